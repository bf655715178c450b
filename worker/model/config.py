"""The parts of a Hugging Face config.json that the decoder's forward pass needs."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# architecture name -> family; all share one forward pass with switches (worker/model/llama.py).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}
FAMILIES = tuple(SUPPORTED_ARCHITECTURES.values())  # `tandem make-tiny-model --family` / `serve --family`
# config.json `model_type` -> family, for folders without `architectures`
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "mixtral": "mixtral",
               "qwen3_moe": "qwen3_moe", "gemma2": "gemma2", "gemma3_text": "gemma3"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")
GEMMA = ("gemma2", "gemma3")
MOE = ("mixtral", "qwen3_moe")
SLIDING, FULL = "sliding_attention", "full_attention"


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
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None
    dtype: str | None = None  # the checkpoint's dtype, if stated
    hidden_act: str = "silu"
    # Mixture of experts (Mixtral, Qwen3-MoE): which layers route, over how many experts, to how many.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1 (Mixtral always)
    moe_layers: tuple[bool, ...] = ()  # per layer: True = experts, False = dense MLP
    # Gemma 2/3
    gemma_norms: bool = False  # (1 + w) RMSNorm, pre/post feed-forward norms, embeddings scaled by sqrt(hidden)
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power instead of head_dim's
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    layer_windows: tuple[int | None, ...] = ()  # per layer: local attention window (None = global); empty = none
    local_rope_theta: float | None = None  # RoPE base of the sliding layers (Gemma 3); None = the global one
    local_rope_scaling: dict[str, Any] | None = None

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    def window_of(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def attention_signature(self) -> str:
        """What a KV block's contents depend on beyond its shape: the sliding-window layers and window.
        Empty for models whose layers all attend alike (their layout hash stays as it was)."""
        if not any(w is not None for w in self.layer_windows):
            return ""
        pattern = "".join("S" if w is not None else "F" for w in self.layer_windows)
        return f"window={next(w for w in self.layer_windows if w is not None)};layers={pattern}"

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
        if family is None and not archs:
            family = MODEL_TYPES.get(raw.get("model_type", ""))
        if family is None:
            raise ValueError(
                f"unsupported model architecture {', '.join(archs) if archs else raw.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        hidden_act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
        if hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; supported: {ACTIVATIONS}")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(raw.get(key), int) or raw[key] <= 0:
                raise ValueError(f"config.json: {key} must be a positive integer, got {raw.get(key)!r}")
        num_heads = raw["num_attention_heads"]
        num_kv_heads = raw.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        rope_theta, rope_scaling = _rope(raw)
        extra: dict[str, Any] = {}
        if family in MOE:
            extra = _moe(raw, family)
        if family in GEMMA:
            extra = _gemma(raw, family, rope_theta, rope_scaling)
            rope_theta, rope_scaling = extra.pop("rope_theta"), extra.pop("rope_scaling")
        else:
            extra["layer_windows"] = _windows(raw, family)
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
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            dtype=raw.get("dtype") or raw.get("torch_dtype"),
            hidden_act=hidden_act,
            **extra,
        )


def _positive_int(raw: dict[str, Any], *keys: str) -> int:
    """The first of `keys` present in config.json, which must be a positive integer."""
    key = next((k for k in keys if raw.get(k) is not None), keys[0])
    value = raw.get(key)
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def _windows(raw: dict[str, Any], family: str) -> tuple[int | None, ...]:
    """Per-layer attention windows of the non-Gemma families, transformers' rules: Mistral and Mixtral
    slide on every layer when `sliding_window` is set; the Qwens only with `use_sliding_window`,
    Qwen3-MoE on every layer, Qwen2/3 on the layers `layer_types` names (else those from
    `max_window_layers` on). Empty: no layer slides."""
    window = raw.get("sliding_window")
    num_layers: int = raw["num_hidden_layers"]
    if family == "llama" or not isinstance(window, int) or window <= 0:
        return ()
    if family in ("qwen2", "qwen3", "qwen3_moe") and not raw.get("use_sliding_window"):
        return ()
    if family in ("qwen2", "qwen3"):
        types = raw.get("layer_types") or [SLIDING if i >= int(raw.get("max_window_layers", 28)) else FULL
                                           for i in range(num_layers)]
        if len(types) != num_layers:
            raise ValueError(f"config.json: layer_types must name each of the {num_layers} layers, got {types!r}")
        if SLIDING not in types:
            return ()
        return tuple(window if t == SLIDING else None for t in types)
    every: tuple[int | None, ...] = (window,) * num_layers
    return every


def _moe(raw: dict[str, Any], family: str) -> dict[str, Any]:
    num_layers = raw["num_hidden_layers"]
    # transformers writes Qwen3-MoE's `num_experts` as `num_local_experts`; published folders say `num_experts`.
    experts = _positive_int(raw, "num_local_experts", "num_experts")
    top_k = _positive_int(raw, "num_experts_per_tok")
    if top_k > experts:
        raise ValueError(f"config.json: num_experts_per_tok {top_k} exceeds the {experts} experts")
    if family == "mixtral":
        return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=raw["intermediate_size"],
                    norm_topk_prob=True, moe_layers=(True,) * num_layers)
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    dense = set(raw.get("mlp_only_layers") or [])
    return dict(num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=_positive_int(raw, "moe_intermediate_size"),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                moe_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)))


def _gemma(raw: dict[str, Any], family: str, rope_theta: float,
           rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    num_layers = raw["num_hidden_layers"]
    layer_types = raw.get("layer_types")
    if layer_types is None:  # transformers 4.x folders: the family's fixed pattern
        period = 2 if family == "gemma2" else int(raw.get("sliding_window_pattern")
                                                  or raw.get("_sliding_window_pattern") or 6)
        layer_types = [SLIDING if (i + 1) % period else FULL for i in range(num_layers)]
    if len(layer_types) != num_layers or any(t not in (SLIDING, FULL) for t in layer_types):
        raise ValueError(f"config.json: layer_types must list {SLIDING!r}/{FULL!r} for each of the "
                         f"{num_layers} layers, got {layer_types!r}")
    window = raw.get("sliding_window")
    if SLIDING in layer_types and (not isinstance(window, int) or window <= 0):
        raise ValueError(f"config.json: sliding_window must be a positive integer, got {window!r}")
    local_theta, local_scaling = None, None
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(FULL), dict):  # transformers 5: one entry per layer type
        rope_theta, rope_scaling = _rope({"rope_parameters": params[FULL]})
        if isinstance(params.get(SLIDING), dict):
            local_theta, local_scaling = _rope({"rope_parameters": params[SLIDING]})
    elif family == "gemma3":  # 4.x: the global scaling is for the full layers only; locals use their own base
        local_theta = float(raw.get("rope_local_base_freq", 10000.0))
    softcap = raw.get("attn_logit_softcapping")
    final_softcap = raw.get("final_logit_softcapping")
    return dict(
        gemma_norms=True,
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or 256),  # transformers' default
        attn_logit_softcapping=float(softcap) if softcap else None,
        final_logit_softcapping=float(final_softcap) if final_softcap else None,
        layer_windows=tuple(window if t == SLIDING else None for t in layer_types),
        local_rope_theta=local_theta, local_rope_scaling=local_scaling,
        rope_theta=rope_theta, rope_scaling=rope_scaling)


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
