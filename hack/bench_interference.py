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

Calibrated load: before measuring, the script starts one monolithic worker and measures this
machine with this model (the long prompt's prefill time, the decode step at `--streams`), then
sends a long prompt every `prefill / --load-fraction` seconds: the interfering load is that
fraction of the monolithic worker's prefill capacity, on any machine (a fixed interval saturated
a machine 3x slower than the one it was tuned on). The table states the fraction, the measured
capacities and the share of decode gaps a long prefill lands in (p99 sees stalls only above 1%).
`--long-every` still sets an absolute interval. Absolute times depend on the machine; compare
the ratios, and look at the other-CPU column (load from outside the benchmark) before trusting a tail.

A mode that is starved (no decode request finished, or it ran past its window) is a result: it is
printed and saved with what was measured; the exit status is 0 when every mode ran, 1 when one
could not (its stack did not start, the calibration failed).

`--goodput`: DistServe's measure. Requests from a mix (`--mix synthetic`, or a trace's length
distribution scaled to the model: `mooncake`, `azure-code`) arrive as a Poisson process; for each
mode the script searches the highest rate at which >= `--attainment` of them meet TTFT <= T and
mean ITL <= I, T and I being multiples (`--slo-ttft-scale`, `--slo-itl-scale`) of the latencies
one request sees alone, and divides it by the devices used. Equal hardware: 2 monolithic
replicas, 2 chunked replicas and 1 prefill + 1 decode worker, behind the same router; on CPU each
worker is pinned to a core of its own (the router and the load generator float), on CUDA both
share the one GPU.

    .venv/bin/python hack/bench_interference.py --rounds 2 --json /tmp/interference.json
    .venv/bin/python hack/bench_interference.py --goodput --json /tmp/goodput.json
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

from tandem.worker.bench.calibration import (
    Capacity,
    Slo,
    long_prompt_interval,
    slo_from_single,
    stalled_gap_share,
    throughput_bounds,
)
from tandem.worker.bench.client import RequestResult, send_one
from tandem.worker.bench.goodput import (
    Mix,
    Probe,
    RateSearch,
    Search,
    attainment,
    miss_reasons,
    synthetic_mix,
    trace_mix,
)
from tandem.worker.bench.report import text_table
from tandem.worker.bench.stats import percentile
from tandem.worker.bench.workload import KNOWN_TRACES, RequestSpec, load_trace, resolve_trace
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
    # ~0.6B parameters, for the GPU machine (hack/gpu_checks.sh): on an H200 "small" is all launch
    # overhead, and a 2048-token prefill has to take long enough to interfere with decoding.
    "gpu": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=12, num_attention_heads=16,
                num_key_value_heads=8, head_dim=128, max_position_embeddings=8192),
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


