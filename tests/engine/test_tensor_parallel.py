"""Tensor parallelism on the CPU (gloo): tokens equal transformers' greedy output at TP 1, 2 and 4 for
each kind of model, each rank loads only its share of the weights, and a follower rank that dies or
hangs makes rank 0 fail naming it, within the collective timeout.

The models are tiny random configs written by transformers (`hf_model`); 4 query heads and 2 KV heads
unless said otherwise, so TP 4 holds each KV head on two ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tandem.worker.engine import EngineConfig, LLMEngine, SamplingParams
from tandem.worker.engine.tp_group import TensorParallelError, launch_engine
from tandem.worker.model import loader
from tandem.worker.model.config import ModelConfig
from tandem.worker.model.loader import load_model
from tandem.worker.model.tensor_parallel import TensorParallel

from .conftest import GREEDY, HFModel, random_prompts

PROMPTS = (3, 17, 40, 64, 9)
NEW_TOKENS = 8
WINDOW = 8
# name -> (family, transformers config keys on top of conftest.TINY)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # one KV head per query head, and every bias (q/k/v split with their heads, o_proj's and down_proj's
    # added once after the all-reduce; random, see _model)
    "llama": ("llama", dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True)),
    "llama-gqa": ("llama", {}),  # 2 KV heads: replicated at TP 4
    # experts and a dense layer, q/k norms, renormalised routing weights
    "qwen3_moe": ("qwen3_moe", dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32,
                                    norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1])),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    # Gemma's norms, an 8-token window on layer 0, attention and final logit soft-capping
    "gemma2": ("gemma2", dict(sliding_window=WINDOW, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
    "gemma3": ("gemma3", dict(sliding_window=WINDOW, num_hidden_layers=3,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
}
_expected: dict[str, list[list[int]]] = {}


def _model(hf_model: Callable[..., HFModel], name: str) -> HFModel:
    family, overrides = CONFIGS[name]
    hf = hf_model(family, **overrides)
    if overrides.get("attention_bias") and not getattr(hf, "biases_randomised", False):
        # transformers initialises biases to zero, which would hide a bias added on every rank
        with torch.no_grad():
            for pname, p in hf.model.named_parameters():
                if pname.endswith(".bias"):
                    p.normal_(0.0, 0.2)
        hf.model.save_pretrained(hf.path)
        hf.biases_randomised = True  # type: ignore[attr-defined]
    return hf


@contextlib.contextmanager
def _engine(hf: HFModel, tp: int, **overrides: Any) -> Iterator[LLMEngine]:
    cfg = EngineConfig(model_dir=str(hf.path), kv_cache_bytes=1 << 22, max_num_batched_tokens=32,
                       tensor_parallel_size=tp, **overrides)
    engine = launch_engine(cfg)
    try:
        yield engine
    finally:
        engine.close()
    assert not dist.is_initialized()


def _params() -> SamplingParams:
    return dataclasses.replace(GREEDY, max_tokens=NEW_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_tokens_match_transformers(hf_model: Callable[..., HFModel], name: str, tp: int) -> None:
    hf = _model(hf_model, name)
    prompts = random_prompts(PROMPTS)
    if name not in _expected:
        _expected[name] = [hf.greedy(p, NEW_TOKENS) for p in prompts]
    # A 32-token budget: prefill chunks after earlier chunks (past the window) share steps with decodes.
    with _engine(hf, tp) as engine:
        assert engine.kv_layout.tensor_parallel == tp
        kv_heads = ModelConfig.from_dir(hf.path).num_kv_heads
        assert engine.kv_cache.shape[4] == engine.kv_layout.num_kv_heads == max(1, kv_heads // tp)
        got = engine.generate(prompts, _params())
    for i, (tokens, want) in enumerate(zip(got, _expected[name], strict=True)):
        assert tokens == want, f"prompt {i} ({len(prompts[i])} tokens) diverged at TP {tp}"


def _whole_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the checkpoint tensors the loader reads whole (get_tensor), not by slices."""
    real, names = loader.safe_open, []

    class Spy:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.file = real(*args, **kwargs)

        def __enter__(self) -> Spy:
            self.inner = self.file.__enter__()
            return self

        def __exit__(self, *exc: Any) -> None:
            self.file.__exit__(*exc)

        def keys(self) -> list[str]:
            return list(self.inner.keys())

        def get_tensor(self, name: str) -> torch.Tensor:
            names.append(name)
            return self.inner.get_tensor(name)

        def get_slice(self, name: str) -> Any:
            return self.inner.get_slice(name)

    monkeypatch.setattr(loader, "safe_open", Spy)
    return names


