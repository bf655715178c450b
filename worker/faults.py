"""Fault injection: test hooks that make a worker misbehave on purpose (`tandem worker --fault`, `tandem serve
--prefill-fault`), for the tests of what the rest of the stack does about it (tests/serving/test_fallback.py).

A worker that drops every KV transfer serves slower for everyone, so the hooks are off unless the process's
environment says TANDEM_ENABLE_FAULTS=1: without it `--fault` is refused at start. The operator never sets
the variable and refuses a DisaggregatedModel whose pool args carry `--fault` or whose env sets the variable
(tandem.operator.api: PoolSpec's rules), so a resource cannot turn a fault on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

ENV = "TANDEM_ENABLE_FAULTS"
FLAG = "--fault"  # `tandem worker`'s hidden option
# drop-kv: a prefill worker computes the prompt but never ships its KV. swap-kv-blocks: it ships the prompt's
# blocks in reverse order into the right destination blocks, so decode reads wrong KV without any error (what
# the router's canary must catch).
FAULTS = ("drop-kv", "swap-kv-blocks")


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether fault injection is allowed in this process: exactly TANDEM_ENABLE_FAULTS=1."""
    return (os.environ if environ is None else environ).get(ENV) == "1"


def check(fault: str | None, option: str = FLAG, environ: Mapping[str, str] | None = None) -> None:
    """ValueError unless `fault` is None, or a known fault with the switch set."""
    if fault is None:
        return
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}")
    if not enabled(environ):
        raise ValueError(f"{option} is a test hook that makes this process misbehave on purpose; it is refused "
                         f"unless the environment sets {ENV}=1 (never set it in production)")