async def run_load(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Decode streams plus long prompts for warmup + duration; whatever has not finished `--grace` s
    after the window is cancelled and counted as unfinished (a starved mode is a result, not a hang)."""
    rng = random.Random(0)
    decode_results: list[RequestResult] = []
    long_results: list[RequestResult] = []
    in_flight = {"decode": 0, "long": 0}  # what the deadline cancels is counted as unfinished
    end = time.monotonic() + args.warmup + args.duration
    measure_from = time.monotonic() + args.warmup
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:

        async def decode_stream(i: int) -> None:
            while time.monotonic() < end:
                in_flight["decode"] += 1
                res = await stream_one(client, url, random_ids(args.short_prompt_tokens, rng), args.decode_tokens)
                in_flight["decode"] -= 1
                decode_results.append(res)

        async def one_long() -> None:
            in_flight["long"] += 1
            long_results.append(await stream_one(client, url, random_ids(args.long_prompt_tokens, rng), 2))
            in_flight["long"] -= 1

        async def long_prompts() -> None:
            await asyncio.sleep(args.warmup)
            tasks = []
            while time.monotonic() < end - 2 and args.long_every < 1e8:
                tasks.append(asyncio.create_task(one_long()))
                await asyncio.sleep(max(0.0, min(args.long_every, end - 2 - time.monotonic())))
            await asyncio.gather(*tasks)

        timed_out = False
        try:
            async with asyncio.timeout(args.warmup + args.duration + args.grace):
                await asyncio.gather(long_prompts(), *(decode_stream(i) for i in range(args.streams)))
        except TimeoutError:
            timed_out = True
    decode, first_gaps = in_window(decode_results, measure_from, end)
    return {"decode": decode, "first_gaps": first_gaps, "long": long_results, "timed_out": timed_out,
            "decode_unfinished": in_flight["decode"], "long_unfinished": in_flight["long"]}


def in_window(results: list[RequestResult], start: float, end: float) -> tuple[list[RequestResult], list[float]]:
    """The decode gaps that ended inside the measured window, whichever request they belong to.

    Counting only requests that started and finished inside it measured nothing on a slow machine,
    where one 128-token request outlasts a 20 s window. Returns the requests with at least one
    gap inside (their `itls` cut to those gaps) and the first gaps (the disaggregated hand-off)
    that ended inside.
    """
    kept, first_gaps = [], []
    for r in results:
        if not r.ok or r.ttft is None:
            if start <= r.start <= end:
                kept.append(r)  # a failed request sent inside the window counts as one
            continue
        t = r.start + r.ttft
        gaps = []
        for i, gap in enumerate(r.itls):
            t += gap
            if start <= t <= end:
                gaps.append(gap)
                if i == 0:
                    first_gaps.append(gap)
        if gaps:
            kept.append(RequestResult(r.tag, True, r.start, ttft=r.ttft, e2e=r.e2e, itls=gaps,
                                      output_tokens=len(gaps)))
    return kept, first_gaps


def summarize(decode: list[RequestResult], long: list[RequestResult], stall_s: float,
              first_gaps: list[float]) -> dict[str, Any]:
    """`decode`: requests with their in-window gaps (in_window); `first_gaps`: the gap between a
    request's first and second token, in disaggregated mode the hand-off from the prefill worker to
    the decode worker (KV transfer, a router hop), once per request."""
    itls = [x for r in decode if r.ok for x in r.itls]
    ttft_long = [r.ttft for r in long if r.ok and r.ttft is not None]
    p50, p99, p999 = percentile(itls, 50), percentile(itls, 99), percentile(itls, 99.9)

    def ms(v: float | None) -> float | None:
        return None if v is None else v * 1000

    return {
        "itl_samples": len(itls), "itl_p999_ms": ms(p999),
        "stalls": sum(x > stall_s for x in itls),  # decode gaps longer than --stall-ms
        "decode_requests": len(decode), "decode_failed": sum(not r.ok for r in decode),  # with a gap in the window
        "decode_tokens": sum(r.output_tokens for r in decode if r.ok),
        "long_requests": len(long), "long_failed": sum(not r.ok for r in long),
        "itl_p50_ms": ms(p50), "itl_p99_ms": ms(p99),
        "itl_max_ms": max(itls) * 1000 if itls else None,
        "itl_p99_over_p50": (p99 / p50) if p50 and p99 else None,
        "itl_p999_over_p50": (p999 / p50) if p50 and p999 else None,
        "first_gap_p50_ms": ms(percentile(first_gaps, 50)),
        "first_gap_p99_ms": ms(percentile(first_gaps, 99)),
        "long_ttft_p50_ms": ms(percentile(ttft_long, 50)),
        "long_ttft_p99_ms": ms(percentile(ttft_long, 99)),
    }


def status(row: dict[str, Any]) -> str:
    """What a mode's row measured, in words: ok, or how it was starved."""
    if row.get("error"):
        return "could not run"
    notes = []
    if not row.get("decode_requests"):
        notes.append("starved: 0 decode finished")
    elif not row.get("itl_samples"):
        notes.append("starved: 0 decode gaps")
    if row.get("timed_out"):
        notes.append("timed out")
    unfinished = row.get("decode_unfinished", 0) + row.get("long_unfinished", 0)
    if unfinished:
        notes.append(f"{unfinished} unfinished")
    return ", ".join(notes) or "ok"


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


def pin_each(stack: LocalStack, cores: list[int]) -> dict[str, str]:
    """Goodput placement: worker i alone on cores[i] (a device each); the router floats."""
    out = {}
    for i, p in enumerate(stack.workers):
        core = cores[i % len(cores)]
        p.argv = ["taskset", "-c", str(core), *p.argv]
        out[p.name] = f"core {core}"
    out["router"] = "floating (with the load generator)"
    return out


def stack_spec(mode: str, model_dir: Path, args: argparse.Namespace, log_dir: Path, workers: int = 1) -> StackSpec:
    """`workers`: monolithic/chunked replicas; disaggregated is always 1 prefill + 1 decode worker."""
    on_gpu = args.device != "cpu"
    return StackSpec(model_dir=model_dir, model_name="bench", mode=mode, prefill_workers=1,
                     decode_workers=1 if mode == "disaggregated" else workers, port=free_port(), log_dir=log_dir,
                     device=args.device, dtype=args.dtype, kv_cache_bytes=args.kv_cache_mib << 20,
                     transport="tcp" if on_gpu else "auto",
                     max_num_batched_tokens=args.chunk if mode == "chunked" else None,
                     canary_interval=0.0)  # no background canary requests in a measurement


async def measure_capacity(url: str, args: argparse.Namespace) -> Capacity:
    """The monolithic worker alone: long-prompt prefill, short-prompt TTFT, one stream's and
    `--streams` streams' decode step (medians; the first request of each shape is a warm-up)."""
    rng = random.Random(1)
    calib_tokens = 24
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:

        async def one(prompt_tokens: int, out: int) -> RequestResult:
            res = await stream_one(client, url, random_ids(prompt_tokens, rng), out)
            if not res.ok:
                raise RuntimeError(f"calibration request failed: {res.error}")
            return res

        await one(args.long_prompt_tokens, 2)
        await one(args.short_prompt_tokens, 4)
        longs = [await one(args.long_prompt_tokens, 2) for _ in range(3)]
        shorts = [await one(args.short_prompt_tokens, 2) for _ in range(3)]
        single = await one(args.short_prompt_tokens, calib_tokens)
        batch = await asyncio.gather(*(one(args.short_prompt_tokens, calib_tokens) for _ in range(args.streams)))

    def med(xs: list[float]) -> float:
        return float(percentile(xs, 50) or 0.0)

    return Capacity(prompt_tokens=args.long_prompt_tokens, prefill_s=med([r.ttft or 0.0 for r in longs]),
                    batch=args.streams, decode_step_s=med([x for r in batch for x in r.itls[1:]]),
                    single_itl_s=med(single.itls[1:]), short_ttft_s=med([r.ttft or 0.0 for r in shorts]))


def calibrate(model_dir: Path, args: argparse.Namespace, log_root: Path) -> Capacity:
    stack = LocalStack(stack_spec("monolithic", model_dir, args, log_root / "calibration"))
    if args.cores:
        pin_stack(stack, args.cores, False)
    stack.start()
    try:
        stack.wait_ready()
        return asyncio.run(measure_capacity(stack.url, args))
    finally:
        stack.stop()


def run_mode(mode: str, model_dir: Path, args: argparse.Namespace, log_root: Path) -> dict[str, Any]:
    """One stack, one load run: raw per-request results plus placement and machine-load notes."""
    if mode == "baseline":  # monolithic with no long prompts: this machine's noise floor
        mode, args = "monolithic", argparse.Namespace(**{**vars(args), "long_every": 1e9})
    stack = LocalStack(stack_spec(mode, model_dir, args, log_root / mode))
    cores = args.cores
    where = pin_stack(stack, cores, args.prefill_idle) if cores else {}
    stack.start()
    try:
        stack.wait_ready()
        ours = [os.getpid(), *(p.pid for p in stack.procs if p.pid)]
        decode_pid = next((p.pid for p in stack.procs if p.role in ("decode", "both")), None)
        before, t0, load0 = cpu_snapshot(ours), time.monotonic(), os.getloadavg()[0]
        load = asyncio.run(run_load(stack.url, args))
        after, seconds = cpu_snapshot(ours), time.monotonic() - t0
    finally:
        stack.stop()
    return {**load, "placement": where, "loadavg_1m": [load0, os.getloadavg()[0]],
            **foreign_load(before, after, seconds, decode_pid, ours, cores)}


def combine(mode: str, runs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Pool one mode's rounds: percentiles over all their ITL samples."""
    out = summarize([r for run in runs for r in run["decode"]], [r for run in runs for r in run["long"]],
                    args.stall_ms / 1000, [g for run in runs for g in run["first_gaps"]])
    out["mode"] = "baseline (no long prompts)" if mode == "baseline" else mode
    out["placement"] = runs[0]["placement"]
    for key in ("foreign_cpu_cores", "foreign_cpu_decode_core", "decode_worker_cpu"):
        if key in runs[0]:
            out[key] = sum(run[key] for run in runs) / len(runs)
    for key in ("decode_unfinished", "long_unfinished"):
        out[key] = sum(run[key] for run in runs)
    out["timed_out"] = any(run["timed_out"] for run in runs)
    out["loadavg_1m"] = [x for run in runs for x in run["loadavg_1m"]]
    out["rounds"] = [{k: v for k, v in summarize(run["decode"], run["long"], args.stall_ms / 1000,
                                                 run["first_gaps"]).items()
                      if k in ("itl_p50_ms", "itl_p99_ms", "itl_p99_over_p50", "stalls", "long_ttft_p50_ms")}
                     for run in runs]
    out["status"] = status(out)
    return out


INTERFERENCE_COLUMNS = [
    ("mode", "mode", ""), ("ITL p50", "itl_p50_ms", ".1f"), ("p99", "itl_p99_ms", ".1f"),
    ("p99.9", "itl_p999_ms", ".1f"), ("max", "itl_max_ms", ".0f"), ("p99/p50", "itl_p99_over_p50", ".1f"),
    ("p99.9/p50", "itl_p999_over_p50", ".1f"), ("stalls", "stalls", "d"), ("decode req", "decode_requests", "d"),
    ("1st gap", "first_gap_p50_ms", ".1f"), ("long TTFT p50", "long_ttft_p50_ms", ".0f"), ("fails", "fails", "d"),
    ("other CPU", "other_cpu", ""), ("load 1m", "load", ""), ("status", "status", ""),
]


def interference_table(results: list[dict[str, Any]]) -> str:
    rows = []
    for r in results:
        row = dict(r)
        if "error" not in r:
            row["fails"] = r["decode_failed"] + r["long_failed"]
            row["other_cpu"] = f"{r['foreign_cpu_cores']:.2f}" + (
                f"/{r['foreign_cpu_decode_core']:.2f}" if "foreign_cpu_decode_core" in r else "")
            row["load"] = f"{min(r['loadavg_1m']):.1f}-{max(r['loadavg_1m']):.1f}"
        rows.append(row)
    return text_table(INTERFERENCE_COLUMNS, rows)


def describe_capacity(cap: Capacity) -> str:
    return (f"measured capacity (one monolithic worker alone): prefill of a {cap.prompt_tokens}-token prompt "
            f"{cap.prefill_s * 1000:.0f} ms = {cap.prefill_tokens_per_s:.0f} prompt tokens/s; decode step "
            f"{cap.decode_step_s * 1000:.1f} ms at {cap.batch} streams, {cap.single_itl_s * 1000:.1f} ms at 1; "
            f"short-prompt TTFT {cap.short_ttft_s * 1000:.0f} ms")


def run_interference(model_dir: Path, args: argparse.Namespace, work: Path, cap: Capacity | None) -> int:
    modes = args.modes.split(",")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    errors: dict[str, str] = {}
    discarded: dict[str, int] = {m: 0 for m in modes}
    for i in range(args.rounds):
        for mode in modes:
            if mode in errors:
                continue
            for attempt in range(args.retries + 1):
                print(f"round {i + 1}/{args.rounds}: {mode} ...", flush=True)
                if args.quiet_cores > 0:
                    waited, other = wait_quiet(args.quiet_cores, args.quiet_wait)
                    print(f"  other load before the run: {other:.2f} cores (waited {waited:.0f} s)", flush=True)
                try:
                    run = run_mode(mode, model_dir, args, work / "logs")
                except RuntimeError as exc:  # the stack did not start: this mode could not be measured
                    errors[mode] = str(exc)
                    print(f"  {mode} could not run: {exc}", flush=True)
                    break
                one = summarize(run["decode"], run["long"], args.stall_ms / 1000, run["first_gaps"])
                print(json.dumps({**one, **{k: v for k, v in run.items() if k not in ("decode", "long", "first_gaps")}}),
                      flush=True)
                if args.quiet_cores <= 0 or run["foreign_cpu_cores"] < args.quiet_cores or attempt == args.retries:
                    break
                discarded[mode] += 1
                print(f"  discarded: other processes used {run['foreign_cpu_cores']:.2f} cores during the run",
                      flush=True)
            if mode not in errors:
                runs[mode].append(run)
    results = [{"mode": m, "error": errors[m], "status": "could not run"} if m in errors
               else {**combine(m, runs[m], args), "discarded_runs": discarded[m]} for m in modes]
    print(f"\nmodel {args.model_shown}; {args.streams} decode streams "
          f"({args.short_prompt_tokens}-token prompts, {args.decode_tokens} tokens each) + one "
          f"{args.long_prompt_tokens}-token prompt every {args.long_every:.3g}s; {args.rounds} x {args.duration:.0f}s "
          f"measured per mode; float32, OMP_NUM_THREADS=1 per worker")
    load = {"long_every_s": args.long_every}
    if cap is not None:
        share = stalled_gap_share(cap, args.long_every)
        print(describe_capacity(cap))
        print(f"interfering load: {args.load_fraction:.0%} of the monolithic worker's prefill capacity "
              f"(a {args.long_prompt_tokens}-token prompt every {args.long_every:.3g} s); a long prefill lands in "
              f"~{share:.1%} of a monolithic stream's decode gaps")
        load.update(load_fraction=args.load_fraction, capacity=cap.as_dict(), stalled_gap_share=share)
    else:
        print(f"interfering load: fixed by --long-every {args.long_every:g} s (not calibrated)")
    if args.cores:
        print(f"placement: decode-side worker (monolithic/chunked: the only worker; disaggregated: the decode worker) "
              f"alone on core {args.cores[1]}; router, load generator and (disaggregated) the prefill worker"
              f"{' at SCHED_IDLE' if args.prefill_idle else ''} on core {args.cores[0]}. This stands in for each "
              f"pool having its own device; the monolithic worker gets a dedicated core too, so the decode side "
              f"is compared like for like.")
    else:
        print("placement: none (--pin off, fewer than 2 cores, or a GPU): every process shares every core")
    print(interference_table(results))
    print(f"(ms; stalls = decode gaps > {args.stall_ms:.0f} ms out of each mode's itl_samples; decode req = decode "
          f"requests with a gap in the window; 1st gap = p50 of the gap between a decode request's first and second "
          f"token (disaggregated: the hand-off); other CPU = cores used by processes outside this benchmark during "
          f"the measurement (whole machine{' / on the decode core' if args.cores else ''}); load 1m = load average "
          f"at the start and end of each run, this benchmark's own processes included; '-' = nothing to measure)")
    if any(discarded.values()):
        print("runs discarded and rerun for other load above --quiet-cores: "
              + ", ".join(f"{m} {n}" for m, n in discarded.items() if n))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "model": args.model_shown,
                                         "load": load, "results": results}, indent=2))
        print(f"wrote {args.json}")
    return 1 if errors else 0


