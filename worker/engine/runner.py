"""Runs one scheduled step through the model: builds the flattened inputs and attention metadata."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..model.attention import AttentionMetadata, PrefillSpan
from ..model.llama import CausalLM
from .sequence import Sequence


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        # Sliding-window layers (Gemma) need their own masks once some context outgrows the window.
        self.window = next((w for w in model.config.layer_windows if w is not None), None)

    def execute(self, batch: list[tuple[Sequence, int]], sample: list[Sequence],
                on_layer_written: Callable[[int], None] | None = None) -> torch.Tensor:
        """Compute `batch` ((sequence, new tokens) pairs); float32 logits for each of `sample`, in order."""
        decodes = [(s, n) for s, n in batch if n == 1]
        prefills = [(s, n) for s, n in batch if n > 1]
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_index: dict[int, int] = {}  # id(seq) -> row of its last token
        spans: list[PrefillSpan] = []
        for seq, n in decodes + prefills:
            start = seq.num_computed_tokens
            if n > 1:
                mask = None
                if start > 0:  # built once per step, shared by every layer
                    mask = torch.ones(n, start + n, dtype=torch.bool, device=self.device).tril(diagonal=start)
                window_mask = None
                if self.window is not None and start + n > self.window:
                    queries = torch.arange(start, start + n, device=self.device)[:, None]
                    keys = torch.arange(start + n, device=self.device)[None, :]
                    window_mask = (keys <= queries) & (keys > queries - self.window)
                spans.append(PrefillSpan(len(input_ids), n, start + n,
                                         torch.tensor(seq.block_table, dtype=torch.long, device=self.device), mask,
                                         window_mask))
            input_ids.extend(seq.token_ids[start:start + n])
            table = seq.block_table
            for pos in range(start, start + n):
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
            last_index[id(seq)] = len(input_ids) - 1
        decode_tables = decode_mask = context = decode_window_mask = None
        if decodes:
            width = max(len(s.block_table) for s, _ in decodes)
            decode_tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s, _ in decodes],
                                         dtype=torch.long, device=self.device)
            context = torch.tensor([s.num_computed_tokens + 1 for s, _ in decodes], device=self.device)
            slots_pos = torch.arange(width * bs, device=self.device)[None, :]
            decode_mask = (slots_pos < context[:, None])[:, None, None, :]
            if self.window is not None:
                decode_window_mask = decode_mask & (slots_pos >= context[:, None] - self.window)[:, None, None, :]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            num_decode_tokens=len(decodes),
            decode_block_tables=decode_tables,
            decode_mask=decode_mask,
            decode_context_lens=context,
            prefills=spans,
            decode_window_mask=decode_window_mask,
        )
        rows = torch.tensor([last_index[id(s)] for s in sample], dtype=torch.long, device=self.device)
        logits: torch.Tensor = self.model(torch.tensor(input_ids, dtype=torch.long, device=self.device),
                                          torch.tensor(positions, dtype=torch.long, device=self.device),
                                          self.kv_cache, meta, rows, on_layer_written)
        return logits
