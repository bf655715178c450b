"""The KV transfer's Prometheus series on the workers' own /metrics pages.

Real `tandem serve` stacks (tests/serving/conftest.py): the series must be on each worker's
/metrics (one registry per process, each family once), count the bytes a disaggregated request
moved on both sides, and count a transfer the prefill side never started as a failure on the
decode side, not only as a fallback prefill.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tandem.worker import faults

from .conftest import Stack, metric_value, wait_until_disaggregated

pytestmark = pytest.mark.integration

PROMPT = "KV moves from the prefill worker to the decode worker, layer by layer, and is counted."


def faults_on() -> dict[str, str]:
    """The test's environment with fault injection allowed (`--prefill-fault` is refused without it)."""
    return {**os.environ, faults.ENV: "1"}


def complete(stack: Stack) -> list[int]:
    wait_until_disaggregated(stack)
    client = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    return list(out.choices[0].model_extra["token_ids"])


def families(url: str) -> list[str]:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return [family.name for family in text_string_to_metric_families(text)]


def test_worker_metrics_show_the_transfer_of_a_disaggregated_request(disagg: Stack) -> None:
    prefill, decode = disagg.procs("prefill")[0]["url"], disagg.procs("decode")[0]["url"]
    sent = metric_value(prefill, "tandem_kv_transfer_bytes_total", direction="send")
    received = metric_value(decode, "tandem_kv_transfer_bytes_total", direction="recv")

    assert len(complete(disagg)) == 4

    sent_now = metric_value(prefill, "tandem_kv_transfer_bytes_total", direction="send", transport="tcp")
    received_now = metric_value(decode, "tandem_kv_transfer_bytes_total", direction="recv", transport="tcp")
    assert sent_now - sent > 0, (f"the prefill worker's /metrics shows no KV bytes sent (decode fallbacks: "
                                 f"{metric_value(decode, 'tandem_fallback_prefills_total')})")
    assert sent_now - sent == received_now - received, "both sides must count the same transfer"
    for url, role in ((prefill, "prefill"), (decode, "decode")):
        assert metric_value(url, "tandem_kv_transport", transport="tcp", role=role, model="tiny") == 1
        assert metric_value(url, "tandem_kv_transport", transport="rdma") == 0
        assert metric_value(url, "tandem_kv_transfer_seconds_count", role=role) >= 1
        names = families(url)
        assert len(names) == len(set(names)), f"a metric family appears twice on {role}'s /metrics"
        assert "tandem_kv_transfer_failures" in names


def test_a_transfer_the_sender_never_starts_counts_as_a_decode_side_failure(
        start_stack: Callable[..., Stack]) -> None:
    faulty = start_stack("--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1",
                         "--prefill-fault", "drop-kv", env=faults_on())
    decode = faulty.procs("decode")[0]["url"]

    assert len(complete(faulty)) == 4

    assert metric_value(decode, "tandem_fallback_prefills_total") == 1
    assert metric_value(decode, "tandem_kv_transfer_failures_total", reason="abandoned", transport="tcp",
                        role="decode") == 1
    assert metric_value(decode, "tandem_kv_transfer_failures_total") == 1, "counted once, under one reason"
    assert metric_value(decode, "tandem_kv_transfer_bytes_total") == 0
