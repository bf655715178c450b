"""The load model (hack/load_model.py): traces, queue/KV dynamics, exposition, and the closed loop
with the real autoscaler timer body (simulated cluster: pods placed up to capacity, ready after a delay)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tandem.worker import metrics as m

TRACES = Path("/work/shared/traces")


def test_step_trace_is_five_times_the_base_rate_in_the_middle(load_model: ModuleType) -> None:
    trace = load_model.step_trace(base_rps=2, factor=5, before_s=120, during_s=240, after_s=420)
    def count(a: float, b: float) -> int:
        return sum(1 for r in trace if a <= r.arrival_s < b)
    assert count(0, 120) == 240
    assert abs(count(120, 360) - 2400) <= 1
    assert abs(count(360, 780) - 840) <= 1


@pytest.mark.skipif(not TRACES.exists(), reason="the shared traces folder /work/shared/traces is absent")
def test_real_traces_are_time_and_length_scaled(load_model: ModuleType) -> None:
    raw = load_model.load_trace("mooncake")
    fast = load_model.load_trace("mooncake", time_scale=4, length_scale=0.5)
    assert len(raw) == len(fast) == 12031
    assert fast[-1].arrival_s == pytest.approx(raw[-1].arrival_s / 4)
    assert sum(r.prompt for r in fast) == pytest.approx(sum(r.prompt for r in raw) / 2, rel=0.01)
    azure = load_model.load_trace("azure", limit_s=60)
    assert azure and azure[0].arrival_s == 0 and all(r.arrival_s < 60 for r in azure)
    assert all(r.prompt >= 1 and r.output >= 1 for r in azure)


@pytest.mark.skipif(not TRACES.exists(), reason="the shared traces folder /work/shared/traces is absent")
def test_trace_files_of_both_formats_are_read_by_path(load_model: ModuleType) -> None:
    by_name = load_model.load_trace("azure", limit_s=120)
    by_path = load_model.load_trace(str(TRACES / "azure_llm_2023_code.csv"), limit_s=120)
    assert by_path == by_name and len(by_path) > 10
    jsonl = load_model.load_trace(str(TRACES / "mooncake_conversation.jsonl"), limit_s=60)
    assert jsonl == load_model.load_trace("mooncake", limit_s=60) and jsonl[0].prompt == 6758


@pytest.mark.parametrize(("name", "kwargs", "error"), [
    ("nope.jsonl", {}, FileNotFoundError),
    ("step", {"time_scale": 0}, ValueError),
    ("step", {"length_scale": -1}, ValueError),
])
def test_bad_trace_arguments_fail_clearly(load_model: ModuleType, name: str, kwargs: dict[str, float],
                                          error: type[Exception]) -> None:
    with pytest.raises(error):
        load_model.load_trace(name, **kwargs)


def burst(load_model: ModuleType, n: int, prompt: int, output: int) -> list[Any]:
    return [load_model.Request(0.0, prompt, output) for _ in range(n)]


def run(model: Any, seconds: float, ready: dict[str, int], dt: float = 0.5) -> Any:
    t = 0.0
    while t < seconds:
        model.step(t, dt, ready)
        t += dt
    return model.snapshot


def test_an_undersized_prefill_pool_builds_a_queue(load_model: ModuleType) -> None:
    cap = load_model.Capacity(prefill_tps=1000, kv_tokens=10**9)
    model = load_model.LoadModel(burst(load_model, 100, prompt=1000, output=10), cap)
    snap = run(model, 10.0, {"prefill": 2, "decode": 1})
    assert snap.queue_requests == 80, "2 replicas x 1 request/s x 10 s done"
    assert sum(1 for _ in model.waiting) + snap.running + len(model.finished) == 20
    assert model.ttft.counts[-1] == 20
    assert model.quantile("ttft", 0.9, since=0) == pytest.approx(9.0, abs=0.6)
    doubled = load_model.LoadModel(burst(load_model, 100, prompt=1000, output=10), cap)
    assert run(doubled, 10.0, {"prefill": 4, "decode": 1}).queue_requests == 60


@pytest.mark.parametrize(("decode", "running", "ratio"), [(1, 5, 1.0), (3, 10, 20_000 / 30_000), (0, 0, 0.0)])
def test_decode_admits_what_fits_in_kv(load_model: ModuleType, decode: int, running: int, ratio: float) -> None:
    cap = load_model.Capacity(prefill_tps=10**9, kv_tokens=10_000, itl_base_s=10.0)  # nobody finishes
    model = load_model.LoadModel(burst(load_model, 10, prompt=1000, output=1000), cap)
    snap = run(model, 1.0, {"prefill": 10, "decode": decode})
    assert (snap.running, snap.waiting) == (running, 10 - running)
    assert snap.kv_used_ratio == pytest.approx(ratio)


def test_histograms_are_cumulative(load_model: ModuleType) -> None:
    model = load_model.LoadModel(load_model.step_trace(before_s=30, during_s=30, after_s=30),
                                 load_model.Capacity())
    run(model, 95.0, {"prefill": 2, "decode": 2})
    for hist in (model.ttft, model.itl):
        assert hist.counts == sorted(hist.counts) and hist.counts[-1] > 0
    assert len(model.finished) > 0 and model.done


def test_exposition_has_one_series_per_ready_replica_under_the_shared_names(load_model: ModuleType) -> None:
    model = load_model.LoadModel(burst(load_model, 9, prompt=4000, output=10), load_model.Capacity(prefill_tps=100))
    model.step(0.0, 0.5, {"prefill": 3, "decode": 2})
    families = {f.name: f for f in load_model.MetricsCollector(model, "tiny").collect()}
    ready = families[m.WORKER_READY.name].samples
    assert sorted(s.labels["replica"] for s in ready) == ["decode-0", "decode-1", "prefill-0", "prefill-1", "prefill-2"]
    queue = families[m.PREFILL_QUEUE_REQUESTS.name].samples
    assert [s.value for s in queue] == [3.0, 3.0, 3.0]
    assert all(s.labels[m.LABEL_MODEL] == "tiny" and s.labels[m.LABEL_POOL] == "prefill" for s in queue)
    assert len(families[m.KV_USAGE_RATIO.name].samples) == 2
    ttft = families[m.TTFT.name.removesuffix("_seconds") + "_seconds"].samples
    assert any(s.name.endswith("_bucket") and s.labels["le"] == "+Inf" for s in ttft)


@pytest.mark.parametrize(("content", "expected"), [
    ('{"prefill": 3, "decode": 2}', {"prefill": 3, "decode": 2}),
    ('{"prefill": {"ready": 4}}', {"prefill": 4, "decode": 0}),
])
def test_replicas_file(load_model: ModuleType, tmp_path: Path, content: str, expected: dict[str, int]) -> None:
    path = tmp_path / "replicas.json"
    path.write_text(content)
    assert load_model.read_replicas_file(path) == expected


def test_replicas_file_rejects_negative_counts(load_model: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "replicas.json"
    path.write_text('{"prefill": -1}')
    with pytest.raises(ValueError, match="non-negative"):
        load_model.read_replicas_file(path)


def test_sim_cluster_places_up_to_capacity_and_readies_after_startup(load_model: ModuleType) -> None:
    cluster = load_model.SimCluster({"prefill": 3, "decode": 8}, startup_s=30)
    cluster.apply("prefill", 2, now=-30)
    cluster.apply("prefill", 5, now=0)
    assert cluster.placed("prefill") == 3 and cluster.ready("prefill", 10) == 2 and cluster.ready("prefill", 30) == 3
    cluster.apply("prefill", 2, now=5)
    assert cluster.ready("prefill", 5) == 2, "the not-ready pod goes first"


# --------------------------------------------------------------------------- closed loop

def simulate(load_model: ModuleType, *argv: str) -> dict[str, Any]:
    args = load_model.build_parser().parse_args(["simulate", *argv])
    return load_model.simulate(args)  # type: ignore[no-any-return]


def assert_invariants(run: dict[str, Any], max_replicas: int, band: tuple[float, float],
                      capacity: dict[str, int]) -> None:
    for point in run["timeline"]:
        d, placed = point["desired"], point["placed"]
        assert all(v <= max_replicas for v in d.values()), point
        assert band[0] * d["decode"] <= d["prefill"] <= band[1] * d["decode"], point
        assert all(placed[r] <= capacity[r] for r in placed), point


def test_five_x_step_up_then_down(load_model: ModuleType) -> None:
    run = simulate(load_model, "--trace", "step", "--interval", "15", "--startup", "30",
                   "--down-window", "300", "--max-replicas", "24", "--min-ratio", "0.25", "--max-ratio", "4")
    tl = run["timeline"]
    assert_invariants(run, 24, (0.25, 4.0), {"prefill": 32, "decode": 64})
    before = next(p for p in tl if p["t"] == 105.0)["desired"]["prefill"]
    # The step starts at 120 s: scaled up within two intervals.
    assert any(p["desired"]["prefill"] > before for p in tl if 120 <= p["t"] <= 150), tl[6:12]
    ups = [p["t"] for p, q in itertools.pairwise(tl) if q["desired"]["prefill"] > p["desired"]["prefill"]]
    downs = [q["t"] for p, q in itertools.pairwise(tl) if q["desired"]["prefill"] < p["desired"]["prefill"]]
    assert downs, "scaled back down after the step"
    assert downs[0] - ups[-1] >= 300 - 15, "not before the scale-down window"
    assert tl[-1]["desired"]["prefill"] == before, "back to the base size"
    assert run["finished"] == run["requests"]


def test_pool_capacity_is_never_exceeded_for_long(load_model: ModuleType) -> None:
    run = simulate(load_model, "--trace", "step", "--capacity-prefill", "4", "--max-replicas", "24")
    tl = run["timeline"]
    assert_invariants(run, 24, (0.25, 4.0), {"prefill": 4, "decode": 64})
    over = [p["t"] for p in tl if p["desired"]["prefill"] > 4]
    assert over, "the load wanted more than 4 prefill pods"
    backs = [p["t"] for p in tl if "ScaledBackUnschedulable" in p["events"]]
    assert backs, "pods that could not be placed were given back"
    # Each attempt beyond capacity is undone at the next tick, then no retry for the 300 s backoff.
    assert len(over) <= 1 + (tl[-1]["t"] - over[0]) // 300
    for t in over:
        assert any(b == t + 15 for b in backs), (t, backs)


@pytest.mark.skipif(not TRACES.exists(), reason="the shared traces folder /work/shared/traces is absent")
def test_mooncake_replay_time_compressed(load_model: ModuleType) -> None:
    # The first 20 minutes of the Mooncake trace, 4x faster (5 simulated minutes), prompts and
    # outputs scaled to a quarter.
    run = simulate(load_model, "--trace", "mooncake", "--time-scale", "4", "--length-scale", "0.25",
                   "--limit", "300", "--max-replicas", "16", "--capacity-prefill", "12")
    assert_invariants(run, 16, (0.25, 4.0), {"prefill": 12, "decode": 64})
    assert max(p["desired"]["prefill"] for p in run["timeline"]) > 1, "the replay needed more than one"
    assert run["finished"] == run["requests"]


def test_cli_prints_the_comparison_and_writes_json(load_model: ModuleType, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim.json"
    load_model.main(["simulate", "--trace", "step", "--json", str(out)])
    table = capsys.readouterr().out
    modes = ["static at peak", "cheapest static >= 99%", "HPA (queue, KV)", "current policy", "predictive",
             "oracle (45 s ahead)"]
    assert all(mode in table for mode in modes), table
    runs = {r["mode"]: r for r in json.loads(out.read_text())["runs"]}
    assert list(runs) == modes

    def cost(mode: str) -> int:
        return sum(runs[mode]["replicaSeconds"].values())  # type: ignore[no-any-return]

    # Static at peak is the plan for the step's top (10 req/s of 2,000/200 tokens): 4/2, meets the SLO.
    assert runs["static at peak"]["peak"] == {"prefill": 4, "decode": 2}
    assert runs["static at peak"]["sloAttainment"] >= 0.99
    cheapest = runs["cheapest static >= 99%"]
    assert cheapest["sloAttainment"] >= 0.99 and cost("cheapest static >= 99%") <= cost("static at peak")
    # The predictive policy spends less than the reactive one and the HPA, and loses no more SLO.
    assert cost("predictive") < cost("current policy") < cost("HPA (queue, KV)")
    assert runs["predictive"]["sloAttainment"] >= runs["current policy"]["sloAttainment"]
    # With one pod start of foresight the same sizing meets the goal: the gap is the reaction time.
    assert runs["oracle (45 s ahead)"]["sloAttainment"] >= 0.99
    assert cost("oracle (45 s ahead)") < cost("cheapest static >= 99%")
