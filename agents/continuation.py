"""Continuing a cached prefix with new token ids and decoding a reply: the generation primitive of servers.

`continue_ids` takes a read-only cache of the first ``prefix_len`` positions (e.g. a FamilyCache
lease), copies it, feeds ``new_ids`` at positions ``prefix_len...`` and decodes: greedy or seeded
sampling, EOS, stop strings (streaming-safe text from `TextAssembler`), ``max_new_tokens``, and
cancellation between tokens. ``lock`` (the model's lock) is held around each forward pass, so other
work on the same model interleaves with this one token by token. A chat backend calls it once
per turn; an OpenAI-compatible endpoint once per completion.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from agents.constrained import TokenConstraint
from agents.detok import TextAssembler
from agents.kv import check_context, check_prefix_cache, forward_tokens

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from mappings.types import CacheLike, Model, Tokenizer
from agents.sampling import Sampler
from mappings.cache_io import copy_cache, model_device, new_cache, sync_device

__all__ = ["Continuation", "ContinuationFinish", "TokenStream", "continue_ids", "continue_stream", "eos_token_ids"]

ContinuationFinish = Literal["eos", "stop", "length", "cancelled"]


@dataclass
class Continuation:
    """A decoded continuation and what it cost."""

    text: str
    """Exactly the concatenation of the texts passed to ``on_token`` (cut before a stop string)."""
    token_ids: list[int]
    """Generated ids, including a final EOS."""
    finish_reason: ContinuationFinish
    """eos: an end-of-sequence token; stop: a stop string; length: max_new_tokens; cancelled: `cancel` was set."""
    prompt_tokens: int
    """Positions fed before decoding (``len(new_ids)``)."""
    prompt_s: float
    """Copying the prefix cache and feeding ``new_ids``, up to the first logits."""
    generation_s: float
    """Decoding after that, all tokens."""

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.generation_s if self.generation_s > 0 else 0.0


def eos_token_ids(model: Model, tokenizer: Tokenizer) -> frozenset[int]:
    """Token ids that end generation: from the generation config, the model config and the tokenizer."""
    found: set[int] = set()
    sources = (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer)
    for source in sources:
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            found.add(value)
        elif isinstance(value, (list, tuple)):
            found.update(int(v) for v in value)
    return frozenset(found)


def _cancel_check(cancel: threading.Event | Callable[[], bool] | None) -> Callable[[], bool]:
    if isinstance(cancel, threading.Event):
        return cancel.is_set
    return cancel or (lambda: False)


class TokenStream:
    """One reply being decoded: repetition control, sampling, constraint, EOS, stop strings, max tokens, text.

    The decoding loop (single sequence here, a batch decoder with one stream per row, or an agent's
    runner) hands it each step's logits; it picks the token, calls ``on_token(text, token_id, index)``
    and sets ``finish`` when the reply is over. Repetition control is off by default (OpenAI semantics
    for the server); agents turn it on through their `GenerationSettings`. ``ends(new_text)``, if
    given, is fed each step's newly decoded text and ends the reply ('stop') when it returns True
    (an agent's JSON-object tracker when no grammar constrains the reply).
    """

    def __init__(self, tokenizer: Tokenizer, eos: frozenset[int], *, max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int | None = None, seed: int | None = None, stop: Sequence[str] = (),
                 on_token: Callable[[str, int, int], None] | None = None,
                 constraint: TokenConstraint | None = None, repetition_penalty: float = 1.0,
                 no_repeat_ngram_size: int = 0, sampler: Sampler | None = None,
                 ends: Callable[[str], bool] | None = None) -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, not {max_new_tokens}")
        self.sampler = sampler or Sampler(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                          repetition_penalty=repetition_penalty,
                                          no_repeat_ngram_size=no_repeat_ngram_size)
        self.assembler = TextAssembler(tokenizer, tuple(stop))
        self.eos = eos
        self.max_new_tokens = max_new_tokens
        self.on_token = on_token
        self.constraint = constraint
        self.ends = ends
        self.ids: list[int] = []
        self.finish: ContinuationFinish | None = None

    def _choose(self, logits: torch.Tensor) -> int:
        adjusted = self.sampler.adjust(logits, self.ids)  # a new tensor whenever it changes anything
        if self.constraint is None:
            return self.sampler(adjusted)
        self.constraint.mask(adjusted)
        if adjusted is not logits and not bool(torch.isfinite(adjusted).any()):
            adjusted = logits  # repetition control banned every token the grammar allows: the grammar wins
            self.constraint.mask(adjusted)
        return self.sampler(adjusted)

    def push(self, logits: torch.Tensor) -> int:
        """Choose the next token from ``logits`` ([vocab]); sets ``finish`` if it ends the reply."""
        token = self._choose(logits)
        index = len(self.ids)
        self.ids.append(token)
        if self.constraint is not None:
            self.constraint.accept(token)
        assembler = self.assembler
        if token in self.eos:
            self.finish, text = "eos", assembler.finish()
        else:
            before = len(assembler.decoded)
            text = assembler.push(token)
            if assembler.stopped:
                self.finish = "stop"
            elif self.constraint is not None and self.constraint.finished():
                self.finish, text = "stop", text + assembler.finish()
            elif self.ends is not None and self.ends(assembler.decoded[before:]):
                self.finish, text = "stop", text + assembler.finish()
            elif index == self.max_new_tokens - 1:
                self.finish, text = "length", text + assembler.finish()
        if self.on_token is not None:
            self.on_token(text, token, index)
        return token

    def result(self, prompt_tokens: int, prompt_s: float, generation_s: float, *, cancelled: bool = False
               ) -> Continuation:
        finish = "cancelled" if cancelled or self.finish in (None, "cancelled") else self.finish
        # on cancel, text held back (a partial character or stop string) was never streamed: leave it out
        a = self.assembler
        text = a.text if finish != "cancelled" else a.decoded[: a.emitted]
        return Continuation(text, list(self.ids), finish, prompt_tokens, prompt_s, generation_s)


def continue_ids(
    model: Model,
    tokenizer: Tokenizer,
    prefix_cache: CacheLike | None,
    prefix_len: int,
    new_ids: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    on_token: Callable[[str, int, int], None] | None = None,
    cancel: threading.Event | Callable[[], bool] | None = None,
    lock: AbstractContextManager[object] | None = None,
    constraint: TokenConstraint | None = None,
    repetition_penalty: float = 1.0,
    no_repeat_ngram_size: int = 0,
) -> Continuation:
    """Feed ``new_ids`` after a cached prefix and decode up to ``max_new_tokens`` tokens.

    ``prefix_cache`` must hold exactly ``prefix_len`` positions (PrefixCacheMismatchError otherwise);
    it is copied, never modified. ``None`` with ``prefix_len`` 0 feeds everything from scratch.
    ``new_ids`` must not be empty: the last one's logits give the first token. ``on_token(text,
    token_id, index)`` is called in this thread for every generated token (``text`` is what became
    safe to stream, possibly ''). ``cancel`` (an Event or a callable) is checked before the prompt and
    between tokens; a cancelled continuation returns what it has with finish_reason 'cancelled'.
    ``constraint`` (e.g. `agents.constrained.JsonConstraint`) masks the logits at every step and ends
    the reply (finish_reason 'stop') once its output is complete. ``repetition_penalty`` /
    ``no_repeat_ngram_size`` control repetition within the reply (off by default; see `Sampler`).
    Raises ContextOverflowError before any compute when prefix + new ids + max_new_tokens do not fit.
    """
    stream = TokenStream(tokenizer, eos_token_ids(model, tokenizer), max_new_tokens=max_new_tokens,
                         temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop,
                         on_token=on_token, constraint=constraint, repetition_penalty=repetition_penalty,
                         no_repeat_ngram_size=no_repeat_ngram_size)
    return continue_stream(model, stream, prefix_cache, prefix_len, new_ids, cancel=cancel, lock=lock)


def continue_stream(model: Model, stream: TokenStream, prefix_cache: CacheLike | None, prefix_len: int,
                    new_ids: Sequence[int], *, cancel: threading.Event | Callable[[], bool] | None = None,
                    lock: AbstractContextManager[object] | None = None) -> Continuation:
    """`continue_ids` over a `TokenStream` the caller built (its own sampler, constraint, stops and token sink),
    as a server does for the sampling fields of its requests; the same checks, copying and locking."""
    new = [int(t) for t in new_ids]
    _check_request(model, prefix_cache, prefix_len, new, stream.max_new_tokens)
    cancelled = _cancel_check(cancel)
    held = lock if lock is not None else contextlib.nullcontext()
    device = model_device(model)
    t0 = time.perf_counter()
    if cancelled():
        return stream.result(len(new), 0.0, 0.0, cancelled=True)

    with torch.no_grad():
        cache = copy_cache(prefix_cache, model) if prefix_cache is not None else new_cache(model)
        with held:
            logits = forward_tokens(model, new, cache, prefix_len)
            sync_device(device)
        t1 = time.perf_counter()
        _decode_steps(_Passes(model, cache, held), stream, logits, prefix_len + len(new), cancelled)
        sync_device(device)
    t2 = time.perf_counter()
    return stream.result(len(new), t1 - t0, t2 - t1)


def _check_request(model: Model, prefix_cache: CacheLike | None, prefix_len: int, new: list[int],
                   max_new_tokens: int) -> None:
    """Refuse a continuation before any compute: no new ids, no tokens to decode, a cache of another length,
    or more positions than the model takes."""
    if not new:
        raise ValueError("new_ids is empty: give at least one token to continue from")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, not {max_new_tokens}")
    if prefix_cache is None:
        if prefix_len:
            raise ValueError(f"prefix_len is {prefix_len} but no prefix_cache was given")
    else:
        check_prefix_cache(prefix_cache, prefix_len)
    check_context(model, prefix_len, len(new), max_new_tokens)


@dataclass(frozen=True)
class _Passes:
    """The decoding steps' forward passes: the model, the continuation's private cache, the lock held per pass."""

    model: Model
    cache: CacheLike
    held: AbstractContextManager[object]


def _decode_steps(passes: _Passes, stream: TokenStream, logits: torch.Tensor, position: int,
                  cancelled: Callable[[], bool]) -> None:
    """Feed each chosen token back until ``stream`` finishes, or mark it 'cancelled' when cancelled between tokens."""
    while True:
        token = stream.push(logits)
        if stream.finish is not None:
            break
        if cancelled():
            stream.finish = "cancelled"
            break
        with passes.held:  # per step: other work on this model interleaves token by token
            logits = forward_tokens(passes.model, [token], passes.cache, position)
        position += 1
