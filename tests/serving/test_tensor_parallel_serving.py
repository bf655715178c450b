"""Tensor-parallel workers behind `tandem serve` (issue 22): same tokens as transformers, a dead rank
takes its worker down cleanly and the router migrates the stream.

Real stacks (tests/serving/conftest.py): every worker runs 2 ranks, 2 processes on gloo (the CPU
stands in for the GPUs; NCCL needs the GPU machine). Only monolithic and chunked modes: the KV
transfer between tensor-parallel workers is not built, and the CLI says so (tested below).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tandem.worker.server.ports import free_port

from .conftest import Stack, control_headers, metric_value

pytestmark = pytest.mark.integration

PROMPTS = [[5, 9, 13, 2, 77, 31], [120, 4, 4, 9], list(range(40, 90))]  # the last spans several 16-token chunks


def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)


def greedy_ids(stack: Stack, prompt: list[int], n: int, on_token: Callable[[int], None] | None = None) -> list[int]:
    ids: list[int] = []
    for chunk in client(stack).completions.create(
            model="tiny", prompt=prompt, max_tokens=n, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True}):
        for choice in chunk.choices:
            ids += choice.model_extra["token_ids"]
            if on_token:
                on_token(len(ids))
    return ids


def followers(pid: int) -> list[int]:
    """The worker's tensor-parallel rank processes (multiprocessing spawns them as its children)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text(errors="replace")]


def pid_gone(pid: int, timeout: float) -> bool:
    limit = time.monotonic() + timeout
    while time.monotonic() < limit:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def chunked(start_stack: Callable[..., Stack]) -> Stack:
    return start_stack("--mode", "chunked", "--decode-workers", "1", "--tensor-parallel-size", "2",
                       "--max-num-batched-tokens", "16")


@pytest.fixture(scope="module")
def mono_tp(start_stack: Callable[..., Stack]) -> Stack:
    return start_stack("--mode", "monolithic", "--decode-workers", "2", "--tensor-parallel-size", "2")


def test_a_chunked_tensor_parallel_worker_answers_with_transformers_tokens(
        chunked: Stack, hf_greedy: Callable[[list[int], int], list[int]]) -> None:
    worker = chunked.procs("both")[0]
    assert len(followers(worker["pid"])) == 1, "a worker of 2 ranks runs one follower process"
    for prompt in PROMPTS:
        assert greedy_ids(chunked, prompt, 12) == hf_greedy(prompt, 12), f"prompt {prompt}"
    # Concurrent requests share the ranks' steps.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: greedy_ids(chunked, p, 12), PROMPTS))
    assert answers == [hf_greedy(p, 12) for p in PROMPTS]


def test_a_dead_rank_ends_its_worker_and_the_stream_migrates(
        mono_tp: Stack, hf_greedy: Callable[[list[int], int], list[int]]) -> None:
    prompt, n = PROMPTS[0], 120
    reference = hf_greedy(prompt, n)
    assert greedy_ids(mono_tp, prompt, n) == reference
    workers = {p["url"]: p for p in mono_tp.procs("both")}
    killed: list[tuple[dict, int]] = []

    def kill_a_busy_rank(count: int) -> None:
        if count != 20 or killed:
            return
        for url, proc in workers.items():
            if httpx.get(f"{url}/info", headers=control_headers(), timeout=5).json()["stats"]["num_running"] > 0:
                rank1 = followers(proc["pid"])[0]
                os.kill(rank1, signal.SIGKILL)
                killed.append((proc, rank1))
                return

    assert greedy_ids(mono_tp, prompt, n, kill_a_busy_rank) == reference
    assert killed, "no worker was running the request when 20 tokens had arrived"
    proc, rank1 = killed[0]
    assert pid_gone(proc["pid"], 30), "the worker whose rank died must exit (its pod restarts)"
    log = Path(proc["log_path"]).read_text()
    assert f"tensor-parallel rank 1 (pid {rank1}) was killed by SIGKILL" in log, log[-2000:]
    assert metric_value(mono_tp.url, "tandem_migrations_total") == 1
    assert re.search(rf"{proc['name']} exited \(code 1\)", mono_tp.log.read_text()), "tandem serve reports the exit"
    # The other worker serves on; its ranks were not touched.
    other = next(p for p in workers.values() if p is not proc)
    assert len(followers(other["pid"])) == 1
    assert greedy_ids(mono_tp, PROMPTS[1], 8) == hf_greedy(PROMPTS[1], 8)
    # tandem serve starts the worker again, on the same port, with its ranks; the router takes it back.
    limit = time.monotonic() + 60
    while time.monotonic() < limit:
        usable = {w["url"] for w in httpx.get(f"{mono_tp.url}/workers", headers=control_headers(), timeout=5).json()
                  if w["usable"]}
        if usable == set(workers):
            break
        time.sleep(0.5)
    assert usable == set(workers), f"the restarted worker is not back: {usable}"
    assert re.search(rf"restarted {proc['name']} \(pid (\d+); restart 1 in a row\)", mono_tp.log.read_text())
    state = json.loads((mono_tp.log.parent / "state.json").read_text())  # rewritten with the new pid
    (again,) = [p for p in state["processes"] if p["name"] == proc["name"]]
    assert again["pid"] != proc["pid"] and again["url"] == proc["url"] and len(followers(again["pid"])) == 1
    mono_tp.state = state  # so that the stack's stop kills the new pid too
    assert greedy_ids(mono_tp, PROMPTS[2], 8) == hf_greedy(PROMPTS[2], 8)


