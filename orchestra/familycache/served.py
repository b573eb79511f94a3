"""What an agent actually gets: the cache a FamilyCache serves for a pair, scored against the target's own prefill.

`orchestra evaluate` scores mapping *methods*; this scores the *product path* on the same windows:
the source's prefix cache is in a FamilyCache, the target's cache is asked for under the gates,
and whatever comes back (mapped, or re-prefilled after a refused map) is continued with the
suffix and compared with the target's own prefill of prefix + suffix.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from orchestra.familycache.gates import GatePolicy

__all__ = ["ServedWindow", "ServedReport", "evaluate_served"]


class ServedWindow(BaseModel):
    """One window: which path the cache took and how close the suffix's predictions are to the truth."""

    model_config = ConfigDict(extra="forbid")
    path: str = Field(description="exact | mapped | reprefilled")
    fallback_reason: str | None = None
    gates: list[dict[str, object]] = Field(default_factory=list)
    kl: float = Field(description="mean KL(target's own prefill || served cache) over the suffix, nats")
    top1: float = Field(description="fraction of suffix positions whose argmax agrees with the truth")
    seconds: float = Field(description="wall seconds the FamilyCache took to serve the target's cache")


class ServedReport(BaseModel):
    """The served rows over every window, and their mean."""

    model_config = ConfigDict(extra="forbid")
    mapping: str
    gate: dict[str, object]
    windows: list[ServedWindow]
    kl: float
    top1: float
    mapped_share: float = Field(description="share of windows served mapped (the rest re-prefilled)")


def evaluate_served(mapping_dir: str | Path, ids: Sequence[int], *, source: str | Path, target: str | Path,
                    prefix_tokens: int, suffix_tokens: int, windows: int = 1, device: str = "cpu",
                    gate: GatePolicy | None = None, tail_tokens: int = 32) -> ServedReport:
    """Score the FamilyCache's served cache of `target` (mapped from `source` through `mapping_dir`) on `ids`."""
    import torch

    from mappings.cache_io import copy_cache, forward_with_cache
    from mappings.metrics import next_token_agreement
    from orchestra.familycache import CachePolicy, FamilyCache
    from orchestra.familycache.mapping_store import MappingStore
    from orchestra.models.registry import ModelRegistry

    gate = gate or GatePolicy()
    registry = ModelRegistry({"source": str(source), "target": str(target)}, default_device=device)
    store = MappingStore(Path(mapping_dir).parent, on_missing="refuse")
    store.add(Path(mapping_dir), registry.load("source"), registry.load("target"))
    n, m = int(prefix_tokens), int(suffix_tokens)
    rows: list[ServedWindow] = []
    for w in range(windows):
        span = list(ids[w * (n + m) : w * (n + m) + n + m])
        prefix = span[:n]
        cache = FamilyCache(registry, store, source="source",
                            policy=CachePolicy(gate=gate, tail_tokens=tail_tokens, min_mapped_tokens=1))
        cache.acquire_sync("source", prefix).release()
        with cache.acquire_sync("target", prefix) as lease:
            model = registry.load("target")
            with torch.no_grad():
                full = torch.tensor([span], device=model.device)
                truth, _, _ = forward_with_cache(model.model, full, None)
                served, _, _ = forward_with_cache(model.model, full[:, n:], copy_cache(lease.local_cache(), model.model))
            # predictions after each suffix token: the truth's own prefill vs the served cache + the suffix
            metrics = next_token_agreement(truth[:, n : n + m].float(), served[:, :m].float())
            rows.append(ServedWindow(path=lease.path, fallback_reason=lease.fallback_reason, gates=lease.gate_dicts(),
                                     kl=metrics["kl"], top1=metrics["top1"], seconds=lease.seconds))
    return ServedReport(mapping=str(mapping_dir), gate=gate.model_dump(mode="json"), windows=rows,
                        kl=sum(r.kl for r in rows) / len(rows), top1=sum(r.top1 for r in rows) / len(rows),
                        mapped_share=sum(r.path == "mapped" for r in rows) / len(rows))