# Goodput (--goodput) ----------------------------------------------------------------------------

GOODPUT_MODES = {"monolithic": "2 monolithic replicas", "chunked": "2 chunked-prefill replicas",
                 "disaggregated": "1 prefill + 1 decode worker"}


def build_mix(args: argparse.Namespace) -> Mix:
    if args.mix == "synthetic":
        return synthetic_mix(args.short_prompt_tokens, args.long_prompt_tokens, args.goodput_output_tokens,
                             args.long_share)
    path = resolve_trace(args.mix)
    rows = load_trace(path, args.trace_rows)
    return trace_mix(rows, path.name, args.trace_median_prompt, args.long_prompt_tokens,
                     args.goodput_output_tokens, 2 * args.goodput_output_tokens)


async def send_probe(url: str, mix: Mix, rate: float, n: int, seed: int, grace: float) -> list[RequestResult]:
    """n requests at `rate` (Poisson); what has not finished `grace` s after the last send is cancelled."""
    specs = mix.requests(n, rate, seed)
    rng = random.Random(seed)
    prompts = [random_ids(s.prompt_tokens, rng) for s in specs]
    results: list[RequestResult] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=httpx.Limits(max_connections=None)) as client:
        start = time.monotonic()

        async def fire(spec: RequestSpec, prompt: list[int]) -> None:
            await asyncio.sleep(max(0.0, spec.send_at - (time.monotonic() - start)))
            results.append(await stream_one(client, url, prompt, spec.output_tokens))

        try:
            async with asyncio.timeout(specs[-1].send_at + grace):
                await asyncio.gather(*(fire(s, p) for s, p in zip(specs, prompts, strict=True)))
        except TimeoutError:
            pass
    return results


