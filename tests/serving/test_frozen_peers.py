"""Frozen and slow peers (SIGSTOP, not SIGKILL: the process keeps its connections and wakes up later).

A frozen worker answers nothing but refuses nothing either; when it resumes it works through
whatever was queued meanwhile. The router must not wait on it longer than its timeouts, must not
blame healthy workers for it, and whatever the worker set aside for requests that went elsewhere
must be given back once it resumes. The KV transfer must not let a frozen receiver hold up its
senders until the request's deadline.

The stack here is started by hand (a router with a short --stall-timeout in front of one prefill
and two decode workers, each of which a test freezes by pid), so the stall-bound tests take seconds,
not minutes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tandem.worker.router.dispatch import STREAM_SILENT_S
from tandem.worker.transfer import TransferError
from tandem.worker.transfer.conformance import TINY_LAYOUT, make_cache, spawn_receiver
from tandem.worker.transfer.tcp_receiver import TcpReceiver
from tandem.worker.transfer.tcp_sender import TcpSender

from .conftest import control_headers, free_port

pytestmark = pytest.mark.integration

STALL_S = 5.0  # the router's --stall-timeout
RESERVE_TIMEOUT_S = 5.0  # dispatch.RESERVE_TIMEOUT_S: how long the router waits for /kv/reserve
PROMPT = "Kubernetes runs pods on nodes. The operator reconciles resources and scales the pools on metrics."


def freeze(pid: int) -> None:
    """SIGSTOP, and wait until the kernel has stopped every thread (the signal is asynchronous)."""
    os.kill(pid, signal.SIGSTOP)
    limit = time.monotonic() + 5
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < limit, f"process {pid} did not stop"
        time.sleep(0.001)


@dataclass
class Proc:
    name: str
    role: str
    url: str
    popen: subprocess.Popen[bytes]

    def stop(self) -> None:  # frozen, connections open
        freeze(self.popen.pid)

    def resume(self) -> None:
        os.kill(self.popen.pid, signal.SIGCONT)

    def info(self) -> dict[str, Any]:
        return dict(httpx.get(f"{self.url}/info", headers=control_headers(), timeout=5).json())

    def holds(self) -> tuple[int, int]:
        """(requests and reservations in flight, blocks reserved for incoming KV)."""
        info = self.info()
        return info["in_flight"], info["stats"]["num_reserved_blocks"]

    def holds_at_most(self, before: tuple[int, int], timeout: float) -> bool:
        """Whether, within `timeout`, this worker holds no more than it did `before` (what an earlier
        test left may expire meanwhile)."""
        limit = time.monotonic() + timeout
        while any(now > then for now, then in zip(self.holds(), before, strict=True)):
            if time.monotonic() > limit:
                return False
            time.sleep(0.2)
        return True


@dataclass
class Stack:
    url: str
    procs: list[Proc]

    def role(self, role: str) -> list[Proc]:
        return [p for p in self.procs if p.role == role]

    def router_view(self) -> dict[str, dict[str, Any]]:
        return {w["url"]: w for w in httpx.get(f"{self.url}/workers", headers=control_headers(), timeout=5).json()}

    def settle(self, timeout: float = 30.0) -> None:
        """Every worker resumed, usable again for the router, and running nothing."""
        for p in self.procs:
            p.resume()
        limit = time.monotonic() + timeout
        while time.monotonic() < limit:
            with contextlib.suppress(httpx.HTTPError):
                view = self.router_view()
                infos = [p.info() for p in self.procs if p.role != "router"]
                if all(w["usable"] for w in view.values()) and not any(
                        i["stats"]["num_running"] or i["stats"]["num_waiting"] for i in infos):
                    return
            time.sleep(0.2)
        pytest.fail(f"the stack did not settle within {timeout:g}s")


@pytest.fixture(scope="module")
def stack(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """1 prefill and 2 decode workers (tcp KV) behind a router with --stall-timeout 5."""
    logs = tmp_path_factory.mktemp("frozen")
    cli = [sys.executable, "-m", "tandem.worker.cli"]
    procs: list[Proc] = []

    def start(name: str, role: str, argv: list[str], url: str) -> None:
        with (logs / f"{name}.log").open("wb") as log:
            popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(Proc(name, role, url, popen))

    try:
        for name, role in (("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")):
            port = free_port()
            start(name, role, [*cli, "worker", "--role", role, "--model", str(tiny_model), "--model-name", "tiny",
                               "--port", str(port), "--kv-port", str(free_port()), "--transport", "tcp",
                               "--kv-cache-bytes", str(8 << 20)], f"http://127.0.0.1:{port}")
        port = free_port()
        workers = [a for p in procs for a in ("--prefill" if p.role == "prefill" else "--decode", p.url)]
        start("router", "router", [*cli, "router", "--port", str(port), "--model-name", "tiny", "--model",
                                   str(tiny_model), "--stall-timeout", str(STALL_S), "--request-timeout", "60",
                                   *workers], f"http://127.0.0.1:{port}")
        stack = Stack(f"http://127.0.0.1:{port}", procs)
        limit = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                if len(stack.router_view()) == 3 and all(w["usable"] for w in stack.router_view().values()):
                    break
            if time.monotonic() > limit or any(p.popen.poll() is not None for p in procs):
                pytest.fail("the stack did not come up:\n" + "\n".join(
                    f"{f.name}: {f.read_text()[-1500:]}" for f in logs.iterdir()))
            time.sleep(0.2)
        # Two requests at once: the second goes to the other decode worker (the router counts the blocks
        # the first reserved), so the prefill worker has a KV connection to each, as in a warm deployment.
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda _: stream_ids(stack, 4), range(2)))
        yield stack
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.popen.pid, signal.SIGCONT)
                p.popen.kill()
            p.popen.wait(10)


def stream_ids(stack: Stack, max_tokens: int, prompt: str = PROMPT, on_token: Any = None) -> list[int]:
    client = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    ids: list[int] = []
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True, "return_token_ids": True}):
        for choice in chunk.choices:
            ids += (choice.model_extra or {})["token_ids"]
            if on_token is not None:
                on_token(len(ids))
    return ids


def next_decode_pick(stack: Stack) -> Proc:
    """The decode worker the router places the next request on (placement.pick_decode on idle workers:
    most free blocks, then the larger URL), once its next /info poll has replaced the blocks it counts
    as reserved by the last request (pending_blocks)."""
    time.sleep(1.0)  # two poll intervals
    view = stack.router_view()
    return max(stack.role("decode"), key=lambda p: (view[p.url]["info"]["stats"]["num_free_blocks"], p.url))


@pytest.mark.slow
def test_a_frozen_decode_worker_that_never_answers_its_reservation_costs_time_not_the_request(stack: Stack) -> None:
    """The router picked a decode worker that froze before the router's poll noticed: /kv/reserve gets no
    answer. That worker is lost for this request, the other one serves it (it was a 504 "deadline passed"
    after 5 s, with 55 s of the request's deadline left)."""
    expected = stream_ids(stack, 30)
    victim = next_decode_pick(stack)
    victim.stop()
    try:
        started = time.monotonic()
        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda _: stream_ids(stack, 30), range(3)))
        took = time.monotonic() - started
    finally:
        victim.resume()
    assert results == [expected] * 3
    assert took >= RESERVE_TIMEOUT_S - 0.5, "the router should have tried the frozen worker first"
    assert took < RESERVE_TIMEOUT_S + 15
    stack.settle()  # what the frozen worker reserved after resuming: the last test below


