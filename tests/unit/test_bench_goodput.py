"""The benchmark's pure parts: load calibration arithmetic, SLOs from single-request latencies,
the goodput rate search, request mixes, and tables that print a starved mode instead of crashing."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import pytest

from tandem.worker.bench.calibration import (
    Capacity,
    long_prompt_interval,
    slo_from_single,
    stalled_gap_share,
)
from tandem.worker.bench.client import RequestResult
from tandem.worker.bench.goodput import (
    Probe,
    attainment,
    miss_reasons,
    search_max_rate,
    synthetic_mix,
    trace_mix,
)
from tandem.worker.bench.report import cell, text_table
from tandem.worker.bench.workload import TraceRow

# The machine of issue 25: a 256-token prefill takes 0.73 s, a decode step 86 ms.
SLOW = Capacity(prompt_tokens=256, prefill_s=0.73, batch=4, decode_step_s=0.086, single_itl_s=0.08,
                short_ttft_s=0.12)


def test_load_is_a_fraction_of_the_measured_prefill_capacity() -> None:
    assert SLOW.prefill_tokens_per_s == pytest.approx(256 / 0.73)
    # 40% of the capacity: one 0.73 s prefill every 1.825 s, on this machine; the fixed 0.75 s of the
    # old default was 97% of it, which starved monolithic decoding.
    assert long_prompt_interval(SLOW, 0.4) == pytest.approx(1.825)
    fast = Capacity(256, 0.32, 4, 0.023, 0.022, 0.03)
    assert long_prompt_interval(fast, 0.4) == pytest.approx(0.8)
    assert long_prompt_interval(SLOW, 1.0) == pytest.approx(0.73)
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="load fraction"):
            long_prompt_interval(SLOW, bad)


def test_stalled_gap_share() -> None:
    # (1.825 - 0.73) / 0.086 + 1 = 13.7 decode steps per long prompt: one in 13.7 gaps is stalled.
    assert stalled_gap_share(SLOW, 1.825) == pytest.approx(1 / ((1.825 - 0.73) / 0.086 + 1))
    assert stalled_gap_share(SLOW, 0.5) == 1.0  # saturated: every gap has a prefill in it


def test_slo_is_a_multiple_of_single_request_latency() -> None:
    slo = slo_from_single(SLOW, 3, 2)
    assert (slo.ttft_s, slo.itl_s) == (pytest.approx(2.19), pytest.approx(0.172))
    assert "3 x 730 ms" in slo.basis and "2 x 86.0 ms (a decode step of 4 streams alone)" in slo.basis
    with pytest.raises(ValueError):
        slo_from_single(SLOW, 0, 2)


def result(ttft: float | None, itls: list[float], ok: bool = True) -> RequestResult:
    return RequestResult("t", ok, 0.0, ttft=ttft, itls=itls)


def test_attainment_counts_unfinished_requests_as_misses() -> None:
    results = [result(0.5, [0.05, 0.05]), result(3.0, [0.05]), result(0.5, [0.1, 0.3]),
               result(None, [], ok=False)]
    # Only the first meets TTFT <= 1 s and mean ITL <= 0.1 s; 6 were planned, 2 never finished.
    assert attainment(results, 6, 1.0, 0.1) == pytest.approx(1 / 6)
    assert attainment([], 0, 1.0, 0.1) == 0.0
    assert miss_reasons(results, 6, 1.0, 0.1) == "3 unfinished, 1 over TTFT, 1 over ITL of 6"


def capacity_probe(limit: float, calls: list[float]):
    def probe(rate: float) -> Probe:
        calls.append(rate)
        return Probe(rate, 1.0 if rate <= limit else 0.5)
    return probe


def test_search_doubles_then_bisects_to_the_highest_passing_rate() -> None:
    calls: list[float] = []
    found = search_max_rate(capacity_probe(3.0, calls), 1.0, max_probes=8, precision=0.1)
    assert calls[:3] == [1.0, 2.0, 4.0]  # doubling until 4 fails, then between 2 and 4
    assert calls[3] == pytest.approx(math.sqrt(8))
    assert 2.7 < found.goodput <= 3.0 and found.bounded
    assert found.goodput == max(p.rate for p in found.probes if p.attainment >= 0.9)


def test_search_halves_when_the_start_fails_and_reports_zero_when_nothing_passes() -> None:
    calls: list[float] = []
    found = search_max_rate(capacity_probe(0.3, calls), 2.0, max_probes=4)
    assert calls[:3] == [2.0, 1.0, 0.5] and found.goodput == pytest.approx(0.25)
    never = search_max_rate(capacity_probe(-1, []), 1.0, max_probes=3)
    assert never.goodput == 0.0 and never.bounded and len(never.probes) == 3


def test_search_that_never_fails_is_marked_a_lower_bound() -> None:
    found = search_max_rate(capacity_probe(1e9, []), 1.0, max_probes=3)
    assert found.goodput == 4.0 and not found.bounded
    with pytest.raises(ValueError):
        search_max_rate(capacity_probe(1, []), 0.0)


def test_mixes() -> None:
    mix = synthetic_mix(32, 256, 64, 0.25)
    assert sorted(set(mix.lengths)) == [(32, 64), (256, 64)]
    assert mix.lengths.count((256, 64)) / len(mix.lengths) == 0.25
    a, b = mix.requests(50, 2.0, seed=7), mix.requests(50, 2.0, seed=7)
    assert [(s.send_at, s.prompt_tokens) for s in a] == [(s.send_at, s.prompt_tokens) for s in b]
    assert 10 < a[-1].send_at < 50  # Poisson at 2 req/s: ~25 s for 50 requests
    with pytest.raises(ValueError):
        synthetic_mix(32, 256, 64, 1.5)
    rows = [TraceRow(0, 7000, 350, []), TraceRow(0, 700, 35, []), TraceRow(0, 70_000, 3500, [])]
    scaled = trace_mix(rows, "t", median_prompt=96, max_prompt=256, median_output=32, max_output=64)
    assert scaled.lengths == [(96, 32), (10, 3), (256, 64)]  # medians mapped, outliers clamped
    assert "33% at the cap" in scaled.description


def test_table_prints_a_starved_mode_instead_of_crashing() -> None:
    columns = [("mode", "mode", ""), ("ITL p50", "itl_p50_ms", ".1f"), ("p99/p50", "ratio", ".1f"),
               ("decode req", "n", "d"), ("status", "status", "")]
    rows = [{"mode": "baseline", "itl_p50_ms": 23.04, "ratio": 1.43, "n": 120, "status": "ok"},
            {"mode": "monolithic", "itl_p50_ms": None, "ratio": None, "n": 0,
             "status": "starved: 0 decode finished"},
            {"mode": "disaggregated", "status": "could not run"}]
    lines = text_table(columns, rows).splitlines()
    assert lines[0].split() == ["mode", "ITL", "p50", "p99/p50", "decode", "req", "status"]
    assert lines[1].split() == ["baseline", "23.0", "1.4", "120", "ok"]
    assert lines[2].split() == ["monolithic", "-", "-", "0", "starved:", "0", "decode", "finished"]
    assert lines[3].split() == ["disaggregated", "-", "-", "-", "could", "not", "run"]
    assert len({len(line.rstrip()) for line in lines[:2]}) == 1  # aligned columns
    assert cell(float("nan"), ".1f") == "-" and cell(True) == "True" and cell(3, "d") == "3"


def test_interleaved_searches_match_one_at_a_time() -> None:
    from tandem.worker.bench.goodput import RateSearch

    searches = {"a": RateSearch(1.0, max_probes=6), "b": RateSearch(1.0, max_probes=6)}
    limits = {"a": 3.0, "b": 0.7}
    order = []
    while any(s.next_rate() is not None for s in searches.values()):
        for name, s in searches.items():
            if (rate := s.next_rate()) is not None:
                order.append(name)
                s.record(Probe(rate, 1.0 if rate <= limits[name] else 0.0))
    assert order[:4] == ["a", "b", "a", "b"]
    for name, s in searches.items():
        alone = search_max_rate(capacity_probe(limits[name], []), 1.0, max_probes=6)
        assert s.result().goodput == alone.goodput and len(s.result().probes) == len(alone.probes)


def test_throughput_bounds_split_against_replicas() -> None:
    from tandem.worker.bench.calibration import throughput_bounds

    fast = Capacity(256, 0.32, 4, 0.024, 0.022, 0.03)  # 800 prompt tokens/s, 6 ms per batched token
    b = throughput_bounds(fast, [(256, 64), (32, 64), (32, 64), (32, 64)])
    assert b.prefill_s == pytest.approx(88 / 800) and b.decode_s == pytest.approx(64 * 0.006)
    assert b.replicas == pytest.approx(2 / (0.11 + 0.384))
    assert b.split == pytest.approx(1 / 0.384) and b.split_bound_by == "decode"
    # Equal costs: the split matches the replicas; otherwise it is always below them.
    even = throughput_bounds(fast, [(256, 53)])
    assert even.split <= even.replicas * 1.0001


def load_script() -> Any:
    path = Path(__file__).resolve().parents[2] / "hack" / "bench_interference.py"
    spec = importlib.util.spec_from_file_location("bench_interference", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_interference_table_of_a_starved_run_prints() -> None:
    """The crash of issue 25: a mode whose decode streams finished nothing had None percentiles and
    the report died on `None:.1f`. The script's own summary and table now print it."""
    bench = load_script()
    long = [RequestResult("bench", True, 0.0, ttft=3.4, itls=[0.01])]
    starved = {**bench.summarize([], long, 0.1, []), "mode": "monolithic", "foreign_cpu_cores": 0.1,
               "loadavg_1m": [1.0, 2.0], "timed_out": True, "decode_unfinished": 4, "long_unfinished": 1}
    starved["status"] = bench.status(starved)
    assert starved["status"] == "starved: 0 decode finished, timed out, 5 unfinished"
    broken = {"mode": "chunked", "error": "worker-0 exited", "status": "could not run"}
    lines = bench.interference_table([starved, broken]).splitlines()
    assert lines[1].split()[:3] == ["monolithic", "-", "-"] and "3400" in lines[1]
    assert lines[1].endswith("starved: 0 decode finished, timed out, 5 unfinished")
    assert lines[2].startswith("chunked") and lines[2].endswith("could not run")


def test_gaps_are_counted_by_when_they_end_not_by_whole_requests() -> None:
    """On a slow machine one 128-token request outlasts the window: its gaps inside still count."""
    bench = load_script()
    long_request = RequestResult("bench", True, 0.0, ttft=1.0, itls=[0.5] * 60)  # gaps end at 1.5 .. 30.5 s
    early = RequestResult("bench", True, 0.0, ttft=0.2, itls=[0.1, 0.1])  # all before the window
    failed = RequestResult("bench", False, 5.0, error="HTTP 500")
    kept, first = bench.in_window([long_request, early, failed], 3.2, 23.2)
    assert [len(r.itls) for r in kept] == [40, 0] and kept[0].ok and not kept[1].ok
    assert first == []  # the long request's first gap ended at 1.5 s, before the window
    kept, first = bench.in_window([long_request], 0.0, 1.8)
    assert first == [0.5] and kept[0].itls == [0.5]
