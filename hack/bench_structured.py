#!/usr/bin/env python3
"""What a grammar costs (structured outputs, issue 20): the engine's output tokens/s for the same batch
with and without a JSON-schema grammar on every request, and for a batch where half the requests have
one, in one run on one model.

    .venv/bin/python hack/bench_structured.py [--batch 1 16] [--tokens 64] [--vocab 2048] [--json OUT]

Every request generates exactly --tokens tokens: the free ones with ignore_eos, the constrained ones
under a schema (an array of at least 500 objects) that cannot complete sooner, so both take the same
number of steps. A random-weight Llama (tandem's own writer) with the test tokenizer (512 tokens: the
logits are --vocab wide, the grammar's token table has 512 entries, so a real 128k vocabulary makes the
mask dearer than here). The fastest of REPEATS runs counts (a shared machine is noisy). Grammar
compilation (once per schema, then cached) is timed on its own.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

REPEATS = 5
MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=32, max_position_embeddings=4096)
# Long enough not to complete within the run (at least 30 objects, each 10+ tokens).
SCHEMA = {"type": "array", "minItems": 30, "items": {
    "type": "object", "required": ["name", "kind"],
    "properties": {"name": {"type": "string", "maxLength": 8}, "kind": {"enum": ["alpha", "beta", "gamma"]}}}}


MASK_TIME = [0.0, 0]  # seconds spent in the engine's mask_logits, and its calls


def _timed_masking() -> None:
    """Count the time the engine spends masking (fill the batch's bitmask + apply it): the grammar's own
    cost per step, apart from everything else that differs between free and constrained outputs (free
    random tokens are often invalid UTF-8, which the detokenizer holds back and decodes again)."""
    from tandem.worker.engine import llm_engine

    inner = llm_engine.mask_logits

    def timed(*args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        inner(*args, **kwargs)
        MASK_TIME[0] += time.perf_counter() - start
        MASK_TIME[1] += 1

    llm_engine.mask_logits = timed  # type: ignore[assignment]


def run(engine: Any, batch: int, tokens: int, constrained: int, tag: str) -> tuple[float, int]:
    """Seconds for one batch and the tokens it produced."""
    from tandem.worker.engine import SamplingParams

    free = SamplingParams(max_tokens=tokens, temperature=1.0, seed=1, ignore_eos=True)
    schema = SamplingParams(max_tokens=tokens, temperature=1.0, seed=1, grammar=("json_schema", json.dumps(SCHEMA)))
    prompts = [[5 + (i * 7 + j) % 200 for j in range(16)] for i in range(batch)]
    MASK_TIME[:] = [0.0, 0]
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, schema if i < constrained else free)
    count = sum(len(out.new_token_ids) for out in engine.iter_outputs())
    return time.perf_counter() - start, count


def best_of(engine: Any, batch: int, tokens: int, configs: dict[str, int]) -> dict[str, float]:
    """tokens/s of each configuration (name -> constrained requests), the fastest of REPEATS; the
    configurations take turns, so that the machine's load falls on each alike."""
    best = dict.fromkeys(configs, 0.0)
    for r in range(REPEATS):
        for name, constrained in configs.items():
            secs, n = run(engine, batch, tokens, constrained, f"{name}-{batch}-{r}")
            if n != batch * tokens:
                raise RuntimeError(f"{name}: {n} tokens instead of {batch * tokens} (a grammar completed early)")
            if n / secs > best[name]:
                best[name] = n / secs
                if name == "all":
                    best["mask_ms_per_step"] = MASK_TIME[0] / max(MASK_TIME[1], 1) * 1000
                    best["mask_share"] = MASK_TIME[0] / secs
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from tandem.worker.engine import EngineConfig, LLMEngine
    from tandem.worker.model.tiny import write_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(Path(tmp) / "bench", vocab_size=args.vocab, **MODEL)
        engine = LLMEngine(EngineConfig(model_dir=str(model_dir), kv_cache_bytes=256 << 20))
        start = time.perf_counter()
        engine.grammars.compile(("json_schema", '{"type": "object", "required": ["a"]}'))
        setup_s = time.perf_counter() - start  # the first grammar: importing xgrammar, its tokenizer table
        start = time.perf_counter()
        engine.grammars.compile(("json_schema", json.dumps(SCHEMA)))
        compile_s = time.perf_counter() - start
        _timed_masking()
        run(engine, 2, 4, 1, "warm-up")  # first steps, xgrammar's first matcher, the control-token table
        rows = []
        for batch in args.batch:
            configs = {"free": 0, "all": batch, **({"half": batch // 2} if batch >= 2 else {})}
            tok_s = best_of(engine, batch, args.tokens, configs)
            row: dict[str, Any] = {"batch": batch, "free_tok_s": tok_s["free"],
                                   "mask_ms_per_step": tok_s["mask_ms_per_step"], "mask_share": tok_s["mask_share"]}
            for label in ("all", "half"):
                if label in tok_s:
                    row[f"{label}_tok_s"] = tok_s[label]
                    row[f"{label}_ratio"] = tok_s[label] / tok_s["free"]
            rows.append(row)
    print(f"model: random Llama {MODEL['num_hidden_layers']} layers x {MODEL['hidden_size']}, vocab {args.vocab}; "
          f"{args.tokens} tokens per request; CPU")
    print(f"first grammar on a worker (xgrammar import + tokenizer table): {setup_s * 1000:.0f} ms; "
          f"compiling the benchmark's schema after that (once per schema, then cached): {compile_s * 1000:.1f} ms")
    print(f"{'batch':>5} {'free tok/s':>11} {'all constrained':>16} {'ratio':>6} {'half constrained':>17} {'ratio':>6} "
          f"{'mask ms/step':>13} {'mask share':>11}")
    for row in rows:
        half = (f"{row['half_tok_s']:>17.1f} {row['half_ratio']:>6.2f}" if "half_tok_s" in row else f"{'-':>17} {'-':>6}")
        print(f"{row['batch']:>5} {row['free_tok_s']:>11.1f} {row['all_tok_s']:>16.1f} {row['all_ratio']:>6.2f} {half} "
              f"{row['mask_ms_per_step']:>13.2f} {row['mask_share']:>11.1%}")
    if args.json:
        args.json.write_text(json.dumps({"setup_s": setup_s, "compile_s": compile_s, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
