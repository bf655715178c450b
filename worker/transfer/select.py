"""Choosing a transport (`auto` = rdma when usable, else tcp) and building receivers/senders."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from tandem.worker.kv.layout import KVLayout

from .errors import UNAVAILABLE, TransferError
from .interface import KVReceiver, KVSender
from .rdma_probe import RdmaProbe, probe
from .telemetry import TransferTelemetry

log = logging.getLogger(__name__)
TRANSPORTS = ("auto", "tcp", "rdma")


def choose_transport(requested: str, telemetry: TransferTelemetry | None = None,
                     probe_rdma: Callable[[], RdmaProbe] = probe) -> tuple[str, str]:
    """Resolve `requested` to "tcp" or "rdma"; return it with the reason, log it, set KV_TRANSPORT_INFO.

    `rdma` asked for explicitly but not usable raises TransferError(UNAVAILABLE) with the reason.
    """
    if requested not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {requested!r}; expected one of {', '.join(TRANSPORTS)}")
    if requested == "tcp":
        kind, why = "tcp", "tcp was requested"
    else:
        found = probe_rdma()
        if found.usable:
            kind, why = "rdma", found.reason
        elif requested == "rdma":
            raise TransferError(UNAVAILABLE, found.reason)
        else:
            kind, why = "tcp", f"{found.reason}; falling back to tcp"
    log.info("KV transport: %s (%s: %s)", kind, requested, why)
    if telemetry is not None:
        telemetry.selected(kind)
    return kind, why


def make_receiver(kind: str, layout: KVLayout, kv_cache: torch.Tensor, *, host: str = "127.0.0.1", port: int = 0,
                  layout_tag: str | None = None, telemetry: TransferTelemetry | None = None,
                  **options: Any) -> KVReceiver:
    """Decode side: listen on host:port (0 = any free port) and receive into kv_cache."""
    telemetry = telemetry or TransferTelemetry()
    kind, _ = choose_transport(kind, telemetry)
    if kind == "rdma":
        from .rdma import RdmaReceiver

        return RdmaReceiver(layout, kv_cache, host=host, port=port, layout_tag=layout_tag, telemetry=telemetry,
                            **options)
    from .tcp_receiver import TcpReceiver

    return TcpReceiver(layout, kv_cache, host=host, port=port, layout_tag=layout_tag, telemetry=telemetry,
                       **options)


def make_sender(kind: str, layout: KVLayout, kv_cache: torch.Tensor, *, layout_tag: str | None = None,
                telemetry: TransferTelemetry | None = None, **options: Any) -> KVSender:
    """Prefill side: send blocks of kv_cache to receivers (sender.connect(address).begin(...))."""
    telemetry = telemetry or TransferTelemetry()
    kind, _ = choose_transport(kind, telemetry)
    if kind == "rdma":
        from .rdma import RdmaSender

        return RdmaSender(layout, kv_cache, layout_tag=layout_tag, telemetry=telemetry, **options)
    from .tcp_sender import TcpSender

    return TcpSender(layout, kv_cache, layout_tag=layout_tag, telemetry=telemetry, **options)
