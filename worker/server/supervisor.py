"""Starts and stops a whole local stack (router + workers as separate processes) for `tandem serve`.

Each process is started in its own session so a terminal Ctrl-C reaches only the supervisor,
which then stops things in order: the router first (no new requests), then the workers with
SIGTERM (they drain), and SIGKILL for anything still alive after the grace period.

The router and workers share a worker control token (control_token.py): $TANDEM_CONTROL_TOKEN_FILE's
or $TANDEM_CONTROL_TOKEN's when set, else a fresh one per run. It is written to `control-token` in
the log folder (mode 0600) and each process gets that file's path, never the token, on its command
line (`ps` shows command lines to every user).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tandem.worker import faults
from tandem.worker.server import control_token
from tandem.worker.server.control_token import ControlTokens
from tandem.worker.server.ports import free_port

MODES = ("disaggregated", "monolithic", "chunked")

# A worker that fails (exits non-zero) while the stack runs is started again, as a pod's container would be
# (one that exits 0 drained after a SIGTERM: someone stopped it on purpose): after 1 s,
# then twice as long each time it exits again soon (up to 30 s), and not at all after MAX_RESTARTS in a
# row; one that ran RESTART_RESET_S before it exited starts over from the first delay.
RESTART_DELAYS_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
MAX_RESTARTS = 6
RESTART_RESET_S = 300.0


def restart_delay(restarts_in_a_row: int) -> float | None:
    """Seconds to wait before the next restart of a worker that exited `restarts_in_a_row` times since it
    last ran RESTART_RESET_S; None once it has been restarted MAX_RESTARTS times in a row (it stays down)."""
    if restarts_in_a_row >= MAX_RESTARTS:
        return None
    return RESTART_DELAYS_S[min(restarts_in_a_row, len(RESTART_DELAYS_S) - 1)]


@dataclass
class Proc:
    name: str  # router | prefill-0 | decode-1 | worker-0
    role: str  # router | prefill | decode | both
    url: str
    argv: list[str]
    log_path: Path
    kv_port: int | None = None
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    env: dict[str, str] = field(default_factory=dict, repr=False)  # added to the supervisor's environment
    started_at: float = 0.0  # time.monotonic() of the last start
    restarts: int = 0  # restarts in a row (reset when it ran RESTART_RESET_S before exiting)

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@dataclass
class StackSpec:
    model_dir: Path
    model_name: str
    mode: str = "disaggregated"
    prefill_workers: int = 1
    decode_workers: int = 1
    transport: str = "auto"
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    max_model_len: int | None = None
    kv_cache_bytes: int | None = None
    memory_utilization: float | None = None  # per worker (--gpu-memory-utilization)
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    seed: int | None = None
    chat_template: Path | None = None  # the router renders chats with this file instead of the model's template
    log_dir: Path = Path(".")
    prefill_fault: str | None = None  # test hook passed to prefill workers (needs TANDEM_ENABLE_FAULTS=1)
    request_timeout: float = 600.0  # the router's per-request deadline
    stall_timeout: float = 60.0  # the router's patience with a silent worker mid-request
    kv_keys: Path | None = None  # secure KV transfer: the keypair folder every worker gets (--kv-keys)
    api_keys: tuple[str, ...] = ()  # the router's API keys: in its environment (TANDEM_API_KEY), not its argv
    api_key_file: Path | None = None  # the router's --api-key-file
    canary_interval: float | None = None  # the router's --canary-interval (None: its default)
    placement: str | None = None  # the router's --placement (None: its default)
    tensor_parallel: int = 1  # ranks of each worker (--tensor-parallel-size); monolithic and chunked modes only

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.decode_workers < 1:
            raise ValueError("at least one decode worker is needed")
        if self.mode == "disaggregated" and self.prefill_workers < 1:
            raise ValueError("disaggregated mode needs at least one prefill worker")
        if self.tensor_parallel < 1:
            raise ValueError(f"--tensor-parallel-size must be at least 1, got {self.tensor_parallel}")
        if self.tensor_parallel > 1 and self.mode == "disaggregated":
            raise ValueError(f"--tensor-parallel-size {self.tensor_parallel} needs --mode monolithic or chunked: the KV "
                             f"transfer between tensor-parallel prefill and decode workers is not built yet")
        # A test hook: refused here unless TANDEM_ENABLE_FAULTS=1, which the workers then inherit.
        faults.check(self.prefill_fault, "--prefill-fault")

    def worker_device(self, index: int) -> str:
        """Worker `index`'s --device: on CUDA with tensor parallelism each worker's ranks take their own GPUs
        (worker i from GPU i * size on); otherwise every worker shares the one device."""
        if self.tensor_parallel == 1 or not self.device.startswith("cuda"):
            return self.device
        first = int(self.device.partition(":")[2] or 0)
        return f"cuda:{first + index * self.tensor_parallel}"


class LocalStack:
    def __init__(self, spec: StackSpec) -> None:
        self.spec = spec
        self.procs: list[Proc] = []
        spec.log_dir.mkdir(parents=True, exist_ok=True)
        self.control = _run_tokens()
        self.control_token_file = control_token.write_private(spec.log_dir / "control-token",
                                                              "\n".join(self.control.tokens))
        self._plan()

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.port}"

    @property
    def workers(self) -> list[Proc]:
        return [p for p in self.procs if p.role != "router"]

    @property
    def router(self) -> Proc:
        return self.procs[-1]

    def _worker(self, name: str, role: str, extra: list[str], index: int = 0) -> Proc:
        s = self.spec
        port, kv_port = free_port(), free_port()
        argv = [sys.executable, "-m", "tandem.worker.cli", "worker", "--role", role, "--model", str(s.model_dir),
                "--model-name", s.model_name, "--dtype", s.dtype, "--device", s.worker_device(index),
                "--block-size", str(s.block_size),
                "--transport", s.transport, "--host", "127.0.0.1", "--port", str(port), "--kv-port", str(kv_port),
                "--pool", "local", "--control-token-file", str(self.control_token_file), *extra]
        if s.max_model_len:
            argv += ["--max-model-len", str(s.max_model_len)]
        if s.kv_cache_bytes:
            argv += ["--kv-cache-bytes", str(s.kv_cache_bytes)]
        if s.max_num_batched_tokens:
            argv += ["--max-num-batched-tokens", str(s.max_num_batched_tokens)]
        if s.memory_utilization is not None:
            argv += ["--gpu-memory-utilization", str(s.memory_utilization)]
        if s.max_num_seqs is not None:
            argv += ["--max-num-seqs", str(s.max_num_seqs)]
        if s.seed is not None:
            argv += ["--seed", str(s.seed)]
        if s.kv_keys is not None:
            argv += ["--kv-keys", str(s.kv_keys)]
        if s.tensor_parallel > 1:
            argv += ["--tensor-parallel-size", str(s.tensor_parallel)]
        return Proc(name, role, f"http://127.0.0.1:{port}", argv, s.log_dir / f"{name}.log", kv_port)

    def _plan(self) -> None:
        s = self.spec
        if s.mode == "disaggregated":
            fault = ["--fault", s.prefill_fault] if s.prefill_fault else []
            self.procs += [self._worker(f"prefill-{i}", "prefill", fault) for i in range(s.prefill_workers)]
            self.procs += [self._worker(f"decode-{i}", "decode", []) for i in range(s.decode_workers)]
        else:
            chunk = ["--chunked-prefill"] if s.mode == "chunked" else ["--no-chunked-prefill"]
            self.procs += [self._worker(f"worker-{i}", "both", chunk, i) for i in range(s.decode_workers)]
        argv = [sys.executable, "-m", "tandem.worker.cli", "router", "--host", s.host, "--port", str(s.port),
                "--model-name", s.model_name, "--model", str(s.model_dir), "--request-timeout", str(s.request_timeout),
                "--stall-timeout", str(s.stall_timeout), "--control-token-file", str(self.control_token_file)]
        if s.chat_template is not None:
            argv += ["--chat-template", str(s.chat_template)]
        for p in self.workers:
            argv += ["--prefill" if p.role == "prefill" else "--decode", p.url]
        if s.api_key_file is not None:
            argv += ["--api-key-file", str(s.api_key_file)]
        if s.canary_interval is not None:
            argv += ["--canary-interval", str(s.canary_interval)]
        if s.placement is not None:
            argv += ["--placement", s.placement]
        env = {"TANDEM_API_KEY": " ".join(s.api_keys)} if s.api_keys else {}
        self.procs.append(Proc("router", "router", self.url, argv, s.log_dir / "router.log", env=env))

    def start(self) -> None:
        for p in self.procs:
            self._launch(p, "wb")

    def _launch(self, p: Proc, mode: str) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **p.env}
        with p.log_path.open(mode) as log:
            p.popen = subprocess.Popen(p.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env=env, start_new_session=True)
        p.started_at = time.monotonic()

    def restart(self, p: Proc) -> None:
        """Start an exited worker again, on the same ports (the router finds it there); its log is appended to."""
        assert p.role != "router" and not p.alive()
        with p.log_path.open("ab") as log:
            log.write(f"\n--- restarted by tandem serve (restart {p.restarts + 1} in a row) ---\n".encode())
        if time.monotonic() - p.started_at >= RESTART_RESET_S:
            p.restarts = 0
        p.restarts += 1
        self._launch(p, "ab")

    def poll_ready(self, client: httpx.Client) -> dict[str, tuple[bool, float]]:
        """name -> (ready, load progress 0..1). Raises RuntimeError when a worker reports a failed load."""
        out: dict[str, tuple[bool, float]] = {}
        for p in self.procs:
            try:
                resp = client.get(f"{p.url}/ready", timeout=1.0)
                body = resp.json()
            except (httpx.HTTPError, ValueError):
                out[p.name] = (False, 0.0)
                continue
            if body.get("error"):
                raise RuntimeError(f"{p.name} failed to load: {body['error']}")
            ok = resp.status_code == 200
            if ok and p is self.router:
                # The router answers /ready once it can serve at all; the stack is ready only when
                # it sees every worker, or the first requests would skip the prefill pool.
                ok = self._router_sees_all_workers(client)
            out[p.name] = (ok, float(body.get("load_progress", 1.0 if ok else 0.0)))
        return out

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Block until every process is ready (see poll_ready); RuntimeError naming a process that exited."""
        limit = time.monotonic() + timeout
        with httpx.Client() as client:
            while time.monotonic() < limit:
                if self.dead():
                    raise RuntimeError(f"{self.dead()[0].name} exited:\n{self.dead()[0].log_tail()}")
                if all(ok for ok, _ in self.poll_ready(client).values()):
                    return
                time.sleep(0.5)
        raise RuntimeError(f"the stack was not ready within {timeout:g}s")

    def _router_sees_all_workers(self, client: httpx.Client) -> bool:
        try:
            workers = client.get(f"{self.router.url}/workers", headers=self.control.headers, timeout=1.0).json()
        except (httpx.HTTPError, ValueError):
            return False
        return sum(1 for w in workers if w.get("usable")) >= len(self.workers)

    def dead(self) -> list[Proc]:
        return [p for p in self.procs if p.popen is not None and not p.alive()]

    def write_state(self, path: Path) -> None:
        state = {"url": self.url, "mode": self.spec.mode, "model": self.spec.model_name,
                 "control_token_file": str(self.control_token_file),
                 "processes": [{"name": p.name, "role": p.role, "url": p.url, "kv_port": p.kv_port,
                                "log_path": str(p.log_path), "pid": p.pid} for p in self.procs]}
        path.write_text(json.dumps(state, indent=2))

    def stop(self, grace: float = 20.0) -> None:
        """Router first, then the workers (they drain on SIGTERM); SIGKILL after `grace` seconds."""
        for group in ([self.router], self.workers):
            for p in group:
                if p.alive():
                    assert p.popen is not None
                    p.popen.send_signal(signal.SIGTERM)
            limit = time.monotonic() + grace
            for p in group:
                if p.popen is None:
                    continue
                try:
                    p.popen.wait(max(0.1, limit - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.popen.kill()
                    p.popen.wait(5)


def _run_tokens() -> ControlTokens:
    """The stack's control token: the environment's (a file or the value) when set, else a fresh one."""
    given = control_token.load(os.environ.get(control_token.ENV_TOKEN_FILE) or None)
    return given if given is not None else ControlTokens((control_token.generate(),), "a fresh token for this run")
