"""The chat engine: documents and sessions over one FamilyCache; it never maps, gates or prefills itself.

A document is tokenized once and leased on the source member (its one prefill). Each turn renders
document prefix + conversation and asks the FamilyCache for the session's member's cache of all
but the last prompt token: the longest cached prefix is reused (the document, the earlier turns),
another member's longer one is mapped (a model switch; gated, re-prefilled when refused), the rest is
computed. `agents.continue_ids` then feeds the last token and decodes under the member's lock.
The last token stays out of the lease because decoding needs its logits, and it keeps what the
FamilyCache stores an exact prefix of the next turn's ids. Locks: a session's lock (one turn at a
time, held by the app) -> the FamilyCache's model locks. Model work runs in worker threads.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import structlog
from anyio import from_thread

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
from orchestra import CacheLease, CachePolicy, FamilyCache

__all__ = ["ChatEngine", "Document", "Session", "Emit", "bundled_documents", "render_conversation"]

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


def render_conversation(tokenizer: Any, system: str, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of the conversation after the document prefix, ending with the assistant's turn opener.

    The chat template is applied to the conversation only (the document prefix stays model- and
    session-independent); a tokenizer without a template gets a plain-text layout.
    """
    turns = [{"role": "system", "content": system}, *messages]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        bos = getattr(tokenizer, "bos_token", None)
        if bos and text.startswith(bos):
            text = text[len(bos):]  # a BOS belongs at the start of the prefix, never after the document
    else:
        text = "".join(f"\n### {t['role'].title()}\n{t['content']}\n" for t in turns) + "\n### Assistant\n"
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _info(lease: CacheLease) -> CacheInfo:
    return CacheInfo(model=lease.member, path=lease.path, source=lease.source, tokens=lease.tokens,
                     reused_tokens=lease.reused_tokens, computed_tokens=lease.computed_tokens, seconds=lease.seconds,
                     fallback_reason=lease.fallback_reason, gates=lease.gate_dicts())


@dataclass
class Document:
    id: str
    name: str
    prefix_ids: list[int]
    lease: CacheLease
    """Keeps the document's prefill on the source cached for every session."""
    info: CacheInfo


@dataclass
class Session:
    id: str
    document: Document
    model: str
    system: str
    messages: list[dict[str, str]] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    """The token ids `lease` holds: document prefix + the last prompt's conversation but its last token."""
    lease: CacheLease | None = None
    info: CacheInfo | None = None
    conversation_tokens: int = 0
    """Positions after the document that the last turn used (prompt and reply)."""
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    deleted: bool = False


