"""Choosing the next token: greedy, or temperature / top-k / top-p sampling with a seeded generator.

Sampling runs on CPU with a CPU ``torch.Generator`` so that a seed gives the same draws whichever
device computed the logits.
"""

from __future__ import annotations

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
    _generator: torch.Generator | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_settings(cls, settings: GenerationSettings) -> Sampler:
        return cls(temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
                   seed=settings.seed)

    def __post_init__(self) -> None:
        if self.temperature > 0:
            self._generator = torch.Generator(device="cpu")
            if self.seed is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(self.seed)

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
