"""The one error type of the KV transfer, with a machine-readable reason.

Callers branch on `reason` (for instance: fall back to local prefill on any failure, but
alert on `layout_mismatch`); the message says what happened in plain words.
"""

from __future__ import annotations

# Every reason a transfer can fail with; also the `reason` label of KV_TRANSFER_FAILURES.
LAYOUT_MISMATCH = "layout_mismatch"  # peers disagree on the KV layout hash or layout tag
VERSION_MISMATCH = "version_mismatch"  # peers speak different wire-protocol versions
CONNECT_FAILED = "connect_failed"  # no answer to the handshake in time
AUTH_FAILED = "auth_failed"  # the security handshake failed: peers hold different KV keys (or one has none)
PEER_LOST = "peer_lost"  # the other side closed or died mid-transfer
TIMEOUT = "timeout"  # the transfer's deadline passed
CORRUPT_FRAME = "corrupt_frame"  # a frame failed its checksum
INVALID_FRAME = "invalid_frame"  # a frame does not fit the layout or the reservation
UNKNOWN_TRANSFER = "unknown_transfer"  # the receiver expects no transfer with this id
INCOMPLETE = "incomplete"  # finish() before every (layer, K/V, block) was sent
ABORTED = "aborted"  # one side gave up on purpose (abort() or cancel())
ABANDONED = "abandoned"  # the receiver gave up on a transfer its sender never started or finished
CLOSED = "closed"  # the sender or receiver was closed
UNAVAILABLE = "unavailable"  # the transport cannot run here (no pyverbs, no RDMA device)
# The decode worker's, after a transfer arrived: the prompt digest its sender declared in BEGIN is not the
# digest of the decode request's prompt (or it declared none). The blocks are neither used nor cached.
PROMPT_MISMATCH = "prompt_mismatch"

REASONS = frozenset({
    LAYOUT_MISMATCH, VERSION_MISMATCH, CONNECT_FAILED, AUTH_FAILED, PEER_LOST, TIMEOUT, CORRUPT_FRAME,
    INVALID_FRAME, UNKNOWN_TRANSFER, INCOMPLETE, ABORTED, ABANDONED, CLOSED, UNAVAILABLE, PROMPT_MISMATCH,
})


class TransferError(RuntimeError):
    """A KV transfer (or the connection carrying it) failed; `reason` is one of REASONS."""

    def __init__(self, reason: str, message: str, transfer_id: str | None = None) -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown transfer failure reason {reason!r}")
        self.reason = reason
        self.message = message
        self.transfer_id = transfer_id
        where = f" (transfer {transfer_id})" if transfer_id else ""
        super().__init__(f"{reason}: {message}{where}")

    def to_wire(self) -> dict[str, str]:
        return {"reason": self.reason, "message": self.message}

    @classmethod
    def from_wire(cls, payload: dict[str, object], transfer_id: str | None = None) -> TransferError:
        reason = str(payload.get("reason", ""))
        message = str(payload.get("message", "no message"))
        if reason not in REASONS:
            reason, message = INVALID_FRAME, f"peer sent an unknown failure reason {reason!r}: {message}"
        return cls(reason, f"peer reports: {message}", transfer_id)