class ChatEngine:
    """Documents, sessions and the model work behind the HTTP API."""

    def __init__(self, config: ChatConfig | None = None, *, family: Any | None = None,
                 registry: Any | None = None, mappings: Any | None = None) -> None:
        """Pass `registry` and `mappings` (a ModelRegistry and a MappingStore) to share loaded models."""
        self.config = config or ChatConfig.from_env()
        if family is None:
            from orchestra import load_family

            family = load_family(self.config.home)
        self.family = family
        # API aliases are the members' roles (root, finetuned, ...); names are accepted too
        self.aliases = {record.role: name for name, record in family.members.items()}
        self.source = self.resolve_model(self.config.source)
        policy = CachePolicy(gate=self.config.gate, tail_tokens=self.config.tail_tokens,
                             budget_bytes=self.config.cache_budget_mb << 20)
        if registry is not None:
            self.cache = FamilyCache(registry, mappings, source=self.source, policy=policy)
        else:
            self.cache = FamilyCache.for_family(
                family, source=self.source, device=self.config.device, dtype=self.config.dtype, policy=policy,
                mapping_dir=str(self.config.mapping_dir) if self.config.mapping_dir else None,
                on_missing=self.config.on_missing_mapping)
        self.documents: dict[str, Document] = {}
        self.sessions: dict[str, Session] = {}

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
        loaded = self.cache.executor.registry.loaded()
        return [ModelOut(alias=alias, name=name, layers=self.family.members[name].num_layers,
                         source=alias == self.source, loaded=alias in loaded)
                for alias, name in self.aliases.items()]

    async def _load(self, alias: str) -> Any:
        return await anyio.to_thread.run_sync(self.cache.executor.load, alias)

    def max_context(self, alias: str) -> int:
        return self.cache.info(alias).max_positions or 1 << 30

    async def _acquire(self, member: str, ids: list[int]) -> CacheLease:
        with anyio.CancelScope(shield=True):  # a lease lost to a cancellation would stay pinned
            return await self.cache.acquire(member, ids)

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

    def _known(self, prefix_ids: list[int]) -> Document | None:
        return next((doc for doc in self.documents.values() if doc.prefix_ids == prefix_ids), None)

    async def add_document(self, body: DocumentIn) -> tuple[Document, bool]:
        """Tokenize the document and lease its cache on the source (one prefill); the same document again returns the same id."""
        from agents import DocumentPrompt

        text, name = self._document_text(body)
        tokenizer = (await self._load(self.source)).tokenizer
        prefix_ids = await anyio.to_thread.run_sync(DocumentPrompt(text).token_ids, tokenizer)
        limit, room = self.max_context(self.source), 64  # a conversation needs some positions after the document
        if len(prefix_ids) + room > limit:
            raise DocumentTooLarge(f"the document is {len(prefix_ids)} tokens; the models take at most {limit} "
                                   f"positions and a conversation needs {room} or more: shorten it")
        if (known := self._known(prefix_ids)) is not None:
            return known, True
        lease = await self._acquire(self.source, prefix_ids)  # concurrent uploads share one prefill
        if (known := self._known(prefix_ids)) is not None:  # one of them was first
            lease.release()
            return known, True
        doc = Document(id=uuid.uuid4().hex[:12], name=name, prefix_ids=prefix_ids, lease=lease, info=_info(lease))
        self.documents[doc.id] = doc
        log.info("document_cached", document=doc.id, tokens=len(prefix_ids), seconds=round(lease.prefill_seconds, 3))
        return doc, False

    def document(self, document_id: str) -> Document:
        try:
            return self.documents[document_id]
        except KeyError:
            raise DocumentNotFound(f"no document {document_id!r}; POST /documents first") from None

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
        if session.lease is not None:
            session.lease.release()
        del self.sessions[session_id]

    def view(self, session: Session) -> SessionOut:
        return SessionOut(session_id=session.id, document_id=session.document.id, model=session.model,
                          messages=list(session.messages), cache=session.info,
                          context_tokens=len(session.document.prefix_ids) + session.conversation_tokens,
                          max_context_tokens=self.max_context(session.model))

    def max_new_tokens(self, body: MessageIn) -> int:
        return min(body.max_new_tokens or self.config.default_max_new_tokens, self.config.max_new_tokens_limit)

    async def precheck(self, session: Session, body: MessageIn) -> None:
        """Refuse (409) a message that cannot fit, before any stream starts (an estimate; the turn re-checks)."""
        alias = self.resolve_model(body.model) if body.model is not None else session.model
        source = await self._load(self.source)
        new = await anyio.to_thread.run_sync(lambda: len(source.tokenizer(body.content)["input_ids"]))
        need = len(session.document.prefix_ids) + session.conversation_tokens + new + self.max_new_tokens(body)
        if need > self.max_context(alias):
            raise ContextFull(
                f"this message needs about {need} positions but model {alias!r} takes at most "
                f"{self.max_context(alias)}; start a new session, send a shorter message or lower max_new_tokens")

    async def _lease(self, session: Session, ids: list[int], emit: Emit, switched_from: str | None) -> CacheLease:
        """The session's cache of `ids` on its member from the FamilyCache; says how it was obtained."""
        lease = await self._acquire(session.model, ids)
        old, session.lease, session.ids, session.info = session.lease, lease, ids, _info(lease)
        if old is not None:
            old.release()
        if session.deleted:
            lease.release()
        for gate in lease.gate_dicts():
            await emit("gate", {"model": lease.member, **gate})
        if lease.fallback_reason is not None:
            await emit("fallback", {"model": lease.member, "reason": lease.fallback_reason})
        extra = {"from": switched_from} if switched_from is not None else {}
        await emit("cache", {**session.info.model_dump(), "hit": lease.hit, "switched": switched_from is not None,
                             **extra})
        return lease

    async def _move(self, session: Session, alias: str, emit: Emit) -> str | None:
        """Point the session at member `alias` (its next lease is taken there); returns the member it left."""
        old = session.model
        if alias == old:
            return None
        await emit("switch", {"from": old, "to": alias, "conversation_tokens": session.conversation_tokens})
        session.model = alias
        return old

    async def switch(self, session: Session, alias: str, emit: Emit) -> CacheInfo | None:
        """Move the session to `alias` now: the FamilyCache maps what the session holds there (or re-prefills it).

        None when nothing was moved (same member, or no turn yet: the next turn takes the lease).
        Call with the session lock held.
        """
        old = await self._move(session, alias, emit)
        if old is None or session.lease is None:
            return None
        await self._lease(session, session.ids, emit, old)
        return session.info

    async def turn(self, session: Session, body: MessageIn, emit: Emit, stop: threading.Event) -> None:
        """One user message -> one streamed reply. Call with the session lock held."""
        from agents import continue_ids

        started = time.perf_counter()
        if session.deleted:
            raise SessionNotFound(f"session {session.id!r} was deleted")
        await emit("start", {"session_id": session.id, "document_id": session.document.id, "model": session.model})
        switched_from = await self._move(session, self.resolve_model(body.model), emit) if body.model else None
        model = await self._load(session.model)
        messages = [*session.messages, {"role": "user", "content": body.content}]
        conversation = await anyio.to_thread.run_sync(render_conversation, model.tokenizer, session.system, messages)
        prefix_len, max_new = len(session.document.prefix_ids), self.max_new_tokens(body)
        limit = self.max_context(session.model)
        if prefix_len + len(conversation) + max_new > limit:
            raise ContextFull(f"document ({prefix_len}) + conversation ({len(conversation)}) + max_new_tokens "
                              f"({max_new}) exceed model {session.model!r}'s {limit} positions; start a new session")
        ids = session.document.prefix_ids + conversation
        lease = await self._lease(session, ids[:-1], emit, switched_from)

        first: list[float] = []

        def on_token(text: str, token_id: int, index: int) -> None:  # in the worker thread
            if not first:
                first.append(time.perf_counter())
            if text:
                from_thread.run(emit, "token", {"text": text, "index": index})

        result = await anyio.to_thread.run_sync(partial(
            continue_ids, model.model, model.tokenizer, lease.cache, lease.tokens, ids[-1:], max_new_tokens=max_new,
            temperature=body.temperature, seed=body.seed, on_token=on_token, cancel=stop,
            lock=self.cache.lock(session.model)))
        session.conversation_tokens = len(conversation) + len(result.token_ids)
        if result.finish_reason != "cancelled":
            session.messages = [*messages, {"role": "assistant", "content": result.text}]
        generated = len(result.token_ids)
        await emit("done", {
            "model": session.model, "reply": result.text, "finish_reason": result.finish_reason,
            "tokens": generated, "cache_path": lease.path, "context_tokens": len(ids) + generated,
            "timings": {
                "cache_s": lease.seconds, "cached_tokens": lease.reused_tokens,
                "prompt_tokens": lease.computed_tokens + result.prompt_tokens, "prompt_prefill_s": result.prompt_s,
                "ttft_s": (first[0] - started) if first else None, "generation_s": result.generation_s,
                "tokens_per_s": result.tokens_per_s or None, "total_s": time.perf_counter() - started,
            },
        })
