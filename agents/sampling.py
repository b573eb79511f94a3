"""Choosing the next token: repetition control, then greedy or temperature / top-k / top-p sampling.

Sampling runs on CPU with a CPU ``torch.Generator`` so that a seed gives the same draws whichever
device computed the logits. Repetition control (`Sampler.adjust`) looks only at the tokens of the reply
being generated, never at the prompt: a small model copying a sentence from the document is what
grounded extraction asks for, while a reply repeating itself is the degenerate loop it guards against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from agents.spec import GenerationSettings

__all__ = ["Sampler"]


@dataclass
class Sampler:
    """Picks token ids from last-position logits according to the generation settings."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    repetition_penalty: float = 1.0
    """>1 divides positive (multiplies negative) logits of tokens already in the reply; 1.0: off."""
    no_repeat_ngram_size: int = 0
    """n > 0: a token that would complete an n-gram already in the reply is forbidden; 0: off."""
    _generator: torch.Generator | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_settings(cls, settings: GenerationSettings, *, seed_offset: int = 0) -> Sampler:
        seed = settings.seed + seed_offset if settings.seed is not None else None
        return cls(temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k, seed=seed,
                   repetition_penalty=settings.repetition_penalty, no_repeat_ngram_size=settings.no_repeat_ngram_size)

    def __post_init__(self) -> None:
        if self.repetition_penalty < 1.0:
            raise ValueError(f"repetition_penalty must be at least 1.0, not {self.repetition_penalty}")
        if self.no_repeat_ngram_size < 0:
            raise ValueError(f"no_repeat_ngram_size must be 0 or more, not {self.no_repeat_ngram_size}")
        if self.temperature > 0:
            self._generator = torch.Generator(device="cpu")
            if self.seed is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(self.seed)

    @property
    def controls_repetition(self) -> bool:
        return self.repetition_penalty != 1.0 or self.no_repeat_ngram_size > 0

    def adjust(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        """``logits`` ([vocab]) with repetition control applied for a reply that so far is ``history``.

        Returns the input itself when nothing applies, else a new tensor (the model's logits are not modified).
        """
        if not history or not self.controls_repetition:
            return logits
        out = logits.clone()
        vocab = out.shape[-1]
        if self.repetition_penalty != 1.0:
            seen = torch.tensor(sorted({t for t in history if 0 <= t < vocab}), dtype=torch.long, device=out.device)
            if seen.numel():
                scores = out[seen]
                out[seen] = torch.where(scores > 0, scores / self.repetition_penalty, scores * self.repetition_penalty)
        n = self.no_repeat_ngram_size
        if n and len(history) >= n:
            if n == 1:
                banned = set(history)
            else:
                lead = tuple(history[len(history) - n + 1:])
                banned = {history[i + n - 1] for i in range(len(history) - n + 1) if tuple(history[i:i + n - 1]) == lead}
            banned = {t for t in banned if 0 <= t < vocab}
            if banned:
                out[torch.tensor(sorted(banned), dtype=torch.long, device=out.device)] = float("-inf")
        return out

    def __call__(self, logits: torch.Tensor) -> int:
        """The next token id for logits of shape [vocab]."""
        if self._generator is None:
            return int(torch.argmax(logits).item())
        scores = logits.detach().to(device="cpu", dtype=torch.float32) / self.temperature
        if self.top_k is not None and self.top_k < scores.numel():
            kth = torch.topk(scores, self.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if not bool(torch.isfinite(probs).all()):  # a temperature so small that logits / T overflow: its limit, greedy
            return int(torch.argmax(logits).item())
        if self.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of strictly better tokens
            drop = before >= self.top_p
            drop[0] = False  # the likeliest token always stays (a top_p under float32's smallest is not 0)
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self._generator).item())
