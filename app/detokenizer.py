"""Incremental detokenization with stop strings.

Text is released only when it is final: never half of a multi-byte character (a trailing
U+FFFD means the bytes are incomplete), and never text that could be the start of a stop
string. A stop string found ends the text just before it and is never emitted.

``min_tokens`` holds stop strings off as vLLM does: a stop string must end in the text of
an output token past the first ``min_tokens`` (it may begin earlier), so the output is never
cut inside the tokens the request asked to get at least.
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True,
                 min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens
        self._stop_after = 0  # a stop string must end past this character of _text
        self._last_index = -1  # output index of the last token fed
        self.stop = tuple(stop)
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""  # all final text decoded so far
        self._emitted = 0  # characters of _text already returned
        self.stopped = False  # a stop string was found
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    @property
    def text(self) -> str:
        return self._text[: self._emitted]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int, index: int | None = None) -> str:
        """Feed one token; return the newly final text (possibly empty). ``index``: the
        token's output position in the whole stream (a resumed stream's events carry it),
        by default the number of tokens fed before it."""
        if self.stopped:
            return ""
        self._last_index = len(self.token_ids) if index is None else index
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            self._text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.token_ids)
        self._hold_off_stops()
        return self._release(final=False)

    def _hold_off_stops(self) -> None:
        """Text that is final while the last token is within ``min_tokens`` cannot end a
        stop string (text a later token completes belongs to that token, as in vLLM)."""
        if self._last_index < self.min_tokens:
            self._stop_after = len(self._text)

    def finish(self) -> str:
        """The stream ended: release what was held back (minus any stop string)."""
        if not self.stopped:
            tail = self._decode(self.token_ids[self._prefix_offset :])
            prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
            if len(tail) > len(prefix):
                self._text += tail[len(prefix) :].rstrip(_REPLACEMENT)
            self._hold_off_stops()
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        if self.stop and not self.stopped:
            # search from where a stop string could begin that was not yet emitted
            start = max(0, self._emitted - self._hold)
            hits = [i for s in self.stop
                    if (i := self._text.find(s, max(start, self._stop_after - len(s) + 1)))
                    != -1]
            if hits:
                self._text = self._text[: min(hits)]
                self.stopped = True
                final = True
        limit = len(self._text) if final else max(self._emitted, len(self._text) - self._hold)
        out = self._text[self._emitted : limit]
        self._emitted = limit
        return out
