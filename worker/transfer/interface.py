"""The transport-neutral interface every KV transport implements (tcp, rdma).

These are typing Protocols: the server codes against them, and the conformance suite in
tests/transfer/ runs the same tests against each implementation.
"""

from __future__ import annotations

from typing import Protocol

from .tracking import DoneCallback


class TransferResultLike(Protocol):
    @property
    def transfer_id(self) -> str: ...

    @property
    def bytes_sent(self) -> int: ...

    @property
    def seconds(self) -> float: ...


class KVTransfer(Protocol):
    transfer_id: str

    def send_layer(self, layer: int, src_block_ids: list[int], dst_start: int = 0) -> None: ...

    def finish(self) -> TransferResultLike: ...

    def abort(self, message: str = ...) -> None: ...


class KVConnection(Protocol):
    address: str

    @property
    def alive(self) -> bool: ...

    def begin(self, transfer_id: str, dst_block_ids: list[int], deadline_s: float,
              prompt_digest: bytes | None = None) -> KVTransfer: ...


class KVSender(Protocol):
    transport: str

    def connect(self, address: str) -> KVConnection: ...

    def close(self) -> None: ...


class KVReceiver(Protocol):
    transport: str
    address: str

    def expect(self, transfer_id: str, block_ids: list[int], deadline_s: float, on_done: DoneCallback) -> None: ...

    def cancel(self, transfer_id: str, reason: str | None = None) -> bool: ...

    def pending(self) -> list[str]: ...

    def prompt_digest(self, transfer_id: str) -> bytes | None: ...

    def close(self) -> None: ...