@pytest.mark.parametrize("name", ["llama", "llama-gqa", "qwen3_moe", "gemma2"])
def test_each_rank_loads_its_share(hf_model: Callable[..., HFModel], monkeypatch: pytest.MonkeyPatch,
                                   name: str) -> None:
    hf = _model(hf_model, name)
    cfg = ModelConfig.from_dir(hf.path)
    full = dict(load_model(hf.path).named_parameters())
    # bytes of k and v in the full model: a KV head shared by several ranks is held by each of them
    kv_bytes = sum(4 * p[cfg.num_heads * cfg.head_dim:].numel() for n, p in full.items() if "qkv_proj" in n)
    whole = _whole_reads(monkeypatch)
    for tp in (2, 4):
        replicas = max(1, tp // cfg.num_kv_heads)
        per_rank = []
        for rank in range(tp):
            whole.clear()
            params = dict(load_model(hf.path, tp=TensorParallel(rank, tp)).named_parameters())
            split = {n for n, p in params.items() if p.shape != full[n].shape}
            for n in params.keys() - split:  # the rest is replicated: norms, router, embeddings, LM head
                assert torch.equal(params[n], full[n]), n
            per_rank.append(sum(params[n].numel() * params[n].element_size() for n in split))
            # no rank reads a split weight whole (biases of o_proj/down_proj are replicated)
            assert not [n for n in whole if re.search(r"(_proj|\.w[123])\.weight$", n)], whole
        full_split = sum(full[n].numel() * full[n].element_size() for n in split)
        assert per_rank == [(full_split + (replicas - 1) * kv_bytes) // tp] * tp, (tp, per_rank, full_split)


def test_degrees_the_model_does_not_split_into_are_refused(hf_model: Callable[..., HFModel]) -> None:
    hf = _model(hf_model, "llama-gqa")
    with pytest.raises(ValueError, match="tensor parallel size 3 does not divide the model's num_attention_heads 4"):
        launch_engine(EngineConfig(model_dir=str(hf.path), kv_cache_bytes=1 << 22, tensor_parallel_size=3))
    with pytest.raises(ValueError, match="launch_engine"):
        LLMEngine(EngineConfig(model_dir=str(hf.path), kv_cache_bytes=1 << 22, tensor_parallel_size=2))
    assert not dist.is_initialized()


def _followers(engine: LLMEngine) -> list[Any]:
    assert engine.tp is not None
    return engine.tp.followers


@pytest.mark.slow
def test_a_follower_killed_while_idle_fails_the_next_step_naming_it(hf_model: Callable[..., HFModel]) -> None:
    hf = _model(hf_model, "llama-gqa")
    prompts = random_prompts((20,))
    with _engine(hf, 2, tp_timeout_s=20) as engine:
        engine.generate(prompts, _params())
        victim = _followers(engine)[0]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match=rf"tensor-parallel rank 1 \(pid {victim.pid}\) was killed by SIGKILL"):
            engine.generate(prompts, _params())
        assert time.monotonic() - start < 5
        with pytest.raises(TensorParallelError, match="rank 1"):  # the group stays failed
            engine.generate(prompts, _params())


@pytest.mark.slow
def test_a_follower_killed_during_a_step_fails_rank_0_naming_it(hf_model: Callable[..., HFModel]) -> None:
    hf = _model(hf_model, "llama-gqa")
    prompts = random_prompts((20,))
    with _engine(hf, 4, tp_timeout_s=20) as engine:
        engine.generate(prompts, _params())
        victim = _followers(engine)[1]  # rank 2
        engine.set_layer_callback(lambda layer, writes: os.kill(victim.pid, signal.SIGKILL) if layer == 0 else None)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"tensor-parallel rank 2 \(pid \d+\) was killed by SIGKILL"):
            engine.generate(prompts, _params())
        assert time.monotonic() - start < 10  # far within the 20 s timeout: the peers see the connection drop
        for p in _followers(engine):  # none outlives the group
            p.join(10)
            assert p.exitcode is not None


