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
from typing import Any, Literal

import torch

from agents.detok import TextAssembler
from agents.kv import check_context, check_prefix_cache, forward_tokens
from agents.runner import eos_token_ids
from agents.sampling import Sampler
from mappings.cache_io import copy_cache, model_device, new_cache, sync_device

__all__ = ["Continuation", "ContinuationFinish", "continue_ids"]

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


def continue_ids(
    model: Any,
    tokenizer: Any,
    prefix_cache: Any | None,
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
    lock: Any = None,
) -> Continuation:
    """Feed ``new_ids`` after a cached prefix and decode up to ``max_new_tokens`` tokens.

    ``prefix_cache`` must hold exactly ``prefix_len`` positions (PrefixCacheMismatchError otherwise);
    it is copied, never modified. ``None`` with ``prefix_len`` 0 feeds everything from scratch.
    ``new_ids`` must not be empty: the last one's logits give the first token. ``on_token(text,
    token_id, index)`` is called in this thread for every generated token (``text`` is what became
    safe to stream, possibly ''). ``cancel`` (an Event or a callable) is checked before the prompt and
    between tokens; a cancelled continuation returns what it has with finish_reason 'cancelled'.
    Raises ContextOverflowError before any compute when prefix + new ids + max_new_tokens do not fit.
    """
    new = [int(t) for t in new_ids]
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
    cancelled = cancel.is_set if isinstance(cancel, threading.Event) else cancel or (lambda: False)
    held = lock if lock is not None else contextlib.nullcontext()
    sampler = Sampler(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    assembler = TextAssembler(tokenizer, tuple(stop))
    eos = eos_token_ids(model, tokenizer)
    device = model_device(model)
    ids: list[int] = []
    finish: ContinuationFinish = "length"
    t0 = time.perf_counter()
    if cancelled():
        return Continuation("", ids, "cancelled", len(new), 0.0, 0.0)

    with torch.no_grad():
        cache = copy_cache(prefix_cache, model) if prefix_cache is not None else new_cache(model)
        with held:
            logits = forward_tokens(model, new, cache, prefix_len)
            sync_device(device)
        t1 = time.perf_counter()
        position = prefix_len + len(new)
        for index in range(max_new_tokens):
            token = sampler(logits)
            ids.append(token)
            last = True
            if token in eos:
                finish, text = "eos", assembler.finish()
            else:
                text = assembler.push(token)
                if assembler.stopped:
                    finish = "stop"
                elif index == max_new_tokens - 1:
                    text += assembler.finish()
                else:
                    last = False
            if on_token is not None:
                on_token(text, token, index)
            if last:
                break
            if cancelled():
                finish = "cancelled"
                break
            with held:  # per step: other work on this model interleaves token by token
                logits = forward_tokens(model, [token], cache, position)
            position += 1
        sync_device(device)
    t2 = time.perf_counter()
    # on cancel, text held back (a partial character or stop string) was never streamed: leave it out
    text = assembler.text if finish != "cancelled" else assembler.decoded[: assembler.emitted]
    return Continuation(text, ids, finish, len(new), t1 - t0, t2 - t1)
