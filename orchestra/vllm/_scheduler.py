"""The connector's scheduler side: for each new request, what the family's store can give it, and what to save.

vLLM asks, per waiting request, how many tokens beyond its own prefix cache the connector can load. The
answer comes from the member's own exact entries in the store (answered at once), or from a cache another
member computed, mapped into this one by FamilyCache in the background (vLLM is told to ask again until the
map is built or refused). A mapped load never passes for exact: the request's block hashes from its first
mapped block on are moved into a hash space of that mapping, so vLLM's own prefix cache serves those blocks
again only to requests that load the same mapped prefix, never to one that asks for the member's exact
cache; and a request with mapped blocks is never saved under the member's exact namespace.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from orchestra.vllm._lookup import FamilyLookup, MappedBuild
from orchestra.vllm._plan import LoadKind, LoadSpec, SaveSpec, StepPlan

if TYPE_CHECKING:
    from orchestra.familycache import StoredEntry
    from orchestra.vllm._settings import ConnectorSettings

__all__ = ["SchedulerSide", "Planned"]


@dataclass
class Planned:
    """A load decided for a request: positions [start, stop) of an entry or a hand-off file."""

    kind: LoadKind
    stop: int
    start: int = 0
    stored: StoredEntry | None = None
    handoff: str | None = None
    salt: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Track:
    """A request the scheduler has scheduled: its prompt, its blocks, and what the store holds of it."""

    ids: tuple[int, ...]
    block_ids: list[int]
    member: str | None
    """The member it runs on (the engine's, or one of its LoRA adapters); None: a LoRA the connector does not know."""
    mapped: bool = False
    held: int = 0
    saved: bool = False


class SchedulerSide:
    """Decides loads and saves; vLLM's scheduler calls it from one thread."""

    def __init__(self, settings: ConnectorSettings, *, dtype: str, model_path: str, block_size: int,
                 hash_block_size: int, hash_fn: Any) -> None:
        self.settings = settings
        self.lookup = FamilyLookup(settings, dtype=dtype, model_path=model_path)
        self.block_size = block_size
        self.hash_block_size = hash_block_size
        self.hash_fn = hash_fn
        self._planned: dict[str, Planned] = {}
        self._pending: dict[str, Future[MappedBuild]] = {}
        self._refused: set[str] = set()
        self._to_load: dict[str, Planned] = {}
        self._tracks: dict[str, Track] = {}
        self._members: dict[str, str | None] = {}

    # -- get_num_new_matched_tokens ---------------------------------------------------------------------------
    def matched(self, request: Any, num_computed: int) -> tuple[int | None, bool]:
        rid = request.request_id
        member = self._member(request)
        if member is None:
            return 0, False
        ids = tuple(int(t) for t in (request.prompt_token_ids or ()))
        limit = len(ids) - 1  # vLLM computes at least the prompt's last token
        if rid in self._pending:
            if not self._pending[rid].done():
                return None, False
            self._take_build(rid, self._pending.pop(rid), limit)
        plan = self._planned.get(rid)
        if plan is None and rid not in self._refused and len(ids) >= self.settings.min_tokens:
            plan = self._plan(rid, member, ids, num_computed, limit)
            if plan is None and rid in self._pending:
                return None, False
        if plan is None or plan.stop <= num_computed:
            return 0, False
        plan.start = num_computed
        if plan.kind == "mapped":
            self._into_mapped_space(request, num_computed, plan.salt or "orchestra-mapped")
        return plan.stop - num_computed, False

    def _member(self, request: Any) -> str | None:
        """The member `request` runs on, decided once per request (its LoRA, or the engine's member)."""
        rid = getattr(request, "request_id", None) or request.req_id  # a Request, or a step's NewRequestData
        if rid not in self._members:
            lora = getattr(request, "lora_request", None)
            name = lora.lora_name if lora is not None else None
            self._members[rid] = self.lookup.member_for(name)
            if self._members[rid] is None:
                self.event("unknown_adapter", rid, adapter=name,
                           reason="add it to the connector's adapters to save and load its caches")
        return self._members[rid]

    def _plan(self, rid: str, member: str, ids: tuple[int, ...], num_computed: int, limit: int) -> Planned | None:
        own = self.lookup.own_entry(member, ids)
        own_len = min(own.length, limit) if own is not None else 0
        mappable = self.lookup.mappable(member, ids)
        length = min(mappable.length, limit) if mappable is not None else 0
        if mappable is not None and length >= max(own_len, num_computed) + self.settings.min_mapped_tokens:
            self._pending[rid] = self.lookup.submit(member, mappable.source, ids[:length])
            return None
        if own is not None and own_len >= num_computed + self.block_size:
            plan = Planned("exact", own_len, stored=own.entry, detail={"from": "store"})
            self._planned[rid] = plan
            return plan
        return None

    def _take_build(self, rid: str, future: Future[MappedBuild], limit: int) -> None:
        build = future.result()
        if build.kind == "refused" or build.handoff is None:
            self._refused.add(rid)
            self.event("refused", rid, reason=build.reason, gates=list(build.gates))
            return
        salt = f"orchestra-mapped:{build.source}:{build.mapping}"
        self._planned[rid] = Planned("mapped", min(build.length, limit), handoff=build.handoff, salt=salt,
                                     detail={"source": build.source, "mapping": build.mapping,
                                             "gates": list(build.gates)})

    def _into_mapped_space(self, request: Any, num_computed: int, salt: str) -> None:
        """Re-hash the request's blocks from its first mapped one in a hash space of the map (see module doc)."""
        from vllm.v1.core.kv_cache_utils import hash_block_tokens

        first = num_computed // self.hash_block_size
        hashes = list(request.block_hashes[:first])
        parent = hashes[-1] if hashes else None
        ids = request.all_token_ids
        for b in range(first, len(request.block_hashes)):
            block = ids[b * self.hash_block_size:(b + 1) * self.hash_block_size]
            parent = hash_block_tokens(self.hash_fn, parent, block, (salt,) if b == first else None)
            hashes.append(parent)
        request.block_hashes[:] = hashes

    # -- update_state_after_alloc -----------------------------------------------------------------------------
    def allocated(self, request: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        plan = self._planned.get(rid)
        if plan is None:
            return
        if num_external_tokens <= 0:
            if plan.handoff is not None:
                self._planned.pop(rid)
                remove_file(plan.handoff)
            return
        plan.stop = plan.start + num_external_tokens
        self._to_load[rid] = self._planned.pop(rid)

    # -- build_connector_meta ---------------------------------------------------------------------------------
    def step(self, out: Any) -> StepPlan:
        plan = StepPlan()
        for new in out.scheduled_new_reqs:
            ids = tuple(int(t) for t in (new.prompt_token_ids or ()))
            track = self._tracks.setdefault(new.req_id, Track(ids, [], self._member(new)))
            track.block_ids = list(new.block_ids[0])
            self._load(plan, new.req_id, track)
            self._save(plan, new.req_id, track, new.num_computed_tokens + out.num_scheduled_tokens[new.req_id])
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            known = self._tracks.get(rid)
            if known is None:
                continue
            track = known
            blocks = cached.new_block_ids[i]
            if blocks is not None:
                track.block_ids = list(blocks[0]) if rid in cached.resumed_req_ids else track.block_ids + list(blocks[0])
            self._load(plan, rid, track)
            self._save(plan, rid, track, cached.num_computed_tokens[i] + out.num_scheduled_tokens.get(rid, 0))
        return plan

    def _load(self, plan: StepPlan, rid: str, track: Track) -> None:
        load = self._to_load.pop(rid, None)
        if load is None:
            return
        track.mapped = track.mapped or load.kind == "mapped"
        track.held = max(track.held, load.stop) if load.kind == "exact" else track.held
        plan.loads.append(LoadSpec(rid, load.kind, load.start, load.stop, tuple(track.block_ids), load.stored,
                                   load.handoff))
        self.event("load", rid, kind=load.kind, start=load.start, tokens=load.stop - load.start, **load.detail)

    def _save(self, plan: StepPlan, rid: str, track: Track, done: int) -> None:
        length = len(track.ids)
        if track.member is None or track.mapped or track.saved or done < length or length < self.settings.min_tokens:
            return
        track.saved = True
        if length - track.held < self.settings.min_tokens:
            return
        plan.saves.append(SaveSpec(rid, self.lookup.namespace_of(track.member), track.member, track.ids,
                                   tuple(track.block_ids)))
        self.event("save", rid, tokens=length)

    # -- request_finished -------------------------------------------------------------------------------------
    def finished(self, request: Any) -> None:
        rid = request.request_id
        self._tracks.pop(rid, None)
        self._members.pop(rid, None)
        self._refused.discard(rid)
        for table in (self._planned, self._to_load):
            left = table.pop(rid, None)
            if left is not None and left.handoff is not None:
                remove_file(left.handoff)
        future = self._pending.pop(rid, None)
        if future is not None:
            future.add_done_callback(lambda f: remove_file(f.result().handoff) if f.result().handoff else None)

    def event(self, name: str, rid: str, **detail: Any) -> None:
        member = self._members.get(rid) or self.lookup.member
        write_event(self.settings.events, {"event": name, "request": rid, "member": member, "side": "scheduler",
                                           **detail})

    def close(self) -> None:
        self.lookup.close()


def write_event(path: str | None, record: dict[str, Any]) -> None:
    """Append one JSON line (one write call: lines from the scheduler and the workers do not interleave)."""
    if path is None:
        return
    line = json.dumps({"time": round(time.time(), 3), **record}, default=str) + "\n"
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line)


def remove_file(path: str | None) -> None:
    """Remove a hand-off file, if it is still there."""
    import os

    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass
