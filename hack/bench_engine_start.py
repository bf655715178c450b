#!/usr/bin/env python3
"""How long an engine takes to start with a real-size vocabulary, and what it holds after (issue 20: the
grammar's vocabulary table is built with the first grammar, not at every start).

    .venv/bin/python hack/bench_engine_start.py [--runs 5] [--merges 128000] [--first-grammar]

No Hub here, so the tokenizer is made up: a byte-level BPE with --merges random merges over the 256
byte symbols plus 256 special tokens (128,000 merges: 128,512 tokens and an 11.9 MB tokenizer.json,
about Llama 3's size), with a random-weight tiny Llama whose embeddings are that wide. Each run is a
fresh process that imports torch and the engine first, then times LLMEngine(...) alone and reports how
much its peak memory (VmHWM) grew; --first-grammar also times the first grammar's compile (importing xgrammar
and building its tables) and a second schema's.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

# The peak is read from /proc (VmHWM: this process's own), not getrusage: Linux carries ru_maxrss over
# fork and exec, so a child would start from its parent's peak.
RUN = r"""
import json, sys, time
import torch  # noqa: F401
from tandem.worker.engine import EngineConfig, LLMEngine

def peak_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024

before = peak_mb()
t0 = time.perf_counter()
engine = LLMEngine(EngineConfig(model_dir=sys.argv[1], kv_cache_bytes=1 << 22))
out = {"start_s": time.perf_counter() - t0, "peak_growth_mb": peak_mb() - before}
if sys.argv[2] == "1":
    t0 = time.perf_counter()
    engine.grammars.compile(("json_object", ""))
    t1 = time.perf_counter()
    engine.grammars.compile(("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}'))
    out |= {"first_grammar_s": t1 - t0, "next_schema_s": time.perf_counter() - t1}
print(json.dumps(out))
"""


def write_model(folder: Path, merges: int) -> Path:
    from tokenizers import Tokenizer, pre_tokenizers

    from tandem.worker.model.tiny import write_tiny_model

    rng = random.Random(0)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tokens, pairs = list(alphabet), []
    while len(pairs) < merges:
        a = tokens[rng.randrange(len(tokens))]
        b = tokens[rng.randrange(len(tokens))] if rng.random() < 0.5 else alphabet[rng.randrange(256)]
        if a + b in vocab or len(a + b) > 16:
            continue
        vocab[a + b] = len(tokens)
        tokens.append(a + b)
        pairs.append([a, b])
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
    specials += [f"<|reserved_{i}|>" for i in range(256 - len(specials))]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    cfg = {"version": "1.0", "truncation": None, "padding": None, "normalizer": None, "post_processor": None,
           "added_tokens": [{"id": len(tokens) + i, "content": s, "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": False, "special": True} for i, s in enumerate(specials)],
           "pre_tokenizer": byte_level, "decoder": byte_level,
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                     "vocab": vocab, "merges": pairs}}
    tok = Tokenizer.from_str(json.dumps(cfg))
    size = tok.get_vocab_size()
    model = write_tiny_model(folder / "model", vocab_size=size, bos_token_id=len(tokens), eos_token_id=len(tokens) + 1)
    tok.save(str(model / "tokenizer.json"))
    print(f"{size} tokens, tokenizer.json {(model / 'tokenizer.json').stat().st_size / 1e6:.1f} MB", flush=True)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--merges", type=int, default=128_000)
    parser.add_argument("--first-grammar", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp), args.merges)
        for _ in range(args.runs):
            out = subprocess.run([sys.executable, "-c", RUN, str(model), "1" if args.first_grammar else "0"],
                                 capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            print(" ".join(f"{k}={v:.3f}" for k, v in json.loads(out).items()), flush=True)


if __name__ == "__main__":
    main()
