"""Settings of one worker process, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tandem.worker import faults
from tandem.worker.kv.keys import KVKeys, KVKeysError
from tandem.worker.server.control_token import ControlTokens
from tandem.worker.transfer.sealing import SealSecrets

ROLES = ("prefill", "decode", "both")
KV_ENCRYPTIONS = ("auto", "aes-gcm", "curve", "none")  # --kv-encryption
TRANSPORTS = ("auto", "tcp", "rdma")
MAX_TENSOR_PARALLEL = 64  # ranks of one worker (processes of one pod)


@dataclass
class WorkerConfig:
    model_dir: Path
    model_name: str | None = None
    role: str = "both"
    pool: str = "local"
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    transport: str = "auto"
    host: str = "127.0.0.1"
    port: int = 8000
    kv_port: int = 5555
    kv_host: str | None = None  # address peers use to reach --kv-port (default: --host, or this pod's IP)
    tensor_parallel: int = 1
    max_model_len: int | None = None
    layout_hash: str | None = None  # expected hash (from the operator); a mismatch refuses to start
    kv_cache_bytes: int | None = None
    memory_utilization: float | None = None  # --gpu-memory-utilization: weights + KV in this share of free memory
    seed: int = 0  # the engine's default sampling seed (requests may bring their own)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    drain_timeout: float = 60.0
    kv_wait_timeout: float = 30.0  # how long decode waits for a transfer before prefilling locally
    fault: str | None = None  # test hook (faults.py): "drop-kv" makes a prefill worker never ship KV
    # Decode role: what one caller may hold in unclaimed KV reservations (kv_link.PeerQuota).
    max_reserved_share_per_peer: float = 0.5  # of the KV pool's blocks (never less than one full context)
    max_reservations_per_peer: int = 512
    kv_keys: Path | None = None  # folder with the model's CURVE keypair: secure KV transfer (security.py)
    keys: KVKeys | None = field(init=False, default=None)  # loaded from kv_keys, at start
    # auto: curve with kv_keys, else aes-gcm (sealing.py, secrets from the control token), else none
    kv_encryption: str = "auto"
    seal: SealSecrets | None = field(init=False, default=None)  # set when the encryption in use is aes-gcm
    # The model's worker control token (control_token.py): every route but the probes and /metrics wants it.
    # None only with `tandem worker --insecure-control-api` (the command refuses to start otherwise).
    control: ControlTokens | None = None

    def _resolve_kv_encryption(self) -> str:
        """The KV encryption in use: what was asked for, with auto resolved; ValueError when it cannot be had."""
        asked = self.kv_encryption
        if asked not in KV_ENCRYPTIONS:
            raise ValueError(f"kv_encryption must be one of {KV_ENCRYPTIONS}, got {asked!r}")
        if asked == "curve" and self.kv_keys is None:
            raise ValueError("--kv-encryption curve needs --kv-keys (the model's keypair, `tandem kv-keys`)")
        if asked in ("aes-gcm", "none") and self.kv_keys is not None:
            raise ValueError(f"--kv-keys means CURVE; it cannot go with --kv-encryption {asked}")
        if asked == "aes-gcm" and self.control is None:
            raise ValueError("--kv-encryption aes-gcm authenticates peers with the control token, and this worker "
                             "has none (--insecure-control-api)")
        if asked != "auto":
            return asked
        if self.kv_keys is not None:
            return "curve"
        return "aes-gcm" if self.control is not None else "none"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if not self.model_dir.is_dir():
            raise ValueError(f"model folder {self.model_dir} does not exist")
        if not 1 <= self.tensor_parallel <= MAX_TENSOR_PARALLEL:
            raise ValueError(f"--tensor-parallel-size must be in 1..{MAX_TENSOR_PARALLEL}, got {self.tensor_parallel}")
        if self.tensor_parallel > 1 and self.role != "both":
            # Each rank holds its share of the KV heads; shipping them needs a transfer per rank pair
            # (re-sharding by head range), which is not built.
            raise ValueError(f"--tensor-parallel-size {self.tensor_parallel} with --role {self.role}: the KV transfer "
                             f"between tensor-parallel workers is not built yet; tensor parallelism runs with "
                             f"--role both (tandem serve --mode monolithic or chunked)")
        faults.check(self.fault)  # a test hook: refused unless TANDEM_ENABLE_FAULTS=1
        if self.kv_keys is not None:
            try:
                self.keys = KVKeys.load(self.kv_keys)  # fail at start, not when the model has loaded
            except KVKeysError as exc:
                raise ValueError(f"--kv-keys: {exc}") from None
        self.kv_encryption = self._resolve_kv_encryption()
        if self.kv_encryption == "aes-gcm" and self.control is not None:
            self.seal = SealSecrets.from_tokens(self.control.tokens)
        if not 0.0 < self.max_reserved_share_per_peer <= 1.0:
            raise ValueError(f"max_reserved_share_per_peer must be in (0, 1], got {self.max_reserved_share_per_peer}")
        if self.max_reservations_per_peer < 1:
            raise ValueError(f"max_reservations_per_peer must be >= 1, got {self.max_reservations_per_peer}")
        for name in ("port", "kv_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"{name} must be a TCP port, got {getattr(self, name)}")
