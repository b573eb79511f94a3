"""The model work of the chat backend: prefill, map + gate, conversation turns.

Every function here is synchronous and runs in a worker thread while the caller holds the device
lock of every model it touches; none of them modifies a cache it was given except `run_turn`,
which extends the session's private cache in place. torch and the mappings package load lazily.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from orchestra.gates import GateDecision, GatePolicy, decide_offline, decide_probe
from orchestra.mapstore import MappingStore, mean_kl, tail_nll
from orchestra.registry import LoadedModel

__all__ = [
    "Transfer",
    "TurnResult",
    "prefill",
    "extend",
    "truncate",
    "transfer",
    "render_conversation",
    "run_turn",
    "common_prefix",
]

CachePath = Literal["exact", "mapped", "reprefilled"]


@dataclass
class Transfer:
    """A cache carried onto a target model, and how."""

    cache: Any
    path: CachePath
    seconds: float
    decisions: list[GateDecision] = field(default_factory=list)
    fallback_reason: str | None = None
    mapping: str | None = None


def _sync(model: LoadedModel) -> None:
    """Wait for queued CUDA work so timings are real (no-op on CPU)."""
    import torch

    from agents.kv import sync_device

    sync_device(torch.device(model.device))


def prefill(model: LoadedModel, ids: Sequence[int]) -> tuple[Any, float]:
    """A real prefill of ``ids`` on ``model`` from scratch: (cache, seconds)."""
    from agents import prefill_document

    result = prefill_document(model.model, list(ids))
    return result.cache, result.seconds


def extend(model: LoadedModel, cache: Any, ids: Sequence[int], start: int) -> float:
    """Feed ``ids`` at positions ``start...`` into ``cache`` (in place); returns seconds."""
    import torch

    from agents import forward_tokens

    if not ids:
        return 0.0
    t0 = time.perf_counter()
    with torch.no_grad():
        forward_tokens(model.model, list(ids), cache, start)
    _sync(model)
    return time.perf_counter() - t0


def truncate(cache: Any, length: int, model: LoadedModel) -> Any:
    """A cache holding the first ``length`` positions of ``cache`` (views; ``cache`` is not modified).

    Built through the mappings package's cache helpers so it works on transformers 4.x and 5.x,
    whose ``DynamicCache.crop`` arguments differ.
    """
    from mappings import build_cache, cache_layers

    layers = [(k[:, :, :length], v[:, :, :length]) for k, v in cache_layers(cache)]
    return build_cache(layers, config=model.model.config)


def _reprefill(target: LoadedModel, ids: Sequence[int], reason: str, decisions: list[GateDecision],
               started: float, mapping: str | None = None) -> Transfer:
    cache, _ = prefill(target, ids)
    return Transfer(cache, "reprefilled", time.perf_counter() - started, decisions, reason, mapping)


def transfer(store: MappingStore, source: LoadedModel, source_cache: Any, target: LoadedModel,
             ids: Sequence[int], policy: GatePolicy, tail: int) -> Transfer:
    """Map ``source_cache`` (which holds exactly ``ids`` on ``source``) onto ``target`` and gate it.

    Like the pipeline scheduler: the pair's mapping comes from the mapping store, the last ``tail``
    positions are recomputed on the target over the mapped prefix (so they are exact), the offline
    gate reads the mapping's held-out KL and the probe gate compares the target's loss on those tail
    tokens with the source's loss plus the pair's calibrated offset. Any failure (no mapping, a
    broken map, a failed gate) re-prefills ``ids`` on the target and says why.
    """
    import torch

    from mappings import map_cache, tail_recompute
    from mappings.errors import MappingError
    from orchestra.errors import OrchestraError

    started = time.perf_counter()
    if policy.force_reprefill:
        return _reprefill(target, ids, "the gate policy forces re-prefill", [], started)
    try:
        mapping, _ = store.get(source, target)
    except (OrchestraError, MappingError) as exc:
        return _reprefill(target, ids, f"no usable mapping {source.info.name} -> {target.info.name}: {exc}",
                          [], started)
    where = str(mapping.path) if getattr(mapping, "path", None) else None
    tail = max(2, min(tail, len(ids) - 1))
    all_ids = torch.tensor([list(ids)])
    try:
        with torch.no_grad():
            # the source's own predictions on the tail: the probe's reference point
            src_logits, _ = tail_recompute(source.model, source_cache, all_ids.to(source.device), tail)
            mapped = map_cache(mapping.kv_map, source_cache, target.model)
            tgt_logits, full = tail_recompute(target.model, mapped, all_ids.to(target.device), tail)
        _sync(target)
    except (MappingError, ValueError, RuntimeError) as exc:
        return _reprefill(target, ids, f"mapping failed: {exc}", [], started, where)

    decisions: list[GateDecision] = []
    if policy.offline is not None:
        heldout = mapping.manifest.heldout
        decisions.append(decide_offline(policy.offline, heldout.get("kl"), heldout.get("top1")))
    if policy.probe is not None:
        ref = store.probe_reference(source, target, mapping, tail)
        tail_ids = all_ids[0, -tail:]
        source_nll = tail_nll(src_logits[0], tail_ids)
        decisions.append(decide_probe(
            policy.probe, tail_nll(tgt_logits[0], tail_ids), source_nll + ref.offset_nll,
            mean_kl(src_logits[0], tgt_logits[0]), ref.source_kl,
        ))
    failed = [d for d in decisions if not d.passed]
    if failed:
        return _reprefill(target, ids, f"{failed[0].gate} gate failed: {failed[0].reason}", decisions, started, where)
    return Transfer(full, "mapped", time.perf_counter() - started, decisions, None, where)


def render_conversation(tokenizer: Any, system: str, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of the conversation after the document prefix, ending with the assistant's turn opener.

    The chat template is applied to the conversation only (the document prefix stays model- and
    session-independent, exactly like the agents' suffixes); a tokenizer without a template gets a
    plain-text layout.
    """
    from agents.prompt import has_chat_template

    turns = [{"role": "system", "content": system}, *messages]
    if has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        bos = getattr(tokenizer, "bos_token", None)
        if bos and text.startswith(bos):
            text = text[len(bos):]  # a BOS belongs at the start of the prefix, never after the document
    else:
        text = "".join(f"\n### {t['role'].title()}\n{t['content']}\n" for t in turns) + "\n### Assistant\n"
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class TurnResult:
    text: str
    token_ids: list[int]
    finish_reason: Literal["eos", "length", "cancelled"]
    prompt_tokens: int
    """Conversation tokens fed this turn (the rest was already in the session's cache)."""
    prompt_prefill_s: float
    generation_s: float
    cache: Any
    fed: list[int]
    """Conversation ids the returned cache holds after the document prefix."""


