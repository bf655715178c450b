"""`tandem serve`: router + prefill + decode workers on this machine, as separate processes."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

import click
import httpx
from rich.console import Console
from rich.markup import escape  # logs and errors hold [brackets] that rich would read as markup
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from tandem.worker import faults
from tandem.worker.commands.vllm_flags import EPILOG, refuse_unsupported_vllm_flags
from tandem.worker.hardware import DTYPE_CHOICES, Choice, choose
from tandem.worker.model.config import FAMILIES as TINY_FAMILIES
from tandem.worker.router.placement import PLACEMENTS
from tandem.worker.server.supervisor import (
    MAX_RESTARTS,
    MODES,
    RESTART_RESET_S,
    LocalStack,
    StackSpec,
    restart_delay,
)

# Share of a GPU's free memory that the workers of one `tandem serve` take for weights plus KV
# cache when the user sets no budget: what vLLM takes for one instance, split between the workers.
DEFAULT_GPU_SHARE = 0.9


def cache_dir() -> Path:
    """Tiny models and logs; TANDEM_CACHE_DIR moves it (the local cluster's builds share this root)."""
    if os.environ.get("TANDEM_CACHE_DIR"):
        return Path(os.environ["TANDEM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tandem"


def resolve_model(model: str, family: str, console: Console) -> tuple[Path, str]:
    """A model folder and its served name; `tiny` writes a small random model into the cache first, a Hub
    repository id (docs/serving.md, "Models from the Hub") is downloaded into the Hub cache first."""
    if model == "tiny":
        folder = cache_dir() / "models" / f"tiny-{family}"
        if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
            console.print(f"using the tiny random {family} model cached in {folder}")
        else:
            from tandem.worker.model.tiny import write_tiny_model

            console.print(f"writing a tiny random-weight {family} model to {folder} (its output is gibberish; "
                          "pass --model DIR for a real model)")
            write_tiny_model(folder, family=family)
        return folder, "tiny"
    from tandem.worker.model.hub import HubError, resolve

    try:
        # Downloaded here, once, for every worker of the stack; workers get the snapshot folder.
        folder, hub_name = resolve(model, console.print)
    except HubError as exc:
        raise click.BadParameter(str(exc), param_hint="--model") from None
    if not (folder / "config.json").is_file():
        raise click.BadParameter(f"{folder} is not a model folder (no config.json); use a Hugging Face style folder, "
                                 "a Hub repository ORG/NAME[@REVISION], or --model tiny", param_hint="--model")
    return folder.resolve(), hub_name or folder.resolve().name


@click.command("serve", epilog=EPILOG + " --chat-template FILE replaces the model's chat template.")
@click.option("--model", required=True,
              help="Model folder; a Hugging Face Hub model ORG/NAME[@REVISION] (or hf://NAME[@REVISION]), downloaded "
                   "into the Hub cache (HF_TOKEN, HF_HUB_CACHE, HF_HUB_OFFLINE apply; a folder of that name here "
                   "wins); or `tiny` for a small random model (written on first use).")
@click.option("--model-name", "--served-model-name", "model_name", default=None,
              help="Name clients use (default: the folder name, the Hub repository id, or `tiny`).")
@click.option("--family", type=click.Choice(list(TINY_FAMILIES)), default="llama",
              show_default=True, help="Architecture of the --model tiny model.")
@click.option("--prefill-workers", type=click.IntRange(0, 64), default=1, show_default=True)
@click.option("--decode-workers", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Decode workers (in monolithic/chunked mode: the number of both-role workers).")
@click.option("--mode", type=click.Choice(MODES), default="disaggregated", show_default=True)
@click.option("--transport", type=click.Choice(["auto", "tcp", "rdma"]), default="auto", show_default=True)
@click.option("--secure-kv", is_flag=True,
              help="Encrypt and authenticate KV transfers (CURVE; a fresh keypair in the log folder). "
                   "About 2.5-3x slower KV transfer on tcp: see docs/transfer.md.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Router address (workers stay on 127.0.0.1).")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="auto", show_default=True,
              help="auto: float32 on CPU; on CUDA the model's config.json dtype (bfloat16 if it says float32).")
@click.option("--device", default="auto", show_default=True,
              help="auto (CUDA when torch sees a GPU, else cpu), cpu or cuda[:N], for every worker.")
@click.option("--tensor-parallel-size", "-tp", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Ranks (processes, and GPUs on CUDA) of each worker; monolithic and chunked modes only for now "
                   "(the KV transfer between tensor-parallel workers is not built yet). See docs/tensor-parallel.md.")
@click.option("--block-size", type=int, default=16, show_default=True)
@click.option("--max-model-len", type=int, default=None)
@click.option("--kv-cache-bytes", type=int, default=None, help="KV cache per worker (default: the engine's).")
@click.option("--gpu-memory-utilization", "memory_utilization", type=click.FloatRange(0, 1, min_open=True), default=None,
              help=f"Share of the memory free at start that the workers together take for weights plus KV cache "
                   f"(default on CUDA: {DEFAULT_GPU_SHARE}; on CPU each worker sizes its KV cache for --max-num-seqs).")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=None, help="Sequences per engine step (default: 64).")
@click.option("--max-num-batched-tokens", type=int, default=None, help="Token budget per step (chunk size).")
@click.option("--seed", type=int, default=None, help="Default sampling seed of every worker (default: 0).")
@click.option("--chat-template", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="A Jinja file that replaces the model's chat template.")
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Process logs (default: a folder in the cache).")
@click.option("--state-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the processes (names, roles, URLs, pids) here as JSON once ready.")
@click.option("--ready-timeout", type=float, default=300.0, show_default=True)
@click.option("--request-timeout", type=click.FloatRange(min=0.1), default=600.0, show_default=True,
              help="Per-request deadline enforced by the router.")
@click.option("--stall-timeout", type=click.FloatRange(min=0.1), default=60.0, show_default=True,
              help="The router counts a worker silent this long mid-request as lost (the request migrates).")
@click.option("--api-key", "api_keys", multiple=True, envvar="TANDEM_API_KEY",
              help="A key clients must send as `Authorization: Bearer KEY` (repeatable; or $TANDEM_API_KEY, keys "
                   "separated by spaces). The router gets it through its environment, not its command line.")
@click.option("--api-key-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="A file of API keys, one a line; the router re-reads it when it changes.")
@click.option("--canary-interval", type=click.FloatRange(min=0), default=None,
              help="Seconds between the router's output canary probes (default 60; 0: off). See `tandem router --help`.")
@click.option("--placement", type=click.Choice(PLACEMENTS), default=None,
              help="The router's prefill placement (default prefix). See `tandem router --help`.")
@click.option("--restart/--no-restart", "restart_workers", default=True, show_default=True,
              help="Start a worker that fails (exits non-zero: killed, crashed, a tensor-parallel rank died) again, "
                   f"after 1 s, backing off to 30 s; it stays down after {MAX_RESTARTS} restarts in a row. A worker "
                   "that exits 0 (drained after a SIGTERM) stays down.")
# A test hook (faults.py): refused unless TANDEM_ENABLE_FAULTS=1, which the workers then inherit.
@click.option("--prefill-fault", type=click.Choice(faults.FAULTS), default=None, hidden=True)
@refuse_unsupported_vllm_flags
def command(model: str, model_name: str | None, family: str, prefill_workers: int, decode_workers: int, mode: str,
            transport: str, secure_kv: bool, host: str, port: int, dtype: str, device: str, tensor_parallel_size: int,
            block_size: int, max_model_len: int | None, kv_cache_bytes: int | None, memory_utilization: float | None,
            max_num_seqs: int | None, max_num_batched_tokens: int | None, seed: int | None, chat_template: Path | None,
            log_dir: Path | None,
            state_file: Path | None, ready_timeout: float, request_timeout: float, stall_timeout: float,
            canary_interval: float | None, placement: str | None, prefill_fault: str | None, api_keys: tuple[str, ...],
            api_key_file: Path | None, restart_workers: bool) -> None:
    """Run the whole stack here: an OpenAI-compatible API at http://HOST:PORT/v1."""
    console = Console(soft_wrap=True)
    model_dir, default_name = resolve_model(model, family, console)
    try:
        choice = choose(device, dtype, model_dir)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    console.print(f"workers run on {choice.describe()}")
    workers = decode_workers + (prefill_workers if mode == "disaggregated" else 0)
    memory_utilization = _memory_share(choice, workers, memory_utilization, kv_cache_bytes)
    if mode != "disaggregated" and prefill_workers:
        console.print(f"--mode {mode}: no prefill pool; running {decode_workers} both-role worker(s)")
    log_dir = log_dir or cache_dir() / "logs" / f"serve-{port}"
    kv_keys = _fresh_kv_keys(log_dir / "kv-keys") if secure_kv and mode == "disaggregated" else None
    try:
        spec = StackSpec(model_dir=model_dir, model_name=model_name or default_name, mode=mode,
                         prefill_workers=prefill_workers if mode == "disaggregated" else 0,
                         decode_workers=decode_workers, transport=transport, host=host, port=port, dtype=choice.dtype,
                         device=choice.device, block_size=block_size, max_model_len=max_model_len,
                         kv_cache_bytes=kv_cache_bytes, memory_utilization=memory_utilization, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, seed=seed, chat_template=chat_template, log_dir=log_dir, prefill_fault=prefill_fault,
                         request_timeout=request_timeout, stall_timeout=stall_timeout, kv_keys=kv_keys,
                         api_keys=tuple(k for value in api_keys for k in value.split()), api_key_file=api_key_file,
                         canary_interval=canary_interval, placement=placement, tensor_parallel=tensor_parallel_size)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if not _port_free(host, port):
        raise click.UsageError(f"{host}:{port} is already in use; pick another --port")
    try:
        stack = LocalStack(spec)  # writes the run's worker control token (its log folder's control-token)
    except ValueError as exc:  # an unusable $TANDEM_CONTROL_TOKEN(_FILE)
        raise click.UsageError(str(exc)) from None
    stop = _StopFlag()
    stack.start()
    code = 0
    try:
        if not _wait_ready(stack, console, ready_timeout, stop):
            code = 1
        else:
            if state_file is not None:
                stack.write_state(state_file)
            console.print(f"[bold green]ready:[/bold green] OpenAI API at [bold]{stack.url}/v1[/bold] "
                          f"(model {spec.model_name!r}, mode {mode}); logs in {log_dir}; Ctrl-C stops everything")
            console.print(f"  the workers' control token (for calling them, or /workers, yourself): "
                          f"{stack.control_token_file}")
            auth = " -H \"Authorization: Bearer $TANDEM_API_KEY\"" if api_keys or api_key_file else ""
            console.print(f"  try: curl {stack.url}/v1/completions -H 'content-type: application/json'{auth} "
                          f"-d '{{\"model\": \"{spec.model_name}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'")
            code = _watch(stack, console, stop, restart_workers, state_file)
    finally:
        console.print("stopping: router first, then workers (they finish in-flight requests)...")
        stack.stop()
        console.print("stopped.")
    sys.exit(code)


def _memory_share(choice: Choice, workers: int, given: float | None, kv_cache_bytes: int | None) -> float | None:
    """Each worker's --gpu-memory-utilization: the stack's share split evenly, since every worker
    measures the same free memory when they load side by side on one device."""
    if kv_cache_bytes is not None:
        if given is not None:
            raise click.UsageError("give either --kv-cache-bytes or --gpu-memory-utilization, not both")
        return None
    if given is None and not choice.device.startswith("cuda"):
        return None  # CPU: each worker sizes its KV cache for max_num_seqs full-length requests
    return (given if given is not None else DEFAULT_GPU_SHARE) / workers


class _StopFlag:
    def __init__(self) -> None:
        self.signal: int | None = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, sig: int, _frame: FrameType | None) -> None:
        self.signal = sig


def _fresh_kv_keys(folder: Path) -> Path:
    """A new keypair per run: only this run's workers can reach each other's KV ports."""
    from tandem.worker.kv.keys import KVKeys

    KVKeys.generate().save(folder)
    return folder


def _port_free(host: str, port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _wait_ready(stack: LocalStack, console: Console, timeout: float, stop: _StopFlag) -> bool:
    limit = time.monotonic() + timeout
    with httpx.Client() as client, Progress(TextColumn("{task.description:<12}"), BarColumn(),
                                            TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
                                            console=console) as progress:
        tasks: dict[str, TaskID] = {p.name: progress.add_task(p.name, total=1.0, status="starting")
                                    for p in stack.procs}
        while True:
            if stop.signal is not None:
                return False
            dead = stack.dead()
            if dead:
                progress.stop()
                for p in dead:
                    console.print(f"[red]{p.name} exited with code {p.popen.returncode if p.popen else '?'}; "
                                  f"its log ({p.log_path}) ends with:[/red]\n{escape(p.log_tail())}")
                return False
            try:
                states = stack.poll_ready(client)
            except RuntimeError as exc:
                progress.stop()
                console.print(f"[red]{escape(str(exc))}[/red]")
                return False
            for name, (ok, frac) in states.items():
                progress.update(tasks[name], completed=1.0 if ok else frac,
                                status="ready" if ok else ("loading model" if frac > 0 else "starting"))
            if all(ok for ok, _ in states.values()):
                return True
            if time.monotonic() > limit:
                progress.stop()
                slow = [n for n, (ok, _) in states.items() if not ok]
                console.print(f"[red]not ready after {timeout:.0f}s: {', '.join(slow)}[/red]")
                for p in stack.procs:
                    if p.name in slow:
                        console.print(f"{p.name} log ({p.log_path}):\n{escape(p.log_tail())}")
                return False
            time.sleep(0.25)


def _watch(stack: LocalStack, console: Console, stop: _StopFlag, restart: bool, state_file: Path | None) -> int:
    """Until a stop signal: report processes that exit, start exited workers again (supervisor.restart_delay),
    and give up (code 1) when the router exits or no worker is left running or due to restart."""
    due: dict[str, float] = {}  # worker name -> when it restarts
    given_up: set[str] = set()
    while stop.signal is None:
        now = time.monotonic()
        for p in stack.dead():
            if p.name in due or p.name in given_up:
                continue
            console.print(f"[yellow]{p.name} exited (code {p.popen.returncode if p.popen else '?'}); "
                          f"log tail:[/yellow]\n{escape(p.log_tail(8))}")
            if p.role == "router":
                return 1
            ran_long = now - p.started_at >= RESTART_RESET_S
            clean = p.popen is not None and p.popen.returncode == 0  # drained on SIGTERM: stopped on purpose
            delay = restart_delay(0 if ran_long else p.restarts) if restart and not clean else None
            if delay is None:
                given_up.add(p.name)
                why = ("--no-restart" if not restart else "it exited cleanly, as after a SIGTERM" if clean
                       else f"it exited {p.restarts + 1} times in a row")
                console.print(f"[red]{p.name} stays down ({why})[/red]")
            else:
                due[p.name] = now + delay
                console.print(f"[yellow]restarting {p.name} in {delay:g} s[/yellow]")
        for p in stack.workers:
            if p.name in due and now >= due[p.name]:
                del due[p.name]
                stack.restart(p)
                console.print(f"restarted {p.name} (pid {p.pid}; restart {p.restarts} in a row)")
                if state_file is not None:
                    stack.write_state(state_file)
        if not due and all(not p.alive() for p in stack.workers):
            console.print("[red]every worker has exited[/red]")
            return 1
        time.sleep(0.25)
    return 0
