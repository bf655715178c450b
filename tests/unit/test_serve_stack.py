"""`tandem serve` hands its router options to the router process it starts (no process is started here)."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from tandem.worker.commands import router as router_command
from tandem.worker.commands import serve as serve_command
from tandem.worker.server.supervisor import LocalStack, StackSpec


def test_the_router_gets_the_request_and_stall_timeouts(tmp_path: Path) -> None:
    stack = LocalStack(StackSpec(model_dir=tmp_path, model_name="m", log_dir=tmp_path / "logs",
                                 request_timeout=42.0, stall_timeout=7.5))
    argv = stack.router.argv[stack.router.argv.index("router") + 1:]
    # The router's own parser accepts exactly what the stack passes it, with those values.
    params = router_command.command.make_context("router", list(argv)).params
    assert params["request_timeout"] == 42.0
    assert params["stall_timeout"] == 7.5


def test_serve_refuses_a_stall_timeout_that_is_not_positive() -> None:
    result = CliRunner().invoke(serve_command.command, ["--model", "tiny", "--stall-timeout", "0"])
    assert result.exit_code == 2
    assert "--stall-timeout" in result.output
