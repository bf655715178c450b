"""Can RDMA run here? Device discovery that works with or without pyverbs.

Reads /sys/class/infiniband (devices, ports, their state and link layer) and, when pyverbs
is importable, asks libibverbs too and opens the chosen device (context, port, a usable GID).
Every "no" comes with a reason in plain words, which `tandem doctor` prints and `auto` logs
when it falls back to tcp.

Settings (environment, read when a probe or an rdma transport starts):
- TANDEM_RDMA_DEVICE: the device, or device and port, to use ("mlx5_0" or "mlx5_0:1"); by default
  the first ACTIVE port of the first device (sorted by name).
- TANDEM_RDMA_GID_INDEX: the GID table index to use; by default chosen by type (choose_gid_index).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from .errors import UNAVAILABLE, TransferError

SYSFS_ROOT = Path("/sys/class/infiniband")
DEVICE_ENV = "TANDEM_RDMA_DEVICE"
GID_INDEX_ENV = "TANDEM_RDMA_GID_INDEX"
PYVERBS_MISSING = "RDMA unavailable: pyverbs not installed (pip install 'tandem-serving[rdma]', see docs/transfer.md)"


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
    chosen = pick_port(active, os.environ.get(DEVICE_ENV, ""))
    if isinstance(chosen, str):
        return RdmaProbe(False, chosen, ports, version, pyverbs_problem)
    if chosen.device not in {_device_name(d) for d in devices}:
        return RdmaProbe(False, f"sysfs lists {chosen.device} but libibverbs does not (provider library "
                         "missing?)", ports, version, pyverbs_problem)
    problem, gid_index = open_device(chosen)
    if problem is not None:
        return RdmaProbe(False, problem, ports, version, pyverbs_problem)
    return RdmaProbe(True, f"RDMA device {chosen.device} port {chosen.port} is ACTIVE ({chosen.link_layer}, "
                     f"{chosen.rate}; GID index {gid_index})", ports, version, pyverbs_problem)


def _device_name(device: object) -> str:
    name = getattr(device, "name", b"")
    return name.decode() if isinstance(name, bytes) else str(name)


def pick_port(active: Sequence[RdmaPort], setting: str) -> RdmaPort | str:
    """The ACTIVE port TANDEM_RDMA_DEVICE names ("mlx5_0" or "mlx5_0:1"), else the first; or why none fits."""
    setting = setting.strip()
    if not setting:
        return active[0]
    device, _, port = setting.partition(":")
    if port and not port.isdigit():
        return f"{DEVICE_ENV}={setting!r} is not DEVICE or DEVICE:PORT (for example mlx5_0 or mlx5_0:1)"
    for candidate in active:
        if candidate.device == device and (not port or candidate.port == int(port)):
            return candidate
    names = ", ".join(f"{p.device}:{p.port}" for p in active)
    return f"{DEVICE_ENV}={setting!r} names no ACTIVE port (ACTIVE: {names})"


GidEntry = tuple[int, str, str]  # (index, "xxxx:...:xxxx", "roce_v1" (also IB) | "roce_v2")
_ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
_IPV4_MAPPED = "0000:0000:0000:0000:0000:ffff:"


def choose_gid_index(gids: Sequence[GidEntry], link_layer: str, override: int | None = None) -> int:
    """The GID index to use: `override` if given; on InfiniBand index 0; on Ethernet (RoCE) an
    IPv4-mapped RoCEv2 GID, else any RoCEv2 GID, else the first non-zero one (v1 does not cross
    routers). Raises TransferError(UNAVAILABLE) when nothing usable is there."""
    present = [g for g in gids if g[1] != _ZERO_GID]
    if override is not None:
        if not any(index == override for index, _gid, _type in present):
            raise TransferError(UNAVAILABLE, f"{GID_INDEX_ENV}={override} is not a populated GID index "
                                f"(populated: {[g[0] for g in present]})")
        return override
    if not present:
        raise TransferError(UNAVAILABLE, "the RDMA port has no usable (non-zero) GID; on RoCE, give the "
                            "netdev an IP address")
    if link_layer != "Ethernet":
        return 0 if any(g[0] == 0 for g in present) else present[0][0]
    v2 = [g for g in present if g[2] == "roce_v2"]
    mapped = [g for g in v2 if g[1].startswith(_IPV4_MAPPED)]
    return (mapped or v2 or present)[0][0]


def gid_index_override() -> int | None:
    """TANDEM_RDMA_GID_INDEX as an int, None when unset; raises TransferError(UNAVAILABLE) when malformed."""
    value = os.environ.get(GID_INDEX_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise TransferError(UNAVAILABLE, f"{GID_INDEX_ENV}={value!r} is not a GID table index")
    return int(value)


def read_gids(ctx: object, port: int, table_len: int, v2: int) -> list[GidEntry]:
    """The port's GID table through a pyverbs Context (entries that fail to read are left out);
    v2 is pyverbs' ibv_gid_type_sysfs.IBV_GID_TYPE_SYSFS_ROCE_V2."""
    found = []
    for index in range(table_len):
        try:
            gid = str(ctx.query_gid(port, index).gid)  # type: ignore[attr-defined]
            kind = ctx.query_gid_type(port, index)  # type: ignore[attr-defined]
        except Exception:  # unpopulated entries raise on some providers
            continue
        found.append((index, gid, "roce_v2" if kind == v2 else "roce_v1"))  # IB GIDs report the v1 type
    return found


def open_device(port: RdmaPort) -> tuple[str | None, int | None]:
    """Open the device and pick a GID as the transport will: (problem or None, GID index)."""
    device = importlib.import_module("pyverbs.device")
    try:
        ctx = device.Context(name=port.device)
    except Exception as exc:
        return f"cannot open RDMA device {port.device} (is /dev/infiniband available?): {exc}", None
    try:
        attr = ctx.query_port(port.port)
        enums = importlib.import_module("pyverbs.libibverbs_enums")
        gids = read_gids(ctx, port.port, int(attr.gid_tbl_len), enums.ibv_gid_type_sysfs.IBV_GID_TYPE_SYSFS_ROCE_V2)
        return None, choose_gid_index(gids, port.link_layer, gid_index_override())
    except TransferError as exc:
        return f"RDMA device {port.device} port {port.port}: {exc.message}", None
    except Exception as exc:
        return f"cannot query RDMA device {port.device} port {port.port}: {exc}", None
    finally:
        ctx.close()
