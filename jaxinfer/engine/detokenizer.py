"""A request's output text, decoded a few tokens at a time, and its stop strings.

Each new token decodes only a short window: the tokens since the last emitted text plus the chunk
before them, whose decode is subtracted (so a window's first token decodes as it does in context).
Text is emitted once it no longer ends in a partial UTF-8 character (U+FFFD). Stop strings are
searched only in the newly emitted tail (and the few characters before it that a stop string
could straddle), so a request's stop checks cost O(its length) in all, not O(length^2).
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool, stop: list[str] | None = None):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = list(stop or ())
        self._overlap = max((len(s) for s in self._stop), default=1) - 1
        self._prefix = 0  # start of the decode window
        self._read = 0  # end of the tokens whose text is emitted
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def add(self, token_ids: list[int]) -> bool:
        """Take the output ``token_ids`` so far (the new ones at the end); True when the text now holds
        a stop string, in which case ``text`` is cut where the first one starts."""
        emitted = self._decode(token_ids[self._prefix:self._read])
        window = self._decode(token_ids[self._prefix:])
        if len(window) <= len(emitted) or window.endswith("\ufffd"):
            return False
        start = max(0, len(self.text) - self._overlap)
        self.text += window[len(emitted):]
        self._prefix, self._read = self._read, len(token_ids)
        hits = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            return True
        return False
