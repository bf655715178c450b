"""Engine configuration: one dataclass per concern, validated on construction.

`EngineConfig` is what the worker server builds from its command line and hands to
`tandem.worker.engine.LLMEngine`. Bad values fail here, with the field name, rather than as an
obscure tensor error minutes later.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("both", "prefill", "decode")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class EngineConfig:
    model_dir: str
    role: str = "both"  # both | prefill | decode
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    # KV budget: bytes, or a fraction of device memory (CUDA: of the memory free after loading
    # the weights; CPU: of physical RAM). A sane default is picked when both are None.
    kv_cache_bytes: int | None = None
    kv_cache_fraction: float | None = None
    # vLLM's --gpu-memory-utilization: this fraction of the memory free before loading (device
    # memory on CUDA, available RAM on CPU) holds the weights plus the KV cache.
    memory_utilization: float | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # None: the model's own limit
    seed: int = 0
    # Tensor parallelism: ranks (processes) of one engine, started by engine.tp_group.launch_engine, and
    # how long a collective may wait for a rank before the engine fails naming it.
    tensor_parallel_size: int = 1
    tp_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ValueError("EngineConfig.model_dir must name a model folder")
        if self.role not in ROLES:
            raise ValueError(f"EngineConfig.role must be one of {ROLES}, got {self.role!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"EngineConfig.device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"EngineConfig.block_size must be a positive power of two, got {self.block_size}")
        budgets = [n for n in ("kv_cache_bytes", "kv_cache_fraction", "memory_utilization")
                   if getattr(self, n) is not None]
        if len(budgets) > 1:
            raise ValueError(f"set at most one of EngineConfig.kv_cache_bytes, kv_cache_fraction and "
                             f"memory_utilization, got {' and '.join(budgets)}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"EngineConfig.kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.kv_cache_fraction is not None and not 0.0 < self.kv_cache_fraction <= 1.0:
            raise ValueError(f"EngineConfig.kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")
        if self.memory_utilization is not None and not 0.0 < self.memory_utilization <= 1.0:
            raise ValueError(f"EngineConfig.memory_utilization must be in (0, 1], got {self.memory_utilization}")
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EngineConfig.{name} must be positive, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"EngineConfig.max_model_len must be positive, got {self.max_model_len}")
        if self.tensor_parallel_size <= 0:
            raise ValueError(f"EngineConfig.tensor_parallel_size must be positive, got {self.tensor_parallel_size}")
        if not self.tp_timeout_s > 0:
            raise ValueError(f"EngineConfig.tp_timeout_s must be positive, got {self.tp_timeout_s}")
