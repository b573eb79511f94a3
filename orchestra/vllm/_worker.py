"""The connector's worker side: writes loaded caches into vLLM's blocks, and reads computed prompts out of them.

Loading goes through the attention backend's own ``do_kv_cache_update`` (whatever its packing, CPU or
CUDA), before the step's forward pass, for every layer at once. Saving reads each layer's blocks after the
layer ran, with the block layout learnt from the same backend (`BlockLayout`), and hands the prompt's K/V
to the store's writer thread once the last layer is read. A load that cannot be read (a damaged entry, a
missing hand-off file, another number of layers) is reported to vLLM by its blocks, which it recomputes
(``kv_load_failure_policy: recompute``): a failed load costs compute, never a wrong answer.
"""

from __future__ import annotations

import os
import re
import threading
from typing import TYPE_CHECKING, Any

from orchestra.vllm._layout import BlockLayout, slots_for
from orchestra.vllm._scheduler import remove_file, write_event

if TYPE_CHECKING:
    import torch

    from orchestra.familycache import KVStore
    from orchestra.vllm._plan import LoadSpec, StepPlan
    from orchestra.vllm._settings import ConnectorSettings

__all__ = ["WorkerSide", "layer_index"]

_LAYER = re.compile(r"\.(\d+)\.")


def layer_index(name: str) -> int:
    """The decoder layer a vLLM attention layer name belongs to (``model.layers.7.self_attn.attn`` -> 7)."""
    found = _LAYER.findall(name)
    if not found:
        raise ValueError(f"cannot tell the decoder layer of attention layer {name!r}")
    return int(found[-1])


class WorkerSide:
    """Loads and saves for one worker (one device) of a vLLM engine."""

    def __init__(self, settings: ConnectorSettings, block_size: int) -> None:
        self.settings = settings
        self.block_size = block_size
        self._store: KVStore | None = None
        self._layouts: dict[tuple[Any, ...], BlockLayout] = {}
        self._failed: set[int] = set()
        self._saving: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    @property
    def store(self) -> KVStore:
        if self._store is None:
            from orchestra.familycache import KVStore

            s = self.settings
            self._store = KVStore(s.store_dir, s.store_mb << 20, min_tokens=s.min_tokens, min_new_tokens=s.min_tokens)
        return self._store

    # -- loading ----------------------------------------------------------------------------------------------
    def load(self, layers: dict[str, Any], plan: StepPlan) -> None:
        """Write every planned load into the attention `layers` (name -> vLLM Attention with its ``kv_cache``)."""
        attention = sorted((layer_index(n), layer) for n, layer in layers.items()
                           if getattr(layer, "kv_cache", None) is not None)
        for spec in plan.loads:
            cache = self._read(spec)
            if cache is None or len(cache) != len(attention):
                self._fail(spec, "unreadable" if cache is None else f"{len(cache)} layers for {len(attention)}")
                continue
            slots = slots_for(list(spec.block_ids), self.block_size, spec.start, spec.stop)
            for (_, layer), (k, v) in zip(attention, cache, strict=True):
                self._write(layer, k, v, slots, spec)
            self.event("loaded", spec.request_id, kind=spec.kind, tokens=spec.stop - spec.start)

    def _read(self, spec: LoadSpec) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        if spec.stored is not None:
            entry = self.store.load(spec.stored)
            return entry.layers if entry is not None else None
        if spec.handoff is None:
            return None
        try:
            from safetensors.torch import load_file

            tensors = load_file(spec.handoff)
        except Exception as exc:  # a missing or damaged hand-off: recomputed
            self.event("handoff_unreadable", spec.request_id, path=spec.handoff, error=str(exc))
            return None
        finally:
            remove_file(spec.handoff)
        count = len(tensors) // 2
        return [(tensors[f"k.{i}"], tensors[f"v.{i}"]) for i in range(count)]

    def _write(self, layer: Any, k: torch.Tensor, v: torch.Tensor, slots: list[int], spec: LoadSpec) -> None:
        import torch

        kv_cache = layer.kv_cache
        # stored as [1, heads, tokens, head_size]; vLLM writes [tokens, heads, head_size]
        key = k[0, :, spec.start:spec.stop, :].transpose(0, 1).to(kv_cache.device, kv_cache.dtype).contiguous()
        value = v[0, :, spec.start:spec.stop, :].transpose(0, 1).to(kv_cache.device, kv_cache.dtype).contiguous()
        layer.impl.do_kv_cache_update(layer, key, value, kv_cache, torch.tensor(slots, device=kv_cache.device))

    def _fail(self, spec: LoadSpec, why: str) -> None:
        first, last = spec.start // self.block_size, (spec.stop - 1) // self.block_size
        self._failed.update(spec.block_ids[first:last + 1])
        entry = str(spec.stored.path) if spec.stored is not None else spec.handoff
        self.event("load_failed", spec.request_id, kind=spec.kind, reason=why, entry=entry)

    def failed_blocks(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    # -- saving -----------------------------------------------------------------------------------------------
    def save_layer(self, name: str, layer: Any, kv_layer: torch.Tensor, plan: StepPlan) -> None:
        """Read the prompts this step completes out of one layer's blocks (called after the layer ran)."""
        if not plan.saves:
            return
        layout = self._layout(layer, kv_layer)
        index = layer_index(name)
        for spec in plan.saves:
            k, v = layout.read(kv_layer, list(spec.block_ids), len(spec.tokens))
            # the store keeps [1, heads, tokens, head_size] on the CPU, as orchestra's own caches
            self._saving.setdefault(spec.request_id, {})[index] = (
                k.transpose(0, 1).unsqueeze(0).to("cpu", copy=True), v.transpose(0, 1).unsqueeze(0).to("cpu", copy=True))

    def _layout(self, layer: Any, kv_layer: torch.Tensor) -> BlockLayout:
        key = (type(layer.impl).__name__, tuple(kv_layer.shape[1:]), kv_layer.dtype, str(kv_layer.device))
        if key not in self._layouts:
            def write(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
                layer.impl.do_kv_cache_update(layer, k, v, cache, slots)

            self._layouts[key] = BlockLayout.probe(write, tuple(kv_layer.shape[1:]), kv_layer.dtype, kv_layer.device)
        return self._layouts[key]

    def finish_saves(self, plan: StepPlan) -> None:
        """Hand every prompt read this step to the store's writer (it writes behind the engine)."""
        for spec in plan.saves:
            read = self._saving.pop(spec.request_id, {})
            if not read:
                continue
            layers = [read[i] for i in sorted(read)]
            written = self.store.put(spec.namespace, spec.member, spec.tokens, layers)
            self.event("saved", spec.request_id, tokens=len(spec.tokens))
            if written is not None:  # the store writes behind the engine: say when other engines can read it
                self._announce(written, spec.request_id, len(spec.tokens))

    def _announce(self, written: threading.Event, rid: str, tokens: int) -> None:
        from agents.bridge import start_thread

        def wait() -> None:
            if written.wait(timeout=600):
                self.event("stored", rid, tokens=tokens)

        start_thread(wait, name="orchestra-kv-stored")

    def event(self, name: str, rid: str, **detail: Any) -> None:
        write_event(self.settings.events, {"event": name, "request": rid, "side": "worker", "pid": os.getpid(),
                                           **detail})

    def close(self) -> None:
        if self._store is not None:
            self._store.flush(timeout=60)
            self._store.close()

