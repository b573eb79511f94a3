"""The model work of a FamilyCache, as module-level functions an Executor runs with the models held.

Each op takes the loaded models first (in the order the executor was given their names), then
plain arguments: token id lists, caches and mappings. Ops never keep state and never modify a
cache they were given (they build new ones from views), so a remote executor can run them where
the weights live. Timings include a device sync so they are real on CUDA too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import threading

    import torch

    from mappings.passcost import PassCosts
    from mappings.repair import RepairPolicy
    from mappings.repair_records import RepairSummary
    from mappings.store import Mapping
    from mappings.types import CacheLike, KVCache, Tensor
    from orchestra.familycache._handles import CacheRef, HiddenRef
    from orchestra.familycache.gates import ProbeCheck
    from orchestra.familycache.mapping_store import MappingStore, ProbeReference
    from orchestra.models.registry import LoadedModel

__all__ = ["Computed", "compute_tokens", "tail_logits", "map_into", "map_on_target", "map_with_source",
           "source_importance", "truncate", "load_mapping", "probe_reference", "held_model", "nbytes_of", "pass_costs"]


@dataclass
class Computed:
    """A cache after computing some tokens, the logits kept for its trailing positions, the seconds it took."""

    cache: CacheRef
    """The cache an op built (as an executor hands it out: a remote one's is a handle)."""
    logits: Tensor
    """[m, vocab] float32 logits of the last m computed positions (m may be 0)."""
    seconds: float
    hidden: HiddenRef | None = None
    """The hidden state entering each layer, by layer index, when asked for (`compute_tokens`'s `want_hidden`)."""


def _ids(model: LoadedModel, ids: list[int]) -> torch.Tensor:
    import torch

    return torch.tensor([ids], dtype=torch.long, device=model.device)


def truncate(model: LoadedModel, cache: CacheLike, length: int) -> KVCache:
    """The first `length` positions of `cache` as a new cache of views (the input is not touched).

    Always a new cache object, even at full length: `compute_tokens` extends what this returns,
    and extending `cache` itself would grow a stored entry in place.
    """
    from mappings.cache_io import truncate_cache

    return truncate_cache(cache, length, model.model.config)


def compute_tokens(model: LoadedModel, ids: list[int], base: CacheLike | None, start: int, keep_logits: int,
                   base_hidden: dict[int, Tensor] | None = None, want_hidden: bool = False) -> Computed:
    """Compute ids[start:] exactly on `model` over `base` (its first `start` positions; None when start is 0).

    Keeps the logits of the last `keep_logits` positions, and with `want_hidden` the hidden state
    entering each layer for every position (the base's, when given, joined with the new ones).
    """
    import torch

    from mappings.cache_io import forward_with_cache, sync_device

    if start > 0 and base is None:  # what reading a missing cache raises
        from mappings.errors import ShapeMismatchError

        raise ShapeMismatchError("no cache given: run the model with use_cache=True first")
    prefix = truncate(model, base, start) if start > 0 and base is not None else None
    new = _ids(model, ids[start:])
    keep = max(0, min(keep_logits, new.shape[1]))
    t0 = time.perf_counter()
    with torch.no_grad():
        logits, cache, out = forward_with_cache(model.model, new, prefix, logits_to_keep=max(keep, 1),
                                                output_hidden_states=want_hidden)
    sync_device(model.device)
    seconds = time.perf_counter() - t0
    hidden = None
    if want_hidden:
        hidden = {}
        for i, state in enumerate(out.hidden_states[:-1]):
            if start > 0 and base_hidden is not None:
                state = torch.cat([base_hidden[i][:, :start], state], dim=1)
            hidden[i] = state
    kept = logits[0, -keep:].float() if keep else logits[0, :0].float()
    return Computed(cache, kept, seconds, hidden)


def tail_logits(model: LoadedModel, cache: CacheLike, ids: list[int], end: int, tail: int) -> Computed:
    """Logits of positions [end - tail, end) of ids, recomputed over the first end - tail positions of `cache`."""
    return compute_tokens(model, ids[:end], cache, end - tail, tail)


def map_into(source: LoadedModel | None, target: LoadedModel, mapping: Mapping, source_cache: CacheLike,
             ids: list[int], tail: int, repair: RepairPolicy | None = None,
             source_hidden: dict[int, Tensor] | None = None, importance: Tensor | None = None,
             probe: ProbeCheck | None = None, sinks: int = 0,
             costs: PassCosts | None = None) -> tuple[Computed, RepairSummary | None]:
    """Map `source_cache` (exactly the positions of `ids`) onto `target`, repair it per policy, recompute the tail.

    Returns the target cache of len(ids) positions with the logits of its last `tail` positions
    (exact given the mapped prefix: the probe gate reads them), and the repair summary. A repair
    recomputes the tail in the same pass as its own trailing tokens. An adaptive policy (a ladder)
    climbs against `probe` (an `orchestra.familycache.gates.ProbeCheck` with its gate) here, next to the
    target's weights; without a probe it repairs at its first budget. `source` is needed (and held)
    only when the repair policy reads the source model, unless `importance` (`source_importance` of
    the source, computed where the source lives) is given. The first `sinks` positions (the caller keeps
    them clear of the tail) are made exact by a `sinks`-token forward on the target before anything reads
    the map, so the probe already sees them; a repair never recomputes them again, and its plan counts
    their pass in its budget. `costs` (the target's measured `mappings.passcost.PassCosts`) prices the
    repair plan in seconds; None prices it in multiply-adds.
    """
    import torch

    from mappings.apply import exact_prefix, map_cache, tail_recompute
    from mappings.cache_io import build_cache, cache_layers, sync_device, truncate_cache

    t0 = time.perf_counter()
    summary: RepairSummary | None = None
    with torch.no_grad():
        # the source's layers, not the target's: a member may have fewer layers than its source (distilled)
        mapped = map_cache(mapping.kv_map, truncate_cache(source_cache, len(ids)), target.model)
        if sinks:
            exact_prefix(target.model, mapped, _ids(target, ids), sinks)
        if repair is not None and repair.adaptive and probe is None:
            repair = repair.at(repair.budget)
        if repair is not None and (repair.adaptive or repair.budget > 0):
            from mappings.repair import climb_repair, layer_scores, repair_cache

            all_ids = _ids(target, ids)
            src_model = source.model if source is not None else None
            src_layers = list(cache_layers(source_cache)) if source is not None else None
            if repair.adaptive:
                assert probe is not None  # an adaptive policy without a probe was fixed at its first budget above
                res = climb_repair(target.model, list(cache_layers(mapped)), all_ids, repair, probe, tail=tail,
                                   importance=importance, source=src_model, source_layers=src_layers, costs=costs,
                                   exact=sinks)
            else:
                res = repair_cache(target.model, list(cache_layers(mapped)), all_ids, repair,
                                   layer_scores=layer_scores(mapping.manifest), residual=mapping.residual,
                                   source_hidden=source_hidden, source=src_model, source_layers=src_layers,
                                   importance=importance, keep_logits=tail, costs=costs, exact=sinks)
            full, logits, summary = build_cache(res.layers, target.model.config), res.logits, res.record()
        else:
            logits, full = tail_recompute(target.model, mapped, _ids(target, ids), tail)
    assert logits is not None  # both paths keep the tail's logits
    sync_device(target.device)
    return Computed(full, logits[0].float(), time.perf_counter() - t0), summary


def map_on_target(target: LoadedModel, mapping: Mapping, source_cache: CacheLike, ids: list[int], tail: int,
                  repair: RepairPolicy | None, source_hidden: dict[int, Tensor] | None,
                  importance: Tensor | None = None, probe: ProbeCheck | None = None, sinks: int = 0,
                  costs: PassCosts | None = None) -> tuple[Computed, RepairSummary | None]:
    """`map_into` with the target alone (the source's hidden states cut to the mapped positions here, where they live)."""
    return map_into(None, target, mapping, source_cache, ids, tail, repair, _cut_hidden(source_hidden, len(ids)),
                    importance=importance, probe=probe, sinks=sinks, costs=costs)


def map_with_source(source: LoadedModel, target: LoadedModel, mapping: Mapping, source_cache: CacheLike, ids: list[int],
                    tail: int, repair: RepairPolicy | None, source_hidden: dict[int, Tensor] | None,
                    sinks: int = 0, costs: PassCosts | None = None) -> tuple[Computed, RepairSummary | None]:
    """`map_into` holding both models: a repair that reads the source model (scattered tokens) ranks with it."""
    return map_into(source, target, mapping, source_cache, ids, tail, repair, _cut_hidden(source_hidden, len(ids)),
                    sinks=sinks, costs=costs)


def _cut_hidden(hidden: dict[int, Tensor] | None, length: int) -> dict[int, Tensor] | None:
    """The source's hidden states of the first `length` positions (views), or None."""
    return {i: h[:, :length] for i, h in hidden.items()} if hidden is not None else None


def load_mapping(source: LoadedModel, target: LoadedModel, store: MappingStore,
                 cancel: threading.Event | None = None) -> tuple[Mapping, bool]:
    """The pair's mapping from `store` and whether it was calibrated just now (on demand, both models held)."""
    return store.get(source, target, cancel=cancel)


def probe_reference(source: LoadedModel, target: LoadedModel, store: MappingStore, mapping: Mapping,
                    tail: int) -> ProbeReference:
    """The pair's probe reference for `tail` trailing tokens: stored beside the mapping, or measured on both models."""
    return store.probe_reference(source, target, mapping, tail)


def import_layers(model: LoadedModel, layers: list[tuple[Tensor, Tensor]]) -> KVCache:
    """Per-layer K/V read from disk as the model's cache, on its device (the dtype is the stored one: it is
    part of the entry's namespace)."""
    from mappings.cache_io import build_cache, model_device

    return build_cache(layers, model.model.config, device=model_device(model.model))


def held_model(model: LoadedModel) -> LoadedModel:
    """The model itself: how `Executor.model` reaches an in-process executor's models through `run`."""
    return model


def pass_costs(target: LoadedModel, directory: str | None) -> PassCosts:
    """The target's measured pass costs (`mappings.passcost.load_or_measure`), stored in `directory`."""
    from mappings.passcost import load_or_measure

    return load_or_measure(target.model, target.info.fingerprint, directory)


def source_importance(source: LoadedModel, source_cache: CacheLike, ids: list[int],
                      probe_tokens: int, focus: tuple[int, ...] | None = None) -> tuple[Tensor, float]:
    """How much the source's last tokens attend to each position (scattered-token repair ranks by it), and seconds.

    The part of a scattered repair that needs the source model: a remote executor runs it where the
    source lives and hands the result (one float per position) to `map_into` on the target.
    """
    import torch

    from mappings.cache_io import cache_layers
    from mappings.repair import attention_importance

    t0 = time.perf_counter()
    with torch.no_grad():
        scores = attention_importance(source.model, list(cache_layers(source_cache)), _ids(source, ids), probe_tokens,
                                      focus)
    return scores.cpu(), time.perf_counter() - t0


def nbytes_of(cache: CacheLike, *extra: Tensor | dict[int, Tensor] | None) -> int:
    """Bytes held by a cache's K/V plus any tensors (or dicts of tensors) kept beside it."""
    from mappings.cache_io import cache_layers

    total = sum(int(t.numel() * t.element_size()) for pair in cache_layers(cache) for t in pair)
    for item in extra:
        if item is None:
            continue
        values = item.values() if isinstance(item, dict) else [item]
        total += sum(int(t.numel() * t.element_size()) for t in values if t is not None)
    return total
