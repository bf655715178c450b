#!/usr/bin/env python3
"""The serving path on a CUDA device, end to end: `tandem serve`'s stack with its workers on the GPU.

    python3 hack/gpu_serve_check.py [--json OUT]

Writes a small random Llama, then serves it twice through the real router and worker processes:
disaggregated with both workers on cuda (prefill and decode each a process on the one GPU, the KV
going GPU -> host -> tcp -> host -> GPU), and monolithic on the CPU as the reference. The same greedy
prompts must give the same tokens (float32 on both). It also reports each run's median TTFT and
inter-token latency over a few sequential streams: absolute figures, meaningful from the GPU only.
Part of hack/gpu_checks.sh; runs on a CPU-only machine too (then both stacks use the CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from tandem.worker.bench.client import RequestResult, send_one
from tandem.worker.bench.workload import RequestSpec
from tandem.worker.model.tiny import write_tiny_model
from tandem.worker.server.ports import free_port
from tandem.worker.server.supervisor import LocalStack, StackSpec

MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=32, vocab_size=2048, max_position_embeddings=4096)
# Token ids the router accepts: the tiny tokenizer knows 512.
PROMPTS = [[10 + (7 * i + 13 * j) % 500 for j in range(length)] for i, length in enumerate((5, 40, 300, 1000))]
MAX_TOKENS = 48


def stream(url: str, prompt: list[int]) -> RequestResult:
    """One greedy stream through the router, timed per token (tandem bench's client)."""
    async def one() -> RequestResult:
        async with httpx.AsyncClient() as client:
            return await send_one(client, url, "gpu-check", RequestSpec(0.0, len(prompt), MAX_TOKENS), prompt,
                                  timeout=120, token_ids=True)

    result = asyncio.run(one())
    if not result.ok or len(result.token_ids) != MAX_TOKENS:
        raise RuntimeError(f"the request failed: {result.error or f'{len(result.token_ids)} token ids came back'}")
    return result


def run(model_dir: Path, logs: Path, mode: str, device: str) -> dict[str, Any]:
    spec = StackSpec(model_dir=model_dir, model_name="gpu-check", mode=mode, device=device, port=free_port(),
                     log_dir=logs / f"{mode}-{device}", transport="tcp", kv_cache_bytes=256 << 20)
    stack = LocalStack(spec)
    stack.start()
    try:
        started = time.monotonic()
        stack.wait_ready(240)
        ready_s = time.monotonic() - started
        stream(stack.url, PROMPTS[0])  # warm-up (CUDA kernels, allocator)
        results = [stream(stack.url, prompt) for prompt in PROMPTS]
        tokens = [r.token_ids for r in results]
        ttfts = [r.ttft for r in results if r.ttft is not None]
        gaps = [gap for r in results for gap in r.itls]
        return {"mode": mode, "device": device, "ready_s": round(ready_s, 1), "tokens": tokens,
                "ttft_ms_median": round(statistics.median(ttfts) * 1e3, 2),
                "itl_ms_median": round(statistics.median(gaps) * 1e3, 3) if gaps else None}
    finally:
        stack.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(Path(tmp) / "model", **MODEL)
        served = run(model_dir, Path(tmp) / "logs", "disaggregated", device)
        reference = run(model_dir, Path(tmp) / "logs", "monolithic", "cpu")
    same = served["tokens"] == reference["tokens"]
    for r in (served, reference):
        print(f"{r['mode']:>13} on {r['device']}: ready in {r['ready_s']} s, TTFT median {r['ttft_ms_median']} ms, "
              f"ITL median {r['itl_ms_median']} ms")
    print(f"greedy tokens of {len(PROMPTS)} prompts x {MAX_TOKENS}: "
          + ("identical" if same else "DIFFERENT") + f" ({served['mode']} on {device} vs monolithic on cpu)")
    if args.json:
        args.json.write_text(json.dumps({"identical": same, "served": served, "reference": reference}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
