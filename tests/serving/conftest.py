"""Real local stacks for the serving tests: `tandem serve` processes on 127.0.0.1 with a tiny model.

Stacks are started through the real CLI (so `tandem serve` itself is under test) and stopped
with SIGTERM, the way a user's Ctrl-C would. The session-wide disaggregated and monolithic
stacks are shared by every test that leaves them intact; tests that kill workers start their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tandem.worker.server.control_token import ENV_TOKEN, HEADER
from tandem.worker.server.ports import free_port

KV_CACHE_BYTES = 8 << 20  # 1024 blocks of the tiny model: plenty, and cheap to allocate


@dataclass
class Stack:
    url: str
    model: str
    state: dict[str, Any]
    popen: subprocess.Popen[bytes]
    log: Path
    shared: bool = False  # used by every module (disagg, mono): stopped at the session's end, not the module's

    def procs(self, role: str) -> list[dict[str, Any]]:
        return [p for p in self.state["processes"] if p["role"] == role]

    def stop(self) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)
        state_file = self.log.parent / "state.json"  # tandem serve rewrites it when it restarts a worker
        with contextlib.suppress(OSError, ValueError):
            self.state = json.loads(state_file.read_text())
        for p in self.state.get("processes", []):  # never leave a worker behind, whatever happened
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(p["pid"], signal.SIGKILL)
        return int(self.popen.returncode)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tandem.worker.model.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-serving")


@pytest.fixture(scope="session")
def tokenizer(tiny_model: Path) -> Any:
    from tandem.worker.model.tokenizer import Tokenizer

    return Tokenizer(tiny_model)


_STARTED: list[Stack] = []  # every stack start_stack started and nobody stopped yet


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A module's own stacks stop after its last test: kept to the session's end, every module's stacks
    (four to six processes of ~380 MB each) added up to the machine's 24 GiB and the later tests failed."""
    yield
    if nextitem is not None and getattr(nextitem, "module", None) is getattr(item, "module", None):
        return
    for stack in [s for s in _STARTED if not s.shared]:
        stack.stop()
        _STARTED.remove(stack)


@pytest.fixture(scope="session")
def start_stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Stack]]:
    started = _STARTED

    def start(*args: str, timeout: float = 120.0, env: dict[str, str] | None = None, model: Path | None = None,
              shared: bool = False) -> Stack:
        port = free_port()
        work = tmp_path_factory.mktemp("stack")
        state_file = work / "state.json"
        log = work / "serve.log"
        argv = [sys.executable, "-m", "tandem.worker.cli", "serve", "--model", str(model or tiny_model), "--model-name", "tiny",
                "--port", str(port), "--kv-cache-bytes", str(KV_CACHE_BYTES), "--log-dir", str(work / "logs"),
                "--state-file", str(state_file), *args]
        with log.open("wb") as fh:
            popen = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        limit = time.monotonic() + timeout
        while not state_file.exists():
            if popen.poll() is not None or time.monotonic() > limit:
                popen.kill()
                pytest.fail(f"tandem serve {' '.join(args)} did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        stack = Stack(f"http://127.0.0.1:{port}", "tiny", json.loads(state_file.read_text()), popen, log, shared)
        started.append(stack)
        return stack

    yield start
    for stack in list(started):
        stack.stop()
        started.remove(stack)


@pytest.fixture(scope="session")
def disagg(start_stack: Callable[..., Stack]) -> Stack:
    return start_stack("--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1", shared=True)


@pytest.fixture(scope="session")
def mono(start_stack: Callable[..., Stack]) -> Stack:
    return start_stack("--mode", "monolithic", "--decode-workers", "1", shared=True)


@pytest.fixture(scope="session")
def chunked(start_stack: Callable[..., Stack]) -> Stack:
    """Both-role workers with chunked prefill, 16-token chunks: most prompts take several steps."""
    return start_stack("--mode", "chunked", "--decode-workers", "1", "--max-num-batched-tokens", "16", shared=True)


@pytest.fixture(scope="session")
def hf_greedy(tiny_model: Path) -> Callable[[list[int], int], list[int]]:
    """transformers' greedy continuation of a prompt: the reference the engine must match."""
    transformers = pytest.importorskip("transformers", reason="transformers is the reference (test extra)")
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    model.eval()

    def greedy(prompt: list[int], n: int) -> list[int]:
        with torch.no_grad():
            ids = torch.tensor([prompt])
            # An explicit mask: without one transformers masks every pad_token_id (0), and 0 is the tiny
            # model's BOS, which chat and token-id prompts start with.
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        return list(out[0, len(prompt):].tolist())

    return greedy


def control_headers() -> dict[str, str]:
    """The worker control token of every worker and router the tests start (tests/conftest.py sets it in the
    environment, which `tandem serve` and the processes the tests start directly take it from)."""
    return {HEADER: os.environ[ENV_TOKEN]}


def metric_value(url: str, name: str, **labels: str) -> float:
    """Sum of a metric's samples on a /metrics page whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def wait_until_disaggregated(stack: Stack, timeout: float = 60.0) -> None:
    """The router serves a request disaggregated only once it sees a usable prefill and decode worker;
    before that it sends everything to decode (no transfer at all), which is not what these tests
    are about."""
    limit = time.monotonic() + timeout
    while time.monotonic() < limit:
        roles = {w["role"] for w in httpx.get(f"{stack.url}/workers", headers=control_headers(), timeout=5).json() if w["usable"]}
        if {"prefill", "decode"} <= roles:
            return
        time.sleep(0.2)
    pytest.fail(f"the router did not see a usable prefill and decode worker within {timeout:g}s")