async def settle(url: str, args: argparse.Namespace, cap: Capacity, limit: float = 90.0) -> float:
    """Wait until a short request is served about as fast as alone (cancelled work has drained)."""
    start = time.monotonic()
    rng = random.Random(2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(limit)) as client:
        while time.monotonic() - start < limit:
            res = await stream_one(client, url, random_ids(args.short_prompt_tokens, rng), 2)
            if res.ok and res.ttft is not None and res.ttft < 3 * cap.short_ttft_s + 0.05:
                break
            await asyncio.sleep(1.0)
    return time.monotonic() - start


def probe_rate(mode: str, stack: LocalStack, rate: float, seed: int, args: argparse.Namespace, cap: Capacity,
               slo: Slo, mix: Mix) -> Probe:
    """One probe: n requests at `rate`; the share meeting the SLOs, why the rest missed, worker CPU use."""
    # rate x --probe-seconds requests, at least --probe-min-requests unless that takes over 3x as long
    # (a low rate would otherwise hold one probe for minutes), at least 4, at most --probe-max-requests.
    n = max(4, min(args.probe_max_requests, max(round(rate * args.probe_seconds),
                                                min(args.probe_min_requests, round(3 * rate * args.probe_seconds)))))
    grace = slo.ttft_s + 2 * max(o for _, o in mix.lengths) * slo.itl_s + 5.0
    pids = {p.name: p.pid for p in stack.workers if p.pid}
    before, t0, load0 = cpu_snapshot(list(pids.values())), time.monotonic(), os.getloadavg()[0]
    results = asyncio.run(send_probe(stack.url, mix, rate, n, seed, grace))
    after, seconds = cpu_snapshot(list(pids.values())), time.monotonic() - t0
    busy = {name: (after[f"pid{pid}"] - before[f"pid{pid}"]) / seconds for name, pid in pids.items()}
    share = attainment(results, n, slo.ttft_s, slo.itl_s)
    note = (miss_reasons(results, n, slo.ttft_s, slo.itl_s) + "; worker CPU "
            + ", ".join(f"{k} {v:.0%}" for k, v in busy.items()) + f"; load 1m {load0:.1f}")
    settled = asyncio.run(settle(stack.url, args, cap))
    print(f"  {mode} {rate:.3g} req/s x {n}: {share:.0%} met the SLOs ({note}; drained in {settled:.0f} s)", flush=True)
    return Probe(rate, share, note)


