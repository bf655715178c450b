"""Build a `CausalLM` from a Hugging Face model folder (config.json + *.safetensors).

Tensor parallel (`tp` of size > 1): each rank reads only its slice of each split tensor
(`safe_open(...).get_slice`), so no rank ever holds a full copy of a split weight.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ModelConfig
from .llama import CausalLM
from .tensor_parallel import TensorParallel

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INDEX_FILE = "model.safetensors.index.json"

Progress = Callable[[str, float], None]


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards an index names, or every *.safetensors."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are missing: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model folder {str(model_dir)!r} has no *.safetensors weights")
    return files


def load_model(model_dir: str | Path, dtype: str = "float32", device: str = "cpu",
               progress: Progress | None = None, tp: TensorParallel | None = None) -> CausalLM:
    path = Path(model_dir)
    cfg = ModelConfig.from_dir(path)
    files = checkpoint_files(path)
    torch_dtype = TORCH_DTYPES[dtype]
    tp = tp or TensorParallel()
    with torch.device("meta"):
        model = CausalLM(cfg, tp)
    # Materialise empty parameters on the target device; every one is then filled from the checkpoint.
    model = model.to(torch_dtype).to_empty(device=device)  # dtype first: no float32 copy on the device
    model.init_buffers(device)
    params = dict(model.named_parameters())
    layout = model.checkpoint_layout()  # checkpoint tensor -> rows of one of our parameters
    loaded: set[str] = set()
    for n, file in enumerate(files):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open has no __iter__)
                if name not in layout:
                    if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                        continue  # a buffer old checkpoints saved / a copy of the tied embedding
                    raise ValueError(f"{file.name}: unexpected tensor {name!r} for a {cfg.family} model")
                target_name, expert, start, end = layout[name]
                param = params[target_name] if expert is None else params[target_name][expert]
                target = param[start:end]
                shard = tp.shard_of(name, cfg)
                if shard is None:
                    tensor = f.get_tensor(name)
                else:  # read this rank's rows or columns only
                    part = f.get_slice(name)
                    shape = part.get_shape()
                    if len(shape) <= shard.dim or shape[shard.dim] != shard.full:
                        raise ValueError(f"{file.name}: {name} has shape {tuple(shape)}, config.json implies "
                                         f"{shard.full} along dimension {shard.dim}")
                    tensor = part[shard.start:shard.stop] if shard.dim == 0 else part[:, shard.start:shard.stop]
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(f"{file.name}: {name} has shape {tuple(tensor.shape)}, "
                                     f"config.json implies {tuple(target.shape)}")
                with torch.no_grad():
                    target.copy_(tensor.to(torch_dtype))
                loaded.add(name)
        if progress is not None:
            progress("load_weights", (n + 1) / len(files))
    expected = set(layout)
    if not cfg.tie_word_embeddings and "lm_head.weight" not in loaded and "model.embed_tokens.weight" in loaded:
        # Some checkpoints tie embeddings without saying so; an absent lm_head means tied.
        expected.discard("lm_head.weight")
        model.tie_weights()
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint in {str(path)!r} is missing tensors: {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model.eval()

