#!/usr/bin/env python3
"""Simulate prefill placement on the Mooncake trace's real prefix structure (issue 24).

Each trace row is a prompt of `input_length` tokens whose 512-token blocks carry `hash_ids` (equal ids:
the same prefix in production). The router's own placement code (worker/router/placement.py) chooses a
worker for each row; each simulated worker keeps an LRU prefix cache of `--cache-blocks` blocks and
prefills first come, first served at a throughput set so the prompts without any cache reuse would
keep `--utilization` of the pool busy. Reported per policy: prefix-cache hit rate (prompt tokens
served from cache / prompt tokens), TTFT p50/p90 (queueing plus prefill of the uncached tokens),
prompt tokens per worker max/mean; and the hit rate of one shared cache of the same total size (the
oracle no placement can beat, with a shared LRU).

What it leaves out: decode, KV transfer, batching, and the gap between the router's picture of a
cache and the cache itself (here both evict the same way; a real worker also pins blocks of running
requests). The real stack's run is `hack/bench_placement.py`.

    .venv/bin/python hack/sim_placement.py --workers 16 64
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem.worker.bench.stats import percentile
from tandem.worker.kv.prefix_hash import ROOT_HASH, BlockHash, hash_block
from tandem.worker.router.placement import DEFAULT_BALANCE, PLACEMENTS, Candidate, PrefillPlacer
from tandem.worker.router.prefix_index import PrefixIndex

TRACE = Path("/work/shared/traces/mooncake_conversation.jsonl")
TRACE_BLOCK = 512  # tokens per hash id in the Mooncake trace


@dataclass
class Row:
    arrival: float
    tokens: int
    hashes: list[BlockHash]  # chained, full blocks only


def load(path: Path, limit: int | None) -> list[Row]:
    rows = []
    with path.open() as fh:
        for i, line in enumerate(fh):
            if limit is not None and i >= limit:
                break
            rec = json.loads(line)
            full = rec["input_length"] // TRACE_BLOCK
            chain, parent = [], ROOT_HASH
            for hid in rec["hash_ids"][:full]:
                parent = hash_block(parent, [hid])
                chain.append(parent)
            rows.append(Row(rec["timestamp"] / 1000.0, int(rec["input_length"]), chain))
    return rows


def cached_blocks(cache: PrefixIndex, url: str, hashes: Sequence[BlockHash]) -> int:
    return cache.overlap(hashes, [url])[url]


def run_policy(rows: list[Row], policy: str, workers: int, cache_blocks: int, rate: float,
               balance: float) -> dict[str, float]:
    placer = PrefillPlacer(policy, balance)
    urls = [f"w{i:02d}" for i in range(workers)]
    cache = PrefixIndex()  # the workers' real caches (one LRU each), apart from the router's picture
    free_at = dict.fromkeys(urls, 0.0)
    prompt_tokens = dict.fromkeys(urls, 0)
    hit = total = 0
    ttfts = []
    for row in rows:
        cands = [Candidate(u, "h", queued_tokens=round(max(0.0, free_at[u] - row.arrival) * rate),
                           cache_blocks=cache_blocks) for u in urls]
        chosen = placer.choose(cands, "h", row.tokens, TRACE_BLOCK, row.hashes)
        assert chosen is not None
        placer.placed(chosen, row.tokens, row.hashes)
        url = chosen.url
        served = min(row.tokens, cached_blocks(cache, url, row.hashes) * TRACE_BLOCK)
        cache.record(url, row.hashes, cache_blocks)
        start = max(row.arrival, free_at[url])
        free_at[url] = start + (row.tokens - served) / rate
        ttfts.append(free_at[url] - row.arrival)
        hit, total = hit + served, total + row.tokens
        prompt_tokens[url] += row.tokens
    loads = list(prompt_tokens.values())
    return {"hit_rate": hit / total, "ttft_p50": percentile(ttfts, 50), "ttft_p90": percentile(ttfts, 90),
            "load_max_mean": max(loads) / statistics.mean(loads)}


def oracle_hit_rate(rows: list[Row], blocks: int) -> float:
    shared = PrefixIndex()
    hit = total = 0
    for row in rows:
        hit += min(row.tokens, cached_blocks(shared, "all", row.hashes) * TRACE_BLOCK)
        total += row.tokens
        shared.record("all", row.hashes, blocks)
    return hit / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--requests", type=int, default=None, help="first N rows (default: all)")
    ap.add_argument("--workers", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--cache-blocks", type=int, default=2000,
                    help="prefix cache per worker, in 512-token blocks (default 2000: about 1M tokens)")
    ap.add_argument("--utilization", type=float, default=0.7,
                    help="busy share of the pool if nothing were cached: sets the simulated prefill throughput")
    ap.add_argument("--balance", type=float, default=DEFAULT_BALANCE)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    rows = load(args.trace, args.requests)
    span = rows[-1].arrival - rows[0].arrival
    out: dict[str, object] = {"requests": len(rows), "cache_blocks": args.cache_blocks,
                              "utilization": args.utilization, "balance": args.balance}
    for n in args.workers:
        rate = sum(r.tokens for r in rows) / (span * n * args.utilization)  # tokens/s per worker
        oracle = oracle_hit_rate(rows, n * args.cache_blocks)
        print(f"\n{n} workers, {args.cache_blocks} blocks each, {rate:,.0f} prompt tokens/s each; "
              f"oracle (one shared cache of {n * args.cache_blocks} blocks) hit rate {oracle:.3f}")
        print(f"{'policy':<13} {'hit rate':>8} {'of oracle':>9} {'TTFT p50':>9} {'TTFT p90':>9} {'max/mean':>8}")
        res = {}
        for policy in PLACEMENTS:
            r = res[policy] = run_policy(rows, policy, n, args.cache_blocks, rate, args.balance)
            print(f"{policy:<13} {r['hit_rate']:8.3f} {r['hit_rate'] / oracle:9.2f} {r['ttft_p50']:8.2f}s "
                  f"{r['ttft_p90']:8.2f}s {r['load_max_mean']:8.2f}")
        out[str(n)] = {"oracle_hit_rate": oracle, "per_worker_tokens_per_s": rate, "policies": res}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
