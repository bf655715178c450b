"""A flood against a real decode worker's KV port costs the attacker, not the worker (issue 18, point 5).

A real `tandem serve` stack (tests/serving/conftest.py). The attacker comes from 127.0.0.2 (another
address than the prefill worker's 127.0.0.1, as on a real network, so the per-peer caps are its own):
- one 1 GiB message part (the issue's repro),
- connections sending one message of endless 0-byte parts (zmq keeps ~64 bytes per 2 wire bytes
  until the last part arrives),
- 40 handshakes from a stranger: a HELLO with the right layout hash but without the model's control token,
  20 sealed with a wrong token and 20 not sealed at all. KV transfer is sealed by default, so each is
  refused at the handshake before it holds a session or anything else: the wrong token counts as
  auth_failed, the unsealed HELLO as version_mismatch (it is what a worker of a release before sealing
  sends; docs/alerts.md). (The per-peer session cap, which a token holder or anyone facing a model run
  with --kv-encryption none meets, is tested in tests/transfer/test_receiver_limits.py.)
Legitimate requests run during and after the flood: their KV must still be transferred (no fallback
prefill) and their output must equal the output before the flood; the worker stays healthy.

Measured here (the decode worker's peak RSS growth, VmHWM, over the flood; 2 shared cores, a CI run
alongside):
- before the limits (RCVHWM=0, no MAXMSGSIZE, no caps; 7efb12b), with TANDEM_TEST_FLOOD_MIB=8 (an
  eighth of the endless-parts flood, so as not to exhaust the machine): +1,692 MiB (682 -> 2,374), all
  40 junk sessions welcomed, the 1 GiB part read to the end; in a first run the worker stopped
  answering /health, the router marked it down and a legitimate request got a 503;
- with them, the full flood: +80 MiB (683 -> 763) and +151 MiB in an earlier run; with
  TANDEM_TEST_FLOOD_MIB=8: +208 MiB (before the receiver counted an idle socket as drained). 16
  sessions welcomed, 24 refused; the 1 GiB part cut after 0-3 MiB, each endless message after 1-6 MiB.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable

import httpx
import pytest
import zmq
from openai import OpenAI

from tandem.worker.transfer import wire
from tandem.worker.transfer.conformance import raw_zmtp_dealer
from tandem.worker.transfer.sealing import SealSecrets, SenderHandshake

from .conftest import Stack, control_headers, metric_value, wait_until_disaggregated

pytestmark = pytest.mark.integration

PROMPT = "A flood of junk at the KV port must not cost the decode worker its memory or its streams."
ATTACKER = "127.0.0.2"
RSS_GROWTH_LIMIT_MIB = 400
BOMB_CONNECTIONS = 4
# Per connection, at most (the receiver cuts it off long before). TANDEM_TEST_FLOOD_MIB makes it smaller, to
# measure a receiver without limits (32x that in RSS) without exhausting the machine.
BOMB_WIRE_BYTES = int(os.environ.get("TANDEM_TEST_FLOOD_MIB", "256")) << 20


def complete(stack: Stack) -> list[int] | str:
    try:
        return _complete(stack)
    except Exception as exc:  # counted below, after the figures are printed
        return f"{type(exc).__name__}: {exc}"


def _complete(stack: Stack) -> list[int]:
    client = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    return list(out.choices[0].model_extra["token_ids"])


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def zmtp_connection(port: int) -> socket.socket:
    """A raw TCP connection from ATTACKER that has completed the ZMTP 3.0 NULL handshake as a DEALER."""
    return raw_zmtp_dealer(port, ATTACKER)


def send_until_cut(sock: socket.socket, chunk: bytes, total: int) -> int:
    sent = 0
    try:
        while sent < total:
            sock.sendall(chunk)
            sent += len(chunk)
    except OSError:
        pass
    finally:
        sock.close()
    return sent


def oversized_message(port: int) -> int:
    """The issue's repro: one message part announced as 1 GiB, then its bytes."""
    sock = zmtp_connection(port)
    sock.sendall(b"\x02" + struct.pack(">Q", 1 << 30))
    return send_until_cut(sock, b"x" * (1 << 20), 1 << 30)


def endless_parts(port: int) -> int:
    """One message that never ends: 0-byte parts, each flagged MORE (2 wire bytes apiece)."""
    return send_until_cut(zmtp_connection(port), b"\x01\x00" * (1 << 19), BOMB_WIRE_BYTES)


