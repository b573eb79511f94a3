"""Run a pipeline: prefill the document once, fan its cache out to every target, run agents in DAG order.

Each agent starts as soon as its own upstreams are done (no supersteps: a slow sibling never holds
back a fast branch). Compute runs in worker threads; the event loop only coordinates.
"""

from __future__ import annotations

import contextlib
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import structlog

from orchestra import events as ev
from orchestra.errors import DocumentError, PipelineError
from orchestra.gates import CircuitBreaker, GateDecision, GatePolicy, decide_offline, decide_probe
from orchestra.graph import build_graph
from orchestra.kvstore import CacheKey, KVStore, token_hash
from orchestra.mapstore import MappingStore, mean_kl, tail_nll
from orchestra.pipeline import PipelineSpec
from orchestra.registry import LoadedModel, ModelRegistry
from orchestra.report import AgentReport, ModelCacheReport, RunReport

__all__ = ["Orchestra"]

log = structlog.get_logger("orchestra")
EventSink = Callable[[ev.Event], Awaitable[None] | None]


@dataclass
class _DocCache:
    """One model's document cache and what it cost."""

    alias: str
    path: str  # exact | mapped | reprefilled
    cache: Any
    seconds: float
    store_hit: bool
    tail_logits: Any = None  # logits of the trailing `tail` positions (probe / shadow)
    tail: int = 0
    mapping: Any = None
    probe: dict[str, float] = field(default_factory=dict)
    charged: bool = False  # whether some agent has been charged its seconds
    hidden: Any = None  # source only, when layer repair needs it: hidden states entering each layer
    repair: dict[str, Any] | None = None


@dataclass
class _Run:
    run_id: str
    started: float
    prefix_ids: list[int]
    token_hash: str
    emit: Callable[[ev.Event], Awaitable[None]]
    caches: dict[str, _DocCache] = field(default_factory=dict)
    exact: dict[str, _DocCache] = field(default_factory=dict)
    locks: dict[str, anyio.Lock] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)
    reports: dict[str, AgentReport] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    source_tail_nll: float | None = None

    def lock(self, name: str) -> anyio.Lock:
        return self.locks.setdefault(name, anyio.Lock())


