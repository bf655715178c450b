#!/usr/bin/env python3
"""Interference benchmark: long prompts arriving into steady decode traffic.

For each mode (monolithic, chunked, disaggregated) this starts a local stack on the same model
(`tandem serve`'s supervisor), keeps `--streams` decode streams running (short prompt, long
output, closed loop), injects a `--long-prompt-tokens` prompt every `--long-every` seconds,
and reports the decode streams' inter-token latency as the client sees it (p50/p99, and
p99/p50) and the long prompts' TTFT. The claim it checks: with disaggregation, a long prefill
does not stall running decodes, so ITL p99 stays near its p50; in monolithic mode every long
prefill freezes the batch. `baseline` (monolithic, no long prompts) is the noise floor.

Placement (`--pin`, on by default with two or more cores): every worker runs torch with one
thread, the decode-side worker (monolithic/chunked: the only worker; disaggregated: the decode
worker) has a core to itself, and the router, this load generator and, in disaggregated mode,
the prefill worker (SCHED_IDLE) share another. That stands in for each pool having its own
device; the monolithic worker gets a dedicated core too, so the decode side is compared like
for like. Without it every process, the router and the client included, competes for the same
cores and OS scheduling noise sets the ITL tail in every mode.

Load shape: p99 sees a stall only if more than 1% of the decode gaps are stalled. Each long
prompt stalls one gap per stream, so that needs long prompts at least every ~100 decode steps,
while each prefill must stay well under the interval or the monolithic worker never catches up
(long-prompt TTFT then grows without bound). The defaults (256-token prompts every 0.75 s, about
320 ms of prefill against ~23 ms decode steps on the machine these numbers come from) stall ~3%
of the gaps and keep the monolithic worker under half busy with prefill. Absolute times
depend on the machine; compare the ratios, and look at the other-CPU column (load from
outside the benchmark) before trusting a tail.

    .venv/bin/python hack/bench_interference.py --rounds 2 --json /tmp/interference.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tandem.worker.bench.client import RequestResult, send_one
from tandem.worker.bench.stats import percentile
from tandem.worker.bench.workload import RequestSpec
from tandem.worker.server.ports import free_port
from tandem.worker.server.supervisor import LocalStack, StackSpec

# Random-weight Llama-shaped models. "small" (~50M parameters) is the default: its decode step
# (~23 ms on one core of the machine these numbers come from) is long against the HTTP/SSE path
# and OS scheduling jitter (a few ms), so client-side ITL measures the engine; with "tiny" a step
# is ~2 ms and the ITL tail is mostly that noise.
MODELS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=32, max_position_embeddings=4096),
    "small": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12,
                  num_key_value_heads=4, head_dim=64, max_position_embeddings=4096),
}


def write_model(folder: Path, config: dict[str, Any]) -> Path:
    from tandem.worker.model.tiny import write_tiny_model

    if not (folder / "config.json").is_file():
        write_tiny_model(folder, **config)
    return folder


def random_ids(n: int, rng: random.Random, vocab: int = 512) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


async def stream_one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> RequestResult:
    """One streamed completion with one chunk per token (`return_token_ids`): without it the router
    holds back a token whose text is still empty (frequent with random tokens on the byte-level
    test tokenizer), which turns one decode step in a few into a two-step gap in every mode alike."""
    spec = RequestSpec(0.0, len(prompt), max_tokens, "bench")
    result = await send_one(client, url, "bench", spec, prompt, 300.0, token_ids=True)
    if result.ok and result.output_tokens != max_tokens:
        result.ok, result.error = False, f"{result.output_tokens} of {max_tokens} tokens"
    return result


async def run_load(url: str, args: argparse.Namespace) -> tuple[list[RequestResult], list[RequestResult]]:
    rng = random.Random(0)
    decode_results: list[RequestResult] = []
    long_results: list[RequestResult] = []
    end = time.monotonic() + args.warmup + args.duration
    measure_from = time.monotonic() + args.warmup
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:

        async def decode_stream(i: int) -> None:
            while time.monotonic() < end:
                res = await stream_one(client, url, random_ids(args.short_prompt_tokens, rng), args.decode_tokens)
                if res.start >= measure_from:
                    decode_results.append(res)

        async def long_prompts() -> None:
            await asyncio.sleep(args.warmup)
            tasks = []
            while time.monotonic() < end - 2 and args.long_every < 1e8:
                tasks.append(asyncio.create_task(
                    stream_one(client, url, random_ids(args.long_prompt_tokens, rng), 2)))
                await asyncio.sleep(max(0.0, min(args.long_every, end - 2 - time.monotonic())))
            long_results.extend(await asyncio.gather(*tasks))

        await asyncio.gather(long_prompts(), *(decode_stream(i) for i in range(args.streams)))
    return decode_results, long_results


def summarize(decode: list[RequestResult], long: list[RequestResult], stall_s: float) -> dict[str, Any]:
    itls = [x for r in decode if r.ok for x in r.itls]
    ttft_long = [r.ttft for r in long if r.ok and r.ttft is not None]
    # The gap between a request's first and second token: in disaggregated mode that is the hand-off
    # from the prefill worker to the decode worker (KV transfer, a router hop), once per request.
    first_gaps = [r.itls[0] for r in decode if r.ok and r.itls]
    p50, p99, p999 = percentile(itls, 50), percentile(itls, 99), percentile(itls, 99.9)
    return {
        "itl_samples": len(itls), "itl_p999_ms": p999 and p999 * 1000,
        "stalls": sum(x > stall_s for x in itls),  # decode gaps longer than --stall-ms
        "decode_requests": len(decode), "decode_failed": sum(not r.ok for r in decode),
        "long_requests": len(long), "long_failed": sum(not r.ok for r in long),
        "itl_p50_ms": p50 and p50 * 1000, "itl_p99_ms": p99 and p99 * 1000,
        "itl_max_ms": max(itls) * 1000 if itls else None,
        "itl_p99_over_p50": (p99 / p50) if p50 and p99 else None,
        "first_gap_p50_ms": (v := percentile(first_gaps, 50)) and v * 1000,
        "first_gap_p99_ms": (v := percentile(first_gaps, 99)) and v * 1000,
        "long_ttft_p50_ms": (v := percentile(ttft_long, 50)) and v * 1000,
        "long_ttft_p99_ms": (v := percentile(ttft_long, 99)) and v * 1000,
    }


def placement(pin: bool) -> tuple[int, int] | None:
    """(shared core, decode core), or None when not pinning: the first two cores this process may use."""
    cores = sorted(os.sched_getaffinity(0))
    return (cores[0], cores[1]) if pin and len(cores) >= 2 else None


def pin_stack(stack: LocalStack, cores: tuple[int, int], prefill_idle: bool) -> dict[str, str]:
    """Prefix each process's argv with taskset (and chrt for the prefill worker); returns name -> placement.

    The decode side (the decode worker, or the only worker in monolithic/chunked) gets `cores[1]` to
    itself; the router and the prefill worker share `cores[0]` with this script. With
    `prefill_idle` the prefill worker runs SCHED_IDLE, so it only takes the CPU time the router and
    the load generator leave: on real hardware prefill runs on its own device and never delays the
    router or the client.
    """
    shared, decode = cores
    out = {}
    for p in stack.procs:
        core = decode if p.role in ("decode", "both") else shared
        prefix = ["taskset", "-c", str(core)]
        if p.role == "prefill" and prefill_idle:
            prefix += ["chrt", "--idle", "0"]
        p.argv = [*prefix, *p.argv]
        out[p.name] = f"core {core}" + (" SCHED_IDLE" if p.role == "prefill" and prefill_idle else "")
    return out


HZ = os.sysconf("SC_CLK_TCK")


def cpu_snapshot(pids: list[int]) -> dict[str, float]:
    """CPU seconds: busy time of the whole machine and of each core (/proc/stat), and of each pid.

    Busy is user + nice + system time; interrupt time is left out, since the loopback traffic of
    the benchmark itself is processed there and is not charged to its processes.
    """
    snap: dict[str, float] = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu"):
            break
        ticks = [int(x) for x in fields]
        busy = ticks[0] + ticks[1] + ticks[2]
        snap[name] = busy / HZ
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            snap[f"pid{pid}"] = (int(stat[11]) + int(stat[12])) / HZ  # utime + stime, all threads
        except (OSError, IndexError):
            snap[f"pid{pid}"] = 0.0
    return snap


def foreign_load(before: dict[str, float], after: dict[str, float], seconds: float, decode_pid: int | None,
                 ours: list[int], cores: tuple[int, int] | None) -> dict[str, float]:
    """CPU used by everything that is not this benchmark, in cores: on the whole machine and, when
    pinning, on the decode core (busy time of that core minus the decode-side worker's own)."""
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    out = {"foreign_cpu_cores": max(0.0, delta["cpu"] - sum(delta[f"pid{p}"] for p in ours)) / seconds}
    if cores and decode_pid is not None:
        own = delta[f"pid{decode_pid}"]
        out["foreign_cpu_decode_core"] = max(0.0, delta[f"cpu{cores[1]}"] - own) / seconds
        out["decode_worker_cpu"] = own / seconds
    return out


def wait_quiet(limit: float, max_wait: float) -> tuple[float, float]:
    """Wait (at most `max_wait` s) until other processes use less than `limit` cores over 3 s.

    Returns (seconds waited, cores they used in the last sample). The machine this was written on
    is shared; a test suite starting elsewhere doubles the ITL tail of every mode alike.
    """
    start = last_note = time.monotonic()
    while True:
        before = cpu_snapshot([os.getpid()])
        time.sleep(3.0)
        after = cpu_snapshot([os.getpid()])
        other = max(0.0, (after["cpu"] - before["cpu"]) - (after[f"pid{os.getpid()}"] - before[f"pid{os.getpid()}"]))
        other /= 3.0
        waited = time.monotonic() - start
        if other < limit or waited >= max_wait:
            return waited, other
        if waited < 4 or time.monotonic() - last_note > 30:
            last_note = time.monotonic()
            print(f"  other processes use {other:.2f} cores (> {limit}); waiting ...", flush=True)


def run_mode(mode: str, model_dir: Path, args: argparse.Namespace, log_root: Path) -> dict[str, Any]:
    """One stack, one load run: raw per-request results plus placement and machine-load notes."""
    if mode == "baseline":  # monolithic with no long prompts: this machine's noise floor
        mode, args = "monolithic", argparse.Namespace(**{**vars(args), "long_every": 1e9})
    spec = StackSpec(model_dir=model_dir, model_name="bench", mode=mode, prefill_workers=1, decode_workers=1,
                     port=free_port(), log_dir=log_root / mode, kv_cache_bytes=256 << 20,
                     max_num_batched_tokens=args.chunk if mode == "chunked" else None)
    stack = LocalStack(spec)
    cores = args.cores
    where = pin_stack(stack, cores, args.prefill_idle) if cores else {}
    stack.start()
    try:
        stack.wait_ready()
        ours = [os.getpid(), *(p.pid for p in stack.procs if p.pid)]
        decode_pid = next((p.pid for p in stack.procs if p.role in ("decode", "both")), None)
        before, t0, load0 = cpu_snapshot(ours), time.monotonic(), os.getloadavg()[0]
        decode, long = asyncio.run(run_load(stack.url, args))
        after, seconds = cpu_snapshot(ours), time.monotonic() - t0
    finally:
        stack.stop()
    return {"decode": decode, "long": long, "placement": where, "loadavg_1m": [load0, os.getloadavg()[0]],
            **foreign_load(before, after, seconds, decode_pid, ours, cores)}


def combine(mode: str, runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Pool one mode's rounds: percentiles over all their ITL samples."""
    out = summarize([r for run in runs for r in run["decode"]], [r for run in runs for r in run["long"]],
                    args.stall_ms / 1000)
    out["mode"] = "baseline (no long prompts)" if mode == "baseline" else mode
    out["placement"] = runs[0]["placement"]
    for key in ("foreign_cpu_cores", "foreign_cpu_decode_core", "decode_worker_cpu"):
        if key in runs[0]:
            out[key] = sum(run[key] for run in runs) / len(runs)
    out["loadavg_1m"] = [x for run in runs for x in run["loadavg_1m"]]
    out["rounds"] = [{k: v for k, v in summarize(run["decode"], run["long"], args.stall_ms / 1000).items()
                      if k in ("itl_p50_ms", "itl_p99_ms", "itl_p99_over_p50", "stalls", "long_ttft_p50_ms")}
                     for run in runs]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="baseline,monolithic,chunked,disaggregated",
                    help="baseline = monolithic without long prompts (the noise floor of this machine)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the modes this many times, interleaved, and pool each mode's samples (spreads "
                         "bursts of other load on the machine over all modes)")
    ap.add_argument("--quiet-cores", type=float, default=0.3,
                    help="before each run wait until other processes use fewer cores than this, and run again "
                         "(up to --retries times) when they used more during it; 0 = never wait or discard")
    ap.add_argument("--quiet-wait", type=float, default=300.0, help="longest wait for a quiet machine, seconds")
    ap.add_argument("--retries", type=int, default=2)
    ap.add_argument("--stall-ms", type=float, default=100.0, help="a decode gap longer than this is a stall")
    ap.add_argument("--duration", type=float, default=20.0, help="measured seconds per mode and round")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--streams", type=int, default=4, help="concurrent decode streams")
    ap.add_argument("--short-prompt-tokens", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--long-prompt-tokens", type=int, default=256)
    ap.add_argument("--long-every", type=float, default=0.75, help="seconds between long prompts")
    ap.add_argument("--chunk", type=int, default=64, help="token budget per step in chunked mode")
    ap.add_argument("--model", choices=sorted(MODELS), default="small", help="which random-weight model to write")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="where to write the model (reused if it already holds one, whatever --model says)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--pin", choices=("auto", "on", "off"), default="auto",
                    help="CPU placement: the decode-side worker on a core of its own; router, prefill worker and "
                         "this script on another (auto: on when this process may use >= 2 cores)")
    ap.add_argument("--prefill-idle", action=argparse.BooleanOptionalAction, default=True,
                    help="when pinning, run the prefill worker SCHED_IDLE so it does not delay the router/client")
    args = ap.parse_args()
    usable = len(os.sched_getaffinity(0))
    tools = all(shutil.which(t) for t in ("taskset", "chrt"))
    if args.pin == "on" and (usable < 2 or not tools):
        ap.error("--pin on needs at least two usable cores, and taskset and chrt (util-linux)")
    args.pin = args.pin == "on" or (args.pin == "auto" and usable >= 2 and tools)
    cores = args.cores = placement(args.pin)  # before this process is pinned to one core
    if cores:
        os.sched_setaffinity(0, {cores[0]})  # the load generator shares its core with the router
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by every worker process
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so every stack is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="tandem-interference-"))
    model_dir = write_model(args.model_dir or work / f"model-{args.model}", MODELS[args.model])
    modes = args.modes.split(",")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    discarded: dict[str, int] = {m: 0 for m in modes}
    for i in range(args.rounds):
        for mode in modes:
            for attempt in range(args.retries + 1):
                print(f"round {i + 1}/{args.rounds}: {mode} ...", flush=True)
                if args.quiet_cores > 0:
                    waited, other = wait_quiet(args.quiet_cores, args.quiet_wait)
                    print(f"  other load before the run: {other:.2f} cores (waited {waited:.0f} s)", flush=True)
                run = run_mode(mode, model_dir, args, work / "logs")
                one = summarize(run["decode"], run["long"], args.stall_ms / 1000)
                print(json.dumps({**one, **{k: v for k, v in run.items() if k not in ("decode", "long")}}), flush=True)
                if args.quiet_cores <= 0 or run["foreign_cpu_cores"] < args.quiet_cores or attempt == args.retries:
                    break
                discarded[mode] += 1
                print(f"  discarded: other processes used {run['foreign_cpu_cores']:.2f} cores during the run",
                      flush=True)
            runs[mode].append(run)
    config = json.loads((model_dir / "config.json").read_text())
    shown = {k: config.get(k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                        "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")}
    results = [{**combine(m, runs[m], args), "discarded_runs": discarded[m]} for m in modes]
    print(f"\nmodel {model_dir} {shown}; {args.streams} decode streams "
          f"({args.short_prompt_tokens}-token prompts, {args.decode_tokens} tokens each) + one "
          f"{args.long_prompt_tokens}-token prompt every {args.long_every}s; {args.rounds} x {args.duration:.0f}s "
          f"measured per mode; float32, OMP_NUM_THREADS=1 per worker")
    if cores:
        print(f"placement: decode-side worker (monolithic/chunked: the only worker; disaggregated: the decode worker) "
              f"alone on core {cores[1]}; router, load generator and (disaggregated) the prefill worker"
              f"{' at SCHED_IDLE' if args.prefill_idle else ''} on core {cores[0]}. This stands in for each pool "
              f"having its own device; the monolithic worker gets a dedicated core too, so the decode side is "
              f"compared like for like.")
    else:
        print("placement: none (--pin off, or fewer than 2 cores): every process shares every core")
    print(f"{'mode':<28}{'ITL p50':>9}{'p99':>8}{'p99.9':>8}{'max':>8}{'p99/p50':>9}{'p99.9/p50':>10}"
          f"{'stalls':>8}{'1st gap':>9}{'long TTFT p50':>15}{'fails':>7}{'other CPU':>13}{'load 1m':>12}")
    for r in results:
        ttft = f"{r['long_ttft_p50_ms']:.0f}" if r["long_ttft_p50_ms"] else "-"
        foreign = f"{r['foreign_cpu_cores']:.2f}" + (f"/{r['foreign_cpu_decode_core']:.2f}"
                                                     if "foreign_cpu_decode_core" in r else "")
        load = f"{min(r['loadavg_1m']):.1f}-{max(r['loadavg_1m']):.1f}"
        print(f"{r['mode']:<28}{r['itl_p50_ms']:>9.1f}{r['itl_p99_ms']:>8.1f}{r['itl_p999_ms']:>8.1f}"
              f"{r['itl_max_ms']:>8.0f}{r['itl_p99_over_p50']:>9.1f}{r['itl_p999_ms'] / r['itl_p50_ms']:>10.1f}"
              f"{r['stalls']:>8}{r['first_gap_p50_ms']:>9.1f}{ttft:>15}{r['decode_failed'] + r['long_failed']:>7}"
              f"{foreign:>13}{load:>12}")
    print(f"(ms; stalls = decode gaps > {args.stall_ms:.0f} ms out of each mode's itl_samples; 1st gap = p50 of "
          f"the gap between a decode request's first and second token (disaggregated: the hand-off); other CPU = cores "
          f"used by processes outside this benchmark during the measurement (whole machine"
          f"{' / on the decode core' if cores else ''}); load 1m = load average at the start and end of each run, "
          f"this benchmark's own processes included)")
    if any(discarded.values()):
        print("runs discarded and rerun for other load above --quiet-cores: "
              + ", ".join(f"{m} {n}" for m, n in discarded.items() if n))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "model": shown, "results": results}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
