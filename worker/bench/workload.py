"""What a benchmark sends, and when: synthetic arrivals or a time- and length-scaled trace.

Prompts are made of words from a fixed list, so any tokenizer accepts them. A prompt's token
count depends on the tokenizer, so `calibrate` measures tokens per word on the target once and
`RequestSpec.words` is sized from it. Trace `hash_ids` (shared-prefix blocks) become shared
leading text, so prefix caching and prefix-aware placement see the sharing the trace had.
"""

from __future__ import annotations

import csv
import json
import math
import random
import statistics
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

WORDS = ["time", "river", "stone", "light", "garden", "quiet", "market", "yellow", "window", "paper", "engine", "forest", "cloud", "simple", "number", "letter", "music", "winter", "summer", "silver", "orange", "bridge", "castle", "circle", "ladder", "pocket", "rabbit", "signal", "travel", "valley", "wonder", "anchor", "basket", "candle", "dragon", "empire", "fabric", "harbor", "island", "jacket", "kettle", "lemon", "mirror", "needle", "ocean", "pepper", "rocket", "saddle", "tunnel", "velvet", "wagon", "zebra"]

TRACES_DIR = Path("/work/shared/traces")
KNOWN_TRACES = {"mooncake": "mooncake_conversation.jsonl", "azure-code": "azure_llm_2023_code.csv"}


@dataclass
class RequestSpec:
    send_at: float  # seconds after the start
    prompt_tokens: int  # wanted prompt length (approximate: see calibrate)
    output_tokens: int
    tag: str = "default"
    prefix_blocks: list[int] = field(default_factory=list)  # trace hash ids: shared-prefix identity


@dataclass
class TraceRow:
    arrival: float  # seconds from the trace start
    prompt_tokens: int
    output_tokens: int
    hash_ids: list[int]


def all_at_once(rate: float) -> bool:
    """`rate` (req/s) 0 or infinite: send every request at the start (as fast as the server takes them)."""
    return rate <= 0 or math.isinf(rate)


def arrivals(n: int, rate: float, process: str, rng: random.Random) -> list[float]:
    """Send times for n requests at `rate` req/s; rate <= 0 or inf means all at once."""
    if n <= 0:
        return []
    if all_at_once(rate):
        return [0.0] * n
    if process == "constant":
        return [i / rate for i in range(n)]
    if process != "poisson":
        raise ValueError(f"unknown arrival process {process!r}; expected poisson or constant")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def synthetic(n: int, rate: float, process: str, prompt_tokens: int, output_tokens: int,
              seed: int = 0, tag: str = "default") -> list[RequestSpec]:
    if prompt_tokens < 1 or output_tokens < 1:
        raise ValueError("prompt and output lengths must be at least 1 token")
    rng = random.Random(seed)
    return [RequestSpec(t, prompt_tokens, output_tokens, tag) for t in arrivals(n, rate, process, rng)]


def resolve_trace(name_or_path: str) -> Path:
    if name_or_path in KNOWN_TRACES:
        return TRACES_DIR / KNOWN_TRACES[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"trace {name_or_path!r} is neither a known trace ({', '.join(KNOWN_TRACES)}) "
                         f"nor a file")
    return path


def load_trace(path: Path, limit: int, offset: int = 0) -> list[TraceRow]:
    """Rows [offset, offset+limit) of a Mooncake-style .jsonl or an Azure-style .csv trace."""
    rows: list[TraceRow] = []
    if path.suffix == ".jsonl":
        with path.open() as fh:
            for i, line in enumerate(fh):
                if i < offset:
                    continue
                if len(rows) >= limit:
                    break
                rec = json.loads(line)
                rows.append(TraceRow(rec["timestamp"] / 1000.0, int(rec["input_length"]),
                                     int(rec["output_length"]), list(rec.get("hash_ids", []))))
    elif path.suffix == ".csv":
        with path.open(newline="") as fh:
            start: datetime | None = None
            for i, rec in enumerate(csv.DictReader(fh)):
                stamp = datetime.fromisoformat(rec["TIMESTAMP"][:26])
                start = start or stamp
                if i < offset:
                    continue
                if len(rows) >= limit:
                    break
                rows.append(TraceRow((stamp - start).total_seconds(), int(rec["ContextTokens"]),
                                     int(rec["GeneratedTokens"]), []))
    else:
        raise ValueError(f"trace {path} must be .jsonl (Mooncake format) or .csv (Azure format)")
    if not rows:
        raise ValueError(f"trace {path} has no rows at offset {offset}")
    base = rows[0].arrival
    for row in rows:
        row.arrival -= base
    return rows