@pytest.mark.slow
def test_the_only_decode_worker_missing_one_reservation_is_tried_again_once_it_answers(stack: Stack) -> None:
    """One decode worker left (the other frozen and known down), and it misses the reserve deadline once
    (frozen for 6.5 s, as a new pod on a busy node can be in a rollout). It is tried again as soon as the
    router's poll reaches it: on the real node this request was a 503 "no ready worker can take this
    request now" after the router had waited 10 s with that worker healthy again after 2."""
    expected = stream_ids(stack, 30)
    victim = next_decode_pick(stack)
    other = next(p for p in stack.role("decode") if p is not victim)
    other.stop()
    try:
        limit = time.monotonic() + 10
        while stack.router_view()[other.url]["usable"]:
            assert time.monotonic() < limit, "the router did not notice the frozen worker"
            time.sleep(0.2)
        victim.stop()
        threading.Timer(RESERVE_TIMEOUT_S + 1.5, victim.resume).start()
        started = time.monotonic()
        assert stream_ids(stack, 30) == expected
        took = time.monotonic() - started
    finally:
        victim.resume()
        other.resume()
    assert took >= RESERVE_TIMEOUT_S, "the router should have waited for the frozen worker's reservation"
    assert took < RESERVE_TIMEOUT_S + 8, f"took {took:.1f}s"
    stack.settle()


