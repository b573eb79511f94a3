"""The chat engine: documents prefilled once on the source, sessions on any member, KV-mapped model switches.

State lives in memory. Locking, always taken in this order so two requests never deadlock:
session lock (one turn or switch at a time per session) -> document lock (each member's document
cache is built once) -> device locks (one forward pass at a time per device, sorted by name).
Model work runs in worker threads (`anyio.to_thread`); the event loop only coordinates, so other
sessions keep being served while one generates.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import structlog
from anyio import from_thread

from examples.chat_backend import kvops
from examples.chat_backend.config import ChatConfig
from examples.chat_backend.errors import (
    BundledDocumentNotFound,
    ContextFull,
    DocumentNotFound,
    DocumentTooLarge,
    InvalidDocument,
    SessionNotFound,
    UnknownModel,
)
from examples.chat_backend.schemas import CacheInfo, DocumentIn, MessageIn, ModelOut, SessionOut
from orchestra.gates import GateDecision
from orchestra.kvstore import token_hash
from orchestra.mapstore import MappingStore
from orchestra.registry import LoadedModel, ModelRegistry

__all__ = ["ChatEngine", "Document", "Session", "Emit", "bundled_documents"]

log = structlog.get_logger("orchestra.chat")

Emit = Callable[[str, dict[str, Any]], Awaitable[None]]
"""Sends one server-sent event: (event name, JSON-able data)."""

_EXAMPLES = Path(__file__).resolve().parents[1]


def bundled_documents() -> dict[str, Path]:
    """Documents a client may reference by name instead of uploading them."""
    from orchestra.family.corpus import DATA_DIR

    found = {p.name: p for p in sorted(DATA_DIR.glob("*.txt"))}
    long_doc = _EXAMPLES / "long_document_analysis" / "document.txt"
    if long_doc.is_file():
        found["long_document_analysis.txt"] = long_doc
    return found


@dataclass
class DocCache:
    """One member's cache of a document (read-only once built; sessions copy it)."""

    info: CacheInfo
    cache: Any


@dataclass
class Document:
    id: str
    name: str
    digest: str
    prefix_ids: list[int]
    prefill_s: float
    caches: dict[str, DocCache] = field(default_factory=dict)
    lock: anyio.Lock = field(default_factory=anyio.Lock)


@dataclass
class Session:
    id: str
    document: Document
    model: str
    system: str
    messages: list[dict[str, str]] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)
    """Conversation token ids held in `cache` after the document prefix."""
    cache: Any = None
    cache_info: CacheInfo | None = None
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    deleted: bool = False


def _gate_dicts(decisions: list[GateDecision]) -> list[dict[str, Any]]:
    return [{"gate": d.gate, "passed": d.passed, "reason": d.reason, "metrics": d.metrics} for d in decisions]