@pytest.mark.slow
def test_a_stuck_follower_fails_rank_0_after_the_timeout(hf_model: Callable[..., HFModel]) -> None:
    hf = _model(hf_model, "llama-gqa")
    prompts = random_prompts((20,))
    with _engine(hf, 2, tp_timeout_s=3) as engine:
        engine.generate(prompts, _params())
        victim = _followers(engine)[0]
        os.kill(victim.pid, signal.SIGSTOP)  # alive, but answers nothing
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"rank 1 still running but did not complete a collective "
                                                      r"within 3 s \(stuck\?\)"):
            engine.generate(prompts, _params())
        assert 3 <= time.monotonic() - start < 12
    assert victim.exitcode == -signal.SIGKILL  # close() killed it


def test_tp_1_is_the_single_process_engine(tiny_model_dir: Path) -> None:
    engine = launch_engine(EngineConfig(model_dir=str(tiny_model_dir), kv_cache_bytes=1 << 22))
    assert engine.tp is None and engine.runner.tp is None and engine.kv_layout.tensor_parallel == 1
    assert engine.model.tp.size == 1
    engine.close()


@pytest.mark.slow
def test_followers_end_when_rank_0_dies(hf_model: Callable[..., HFModel]) -> None:
    hf = _model(hf_model, "llama-gqa")
    script = ("import sys, time\n"
              "from tandem.worker.engine import EngineConfig\n"
              "from tandem.worker.engine.tp_group import launch_engine\n"
              "if __name__ == '__main__':\n"
              "    e = launch_engine(EngineConfig(model_dir=sys.argv[1], kv_cache_bytes=1 << 22, tensor_parallel_size=2))\n"
              "    print('followers', *(p.pid for p in e.tp.followers), flush=True)\n"
              "    time.sleep(600)\n")
    rank0 = subprocess.Popen([sys.executable, "-c", script, str(hf.path)], stdout=subprocess.PIPE, text=True)
    try:
        assert rank0.stdout is not None
        line = next(line for line in rank0.stdout if line.startswith("followers"))  # gloo prints to stdout too
        pids = [int(p) for p in line.split()[1:]]
    finally:
        rank0.kill()
        rank0.wait()
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_running(pid) for pid in pids)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by whoever adopted it, maybe never in a container)."""
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(32, 8, 2), (32, 8, 8), (32, 8, 16), (64, 8, 8), (4, 1, 4),
                                                       (28, 4, 4), (16, 16, 4), (8, 2, 8)])
def test_each_rank_holds_the_kv_heads_its_query_heads_read(heads: int, kv_heads: int, tp: int) -> None:
    cfg = ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], vocab_size=16, hidden_size=heads * 4,
                                     intermediate_size=64, num_hidden_layers=1, num_attention_heads=heads,
                                     num_key_value_heads=kv_heads, head_dim=4))
    group = heads // kv_heads
    held: list[int] = []
    for rank in range(tp):
        shard = TensorParallel(rank, tp)
        q, kv = shard.q_heads(cfg), shard.kv_heads(cfg)
        assert len(q) == heads // tp and len(kv) == max(1, kv_heads // tp)
        # each local query head i reads local KV head i // (local group), as SDPA's enable_gqa does
        assert [h // group for h in q] == [kv[i // (len(q) // len(kv))] for i in range(len(q))]
        held.extend(kv)
    assert sorted(set(held)) == list(range(kv_heads)) and len(held) == max(kv_heads, tp)