def run_searches(modes: list[str], model_dir: Path, args: argparse.Namespace, work: Path, cap: Capacity, slo: Slo,
                 mix: Mix, start_rate: float) -> tuple[dict[str, Search], dict[str, dict[str, str]], dict[str, str]]:
    """Every mode's stack up at once (idle ones cost nothing), their rate searches interleaved probe by
    probe, so load from outside that drifts during the run falls on every mode alike."""
    stacks: dict[str, LocalStack] = {}
    where: dict[str, dict[str, str]] = {}
    errors: dict[str, str] = {}
    try:
        for mode in modes:
            stack = LocalStack(stack_spec(mode, model_dir, args, work / "logs" / f"goodput-{mode}", workers=2))
            where[mode] = pin_each(stack, args.goodput_cores) if args.goodput_cores else {}
            stack.start()
            stacks[mode] = stack
            try:
                stack.wait_ready()
            except RuntimeError as exc:
                errors[mode] = str(exc)
                print(f"  {mode} could not run: {exc}", flush=True)
        searches = {m: RateSearch(start_rate, target=args.attainment, max_probes=args.max_probes)
                    for m in modes if m not in errors}
        seed = 100
        while any(s.next_rate() is not None for s in searches.values()):
            seed += 1  # the same request draw for every mode's k-th probe
            for mode, search in searches.items():
                rate = search.next_rate()
                if rate is not None:
                    search.record(probe_rate(mode, stacks[mode], rate, seed, args, cap, slo, mix))
    finally:
        for stack in stacks.values():
            stack.stop()
    return {m: s.result() for m, s in searches.items()}, where, errors


