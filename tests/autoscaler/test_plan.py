"""`tandem plan` through its CLI: sizes, YAML that the resource accepts, clear errors, and a plan
that meets the SLO when the load model simulates it."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import yaml
from click.testing import CliRunner

from tandem.operator.api import DisaggregatedModelSpec
from tandem.operator.capacity_model import SIMULATED_H100_8B
from tandem.worker.cli import main

TRACES = Path("/work/shared/traces")


@pytest.fixture()
def profile(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(SIMULATED_H100_8B.to_dict()))
    return path


def plan(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["plan", *args])
    return result.exit_code, result.output


def test_a_steady_load_gets_both_pools_the_ratio_gpus_and_the_bottleneck(profile: Path) -> None:
    code, out = plan("--profile", str(profile), "--rate", "10", "--isl", "2000", "--osl", "200",
                     "--ttft-ms", "3000", "--itl-ms", "50")
    assert code == 0, out
    lines = dict(line.split(None, 1) for line in out.splitlines() if line.strip())
    assert lines["prefill"].startswith("4 replicas")
    assert lines["decode"].startswith("2 replicas")
    assert lines["GPUs"] == "6"
    assert "12.8 req/s" in lines["goodput"]
    assert lines["bottleneck"].startswith("prefill")


def test_yaml_is_a_spec_fragment_the_resource_accepts(profile: Path) -> None:
    code, out = plan("--profile", str(profile), "--rate", "10", "--isl", "2000", "--osl", "200",
                     "--ttft-ms", "3000", "--itl-ms", "50", "--format", "yaml")
    assert code == 0, out
    fragment = yaml.safe_load(out)["spec"]
    spec = DisaggregatedModelSpec.model_validate({"model": {"name": "m", "source": {"path": "/m"}}, **fragment})
    assert (spec.prefill.replicas, spec.decode.replicas) == (4, 2)
    assert spec.prefill.autoscaling.enabled and spec.prefill.autoscaling.max_replicas >= 4
    assert (spec.slo.ttft_ms, spec.slo.itl_ms) == (3000, 50)
    assert spec.ratio.min_prefill_per_decode <= 2 <= spec.ratio.max_prefill_per_decode


def test_without_a_profile_a_gpu_roofline_estimate_is_used_and_named() -> None:
    code, out = plan("--gpu", "h100", "--params-b", "8", "--rate", "10", "--isl", "2000", "--osl", "200")
    assert code == 0, out
    assert "roofline estimate: h100, 8B" in out


@pytest.mark.parametrize(("args", "message"), [
    (["--rate", "10"], "give --trace, or all of --rate, --isl and --osl"),
    (["--rate", "1", "--isl", "10", "--osl", "10"], "give --profile FILE, or --gpu and --params-b"),
    (["--gpu", "l40s", "--params-b", "70", "--rate", "1", "--isl", "10", "--osl", "10"], "do not fit"),
    (["--gpu", "h100", "--params-b", "8", "--trace", "/nope.csv"], "cannot read trace"),
    (["--gpu", "h100", "--params-b", "8", "--rate", "1", "--isl", "10", "--osl", "10", "--itl-ms", "1"],
     "below one decode step"),
])
def test_bad_input_is_a_clear_error_not_a_traceback(args: list[str], message: str) -> None:
    code, out = plan(*args)
    assert code != 0
    assert message in out and "Traceback" not in out


@pytest.mark.skipif(not TRACES.exists(), reason="the shared traces folder /work/shared/traces is absent")
@pytest.mark.parametrize(("trace", "sim_trace", "scale"), [
    ("mooncake", "mooncake", ["--time-scale", "4", "--length-scale", "0.25"]),
    (str(TRACES / "azure_llm_2023_code.csv"), "azure", ["--time-scale", "2"]),
])
def test_the_plan_for_a_trace_meets_the_slo_when_simulated(load_model: ModuleType, profile: Path, trace: str,
                                                           sim_trace: str, scale: list[str]) -> None:
    code, out = plan("--profile", str(profile), "--trace", trace, *scale, "--ttft-ms", "3000", "--itl-ms", "50",
                     "--format", "yaml")
    assert code == 0, out
    spec = yaml.safe_load(out)["spec"]
    sizes = {"prefill": spec["prefill"]["replicas"], "decode": spec["decode"]["replicas"]}
    args = load_model.build_parser().parse_args(["simulate", "--trace", sim_trace, *scale])
    run = load_model.simulate(args, static=sizes)
    assert run["sloAttainment"] >= 0.99, (sizes, run["sloAttainment"])


def test_a_trace_plan_reports_its_length_quantiles_and_the_prompts_no_replica_count_serves_in_time(
        profile: Path) -> None:
    from tandem.operator.capacity_model import Profile, Slo
    from tandem.worker.commands.plan import Load, quantiles, tail_warnings

    assert quantiles(list(range(1, 101))) == (50.0, 90.0, 99.0)
    code, out = plan("--profile", str(profile), "--trace", "mooncake", "--length-scale", "0.25", "--ttft-ms", "2000",
                     "--itl-ms", "100")
    assert code == 0, out
    line = next(x for x in out.splitlines() if x.startswith("lengths"))
    p50, p90, p99 = (float(v) for v in line.split("p50/p90/p99 ")[1].split(",")[0].split("/"))
    assert p50 <= p90 <= p99
    slow = Profile.from_dict({**json.loads(profile.read_text()), "prefill_tps": p90 / 1.0})  # the p90 prompt: 1 s
    warned = tail_warnings(Load(1.0, p50, 10.0, "test", (p50, p90, p99), (10.0, 10.0, 10.0)), slow, Slo(0.5, 0.1))
    assert len(warned) == 2 and "the p90 prompt" in warned[0] and "at any replica count" in warned[0]
    assert tail_warnings(Load(1.0, p50, 10.0, "test", (p50, p90, p99), (10.0, 10.0, 10.0)), slow, Slo(1e3, 0.1)) == []
    code, given = plan("--profile", str(profile), "--rate", "1", "--isl", "100", "--osl", "10", "--isl-p99", "1e9",
                       "--ttft-ms", "500", "--itl-ms", "100")
    assert code == 0, given
    assert "warning      the p99 prompt (1000000000 tokens)" in given
