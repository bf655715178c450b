#!/usr/bin/env python3
"""xgrammar against llguidance for the engine's structured outputs (issue 20: "compare them on this
engine and say why you chose one"), on the same tokenizer, schemas and documents, in one run.

    .venv/bin/pip install --target /tmp/llg llguidance   # not a Tandem dependency
    PYTHONPATH=/tmp/llg .venv/bin/python hack/compare_grammar_libs.py [--vocab 32000] [--json OUT]

What the engine needs of the library, per request: compile the schema (once, cached by schema), then at
every decode step fill the batch's token bitmask for this request and accept the sampled token; a
migration replays the accepted tokens into a new matcher. Measured here for each library:
- vocabulary setup: the library's view of the tokenizer, once per process;
- compile: a fresh compiler and schema, median of 5 (what the first request with a new schema waits);
- mask: the time to fill one request's bitmask before each token of a valid document, forced token by
  token (what every constrained decode step adds), mean and p99 over the document;
- the engine's JSON form for both (no free whitespace, separators ", " and ": ");
- that every token of the document is allowed by the mask before it and the matcher ends accepting
  (a library that masks a valid token out would corrupt outputs).
The tokenizer is a byte-level BPE trained here on Python's standard library sources (no Hub here):
the real families' vocabularies are 32k-256k; the mask cost grows with the vocabulary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

TOOL_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"], "properties": {
    "name": {"const": "get_weather"},
    "arguments": {"type": "object", "additionalProperties": False, "required": ["city", "unit", "days"],
                  "properties": {"city": {"type": "string", "maxLength": 40},
                                 "unit": {"enum": ["celsius", "fahrenheit"]},
                                 "days": {"type": "integer", "minimum": 1, "maximum": 14}}}}}
LIST_SCHEMA = {"type": "array", "minItems": 30, "items": {
    "type": "object", "required": ["name", "kind"], "additionalProperties": False,
    "properties": {"name": {"type": "string", "maxLength": 8}, "kind": {"enum": ["alpha", "beta", "gamma"]}}}}
CASES: dict[str, tuple[dict[str, Any], Any]] = {
    "tool call": (TOOL_SCHEMA, {"name": "get_weather", "arguments": {"city": "Zurich", "unit": "celsius", "days": 3}}),
    "list of 30": (LIST_SCHEMA, [{"name": f"n{i}x", "kind": ("alpha", "beta", "gamma")[i % 3]} for i in range(30)]),
}


def train_tokenizer(vocab: int, folder: Path) -> Any:
    """A byte-level BPE (GPT-2/Llama 3 style) trained on the standard library's sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(str(p) for p in Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))[:1500]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = (Path(f).read_text(encoding="utf-8", errors="replace") for f in files)
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|eos|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), eos_token="<|eos|>")


def median_seconds(fn: Callable[[], object], repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def allowed(bitmask: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def run_xgrammar(hf: Any, schema: str, tokens: list[int]) -> dict[str, Any]:
    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf))
    setup_s = time.perf_counter() - start

    def compile_fresh() -> Any:
        return xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False).compile_json_schema(
            schema, any_whitespace=False, strict_mode=True)
    compile_s = median_seconds(compile_fresh)
    matcher = xgr.GrammarMatcher(compile_fresh())
    bitmask = xgr.allocate_token_bitmask(1, len(hf))
    masks, ok = [], True
    for token in tokens:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        masks.append(time.perf_counter() - start)
        ok = ok and allowed(bitmask, token) and matcher.accept_token(token)
    return {"setup_s": setup_s, "compile_s": compile_s, "masks": masks,
            "valid": ok and (matcher.is_terminated() or matcher.accept_token(hf.eos_token_id))}


def run_llguidance(hf: Any, schema: str, tokens: list[int]) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf))
    setup_s = time.perf_counter() - start

    def compile_fresh() -> Any:  # llguidance builds its lexer lazily: part of the cost moves to the masks
        return llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={
            "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}))
    compile_s = median_seconds(compile_fresh)
    matcher = compile_fresh()
    if matcher.is_error():
        raise SystemExit(f"llguidance refused the schema: {matcher.get_error()}")
    bitmask = llguidance.torch.allocate_token_bitmask(1, len(hf))
    masks, ok = [], True
    for token in tokens:
        start = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        masks.append(time.perf_counter() - start)
        ok = ok and allowed(bitmask, token) and matcher.consume_token(token)
    return {"setup_s": setup_s, "compile_s": compile_s, "masks": masks, "valid": ok and matcher.is_accepting()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import importlib.metadata as md

    versions = {name: md.version(name) for name in ("xgrammar", "llguidance")}
    with tempfile.TemporaryDirectory() as folder:
        hf = train_tokenizer(args.vocab, Path(folder))
    print(f"tokenizer: byte-level BPE, {len(hf)} tokens; {versions}", file=sys.stderr)
    rows = []
    for case, (schema, document) in CASES.items():
        text = json.dumps(document)  # ", " and ": ": xgrammar's form without any_whitespace, as the engine asks
        tokens = hf.encode(text, add_special_tokens=False)
        for lib, run in (("xgrammar", run_xgrammar), ("llguidance", run_llguidance)):
            result = run(hf, json.dumps(schema), tokens)
            masks = sorted(result["masks"])
            rows.append({"case": case, "library": lib, "version": versions[lib], "tokens": len(tokens),
                         "vocab_setup_ms": 1e3 * result["setup_s"],
                         "compile_ms": 1e3 * result["compile_s"], "mask_mean_us": 1e6 * statistics.mean(masks),
                         "mask_p99_us": 1e6 * masks[min(len(masks) - 1, int(0.99 * len(masks)))],
                         "valid": result["valid"]})
    print("| schema | library | tokens | vocabulary setup ms | compile ms | mask us/token mean | p99 | document accepted |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['library']} {r['version']} | {r['tokens']} | {r['vocab_setup_ms']:.0f} | "
              f"{r['compile_ms']:.1f} | "
              f"{r['mask_mean_us']:.0f} | {r['mask_p99_us']:.0f} | {'yes' if r['valid'] else 'NO'} |")
    if args.json:
        args.json.write_text(json.dumps({"vocab": len(hf), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
