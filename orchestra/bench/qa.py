"""The QA set behind the ``tasks`` section: extractive questions over the bundled licenses, and their scoring.

``data/qa.json`` (shipped with the package) holds *passages* (a character span of one bundled
document) and *questions* on them, each with short reference answers that occur in the passage.
``data/qa_heldout.json`` (:data:`HELDOUT_QA_FILE`) is a second set of that format over license texts
that neither the calibration corpus nor the first set uses; :func:`load_qa` takes either bare name.
A question is answered from a window of the document around its passage (:func:`passage_window`),
so the context a model reads can be sized without changing the questions; questions on one passage
share its window, so a window is prefilled once per member and condition.

Scoring is normalised containment (:func:`is_correct`): a prediction is correct when one reference,
normalised, occurs in it as whole words. Normalisation lower-cases, folds accents, drops apostrophes,
turns every other punctuation mark into a space, writes ``%`` as ``percent``, number words as digits
(``sixty days`` == ``60 days``, ``twenty-five`` == ``25``) and dates day first (``June 29, 2007`` ==
``29 June 2007``), so references are written as the document writes them. Pure functions, no model.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from functools import lru_cache
from importlib import resources
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agents.agreement import normalize

if TYPE_CHECKING:
    from mappings.types import Tokenizer

__all__ = ["AnswerType", "QAPassage", "QAQuestion", "QASet", "load_qa", "normalize", "is_correct", "passage_window",
           "QA_FILE", "HELDOUT_QA_FILE"]

QA_FILE = "qa.json"
HELDOUT_QA_FILE = "qa_heldout.json"
"""A second QA set over texts that neither the calibration corpus nor :data:`QA_FILE` uses."""
_BUNDLED = (QA_FILE, HELDOUT_QA_FILE)
AnswerType = Literal["date", "number", "duration", "name", "term", "title"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class QAPassage(_Model):
    """A character span ``[start, end)`` of a bundled document from which its questions are answerable."""

    id: str
    document: str = Field(description="file name under orchestra/family/data")
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    title: str = ""

    @model_validator(mode="after")
    def _ordered(self) -> QAPassage:
        if self.end <= self.start:
            raise ValueError(f"passage {self.id}: end {self.end} <= start {self.start}")
        return self


class QAQuestion(_Model):
    id: str
    passage: str = Field(description="id of the passage that answers it")
    question: str = Field(min_length=1)
    answers: list[str] = Field(min_length=1, description="acceptable short answers (any one, by normalised containment)")
    type: AnswerType


class QASet(_Model):
    version: int
    name: str
    description: str = ""
    passages: list[QAPassage]
    questions: list[QAQuestion]

    @model_validator(mode="after")
    def _consistent(self) -> QASet:
        for kind, ids in (("passage", [p.id for p in self.passages]), ("question", [q.id for q in self.questions])):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            if dup:
                raise ValueError(f"duplicate {kind} id(s): {', '.join(dup)}")
        known = {p.id for p in self.passages}
        missing = sorted({q.passage for q in self.questions} - known)
        if missing:
            raise ValueError(f"questions refer to unknown passage(s): {', '.join(missing)}")
        return self

    def passage(self, pid: str) -> QAPassage:
        for p in self.passages:
            if p.id == pid:
                return p
        raise KeyError(pid)

    def by_passage(self, questions: Iterable[QAQuestion] | None = None) -> dict[str, list[QAQuestion]]:
        """Questions grouped by passage, in the file's order (one window, hence one prefill, per group)."""
        out: dict[str, list[QAQuestion]] = {}
        for q in self.questions if questions is None else questions:
            out.setdefault(q.passage, []).append(q)
        return out

    def document_text(self, name: str) -> str:
        from orchestra.family.corpus import data_text

        return data_text(name)

    def passage_text(self, pid: str) -> str:
        p = self.passage(pid)
        return self.document_text(p.document)[p.start : p.end]


@lru_cache(maxsize=4)
def load_qa(path: str | None = None) -> QASet:
    """The QA set shipped with the package (or the one at ``path``).

    A bundled set's bare name (:data:`QA_FILE`, :data:`HELDOUT_QA_FILE`) loads the shipped file, unless a
    file of that name exists on disk: a path that exists always wins.
    """
    if path is not None and (path not in _BUNDLED or os.path.isfile(path)):
        with open(path, encoding="utf-8") as f:
            return QASet.model_validate_json(f.read())
    name = QA_FILE if path is None else path
    return QASet.model_validate_json(resources.files("orchestra.bench").joinpath("data").joinpath(name).read_text("utf-8"))


# -- scoring -------------------------------------------------------------------------------------
def is_correct(prediction: str, references: Sequence[str]) -> bool:
    """True when one normalised reference occurs in the normalised prediction as whole words."""
    pred = f" {normalize(prediction)} "
    return any((ref := normalize(r)) and f" {ref} " in pred for r in references)


# -- windows -------------------------------------------------------------------------------------
def passage_window(document: str, start: int, end: int, tokens: int, tokenizer: Tokenizer,
                   offsets: Sequence[tuple[int, int]] | None = None) -> tuple[str, int]:
    """About ``tokens`` tokens of ``document`` around the characters ``[start, end)``, as text, and its token count.

    The passage is kept whole and centred; the window is shifted inside the document at its edges and
    is never shorter than the passage. ``offsets`` (the document's token character offsets) can be
    passed to tokenize a document once for many windows.
    """
    if offsets is None:
        offsets = token_offsets(document, tokenizer)
    n = len(offsets)
    first = next((i for i, (_, z) in enumerate(offsets) if z > start), n - 1)
    last = next((i for i in range(n - 1, -1, -1) if offsets[i][0] < end), first)
    have = last + 1 - first
    lo, hi = first, last + 1
    if tokens > have:
        extra = tokens - have
        lo = first - extra // 2
        hi = last + 1 + (extra - extra // 2)
        if lo < 0:
            hi, lo = min(n, hi - lo), 0
        if hi > n:
            lo, hi = max(0, lo - (hi - n)), n
    return document[offsets[lo][0] : offsets[hi - 1][1]], hi - lo


def token_offsets(document: str, tokenizer: Tokenizer) -> list[tuple[int, int]]:
    """Character offsets of the document's tokens (a fast tokenizer's offset mapping)."""
    enc = tokenizer(document, add_special_tokens=False, return_offsets_mapping=True)
    return [(int(a), int(z)) for a, z in enc["offset_mapping"]]
