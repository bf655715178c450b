"""Summaries of benchmark results: percentiles, throughput, goodput against SLOs."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from tandem.worker.bench.client import RequestResult

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method); None for no data."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def dist(values: list[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {f"p{q}": percentile(values, q) for q in PERCENTILES}
    out["mean"] = sum(values) / len(values) if values else None
    out["count"] = len(values)
    return out


@dataclass
class Summary:
    requests: int
    completed: int
    failed: int
    duration_s: float
    ttft_s: dict[str, float | None]
    itl_s: dict[str, float | None]
    e2e_s: dict[str, float | None]
    request_throughput: float  # completed requests / s
    output_throughput: float  # generated tokens / s
    prompt_tokens: int
    output_tokens: int
    slo_ttft_s: float | None
    slo_itl_s: float | None
    goodput: float | None  # requests / s meeting every SLO given
    slo_attainment: float | None  # fraction of all requests meeting every SLO given
    errors: list[str]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def meets_slo(r: RequestResult, slo_ttft: float | None, slo_itl: float | None) -> bool:
    """DistServe's per-request criterion: TTFT within its SLO and mean time per output token within its."""
    if not r.ok or r.ttft is None:
        return False
    if slo_ttft is not None and r.ttft > slo_ttft:
        return False
    return not (slo_itl is not None and r.itls and sum(r.itls) / len(r.itls) > slo_itl)


def summarize(results: list[RequestResult], duration: float, slo_ttft: float | None = None,
              slo_itl: float | None = None) -> Summary:
    done = [r for r in results if r.ok]
    duration = max(duration, 1e-9)
    has_slo = slo_ttft is not None or slo_itl is not None
    good = sum(meets_slo(r, slo_ttft, slo_itl) for r in results) if has_slo else None
    errors = sorted({r.error for r in results if r.error})[:10]
    return Summary(
        requests=len(results), completed=len(done), failed=len(results) - len(done), duration_s=duration,
        ttft_s=dist([r.ttft for r in done if r.ttft is not None]),
        itl_s=dist([x for r in done for x in r.itls]),
        e2e_s=dist([r.e2e for r in done if r.e2e is not None]),
        request_throughput=len(done) / duration,
        output_throughput=sum(r.output_tokens for r in done) / duration,
        prompt_tokens=sum(r.prompt_tokens for r in done), output_tokens=sum(r.output_tokens for r in done),
        slo_ttft_s=slo_ttft, slo_itl_s=slo_itl,
        goodput=(good / duration) if good is not None else None,
        slo_attainment=(good / len(results)) if good is not None and results else None,
        errors=errors,
    )
