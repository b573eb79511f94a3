"""How close two short answers are: the normalisation answers are compared under, and their token F1.

Shared by the answer gate (:class:`orchestra.familycache.gates.AnswerGate`), which compares an agent's
answer on a mapped cache with the source's own, and by the tasks benchmark, which scores answers
against references and against each other. Normalisation lower-cases, folds accents, drops
apostrophes, turns every other punctuation mark into a space, writes ``%`` as ``percent``, number
words as digits (``sixty days`` == ``60 days``) and dates day first (``June 29, 2007`` ==
``29 June 2007``). Pure functions.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter

__all__ = ["normalize", "token_f1"]

_UNITS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve thirteen "
                                       "fourteen fifteen sixteen seventeen eighteen nineteen".split())}
_TENS = {w: 10 * i for i, w in enumerate("_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()) if i >= 2}
_MONTHS = frozenset("january february march april may june july august september october november december".split())
_ORDINAL = re.compile(r"^(\d+)(?:st|nd|rd|th)$")
_APOSTROPHES = re.compile(r"['\u2019\u2018`]")
_NON_WORD = re.compile(r"[^a-z0-9]+")


def _numbers(words: list[str]) -> list[str]:
    """Number words as digits: ``sixty`` -> 60, ``twenty five`` -> 25, ``one hundred`` -> 100."""
    out: list[str] = []
    i = 0
    while i < len(words):
        w = words[i]
        value: int | None = None
        if w in _TENS:
            value = _TENS[w]
            if i + 1 < len(words) and words[i + 1] in _UNITS and 0 < _UNITS[words[i + 1]] < 10:
                value += _UNITS[words[i + 1]]
                i += 1
        elif w in _UNITS:
            value = _UNITS[w]
        if value is not None and i + 1 < len(words) and words[i + 1] == "hundred":
            value *= 100
            i += 1
        elif value is None and w == "hundred":
            value = 100
        out.append(str(value) if value is not None else w)
        i += 1
    return out


def _dates(words: list[str]) -> list[str]:
    """``june 29 2007`` -> ``29 june 2007`` (one order for both ways of writing a date), ``29th`` -> ``29``."""
    words = [m.group(1) if (m := _ORDINAL.match(w)) else w for w in words]
    for i in range(len(words) - 2):
        w, d, y = words[i : i + 3]
        if w in _MONTHS and d.isdigit() and len(d) <= 2 and y.isdigit() and len(y) == 4:
            words[i], words[i + 1] = d, w
    return words


def normalize(text: str) -> str:
    """Lower case, accents folded, apostrophes dropped, other punctuation as spaces, number words as digits,
    dates as day month year."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c for c in text if not unicodedata.combining(c)).lower()
    text = _APOSTROPHES.sub("", text).replace("%", " percent ")
    return " ".join(_dates(_numbers(_NON_WORD.sub(" ", text).split())))


def token_f1(reference: str, candidate: str) -> float:
    """SQuAD's token F1 of two answers (normalised words, counted with multiplicity; 1.0 for two empty texts)."""
    ref, cand = normalize(reference).split(), normalize(candidate).split()
    if not ref and not cand:
        return 1.0
    common = sum((Counter(ref) & Counter(cand)).values())
    if common == 0:
        return 0.0
    p, r = common / len(cand), common / len(ref)
    return 2 * p * r / (p + r)
