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


def free_memory_bytes(device: torch.device) -> int:
    """What this worker may still allocate: free device memory on CUDA, available RAM on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return available_ram_bytes()


def kv_budget_bytes(cfg: EngineConfig, device: torch.device, bytes_per_token: int, max_model_len: int,
                    free_before_load: int = 0, weight_bytes: int = 0) -> int:
    """The configured budget; by default enough for max_num_seqs full-length requests, capped by memory.
    `free_before_load` and `weight_bytes` serve `memory_utilization` (weights plus KV in that share)."""
    if cfg.kv_cache_bytes is not None:
        return cfg.kv_cache_bytes
    if cfg.memory_utilization is not None:
        share = int(free_before_load * cfg.memory_utilization)
        if share <= weight_bytes:
            raise ValueError(f"--gpu-memory-utilization {cfg.memory_utilization} gives {share >> 20} MiB, "
                             f"but the weights alone take {weight_bytes >> 20} MiB: raise it")
        return share - weight_bytes
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * (cfg.kv_cache_fraction or DEFAULT_CUDA_FRACTION))
    if cfg.kv_cache_fraction is not None:
        return int(available_ram_bytes() * cfg.kv_cache_fraction)
    wanted = cfg.max_num_seqs * max_model_len * bytes_per_token
    return min(wanted, int(available_ram_bytes() * DEFAULT_CPU_FRACTION))