def test_an_idle_workers_dead_rank_is_found_before_a_request_needs_it(
        start_stack: Callable[..., Stack], hf_greedy: Callable[[list[int], int], list[int]]) -> None:
    stack = start_stack("--mode", "monolithic", "--decode-workers", "2", "--tensor-parallel-size", "2", "--no-restart")
    victim, other = stack.procs("both")
    rank1 = followers(victim["pid"])[0]
    os.kill(rank1, signal.SIGKILL)
    assert pid_gone(victim["pid"], 15), "an idle worker notices its dead rank and exits"
    assert f"tensor-parallel rank 1 (pid {rank1}) was killed by SIGKILL" in Path(victim["log_path"]).read_text()
    limit = time.monotonic() + 15
    while time.monotonic() < limit:  # the router stops routing to it
        usable = [w["url"] for w in httpx.get(f"{stack.url}/workers", headers=control_headers(), timeout=5).json()
                  if w["usable"]]
        if usable == [other["url"]]:
            break
        time.sleep(0.2)
    assert usable == [other["url"]]
    assert f"{victim['name']} stays down (--no-restart)" in stack.log.read_text()
    for prompt in PROMPTS:  # no request lands on the dead worker
        assert greedy_ids(stack, prompt, 6) == hf_greedy(prompt, 6)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tandem.worker.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_tensor_parallelism_where_it_is_not_built_is_refused_with_the_reason(tiny_model: Path) -> None:
    serve = run_cli("serve", "--model", str(tiny_model), "--mode", "disaggregated", "--tensor-parallel-size", "2",
                    "--port", "1")
    assert serve.returncode == 2
    assert "--tensor-parallel-size 2 needs --mode monolithic or chunked" in serve.stderr, serve.stderr
    worker = run_cli("worker", "--role", "decode", "--model", str(tiny_model), "--tensor-parallel-size", "2")
    assert worker.returncode == 2
    assert "the KV transfer between tensor-parallel workers is not built yet" in worker.stderr, worker.stderr


def test_a_degree_the_model_does_not_split_into_fails_the_load_with_the_reason(tiny_model: Path, tmp_path: Path) -> None:
    port = free_port()
    serve = subprocess.run([sys.executable, "-m", "tandem.worker.cli", "serve", "--model", str(tiny_model),
                            "--mode", "monolithic", "--tensor-parallel-size", "3", "--port", str(port),
                            "--log-dir", str(tmp_path), "--ready-timeout", "60"],
                           capture_output=True, text=True, timeout=120)
    assert serve.returncode == 1
    assert "tensor parallel size 3 does not divide the model's num_attention_heads" in serve.stdout + serve.stderr, \
        serve.stdout[-2000:]