def run_goodput(model_dir: Path, args: argparse.Namespace, work: Path, cap: Capacity) -> int:
    slo = slo_from_single(cap, args.slo_ttft_scale, args.slo_itl_scale)
    mix = build_mix(args)
    mean_prompt = sum(p for p, _ in mix.lengths) / len(mix.lengths)
    mean_out = sum(o for _, o in mix.lengths) / len(mix.lengths)
    # One request's work on one worker, its decode steps shared by a batch of --streams: a rough
    # capacity per device to start the search from (it doubles or halves from there).
    work_s = mean_prompt / cap.prefill_tokens_per_s + mean_out * cap.decode_step_s / cap.batch
    start_rate = args.start_rate or args.devices / work_s
    print(f"SLOs: {slo.basis} = TTFT <= {slo.ttft_s * 1000:.0f} ms, mean ITL <= {slo.itl_s * 1000:.1f} ms; "
          f"goodput = highest Poisson rate at which >= {args.attainment:.0%} of the requests meet both")
    print(f"mix: {mix.description}")
    modes = args.goodput_modes.split(",")
    print(f"goodput: {', '.join(GOODPUT_MODES[m] for m in modes)}; searches interleaved from {start_rate:.3g} req/s",
          flush=True)
    bounds = throughput_bounds(cap, mix.lengths, args.devices)
    print(f"throughput ceilings from the calibration: {bounds.prefill_s * 1000:.0f} ms of prefill and "
          f"{bounds.decode_s * 1000:.0f} ms of decode work per request (decode at a batch of {cap.batch}); "
          f"{args.devices} replicas <= {bounds.replicas:.3g} req/s, 1 prefill + 1 decode <= {bounds.split:.3g} req/s "
          f"(its {bounds.split_bound_by} side)", flush=True)
    searches, where, errors = run_searches(modes, model_dir, args, work, cap, slo, mix, start_rate)
    results: list[dict[str, Any]] = []
    for mode in modes:
        if mode in errors:
            results.append({"mode": mode, "setup": GOODPUT_MODES[mode], "error": errors[mode]})
            continue
        found = searches[mode]
        results.append({"mode": mode, "setup": GOODPUT_MODES[mode], "placement": where[mode], "devices": args.devices,
                        "goodput_rps": found.goodput, "goodput_per_device": found.goodput / args.devices,
                        "bounded": found.bounded, "probes": [vars(p) for p in found.probes],
                        "ceiling_rps": bounds.split if mode == "disaggregated" else bounds.replicas})
    base = next((r["goodput_per_device"] for r in results if r["mode"] == "monolithic" and "error" not in r), None)
    for r in results:
        if "error" not in r:
            r["vs_monolithic"] = r["goodput_per_device"] / base if base else None
            r["best_probe"] = max((p["rate"] for p in r["probes"] if p["attainment"] >= args.attainment), default=None)
            failed = [p for p in r["probes"] if p["attainment"] < args.attainment]
            r["first_miss"] = min(failed, key=lambda p: p["rate"])["note"] if failed else "none: never missed"
            r["goodput_shown"] = f"{r['goodput_rps']:.3g}" + ("" if r["bounded"] else "+")
            r["of_ceiling"] = r["goodput_rps"] / r["ceiling_rps"]
    print(f"\nmodel {args.model_shown}; device: {args.device}; {args.devices} device(s) per mode "
          f"({'one core per worker, pinned' if args.goodput_cores else 'shared'})")
    print(text_table([("mode", "setup", ""), ("goodput req/s", "goodput_shown", ""),
                      ("per device", "goodput_per_device", ".3g"), ("vs monolithic", "vs_monolithic", ".2f"),
                      ("ceiling req/s", "ceiling_rps", ".3g"), ("of ceiling", "of_ceiling", ".0%"),
                      ("probes", "probe_count", "d")],
                     [{**r, "probe_count": len(r.get("probes", []))} for r in results]))
    for r in results:
        if "error" in r:
            print(f"{r['setup']}: could not run: {r['error']}")
            continue
        probes = ", ".join(f"{p['rate']:.3g}:{p['attainment']:.0%}" for p in r["probes"])
        print(f"{r['setup']}: probes (req/s: met) {probes}; at the lowest missed rate: {r['first_miss']}")
    print("('+' = every probed rate met the target: a lower bound; ceiling = the throughput the calibration allows "
          "that setup with every device busy, before any SLO)")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "model": args.model_shown,
                                         "capacity": cap.as_dict(), "slo": vars(slo), "mix": mix.description,
                                         "ceilings": vars(bounds),
                                         "loadavg_end": os.getloadavg(), "results": results}, indent=2))
        print(f"wrote {args.json}")
    return 1 if errors else 0


