"""Can RDMA run here? Device discovery that works with or without pyverbs.

Reads /sys/class/infiniband (devices, ports, their state and link layer) and, when pyverbs
is importable, asks libibverbs too. Every "no" comes with a reason in plain words, which
`tandem doctor` prints and `auto` logs when it falls back to tcp.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from .errors import UNAVAILABLE, TransferError

SYSFS_ROOT = Path("/sys/class/infiniband")
PYVERBS_MISSING = "RDMA unavailable: pyverbs not installed (pip install 'tandem[rdma]', see docs/transfer.md)"


@dataclass(frozen=True)
class RdmaPort:
    device: str
    port: int
    state: str  # e.g. "4: ACTIVE"
    link_layer: str  # InfiniBand | Ethernet (RoCE)
    rate: str  # e.g. "200 Gb/sec (4X HDR)"

    @property
    def active(self) -> bool:
        return self.state.endswith("ACTIVE")


@dataclass(frozen=True)
class RdmaProbe:
    usable: bool
    reason: str  # why not, or what was found
    ports: list[RdmaPort] = field(default_factory=list)
    pyverbs: str | None = None  # version, when importable
    pyverbs_problem: str | None = None  # why pyverbs cannot be used, when it cannot


def load_pyverbs() -> ModuleType:
    """Import pyverbs.device, or raise TransferError(UNAVAILABLE) saying how to get it."""
    try:
        return importlib.import_module("pyverbs.device")
    except ImportError as exc:
        if exc.name is not None and exc.name.split(".")[0] == "pyverbs":
            raise TransferError(UNAVAILABLE, PYVERBS_MISSING) from exc
        raise TransferError(UNAVAILABLE, f"RDMA unavailable: pyverbs is installed but does not load ({exc}); "
                            "it needs the libibverbs it was built against on LD_LIBRARY_PATH, see "
                            "docs/transfer.md") from exc


def _pyverbs_version() -> str:
    try:
        return importlib.metadata.version("pyverbs")
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return "unknown"


def sysfs_ports(root: Path = SYSFS_ROOT) -> list[RdmaPort]:
    ports = []
    for device in sorted(root.iterdir()) if root.is_dir() else []:
        for port_dir in sorted((device / "ports").glob("*")):
            if port_dir.name.isdigit():
                ports.append(RdmaPort(device.name, int(port_dir.name), _read(port_dir / "state"),
                                      _read(port_dir / "link_layer"), _read(port_dir / "rate")))
    return ports


def probe(root: Path = SYSFS_ROOT) -> RdmaProbe:
    """Whether the rdma transport can run here, and why (not)."""
    version = None
    try:
        load_pyverbs()
        version = _pyverbs_version()
    except TransferError as exc:
        pyverbs_problem: str | None = exc.message
    else:
        pyverbs_problem = None
    if not root.exists():
        return RdmaProbe(False, f"no RDMA device: {root} does not exist (this kernel has no RDMA/InfiniBand "
                         "support loaded)", [], version, pyverbs_problem)
    ports = sysfs_ports(root)
    if not ports:
        return RdmaProbe(False, f"no RDMA device: {root} is empty", [], version, pyverbs_problem)
    active = [p for p in ports if p.active]
    if not active:
        states = ", ".join(f"{p.device} port {p.port}: {p.state}" for p in ports)
        return RdmaProbe(False, f"RDMA device found but no port is ACTIVE ({states})", ports, version, pyverbs_problem)
    if pyverbs_problem is not None:
        return RdmaProbe(False, pyverbs_problem, ports, version, pyverbs_problem)
    try:
        devices = importlib.import_module("pyverbs.device").get_device_list()
    except Exception as exc:  # PyverbsRDMAError when libibverbs sees no device
        return RdmaProbe(False, f"libibverbs cannot list RDMA devices: {exc}", ports, version, pyverbs_problem)
    if not devices:
        return RdmaProbe(False, "libibverbs lists no RDMA device (driver or provider library missing?)",
                         ports, version, pyverbs_problem)
    best = active[0]
    return RdmaProbe(True, f"RDMA device {best.device} port {best.port} is ACTIVE ({best.link_layer}, "
                     f"{best.rate})", ports, version, pyverbs_problem)
