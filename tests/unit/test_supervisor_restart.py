"""`tandem serve`'s restart policy for workers that exit (worker/server/supervisor.py)."""

from __future__ import annotations

from tandem.worker.server.supervisor import MAX_RESTARTS, RESTART_DELAYS_S, restart_delay


def test_restarts_back_off_to_a_ceiling_then_stop() -> None:
    delays = [restart_delay(n) for n in range(MAX_RESTARTS + 2)]
    assert delays[:MAX_RESTARTS] == sorted(delays[:MAX_RESTARTS]), "each restart in a row waits at least as long"
    assert delays[0] == RESTART_DELAYS_S[0] == 1.0 and max(d for d in delays if d is not None) <= 30.0
    assert delays[MAX_RESTARTS:] == [None, None], "a worker that keeps exiting stays down"