@dataclass
class TraceScaling:
    time_scale: float  # trace seconds are multiplied by this
    length_scale: float  # token lengths are multiplied by this, then clamped
    max_prompt_tokens: int
    max_output_tokens: int
    description: str


def scale_trace(rows: list[TraceRow], *, rate: float | None, time_scale: float | None,
                target_median_prompt: int, length_scale: float | None, max_prompt_tokens: int,
                max_output_tokens: int) -> tuple[list[RequestSpec], TraceScaling]:
    """Map a trace onto what this machine can run, and say how in plain words."""
    span = rows[-1].arrival - rows[0].arrival
    trace_rate = (len(rows) - 1) / span if span > 0 else math.inf
    if time_scale is None:
        time_scale = trace_rate / rate if rate and span > 0 else 1.0
    median_prompt = statistics.median(r.prompt_tokens for r in rows)
    if length_scale is None:
        length_scale = min(1.0, target_median_prompt / median_prompt) if median_prompt else 1.0
    specs = []
    for row in rows:
        p = min(max_prompt_tokens, max(1, round(row.prompt_tokens * length_scale)))
        o = min(max_output_tokens, max(1, round(row.output_tokens * length_scale)))
        specs.append(RequestSpec(row.arrival * time_scale, p, o, "trace", row.hash_ids))
    new_rate = trace_rate / time_scale if time_scale else math.inf
    pacing = ("all at once (arrival times x0)" if time_scale == 0
              else f"arrival times x{time_scale:.4g} ({trace_rate:.3g} -> {new_rate:.3g} req/s)")
    description = (
        f"{len(rows)} requests; {pacing}; "
        f"lengths x{length_scale:.4g} (median prompt {median_prompt:.0f} -> "
        f"{statistics.median(s.prompt_tokens for s in specs):.0f} tokens), clamped to "
        f"prompt <= {max_prompt_tokens} and output <= {max_output_tokens} tokens"
    )
    return specs, TraceScaling(time_scale, length_scale, max_prompt_tokens, max_output_tokens, description)


def words_for(tokens: float, tokens_per_word: float) -> int:
    return max(1, round(tokens / tokens_per_word))


def prompt_text(spec: RequestSpec, index: int, tokens_per_word: float, block_tokens: int = 512,
                length_scale: float = 1.0) -> str:
    """Deterministic text of about spec.prompt_tokens tokens.

    Each trace prefix block id becomes the same words wherever it appears (shared prefixes stay
    shared); the rest is unique to the request so unrelated requests do not share a prefix.
    """
    total_words = words_for(spec.prompt_tokens, tokens_per_word)
    words: list[str] = []
    per_block = max(1, words_for(block_tokens * length_scale, tokens_per_word))
    for block in spec.prefix_blocks[:-1]:  # the last block is usually partial and unique
        if len(words) + per_block > total_words:
            break
        rng = random.Random(f"block-{block}")
        words.extend(rng.choice(WORDS) for _ in range(per_block))
    rng = random.Random(f"request-{index}")
    words.insert(0, f"r{index}") if not words else words.append(f"r{index}")
    while len(words) < total_words:
        words.append(rng.choice(WORDS))
    return " ".join(words[:total_words])
