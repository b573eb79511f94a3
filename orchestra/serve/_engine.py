"""The in-process serving engine: OpenAI-style chat requests over the family-wide FamilyCache.

Every request renders its messages with the family's (shared) chat template, asks the FamilyCache
for the longest cached prefix of the prompt on the requested member (exact, or mapped from another
member and gated, or prefilled), and decodes the reply over it under the
member's lock, sampling as the request's fields ask (`orchestra.serve._sampling`). Backends that do not want
HTTP use this class directly:

    engine = ServeEngine(ServeConfig())
    async with engine.open(ChatCompletionRequest(model="finetuned", messages=[...])) as gen:
        async for text in gen.stream():
            print(text, end="")
    print(gen.usage(), gen.cache_info)
"""

from __future__ import annotations

import functools
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from agents.bridge import CancelFlag, ThreadStream, WorkerCancelledError, in_thread, start_thread
from orchestra._logging import get_logger
from orchestra.familycache import CacheLease, CachePolicy, FamilyCache, make_executor
from orchestra.serve._config import ServeConfig
from orchestra.serve._errors import (
    BadRequest,
    ContextLengthExceeded,
    ExecutorFailed,
    ModelNotFound,
    RateLimited,
    RequestTimeout,
)
from orchestra.serve._metrics import ServeMetrics
from orchestra.serve._schemas import (
    ChatCompletionRequest,
    ChatMessage,
    ModelCard,
    ResponseFormat,
    TokenLogprob,
    TopLogprob,
    Usage,
)

if TYPE_CHECKING:
    from agents.constrained import JsonConstraint
    from agents.continuation import Continuation
    from mappings.types import Tokenizer
    from orchestra.family.manifest import FamilyManifest
    from orchestra.models.modelref import AdapterSpec, QuantizeSpec
    from orchestra.serve._batch import BatchDecoder
    from orchestra.serve._runs import RunManager
    from orchestra.serve._sampling import SampledToken

__all__ = ["ServeEngine", "Generation", "CacheInfo", "Piece", "render_messages", "tune_allocator"]

log = get_logger("orchestra.serve")


@dataclass(frozen=True)
class CacheInfo:
    """How the prompt's cache was obtained: what the x-orchestra-* headers say."""

    path: str
    """exact | mapped | reprefilled"""
    source: str | None
    """The member whose cache was mapped (mapped and reprefilled)."""
    cached_tokens: int
    """Prompt tokens not recomputed for this request."""
    gates: list[dict[str, object]]
    fallback_reason: str | None
    seconds: float

    def headers(self) -> dict[str, str]:
        out = {"x-orchestra-cache": self.path, "x-orchestra-cached-tokens": str(self.cached_tokens)}
        if self.source:
            out["x-orchestra-cache-source"] = self.source
        if self.gates:
            out["x-orchestra-gates"] = ",".join(f"{g['gate']}={'pass' if g['passed'] else 'fail'}" for g in self.gates)
        if self.fallback_reason:
            out["x-orchestra-fallback"] = self.fallback_reason.encode("ascii", "replace").decode()[:200]
        return out


def render_messages(tokenizer: Tokenizer, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True,
                    response_format: ResponseFormat | None = None) -> list[int]:
    """Prompt token ids: the chat template when the tokenizer has one, a plain layout otherwise.

    A JSON response format adds its instruction to the end of the last user message, never to the
    system message, so the cached prefix (a long document in the first messages) stays the same.
    """
    from agents.prompt import has_chat_template

    turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    hint = _json_hint(response_format)
    if hint:
        last = max((i for i, t in enumerate(turns) if t["role"] == "user"), default=None)
        if last is None:
            turns.append({"role": "user", "content": hint})
        else:
            turns[last] = {**turns[last], "content": f"{turns[last]['content']}\n\n{hint}"}
    if has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=add_generation_prompt)
    else:
        text = "".join(f"### {t['role'].title()}\n{t['content']}\n\n" for t in turns)
        if add_generation_prompt:
            text += "### Assistant\n"
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _json_hint(fmt: ResponseFormat | None) -> str:
    if fmt is None or fmt.type == "text":
        return ""
    if fmt.type == "json_object":
        return "Reply with one JSON object only."
    import json

    assert fmt.json_schema is not None
    return ("Reply with one JSON object only, following this JSON schema:\n"
            + json.dumps(fmt.json_schema.schema_, separators=(",", ":")))


