"""`--device auto` and `--dtype auto`: what a worker runs on when the user does not say.

The choice is a pure function of what torch sees and what the model's config.json declares, so
it is unit-tested without a GPU; `choose()` only gathers those two facts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tandem.worker.config import DTYPES

# vLLM's spellings of the same dtypes (`vllm serve --dtype half`).
DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DTYPE_CHOICES = ("auto", *DTYPES, *DTYPE_ALIASES)


@dataclass(frozen=True)
class Choice:
    device: str
    dtype: str
    why: str  # one line for the startup log: what was chosen and why

    def describe(self) -> str:
        return f"device {self.device}, dtype {self.dtype} ({self.why})"


def decide(device: str, dtype: str, cuda_devices: int, model_dtype: str | None) -> Choice:
    """`device`/`dtype` as given (possibly `auto` or a vLLM alias), the number of CUDA devices torch
    sees, and the `dtype`/`torch_dtype` of the model's config.json (None when it has none)."""
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    reasons = []
    if device == "auto":
        device = "cuda" if cuda_devices else "cpu"
        reasons.append("torch sees a CUDA device" if cuda_devices else "no CUDA device visible to torch")
    if dtype == "auto":
        if not device.startswith("cuda"):
            # bfloat16/float16 matmuls on CPU are slow or unsupported for many ops; float32 is exact.
            dtype = "float32"
            reasons.append("float32 on the CPU")
        elif model_dtype in ("bfloat16", "float16"):
            dtype = model_dtype
            reasons.append(f"the model's config.json says {model_dtype}")
        else:
            # float32 weights on a GPU halve the KV cache and the speed for no quality a user sees.
            dtype = "bfloat16"
            said = f"says {model_dtype}" if model_dtype else "names no dtype"
            reasons.append(f"the model's config.json {said}; bfloat16 on CUDA")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {dtype!r}")
    if not (device == "cpu" or device.startswith("cuda")):
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {device!r}")
    return Choice(device, dtype, "; ".join(reasons) or "as given")


def model_dtype(model_dir: Path) -> str | None:
    """The dtype the model's config.json declares (transformers 5 `dtype`, 4.x `torch_dtype`)."""
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = raw.get("dtype") or raw.get("torch_dtype") if isinstance(raw, dict) else None
    return value if isinstance(value, str) else None


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose(device: str, dtype: str, model_dir: Path) -> Choice:
    """Resolve `auto` for a worker about to load `model_dir` (imports torch only for `--device auto`)."""
    cuda = cuda_device_count() if device == "auto" else 0
    return decide(device, dtype, cuda, model_dtype(model_dir))
