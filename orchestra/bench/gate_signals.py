"""Which reading of a mapped cache notices that the map changed an answer: candidate gate signals, scored.

The tasks section records, for every question answered on a pure map, the readings a gate could
take (``QAAnswer.signals``); this module defines them and scores each as a gate against what the
map did to the answer. A question is *harmed* when the member's own prefill answers it right and
the map wrong, *changed* when the two answers differ (normalised). A candidate refuses a question
when its reading is above a threshold (every reading is oriented so that larger is worse); its
catch rate is the share of harmed questions it refuses, its false-alarm rate the share of the
others it refuses.

Readings, and what taking them costs at run time:

- ``probe_excess_nll``, ``probe_excess_kl``: the shipped probe gate's two tests on the document's
  last tokens (recomputed anyway as the tail);
- ``probe_top1_miss``: share of those tail positions where the target's most likely token is not
  the source's; ``probe_entropy_shift``: how much more uncertain the target is there than the source;
- ``start_kl_source``, ``start_top1_miss_source``: the member's first-answer-token distribution on
  the map against the source's on its own cache (the source runs the agent's suffix too: a few dozen
  tokens);
- ``answer_differs_source``: 1 - token F1 of the member's mapped answer against the source's own
  answer (the source decodes the answer too);
- ``answer_tie``, ``answer_nll``: how close the member came, on the map, to answering otherwise: the
  smallest gap between the log-probabilities of the top two tokens over the answer's tokens (negated),
  and the answer's mean NLL. A small map error flips a greedy answer only where two tokens nearly tie,
  and the member computes these distributions while it answers, so they cost nothing at run time;
- ``oracle_start_kl_own``: the first-answer-token KL against the member's *own* prefill, which a
  gate never has (it is what the map is meant to save): the ceiling a distribution reading reaches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    import torch

    from mappings.types import KVCache, Model

__all__ = ["SIGNALS", "Signal", "GateCandidate", "Judged", "answer_logits", "start_readings", "answer_readings",
           "probe_readings", "score_candidates", "threshold_for_catch", "TARGET_CATCH"]

TARGET_CATCH = 0.8
"""The catch rate a candidate's threshold is tuned to reach (issue goal: >= 80 % of harmed questions)."""


@dataclass(frozen=True)
class Signal:
    """One gate reading: its name, whether a gate can take it without the member's own prefill, and where."""

    name: str
    runtime: bool
    level: Literal["window", "question"]
    what: str


SIGNALS: tuple[Signal, ...] = (
    Signal("probe_excess_nll", True, "window", "probe NLL over the calibrated reference (shipped)"),
    Signal("probe_excess_kl", True, "window", "probe KL to the source over the calibrated value (shipped)"),
    Signal("probe_top1_miss", True, "window", "probe positions whose top token is not the source's"),
    Signal("probe_entropy_shift", True, "window", "probe entropy, target minus source"),
    Signal("start_kl_source", True, "question", "first answer token: KL from the source's"),
    Signal("start_top1_miss_source", True, "question", "first answer token differs from the source's"),
    Signal("answer_differs_source", True, "question", "1 - token F1 against the source's answer"),
    Signal("answer_tie", True, "question", "smallest top-1/top-2 log-prob gap over the answer's tokens, negated"),
    Signal("answer_nll", True, "question", "the answer's mean NLL on the map"),
    Signal("oracle_start_kl_own", False, "question", "first answer token: KL from the own prefill's (oracle)"),
)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GateCandidate(_Model):
    """One reading scored as a gate over a member's questions."""

    signal: str
    runtime: bool = Field(description="a gate can take it without the member's own prefill")
    questions: int = Field(description="questions with this reading")
    harmed: int
    changed: int
    threshold: float | None = Field(None, description="the largest threshold that refuses >= 80 % of the harmed "
                                    "questions (None: no harmed question)")
    catch_rate: float | None = Field(None, description="harmed questions refused at `threshold`")
    false_alarm_rate: float | None = Field(None, description="other questions refused at `threshold`")
    changed_catch_rate: float | None = Field(None, description="changed questions refused at `threshold`")
    auc: float | None = Field(None, description="chance a harmed question reads worse than an unharmed one "
                              "(ties count half)")


