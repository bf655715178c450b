"""Capacity model: how many prefill and decode replicas a load needs to meet its SLOs.

Pure arithmetic over a worker `Profile` (what one replica does), shared by `tandem plan` (sizing
ahead of time) and the predictive policy (sizing from measured rates each tick). The same model
as hack/load_model.py: prefill ingests `prefill_tps` prompt tokens/s per replica; decode holds
prompt+output tokens of KV per running request and generates at
ITL = itl_base_s + itl_per_seq_s x (running requests per replica).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any


class CapacityError(ValueError):
    """A profile or load that cannot be sized (bad numbers, or no size meets the SLO)."""


# Keys a profile file may hold beside the Profile's fields, which reading it skips: what `tandem profile`
# measured (its raw tables and fits) and how (model, device, dtype, date, version, command). Any other
# key is still refused, so a misspelt field cannot fall back to its default without a word.
INFORMATIONAL_KEYS = frozenset({"metadata", "measurements"})


@dataclass(frozen=True)
class Profile:
    """What one replica of a model does on one kind of GPU (measured, or a roofline estimate)."""

    prefill_tps: float  # prompt tokens/s one prefill replica ingests
    kv_tokens: float  # KV-cache tokens one decode replica holds
    itl_base_s: float  # decode step time at batch 1
    itl_per_seq_s: float  # added step time per running request on the replica
    startup_s: float = 30.0  # pod placement to ready
    gpus_per_replica: int = 1
    source: str = "unspecified"  # how the numbers were obtained

    def __post_init__(self) -> None:
        for name in ("prefill_tps", "kv_tokens", "itl_base_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise CapacityError(f"profile {name} must be a positive number (got {value})")
        for name in ("itl_per_seq_s", "startup_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise CapacityError(f"profile {name} must be a non-negative number (got {value})")
        if self.gpus_per_replica < 1:
            raise CapacityError(f"gpus_per_replica must be at least 1 (got {self.gpus_per_replica})")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> Profile:
        known = {f.name for f in fields(Profile)}
        unknown = sorted(set(data) - known - INFORMATIONAL_KEYS)
        if unknown:
            raise CapacityError(f"unknown profile fields {unknown}; expected some of {sorted(known)} "
                                f"(and, not read, {sorted(INFORMATIONAL_KEYS)})")
        try:
            return Profile(**{key: value for key, value in data.items() if key in known})
        except TypeError as exc:
            raise CapacityError(f"incomplete profile: {exc}") from None

    @staticmethod
    def load(path: Path) -> Profile:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CapacityError(f"cannot read profile {path}: {exc}") from None
        if not isinstance(data, dict):
            raise CapacityError(f"profile {path} is not a JSON object")
        return Profile.from_dict(data)


# The load model's default replica (hack/load_model.py Capacity): an H100-class replica of an
# 8B model, roughly. A model, not a measurement.
SIMULATED_H100_8B = Profile(8000.0, 160_000.0, 0.015, 0.0004, 30.0, 1, "hack/load_model.py defaults")


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    itl_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.itl_s > 0):
            raise CapacityError(f"SLOs must be positive (got TTFT {self.ttft_s} s, ITL {self.itl_s} s)")


# Prefill runs at most this busy in steady state: request sizes vary, and a queue near 100%
# utilisation waits without bound (M/G/1).
PREFILL_MAX_UTILIZATION = 0.8
# Decode KV is filled at most this far: requests are admitted whole and leave whole.
DECODE_MAX_KV = 0.6


def prefill_replicas(prompt_tps: float, profile: Profile, slo: Slo, *, backlog_tokens: float = 0.0,
                     mean_prompt: float = 0.0, utilization: float = PREFILL_MAX_UTILIZATION,
                     drain_s: float | None = None) -> int:
    """Fewest prefill replicas that keep up with `prompt_tps` at `utilization` and clear
    `backlog_tokens` within `drain_s` (default: the pod start time, the soonest new pods help)."""
    if prompt_tps < 0 or backlog_tokens < 0:
        raise CapacityError("load must be non-negative")
    need = prompt_tps / (profile.prefill_tps * utilization)
    if backlog_tokens > 0:
        drain = max(drain_s if drain_s is not None else profile.startup_s, slo.ttft_s)
        need = max(need, (prompt_tps + backlog_tokens / drain) / profile.prefill_tps)
    return max(1, math.ceil(need - 1e-9))


@dataclass(frozen=True)
class DecodeLoad:
    running: float  # requests decoding across the pool (Little's law: rate x output x ITL)
    itl_s: float
    kv_fill: float  # KV used / KV held


def decode_load(request_rate: float, mean_prompt: float, mean_output: float, replicas: int,
                profile: Profile) -> DecodeLoad:
    """Steady state of `replicas` decode replicas: running requests solve N = rate x output x ITL(N)."""
    per_seq = profile.itl_per_seq_s / replicas
    denom = 1 - request_rate * mean_output * per_seq
    if denom <= 0:
        return DecodeLoad(math.inf, math.inf, math.inf)
    running = request_rate * mean_output * profile.itl_base_s / denom
    itl = profile.itl_base_s + per_seq * running
    return DecodeLoad(running, itl, running * (mean_prompt + mean_output) / (replicas * profile.kv_tokens))


def decode_replicas(request_rate: float, mean_prompt: float, mean_output: float, profile: Profile, slo: Slo,
                    *, extra_kv_tokens: float = 0.0, max_kv: float = DECODE_MAX_KV,
                    limit: int = 10_000) -> int:
    """Fewest decode replicas whose steady state meets the ITL SLO within `max_kv` of the KV cache
    (plus `extra_kv_tokens` waiting for admission)."""
    if profile.itl_base_s >= slo.itl_s:
        raise CapacityError(f"the ITL SLO ({slo.itl_s * 1000:g} ms) is below one decode step at batch 1 "
                            f"({profile.itl_base_s * 1000:g} ms): no replica count meets it")
    for d in range(1, limit + 1):
        load = decode_load(request_rate, mean_prompt, mean_output, d, profile)
        kv = load.kv_fill + extra_kv_tokens / (d * profile.kv_tokens)
        if load.itl_s <= slo.itl_s and kv <= max_kv:
            return d
    raise CapacityError(f"more than {limit} decode replicas needed")


@dataclass(frozen=True)
class PoolPlan:
    """Replica counts for one load, and what limits them."""

    prefill: int
    decode: int
    gpus: int
    prefill_utilization: float
    decode_itl_s: float
    decode_kv_fill: float
    bottleneck: str
    goodput_rps: float  # requests/s this size serves within the SLOs in steady state

    def ratio(self) -> float:
        return self.prefill / self.decode


def plan(request_rate: float, mean_prompt: float, mean_output: float, profile: Profile, slo: Slo) -> PoolPlan:
    """Pool sizes for a steady load of `request_rate` requests/s of the given mean lengths."""
    if request_rate <= 0 or mean_prompt <= 0 or mean_output <= 0:
        raise CapacityError("request rate and mean lengths must be positive")
    if mean_prompt / profile.prefill_tps >= slo.ttft_s:
        raise CapacityError(f"one mean prompt takes {mean_prompt / profile.prefill_tps:.2f} s to prefill, "
                            f"more than the TTFT SLO ({slo.ttft_s:g} s): no replica count meets it")
    p = prefill_replicas(request_rate * mean_prompt, profile, slo, mean_prompt=mean_prompt)
    d = decode_replicas(request_rate, mean_prompt, mean_output, profile, slo)
    load = decode_load(request_rate, mean_prompt, mean_output, d, profile)
    util = request_rate * mean_prompt / (p * profile.prefill_tps)
    # Goodput: the rate at which the first pool runs out (prefill at its utilization cap, decode
    # at the ITL SLO or the KV cap), sizes held.
    prefill_max = p * profile.prefill_tps * PREFILL_MAX_UTILIZATION / mean_prompt
    decode_max = _decode_max_rate(d, mean_prompt, mean_output, profile, slo)
    bottleneck = "prefill (prompt tokens/s)" if prefill_max <= decode_max else _decode_limit(
        decode_max, d, mean_prompt, mean_output, profile, slo)
    return PoolPlan(p, d, (p + d) * profile.gpus_per_replica, util, load.itl_s, load.kv_fill, bottleneck,
                    min(prefill_max, decode_max))


def _decode_max_rate(d: int, mean_prompt: float, mean_output: float, profile: Profile, slo: Slo) -> float:
    lo, hi = 0.0, 1.0
    while _decode_ok(hi, d, mean_prompt, mean_output, profile, slo):
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _decode_ok(mid, d, mean_prompt, mean_output, profile, slo) else (lo, mid)
    return lo


def _decode_ok(rate: float, d: int, mean_prompt: float, mean_output: float, profile: Profile, slo: Slo) -> bool:
    load = decode_load(rate, mean_prompt, mean_output, d, profile)
    return load.itl_s <= slo.itl_s and load.kv_fill <= DECODE_MAX_KV


def _decode_limit(rate: float, d: int, mean_prompt: float, mean_output: float, profile: Profile, slo: Slo) -> str:
    load = decode_load(rate * 1.01, mean_prompt, mean_output, d, profile)
    return "decode ITL" if load.itl_s > slo.itl_s else "decode KV-cache memory"