@pytest.mark.slow
def test_a_decode_worker_frozen_while_the_prefill_ships_its_kv_does_not_cost_twice_the_stall(stack: Stack) -> None:
    """The decode worker froze after reserving KV for a request, before the prefill worker shipped it: the
    prefill worker waits for a confirmation that cannot come, so its /prefill times out. The request
    starts over on the other decode worker at once (it used to try that frozen worker again for a local
    prefill: two stall timeouts plus a cancel's), and once the worker resumes it holds nothing for it."""
    expected = stream_ids(stack, 20)
    baseline = {p.url: p.holds() for p in stack.role("decode")}
    result, took, victim = freeze_the_decode_worker_while_its_kv_ships(stack, 20)
    assert result == expected
    assert took < 1.7 * STALL_S, f"took {took:.1f}s"
    # The router cancelled the reservation with a call the frozen worker reads when it resumes (it
    # used to stay until it expired, the request's deadline + 5 s).
    assert victim.holds_at_most(baseline[victim.url], 10), victim.holds()
    stack.settle()


def freeze_the_decode_worker_while_its_kv_ships(stack: Stack, max_tokens: int) -> tuple[list[int], float, Proc]:
    """One request whose decode worker freezes after reserving its KV, before the prefill worker ships
    it (the prefill worker is held stopped until then). Returns its tokens, the seconds from the freeze
    to its end, and the frozen worker (resumed by then)."""
    baseline = {p.url: p.holds()[0] for p in stack.role("decode")}
    prefill = stack.role("prefill")[0]
    prefill.stop()  # holds the request between its reservation and its prefill
    result: list[list[int]] = []
    thread = threading.Thread(target=lambda: result.append(stream_ids(stack, max_tokens)))
    started = time.monotonic()
    thread.start()
    victim = None
    while victim is None and time.monotonic() - started < 10:
        victim = next((p for p in stack.role("decode") if p.holds()[0] > baseline[p.url]), None)
    if victim is None:
        prefill.resume()
        thread.join(60)
        pytest.fail("no decode worker reserved KV for the request")
    victim.stop()
    frozen_at = time.monotonic()
    prefill.resume()  # it computes the prompt and ships the KV to the frozen worker
    try:
        thread.join(60)
        took = time.monotonic() - frozen_at
    finally:
        victim.resume()
    assert result, "the request did not finish within 60 s"
    return result[0], took, victim