def main() -> int:
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
    ap.add_argument("--stall-ms", type=float, default=None,
                    help="a decode gap longer than this is a stall (default: 4 x the calibrated decode step, or 100)")
    ap.add_argument("--duration", type=float, default=20.0, help="measured seconds per mode and round")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--grace", type=float, default=15.0,
                    help="seconds after the window before unfinished requests are cancelled (counted as unfinished)")
    ap.add_argument("--streams", type=int, default=4, help="concurrent decode streams")
    ap.add_argument("--short-prompt-tokens", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--long-prompt-tokens", type=int, default=256)
    ap.add_argument("--load-fraction", type=float, default=0.4,
                    help="the long prompts take this share of the monolithic worker's measured prefill capacity")
    ap.add_argument("--long-every", type=float, default=None,
                    help="seconds between long prompts, fixed (skips the calibration of the interference run)")
    ap.add_argument("--chunk", type=int, default=64, help="token budget per step in chunked mode")
    ap.add_argument("--model", choices=sorted(MODELS), default="small", help="which random-weight model to write")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="where to write the model (reused if it already holds one, whatever --model says)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (every worker on the one GPU; no pinning)")
    ap.add_argument("--dtype", default="float32", help="the workers' --dtype (float32, bfloat16, auto)")
    ap.add_argument("--kv-cache-mib", type=int, default=256, help="KV cache per worker")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--pin", choices=("auto", "on", "off"), default="auto",
                    help="CPU placement: the decode-side worker on a core of its own; router, prefill worker and "
                         "this script on another (auto: on when this process may use >= 2 cores)")
    ap.add_argument("--prefill-idle", action=argparse.BooleanOptionalAction, default=True,
                    help="when pinning, run the prefill worker SCHED_IDLE so it does not delay the router/client")
    g = ap.add_argument_group("goodput (--goodput)")
    g.add_argument("--goodput", action="store_true", help="measure goodput per device instead of ITL under interference")
    g.add_argument("--goodput-modes", default="monolithic,chunked,disaggregated")
    g.add_argument("--mix", default="synthetic",
                   help=f"request lengths: synthetic, or a trace's scaled ({', '.join(KNOWN_TRACES)}, or a file)")
    g.add_argument("--long-share", type=float, default=0.25, help="synthetic mix: share of long prompts")
    g.add_argument("--goodput-output-tokens", type=int, default=64,
                   help="synthetic: every request's output; trace: the median output after scaling (max 2x)")
    g.add_argument("--trace-median-prompt", type=int, default=96, help="trace mix: median prompt after scaling")
    g.add_argument("--trace-rows", type=int, default=2000, help="trace mix: rows whose lengths are drawn from")
    g.add_argument("--slo-ttft-scale", type=float, default=3.0, help="TTFT SLO = this x the long prompt's TTFT alone")
    g.add_argument("--slo-itl-scale", type=float, default=1.5,
                   help="mean ITL SLO = this x the decode step of --streams streams alone")
    g.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet both SLOs")
    g.add_argument("--start-rate", type=float, default=None, help="first rate probed (default: from the capacity)")
    g.add_argument("--max-probes", type=int, default=5, help="rates probed per mode")
    g.add_argument("--probe-seconds", type=float, default=15.0, help="requests per probe = rate x this ...")
    g.add_argument("--probe-min-requests", type=int, default=20, help="... but at least this many")
    g.add_argument("--probe-max-requests", type=int, default=120, help="... and at most this many")
    args = ap.parse_args()
    for name in ("load_fraction", "attainment"):
        if not 0 < getattr(args, name) <= 1:
            ap.error(f"--{name.replace('_', '-')} must be in (0, 1]")
    unknown = set(args.goodput_modes.split(",")) - set(GOODPUT_MODES)
    if unknown:
        ap.error(f"--goodput-modes: unknown {', '.join(sorted(unknown))}; choose from {', '.join(GOODPUT_MODES)}")
    usable = sorted(os.sched_getaffinity(0))
    tools = all(shutil.which(t) for t in ("taskset", "chrt"))
    on_cpu = args.device == "cpu"
    if args.pin == "on" and (len(usable) < 2 or not tools or not on_cpu):
        ap.error("--pin on needs at least two usable cores, taskset and chrt (util-linux), and --device cpu")
    args.pin = on_cpu and (args.pin == "on" or (args.pin == "auto" and len(usable) >= 2 and tools))
    cores = args.cores = placement(args.pin)  # before this process is pinned to one core
    args.goodput_cores = usable[:2] if args.pin else None
    args.devices = 2 if on_cpu else 1  # two cores for two workers; on the GPU machine both share its one GPU
    if cores and not args.goodput:
        os.sched_setaffinity(0, {cores[0]})  # the load generator shares its core with the router
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by every worker process
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so every stack is stopped on the way out.
    # One-shot: a second SIGTERM (`timeout` and a user both sending one) must not cut the stop short.
    def on_term(*_: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(143)

    signal.signal(signal.SIGTERM, on_term)
    work = Path(tempfile.mkdtemp(prefix="tandem-interference-"))
    model_dir = write_model(args.model_dir or work / f"model-{args.model}", MODELS[args.model])
    config = json.loads((model_dir / "config.json").read_text())
    args.model_shown = {k: config.get(k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                   "num_attention_heads", "num_key_value_heads", "head_dim",
                                                   "vocab_size")}
    cap = None
    if args.goodput or args.long_every is None:
        print("calibrating: one monolithic worker alone ...", flush=True)
        try:
            cap = calibrate(model_dir, args, work / "logs")
        except RuntimeError as exc:
            print(f"calibration failed, nothing measured: {exc}", flush=True)
            return 1
        print(describe_capacity(cap), flush=True)
        if args.long_every is None:
            args.long_every = long_prompt_interval(cap, args.load_fraction)
    if args.stall_ms is None:
        args.stall_ms = 4000 * cap.decode_step_s if cap else 100.0
    if args.goodput:
        assert cap is not None
        return run_goodput(model_dir, args, work, cap)
    return run_interference(model_dir, args, work, cap)


if __name__ == "__main__":
    sys.exit(main())
