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
RDMA_ONLY_OPTIONS = ("verbs_factory", "drain_timeout_s")  # dropped when auto falls back to tcp


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


def _split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(options for tcp, the rdma-only ones)."""
    rdma = {key: options[key] for key in RDMA_ONLY_OPTIONS if key in options}
    return {key: value for key, value in options.items() if key not in rdma}, rdma


def _fall_back(requested: str, exc: TransferError, telemetry: TransferTelemetry) -> None:
    """`auto` picked rdma but it cannot be set up: say why and use tcp; explicit `rdma` raises."""
    if requested != "auto" or exc.reason != UNAVAILABLE:
        raise exc
    log.warning("KV transport: tcp (auto: rdma looked usable but could not be set up: %s; falling back to tcp)",
                exc.message)
    telemetry.selected("tcp")


def make_receiver(kind: str, layout: KVLayout, kv_cache: torch.Tensor, *, host: str = "127.0.0.1", port: int = 0,
                  layout_tag: str | None = None, telemetry: TransferTelemetry | None = None,
                  probe_rdma: Callable[[], RdmaProbe] = probe, **options: Any) -> KVReceiver:
    """Decode side: listen on host:port (0 = any free port) and receive into kv_cache."""
    telemetry = telemetry or TransferTelemetry()
    chosen, _ = choose_transport(kind, telemetry, probe_rdma)
    tcp_options, rdma_options = _split_options(options)
    if chosen == "rdma":
        from .rdma import RdmaReceiver

        try:
            return RdmaReceiver(layout, kv_cache, host=host, port=port, layout_tag=layout_tag, telemetry=telemetry,
                                **tcp_options, **rdma_options)
        except TransferError as exc:
            _fall_back(kind, exc, telemetry)
    from .tcp_receiver import TcpReceiver

    return TcpReceiver(layout, kv_cache, host=host, port=port, layout_tag=layout_tag, telemetry=telemetry,
                       **tcp_options)


def make_sender(kind: str, layout: KVLayout, kv_cache: torch.Tensor, *, layout_tag: str | None = None,
                telemetry: TransferTelemetry | None = None, probe_rdma: Callable[[], RdmaProbe] = probe,
                **options: Any) -> KVSender:
    """Prefill side: send blocks of kv_cache to receivers (sender.connect(address).begin(...))."""
    telemetry = telemetry or TransferTelemetry()
    chosen, _ = choose_transport(kind, telemetry, probe_rdma)
    tcp_options, rdma_options = _split_options(options)
    if chosen == "rdma":
        from .rdma import RdmaSender

        try:
            return RdmaSender(layout, kv_cache, layout_tag=layout_tag, telemetry=telemetry, **tcp_options,
                              **rdma_options)
        except TransferError as exc:
            _fall_back(kind, exc, telemetry)
    from .tcp_sender import TcpSender

    return TcpSender(layout, kv_cache, layout_tag=layout_tag, telemetry=telemetry, **tcp_options)