def run_turn(
    model: LoadedModel,
    cache: Any,
    prefix_len: int,
    fed: Sequence[int],
    conversation: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int | None = None,
    on_token: Callable[[str, int], None] | None = None,
    stop: threading.Event | None = None,
) -> TurnResult:
    """Bring ``cache`` (document + ``fed``) up to document + ``conversation`` and generate the reply.

    Only the tokens after the longest common prefix of ``fed`` and ``conversation`` are computed
    (when the template re-tokenizes an earlier reply differently the cache is cut back first), so a
    turn costs its new tokens, never the document or the earlier turns.
    """
    import torch

    from agents import GenerationSettings, eos_token_ids, forward_tokens
    from agents.detok import TextAssembler
    from agents.sampling import Sampler

    keep = common_prefix(fed, conversation)
    if keep == len(conversation):
        keep -= 1  # at least one token must be fed to get the next-token logits
    if keep < len(fed):
        cache = truncate(cache, prefix_len + keep, model)
    new = list(conversation[keep:])
    sampler = Sampler.from_settings(GenerationSettings(max_new_tokens=max_new_tokens, temperature=temperature,
                                                       seed=seed))
    assembler = TextAssembler(model.tokenizer)
    eos = eos_token_ids(model.model, model.tokenizer)
    state = list(conversation)
    ids: list[int] = []
    finish: Literal["eos", "length", "cancelled"] = "length"
    with torch.no_grad():
        t0 = time.perf_counter()
        logits = forward_tokens(model.model, new, cache, prefix_len + keep)
        _sync(model)
        t1 = time.perf_counter()
        for index in range(max_new_tokens):
            token = sampler(logits)
            ids.append(token)
            if token in eos:
                finish = "eos"
                text = assembler.finish()
            else:
                text = assembler.push(token)
                if index == max_new_tokens - 1:
                    text += assembler.finish()
            if on_token is not None and text:
                on_token(text, index)
            if finish == "eos" or index == max_new_tokens - 1:
                break
            if stop is not None and stop.is_set():
                finish = "cancelled"
                break
            logits = forward_tokens(model.model, [token], cache, prefix_len + len(state))
            state.append(token)
        _sync(model)
        t2 = time.perf_counter()
    return TurnResult(text=assembler.text, token_ids=ids, finish_reason=finish, prompt_tokens=len(new),
                      prompt_prefill_s=t1 - t0, generation_s=t2 - t1, cache=cache, fed=state)
