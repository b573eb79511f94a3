"""Quality gates for agents that would run on a mapped cache, and the per-pair circuit breaker.

Each gate is a typed policy with thresholds; `decide` turns measured metrics into a pass/fail
with a human-readable reason. The measurements themselves (probe NLL, shadow KL) are taken by
the scheduler, which owns the models.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from mappings.types import Tensor

__all__ = ["OfflineGate", "ProbeGate", "AnswerGate", "ShadowGate", "GatePolicy", "GateDecision", "CircuitBreaker",
           "ProbeCheck", "decide_offline", "decide_probe", "decide_answer"]


class OfflineGate(BaseModel):
    """The mapping's held-out metrics (from its manifest) must meet these thresholds."""

    model_config = ConfigDict(extra="forbid")
    max_kl: float = Field(0.1, description="Largest acceptable held-out next-token KL of the mapping.")
    min_top1: float = Field(0.8, description="Smallest acceptable held-out top-1 agreement of the mapping.")


class ProbeGate(BaseModel):
    """Recompute the last `tokens` document tokens on the target over the mapped prefix and compare their loss."""

    model_config = ConfigDict(extra="forbid")
    tokens: int = Field(32, ge=1, description="How many trailing document tokens the target recomputes (they become exact).")
    max_excess_nll: float = Field(
        0.25, description="Largest acceptable mean NLL excess (nats/token) over the pair's calibrated reference."
    )
    max_excess_kl: float = Field(
        0.1, description="Largest acceptable rise of KL(source ‖ target) on the probe tokens over the pair's calibrated value."
    )


class ShadowGate(BaseModel):
    """With some probability also re-prefill the target, measure the true KL, and trip a breaker on repeated failures."""

    model_config = ConfigDict(extra="forbid")
    probability: float = Field(0.0, ge=0.0, le=1.0, description="Chance that a mapped run is shadowed by a re-prefill.")
    max_kl: float = Field(0.05, description="A shadow sample with a larger next-token KL counts as a failure.")
    window: int = Field(20, ge=1, description="How many recent shadow samples per pair the breaker looks at.")
    trip_after: int = Field(3, ge=1, description="Failures within the window that open the breaker.")
    cooldown_s: float = Field(300.0, ge=0.0, description="Seconds an open breaker sends the pair to re-prefill.")
    seed: int | None = Field(None, description="Seed for the sampling decision (None: nondeterministic).")


class AnswerGate(BaseModel):
    """After the agent answered on a mapped cache, the source answers it too on its own cache; an answer too far
    from the source's (token F1 of their first `tokens` tokens) is thrown away and the agent runs again on a
    re-prefill of its member."""

    model_config = ConfigDict(extra="forbid")
    tokens: int = Field(24, ge=1, description="Tokens of each answer compared; the source decodes this many.")
    min_f1: float = Field(0.45, ge=0.0, le=1.0, description="Smallest acceptable token F1 of the two answers.")


class GatePolicy(BaseModel):
    """Which gates guard an agent on a mapped cache; a missing gate is not applied."""

    model_config = ConfigDict(extra="forbid")
    offline: OfflineGate | None = Field(default_factory=OfflineGate, description="Check the mapping's manifest metrics.")
    probe: ProbeGate | None = Field(default_factory=ProbeGate, description="Online probe on the trailing document tokens.")
    answer: AnswerGate | None = Field(None, description="Compare the agent's answer with the source's own answer.")
    shadow: ShadowGate | None = Field(None, description="Sampled re-prefill with a per-pair circuit breaker.")
    force_reprefill: bool = Field(False, description="Never use a mapped cache for this agent (always re-prefill).")


@dataclass(frozen=True)
class GateDecision:
    passed: bool
    gate: str
    reason: str
    metrics: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        """The decision as the run report and the events record it."""
        return {"gate": self.gate, "passed": self.passed, "reason": self.reason, "metrics": self.metrics}


def decide_offline(policy: OfflineGate, heldout_kl: float | None, heldout_top1: float | None = None) -> GateDecision:
    """KL is required; top-1 is checked when the manifest has it."""
    metrics = {k: v for k, v in (("heldout_kl", heldout_kl), ("heldout_top1", heldout_top1)) if v is not None}
    if heldout_kl is None:
        return GateDecision(False, "offline", "the mapping's manifest has no held-out KL", metrics)
    if heldout_kl != heldout_kl or (heldout_top1 is not None and heldout_top1 != heldout_top1):  # NaN fails
        return GateDecision(False, "offline", "the mapping's held-out metrics are NaN: recalibrate it", metrics)
    if heldout_kl > policy.max_kl:
        return GateDecision(False, "offline", f"held-out KL {heldout_kl:.4f} > {policy.max_kl}", metrics)
    if heldout_top1 is not None and heldout_top1 < policy.min_top1:
        return GateDecision(False, "offline", f"held-out top-1 {heldout_top1:.3f} < {policy.min_top1}", metrics)
    return GateDecision(True, "offline", f"held-out KL {heldout_kl:.4f} <= {policy.max_kl}", metrics)


def decide_probe(policy: ProbeGate, probe_nll: float, reference_nll: float,
                 probe_kl: float | None = None, reference_kl: float | None = None,
                 readings: dict[str, float] | None = None) -> GateDecision:
    """Fails on too much loss over the reference, or (when measured) too much divergence from the source.

    ``readings``: further probe measurements reported with the decision (not thresholded).
    """
    excess = probe_nll - reference_nll
    metrics = {**(readings or {}), "probe_nll": probe_nll, "reference_nll": reference_nll, "excess_nll": excess}
    if excess != excess or excess > policy.max_excess_nll:  # NaN fails too
        return GateDecision(False, "probe", f"probe NLL excess {excess:.3f} > {policy.max_excess_nll} nats/token", metrics)
    if probe_kl is not None and reference_kl is not None:
        excess_kl = probe_kl - reference_kl
        metrics.update(probe_source_kl=probe_kl, reference_source_kl=reference_kl, excess_kl=excess_kl)
        if excess_kl != excess_kl or excess_kl > policy.max_excess_kl:
            return GateDecision(False, "probe", f"probe KL to the source rose by {excess_kl:.3f} > {policy.max_excess_kl}",
                                metrics)
    return GateDecision(True, "probe", f"probe NLL excess {excess:.3f} <= {policy.max_excess_nll} nats/token", metrics)


