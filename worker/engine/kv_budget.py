"""How many KV blocks fit in the configured memory budget."""

from __future__ import annotations

import torch

from ..config import EngineConfig

DEFAULT_CPU_FRACTION = 0.25  # of available RAM, when no budget is configured
DEFAULT_CUDA_FRACTION = 0.8  # of the device memory free after loading the weights


def available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def kv_budget_bytes(cfg: EngineConfig, device: torch.device, bytes_per_token: int, max_model_len: int) -> int:
    """The configured budget; by default enough for max_num_seqs full-length requests, capped by memory."""
    if cfg.kv_cache_bytes is not None:
        return cfg.kv_cache_bytes
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * (cfg.kv_cache_fraction or DEFAULT_CUDA_FRACTION))
    if cfg.kv_cache_fraction is not None:
        return int(available_ram_bytes() * cfg.kv_cache_fraction)
    wanted = cfg.max_num_seqs * max_model_len * bytes_per_token
    return min(wanted, int(available_ram_bytes() * DEFAULT_CPU_FRACTION))
