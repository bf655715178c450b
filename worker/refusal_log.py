"""A throttle for refusal logs, shared by the router's edge (router/auth.py: API keys) and the worker
control API (server/control_auth.py: the control token, on workers and on the router's /workers).

A flood of refused calls must not flood the log too: the first refusal is logged at once, later ones at
most once per `every_s` seconds, each line saying how many were held back since the previous one. Every
refusal is still counted in the caller's Prometheus counter; only the log lines are throttled. The line
goes to the caller's own logger, so a refusal is logged under the module that refused it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

LOG_EVERY_S = 10.0


class ThrottledLog:
    """Logs refusals at WARNING on `logger`: the first at once, then at most one line per `every_s`."""

    def __init__(self, logger: logging.Logger, every_s: float = LOG_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.every_s, self.clock = logger, every_s, clock
        self._lock = threading.Lock()
        self._last = -float("inf")
        self._suppressed = 0

    def warning(self, message: str, *args: object) -> bool:
        """Log `message % args` unless a line went out less than every_s ago; whether it was logged."""
        with self._lock:
            now = self.clock()
            if now - self._last < self.every_s:
                self._suppressed += 1
                return False
            suppressed, self._suppressed, self._last = self._suppressed, 0, now
        more = f" ({suppressed} more refused since the last line)" if suppressed else ""
        self.logger.warning(message + more, *args)
        return True
