"""Turns a request's sampled tokens into text, releasing it safely around stop strings."""

from __future__ import annotations


class OutputText:
    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self._tokenizer = tokenizer
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self._released = 0

    def add(self, token_id: int) -> tuple[str, bool]:
        """Add a token; returns (text to release now, whether a stop string was hit)."""
        self.token_ids.append(token_id)
        text = self._tokenizer.decode(self.token_ids)
        # An incomplete UTF-8 sequence decodes to U+FFFD: wait for the next token.
        text = text.rstrip("\ufffd")
        stopped = False
        if self._stop:
            search_from = max(0, self._released - self._hold)
            hits = [i for i in (text.find(s, search_from) for s in self._stop) if i >= 0]
            if hits:
                text, stopped = text[:min(hits)], True
        self.text = text
        safe = len(text) if stopped else len(text) - self._hold
        return self._release(safe), stopped

    def flush(self) -> str:
        """Release whatever is held back (the request is ending)."""
        if self.token_ids:
            full = self._tokenizer.decode(self.token_ids)
            if not self._stop_hit_in(full):
                self.text = full
        return self._release(len(self.text))

    def _stop_hit_in(self, text: str) -> bool:
        return any(s in text for s in self._stop)

    def _release(self, upto: int) -> str:
        if upto <= self._released:
            return ""
        out = self.text[self._released:upto]
        self._released = upto
        return out