class Orchestra:
    """A validated pipeline bound to a model registry, a KV store and a mapping store."""

    def __init__(
        self,
        pipeline: PipelineSpec,
        *,
        family: Any | None = None,
        store: KVStore | None = None,
        mappings: MappingStore | None = None,
        breaker: CircuitBreaker | None = None,
        share_prefill: bool = True,
    ) -> None:
        self.pipeline = pipeline
        self.graph = build_graph(pipeline.upstreams(), {a.name: a.model for a in pipeline.agents})
        self.specs = {a.name: a.agent_spec() for a in pipeline.agents}
        for agent in pipeline.agents:
            missing = [n for n in self.specs[agent.name].required_inputs() if n not in agent.upstream]
            if missing:
                raise PipelineError(
                    f"agent {agent.name!r}: its task template reads {', '.join(map(repr, missing))}, which "
                    f"{'is' if len(missing) == 1 else 'are'} not in its upstream list {agent.upstream}; add "
                    f"{'it' if len(missing) == 1 else 'them'} to `upstream`"
                )
        if family is None:
            family = _default_family()
        self.family = family
        self.registry = ModelRegistry(
            pipeline.models, family=family, devices=pipeline.devices, default_device=pipeline.default_device,
            dtype=pipeline.dtype,
        )
        self.source_alias = pipeline.source_alias
        used = {a.model for a in pipeline.agents} | {self.source_alias}
        for alias in used:
            self.registry.info(alias)  # missing models are refused here, before any weights load
        self.registry.check_family(self.source_alias)
        self.store = store if store is not None else KVStore(pipeline.store_budget_mb << 20)
        if mappings is None:
            directory = pipeline.mapping.directory or str(Path(family.home if family else ".") / "mappings")
            mappings = MappingStore(Path(directory), on_missing=pipeline.mapping.on_missing,
                                    method=pipeline.mapping.method, tokens=pipeline.mapping.tokens)
        self.mappings = mappings
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        self.share_prefill = share_prefill
        self._limiters: dict[str, anyio.CapacityLimiter] = {}
        self.last_report: RunReport | None = None

    # -- public API -----------------------------------------------------------------------------
    async def run(self, document: str, *, on_event: EventSink | None = None, run_id: str | None = None) -> RunReport:
        """Run every agent over `document`; returns the report (also kept as `last_report`)."""
        run_id = run_id or uuid.uuid4().hex[:12]

        async def emit(event: ev.Event) -> None:
            if event.kind != "token":  # tokens are in the stream; logging each would drown the log
                log.info(event.kind, **event.model_dump(exclude={"kind"}))
            if on_event is not None:
                result = on_event(event)
                if result is not None:
                    await result

        report = await self._run(document, run_id, emit)
        self.last_report = report
        return report

    async def stream(self, document: str) -> AsyncIterator[ev.Event]:
        """Yield typed events as they happen; the report is `last_report` once `RunFinished` arrived."""
        send, receive = anyio.create_memory_object_stream[ev.Event](max_buffer_size=math.inf)
        failure: list[BaseException] = []

        async def runner() -> None:
            async with send:
                try:
                    await self.run(document, on_event=send.send)
                except Exception as exc:  # re-raised to the consumer after the stream drains
                    failure.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(runner)
            async with receive:
                async for event in receive:
                    yield event
        if failure:
            raise failure[0]

    # -- the run --------------------------------------------------------------------------------
    async def _run(self, document: str, run_id: str, emit) -> RunReport:
        from agents import DocumentPrompt
        from agents.errors import EmptyDocumentError

        started = time.perf_counter()
        source = await anyio.to_thread.run_sync(self.registry.load, self.source_alias)
        try:
            prefix_ids = DocumentPrompt(document).token_ids(source.tokenizer)
        except EmptyDocumentError as exc:
            raise DocumentError(str(exc)) from exc
        self._check_length(prefix_ids)
        run = _Run(run_id, started, prefix_ids, token_hash(prefix_ids), emit)
        await emit(ev.RunStarted(run_id=run_id, agents=[a.name for a in self.pipeline.agents],
                                 source_model=self.source_alias, document_tokens=len(prefix_ids)))
        if self.share_prefill:
            await self._source_cache(run, source)

        done = {a.name: anyio.Event() for a in self.pipeline.agents}
        async with anyio.create_task_group() as tg:
            for agent in self.pipeline.agents:
                tg.start_soon(self._agent_task, run, agent.name, done)

        reports = [run.reports[a.name] for a in self.pipeline.agents]
        seconds = time.perf_counter() - started
        distinct = list({id(c): c for c in [*run.caches.values(), *run.exact.values()]}.values())
        spent = sum(c.seconds for c in distinct) if self.share_prefill else sum(r.prefill_s_spent for r in reports)
        await emit(ev.RunFinished(
            run_id=run_id, succeeded=[r.name for r in reports if r.status == "succeeded"],
            failed=[r.name for r in reports if r.status == "failed"],
            skipped=[r.name for r in reports if r.status == "skipped"], seconds=seconds,
        ))
        cache_reports = [
            ModelCacheReport(model=c.alias, path=c.path, seconds=c.seconds, store_hit=c.store_hit,
                             mapping=str(c.mapping.path) if c.mapping is not None and c.mapping.path else None,
                             tail_tokens=c.tail, repair=c.repair)
            for c in distinct
        ]
        stats = self.store.stats
        return RunReport(
            run_id=run_id, pipeline=self.pipeline.name, source_model=self.source_alias,
            document_tokens=len(prefix_ids), agents=reports, caches=cache_reports, seconds=seconds,
            prefill_s_spent=spent, prefill_s_saved=sum(r.prefill_s_saved for r in reports),
            store_hits=stats.hits, store_misses=stats.misses, store_hit_rate=stats.hit_rate, warnings=run.warnings,
        )

    def _check_length(self, prefix_ids: list[int]) -> None:
        for agent in self.pipeline.agents:
            info = self.registry.info(agent.model)
            need = len(prefix_ids) + self.specs[agent.name].generation.max_new_tokens + 1
            if info.max_positions and need > info.max_positions:
                raise DocumentError(
                    f"the document is {len(prefix_ids)} tokens; with agent {agent.name!r}'s "
                    f"{self.specs[agent.name].generation.max_new_tokens} new tokens it needs {need} positions but "
                    f"model {agent.model!r} takes at most {info.max_positions}: shorten the document by "
                    f"{need - info.max_positions} tokens or more"
                )

    def _tail_tokens(self) -> int:
        probes = [(a.gate or self.pipeline.gate).probe for a in self.pipeline.agents]
        return max([self.pipeline.mapping.tail_tokens] + [p.tokens for p in probes if p is not None] + [2])

    def _limiter(self, device: str) -> anyio.CapacityLimiter:
        if device not in self._limiters:
            self._limiters[device] = anyio.CapacityLimiter(self.pipeline.max_concurrency_per_device)
        return self._limiters[device]

    def _exact_key(self, model: LoadedModel, run: _Run) -> CacheKey:
        return CacheKey("exact", model.info.fingerprint, model.dtype, model.info.rope, run.token_hash)

    async def _prefill(self, run: _Run, model: LoadedModel, tail: int, hidden: bool = False) -> _DocCache:
        """A real prefill of the document on `model`, reusing the store's exact cache when present.

        ``hidden``: also keep the hidden states entering each layer (for layer repair), which a
        store hit does not have: the store is skipped then.
        """
        key = self._exact_key(model, run)
        hit = None if hidden else self.store.get(key, namespace="exact")
        if hit is not None:
            return _DocCache(model.info.alias, "exact", hit, 0.0, True, self.store.meta(key).get("tail_logits"), tail)

        def work():
            import torch

            from mappings import forward_with_cache

            ids = torch.tensor([run.prefix_ids], device=model.device)
            t0 = time.perf_counter()
            with torch.no_grad():
                logits, cache, out = forward_with_cache(model.model, ids, None, logits_to_keep=tail,
                                                        output_hidden_states=hidden)
            _sync(model.device)
            states = dict(enumerate(out.hidden_states[:-1])) if hidden else None
            return cache, logits[0].float(), time.perf_counter() - t0, states

        cache, logits, seconds, states = await anyio.to_thread.run_sync(work)
        self.store.put(key, cache, tail_logits=logits, seconds=seconds)
        doc = _DocCache(model.info.alias, "exact", cache, seconds, False, logits, tail)
        doc.hidden = states
        return doc

    async def _source_cache(self, run: _Run, source: LoadedModel) -> _DocCache:
        async with run.lock(self.source_alias):
            if self.source_alias not in run.caches:
                repair = self.pipeline.mapping.repair
                layers = repair is not None and repair.budget > 0 and (repair.layer_share > 0 or bool(repair.blocks))
                cache = await self._prefill(run, source, self._tail_tokens(), hidden=layers)
                run.caches[self.source_alias] = cache
                run.exact[self.source_alias] = cache
                if cache.tail_logits is not None:
                    import torch

                    tail_ids = torch.tensor(run.prefix_ids[-cache.tail:])
                    run.source_tail_nll = tail_nll(cache.tail_logits, tail_ids)
                await run.emit(ev.DocumentPrefilled(run_id=run.run_id, model=self.source_alias,
                                                    tokens=len(run.prefix_ids), seconds=cache.seconds,
                                                    store_hit=cache.store_hit))
        return run.caches[self.source_alias]

    async def _exact_cache(self, run: _Run, target: LoadedModel) -> _DocCache:
        alias = target.info.alias
        async with run.lock(f"exact:{alias}"):
            if alias not in run.exact:
                cache = await self._prefill(run, target, self._tail_tokens())
                if not cache.store_hit:
                    cache.path = "reprefilled"
                run.exact[alias] = cache
                await run.emit(ev.CacheReady(run_id=run.run_id, model=alias, path=cache.path,
                                             seconds=cache.seconds, store_hit=cache.store_hit))
        return run.exact[alias]

    async def _mapped_cache(self, run: _Run, source: LoadedModel, target: LoadedModel) -> _DocCache:
        alias = target.info.alias
        async with run.lock(f"mapped:{alias}"):
            if alias in run.caches:
                return run.caches[alias]
            src = await self._source_cache(run, source)
            tail = self._tail_tokens()

            def get_mapping():
                return self.mappings.get(source, target, log=run.warnings.append)

            mapping, _calibrated = await anyio.to_thread.run_sync(get_mapping)
            key = CacheKey("mapped", target.info.fingerprint, target.dtype, target.info.rope, run.token_hash,
                           source_fingerprint=source.info.fingerprint, mapping_id=mapping.manifest.tensors.sha256,
                           mapping_version=mapping.manifest.mapping_version, variant=self._variant(tail))
            hit = self.store.get(key, namespace="mapped")
            if hit is not None:
                meta = self.store.meta(key)
                cache = _DocCache(alias, "mapped", hit, 0.0, True, meta.get("tail_logits"), tail, mapping)
                cache.repair = meta.get("repair")
            else:
                def work():
                    import torch

                    from mappings import map_cache, tail_recompute

                    ids = torch.tensor([run.prefix_ids], device=target.device)
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        mapped = map_cache(mapping.kv_map, src.cache, target.model)
                        plan = self._repair(mapped, ids, source, target, src, mapping, run)
                        if plan is not None:
                            mapped, plan = plan
                        logits, full = tail_recompute(target.model, mapped, ids, tail)
                    _sync(target.device)
                    return full, logits[0].float(), time.perf_counter() - t0, plan

                full, logits, seconds, plan = await anyio.to_thread.run_sync(work)
                self.store.put(key, full, tail_logits=logits, repair=plan)
                cache = _DocCache(alias, "mapped", full, seconds, False, logits, tail, mapping)
                cache.repair = plan
            if cache.tail_logits is not None and run.source_tail_nll is not None:
                import torch

                ref = await anyio.to_thread.run_sync(
                    lambda: self.mappings.probe_reference(source, target, mapping, tail))
                probe_nll = tail_nll(cache.tail_logits, torch.tensor(run.prefix_ids[-tail:]))
                cache.probe = {"probe_nll": probe_nll, "reference_nll": run.source_tail_nll + ref.offset_nll,
                               "probe_source_kl": mean_kl(src.tail_logits, cache.tail_logits),
                               "reference_source_kl": ref.source_kl,
                               "calibrated_mapped_excess": ref.mapped_excess_nll}
            run.caches[alias] = cache
            await run.emit(ev.CacheReady(run_id=run.run_id, model=alias, path="mapped", seconds=cache.seconds,
                                         store_hit=cache.store_hit, repair=cache.repair))
            return cache

    def _variant(self, tail: int) -> str:
        repair = self.pipeline.mapping.repair
        if repair is None or repair.budget == 0:
            return f"tail={tail}"
        return f"tail={tail};{repair.model_dump_json()}"

    def _repair(self, mapped: Any, ids: Any, source: LoadedModel, target: LoadedModel, src: _DocCache,
                mapping: Any, run: _Run) -> tuple[Any, dict[str, Any]] | None:
        """Apply the pipeline's repair policy to a freshly mapped cache (worker thread)."""
        from mappings import build_cache, cache_layers
        from mappings.repair import repair_cache
        from mappings.residual import layer_scores

        policy = self.pipeline.mapping.repair
        if policy is None or policy.budget == 0:
            return None
        wants_layers = policy.layer_share > 0 or bool(policy.blocks)
        if wants_layers and (src.hidden is None or mapping.residual is None):
            why = ("the mapping has no residual maps (run `orchestra calibrate-repair`)" if mapping.residual is None
                   else "the source cache came from the store without hidden states")
            run.warnings.append(f"{target.info.alias}: layer repair skipped, {why}; repairing tokens only")
            policy = policy.model_copy(update={"layer_share": 0.0, "blocks": None})
        res = repair_cache(target.model, list(cache_layers(mapped)), ids, policy,
                           layer_scores=layer_scores(mapping.manifest), residual=mapping.residual,
                           source_hidden=src.hidden, source=source.model, source_layers=list(cache_layers(src.cache)))
        return build_cache(res.layers, target.model.config), res.summary()

    async def _cache_for(self, run: _Run, name: str, report: AgentReport) -> _DocCache:
        """The document cache this agent runs on, after the gates (re-prefilling on failure)."""
        agent = self.pipeline.agent(name)
        target = await anyio.to_thread.run_sync(self.registry.load, agent.model)
        if not self.share_prefill:
            return await self._private_prefill(run, target)
        source = await anyio.to_thread.run_sync(self.registry.load, self.source_alias)
        if agent.model == self.source_alias or target.info.fingerprint == source.info.fingerprint:
            return await self._source_cache(run, source)
        exact_key = self._exact_key(target, run)
        if agent.model in run.exact or exact_key in self.store:
            return await self._exact_cache(run, target)
        policy: GatePolicy = agent.gate or self.pipeline.gate
        pair = (source.info.fingerprint, target.info.fingerprint)
        if policy.force_reprefill:
            return await self._fallback(run, name, target, "the agent's gate policy forces re-prefill", report)
        if self.breaker.is_open(pair):
            return await self._fallback(run, name, target, "circuit breaker open for this pair after shadow failures",
                                        report)
        cache = await self._mapped_cache(run, source, target)
        decisions: list[GateDecision] = []
        if policy.offline is not None:
            heldout = cache.mapping.manifest.heldout
            decisions.append(decide_offline(policy.offline, heldout.get("kl"), heldout.get("top1")))
        if policy.probe is not None:
            if not cache.probe:
                decisions.append(GateDecision(False, "probe", "no probe measurement (document shorter than the probe)"))
            else:
                decisions.append(decide_probe(policy.probe, cache.probe["probe_nll"], cache.probe["reference_nll"],
                                              cache.probe["probe_source_kl"], cache.probe["reference_source_kl"]))
        if policy.shadow is not None and self.breaker.should_shadow(policy.shadow):
            exact = await self._exact_cache(run, target)
            kl = mean_kl(exact.tail_logits, cache.tail_logits)
            passed = kl <= policy.shadow.max_kl
            opened = self.breaker.record(pair, passed, policy.shadow)
            decisions.append(GateDecision(
                passed, "shadow", f"shadow KL {kl:.4f} {'<=' if passed else '>'} {policy.shadow.max_kl}"
                + ("; breaker opened" if opened else ""), {"shadow_kl": kl, **self.breaker.stats(pair)}))
        for decision in decisions:
            report.gate.append({"gate": decision.gate, "passed": decision.passed, "reason": decision.reason,
                                "metrics": decision.metrics})
            await run.emit(ev.GateResult(run_id=run.run_id, agent=name, model=agent.model, passed=decision.passed,
                                         reason=f"{decision.gate}: {decision.reason}", metrics=decision.metrics))
        failed = [d for d in decisions if not d.passed]
        if failed:
            return await self._fallback(run, name, target, f"{failed[0].gate} gate failed: {failed[0].reason}", report)
        return cache

    async def _fallback(self, run: _Run, name: str, target: LoadedModel, reason: str, report: AgentReport) -> _DocCache:
        report.fallback_reason = reason
        await run.emit(ev.Fallback(run_id=run.run_id, agent=name, model=target.info.alias, reason=reason))
        return await self._exact_cache(run, target)

    async def _private_prefill(self, run: _Run, target: LoadedModel) -> _DocCache:
        """Baseline mode: every agent prefills the document itself (no sharing, no store)."""

        def work():
            import torch

            from mappings import forward_with_cache

            ids = torch.tensor([run.prefix_ids], device=target.device)
            t0 = time.perf_counter()
            with torch.no_grad():
                _, cache, _ = forward_with_cache(target.model, ids, None, logits_to_keep=1)
            _sync(target.device)
            return cache, time.perf_counter() - t0

        cache, seconds = await anyio.to_thread.run_sync(work)
        return _DocCache(target.info.alias, "reprefilled", cache, seconds, False)

    async def _agent_task(self, run: _Run, name: str, done: dict[str, anyio.Event]) -> None:
        from agents import run_agent

        agent = self.pipeline.agent(name)
        report = AgentReport(name=name, model=agent.model, status="failed")
        run.reports[name] = report
        try:
            for up in agent.upstream:
                await done[up].wait()
            bad = [up for up in agent.upstream if run.reports[up].status != "succeeded"]
            if bad:
                report.status = "skipped"
                report.skip_reason = f"upstream {', '.join(bad)} did not succeed"
                await run.emit(ev.AgentSkipped(run_id=run.run_id, agent=name, reason=report.skip_reason))
                return
            await run.emit(ev.AgentStarted(run_id=run.run_id, agent=name, model=agent.model))
            first_token: list[float] = []

            async def on_token(token) -> None:
                if not first_token:
                    first_token.append(time.perf_counter())
                await run.emit(ev.TokenEvent(run_id=run.run_id, agent=name, text=token.text, index=token.index))

            scope = anyio.fail_after(agent.timeout_s) if agent.timeout_s else contextlib.nullcontext()
            with scope:
                cache = await self._cache_for(run, name, report)
                report.cache_path = cache.path  # type: ignore[assignment]
                if not cache.charged or not self.share_prefill:
                    report.prefill_s_spent = cache.seconds if cache.path != "mapped" else 0.0
                    cache.charged = True
                target = self.registry.load(agent.model)
                result = await run_agent(
                    target.model, target.tokenizer, self.specs[name], prefix_ids=run.prefix_ids,
                    prefix_cache=cache.cache, upstream={up: run.outputs[up] for up in agent.upstream},
                    on_token=on_token, limiter=self._limiter(target.device),
                )
            run.outputs[name] = result.downstream_text()
            report.status = "succeeded"
            report.output = result.text
            report.parsed = _jsonable(result.parsed)
            report.tokens = result.generated_tokens
            report.suffix_tokens = result.suffix_tokens
            report.generation_s = result.timings.generation_s
            report.ttft_s = (first_token[0] - run.started) if first_token else None
            report.prefill_s_saved = max(0.0, self._full_prefill_estimate(run, target) - report.prefill_s_spent) \
                if self.share_prefill else 0.0
            await run.emit(ev.AgentFinished(run_id=run.run_id, agent=name, output=result.text,
                                            parsed=report.parsed))
        except Exception as exc:
            report.status = "failed"
            report.error_type = type(exc).__name__
            report.error = str(exc) or (f"timed out after {agent.timeout_s}s" if isinstance(exc, TimeoutError) else "")
            await run.emit(ev.AgentFailed(run_id=run.run_id, agent=name, error_type=report.error_type,
                                          error=report.error))
        finally:
            done[name].set()

    def _full_prefill_estimate(self, run: _Run, target: LoadedModel) -> float:
        """Seconds a real prefill of the document on `target` takes: measured if one ran, else scaled from the source."""
        exact = run.exact.get(target.info.alias)
        if exact is not None and not exact.store_hit and exact.seconds > 0:
            return exact.seconds
        src = run.exact.get(self.source_alias)
        if src is None or src.seconds <= 0:
            return 0.0
        source_info = self.registry.info(self.source_alias)
        return src.seconds * target.info.weight_bytes / max(1, source_info.weight_bytes)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    return value


def _default_family():
    from orchestra.family import load_family

    try:
        return load_family()
    except Exception:
        return None
