"""The worker control credential against real processes: a `tandem serve` stack and a router of its own.

Without the model's control token (or with another one) a worker answers 401 and does nothing: a
/kv/reserve sets no block aside, a /generate runs nothing. Probes and /metrics stay open. The router,
holding the token, serves as before; its /workers listing wants the token too. Pure parts (parsing,
the constant-time check, the middleware, the 0600 file) are tested in-process at the end.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from tandem.worker.commands import router as router_command
from tandem.worker.commands import worker as worker_command
from tandem.worker.server import control_auth, control_token
from tandem.worker.server.control_token import (
    ENV_TOKEN,
    ENV_TOKEN_FILE,
    HEADER,
    ControlTokenError,
    ControlTokens,
)
from tandem.worker.server.supervisor import LocalStack, StackSpec

from .conftest import Stack, control_headers, free_port, metric_value, wait_until_disaggregated

WRONG = {HEADER: "not-this-models-token-0123456789"}
RESERVE = {"request_id": "auth-reserve", "num_tokens": 160, "deadline_s": 30}
# Every control route, with a body it would act on if the caller were let in.
CONTROL_CALLS: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/kv/reserve", RESERVE),
    ("POST", "/kv/cancel", {"request_id": "auth-reserve"}),
    ("POST", "/generate", {"request_id": "auth-gen", "prompt_token_ids": [5, 6, 7],
                           "sampling": {"max_tokens": 4, "temperature": 0}}),
    ("POST", "/decode", {"request_id": "auth-dec", "prompt_token_ids": [5, 6, 7], "first_token_id": 8,
                         "sampling": {"max_tokens": 4}, "kv_ready": False}),
    ("POST", "/abort", {"request_id": "auth-gen"}),
    ("GET", "/info", None),
    ("GET", "/tokenizer", None),
    ("GET", "/openapi.json", None),
]


def worker_url(stack: Stack, role: str) -> str:
    return str(stack.procs(role)[0]["url"])


def stats(url: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/info", headers=control_headers(), timeout=5).json()["stats"])


def refusals(url: str, reason: str) -> float:
    return metric_value(url, "tandem_control_auth_failures_total", reason=reason)


@pytest.mark.integration
@pytest.mark.parametrize(("who", "headers", "reason"), [("no token", {}, "missing"), ("a wrong token", WRONG, "invalid")])
def test_a_worker_refuses_every_control_call_without_the_token_and_does_nothing(
        disagg: Stack, who: str, headers: dict[str, str], reason: str) -> None:
    decode = worker_url(disagg, "decode")
    before, counted = stats(decode), refusals(decode, reason)
    for method, path, body in CONTROL_CALLS:
        resp = httpx.request(method, f"{decode}{path}", json=body, headers=headers, timeout=10)
        assert resp.status_code == 401, f"{method} {path} with {who}: {resp.status_code} {resp.text}"
        error = resp.json()["error"]
        assert error["code"] == f"control_token_{reason}" and HEADER in error["message"], error
        assert WRONG[HEADER] not in resp.text
    after = stats(decode)
    # Nothing was reserved, generated or queued: the pool is exactly as it was.
    for key in ("num_free_blocks", "num_reserved_blocks", "num_running", "num_waiting"):
        assert after[key] == before[key], (key, before, after)
    assert refusals(decode, reason) == counted + len(CONTROL_CALLS)
    # The same reserve with the token does take blocks (so the unchanged pool above means something).
    ok = httpx.post(f"{decode}/kv/reserve", json=dict(RESERVE, request_id=f"auth-ok-{reason}"),
                    headers=control_headers(), timeout=10)
    assert ok.status_code == 200, ok.text
    assert stats(decode)["num_reserved_blocks"] == before["num_reserved_blocks"] + len(ok.json()["block_ids"])
    assert httpx.post(f"{decode}/kv/cancel", json={"request_id": f"auth-ok-{reason}"}, headers=control_headers(),
                      timeout=10).json() == {"cancelled": True}


@pytest.mark.integration
def test_probes_and_metrics_need_no_token(disagg: Stack) -> None:
    for role in ("prefill", "decode"):
        url = worker_url(disagg, role)
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        assert httpx.get(f"{url}/ready", timeout=5).status_code == 200
        text = httpx.get(f"{url}/metrics", timeout=5).text
        for reason in ("missing", "invalid"):  # exported from the start (at 0 until a refusal)
            assert re.search(rf'^tandem_control_auth_failures_total{{[^}}]*reason="{reason}"', text, re.M), text


@pytest.mark.integration
def test_the_router_serves_as_before_and_keeps_workers_to_itself(disagg: Stack) -> None:
    wait_until_disaggregated(disagg)  # the router's polls and /workers carry the token
    resp = httpx.post(f"{disagg.url}/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 8
    counted = {r: refusals(disagg.url, r) for r in ("missing", "invalid")}
    for headers, reason in (({}, "missing"), (WRONG, "invalid")):
        listed = httpx.get(f"{disagg.url}/workers", headers=headers, timeout=5)
        assert listed.status_code == 401, listed.text
        assert "127.0.0.1" not in listed.text and "layout" not in listed.text
        assert refusals(disagg.url, reason) == counted[reason] + 1
    listed = httpx.get(f"{disagg.url}/workers", headers=control_headers(), timeout=5)
    assert listed.status_code == 200 and {w["role"] for w in listed.json()} == {"prefill", "decode"}


@pytest.mark.integration
def test_a_router_with_another_token_gets_no_worker(disagg: Stack, tiny_model: Path, tmp_path: Path) -> None:
    """A router that does not hold the workers' token (another model's, a stale one) cannot use them: it says
    why in /workers, never becomes ready, and each of its polls is a refusal counted on the worker."""
    decode, prefill = worker_url(disagg, "decode"), worker_url(disagg, "prefill")
    counted = refusals(decode, "invalid")
    port = free_port()
    env = {**os.environ, ENV_TOKEN: "another-models-token-0123456789"}
    log = tmp_path / "router.log"
    with log.open("wb") as fh:
        popen = subprocess.Popen([sys.executable, "-m", "tandem.worker.cli", "router", "--port", str(port),
                                  "--model", str(tiny_model), "--prefill", prefill, "--decode", decode],
                                 stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        listed: list[dict[str, Any]] = []
        limit = time.monotonic() + 60
        while time.monotonic() < limit and not (listed and all(w["error"] for w in listed)):
            with contextlib.suppress(httpx.HTTPError):
                listed = httpx.get(f"{url}/workers", headers={HEADER: env[ENV_TOKEN]}, timeout=2).json()
            time.sleep(0.2)
        assert listed and all("refused this router's worker control token (401)" in w["error"] for w in listed), \
            f"{listed}\n{log.read_text()[-2000:]}"
        assert httpx.get(f"{url}/ready", timeout=5).status_code == 503
        assert refusals(decode, "invalid") > counted
        assert "refused this router's worker control token" in log.read_text()
    finally:
        popen.send_signal(signal.SIGTERM)
        popen.wait(30)


@pytest.mark.integration
@pytest.mark.slow
def test_serve_makes_a_fresh_token_per_run_and_keeps_it_off_command_lines(
        start_stack: Callable[..., Stack]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in (ENV_TOKEN, ENV_TOKEN_FILE)}
    stack = start_stack("--mode", "monolithic", "--decode-workers", "1", env=env)
    try:
        token_file = Path(stack.state["control_token_file"])
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = ControlTokens.from_file(token_file)
        assert token.tokens[0] != os.environ[ENV_TOKEN]
        for p in stack.state["processes"]:
            cmdline = Path(f"/proc/{p['pid']}/cmdline").read_bytes().decode()
            assert token.tokens[0] not in cmdline and str(token_file) in cmdline, p["name"]
        worker = worker_url(stack, "both")
        assert httpx.get(f"{worker}/info", headers=control_headers(), timeout=5).status_code == 401
        assert httpx.get(f"{worker}/info", headers=token.headers, timeout=5).status_code == 200
        resp = httpx.post(f"{stack.url}/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": "Hi", "max_tokens": 4, "temperature": 0})
        assert resp.status_code == 200, resp.text
    finally:
        assert stack.stop() == 0


# --------------------------------------------------------------------------- commands (no process started)


@pytest.mark.parametrize("command", [worker_command.command, router_command.command], ids=["worker", "router"])
def test_a_command_without_a_token_refuses_to_start(command: Any, tmp_path: Path) -> None:
    args = ["--model", str(tmp_path)] + (["--decode", "http://127.0.0.1:1"] if command is router_command.command else [])
    env: dict[str, str | None] = {ENV_TOKEN: None, ENV_TOKEN_FILE: None}
    result = CliRunner().invoke(command, args, env=env)
    assert result.exit_code == 2, result.output
    assert "no worker control token" in result.output and "--insecure-control-api" in result.output
    result = CliRunner().invoke(command, [*args, "--insecure-control-api"], env={ENV_TOKEN: "x" * 20})
    assert result.exit_code == 2 and "exclude each other" in result.output
    short = tmp_path / "short"
    short.write_text("tiny\n")
    result = CliRunner().invoke(command, [*args, "--control-token-file", str(short)], env=env)
    assert result.exit_code == 2 and "token 1 has 4 characters" in result.output


def test_serve_hands_its_processes_the_token_file_never_the_token(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_TOKEN, raising=False)
    first = LocalStack(StackSpec(model_dir=tmp_path, model_name="m", log_dir=tmp_path / "a"))
    second = LocalStack(StackSpec(model_dir=tmp_path, model_name="m", log_dir=tmp_path / "b"))
    assert first.control.tokens != second.control.tokens  # one per run
    for p in first.procs:
        assert p.argv[p.argv.index("--control-token-file") + 1] == str(first.control_token_file)
        assert first.control.tokens[0] not in " ".join(p.argv)
    assert stat.S_IMODE(first.control_token_file.stat().st_mode) == 0o600
    argv = first.router.argv[first.router.argv.index("router") + 1:]
    params = router_command.command.make_context("router", list(argv)).params
    assert params["control_token_file"] == first.control_token_file
    monkeypatch.setenv(ENV_TOKEN, "the-users-own-token-0123456789")  # the user's own is used as it is
    own = LocalStack(StackSpec(model_dir=tmp_path, model_name="m", log_dir=tmp_path / "c"))
    assert own.control.tokens == ("the-users-own-token-0123456789",)


# --------------------------------------------------------------------------- pure parts


def test_token_files_parse_lines_comments_and_refuse_junk() -> None:
    assert control_token.parse("# rotation\n\n  new-token-0123456789 \nold-token-0123456789\n", "f") == \
        ("new-token-0123456789", "old-token-0123456789")
    for text, why in (("", "holds no control token"), ("# only a comment\n", "holds no control token"),
                      ("short\n", "has 5 characters"), ("has a space in it 0123\n", "without spaces"),
                      ("tab\tin-the-middle-012345\n", "without spaces"), ("ünïcode-token-0123456789\n", "ASCII")):
        with pytest.raises(ControlTokenError, match=why):
            control_token.parse(text, "f")


def test_the_check_accepts_any_listed_token_and_says_why_not() -> None:
    tokens = ControlTokens(("new-token-0123456789", "old-token-0123456789"), "test")
    assert tokens.headers == {HEADER: "new-token-0123456789"}
    assert tokens.check("new-token-0123456789") is None and tokens.check("old-token-0123456789") is None
    assert tokens.check(None) == "missing" and tokens.check("") == "missing"
    assert tokens.check("new-token-012345678") == "invalid" and tokens.check("new-token-0123456789x") == "invalid"
    assert tokens.check("\udcff") == "invalid"  # undecodable header bytes do not raise
    assert "0123456789" not in repr(tokens) and "0123456789" not in str(tokens)
    assert control_token.fingerprint(tokens.tokens) == control_token.fingerprint("\n".join(tokens.tokens))
    assert control_token.fingerprint(("a" * 20,)) != control_token.fingerprint(("b" * 20,))
    assert len({control_token.generate() for _ in range(100)}) == 100


def test_load_prefers_the_file_then_the_environment(tmp_path: Path) -> None:
    file = control_token.write_private(tmp_path / "t", "from-the-file-0123456789")
    assert control_token.load(file, {ENV_TOKEN: "from-the-env-0123456789"}).tokens == ("from-the-file-0123456789",)  # type: ignore[union-attr]
    assert control_token.load(None, {ENV_TOKEN: "from-the-env-0123456789"}).tokens == ("from-the-env-0123456789",)  # type: ignore[union-attr]
    assert control_token.load(None, {}) is None
    with pytest.raises(ControlTokenError, match="cannot read the control token file"):
        control_token.load(tmp_path / "absent", {})


def test_the_token_file_is_private_even_when_it_existed(tmp_path: Path) -> None:
    path = tmp_path / "dir" / "control-token"
    path.parent.mkdir()
    path.write_text("an old world-readable token\n")
    path.chmod(0o644)
    control_token.write_private(path, "fresh-token-0123456789")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == "fresh-token-0123456789\n"


def _guarded_app(counted: list[str], reached: list[str]) -> TestClient:
    async def route(request: Request) -> JSONResponse:
        reached.append(request.url.path)
        await request.body()
        return JSONResponse({"ok": True})

    paths = ["/health", "/ready", "/metrics", "/kv/reserve", "/info"]
    app = Starlette(routes=[Route(p, route, methods=["GET", "POST"]) for p in paths])
    tokens = ControlTokens(("right-token-0123456789",))
    return TestClient(control_auth.ControlAuth(app, tokens, counted.append))


def test_the_middleware_refuses_before_the_route_runs() -> None:
    counted: list[str] = []
    reached: list[str] = []
    client = _guarded_app(counted, reached)
    for path in ("/health", "/ready", "/metrics"):
        assert client.get(path).status_code == 200
    resp = client.post("/kv/reserve", content=b"x" * 100_000)
    assert resp.status_code == 401 and resp.headers["www-authenticate"].startswith(HEADER)
    assert resp.json()["error"]["code"] == "control_token_missing"
    assert client.get("/info", headers=WRONG).status_code == 401
    assert client.get("/nowhere").status_code == 401  # unknown paths too: no route list for strangers
    assert reached == ["/health", "/ready", "/metrics"] and counted == ["missing", "invalid", "missing"]
    assert client.post("/kv/reserve", json={}, headers={HEADER: "right-token-0123456789"}).status_code == 200
    assert reached[-1] == "/kv/reserve"


def test_refusals_are_logged_without_the_token_and_throttled(caplog: pytest.LogCaptureFixture) -> None:
    counted: list[str] = []
    client = _guarded_app(counted, [])
    with caplog.at_level(logging.WARNING, logger=control_auth.__name__):
        for _ in range(5):
            client.get("/info", headers=WRONG)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "GET /info" in lines[0] and "invalid control token" in lines[0], lines
    assert WRONG[HEADER] not in json.dumps(lines) and len(counted) == 5
    log = control_auth.RefusalLog("call", every_s=0.0)
    with caplog.at_level(logging.WARNING, logger=control_auth.__name__):
        log.refused("missing", "POST", "/abort", "10.0.0.9")
    assert "from 10.0.0.9: missing control token" in caplog.records[-1].getMessage()
