"""The worker control credential's command-line options, shared by `tandem worker` and `tandem router`.

The token itself never goes on a command line (`ps` shows every process's argv to every user):
it comes from a file (--control-token-file, or $TANDEM_CONTROL_TOKEN_FILE) or from the environment
($TANDEM_CONTROL_TOKEN). Without either the command refuses to start, unless --insecure-control-api
says on purpose that anyone who reaches the workers may drive them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from tandem.worker.server import control_token
from tandem.worker.server.control_token import ControlTokenError, ControlTokens

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])


def control_options(func: F) -> F:
    func = click.option(
        "--insecure-control-api", is_flag=True,
        help="Run without a worker control token: anyone who reaches a worker's port can reserve its KV, "
             "generate, abort. Only for a machine nobody else can reach.")(func)
    func = click.option(
        "--control-token-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
        envvar=control_token.ENV_TOKEN_FILE,
        help="File with the model's worker control token (one per line: the first is sent, any is accepted); "
             "the router and every worker of the model need it. Or set $TANDEM_CONTROL_TOKEN to the token. "
             f"[env: {control_token.ENV_TOKEN_FILE}]")(func)
    return func


def resolve(token_file: Path | None, insecure: bool) -> ControlTokens | None:
    """The credential the options ask for; click.UsageError when there is none and none was waived."""
    try:
        tokens = control_token.load(token_file)
    except ControlTokenError as exc:
        raise click.UsageError(str(exc)) from None
    if tokens is not None:
        if insecure:
            raise click.UsageError("--insecure-control-api and a control token exclude each other")
        log.info("worker control: token from %s (%s)", tokens.source, control_token.fingerprint(tokens.tokens))
        return tokens
    if not insecure:
        raise click.UsageError(
            f"no worker control token: give --control-token-file FILE or set ${control_token.ENV_TOKEN} (the "
            "model's router and workers share it; `tandem serve` and the operator make one for you), or pass "
            "--insecure-control-api to let anyone who reaches the workers drive them")
    log.warning("worker control API WITHOUT a token (--insecure-control-api): anyone who reaches the workers "
                "can drive them")
    return None
