#!/usr/bin/env python3
"""Prefill placement policies side by side on a real `tandem serve` stack, replaying the Mooncake trace.

For each policy one stack (router + N prefill workers + 1 decode worker, the tiny random model) is
started, `tandem bench --trace mooncake` replays the same rows (each trace `hash_id` becomes the
same words wherever it appears, so prompts that shared a 512-token block in production share their
text here, lengths scaled to the tiny model), and the prefill workers' own /metrics give the
prefix-cache hit rate (tokens served from cache / prompt tokens) and prompt tokens per worker
(max / mean). TTFT comes from the client. The oracle is one prefill worker with N times the KV cache
(one shared cache of the same total size): its hit rate only, its TTFT is not comparable.

    .venv/bin/python hack/bench_placement.py --requests 600 --rate 6
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tandem.worker.router.placement import PLACEMENTS
from tandem.worker.server.control_token import HEADER
from tandem.worker.server.ports import free_port


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def start(model: Path, work: Path, prefill: int, kv_bytes: int, policy: str) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    port = free_port()
    state_file = work / "state.json"
    argv = [sys.executable, "-m", "tandem.worker.cli", "serve", "--model", str(model), "--model-name", "tiny",
            "--port", str(port), "--prefill-workers", str(prefill), "--decode-workers", "1",
            "--kv-cache-bytes", str(kv_bytes), "--canary-interval", "0", "--placement", policy,
            "--log-dir", str(work / "logs"), "--state-file", str(state_file)]
    with (work / "serve.log").open("wb") as log:
        popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    limit = time.monotonic() + 300
    while not state_file.exists():
        if popen.poll() is not None or time.monotonic() > limit:
            raise RuntimeError(f"tandem serve did not come up: {(work / 'serve.log').read_text()[-2000:]}")
        time.sleep(0.5)
    state = json.loads(state_file.read_text())
    headers = {HEADER: Path(state["control_token_file"]).read_text().strip()}
    while time.monotonic() < limit:  # the router sends everything to decode until it has polled a prefill worker
        workers = httpx.get(f"{state['url']}/workers", headers=headers, timeout=5).json()
        if sum(w["usable"] and w["role"] == "prefill" for w in workers) == prefill:
            break
        time.sleep(0.5)
    return popen, state


def stop(popen: subprocess.Popen[bytes], state: dict[str, Any]) -> None:
    popen.send_signal(signal.SIGTERM)
    try:
        popen.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(popen.pid, signal.SIGKILL)
    for p in state["processes"]:
        with contextlib.suppress(ProcessLookupError, TypeError):
            os.kill(p["pid"], signal.SIGKILL)


def run(args: argparse.Namespace, model: Path, work: Path, policy: str, prefill: int, kv_bytes: int) -> dict[str, Any]:
    work.mkdir(parents=True)
    popen, state = start(model, work, prefill, kv_bytes, policy)
    try:
        out = work / "bench.json"
        subprocess.run([sys.executable, "-m", "tandem.worker.cli", "bench", "--url", state["url"], "--trace", "mooncake",
                        "-n", str(args.requests), "--rate", str(args.rate), "--prompt-tokens", str(args.prompt_tokens),
                        "--max-output-tokens", str(args.output_tokens), "--max-duration", "900",
                        "--json", str(out)], check=True, stdout=subprocess.DEVNULL)
        summary = json.loads(out.read_text())["summary"]
        urls = [p["url"] for p in state["processes"] if p["role"] == "prefill"]
        tokens = [metric(u, "tandem_prompt_tokens_total") for u in urls]
        hits = sum(metric(u, "tandem_prefix_cache_hits_total") for u in urls)
        queries = sum(metric(u, "tandem_prefix_cache_queries_total") for u in urls)
    finally:
        stop(popen, state)
    return {"hit_rate": hits / queries if queries else 0.0, "ttft_p50": summary["ttft_s"]["p50"],
            "ttft_p90": summary["ttft_s"]["p90"], "load_max_mean": max(tokens) / statistics.mean(tokens),
            "prompt_tokens_per_worker": tokens, "completed": summary["completed"], "failed": summary["failed"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=600, help="first N rows of the trace")
    ap.add_argument("--rate", type=float, default=6.0, help="replay rate, requests/s")
    ap.add_argument("--prefill-workers", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=512, help="median prompt after length scaling")
    ap.add_argument("--output-tokens", type=int, default=8, help="cap on output tokens (TTFT is the point)")
    ap.add_argument("--kv-cache-bytes", type=int, default=16 << 20, help="per worker (tiny model: 8 KiB a block)")
    ap.add_argument("--policies", nargs="+", default=list(PLACEMENTS), choices=PLACEMENTS)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from tandem.worker.model.tiny import write_tiny_model

    with tempfile.TemporaryDirectory(prefix="bench-placement-") as tmp:
        root = Path(tmp)
        model = write_tiny_model(root / "tiny")
        results = {p: run(args, model, root / p, p, args.prefill_workers, args.kv_cache_bytes) for p in args.policies}
        oracle = run(args, model, root / "oracle", "least-loaded", 1, args.prefill_workers * args.kv_cache_bytes)
    print(f"\n{args.requests} Mooncake rows at {args.rate:g} req/s, {args.prefill_workers} prefill workers, "
          f"{args.kv_cache_bytes >> 20} MiB KV each; oracle (1 worker, {args.prefill_workers}x the cache) "
          f"hit rate {oracle['hit_rate']:.3f}")
    print(f"{'policy':<13} {'hit rate':>8} {'of oracle':>9} {'TTFT p50':>9} {'TTFT p90':>9} {'max/mean':>8} {'failed':>6}")
    for p, r in results.items():
        print(f"{p:<13} {r['hit_rate']:8.3f} {r['hit_rate'] / max(oracle['hit_rate'], 1e-9):9.2f} "
              f"{r['ttft_p50'] * 1e3:7.0f}ms {r['ttft_p90'] * 1e3:7.0f}ms {r['load_max_mean']:8.2f} {r['failed']:6d}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "oracle": oracle,
                                         "policies": results}, indent=2))


if __name__ == "__main__":
    main()