def junk_sessions(address: str, layout_hash: str, count: int, token: str | None) -> tuple[int, int]:
    """`count` DEALERs from ATTACKER each saying a HELLO, sealed with `token` when one is given; returns
    (welcomed, refused)."""
    ctx = zmq.Context()
    host_port = address.removeprefix("tcp://")
    welcomed = refused = 0
    socks = []
    try:
        for _ in range(count):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{ATTACKER}:0;{host_port}")
            session = uuid.uuid4().hex
            hello = {"protocol": wire.PROTOCOL_VERSION, "transport": "tcp", "layout_hash": layout_hash,
                     "session": session}
            if token is not None:
                hello.update(SenderHandshake(SealSecrets.from_tokens([token]), session).hello_fields())
            sock.send_multipart([b"H", json.dumps(hello).encode()])
            socks.append(sock)
        limit = time.monotonic() + 15
        for sock in socks:
            if sock.poll(max(0, int((limit - time.monotonic()) * 1000))):
                kind, _ = sock.recv_multipart()
                welcomed += kind == b"W"
                refused += kind == b"R"
    finally:
        for sock in socks:
            sock.close()
        ctx.term()
    return welcomed, refused


def test_a_kv_port_flood_leaves_the_decode_worker_bounded_and_serving(start_stack: Callable[..., Stack]) -> None:
    stack = start_stack("--mode", "disaggregated", "--prefill-workers", "1", "--decode-workers", "1")
    wait_until_disaggregated(stack)
    decode = stack.procs("decode")[0]
    kv = httpx.get(f"{decode['url']}/info", headers=control_headers(), timeout=5).json()
    address, layout_hash = kv["kv_address"], kv["layout_hash"]
    port = int(address.rpartition(":")[2])

    reference = complete(stack)  # also warms up: the prefill worker's session to decode is open
    fallbacks = metric_value(decode["url"], "tandem_fallback_prefills_total")
    received = metric_value(decode["url"], "tandem_kv_transfer_bytes_total", direction="recv")
    before = peak_rss_mib(decode["pid"])

    outputs: list[list[int] | str] = []
    sent: dict[str, int] = {}
    sessions: list[tuple[int, int]] = []
    attacks = [threading.Thread(target=lambda: sent.__setitem__("oversized", oversized_message(port)))]
    attacks += [threading.Thread(target=lambda i=i: sent.__setitem__(f"parts{i}", endless_parts(port)))
                for i in range(BOMB_CONNECTIONS)]
    auth_failures = metric_value(decode["url"], "tandem_kv_transfer_failures_total", reason="auth_failed")
    mismatches = metric_value(decode["url"], "tandem_kv_transfer_failures_total", reason="version_mismatch")
    attacks.append(threading.Thread(target=lambda: sessions.append(
        junk_sessions(address, layout_hash, 20, "not-the-models-token"))))
    attacks.append(threading.Thread(target=lambda: sessions.append(junk_sessions(address, layout_hash, 20, None))))
    for attack in attacks:
        attack.start()
    while any(attack.is_alive() for attack in attacks):  # legitimate traffic during the flood
        outputs.append(complete(stack))
        time.sleep(0.2)
    for attack in attacks:
        attack.join()
    time.sleep(1.5)  # the monitor's close events, the watchdog's last look
    after = peak_rss_mib(decode["pid"])
    outputs.extend(complete(stack) for _ in range(3))  # and after it

    growth = after - before
    print(f"decode peak RSS {before:.0f} -> {after:.0f} MiB (+{growth:.0f} MiB); attacker sent "
          f"{ {k: v >> 20 for k, v in sent.items()} } MiB; sessions (welcomed, refused) {sessions}")
    assert all(out == reference for out in outputs), f"requests failed or changed during or after the flood: " \
        f"{[out for out in outputs if out != reference]}"
    assert metric_value(decode["url"], "tandem_fallback_prefills_total") == fallbacks, \
        "a legitimate transfer failed (the request was prefilled locally)"
    assert metric_value(decode["url"], "tandem_kv_transfer_bytes_total", direction="recv") > received
    assert httpx.get(f"{decode['url']}/health", timeout=5).status_code == 200
    assert growth < RSS_GROWTH_LIMIT_MIB, f"the decode worker's peak RSS grew by {growth:.0f} MiB"
    assert sessions == [(0, 20), (0, 20)], f"a stranger without the control token got a session: {sessions}"
    assert metric_value(decode["url"], "tandem_kv_transfer_failures_total", reason="auth_failed") \
        >= auth_failures + 20, "the handshakes sealed with a wrong token were not counted as auth_failed"
    assert metric_value(decode["url"], "tandem_kv_transfer_failures_total", reason="version_mismatch") \
        >= mismatches + 20, "the unsealed handshakes were not counted as version_mismatch"
    assert sent["oversized"] < 1 << 30, "the 1 GiB part was read to the end"
    refused = {reason: metric_value(decode["url"], "tandem_kv_receiver_refusals_total", reason=reason)
               for reason in ("bytes_in_flight", "dropped")}
    assert all(refused.values()), f"every refusal is counted by its reason: {refused}"
