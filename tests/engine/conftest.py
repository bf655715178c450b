"""Tiny models for the engine tests.

`hf_model` writes a random-weight model with transformers itself (the reference
implementation) plus the test-time byte-level BPE tokenizer, and returns the folder and the
transformers model, cached per test session so the folder's tests stay fast.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.worker.engine import EngineConfig, LLMEngine, RequestOutput, SamplingParams
from tandem.worker.model.tiny import build_tokenizer, write_tiny_model

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
            # a wider init than 0.02 gives peaked next-token distributions, so greedy argmax is well defined
            initializer_range=0.15, tie_word_embeddings=False)


def _config_class(family: str) -> Any:
    import transformers

    return {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
            "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
            "mixtral": transformers.MixtralConfig, "qwen3_moe": transformers.Qwen3MoeConfig,
            "gemma2": transformers.Gemma2Config, "gemma3": transformers.Gemma3TextConfig}[family]


class HFModel:
    def __init__(self, path: Path, model: Any) -> None:
        self.path = path
        self.model = model

    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """transformers' greedy continuation (batch of one, so no padding is involved)."""
        out = self.model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
        return list(out[0, len(prompt):].tolist())

    def engine(self, **overrides: Any) -> LLMEngine:
        return LLMEngine(EngineConfig(model_dir=str(self.path), **{"kv_cache_bytes": 1 << 22, **overrides}))


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., HFModel]:
    pytest.importorskip("transformers", reason="transformers is the reference implementation (test extra)")
    from transformers import AutoModelForCausalLM

    cache: dict[str, HFModel] = {}

    def make(family: str = "llama", max_shard_size: str | None = None, **overrides: Any) -> HFModel:
        key = repr((family, max_shard_size, sorted(overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"hf-{family}")
            torch.manual_seed(0)
            config = _config_class(family)(**{**TINY, **overrides})
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
            kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
            model.save_pretrained(path, **kwargs)
            build_tokenizer().save(str(path / "tokenizer.json"))
            cache[key] = HFModel(path, model)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder from our own writer (no transformers involved), with tokenizer and chat template."""
    path: Path = write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", family="llama")
    return path


def random_prompts(lengths: tuple[int, ...], seed: int = 1, vocab: int = 512) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=generator).tolist() for n in lengths]


GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


def run_requests(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[RequestOutput]]:
    """Add every request, step the engine until all finish, and return each request's outputs."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    for out in engine.iter_outputs():
        outs[out.request_id].append(out)
    return outs


def tokens_of(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]
