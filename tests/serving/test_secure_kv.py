"""`tandem serve --secure-kv`: the KV cache moves over CURVE-encrypted, authenticated zmq, tokens unchanged.

Real `tandem serve` stacks (tests/serving/conftest.py) with real worker processes.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from .conftest import Stack, metric_value
from .test_transfer_metrics import complete

pytestmark = pytest.mark.integration


def test_secure_kv_transfer_serves_the_same_tokens_as_plain(start_stack: Callable[..., Stack], disagg: Stack) -> None:
    secure = start_stack("--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1", "--secure-kv")
    prefill, decode = secure.procs("prefill")[0]["url"], secure.procs("decode")[0]["url"]

    assert complete(secure) == complete(disagg)

    assert metric_value(prefill, "tandem_kv_transfer_bytes_total", direction="send", transport="tcp") > 0, (
        f"no KV moved over the secure channel (decode fallbacks: "
        f"{metric_value(decode, 'tandem_fallback_prefills_total')})")
    assert metric_value(decode, "tandem_kv_transfer_failures_total") == 0
    assert metric_value(prefill, "tandem_kv_transfer_failures_total") == 0
    assert "KV transfer: secure" in secure.log.read_text() or any(
        "KV transfer: secure" in path.read_text() for path in secure.log.parent.glob("logs/*.log"))
