"""A free-text reply cut off at ``max_new_tokens``, shown up to its last complete sentence.

A reply that stops at its token budget ends mid-sentence ("... in using their own code or") or on a list
marker with nothing after it ("2."). Shown as an agent's answer, or handed to a downstream agent as a
note, that stub reads as a broken output; the sentences before it are whole. `complete_text` keeps them
and drops the stub, unless that would leave less than half of the reply (one long sentence is better
shown cut than not shown).
"""

from __future__ import annotations

import re

__all__ = ["complete_text"]

# a sentence ends at . ! or ? (closing quotes or brackets may follow) before whitespace or the end
_SENTENCE_END = re.compile(r"[.!?][\"')\]\u201d\u2019]*(?=\s|\Z)")
_LIST_MARKER = re.compile(r"(?:^|\n)\s*(?:\d+|[a-zA-Z]|[ivxIVX]+)[.)]\Z")


def complete_text(text: str) -> str:
    """``text`` up to its last complete sentence, or as it is when no sentence ends in its second half."""
    body = text.rstrip()
    ends = [m.end() for m in _SENTENCE_END.finditer(body) if not _LIST_MARKER.search(body[: m.end()])]
    if not ends or ends[-1] == len(body):
        return text if not ends else body
    if ends[-1] < len(body) / 2:
        return text
    return body[: ends[-1]]