@dataclass(frozen=True)
class Piece:
    """A piece of a reply's text as it becomes safe to show, and the log-probabilities of the tokens it completes
    (when the request asked for them; a token whose text is held back is reported with the next piece)."""

    text: str
    logprobs: tuple[SampledToken, ...] = ()


@dataclass
class Generation:
    """One admitted request: its cache lease, then the streamed reply; close it to free its slot."""

    id: str
    created: int
    model: str
    member: str
    prompt_ids: list[int]
    lease: CacheLease
    cache_info: CacheInfo
    leased_tokens: int
    """Leading prompt tokens the lease holds; decoding computes the rest of the prompt first."""
    max_tokens: int
    request: ChatCompletionRequest
    engine: ServeEngine
    started: float
    cancel: threading.Event = field(default_factory=CancelFlag)
    """Stops decoding at its next token; a CancelFlag, so a decode in a Ray actor hears of it at once."""
    result: Continuation | None = None
    ttft_s: float | None = None
    timed_out: bool = False
    completion_tokens: int = 0
    constraint: JsonConstraint | None = None
    """The request's JSON constraint (response_format), compiled before it was admitted (local executor)."""
    placement: dict[str, str] = field(default_factory=dict)
    """Where it was decoded under the ray executor: ``{"actor": "root#0", "node": ...}``."""
    tokenizer: Tokenizer | None = None
    """The member's tokenizer (the text of the tokens in `token_logprobs`)."""
    token_logprobs: list[SampledToken] = field(default_factory=list)
    """Each reply token's log-probability, when the request asked for them (``logprobs``)."""
    token_gaps: list[float] = field(default_factory=list)
    """Seconds between consecutive reply tokens (the inter-token latency metric)."""
    _decoding: ThreadStream[Piece, Continuation] | None = None

    async def stop(self) -> None:
        """Stop decoding at the next token and wait for the thread (idempotent)."""
        self.cancel.set()
        if self._decoding is not None:
            await self._decoding.wait()

    async def stream(self) -> AsyncIterator[str]:
        """Text pieces as they become safe to show; `result` is set when it ends (also on cancel)."""
        async for piece in self.pieces():
            if piece.text:
                yield piece.text

    async def pieces(self) -> AsyncIterator[Piece]:
        """`stream`, each piece with the log-probabilities of its tokens (a piece with no text carries those of
        the last tokens, when their text is empty: an end-of-sequence token)."""
        wants_logprobs = bool(self.request.logprobs)

        def work(emit: Callable[[Piece], None], cancel: threading.Event) -> Continuation:  # the decoding thread
            pending: list[SampledToken] = []
            last: list[float] = []

            def on_token(text: str, token_id: int, index: int, logprob: SampledToken | None) -> None:
                now = time.perf_counter()
                self.completion_tokens = index + 1
                if self.ttft_s is None:
                    self.ttft_s = now - self.started
                elif last:
                    self.token_gaps.append(now - last[0])
                last[:] = [now]
                if wants_logprobs and logprob is not None:
                    self.token_logprobs.append(logprob)
                    pending.append(logprob)
                if text:
                    emit(Piece(text, tuple(pending)))
                    pending.clear()

            self.result = self.engine._decode(self, on_token)
            if pending:
                emit(Piece("", tuple(pending)))
            return self.result

        remaining = self.engine.config.request_timeout_s - (time.perf_counter() - self.started)
        # A thread of its own (a reply can take long: it must not hold one of anyio's worker threads); leaving
        # the block sets `cancel` and waits for it, so no compute outlives the request.
        async with ThreadStream(work, cancel=self.cancel, thread_name=f"decode-{self.id}") as decoding:
            self._decoding = decoding
            with anyio.move_on_after(max(0.0, remaining)) as scope:
                async for piece in decoding:  # the decode's error, unwrapped, once its text is out
                    yield piece
            if scope.cancelled_caught:
                self.timed_out = True
                self.cancel.set()
        if self.timed_out:
            try:
                decoding.result_nowait()  # an error of the decode wins over the timeout
            except WorkerCancelledError:  # timed out before the thread started
                pass
            raise RequestTimeout(f"the request ran past the server's {self.engine.config.request_timeout_s:g} s "
                                 "timeout; ask for fewer max_tokens or raise --request-timeout")

    def logprob_content(self, tokens: Sequence[SampledToken]) -> list[TokenLogprob]:
        """`tokens` as OpenAI's ``logprobs.content`` entries: each token's text, UTF-8 bytes and log-probability,
        with the step's likeliest tokens."""
        tokenizer = self.tokenizer
        assert tokenizer is not None, "the generation was made without its tokenizer"
        texts: dict[int, str] = {}

        def text(token_id: int) -> str:
            if token_id not in texts:
                decoded = tokenizer.decode([token_id])
                texts[token_id] = decoded if isinstance(decoded, str) else "".join(decoded)
            return texts[token_id]

        return [TokenLogprob(token=text(t.token_id), logprob=t.logprob, bytes=list(text(t.token_id).encode()),
                             top_logprobs=[TopLogprob(token=text(i), logprob=lp, bytes=list(text(i).encode()))
                                           for i, lp in t.top])
                for t in tokens]

    async def text(self) -> str:
        """The whole reply (non-streamed requests)."""
        return "".join([piece async for piece in self.stream()])

    @property
    def finish_reason(self) -> str:
        reason = self.result.finish_reason if self.result is not None else "length"
        return "length" if reason == "length" else "stop"

    def usage(self) -> Usage:
        prompt = len(self.prompt_ids)
        done = len(self.result.token_ids) if self.result is not None else self.completion_tokens
        return Usage(prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done,
                     prompt_tokens_details={"cached_tokens": self.cache_info.cached_tokens})


