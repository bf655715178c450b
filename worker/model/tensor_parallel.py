"""Megatron-style tensor parallelism: which heads and rows of each weight a rank holds.

Rank r of `size` ranks holds:
- attention: query heads [r * h, (r + 1) * h), h = num_heads / size, and the KV heads they read:
  num_kv_heads / size of them when size divides the KV heads; otherwise (size a multiple of the KV
  heads) the one KV head its query heads share, replicated on size / num_kv_heads ranks.
  q/k/v are split by rows (column-parallel), o_proj by columns (row-parallel).
- the MLP, and each expert's MLP alike: the intermediate size split, gate/up by rows, down by
  columns. Every rank routes every token itself (the router is replicated and its input identical on
  all ranks, since it follows an all-reduce), so the experts need no exchange of tokens; splitting
  experts across ranks instead (expert parallelism) would balance badly with few experts per layer.
- one all-reduce at the end of attention (after o_proj) and one at the end of the MLP or experts.
- everything else replicated: norms (Gemma's four included), q/k norms, the router, and the
  embeddings and LM head. Replicated rather than split by vocabulary because a split costs a
  collective per step each way (a masked all-reduce of the embeddings, a gather of the logits to the
  rank that samples), while replicated, only rank 0 computes logits (the others ask for none) and
  no rank waits for another; the price is the two vocabulary matrices in full on every rank
  (Llama-3-70B at TP 4: 2 GiB of a 35 GiB share). Whether a split wins on a GPU is to be measured.

Row-parallel biases (o_proj with attention_bias, down_proj with mlp_bias) are added once, after
the all-reduce. At size 1 nothing here runs a collective and the modules are the unsplit ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


class Shard(NamedTuple):
    """The part of a checkpoint tensor one rank loads: [start, stop) along `dim`, whose full length is `full`."""
    dim: int
    start: int
    stop: int
    full: int


class CollectiveError(RuntimeError):
    """A collective failed or timed out: some rank is gone or stuck (the engine's TPGroup says which)."""


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed process group of the all-reduces (None: the default one)

    def check(self, cfg: ModelConfig) -> None:
        """Refuse a degree the model's shapes do not split into, with the reason."""
        if self.size == 1:
            return
        problems = []
        if cfg.num_heads % self.size:
            problems.append(f"num_attention_heads {cfg.num_heads}")
        if cfg.num_kv_heads % self.size and self.size % cfg.num_kv_heads:
            problems.append(f"num_key_value_heads {cfg.num_kv_heads} (neither divides the other)")
        if any(not cfg.is_moe_layer(i) for i in range(cfg.num_layers)) and cfg.intermediate_size % self.size:
            problems.append(f"intermediate_size {cfg.intermediate_size}")
        if cfg.num_experts and cfg.moe_intermediate_size % self.size:
            problems.append(f"moe_intermediate_size {cfg.moe_intermediate_size}")
        if problems:
            raise ValueError(f"tensor parallel size {self.size} does not divide the model's {', '.join(problems)}")

    def q_heads(self, cfg: ModelConfig) -> range:
        per_rank = cfg.num_heads // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def kv_heads(self, cfg: ModelConfig) -> range:
        if cfg.num_kv_heads >= self.size:
            per_rank = cfg.num_kv_heads // self.size
            return range(self.rank * per_rank, (self.rank + 1) * per_rank)
        first = self.q_heads(cfg).start // (cfg.num_heads // cfg.num_kv_heads)  # the group of this rank's heads
        return range(first, first + 1)

    def split(self, n: int) -> range:
        """This rank's rows of an intermediate dimension of n."""
        per_rank = n // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def shard_of(self, name: str, cfg: ModelConfig) -> Shard | None:
        """The slice of the checkpoint tensor `name` this rank loads; None: all of it (replicated)."""
        if self.size == 1:
            return None
        hd = cfg.head_dim
        inter = cfg.moe_intermediate_size if ".experts." in name else cfg.intermediate_size
        leaf = name.rsplit(".", 2)[-2:]  # e.g. ["q_proj", "weight"]
        kind, param = leaf[0], leaf[-1]
        if kind == "q_proj":
            heads = self.q_heads(cfg)
            return Shard(0, heads.start * hd, heads.stop * hd, cfg.num_heads * hd)
        if kind in ("k_proj", "v_proj"):
            heads = self.kv_heads(cfg)
            return Shard(0, heads.start * hd, heads.stop * hd, cfg.num_kv_heads * hd)
        if kind in ("gate_proj", "up_proj", "w1", "w3"):
            rows = self.split(inter)
            return Shard(0, rows.start, rows.stop, inter)
        if param != "weight":  # o_proj's and down_proj's biases: added once, after the all-reduce
            return None
        if kind == "o_proj":
            heads = self.q_heads(cfg)
            return Shard(1, heads.start * hd, heads.stop * hd, cfg.num_heads * hd)
        if kind in ("down_proj", "w2"):
            rows = self.split(inter)
            return Shard(1, rows.start, rows.stop, inter)
        return None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial results in place (a no-op at size 1)."""
        if self.size > 1:
            import torch.distributed as dist

            try:
                dist.all_reduce(x, group=self.group)
            except RuntimeError as exc:  # gloo and NCCL raise RuntimeError subclasses for a lost peer or a timeout
                raise CollectiveError(f"all-reduce failed on tensor-parallel rank {self.rank}: {exc}") from exc
        return x


def row_parallel(linear: nn.Linear, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """`linear` split by input columns: each rank's partial product, summed over the ranks, plus the bias once."""
    if tp.size == 1:
        out: torch.Tensor = linear(x)
        return out
    summed = tp.all_reduce(F.linear(x, linear.weight))
    return summed if linear.bias is None else summed + linear.bias
