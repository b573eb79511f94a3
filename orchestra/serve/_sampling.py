"""The OpenAI (and vLLM) sampling fields of a request, as one reply's token choice; the log-probabilities it reports.

`ServeSampler` is the `agents.sampling.Sampler` a served reply's `TokenStream` picks its tokens with. Per step,
in vLLM's order: the raw logits' log-probabilities are read (``logprobs``: what the model gave, before anything
below), then ``logit_bias`` is added, then the penalties (``repetition_penalty`` over the prompt and the reply,
``frequency_penalty`` and ``presence_penalty`` over the reply), then a JSON constraint masks (the stream's), then
greedy (temperature 0) or: temperature, ``min_p``, ``top_k``, ``top_p``, a seeded draw.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict

import torch

from agents.sampling import Sampler

if TYPE_CHECKING:
    from orchestra.serve._schemas import ChatCompletionRequest

__all__ = ["LOGPROB_FLOOR", "SampledToken", "SamplingSettings", "ServeSampler", "sampling_settings"]

LOGPROB_FLOOR = -9999.0
"""The lowest log-probability reported (vLLM's): a token the model rules out (-inf) is not valid JSON."""


@dataclass(frozen=True)
class SampledToken:
    """One chosen token and its log-probability, with the likeliest tokens of that step (ids, best first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class SamplingSettings(TypedDict, total=False):
    """The sampling settings of one reply, as the engine builds them from the request (`sampling_settings`)."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int | None
    min_p: float
    seed: int | None
    stop: Sequence[str]
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    prompt_ids: Sequence[int]
    """The whole prompt: `repetition_penalty` counts its tokens as seen (given only when that is on)."""
    logit_bias: Mapping[int, float]
    logprobs: int | None
    """None: no log-probabilities; N >= 0: the chosen token's and the N likeliest of each step."""


def sampling_settings(req: ChatCompletionRequest, max_tokens: int, prompt_ids: Sequence[int]) -> SamplingSettings:
    """The request's sampling fields as a reply's settings (OpenAI's defaults where it gives none)."""
    settings = SamplingSettings(
        max_new_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=req.top_p or 1.0, top_k=req.top_k if req.top_k is not None and req.top_k > 0 else None,
        min_p=req.min_p or 0.0, seed=req.seed, stop=req.stop_list(),
        frequency_penalty=req.frequency_penalty or 0.0, presence_penalty=req.presence_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias={int(token): bias for token, bias in (req.logit_bias or {}).items()},
        logprobs=(req.top_logprobs or 0) if req.logprobs else None)
    if settings["repetition_penalty"] != 1.0:
        settings["prompt_ids"] = list(prompt_ids)
    return settings


@dataclass
class ServeSampler(Sampler):
    """A `Sampler` with the OpenAI/vLLM fields; the base's own repetition controls stay off (the agents' ones).

    `last` is the token the latest call chose, with its raw log-probability, when `logprobs` is set.
    """

    min_p: float = 0.0
    """Sampling keeps only tokens at least `min_p` times as likely as the likeliest (after temperature); 0: off."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the reply has it (OpenAI)."""
    presence_penalty: float = 0.0
    """Subtracted from a token's logit once if the reply has it (OpenAI)."""
    penalty: float = 1.0
    """vLLM's `repetition_penalty`: a token in the prompt or the reply has its logit divided by it when positive,
    multiplied when negative; 1.0: off."""
    prompt_ids: Sequence[int] = ()
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    last: SampledToken | None = field(default=None, init=False, repr=False)
    _raw: torch.Tensor | None = field(default=None, init=False, repr=False)
    _top: tuple[tuple[int, float], ...] = field(default=(), init=False, repr=False)
    _prompt_seen: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.penalty <= 0:
            raise ValueError(f"repetition_penalty must be more than 0, not {self.penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be between 0 and 1, not {self.min_p}")

    @classmethod
    def from_serve_settings(cls, settings: SamplingSettings) -> ServeSampler:
        return cls(temperature=settings.get("temperature", 0.0), top_p=settings.get("top_p", 1.0),
                   top_k=settings.get("top_k"), seed=settings.get("seed"), min_p=settings.get("min_p", 0.0),
                   frequency_penalty=settings.get("frequency_penalty", 0.0),
                   presence_penalty=settings.get("presence_penalty", 0.0),
                   penalty=settings.get("repetition_penalty", 1.0), prompt_ids=settings.get("prompt_ids", ()),
                   logit_bias=settings.get("logit_bias", {}), logprobs=settings.get("logprobs"))

    def adjust(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        """``logits`` with the bias and penalties applied (a new tensor when any applies); the raw logits'
        log-probabilities are read first, when the reply reports them."""
        if self.logprobs is not None:
            self._read_logprobs(logits)
        out = logits
        vocab = logits.shape[-1]
        if self.logit_bias:
            out = out.clone()
            ids = [t for t in self.logit_bias if 0 <= t < vocab]
            if ids:
                out[torch.tensor(ids, device=out.device)] += torch.tensor(
                    [self.logit_bias[t] for t in ids], dtype=out.dtype, device=out.device)
        generated = [t for t in history if 0 <= t < vocab]
        if self.penalty != 1.0:
            seen = self._prompt_mask(vocab, out.device).clone()
            if generated:
                seen[torch.tensor(generated, device=out.device)] = True
            out = torch.where(seen, torch.where(out > 0, out / self.penalty, out * self.penalty), out)
        if generated and (self.frequency_penalty or self.presence_penalty):
            counts = torch.bincount(torch.tensor(generated, device=out.device), minlength=vocab).to(out.dtype)
            out = out - self.frequency_penalty * counts - self.presence_penalty * (counts > 0).to(out.dtype)
        return out

    def __call__(self, logits: torch.Tensor) -> int:
        if self._generator is not None and self.min_p > 0:
            # p_i < min_p * p_max after temperature  <=>  logit_i < logit_max + T * log(min_p)
            floor = logits.max() + self.temperature * math.log(self.min_p)
            logits = logits.masked_fill(logits < floor, float("-inf"))
        token = super().__call__(logits)
        if self._raw is not None:
            self.last = SampledToken(token, max(LOGPROB_FLOOR, float(self._raw[token])), self._top)
            self._raw = None
        return token

    def _read_logprobs(self, logits: torch.Tensor) -> None:
        raw = torch.log_softmax(logits.detach().float(), dim=-1)
        self._raw = raw
        n = min(self.logprobs or 0, raw.shape[-1])
        if n:
            values, ids = torch.topk(raw, n)
            self._top = tuple((int(i), max(LOGPROB_FLOOR, float(v))) for i, v in zip(ids.tolist(), values.tolist(),
                                                                                     strict=True))
        else:
            self._top = ()

    def _prompt_mask(self, vocab: int, device: torch.device) -> torch.Tensor:
        if self._prompt_seen is None or self._prompt_seen.device != device or self._prompt_seen.numel() != vocab:
            mask = torch.zeros(vocab, dtype=torch.bool, device=device)
            ids = sorted({t for t in self.prompt_ids if 0 <= t < vocab})
            if ids:
                mask[torch.tensor(ids, device=device)] = True
            self._prompt_seen = mask
        return self._prompt_seen