def answer_logits(model: Model, cache: KVCache, prefix_len: int, suffix: Sequence[int],
                  answer: Sequence[int] = ()) -> torch.Tensor:
    """The distributions an agent's answer was drawn from over a copy of ``cache`` (``prefix_len`` positions):
    ``suffix`` then ``answer`` teacher-forced, one row of logits per answer token (row 0: the first answer
    token's; one row when ``answer`` is empty), float32 on the CPU; ``cache`` is not modified. These are the
    model's own logits, before the agent's repetition control: where an n-gram ban took the top token away,
    the decode chose from a distribution this row does not show."""
    import torch

    from agents.kv import copy_cache
    from mappings.cache_io import forward_with_cache, model_device

    ids = [*suffix, *answer]
    device = model_device(model)
    input_ids = torch.as_tensor(ids, dtype=torch.long, device=device).view(1, -1)
    positions = torch.arange(prefix_len, prefix_len + len(ids), device=device).unsqueeze(0)
    logits, _, _ = forward_with_cache(model, input_ids, copy_cache(cache, model), position_ids=positions,
                                      logits_to_keep=len(answer) + 1)
    # the last position predicts what follows the answer: it drew an answer token only when there is none
    rows = logits[0, -(len(answer) + 1):-1] if answer else logits[0, -1:]
    return rows.float().cpu()


def answer_readings(logits: torch.Tensor, answer: Sequence[int]) -> dict[str, float]:
    """``answer_tie`` and ``answer_nll`` of an answer from its rows of `answer_logits` (empty for no answer)."""
    import torch

    if not answer:
        return {}
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = logp.topk(2, dim=-1).values
    chosen = logp[torch.arange(len(answer)), torch.as_tensor(list(answer))]
    return {"answer_tie": -float((top[:, 0] - top[:, 1]).min()), "answer_nll": -float(chosen.mean())}


def start_readings(mapped: torch.Tensor, source: torch.Tensor, own: torch.Tensor | None) -> dict[str, float]:
    """The question-level readings of one first-answer-token distribution on the map."""
    from mappings.metrics import mean_kl

    out = {"start_kl_source": mean_kl(source, mapped),
           "start_top1_miss_source": float(int(mapped.argmax()) != int(source.argmax()))}
    if own is not None:
        out["oracle_start_kl_own"] = mean_kl(own, mapped)
    return out


def probe_readings(metrics: dict[str, float]) -> dict[str, float]:
    """The window-level readings from the probe gate's decision metrics (empty when the probe did not run)."""
    out: dict[str, float] = {}
    if "excess_nll" in metrics:
        out["probe_excess_nll"] = metrics["excess_nll"]
    if "excess_kl" in metrics:
        out["probe_excess_kl"] = metrics["excess_kl"]
    if "probe_source_top1" in metrics:
        out["probe_top1_miss"] = 1.0 - metrics["probe_source_top1"]
    if "probe_entropy_shift" in metrics:
        out["probe_entropy_shift"] = metrics["probe_entropy_shift"]
    return out


def threshold_for_catch(harmed: Sequence[float], target: float = TARGET_CATCH) -> float | None:
    """The largest threshold ``t`` such that readings ``>= t`` include at least ``target`` of ``harmed``."""
    if not harmed:
        return None
    ranked = sorted(harmed, reverse=True)
    need = max(1, math.ceil(target * len(ranked) - 1e-9))  # the fuzz: 0.8 * 5 is 4.000000000000001
    return ranked[min(need, len(ranked)) - 1]


def _auc(bad: Sequence[float], good: Sequence[float]) -> float | None:
    if not bad or not good:
        return None
    wins = sum((b > g) + 0.5 * (b == g) for b in bad for g in good)
    return wins / (len(bad) * len(good))


@dataclass(frozen=True)
class Judged:
    """One question's readings and what the map did to its answer."""

    signals: dict[str, float]
    harmed: bool
    changed: bool


def score_candidates(judged: Sequence[Judged], thresholds: dict[str, float] | None = None) -> list[GateCandidate]:
    """Every signal scored as a gate over ``judged``: at the threshold that catches 80 % of its harmed
    questions, or at ``thresholds[signal]`` when given (a threshold tuned on another set)."""
    out = []
    for sig in SIGNALS:
        rows = [j for j in judged if sig.name in j.signals]
        if not rows:
            continue
        bad = [j.signals[sig.name] for j in rows if j.harmed]
        good = [j.signals[sig.name] for j in rows if not j.harmed]
        t = (thresholds or {}).get(sig.name, threshold_for_catch(bad))
        cand = GateCandidate(signal=sig.name, runtime=sig.runtime, questions=len(rows), harmed=len(bad),
                             changed=sum(j.changed for j in rows), threshold=t, auc=_auc(bad, good))
        if t is not None:
            refused = [j.signals[sig.name] >= t for j in rows]
            cand.catch_rate = _share(refused, [j.harmed for j in rows])
            cand.false_alarm_rate = _share(refused, [not j.harmed for j in rows])
            cand.changed_catch_rate = _share(refused, [j.changed for j in rows])
        out.append(cand)
    return out


def _share(refused: list[bool], among: list[bool]) -> float | None:
    n = sum(among)
    return sum(r and a for r, a in zip(refused, among, strict=True)) / n if n else None
