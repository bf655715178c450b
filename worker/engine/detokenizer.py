"""A request's output text: streaming deltas, with stop strings cut exactly.

Text that could still turn out to be the start of a stop string is held back from the
stream until it cannot; when a stop string appears, the text ends right before it.
"""

from __future__ import annotations

from typing import Protocol


class TokenDetokenizer(Protocol):
    def push(self, token_id: int) -> str: ...


class OutputText:
    def __init__(self, detokenizer: TokenDetokenizer, stop: list[str]) -> None:
        self._detokenizer = detokenizer
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._emitted = 0

    def push(self, token_id: int) -> bool:
        """Add a token's text; True when a stop string now appears (the text is cut before it)."""
        before = len(self.text)
        self.text += self._detokenizer.push(token_id)
        if not self._stop or len(self.text) == before:
            return False
        search_from = max(0, before - self._holdback)
        hits = [i for s in self._stop if (i := self.text.find(s, search_from)) >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        return True

    def take_delta(self, finished: bool) -> str:
        """Text not yet returned; while running, the last few characters wait if they might begin a stop string."""
        end = len(self.text) if finished else len(self.text) - self._holdback
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta

    def skip_pending(self) -> None:
        """Mark all text so far as delivered (by another worker, e.g. the prefill worker's first token)."""
        self._emitted = len(self.text)
