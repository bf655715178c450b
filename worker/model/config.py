"""The parts of a Hugging Face config.json that the llama-family forward pass needs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# architecture name -> family; all four share one forward pass with small switches.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    name: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (Qwen2 always; Llama when configured)
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm on each head of q and k before RoPE
    sliding_window: int | None  # attention window; the engine caps max_model_len at it
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None
    dtype: str | None = None  # the checkpoint's dtype, if stated

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir)
        config_file = path / "config.json"
        if not path.is_dir():
            raise FileNotFoundError(f"model folder {str(path)!r} does not exist")
        if not config_file.is_file():
            raise FileNotFoundError(f"model folder {str(path)!r} has no config.json")
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{config_file} is not valid JSON: {exc}") from exc
        return cls.from_dict(raw, name=_model_name(raw, path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], name: str = "model") -> ModelConfig:
        archs = raw.get("architectures") or []
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if family is None:
            family = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}.get(
                raw.get("model_type", ""))
        if family is None:
            raise ValueError(
                f"unsupported model architecture {archs or raw.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r}; only 'silu' is implemented")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(raw.get(key), int) or raw[key] <= 0:
                raise ValueError(f"config.json: {key} must be a positive integer, got {raw.get(key)!r}")
        num_heads = raw["num_attention_heads"]
        num_kv_heads = raw.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        rope_theta, rope_scaling = _rope(raw)
        sliding_window = raw.get("sliding_window")
        if family == "qwen2" or family == "qwen3":
            sliding_window = sliding_window if raw.get("use_sliding_window") else None
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        return cls(
            name=name,
            family=family,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=True if family == "qwen2" else bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=sliding_window if isinstance(sliding_window, int) else None,
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            dtype=raw.get("dtype") or raw.get("torch_dtype"),
        )


def _model_name(raw: dict[str, Any], path: Path) -> str:
    name = str(raw.get("_name_or_path") or "")
    # A local path written by save_pretrained says nothing about the model; use the folder name.
    if not name or Path(name).is_absolute() or name.startswith("."):
        name = path.resolve().name
    return name


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """RoPE settings from either spelling: transformers 5 `rope_parameters` or 4.x `rope_theta` + `rope_scaling`."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling: dict[str, Any] | None = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        scaling = raw.get("rope_scaling")
    if scaling:
        rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported RoPE scaling {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
        scaling = {**scaling, "rope_type": rope_type}
        if rope_type == "default":
            scaling = None
    return theta, scaling or None