@dataclass(frozen=True)
class _Prepared:
    """A request resolved, rendered and checked, before it waits for a generation slot."""

    req: ChatCompletionRequest
    """The request as it is decoded (a tool request under its call-or-answer grammar)."""
    member: str
    ids: list[int]
    """The prompt's token ids."""
    max_tokens: int
    constraint: JsonConstraint | None
    started: float
    """When the request arrived (`time.perf_counter`)."""
    tokenizer: Tokenizer


def member_aliases(family: FamilyManifest) -> dict[str, str]:
    """Member name -> the model id it is served under: its role (``root``, ``finetuned``), or its name where
    several members share a role (the members of ``family init`` besides the root are all ``external``)."""
    roles = [record.role for record in family.members.values()]
    return {name: record.role if roles.count(record.role) == 1 else name for name, record in family.members.items()}


class ServeEngine:
    """Members by role (and name), one FamilyCache for all of them, admission control, metrics."""

    def __init__(self, config: ServeConfig | None = None, *, family: FamilyManifest | None = None,
                 cache: FamilyCache | None = None,
                 metrics: ServeMetrics | None = None) -> None:
        self.config = config or ServeConfig()
        if family is None:
            from orchestra.family.manifest import load_family

            family = load_family(self.config.home)
        self.family = family
        self._owns_cache = cache is None
        views = self._views(family)
        if cache is None:
            from pathlib import Path

            from orchestra.familycache.mapping_store import MappingStore
            from orchestra.models.registry import ModelRegistry

            aliases: dict[str, str | AdapterSpec | QuantizeSpec] = {
                alias: name for name, alias in member_aliases(family).items()}
            aliases.update(views)
            registry = ModelRegistry(aliases, family=family, default_device=self.config.device, dtype=self.config.dtype)
            registry.check_family(self.config.source)
            store = MappingStore(Path(family.home) / "mappings", on_missing=self.config.on_missing_mapping)
            # started here (Ray joined, actors placed, models loaded), so a server that answers /readyz can
            # serve, and a cluster that cannot place it fails the start
            executor = make_executor(self.config.executor.kind, registry, self.config.executor, name="serve",
                                     start=True)
            disk = None
            if self.config.kv_store is not None:
                from orchestra.familycache import KVStore

                disk = KVStore(self.config.kv_store, self.config.kv_store_mb << 20)
            cache = FamilyCache(executor, store, source=self.config.source,
                                policy=CachePolicy(budget_bytes=self.config.cache_budget_bytes(), gate=self.config.gate,
                                                   tail_tokens=self.config.tail_tokens, repair=self.config.repair),
                                disk=disk)
        self.cache = cache
        self.remote = not cache.executor.in_process
        """Models live elsewhere (Ray actors): replies are decoded there, tokens streamed back."""
        self.metrics = metrics or ServeMetrics()
        self._names = member_aliases(family)
        """Member name -> the id it is served under (its role; its name where members share a role)."""
        self._views_served = {name: spec for name, spec in views.items() if name in set(cache.executor.members)}
        """Served adapters and quantized views, by model id (members of their own over a family member)."""
        self._names.update({name: name for name in self._views_served})
        self._roles = set(self._names.values())
        self.metrics.bind_cache(cache, members=sorted(self._roles))
        self._batchers: dict[str, BatchDecoder] = {}
        self._batch_lock = threading.Lock()
        self._mean_s = 1.0
        self._runs: RunManager | None = None
        """Moving average of the seconds a generation holds its slot (the 429's Retry-After is from it)."""
        self._slots = anyio.Semaphore(self.config.max_concurrent)
        self._waiting = 0
        self._running = 0
        self._created = int(time.time())

    def _views(self, family: FamilyManifest) -> dict[str, AdapterSpec | QuantizeSpec]:
        """The configured adapters and views, their bases named by served id; a clash or unknown base refused."""
        from dataclasses import replace

        from orchestra.errors import ModelReferenceError

        served = member_aliases(family)
        ids = set(served.values())
        views = {}
        for name, spec in self.config.views().items():
            if name in ids or name in served:
                raise ModelReferenceError(f"{name!r} is already a member's id or name: serve the adapter or view "
                                          "under another name")
            base = served.get(spec.base, spec.base)
            if base not in ids:
                raise ModelReferenceError(f"{name!r} is over {spec.base!r}, which is no member of the family: "
                                          f"name one of {', '.join(sorted(ids))}")
            views[name] = replace(spec, base=base)
        return views

    # -- models ---------------------------------------------------------------------------------
    def resolve(self, model: str) -> str:
        """The member alias (its role) for a model id given by role or by name."""
        if model in self._roles:
            return model
        if model in self._names:
            return self._names[model]
        raise ModelNotFound(f"the model {model!r} does not exist; this server has "
                            + ", ".join(sorted(self._roles)) + " (GET /v1/models lists them)", param="model")

    def model_cards(self) -> list[ModelCard]:
        cards = []
        for name, record in self.family.members.items():
            alias = self._names[name]
            parent = self._names.get(record.parent) if record.parent else None
            cards.append(ModelCard(
                id=alias, created=self._created, name=name, role=record.role,
                parent=parent if parent is not None else record.parent,
                divergence=record.divergence.model_dump() if record.divergence else None,
                max_context=self.cache.info(alias).max_positions or None,
            ))
        from orchestra.models.modelref import AdapterSpec

        for name, spec in self._views_served.items():
            role = "adapter" if isinstance(spec, AdapterSpec) else "quantized"
            cards.append(ModelCard(id=name, created=self._created, name=name, role=role, parent=spec.base,
                                   divergence=None, max_context=self.cache.info(name).max_positions or None))
        return cards

    def ready(self) -> bool:
        return True

    # -- requests -------------------------------------------------------------------------------
    def _max_tokens(self, req: ChatCompletionRequest) -> int:
        asked = req.max_completion_tokens or req.max_tokens
        if asked is not None and asked > self.config.max_tokens_limit:
            param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
            raise BadRequest(f"{param} is {asked}; this server allows at most {self.config.max_tokens_limit}",
                             param=param)
        return asked or self.config.default_max_tokens

    async def prompt_ids(self, member: str, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True,
                         response_format: ResponseFormat | None = None) -> list[int]:
        tokenizer = await in_thread(self.cache.executor.tokenizer, member)
        return await in_thread(functools.partial(render_messages, tokenizer, messages,
                                                 add_generation_prompt=add_generation_prompt,
                                                 response_format=response_format))

    @asynccontextmanager
    async def open(self, req: ChatCompletionRequest) -> AsyncIterator[Generation]:
        """Admit `req` (429 when the queue is full), get its prompt's cache, and hand out its Generation."""
        request = await self._prepared(req, started=time.perf_counter())
        await self._admit(request.member)
        lease: CacheLease | None = None
        try:
            # concurrent requests over one document build it once: a request finding a longer prefix of its
            # prompt in flight (on its member, or on one that maps into it) waits for it, then extends or maps it
            with anyio.fail_after(self.config.request_timeout_s):
                lease = await self.cache.acquire(request.member, request.ids[:-1], on_step=self.metrics.on_step,
                                                 inline_tail=self.config.inline_tail_tokens)
            gen = self._generation(request, lease)
            try:
                yield gen
            finally:
                await self._finish(request, gen)
        except TimeoutError as exc:
            raise RequestTimeout(f"the prompt's cache was not ready within the server's "
                                 f"{self.config.request_timeout_s:g} s timeout") from exc
        finally:
            self._leave(request.member, lease)

    async def _prepared(self, req: ChatCompletionRequest, *, started: float) -> _Prepared:
        """`req` resolved to its member, its prompt rendered and checked against the context, its JSON constraint
        compiled: everything that can refuse it before it waits for a slot."""
        member = self.resolve(req.model)
        from orchestra.serve._tools import has_tool_turns, prepare_tool_request

        if req.tool_mode() or has_tool_turns(req):  # a call or an answer under a grammar; tool turns as plain turns
            req = prepare_tool_request(req)
        max_tokens = self._max_tokens(req)
        tokenizer = await in_thread(self.cache.executor.tokenizer, member)
        ids = await in_thread(functools.partial(render_messages, tokenizer, req.messages,
                                                response_format=req.response_format))
        limit = self.cache.info(member).max_positions
        if limit and len(ids) + max_tokens > limit:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {limit} tokens; the messages are {len(ids)} tokens and "
                f"{max_tokens} completion tokens were asked for: shorten the messages or lower max_tokens",
                param="messages")
        if req.logit_bias:
            vocab = await in_thread(self._vocab_size, member)
            beyond = sorted((t for t in req.logit_bias if int(t) >= vocab), key=int)
            if beyond:
                raise BadRequest(f"logit_bias names token ids this model does not have ({', '.join(beyond[:5])}"
                                 f"{', ...' if len(beyond) > 5 else ''}); its ids are 0 to {vocab - 1}",
                                 param="logit_bias")
        constraint = await in_thread(self._json_constraint, member, req)
        return _Prepared(req=req, member=member, ids=ids, max_tokens=max_tokens, constraint=constraint,
                         started=started, tokenizer=tokenizer)

    async def _admit(self, member: str) -> None:
        """Wait for a generation slot (counted as waiting, then running); RateLimited when the queue is full."""
        if self._slots.value == 0 and self._waiting >= self.config.max_queue:
            self.metrics.rejected.inc()
            wait = math.ceil(self._mean_s * (self._waiting + 1) / self.config.max_concurrent)
            raise RateLimited(f"the server is busy: {self.config.max_concurrent} generations running and "
                              f"{self._waiting} waiting; retry in {wait} s", retry_after=min(wait, 600))
        self._waiting += 1
        self.metrics.queued.inc()
        self.metrics.vllm_waiting.labels(model_name=member).inc()
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
            self.metrics.queued.dec()
            self.metrics.vllm_waiting.labels(model_name=member).dec()
        self.metrics.running.inc()
        self.metrics.vllm_running.labels(model_name=member).inc()
        self._running += 1

    def _generation(self, request: _Prepared, lease: CacheLease) -> Generation:
        """The admitted request's Generation over its lease (its cache use counted in the metrics)."""
        member, ids = request.member, request.ids
        info = _cache_info(lease)
        self.metrics.on_cache(member, info.path, info.cached_tokens,
                              self.cache.prefill_estimate(member, info.cached_tokens), prompt_tokens=len(ids))
        return Generation(id=f"chatcmpl-{uuid.uuid4().hex[:24]}", created=int(time.time()), model=request.req.model,
                          member=member, prompt_ids=ids, lease=lease, cache_info=info, leased_tokens=lease.tokens,
                          max_tokens=request.max_tokens, request=request.req, engine=self, started=request.started,
                          constraint=request.constraint, tokenizer=request.tokenizer)

    async def _finish(self, request: _Prepared, gen: Generation) -> None:
        """Stop `gen`'s decoding (shielded: also when the request is cancelled), then count and log it."""
        with anyio.CancelScope(shield=True):
            await gen.stop()
        started, info = request.started, gen.cache_info
        # counted however it ended (done, cancelled, timed out, failed): its tokens were spent
        self.metrics.on_done(gen)
        self._mean_s += 0.2 * (time.perf_counter() - started - self._mean_s)  # what a slot is held for
        log.info("completion", id=gen.id, model=request.member, cache=info.path, cached_tokens=info.cached_tokens,
                 prompt_tokens=len(request.ids), completion_tokens=gen.usage().completion_tokens,
                 finish=gen.result.finish_reason if gen.result else None, timed_out=gen.timed_out,
                 seconds=round(time.perf_counter() - started, 3), **gen.placement)

    def _leave(self, member: str, lease: CacheLease | None) -> None:
        """Close the request's lease (if it got one) and free its slot; an idle server gives memory back."""
        if lease is not None:
            # the Generation can outlive the request (the response object refers to it): it must not keep
            # K/V alive that the budget stopped counting when the entry was unpinned and evicted
            lease.close()
        self.metrics.running.dec()
        self.metrics.vllm_running.labels(model_name=member).dec()
        self._slots.release()
        self._running -= 1
        if self._running == 0:  # idle: what the requests freed goes back to the OS
            release_memory()

    def _decode(self, gen: Generation, on_token) -> Continuation:
        """Decode `gen`'s reply (in a worker thread) over its lease: batched with the member's other requests,
        or alone, holding the member's lock per step either way; in the member's actor under the ray executor."""
        from orchestra.serve._decode import decode
        from orchestra.serve._sampling import sampling_settings

        settings = sampling_settings(gen.request, gen.max_tokens, gen.prompt_ids)
        prefix_len, new = gen.leased_tokens, gen.prompt_ids[gen.leased_tokens:]
        if self.remote:
            return self._decode_remote(gen, on_token, prefix_len, new, settings)
        loaded = self.cache.executor.model(gen.member)
        lock = self.cache.lock(gen.member)

        def batcher() -> BatchDecoder:
            from orchestra.serve._batch import BatchDecoder

            with self._batch_lock:
                found = self._batchers.get(gen.member)
                if found is None:
                    # rows and cached entries share the cache budget: a burst cannot hold more K/V than it
                    found = self._batchers[gen.member] = BatchDecoder(loaded, lock, max_batch=self.config.max_batch,
                                                                      memory=self.cache.pool)
                return found

        return decode(loaded, lock, gen.lease.local_cache(), prefix_len, new, settings, gen.cancel, on_token=on_token,
                      constraint=gen.constraint, batcher=batcher if self.config.batch_decode else None)

    def _decode_remote(self, gen: Generation, on_token, prefix_len: int, new: list[int],
                       settings: Mapping[str, object]) -> Continuation:
        """The reply decoded in the member's actor (the lease's cache is an ObjectRef there), tokens streamed here."""
        from orchestra.errors import ActorLostError, ExecutorError
        from orchestra.serve._decode import remote_decode_op

        try:
            return self.cache.executor.stream(
                gen.member, remote_decode_op, gen.lease.cache, prefix_len, new, settings, gen.request.response_format,
                self.config.batch_decode, self.config.max_batch, on_item=lambda item: on_token(*item),
                cancel=gen.cancel, placement=gen.placement)
        except ActorLostError as exc:
            raise ExecutorFailed(str(exc), code="actor_lost") from exc
        except ExecutorError as exc:
            raise ExecutorFailed(str(exc)) from exc

    def _json_constraint(self, member: str, req: ChatCompletionRequest) -> JsonConstraint | None:
        """The request's JSON constraint, or None for text; a schema xgrammar cannot compile is the client's 400.

        Under the ray executor the schema is only checked here (so a bad one is refused before admission);
        the constraint that steers decoding is compiled in the member's actor, beside the model.
        """
        from orchestra.serve._decode import json_constraint

        if self.remote:
            json_constraint(self.cache.executor.tokenizer(member), self._vocab_size(member), req.response_format)
            return None
        loaded = self.cache.executor.model(member)
        return json_constraint(loaded.tokenizer, self._vocab_size(member), req.response_format)

    def _vocab_size(self, member: str) -> int:
        """The member's logits width (it may pad the tokenizer's vocabulary)."""
        from orchestra.serve._decode import vocab_size

        if self.remote:
            config = self.cache.info(member).config
            text = config.get("text_config") or config
            return int(text.get("vocab_size") or len(self.cache.executor.tokenizer(member)))
        return vocab_size(self.cache.executor.model(member).model)

    @property
    def runs(self) -> RunManager:
        """The pipeline runs of ``/v1/runs`` (on this engine's FamilyCache)."""
        if self._runs is None:
            from orchestra.observability.metrics import PipelineMetrics
            from orchestra.serve._runs import RunManager

            self._runs = RunManager(self, pipelines_dir=self.config.pipelines_dir, max_running=self.config.max_runs,
                                    metrics=PipelineMetrics(self.metrics.registry), code=self.config.code_policy())
        return self._runs

    def close(self) -> None:
        """Stop the decoding threads (in-flight replies finish first); release an executor this engine made
        (a ray executor's actors and placement group). Idempotent."""
        if self._runs is not None:
            self._runs.close()
        for batcher in self._batchers.values():
            batcher.close()
        self.cache.flush(60.0)  # caches built before the shutdown are there after the restart
        if self._owns_cache:
            self.cache.executor.close()

    async def prefill(self, model: str,
                      messages: Sequence[ChatMessage | Mapping[str, object]]) -> tuple[str, int, CacheLease]:
        """Warm the cache with the rendered `messages` (no generation prompt): later requests starting so reuse it."""
        member = self.resolve(model)
        validated = [m if isinstance(m, ChatMessage) else ChatMessage.model_validate(m) for m in messages]
        ids = await self.prompt_ids(member, validated, add_generation_prompt=False)
        limit = self.cache.info(member).max_positions
        if limit and len(ids) > limit:
            raise ContextLengthExceeded(f"the messages are {len(ids)} tokens; {model!r} takes at most {limit}",
                                        param="messages")
        lease = await self.cache.acquire(member, ids, on_step=self.metrics.on_step)
        lease.release()
        self.metrics.on_lease(member, lease, self.cache.prefill_estimate(member, lease.reused_tokens))
        return member, len(ids), lease


