"""Runs one scheduled step through the model: builds the flattened inputs and attention metadata.

A step is first reduced to its plan, a list of `Chunk`s (decodes first, then prefill chunks): what
every rank of a tensor-parallel group needs to run the same forward. Rank 0 publishes it
(`TPGroup.publish`) and the followers `run` it as received.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from ..model.attention import AttentionMetadata, PrefillSpan
from ..model.llama import CausalLM
from .sequence import Sequence

if TYPE_CHECKING:
    from .tp_group import TPGroup

# One sequence's part of a step: its new tokens, the position of the first, its block table.
Chunk = tuple[Seq[int], int, Seq[int]]


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, block_size: int, device: torch.device,
                 tp: TPGroup | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.tp = tp  # rank 0 of a tensor-parallel group: publishes each step's plan to the followers
        # Sliding-window layers (Gemma) need their own masks once some context outgrows the window.
        self.window = next((w for w in model.config.layer_windows if w is not None), None)

    def execute(self, batch: list[tuple[Sequence, int]], sample: list[Sequence],
                on_layer_written: Callable[[int], None] | None = None,
                spans: Seq[tuple[Sequence, int, int]] = ()) -> torch.Tensor:
        """Compute `batch` ((sequence, new tokens) pairs); float32 logits for each of `sample`, in order,
        then for each (sequence, lo, hi) of `spans` those of its positions lo..hi-1 (in this step's chunk
        of it: the prompt logprobs). Only rank 0 asks for logits; the followers compute none."""
        ordered = [(s, n) for s, n in batch if n == 1] + [(s, n) for s, n in batch if n > 1]  # decodes first
        plan: list[Chunk] = []
        first_index: dict[int, int] = {}  # id(seq) -> row of its first new token
        last_index: dict[int, int] = {}  # id(seq) -> row of its last token
        num_tokens = 0
        for seq, n in ordered:
            start = seq.num_computed_tokens
            plan.append((seq.token_ids[start:start + n], start, seq.block_table))
            first_index[id(seq)] = num_tokens
            num_tokens += n
            last_index[id(seq)] = num_tokens - 1
        rows = [last_index[id(s)] for s in sample]
        rows += [first_index[id(s)] + pos - s.num_computed_tokens for s, lo, hi in spans for pos in range(lo, hi)]
        if self.tp is None:
            return self.run(plan, rows, on_layer_written)
        with self.tp.step():  # a failed collective names the rank that caused it
            self.tp.publish(plan)
            return self.run(plan, rows, on_layer_written)

    def run(self, plan: Seq[Chunk], rows: list[int], on_layer_written: Callable[[int], None] | None = None
            ) -> torch.Tensor:
        """Run a step's plan; float32 logits of the flattened tokens at `rows` (a follower asks for none)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[PrefillSpan] = []
        decode_contexts: list[int] = []
        decode_tables: list[Seq[int]] = []
        for tokens, start, table in plan:
            n = len(tokens)
            if n == 1:
                decode_contexts.append(start + 1)
                decode_tables.append(table)
            else:
                mask = None
                if start > 0:  # built once per step, shared by every layer
                    mask = torch.ones(n, start + n, dtype=torch.bool, device=self.device).tril(diagonal=start)
                window_mask = None
                if self.window is not None and start + n > self.window:
                    queries = torch.arange(start, start + n, device=self.device)[:, None]
                    keys = torch.arange(start + n, device=self.device)[None, :]
                    window_mask = (keys <= queries) & (keys > queries - self.window)
                spans.append(PrefillSpan(len(input_ids), n, start + n,
                                         torch.tensor(table, dtype=torch.long, device=self.device), mask,
                                         window_mask))
            input_ids.extend(tokens)
            for pos in range(start, start + n):
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
        tables = decode_mask = context = decode_window_mask = None
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            tables = torch.tensor([list(t) + [0] * (width - len(t)) for t in decode_tables],
                                  dtype=torch.long, device=self.device)
            context = torch.tensor(decode_contexts, device=self.device)
            slots_pos = torch.arange(width * bs, device=self.device)[None, :]
            decode_mask = (slots_pos < context[:, None])[:, None, None, :]
            if self.window is not None:
                decode_window_mask = decode_mask & (slots_pos >= context[:, None] - self.window)[:, None, None, :]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_decode_tokens=len(decode_tables),
            decode_block_tables=tables,
            decode_mask=decode_mask,
            decode_context_lens=context,
            prefills=spans,
            decode_window_mask=decode_window_mask,
        )
        logits: torch.Tensor = self.model(torch.tensor(input_ids, dtype=torch.long, device=self.device),
                                          torch.tensor(positions, dtype=torch.long, device=self.device),
                                          self.kv_cache, meta, torch.tensor(rows, dtype=torch.long, device=self.device),
                                          on_layer_written)
        return logits
