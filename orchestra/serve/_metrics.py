"""Prometheus metrics of the server, on a registry of its own (several apps in one process never clash).

Every series about a member labels it ``model_name`` (its role), as vLLM's series and the pipeline series
(`orchestra.observability.metrics`) do, so one dashboard variable filters them all.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from orchestra.familycache import CacheLease, CacheStep, FamilyCache
    from orchestra.serve._schemas import Usage

__all__ = ["ServeMetrics"]


class _Finished(Protocol):
    """What the metrics read of a finished generation (`orchestra.serve._engine.Generation`)."""

    @property
    def member(self) -> str: ...

    @property
    def ttft_s(self) -> float | None: ...

    @property
    def started(self) -> float: ...

    @property
    def token_gaps(self) -> Sequence[float]: ...

    def usage(self) -> Usage: ...


class ServeMetrics:
    """Requests, tokens, cache paths, gate failures, evictions, bytes held, prefill seconds saved, TTFT."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("orchestra_requests", "HTTP requests answered", ["route", "status"], registry=r)
        self.tokens = Counter("orchestra_tokens", "Tokens in (prompt) and out (completion)",
                              ["direction", "model_name"], registry=r)
        self.cached_tokens = Counter("orchestra_cached_prompt_tokens", "Prompt tokens served from the cache",
                                     ["model_name"], registry=r)
        self.lookups = Counter("orchestra_cache_lookups", "Caches obtained, by path (exact, mapped, reprefilled)",
                               ["path", "model_name"], registry=r)
        self.gate_failures = Counter("orchestra_gate_failures", "Gate decisions that refused a mapped cache", ["gate"],
                                     registry=r)
        self.evictions = Counter("orchestra_cache_evictions", "Cache entries evicted for the byte budget", registry=r)
        self.saved = Counter("orchestra_prefill_seconds_saved", "Estimated prefill seconds not spent thanks to reuse",
                             registry=r)
        self.ttft = Histogram("orchestra_ttft_seconds", "Time to first token", ["model_name"], registry=r,
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128))
        self.queued = Gauge("orchestra_queued_requests", "Requests waiting for a generation slot", registry=r)
        self.running = Gauge("orchestra_running_generations", "Generations running", registry=r)
        self.rejected = Counter("orchestra_rejected_requests", "Requests refused because the queue was full",
                                registry=r)
        self.cache_bytes = Gauge("orchestra_cache_bytes", "Bytes held by the family-wide cache", registry=r)
        self.cache_budget = Gauge("orchestra_cache_budget_bytes", "Byte budget of the family-wide cache", registry=r)
        self.disk_loads = Counter("orchestra_kv_disk_loads", "Caches read from the disk tier instead of computed",
                                  ["kind"], registry=r)
        self.disk_load_seconds = Counter("orchestra_kv_disk_load_seconds", "Seconds spent reading caches from the "
                                         "disk tier", registry=r)
        self.disk_bytes = Gauge("orchestra_kv_disk_bytes", "Bytes the disk tier holds (all processes)", registry=r)
        self.disk_writes = Gauge("orchestra_kv_disk_writes", "Caches this process wrote to the disk tier", registry=r)
        # the series vLLM exports, under its names and `model_name` label, so dashboards made for vLLM work here
        latency = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", ["model_name"],
                                   registry=r, buckets=latency)
        self.vllm_e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to last token",
                                  ["model_name"], registry=r, buckets=latency)
        per_token = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5, 10)
        self.vllm_itl = Histogram("vllm:inter_token_latency_seconds", "Seconds between consecutive output tokens "
                                  "(one observation per token after the first)", ["model_name"], registry=r,
                                  buckets=per_token)
        self.vllm_tpot = Histogram("vllm:request_time_per_output_token_seconds", "A request's mean seconds per "
                                   "output token after the first", ["model_name"], registry=r, buckets=per_token)
        self.vllm_prompt = Counter("vllm:prompt_tokens", "Prompt tokens", ["model_name"], registry=r)
        self.vllm_generation = Counter("vllm:generation_tokens", "Generated tokens", ["model_name"], registry=r)
        self.vllm_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                    ["model_name"], registry=r)
        self.vllm_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (exact or "
                                 "mapped from another member)", ["model_name"], registry=r)
        self.vllm_running = Gauge("vllm:num_requests_running", "Requests generating", ["model_name"], registry=r)
        self.vllm_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for a slot", ["model_name"],
                                  registry=r)
        self.vllm_kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent: the share of "
                                   "the family-wide cache budget held by requests (leased entries, decoding rows, "
                                   "builds); the same for every member, which share it", ["model_name"], registry=r)
        self.decode_bytes = Gauge("orchestra_decode_reserved_bytes",
                                  "Bytes of the cache budget held by decoding rows (their K/V)", registry=r)
        self.outside_bytes = Gauge("orchestra_cache_outside_bytes", "Bytes of cache entries in use that the budget "
                                   "had no room to store (held by requests until they end)", registry=r)

    def bind_cache(self, cache: FamilyCache, members: Iterable[str] = ()) -> None:
        """Read the cache's bytes at each scrape; `members` (roles) get the KV-usage gauge."""
        self.cache_bytes.set_function(lambda: float(cache.used_bytes))
        pool = cache.pool

        def usage() -> float:  # what requests hold, as vLLM counts blocks in use (cached, unreferenced ones are free)
            held = pool.pinned_bytes + pool.reserved_bytes + pool.outside_bytes
            return min(1.0, held / pool.budget_bytes) if pool.budget_bytes > 0 else 0.0

        for member in members:
            self.vllm_kv_usage.labels(model_name=member).set_function(usage)
        self.cache_budget.set(cache.pool.budget_bytes)
        self.decode_bytes.set_function(lambda: float(cache.pool.reserved_bytes))
        self.outside_bytes.set_function(lambda: float(cache.pool.outside_bytes))
        disk = cache.disk
        if disk is not None:
            self.disk_bytes.set_function(lambda: float(disk.used_bytes))
            self.disk_writes.set_function(lambda: float(disk.stats.writes))

    def on_step(self, step: CacheStep) -> None:
        if step.step in ("gate", "shadow") and step.passed is False:
            self.gate_failures.labels(gate=(step.reason or "?").split(":", 1)[0]).inc()
        elif step.step == "evict":
            self.evictions.inc()
        elif step.step == "load" and step.tokens:
            self.disk_loads.labels(kind=step.entry_kind or "exact").inc()
            self.disk_load_seconds.inc(step.seconds)

    def on_lease(self, model: str, lease: CacheLease, saved_seconds: float) -> None:
        self.on_cache(model, lease.path, lease.reused_tokens, saved_seconds)

    def on_cache(self, model: str, path: str, cached_tokens: int, saved_seconds: float,
                 prompt_tokens: int | None = None) -> None:
        self.lookups.labels(path=path, model_name=model).inc()
        self.cached_tokens.labels(model_name=model).inc(cached_tokens)
        self.vllm_hits.labels(model_name=model).inc(cached_tokens)
        if prompt_tokens is not None:
            self.vllm_queries.labels(model_name=model).inc(prompt_tokens)
        if saved_seconds > 0:
            self.saved.inc(saved_seconds)

    def on_done(self, gen: _Finished) -> None:
        import time

        usage = gen.usage()
        self.tokens.labels(direction="in", model_name=gen.member).inc(usage.prompt_tokens)
        self.tokens.labels(direction="out", model_name=gen.member).inc(usage.completion_tokens)
        self.vllm_prompt.labels(model_name=gen.member).inc(usage.prompt_tokens)
        self.vllm_generation.labels(model_name=gen.member).inc(usage.completion_tokens)
        e2e = time.perf_counter() - gen.started
        self.vllm_e2e.labels(model_name=gen.member).observe(e2e)
        if gen.ttft_s is not None:
            self.ttft.labels(model_name=gen.member).observe(gen.ttft_s)
            self.vllm_ttft.labels(model_name=gen.member).observe(gen.ttft_s)
            if usage.completion_tokens > 1:
                self.vllm_tpot.labels(model_name=gen.member).observe((e2e - gen.ttft_s) / (usage.completion_tokens - 1))
        itl = self.vllm_itl.labels(model_name=gen.member)
        for gap in gen.token_gaps:
            itl.observe(gap)