def decide_answer(policy: AnswerGate, mapped_answer: str, source_answer: str) -> GateDecision:
    """Fails when the agent's answer on the mapped cache shares too few words with the source's own answer."""
    from agents.agreement import token_f1

    f1 = token_f1(source_answer, mapped_answer)
    metrics = {"answer_f1": f1}
    if f1 < policy.min_f1:
        return GateDecision(False, "answer", f"the answer on the mapped cache agrees with the source's by token F1 "
                            f"{f1:.2f} < {policy.min_f1}", metrics)
    return GateDecision(True, "answer", f"answer token F1 to the source's {f1:.2f} >= {policy.min_f1}", metrics)


@dataclass(frozen=True)
class ProbeCheck:
    """The probe measurement (and, with a gate, its decision) as a function of a mapped cache's tail logits.

    Built where the source's tail logits and the pair's calibrated reference are known, then handed
    to the op that maps (and repairs) on the target: an adaptive repair ladder calls it after each
    rung, so it must be cheap and picklable (a tensor and floats).
    """

    tail_ids: tuple[int, ...]
    """The probe tokens (the document's last tokens)."""
    source_logits: Tensor
    """The source's own logits over the probe tokens, ``[tail, vocab]``."""
    reference_nll: float
    """The source's NLL on the probe tokens plus the pair's calibrated target-minus-source offset."""
    reference_source_kl: float | None = None
    """The pair's calibrated KL(source || target) on trailing tokens (None: the KL test is skipped)."""
    gate: ProbeGate | None = None
    """Thresholds applied by `__call__` (None: measure only)."""

    def metrics(self, logits: Tensor) -> dict[str, float]:
        """Probe NLL, KL to the source and the references, for `logits` ``[tail, vocab]`` (or ``[1, tail, vocab]``);
        also the share of probe positions whose most likely token is the source's (``probe_source_top1``) and how
        much more uncertain the target is than the source there (``probe_entropy_shift``, nats)."""
        import torch

        from mappings.metrics import entropy, mean_kl, tail_nll

        logits = logits[0] if logits.dim() == 3 else logits
        ids = torch.tensor(self.tail_ids, dtype=torch.long)
        source = self.source_logits.float()
        mine = logits.float().to(source.device)
        out = {"probe_nll": tail_nll(logits.float(), ids), "reference_nll": self.reference_nll,
               "probe_source_kl": mean_kl(source, mine),
               "probe_source_top1": float((mine.argmax(-1) == source.argmax(-1)).float().mean()),
               "probe_entropy_shift": entropy(mine) - entropy(source)}
        if self.reference_source_kl is not None:
            out["reference_source_kl"] = self.reference_source_kl
        return out

    def decide(self, logits: Tensor) -> GateDecision:
        """The probe gate's decision on `logits`; needs `gate`."""
        if self.gate is None:
            raise ValueError("this probe check has no gate to decide with")
        m = self.metrics(logits)
        return decide_probe(self.gate, m["probe_nll"], m["reference_nll"], m["probe_source_kl"],
                            m.get("reference_source_kl"), _readings(m))

    def __call__(self, logits: Tensor) -> tuple[bool, dict[str, float]]:
        """(passed, metrics): the form `mappings.repair.climb_repair` climbs against."""
        decision = self.decide(logits)
        return decision.passed, dict(decision.metrics)


def _readings(metrics: dict[str, float]) -> dict[str, float]:
    """The probe's measurements that no threshold reads, reported beside the decision."""
    return {k: metrics[k] for k in ("probe_source_top1", "probe_entropy_shift") if k in metrics}


class CircuitBreaker:
    """Per (source, target) pair: rolling shadow results; opens after repeated failures, for a cool-down."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._results: dict[tuple[str, str], deque[bool]] = {}
        self._open_until: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()
        self._rng = random.Random()
        self._seeded: dict[int, random.Random] = {}

    def should_shadow(self, policy: ShadowGate) -> bool:
        if policy.probability <= 0.0:
            return False
        with self._lock:
            rng = self._rng if policy.seed is None else self._seeded.setdefault(policy.seed, random.Random(policy.seed))
            return rng.random() < policy.probability

    def record(self, pair: tuple[str, str], passed: bool, policy: ShadowGate) -> bool:
        """Record a shadow result; returns True if this opened the breaker."""
        with self._lock:
            results = self._results.setdefault(pair, deque(maxlen=policy.window))
            if results.maxlen != policy.window:
                results = self._results[pair] = deque(results, maxlen=policy.window)
            results.append(passed)
            if sum(1 for r in results if not r) >= policy.trip_after:
                self._open_until[pair] = self._clock() + policy.cooldown_s
                results.clear()
                return True
            return False

    def is_open(self, pair: tuple[str, str]) -> bool:
        with self._lock:
            until = self._open_until.get(pair)
            if until is None:
                return False
            if self._clock() >= until:
                del self._open_until[pair]
                return False
            return True

    def stats(self, pair: tuple[str, str]) -> dict[str, float]:
        with self._lock:
            results = self._results.get(pair, ())
            return {"shadow_samples": float(len(results)), "shadow_failures": float(sum(1 for r in results if not r))}
