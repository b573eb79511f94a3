"""Split a document longer than a model's window into overlapping chunks, each a prefix of its own.

    chunks = split_document(text, tokenizer, window_tokens=2048, overlap_tokens=64)
    chunks[1].label(len(chunks))     # "[chunk 2/5, page 3]"

The text is cut on its structure, coarsest first: anchor lines (Markdown ``#`` headings and the
``[page N]`` lines `orchestra.documents.formats` writes), then blank-line paragraphs, then lines (a table's
rows stay rows), then sentences, and only as a last resort inside a run of words. The pieces are
packed greedily so that each chunk's `agents.DocumentPrompt` prefix (chat head and markers included)
fits ``window_tokens``, measured with the real tokenizer, never estimated. Each chunk after the first
starts with about ``overlap_tokens`` of the previous chunk's trailing text, so a fact cut at a
boundary is whole in one of the two. A document whose prefix fits is one chunk, exactly its text,
so its cache is the one an unchunked run builds. Pure and deterministic: the same text, tokenizer
and window always give the same chunks.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orchestra.errors import DocumentError

HOLD_INPUT_TOKENS = 64
"""Tokens a held chunked document (a session's) keeps per input value, its question, when its chunks are cut."""

if TYPE_CHECKING:
    from mappings.types import Tokenizer

__all__ = ["Chunk", "split_document", "prefix_tokens", "select_chunks", "DEFAULT_OVERLAP_TOKENS", "HOLD_INPUT_TOKENS"]

DEFAULT_OVERLAP_TOKENS = 64

_ANCHOR = re.compile(r"^(?:#{1,6}[ \t]+\S|\[page \d+\][ \t]*$)", re.MULTILINE)
# each level's cut points, coarsest first; a piece that still does not fit is cut at the next level
_LEVELS: tuple[tuple[re.Pattern[str], bool], ...] = (
    (_ANCHOR, True),  # (pattern, cut before the match) else cut after it
    (re.compile(r"\n[ \t]*\n\s*"), False),
    (re.compile(r"\n"), False),
    (re.compile(r"[.!?;:][\"')\]]*\s+"), False),
)


@dataclass(frozen=True)
class Chunk:
    """One window of the document: its text, where it lies, the anchor it starts under, its prefix size."""

    index: int
    """0-based position among the document's chunks."""
    text: str
    """The chunk's text (the overlap with the previous chunk included)."""
    start: int
    """Character offset in the document where the text starts."""
    end: int
    """Character offset in the document where the text ends (exclusive)."""
    anchor: str | None
    """The page or heading the chunk's own text starts under ("[page 3]", "## Termination"), or None."""
    tokens: int
    """Token ids of the chunk's DocumentPrompt prefix: what is prefilled for it."""

    def label(self, total: int) -> str:
        """How outputs cite the chunk: ``[chunk 2/5, page 3]`` or ``[chunk 2/5, ## Termination]``."""
        where = ""
        if self.anchor:
            where = ", " + (self.anchor[1:-1] if self.anchor.startswith("[") else self.anchor)
        return f"[chunk {self.index + 1}/{total}{where}]"


def prefix_tokens(text: str, tokenizer: Tokenizer, use_chat_template: bool | None = None) -> list[int]:
    """The DocumentPrompt prefix ids of `text` (the chunk's cache key)."""
    from agents import DocumentPrompt

    return DocumentPrompt(text, use_chat_template=use_chat_template).token_ids(tokenizer)


def split_document(text: str, tokenizer: Tokenizer, window_tokens: int,
                   overlap_tokens: int = DEFAULT_OVERLAP_TOKENS, *,
                   use_chat_template: bool | None = None) -> list[Chunk]:
    """The document's chunks, each prefix at most `window_tokens` ids; DocumentError when no text fits."""
    if not text.strip():
        raise DocumentError("the document is empty; give a document with some text to analyse")
    whole = len(prefix_tokens(text, tokenizer, use_chat_template))
    if whole <= window_tokens:
        return [Chunk(0, text, 0, len(text), _anchor_at(_anchors(text), 0), whole)]
    counter = _Counter(tokenizer, use_chat_template)
    room = window_tokens - counter.overhead
    if room < 8:
        raise DocumentError(f"a chunk window of {window_tokens} tokens leaves no room for text after the prompt's "
                            f"{counter.overhead} tokens: raise chunking.window_tokens")
    overlap = min(max(0, overlap_tokens), room // 4)  # the overlap never crowds out the chunk's own text
    pieces = _pieces(text, 0, len(text), room - overlap, counter, 0)
    return _pack(text, _merge_blank(text, pieces), counter, window_tokens, overlap)


class _Counter:
    """Token counts of spans of text, and of a span's whole prefix."""

    def __init__(self, tokenizer: Tokenizer, use_chat_template: bool | None) -> None:
        from agents.prompt import encode_document_text

        self._encode: Callable[[str], list[int]] = lambda s: encode_document_text(tokenizer, s)
        self._prefix: Callable[[str], int] = lambda s: len(prefix_tokens(s, tokenizer, use_chat_template))
        self.overhead = self._prefix("x") - len(self._encode("x"))
        self._counts: dict[str, int] = {}

    def text(self, span: str) -> int:
        if span not in self._counts:  # packing asks for each piece's count again
            self._counts[span] = len(self._encode(span))
        return self._counts[span]

    def prefix(self, span: str) -> int:
        return self._prefix(span)


def _cuts(text: str, start: int, end: int, pattern: re.Pattern[str], before: bool) -> list[int]:
    points = [m.start() if before else m.end() for m in pattern.finditer(text, start, end)]
    return sorted({p for p in points if start < p < end})


def _pieces(text: str, start: int, end: int, room: int, counter: _Counter, level: int) -> list[tuple[int, int]]:
    """Consecutive spans covering [start, end), each `room` text tokens or fewer, cut as coarsely as they allow."""
    if counter.text(text[start:end]) <= room:
        return [(start, end)]
    if level >= len(_LEVELS):
        return _token_pieces(text, start, end, room, counter)
    points = _cuts(text, start, end, *_LEVELS[level])
    if not points:
        return _pieces(text, start, end, room, counter, level + 1)
    out: list[tuple[int, int]] = []
    for a, b in zip([start, *points], [*points, end], strict=True):
        out += _pieces(text, a, b, room, counter, level + 1)
    return out


def _token_pieces(text: str, start: int, end: int, room: int, counter: _Counter) -> list[tuple[int, int]]:
    """The last resort: the longest runs that fit, cut at a space where one is in the second half."""
    out: list[tuple[int, int]] = []
    while start < end:
        lo, hi = start + 1, end
        while lo < hi:  # the longest text[start:e] that fits
            mid = (lo + hi + 1) // 2
            if counter.text(text[start:mid]) <= room:
                lo = mid
            else:
                hi = mid - 1
        cut = lo
        if cut < end:
            space = text.rfind(" ", start + (cut - start) // 2, cut)
            cut = space + 1 if space > start else cut
        out.append((start, cut))
        start = cut
    return out


def _merge_blank(text: str, pieces: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Whitespace-only pieces joined to their neighbour, so no chunk is empty."""
    out: list[tuple[int, int]] = []
    for a, b in pieces:
        if out and (not text[a:b].strip() or not text[out[-1][0]:out[-1][1]].strip()):
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _pack(text: str, pieces: list[tuple[int, int]], counter: _Counter, window: int,
          overlap: int) -> list[Chunk]:
    """Greedy packing: as many pieces as fit after the overlap; the real prefix decides what fits."""
    chunks: list[Chunk] = []
    anchors = _anchors(text)
    i = 0
    while i < len(pieces):
        own = pieces[i][0]
        start = _overlap_start(text, chunks[-1], own, counter, overlap) if chunks else own
        j, size = _grow(text, pieces, i, start, counter, window)
        if j == i and start != own:  # the overlap leaves no room for this piece: drop the overlap
            start = own
            j, size = _grow(text, pieces, i, start, counter, window)
        if j == i:  # one piece alone overflows (tokens merged across its cuts): it still gets its own chunk
            j, size = i + 1, counter.prefix(text[start:pieces[i][1]])
        end = pieces[j - 1][1]
        chunks.append(Chunk(len(chunks), text[start:end], start, end, _anchor_at(anchors, own), size))
        i = j
    return chunks


def _grow(text: str, pieces: list[tuple[int, int]], i: int, start: int, counter: _Counter,
          window: int) -> tuple[int, int]:
    """(index after the last piece that fits from `start`, the prefix size then); (i, 0) when none fits.

    Pieces' own counts (summed, which BPE merges only lower) skip ahead cheaply; the real prefix then
    settles the last few pieces, so each chunk is tokenized a handful of times, not once per piece.
    """
    estimate = counter.overhead + counter.text(text[start:pieces[i][0]])
    j = i
    while j < len(pieces) and estimate + counter.text(text[pieces[j][0]:pieces[j][1]]) + 2 <= window:
        estimate += counter.text(text[pieces[j][0]:pieces[j][1]]) + 1
        j += 1
    size = counter.prefix(text[start:pieces[j - 1][1]]) if j > i else 0
    while j > i and size > window:
        j -= 1
        size = counter.prefix(text[start:pieces[j - 1][1]]) if j > i else 0
    while j < len(pieces):
        n = counter.prefix(text[start:pieces[j][1]])
        if n > window:
            break
        j, size = j + 1, n
    return j, size


def _overlap_start(text: str, previous: Chunk, own: int, counter: _Counter, overlap: int) -> int:
    """Where the next chunk starts: about `overlap` tokens before `own`, at a word start, inside `previous`."""
    if overlap <= 0:
        return own
    lo, hi = previous.start, own
    while lo < hi:  # the earliest start whose trailing text is at most `overlap` tokens
        mid = (lo + hi) // 2
        if counter.text(text[mid:own]) <= overlap:
            hi = mid
        else:
            lo = mid + 1
    while lo < own and not (lo == 0 or text[lo - 1].isspace()):
        lo += 1  # never begin inside a word
    return lo if previous.start < lo < own else own  # no word start in reach: no overlap


def _anchors(text: str) -> list[tuple[int, str]]:
    """Every anchor line (a heading or a page line) as (offset, label as written)."""
    out = []
    for match in _ANCHOR.finditer(text):
        line_end = text.find("\n", match.start())
        out.append((match.start(), text[match.start(): line_end if line_end >= 0 else len(text)].strip()))
    return out


def _anchor_at(anchors: list[tuple[int, str]], offset: int) -> str | None:
    """The last anchor at or before `offset`."""
    i = bisect_right([a for a, _ in anchors], offset)
    return anchors[i - 1][1] if i else None


def select_chunks(texts: list[str], query: str, k: int) -> list[int]:
    """Indices (in document order) of the `k` texts most relevant to `query` by BM25; all when k covers them."""
    if k >= len(texts):
        return list(range(len(texts)))
    try:
        from rank_bm25 import BM25Plus  # Okapi gives a word in half the chunks no weight
    except ImportError as exc:
        from agents.errors import MissingDependencyError

        raise MissingDependencyError("choosing an agent's k most relevant chunks (chunks: k) needs rank-bm25, which "
                                     "is not installed: pip install rank-bm25 (a core dependency; or set chunks: all)"
                                     ) from exc
    words = [re.findall(r"\w+", text.lower()) or [""] for text in texts]
    scores = BM25Plus(words).get_scores(re.findall(r"\w+", query.lower()))
    ranked = sorted(range(len(texts)), key=lambda i: (-float(scores[i]), i))  # ties: the earlier chunk
    return sorted(ranked[:k])