@pytest.fixture(scope="module")
def patient(stack: Stack, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A second router in front of the same workers, with the default --stall-timeout (60 s): what the
    router itself notices, rather than its stall timeout, decides how long a request waits."""
    port = free_port()
    workers = [a for p in stack.procs if p.role != "router"
               for a in ("--prefill" if p.role == "prefill" else "--decode", p.url)]
    log_path = tmp_path_factory.mktemp("patient") / "router.log"
    with log_path.open("wb") as log:
        popen = subprocess.Popen([sys.executable, "-m", "tandem.worker.cli", "router", "--port", str(port),
                                  "--model-name", "tiny", "--model", str(tiny_model), "--request-timeout", "120",
                                  *workers], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    router = Proc("patient-router", "router", f"http://127.0.0.1:{port}", popen)
    patient = Stack(router.url, [*(p for p in stack.procs if p.role != "router"), router])
    try:
        limit = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                view = patient.router_view()
                if len(view) == 3 and all(w["usable"] for w in view.values()):
                    break
            if time.monotonic() > limit or popen.poll() is not None:
                pytest.fail(f"the second router did not come up:\n{log_path.read_text()[-1500:]}")
            time.sleep(0.2)
        yield patient
    finally:
        popen.kill()
        popen.wait(10)


@pytest.mark.slow
def test_a_decode_worker_that_stops_answering_while_its_kv_ships_is_given_up_on_soon(patient: Stack) -> None:
    """Frozen after its reservation, before the prefill worker shipped it the KV: the prefill worker would
    wait its KV silence timeout (--kv-wait-timeout, 30 s) for a confirmation that cannot come, and the
    router its stall timeout (60 s here). Once the router's polls have not reached the decode worker for
    4 s it gives up on that /prefill and starts the request over on the other decode worker."""
    expected = stream_ids(patient, 20)
    # Two at once, so the prefill worker has a live KV connection to each decode worker (an earlier test
    # may have broken one): a connection made after the freeze would fail its handshake within 5 s instead.
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda _: stream_ids(patient, 4), range(2)))
    baseline = {p.url: p.holds() for p in patient.role("decode")}
    result, took, victim = freeze_the_decode_worker_while_its_kv_ships(patient, 20)
    assert result == expected
    assert took < 12, f"took {took:.1f}s after the decode worker froze (its KV silence timeout is 30 s)"
    assert victim.holds_at_most(baseline[victim.url], 10), victim.holds()
    patient.settle()


def freeze_the_decode_worker_mid_stream(stack: Stack, max_tokens: int) -> tuple[list[int], float, Proc]:
    """Stream `max_tokens`, SIGSTOP the decode worker serving it after 10 tokens, resume it once the
    stream ended: (token ids the client got, seconds the stream took, the frozen worker)."""
    frozen: list[Proc] = []

    def freeze_the_busy_one(count: int) -> None:
        if count >= 10 and not frozen:
            busy = next(p for p in stack.role("decode") if p.info()["stats"]["num_running"])
            busy.stop()
            frozen.append(busy)

    started = time.monotonic()
    try:
        disturbed = stream_ids(stack, max_tokens, on_token=freeze_the_busy_one)
        took = time.monotonic() - started
    finally:
        for p in frozen:
            p.resume()
    return disturbed, took, frozen[0]


@pytest.mark.slow
def test_a_decode_worker_frozen_mid_stream_is_left_and_taken_back(stack: Stack) -> None:
    """Frozen mid-stream: the stream moves on with the same tokens; once resumed, the worker frees the
    request's KV (it sends nothing more to anyone) and serves new requests."""
    expected = stream_ids(stack, 200)
    baseline = {p.url: p.holds() for p in stack.role("decode")}
    disturbed, took, frozen = freeze_the_decode_worker_mid_stream(stack, 200)
    assert disturbed == expected
    assert took < STALL_S + 15
    stack.settle(timeout=10)
    assert frozen.holds_at_most(baseline[frozen.url], 5), frozen.holds()
    assert frozen.info()["stats"]["num_running"] == 0


@pytest.mark.slow
def test_a_stream_from_a_frozen_decode_worker_moves_on_after_seconds_not_the_stall_timeout(patient: Stack) -> None:
    """Workers send a heartbeat line after a second without output, so the router (stall timeout 60 s
    here) takes 5 s of silence mid-stream for a frozen worker and moves the stream on. Before
    heartbeats, this stream waited out the whole stall timeout."""
    expected = stream_ids(patient, 200)
    disturbed, took, _ = freeze_the_decode_worker_mid_stream(patient, 200)
    assert disturbed == expected
    assert took < STREAM_SILENT_S + 15, f"took {took:.1f}s with a decode worker frozen mid-stream"
    patient.settle(timeout=10)


def test_reservations_the_router_stopped_waiting_for_are_given_back(stack: Stack) -> None:
    """A frozen decode worker resumes with /kv/reserve calls queued whose caller timed out and went
    elsewhere: it must not keep those blocks until the reservations expire (the request's deadline,
    600 s by default). Needs http.py to pass the request's is_disconnected to WorkerServer.reserve."""
    victim = stack.role("decode")[0]
    baseline = victim.holds()
    victim.stop()
    try:
        def reserve(i: int) -> None:
            with contextlib.suppress(httpx.TimeoutException):
                httpx.post(f"{victim.url}/kv/reserve", json={"request_id": f"gone-{i}", "num_tokens": 40,
                                                              "deadline_s": 60}, headers=control_headers(),
                           timeout=1.0)

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(reserve, range(4)))
    finally:
        victim.resume()
    assert victim.holds_at_most(baseline, 10), f"still held: {victim.holds()}, before: {baseline}"