class ChatEngine:
    """Documents, sessions and the model work behind the HTTP API."""

    def __init__(self, config: ChatConfig | None = None, *, family: Any | None = None,
                 registry: ModelRegistry | None = None, mappings: MappingStore | None = None) -> None:
        self.config = config or ChatConfig.from_env()
        if family is None:
            from orchestra.family import load_family

            family = load_family(self.config.home)
        self.family = family
        # API aliases are the members' roles (root, finetuned, ...); names are accepted too
        self.aliases = {record.role: name for name, record in family.members.items()}
        self.registry = registry or ModelRegistry(self.aliases, family=family, default_device=self.config.device,
                                                  dtype=self.config.dtype)
        self.source = self.resolve_model(self.config.source)
        directory = self.config.mapping_dir or Path(family.home) / "mappings"
        self.mappings = mappings or MappingStore(Path(directory), on_missing=self.config.on_missing_mapping)
        self.documents: dict[str, Document] = {}
        self.sessions: dict[str, Session] = {}
        self._device_locks: dict[str, anyio.Lock] = {}
        self._upload_lock = anyio.Lock()

    # -- models -----------------------------------------------------------------------------
    def resolve_model(self, name: str) -> str:
        """The alias (role) of a member given by role or name; UnknownModel (422) otherwise."""
        if name in self.aliases:
            return name
        for alias, member in self.aliases.items():
            if member == name:
                return alias
        known = ", ".join(f"{alias} ({member})" for alias, member in self.aliases.items())
        raise UnknownModel(f"model {name!r} is not a member of the family; use one of: {known}")

    def models(self) -> list[ModelOut]:
        loaded = self.registry.loaded()
        return [ModelOut(alias=alias, name=name, layers=self.family.members[name].num_layers,
                         source=alias == self.source, loaded=alias in loaded)
                for alias, name in self.aliases.items()]

    async def _load(self, alias: str) -> LoadedModel:
        return await anyio.to_thread.run_sync(self.registry.load, alias)

    @asynccontextmanager
    async def _hold(self, *models: LoadedModel) -> AsyncIterator[None]:
        """Hold the device lock of every device these models are on (sorted: no lock-order deadlock)."""
        async with AsyncExitStack() as stack:
            for device in sorted({m.device for m in models}):
                await stack.enter_async_context(self._device_locks.setdefault(device, anyio.Lock()))
            yield

    def max_context(self, alias: str) -> int:
        return self.registry.info(alias).max_positions or 1 << 30

    # -- documents --------------------------------------------------------------------------
    def _document_text(self, body: DocumentIn) -> tuple[str, str]:
        if body.bundled is not None:
            files = bundled_documents()
            if body.bundled not in files:
                raise BundledDocumentNotFound(
                    f"no bundled document named {body.bundled!r}; available: {', '.join(files)}")
            text, name = files[body.bundled].read_text(encoding="utf-8"), body.bundled
        else:
            text, name = body.text or "", body.name or "uploaded"
        if body.max_chars is not None:
            text = text[: body.max_chars]
        if len(text) > self.config.max_document_chars:
            raise DocumentTooLarge(f"the document has {len(text)} characters; this server takes at most "
                                   f"{self.config.max_document_chars}: send a shorter one or use max_chars")
        if not text.strip():
            raise InvalidDocument("the document is empty; send some text to talk about")
        return text, body.name or name

    async def add_document(self, body: DocumentIn) -> tuple[Document, bool]:
        """Tokenize and prefill the document once on the source; the same document again returns the same id."""
        from agents import DocumentPrompt

        text, name = self._document_text(body)
        source = await self._load(self.source)
        prefix_ids = await anyio.to_thread.run_sync(DocumentPrompt(text).token_ids, source.tokenizer)
        limit = self.max_context(self.source)
        room = 64  # a conversation needs some positions after the document
        if len(prefix_ids) + room > limit:
            raise DocumentTooLarge(f"the document is {len(prefix_ids)} tokens; the models take at most {limit} "
                                   f"positions and a conversation needs {room} or more: shorten it")
        digest = token_hash(prefix_ids)
        async with self._upload_lock:  # two uploads of one document must not prefill it twice
            for doc in self.documents.values():
                if doc.digest == digest:
                    return doc, True
            async with self._hold(source):
                cache, seconds = await anyio.to_thread.run_sync(kvops.prefill, source, prefix_ids)
            doc = Document(id=uuid.uuid4().hex[:12], name=name, digest=digest, prefix_ids=prefix_ids,
                           prefill_s=seconds)
            doc.caches[self.source] = DocCache(CacheInfo(model=self.source, path="exact", seconds=seconds), cache)
            self.documents[doc.id] = doc
        log.info("document_prefilled", document=doc.id, tokens=len(prefix_ids), seconds=round(seconds, 3))
        return doc, False

    def document(self, document_id: str) -> Document:
        try:
            return self.documents[document_id]
        except KeyError:
            raise DocumentNotFound(f"no document {document_id!r}; POST /documents first") from None

    async def _document_cache(self, doc: Document, alias: str, emit: Emit) -> tuple[DocCache, bool]:
        """The document's cache on ``alias``: mapped from the source (gated) once, then reused."""
        async with doc.lock:
            if alias in doc.caches:
                return doc.caches[alias], True
            source, target = await self._load(self.source), await self._load(alias)
            src = doc.caches[self.source]
            if target.info.fingerprint == source.info.fingerprint:
                built = DocCache(CacheInfo(model=alias, path="exact", seconds=0.0), src.cache)
            else:
                async with self._hold(source, target):
                    moved = await anyio.to_thread.run_sync(partial(
                        kvops.transfer, self.mappings, source, src.cache, target, doc.prefix_ids, self.config.gate,
                        self.config.tail_tokens))
                await self._report_gates(alias, moved, emit)
                built = DocCache(CacheInfo(model=alias, path=moved.path, seconds=moved.seconds,
                                           fallback_reason=moved.fallback_reason,
                                           gates=_gate_dicts(moved.decisions)), moved.cache)
            doc.caches[alias] = built
            return built, False

    async def _report_gates(self, alias: str, moved: kvops.Transfer, emit: Emit) -> None:
        for decision in moved.decisions:
            await emit("gate", {"model": alias, "gate": decision.gate, "passed": decision.passed,
                                "reason": decision.reason, "metrics": decision.metrics})
        if moved.fallback_reason is not None:
            await emit("fallback", {"model": alias, "reason": moved.fallback_reason})

    # -- sessions ---------------------------------------------------------------------------
    def create_session(self, document_id: str, model: str, system: str | None = None) -> Session:
        doc = self.document(document_id)
        session = Session(id=uuid.uuid4().hex[:12], document=doc, model=self.resolve_model(model),
                          system=system or self.config.system_prompt)
        self.sessions[session.id] = session
        return session

    def session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.deleted:
            raise SessionNotFound(f"no session {session_id!r}; create one with POST /sessions")
        return session

    def delete_session(self, session_id: str) -> None:
        session = self.session(session_id)
        session.deleted = True  # a request queued on its lock sees this and stops
        session.cache = None
        del self.sessions[session_id]

    def view(self, session: Session) -> SessionOut:
        return SessionOut(session_id=session.id, document_id=session.document.id, model=session.model,
                          messages=list(session.messages), cache=session.cache_info,
                          context_tokens=len(session.document.prefix_ids) + len(session.fed),
                          max_context_tokens=self.max_context(session.model))

    def max_new_tokens(self, body: MessageIn) -> int:
        return min(body.max_new_tokens or self.config.default_max_new_tokens, self.config.max_new_tokens_limit)

    async def precheck(self, session: Session, body: MessageIn) -> None:
        """Refuse (409) a message that cannot fit, before any stream starts (an estimate; the turn re-checks)."""
        alias = self.resolve_model(body.model) if body.model is not None else session.model
        source = await self._load(self.source)
        new = await anyio.to_thread.run_sync(lambda: len(source.tokenizer(body.content)["input_ids"]))
        need = len(session.document.prefix_ids) + len(session.fed) + new + self.max_new_tokens(body)
        if need > self.max_context(alias):
            raise ContextFull(
                f"this message needs about {need} positions but model {alias!r} takes at most "
                f"{self.max_context(alias)}; start a new session, send a shorter message or lower max_new_tokens")

    async def switch(self, session: Session, alias: str, emit: Emit) -> CacheInfo | None:
        """Move the session to member ``alias``, mapping its KV (document + conversation) there.

        Returns the new cache's info, or None when there was nothing to move (same member, or no
        message yet: the next turn builds the cache). Call with the session lock held. The session's cache is mapped directly when the store has a
        mapping for (current member -> alias), which is the case from the source; from any other
        member the conversation is first recomputed on the source over the document's exact cache
        (conversation tokens only, never the document) and mapped from there. A failed gate or a
        missing mapping re-prefills document + conversation on the new member, and says so.
        """
        old = session.model
        if alias == old:
            return None
        await emit("switch", {"from": old, "to": alias, "conversation_tokens": len(session.fed)})
        if session.cache is None:  # nothing computed yet: the next turn builds the new member's cache
            session.model, session.cache_info = alias, None
            return None
        doc = session.document
        a, b, s = await self._load(old), await self._load(alias), await self._load(self.source)
        ids = doc.prefix_ids + session.fed
        started = time.perf_counter()
        with anyio.CancelScope(shield=True):  # the session's state changes below: never half-done
            if b.info.fingerprint == a.info.fingerprint:
                moved, route = kvops.Transfer(session.cache, session.cache_info.path if session.cache_info else "exact",
                                              0.0), "same-weights"
            else:
                direct = a.info.alias == self.source or (self.mappings.path_for(a, b) / "manifest.json").is_file()
                src_model, src_cache, route = a, session.cache, "direct"
                if not direct:
                    # rebuild the session on the source: the document's exact cache + the conversation tokens
                    async with self._hold(s):
                        src_cache = await anyio.to_thread.run_sync(self._source_session, doc, s, session.fed)
                    src_model, route = s, "via-source"
                if b.info.alias == self.source:
                    moved = kvops.Transfer(src_cache, "exact", time.perf_counter() - started)
                else:
                    async with self._hold(src_model, b):
                        moved = await anyio.to_thread.run_sync(partial(
                            kvops.transfer, self.mappings, src_model, src_cache, b, ids, self.config.gate,
                            self.config.tail_tokens))
            await self._report_gates(alias, moved, emit)
            seconds = time.perf_counter() - started
            session.model, session.cache = alias, moved.cache
            session.cache_info = CacheInfo(model=alias, path=moved.path, seconds=seconds,
                                           fallback_reason=moved.fallback_reason, gates=_gate_dicts(moved.decisions))
        await emit("cache", {**session.cache_info.model_dump(), "reused": False, "switched": True, "route": route,
                             "from": old, "tokens": len(ids), "conversation_tokens": len(session.fed)})
        return session.cache_info

    def _source_session(self, doc: Document, source: LoadedModel, fed: list[int]) -> Any:
        from agents import copy_cache

        cache = copy_cache(doc.caches[self.source].cache, source.model)
        kvops.extend(source, cache, fed, len(doc.prefix_ids))
        return cache

    async def turn(self, session: Session, body: MessageIn, emit: Emit, stop: threading.Event) -> None:
        """One user message -> one streamed reply. Call with the session lock held."""
        started = time.perf_counter()
        if session.deleted:
            raise SessionNotFound(f"session {session.id!r} was deleted")
        await emit("start", {"session_id": session.id, "document_id": session.document.id, "model": session.model})
        from agents import copy_cache

        moved = await self.switch(session, self.resolve_model(body.model), emit) if body.model else None
        cache_s = moved.seconds if moved is not None else 0.0
        model = await self._load(session.model)
        if moved is None:  # a switch has reported its cache already
            reused = True
            if session.cache is None:  # the session's first turn on this member: copy the document's cache
                doc_cache, reused = await self._document_cache(session.document, session.model, emit)
                async with self._hold(model):
                    session.cache = await anyio.to_thread.run_sync(copy_cache, doc_cache.cache, model.model)
                session.fed, session.cache_info = [], doc_cache.info
                cache_s += 0.0 if reused else doc_cache.info.seconds
            await emit("cache", {**session.cache_info.model_dump(), "reused": reused, "switched": False,
                                 "tokens": len(session.document.prefix_ids) + len(session.fed)})

        messages = [*session.messages, {"role": "user", "content": body.content}]
        conversation = await anyio.to_thread.run_sync(kvops.render_conversation, model.tokenizer, session.system,
                                                      messages)
        prefix_len, max_new = len(session.document.prefix_ids), self.max_new_tokens(body)
        limit = self.max_context(session.model)
        if prefix_len + len(conversation) + max_new > limit:
            raise ContextFull(f"document ({prefix_len}) + conversation ({len(conversation)}) + max_new_tokens "
                              f"({max_new}) exceed model {session.model!r}'s {limit} positions; start a new session")

        first: list[float] = []

        def on_token(text: str, index: int) -> None:  # in the worker thread
            if not first:
                first.append(time.perf_counter())
            from_thread.run(emit, "token", {"text": text, "index": index})

        with anyio.CancelScope(shield=True):  # the session's cache is extended in place: finish and record it
            try:
                async with self._hold(model):
                    result = await anyio.to_thread.run_sync(partial(
                        kvops.run_turn, model, session.cache, prefix_len, session.fed, conversation,
                        max_new_tokens=max_new, temperature=body.temperature, seed=body.seed, on_token=on_token,
                        stop=stop))
            except BaseException:
                # the cache may hold tokens `fed` does not list: rebuild it from the document next time
                session.cache, session.fed, session.cache_info = None, [], None
                raise
            session.cache, session.fed = result.cache, result.fed
            if result.finish_reason != "cancelled":
                session.messages = [*messages, {"role": "assistant", "content": result.text}]
        total = time.perf_counter() - started
        generated = len(result.token_ids)
        await emit("done", {
            "model": session.model, "reply": result.text, "finish_reason": result.finish_reason,
            "tokens": generated, "cache_path": session.cache_info.path if session.cache_info else None,
            "context_tokens": prefix_len + len(session.fed),
            "timings": {
                "cache_s": cache_s, "prompt_tokens": result.prompt_tokens, "prompt_prefill_s": result.prompt_prefill_s,
                "ttft_s": (first[0] - started) if first else None, "generation_s": result.generation_s,
                "tokens_per_s": generated / result.generation_s if result.generation_s > 0 else None,
                "total_s": total,
            },
        })
