"""`tandem profile`: a real worker measured into a profile that `tandem plan` sizes with.

The slow tests run the command as a user would (its own process), against a `tandem worker` it starts
(--model) or one the test starts (--url), with the smallest bounds: a few seconds of measurement on the
tiny random model. The rest: the fits and the steady-window arithmetic, clear errors, and the profile
the repository ships (deploy/profiles/tiny-cpu.json).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from tandem.operator.capacity_model import CapacityError, Profile
from tandem.worker.cli import main
from tandem.worker.commands.profile import Stream, itl_fit, itl_fit_with_context, steady_window
from tandem.worker.server import control_token
from tandem.worker.server.ports import free_port

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "deploy" / "profiles" / "tiny-cpu.json"
# 16 decode tokens: enough for a steady window (every stream decoding) of a few gaps on a busy machine.
SMALLEST = ["--prompt-lengths", "16,64", "--batch-sizes", "1,2", "--contexts", "32", "--decode-tokens", "16",
            "--repeats", "1"]


def tandem(*args: str, timeout: float = 110, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tandem.worker.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


def plan_output(profile: Path) -> str:
    result = CliRunner().invoke(main, ["plan", "--profile", str(profile), "--rate", "2", "--isl", "200", "--osl", "20",
                                       "--ttft-ms", "10000", "--itl-ms", "1000"])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tandem.worker.model.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("profile") / "tiny")


@pytest.mark.integration
@pytest.mark.slow
def test_a_started_worker_is_measured_into_a_profile_that_plan_reads(tiny_model: Path, tmp_path: Path) -> None:
    out, logs = tmp_path / "profile.json", tmp_path / "logs"
    start = time.monotonic()
    run = tandem("profile", "--model", str(tiny_model), "--device", "cpu", "--out", str(out), "--log-dir", str(logs),
                 *SMALLEST)
    took = time.monotonic() - start
    assert run.returncode == 0, run.stderr[-3000:]
    assert "[tandem profile] prefill" in run.stderr and "[tandem profile] decode" in run.stderr  # progress on stderr
    assert "Traceback" not in run.stderr
    profile = Profile.load(out)
    doc = json.loads(out.read_text())
    assert profile.prefill_tps > 0 and profile.itl_base_s > 0 and profile.itl_per_seq_s >= 0
    # The KV capacity is the worker's own: its log says how many blocks it allocated.
    blocks = int(re.search(r"(\d+) KV blocks", (logs / "worker.log").read_text()).group(1))  # type: ignore[union-attr]
    kv = doc["measurements"]["kv"]
    assert profile.kv_tokens == blocks * kv["block_size"] == kv["blocks"] * kv["block_size"]
    assert kv["metrics_total_blocks"] == blocks  # /metrics agrees with /info
    # Startup was measured: process start to /ready, within this test's run.
    assert 0 < profile.startup_s == doc["measurements"]["startup"]["measured_s"] < took
    # The raw tables hold every cell asked for.
    decode = doc["measurements"]["decode"]
    assert sorted(c["batch"] for c in decode) == [1, 2]
    assert all(c["context_tokens"] == 32 and (c["itl_s"] or 0) > 0 for c in decode), decode
    assert {(c["prompt_tokens"], c["batch"]) for c in doc["measurements"]["prefill"]} == {(16, 1), (16, 2), (64, 1),
                                                                                          (64, 2)}
    saturated = next(c for c in doc["measurements"]["prefill"] if (c["prompt_tokens"], c["batch"]) == (64, 2))
    assert profile.prefill_tps == saturated["tokens_per_s"]
    assert [f["context_tokens"] for f in doc["measurements"]["itl_fits"]] == [32]
    meta = doc["metadata"]
    assert meta["device"] == "cpu" and meta["dtype"] == "float32" and meta["command"].startswith("tandem profile")
    assert meta["tandem_version"] and meta["date"] and meta["worker"]["role"] == "both"
    assert any("noisy" in note for note in meta["notes"])
    assert "tiny on" in profile.source
    out_text = plan_output(out)
    assert "prefill" in out_text and "replicas" in out_text and profile.source in out_text
    assert took < 100, f"the smallest profile took {took:.0f} s"


@pytest.fixture()
def running_worker(tiny_model: Path, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    token_file = control_token.write_private(tmp_path / "token", control_token.generate())
    port = free_port()
    log = (tmp_path / "worker.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "tandem.worker.cli", "worker", "--model", str(tiny_model),
                             "--device", "cpu", "--port", str(port), "--kv-port", str(free_port()),
                             "--control-token-file", str(token_file), "--kv-cache-bytes", str(4 << 20)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, (tmp_path / "worker.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the worker did not become ready"
            try:
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield url, token_file
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


@pytest.mark.integration
@pytest.mark.slow
def test_a_running_worker_is_measured_over_its_url(running_worker: tuple[str, Path], tmp_path: Path) -> None:
    url, token_file = running_worker
    # Without the worker's control token (the test session sets one in the environment): a clear error,
    # nothing written.
    no_token = {k: v for k, v in os.environ.items() if k not in (control_token.ENV_TOKEN, control_token.ENV_TOKEN_FILE)}
    refused = tandem("profile", "--url", url, "--out", str(tmp_path / "no.json"), *SMALLEST, timeout=60, env=no_token)
    assert refused.returncode != 0 and "wants a control token" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "no.json").exists()

    out = tmp_path / "url.json"
    run = tandem("profile", "--url", url, "--control-token-file", str(token_file), "--out", str(out), *SMALLEST,
                 "--startup-s", "45")
    assert run.returncode == 0, run.stderr[-3000:]
    profile = Profile.load(out)
    doc = json.loads(out.read_text())
    assert profile.kv_tokens == (4 << 20) // 512  # --kv-cache-bytes over the tiny model's 512 KV bytes per token
    assert profile.kv_tokens == doc["measurements"]["kv"]["blocks"] * doc["measurements"]["kv"]["block_size"]
    # Nothing started: the startup time is the one given, and the file says it was not measured.
    assert profile.startup_s == 45 and doc["measurements"]["startup"]["measured_s"] is None
    assert "not measured" in doc["measurements"]["startup"]["how"]
    assert doc["metadata"]["url"] == url and "startup_s was not measured (--url)" in doc["metadata"]["notes"]
    assert sorted(c["batch"] for c in doc["measurements"]["decode"]) == [1, 2]
    assert "replicas" in plan_output(out)


@pytest.mark.parametrize(("args", "message"), [
    (["--url", f"http://127.0.0.1:{free_port()}"], "cannot reach the worker at"),
    (["--model", "/nonexistent/model-folder"], "is not a folder"),
    (["--model", "no-such-model-folder-here"], "is not a model folder"),
    (["--model", "tiny", "--url", "http://127.0.0.1:1"], "not both"),
    ([], "give --model DIR|tiny"),
    (["--model", "tiny", "--batch-sizes", "0,4"], "each at least 1"),
    (["--model", "tiny", "--contexts", "a,b"], "comma-separated list"),
])
def test_bad_input_is_a_clear_error_and_a_failure_not_a_traceback(args: list[str], message: str,
                                                                  tmp_path: Path) -> None:
    run = tandem("profile", *args, "--out", str(tmp_path / "p.json"), timeout=60)
    assert run.returncode != 0
    assert message in run.stderr, run.stderr
    assert "Traceback" not in run.stderr + run.stdout
    assert not (tmp_path / "p.json").exists()


def test_a_profile_file_may_carry_metadata_and_measurements_but_no_other_unknown_key() -> None:
    fields = {"prefill_tps": 1000.0, "kv_tokens": 5000.0, "itl_base_s": 0.01, "itl_per_seq_s": 0.001}
    assert Profile.from_dict({**fields, "metadata": {"a": 1}, "measurements": {"prefill": []}}) == Profile(**fields)
    with pytest.raises(CapacityError, match="unknown profile fields"):
        Profile.from_dict({**fields, "itl_base": 0.01})


def stream(*times: float) -> Stream:
    return Stream(0.0, [(t, 1) for t in times])


def test_decode_itl_is_taken_only_while_every_stream_decodes() -> None:
    # The second stream's first token at 2.0 ends its prefill; the first stream ends at 5.0.
    a = stream(1.0, 2.0, 3.0, 4.0, 5.0)
    b = stream(2.0, 3.0, 4.0, 6.0, 9.0)
    window = steady_window([a, b])
    assert window.gaps == [1.0, 1.0, 1.0, 1.0, 1.0]
    assert (window.span_s, window.tokens) == (5.0, 5)
    assert steady_window([a, stream(1.0)]).tokens == 0
    two_tokens = Stream(0.0, [(1.0, 1), (3.0, 2)])  # a chunk of two tokens: one gap of 1 s per token
    assert steady_window([two_tokens]).gaps == [1.0] and steady_window([two_tokens]).tokens == 2
    # Tokens that reached the client bunched (it was descheduled, then read three lines at once): the
    # single gaps' median says 1 ms, the window's span over its tokens the pace of 1 s.
    bunched = steady_window([stream(0.0, 1.0, 3.998, 3.999, 4.0)])
    assert bunched.span_s / bunched.tokens == pytest.approx(1.0)


def test_itl_fits_give_a_valid_profile_line() -> None:
    fit = itl_fit([(1, 0.011), (4, 0.014), (16, 0.026)])
    assert fit["base_s"] == pytest.approx(0.010) and fit["per_seq_s"] == pytest.approx(0.001)
    flat = itl_fit([(1, 0.012), (4, 0.010)])  # noise: a negative slope is taken as none
    assert flat["per_seq_s"] == 0 and flat["base_s"] == pytest.approx(0.011) and flat["notes"]
    steep = itl_fit([(1, 0.001), (2, 0.004)])  # a negative intercept: the base stays positive
    assert steep["base_s"] > 0 and steep["per_seq_s"] > 0 and steep["notes"]
    assert itl_fit([(4, 0.02)]) == {"base_s": 0.02, "per_seq_s": 0.0, "points": 1, "max_relative_error": 0.0}
    cells = [(b, c, 0.01 + 0.0005 * b + 1e-6 * b * c) for b in (1, 4, 16) for c in (100, 1000)]
    with_context = itl_fit_with_context(cells)
    assert with_context is not None
    assert with_context["base_s"] == pytest.approx(0.01)
    assert with_context["per_seq_s"] == pytest.approx(0.0005)
    assert with_context["per_seq_per_context_token_s"] == pytest.approx(1e-6)
    assert itl_fit_with_context([(b, 100, 0.01 * b) for b in (1, 4)]) is None  # one context: undetermined


def test_the_shipped_cpu_profile_of_the_tiny_model_plans_and_says_what_it_is() -> None:
    profile = Profile.load(SHIPPED)
    doc = json.loads(SHIPPED.read_text())
    assert profile.kv_tokens == doc["measurements"]["kv"]["tokens"] > 0
    assert doc["metadata"]["device"] == "cpu" and doc["metadata"]["model"]["name"] == "tiny"
    assert any("noisy" in note for note in doc["metadata"]["notes"])
    assert doc["measurements"]["startup"]["measured_s"] == profile.startup_s
    out = plan_output(SHIPPED)
    assert profile.source in out and "decode" in out and "GPUs" in out
