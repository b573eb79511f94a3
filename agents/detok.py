"""Turning generated token ids into streamed text, with stop strings.

`TextAssembler` decodes incrementally (holding back incomplete UTF-8 sequences), cuts the text before
the first stop string, and never streams text that could still turn out to be the start of a stop
string. The concatenation of everything it returns is exactly the final output text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from mappings.types import Tokenizer

__all__ = ["TextAssembler"]


@dataclass
class TextAssembler:
    """Incremental detokenizer + stop-string matcher for one generation."""

    tokenizer: Tokenizer
    stop: Sequence[str] = ()
    ids: list[int] = field(default_factory=list)
    decoded: str = ""
    """All text decoded so far (complete characters only)."""
    emitted: int = 0
    """How many characters of ``decoded`` have been handed out."""
    stopped: bool = False
    stopped_by: str | None = None
    """The stop string that ended the text (the earliest in it), once one has."""
    _prefix_offset: int = 0
    _read_offset: int = 0

    def _decode(self, ids: list[int]) -> str:
        # one id list decodes to one str (transformers types `decode` as `str | list[str]`, for batches too)
        return cast(str, self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))

    def _advance(self, final: bool) -> None:
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.ids[self._prefix_offset :])
        if len(full) > len(prefix_text) and (final or not full.endswith("\ufffd")):
            self.decoded += full[len(prefix_text) :]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now safe to stream ('' if none)."""
        if self.stopped:
            raise RuntimeError("push after a stop string was found")
        before = len(self.decoded)
        self.ids.append(token_id)
        self._advance(final=False)
        if self.stop:
            longest = max(len(s) for s in self.stop)
            start = max(0, before - longest + 1)
            hits = [(i, s) for i, s in ((self.decoded.find(s, start), s) for s in self.stop) if i >= 0]
            if hits:
                at, self.stopped_by = min(hits)
                self.decoded = self.decoded[:at]
                self.stopped = True
                return self._emit(len(self.decoded))
            return self._emit(len(self.decoded) - self._partial_stop_length())
        return self._emit(len(self.decoded))

    def finish(self) -> str:
        """Flush what is held back at the end of generation (partial characters, partial stop strings)."""
        if not self.stopped:
            self._advance(final=True)
        return self._emit(len(self.decoded))

    @property
    def text(self) -> str:
        return self.decoded

    def _partial_stop_length(self) -> int:
        """Length of the longest tail of ``decoded`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.decoded)), best, -1):
                if self.decoded.endswith(s[:k]):
                    best = k
                    break
        return best

    def _emit(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        chunk = self.decoded[self.emitted : upto]
        self.emitted = upto
        return chunk
