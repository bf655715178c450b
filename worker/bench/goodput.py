"""Goodput as DistServe defines it: the highest request rate at which a target share of requests
meets both the TTFT and the mean-ITL SLO. Pure parts: the request mix, attainment, the rate search.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.worker.bench.client import RequestResult
from tandem.worker.bench.stats import meets_slo
from tandem.worker.bench.workload import RequestSpec, TraceRow, arrivals


@dataclass
class Mix:
    """Request lengths to draw from (prompt, output), and how they were obtained, in words."""

    lengths: list[tuple[int, int]]
    description: str

    def requests(self, n: int, rate: float, seed: int) -> list[RequestSpec]:
        """n requests with Poisson arrivals at `rate` req/s, lengths drawn from the mix (same seed, same draw)."""
        rng = random.Random(seed)
        times = arrivals(n, rate, "poisson", rng)
        return [RequestSpec(t, *rng.choice(self.lengths), "goodput") for t in times]


def synthetic_mix(short_prompt: int, long_prompt: int, output: int, long_share: float) -> Mix:
    """Short prompts with `long_share` long ones mixed in, every request `output` tokens long."""
    if not 0 <= long_share <= 1:
        raise ValueError(f"the long-prompt share must be in [0, 1], got {long_share:g}")
    longs = round(20 * long_share)
    lengths = [(long_prompt, output)] * longs + [(short_prompt, output)] * (20 - longs)
    return Mix(lengths, f"synthetic: {long_share:.0%} {long_prompt}-token prompts, the rest {short_prompt}-token, "
                        f"{output} output tokens each")


def trace_mix(rows: list[TraceRow], name: str, median_prompt: int, max_prompt: int, median_output: int,
              max_output: int) -> Mix:
    """A trace's length distribution scaled to this model: medians mapped to the targets, then clamped.

    Prompts and outputs get separate factors: one factor for both (what `tandem bench --trace` does)
    would turn Mooncake's 350-token median output into a handful of tokens at a 100-token median prompt.
    """
    if not rows:
        raise ValueError(f"trace {name} has no rows")
    p_med = statistics.median(r.prompt_tokens for r in rows) or 1
    o_med = statistics.median(r.output_tokens for r in rows) or 1
    p_scale, o_scale = median_prompt / p_med, median_output / o_med
    lengths = [(min(max_prompt, max(4, round(r.prompt_tokens * p_scale))),
                min(max_output, max(2, round(r.output_tokens * o_scale)))) for r in rows]
    clamped = sum(p == max_prompt for p, _ in lengths) / len(lengths)
    return Mix(lengths, f"{name}, {len(rows)} rows: prompts x{p_scale:.3g} (median {p_med:.0f} -> {median_prompt}, "
                        f"<= {max_prompt}: {clamped:.0%} at the cap), outputs x{o_scale:.3g} (median {o_med:.0f} -> "
                        f"{median_output}, in [2, {max_output}])")


def attainment(results: list[RequestResult], planned: int, ttft_s: float, itl_s: float) -> float:
    """Share of the `planned` requests that met both SLOs; one that never finished missed them."""
    if planned <= 0:
        return 0.0
    return sum(meets_slo(r, ttft_s, itl_s) for r in results) / planned


@dataclass
class Probe:
    rate: float
    attainment: float
    note: str = ""  # e.g. why it missed: TTFT / ITL / unfinished counts


@dataclass
class Search:
    goodput: float  # highest rate that met the target (0.0: not even the lowest probed rate)
    probes: list[Probe] = field(default_factory=list)
    bounded: bool = True  # False: even the highest rate tried met the target (goodput is a lower bound)


class RateSearch:
    """Highest rate whose attainment is >= target, one probe at a time: double (or halve) from
    `start` until the answer flips, then bisect geometrically until the bracket is within
    `precision` or the probes run out. Step-wise so a benchmark can interleave several modes'
    searches, spreading the machine's load drift over all of them.

    Attainment is noisy and only roughly monotone in the rate; the answer is the highest passing
    rate actually measured, never an interpolation.
    """

    def __init__(self, start: float, *, target: float = 0.9, max_probes: int = 6, precision: float = 0.2,
                 min_rate: float = 1e-3) -> None:
        if start <= 0 or not math.isfinite(start):
            raise ValueError(f"the starting rate must be a positive number, got {start}")
        self.target, self.max_probes, self.precision, self.min_rate = target, max_probes, precision, min_rate
        self.probes: list[Probe] = []
        self.lo: float | None = None  # highest passing rate
        self.hi: float | None = None  # lowest failing rate
        self._next: float | None = start

    def next_rate(self) -> float | None:
        """The rate to probe next, or None when the search is over."""
        return self._next if len(self.probes) < self.max_probes else None

    def record(self, probe: Probe) -> None:
        self.probes.append(probe)
        if probe.attainment >= self.target:
            self.lo = probe.rate if self.lo is None else max(self.lo, probe.rate)
        else:
            self.hi = probe.rate if self.hi is None else min(self.hi, probe.rate)
        if self.hi is None:
            self._next = probe.rate * 2
        elif self.lo is None:
            self._next = probe.rate / 2 if probe.rate / 2 >= self.min_rate else None
        elif self.hi <= self.lo * (1 + self.precision):
            self._next = None
        else:
            self._next = math.sqrt(self.lo * self.hi)

    def result(self) -> Search:
        return Search(self.lo or 0.0, list(self.probes), self.hi is not None)


def search_max_rate(probe: Callable[[float], Probe], start: float, *, target: float = 0.9,
                    max_probes: int = 6, precision: float = 0.2, min_rate: float = 1e-3) -> Search:
    """RateSearch driven to the end by one probe function."""
    search = RateSearch(start, target=target, max_probes=max_probes, precision=precision, min_rate=min_rate)
    while (rate := search.next_rate()) is not None:
        search.record(probe(rate))
    return search.result()


def miss_reasons(results: list[RequestResult], planned: int, ttft_s: float, itl_s: float) -> str:
    """Why requests missed, counted: unfinished, TTFT over, mean ITL over (a request can be both)."""
    done = [r for r in results if r.ok and r.ttft is not None]
    ttft = sum(r.ttft is not None and r.ttft > ttft_s for r in done)
    itl = sum(bool(r.itls) and sum(r.itls) / len(r.itls) > itl_s for r in done)
    return f"{planned - len(done)} unfinished, {ttft} over TTFT, {itl} over ITL of {planned}"
