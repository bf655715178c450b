"""Load sized from what this machine does with this model, not in absolute terms.

A fixed load (a 256-token prompt every 0.75 s) is light on one machine and saturates a machine
three times slower, which then measures the machine instead of the design. The benchmark first
measures the monolithic worker (prefill time of the long prompt, decode step time at the batch it
will run) and sizes the interfering load as a fraction of that worker's prefill capacity.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Capacity:
    """What one monolithic worker measured alone (seconds)."""

    prompt_tokens: int  # the long prompt's length
    prefill_s: float  # TTFT of that prompt alone: one prefill plus the HTTP path
    batch: int  # decode streams running together
    decode_step_s: float  # median inter-token gap with `batch` streams and nothing else
    single_itl_s: float  # median inter-token gap of one stream alone
    short_ttft_s: float  # TTFT of a short prompt alone (the request path without much prefill)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "prefill_tokens_per_s": self.prefill_tokens_per_s}


def check_fraction(fraction: float) -> float:
    if not 0 < fraction <= 1:
        raise ValueError(f"a load fraction must be in (0, 1], got {fraction:g}")
    return fraction


def long_prompt_interval(cap: Capacity, fraction: float) -> float:
    """Seconds between long prompts so they take `fraction` of the monolithic worker's prefill capacity.

    A prompt needing `prefill_s` every `prefill_s / fraction` seconds keeps that worker busy with
    prefill for `fraction` of its time; the rest is left for decoding.
    """
    return cap.prefill_s / check_fraction(fraction)


def stalled_gap_share(cap: Capacity, interval_s: float) -> float:
    """Share of a monolithic stream's decode gaps that a long prefill lands in (one per long prompt).

    p99 sees the stalls only when this is above 1%; the interval is set by the fraction, so this is
    reported so a reader can tell whether a flat p99 means "no interference" or "too few stalls".
    """
    steps_per_interval = max(1.0, (interval_s - cap.prefill_s) / cap.decode_step_s + 1)
    return 1.0 / steps_per_interval


@dataclass
class Slo:
    ttft_s: float
    itl_s: float
    ttft_scale: float
    itl_scale: float
    basis: str  # which single-request latencies they are multiples of, in words


def slo_from_single(cap: Capacity, ttft_scale: float, itl_scale: float) -> Slo:
    """DistServe's way: SLOs as multiples of latencies measured on this machine without contention.

    TTFT is scaled from the long prompt's prefill alone (the longest prompt the mix sends), ITL from
    the decode step at the calibration batch (`cap.batch` streams, nothing else running): a step
    of one stream alone would make a batched decode miss the SLO on a CPU, where a step's time
    grows with the batch, and then no mode has any goodput to compare.
    """
    if ttft_scale <= 0 or itl_scale <= 0:
        raise ValueError("SLO scales must be positive")
    return Slo(ttft_scale * cap.prefill_s, itl_scale * cap.decode_step_s, ttft_scale, itl_scale,
               f"TTFT <= {ttft_scale:g} x {cap.prefill_s * 1000:.0f} ms (a {cap.prompt_tokens}-token prompt alone), "
               f"mean ITL <= {itl_scale:g} x {cap.decode_step_s * 1000:.1f} ms (a decode step of {cap.batch} "
               f"streams alone)")


@dataclass
class Bounds:
    """Throughput ceilings (req/s) from the calibration, before any SLO: what each setup could at best
    sustain if every device were busy all the time. Goodput can only be lower."""

    prefill_s: float  # prefill work per request (mean over the mix)
    decode_s: float  # decode work per request at the calibration batch
    replicas: float  # n replicas on n devices: n / (prefill + decode)
    split: float  # 1 prefill + 1 decode device: the slower pool, min(1 / prefill, 1 / decode)
    split_bound_by: str  # "prefill" or "decode"


def throughput_bounds(cap: Capacity, lengths: list[tuple[int, int]], devices: int = 2) -> Bounds:
    """Prefill cost linear in prompt tokens at the measured rate; decode cost per token the calibrated
    step divided by its batch (a larger batch may amortize more, so the decode side is a rough bound).

    A replica does both jobs on its device; the 1:1 split gives each job one device. The split can
    only match replicas in throughput when the two jobs cost the same; it wins goodput only where
    interference, not capacity, limits the replicas.
    """
    prefill = sum(p for p, _ in lengths) / len(lengths) / cap.prefill_tokens_per_s
    decode = sum(o for _, o in lengths) / len(lengths) * cap.decode_step_s / cap.batch
    return Bounds(prefill, decode, devices / (prefill + decode), min(1 / prefill, 1 / decode),
                  "prefill" if prefill >= decode else "decode")
