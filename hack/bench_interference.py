#!/usr/bin/env python3
"""Interference benchmark: long prompts arriving into steady decode traffic.

For each mode (monolithic, chunked, disaggregated) this starts a local stack on the same model
(`tandem serve`'s supervisor), keeps `--streams` decode streams running (short prompt, long
output, closed loop), injects a `--long-prompt-tokens` prompt every `--long-every` seconds,
and reports the decode streams' inter-token latency (p50/p99, and p99/p50) and the long
prompts' TTFT. The claim it checks: with disaggregation, a long prefill does not stall running
decodes, so ITL p99 stays near its p50; in monolithic mode every long prefill freezes the batch.

Every worker process runs torch with one thread (OMP_NUM_THREADS=1) so the modes differ only in
where prefill runs: monolithic and chunked use one worker (one core); disaggregated uses a
prefill and a decode worker (two cores), which is the point of disaggregation, and is said in
the output. Absolute times depend on this machine; compare the ratios.

    .venv/bin/python hack/bench_interference.py --duration 40 --json /tmp/interference.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
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
from tandem.worker.server.supervisor import LocalStack, StackSpec, free_port

MODEL: dict[str, Any] = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=32, max_position_embeddings=4096)


def write_model(folder: Path) -> Path:
    from tandem.worker.model.tiny import write_tiny_model

    if not (folder / "config.json").is_file():
        write_tiny_model(folder, **MODEL)
    return folder


def wait_ready(stack: LocalStack, timeout: float = 300) -> None:
    limit = time.monotonic() + timeout
    with httpx.Client() as client:
        while time.monotonic() < limit:
            if stack.dead():
                raise RuntimeError(f"{stack.dead()[0].name} exited:\n{stack.dead()[0].log_tail()}")
            if all(ok for ok, _ in stack.poll_ready(client).values()):
                return
            time.sleep(0.5)
    raise RuntimeError("stack not ready in time")


def random_ids(n: int, rng: random.Random, vocab: int = 512) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


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
                spec = RequestSpec(0, args.short_prompt_tokens, args.decode_tokens, "decode")
                res = await send_one(client, url, "bench", spec, random_ids(args.short_prompt_tokens, rng), 300)
                if res.start >= measure_from:
                    decode_results.append(res)

        async def long_prompts() -> None:
            await asyncio.sleep(args.warmup)
            tasks = []
            while time.monotonic() < end - 2 and args.long_every < 1e8:
                spec = RequestSpec(0, args.long_prompt_tokens, 2, "long")
                tasks.append(asyncio.create_task(
                    send_one(client, url, "bench", spec, random_ids(args.long_prompt_tokens, rng), 300)))
                await asyncio.sleep(max(0.0, min(args.long_every, end - 2 - time.monotonic())))
            long_results.extend(await asyncio.gather(*tasks))

        await asyncio.gather(long_prompts(), *(decode_stream(i) for i in range(args.streams)))
    return decode_results, long_results


def summarize(decode: list[RequestResult], long: list[RequestResult], stall_s: float) -> dict[str, Any]:
    itls = [x for r in decode if r.ok for x in r.itls]
    ttft_long = [r.ttft for r in long if r.ok and r.ttft is not None]
    p50, p99, p999 = percentile(itls, 50), percentile(itls, 99), percentile(itls, 99.9)
    return {
        "itl_samples": len(itls), "itl_p999_ms": p999 and p999 * 1000,
        "stalls": sum(x > stall_s for x in itls),  # decode gaps longer than --stall-ms
        "decode_requests": len(decode), "decode_failed": sum(not r.ok for r in decode),
        "long_requests": len(long), "long_failed": sum(not r.ok for r in long),
        "itl_p50_ms": p50 and p50 * 1000, "itl_p99_ms": p99 and p99 * 1000,
        "itl_max_ms": max(itls) * 1000 if itls else None,
        "itl_p99_over_p50": (p99 / p50) if p50 and p99 else None,
        "long_ttft_p50_ms": (v := percentile(ttft_long, 50)) and v * 1000,
        "long_ttft_p99_ms": (v := percentile(ttft_long, 99)) and v * 1000,
    }


def run_mode(mode: str, model_dir: Path, args: argparse.Namespace, log_root: Path) -> dict[str, Any]:
    baseline = mode == "baseline"  # monolithic with no long prompts: this machine's noise floor
    if baseline:
        mode, args = "monolithic", argparse.Namespace(**{**vars(args), "long_every": 1e9})
    port = free_port()
    spec = StackSpec(model_dir=model_dir, model_name="bench", mode=mode, prefill_workers=1, decode_workers=1,
                     port=port, log_dir=log_root / mode, kv_cache_bytes=256 << 20,
                     max_num_batched_tokens=args.chunk if mode == "chunked" else None)
    stack = LocalStack(spec)
    stack.start()
    try:
        wait_ready(stack)
        decode, long = asyncio.run(run_load(stack.url, args))
    finally:
        stack.stop()
    out = summarize(decode, long, args.stall_ms / 1000)
    out["mode"] = "baseline (no long prompts)" if baseline else mode
    out["cores_for_workers"] = 2 if mode == "disaggregated" else 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="baseline,monolithic,chunked,disaggregated",
                    help="baseline = monolithic without long prompts (the noise floor of this machine)")
    ap.add_argument("--stall-ms", type=float, default=250.0, help="a decode gap longer than this is a stall")
    ap.add_argument("--duration", type=float, default=40.0, help="measured seconds per mode")
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--streams", type=int, default=6, help="concurrent decode streams")
    ap.add_argument("--short-prompt-tokens", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--long-prompt-tokens", type=int, default=1536)
    ap.add_argument("--long-every", type=float, default=3.0, help="seconds between long prompts")
    ap.add_argument("--chunk", type=int, default=256, help="token budget per step in chunked mode")
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by every worker process
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so every stack is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="tandem-interference-"))
    model_dir = write_model(args.model_dir or work / "model")
    results = []
    for mode in args.modes.split(","):
        print(f"running {mode} ...", flush=True)
        results.append(run_mode(mode, model_dir, args, work / "logs"))
        print(json.dumps(results[-1]), flush=True)
    print(f"\nmodel {MODEL}; {args.streams} decode streams ({args.short_prompt_tokens}-token prompts, "
          f"{args.decode_tokens} tokens each) + one {args.long_prompt_tokens}-token prompt every {args.long_every}s; "
          f"{args.duration:.0f}s measured per mode; OMP_NUM_THREADS=1 per worker")
    print(f"{'mode':<28}{'ITL p50':>9}{'p99':>8}{'p99.9':>8}{'max':>8}{'p99/p50':>9}{'p99.9/p50':>10}"
          f"{'stalls':>8}{'long TTFT p50':>15}{'fails':>7}")
    for r in results:
        ttft = f"{r['long_ttft_p50_ms']:.0f}" if r["long_ttft_p50_ms"] else "-"
        print(f"{r['mode']:<28}{r['itl_p50_ms']:>9.1f}{r['itl_p99_ms']:>8.1f}{r['itl_p999_ms']:>8.1f}"
              f"{r['itl_max_ms']:>8.0f}{r['itl_p99_over_p50']:>9.1f}{r['itl_p999_ms'] / r['itl_p50_ms']:>10.1f}"
              f"{r['stalls']:>8}{ttft:>15}{r['decode_failed'] + r['long_failed']:>7}")
    print(f"(ms; stalls = decode gaps > {args.stall_ms:.0f} ms out of each mode's itl_samples)")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "model": MODEL,
                                         "results": results}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