# --- the transfer: a frozen receiver ---------------------------------------------------------------

def test_a_receiver_that_stops_answering_fails_the_transfer_after_the_silence_timeout() -> None:
    """The sender waits for the receiver's confirmation (finish) and, with a full window, for its
    acknowledgements on the engine thread: a frozen receiver used to hold both until the transfer's
    deadline, the whole request's. Now it fails with `timeout` once the receiver said nothing for
    silence_timeout_s."""
    peer = spawn_receiver("tcp", 16)
    sender = TcpSender(TINY_LAYOUT, make_cache(TINY_LAYOUT, 16, random=True), silence_timeout_s=2.0)
    try:
        address = peer.recv()
        peer.pipe.send(("frozen", [0, 1, 2]))
        assert peer.recv() == "expected"
        transfer = sender.connect(address).begin("frozen", [0, 1, 2], 60.0)
        assert peer.process.pid is not None
        freeze(peer.process.pid)
        for layer in range(TINY_LAYOUT.num_layers):
            transfer.send_layer(layer, [0, 1, 2])
        started = time.monotonic()
        with pytest.raises(TransferError) as failed:
            transfer.finish()
        assert failed.value.reason == "timeout"
        assert "has not answered" in failed.value.message
        assert time.monotonic() - started < 10  # not the 60 s deadline
    finally:
        if peer.process.pid is not None:
            os.kill(peer.process.pid, signal.SIGCONT)
        peer.kill()
        sender.close()


def test_a_frozen_receiver_does_not_hold_up_connections_to_other_receivers() -> None:
    """connect() handshakes with a receiver that does not answer until connect_timeout_s; that used to
    happen under the sender's one lock, so a transfer to a healthy decode worker waited behind it, and
    every concurrent connect() to the frozen one waited its own timeout in turn."""
    peer = spawn_receiver("tcp", 16)
    healthy = TcpReceiver(TINY_LAYOUT, make_cache(TINY_LAYOUT, 16, random=False))
    sender = TcpSender(TINY_LAYOUT, make_cache(TINY_LAYOUT, 16, random=True), connect_timeout_s=4.0)
    outcomes: list[tuple[str, float]] = []

    def connect_frozen(address: str) -> None:
        begun = time.monotonic()
        try:
            sender.connect(address)
            outcomes.append(("connected", time.monotonic() - begun))
        except TransferError as exc:
            outcomes.append((exc.reason, time.monotonic() - begun))

    threads: list[threading.Thread] = []
    try:
        address = peer.recv()
        assert peer.process.pid is not None
        freeze(peer.process.pid)
        threads = [threading.Thread(target=connect_frozen, args=(address,)) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        begun = time.monotonic()
        sender.connect(healthy.address)
        assert time.monotonic() - begun < 2.0
        for t in threads:
            t.join(20)
        assert [reason for reason, _ in outcomes] == ["connect_failed", "connect_failed"]
        assert max(seconds for _, seconds in outcomes) < 6.0  # one 4 s handshake, not one each
    finally:
        if peer.process.pid is not None:
            os.kill(peer.process.pid, signal.SIGCONT)
        peer.kill()
        for t in threads:
            t.join(20)
        sender.close()
        healthy.close()