def _cache_info(lease: CacheLease) -> CacheInfo:
    """What the headers say about the prompt's cache."""
    return CacheInfo(path=lease.path, source=lease.source, cached_tokens=lease.reused_tokens,
                     gates=lease.gate_dicts(), fallback_reason=lease.fallback_reason, seconds=lease.seconds)


_TRIMMING = threading.Lock()

MMAP_THRESHOLD = 1 << 20
"""Allocations from this size up get pages of their own from the OS (`tune_allocator`)."""


def tune_allocator(threshold: int = MMAP_THRESHOLD) -> bool:
    """Make glibc give a server's K/V memory back to the OS as soon as it is freed (process-wide; glibc only).

    glibc raises its mmap threshold each time a large block is freed (up to 32 MiB), after which K/V
    tensors (a layer of a 2k-token prompt is ~2 MiB) come from its arenas, and every request thread
    gets arenas of its own: freed copies stay resident, so under steady load (never idle, so
    `release_memory` never runs) RSS climbs far past what is live. A fixed threshold keeps such
    blocks mmapped, returned on free; smaller ones (per-step activations) still come from the arenas.
    `orchestra serve` calls this at start unless ``ORCHESTRA_MALLOC=default``. Returns whether it applied.
    """
    import os

    if os.environ.get("ORCHESTRA_MALLOC", "").strip().lower() == "default":
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_mmap_threshold, m_arena_max = -3, -8  # mallopt parameters (malloc.h)
        ok = bool(libc.mallopt(m_mmap_threshold, threshold))
        libc.mallopt(m_arena_max, max(2, (os.cpu_count() or 1)))
        return ok
    except (OSError, AttributeError):  # not glibc
        return False


def release_memory() -> None:
    """Return freed heap memory to the OS, in a thread of its own (glibc only; elsewhere nothing happens).

    A request's K/V copies are megabytes per layer: glibc serves them from its arenas and keeps them there
    once freed, so without this the server's RSS stays at its busiest level for good, however little the
    cache then holds. `malloc_trim` gives the free pages back (milliseconds, off the event loop).
    """
    if not _TRIMMING.acquire(blocking=False):
        return  # one is already running

    def trim() -> None:
        try:
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
        finally:
            _TRIMMING.release()

    start_thread(trim, name="malloc-trim")
