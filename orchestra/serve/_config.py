"""Settings of `orchestra serve`: the family, devices, limits, auth and the cache budget."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mappings.repair import RepairPolicy
from orchestra.familycache import ExecutorSpec
from orchestra.familycache.gates import GatePolicy

if TYPE_CHECKING:
    from agents.references import CodePolicy
    from orchestra.models.modelref import AdapterSpec, QuantizeSpec

__all__ = ["ServeConfig"]


class ServeConfig(BaseModel):
    """Everything the server needs; each field is also a `orchestra serve` option."""

    model_config = ConfigDict(extra="forbid")

    home: Path | None = None
    """Family home (default: $ORCHESTRA_HOME or ~/.cache/orchestra)."""
    source: str = "root"
    """Member (role or name) whose mappings to the others are used first."""
    device: str = "auto"
    """'cpu', 'cuda:N' or 'auto' for every member."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Runtime dtype of every member; auto: bfloat16 on CUDA that supports it, float32 on CPU."""
    api_key_env: str | None = None
    """Name of the environment variable holding the Bearer key; unset: no authentication."""
    cache_mb: int = Field(2048, ge=1)
    """Memory the server may use beyond its models, MiB: the family-wide prefix cache (K/V, logits and hidden
    states all counted), the replies decoding and the caches being built, less `runtime_reserve_mb`."""
    runtime_reserve_mb: int = Field(128, ge=0)
    """Of `cache_mb`, MiB kept for the server's own working memory, which no cache entry or row accounts for
    (request and connection buffers, threads, allocator slack; at most a quarter of `cache_mb`).
    `benchmarks/serve_load.py` measures what it takes under 50 conversations: 87 MiB at the RSS peak."""
    max_concurrent: int = Field(8, ge=1)
    """Generations running at once; the rest wait in the queue."""
    max_queue: int = Field(64, ge=0)
    """Requests that may wait for a generation slot; beyond it: 429."""
    max_body_bytes: int = Field(4 << 20, ge=1024)
    """Largest request body; beyond it: 413."""
    request_timeout_s: float = Field(300.0, gt=0)
    """A request still generating after this many seconds is stopped (504, or an error event when streamed)."""
    default_max_tokens: int = Field(256, ge=1)
    """Completion tokens when a request gives no max_tokens."""
    max_tokens_limit: int = Field(4096, ge=1)
    """Largest max_tokens a request may ask for."""
    gate: GatePolicy = Field(default_factory=GatePolicy)
    """Gates a mapped cache must pass; a refused map is re-prefilled on the requested member."""
    repair: RepairPolicy | None = None
    """Map, then repair: target compute spent on a fresh map (a ladder climbs until the probe gate passes, so a
    map the gate would refuse is repaired instead of re-prefilled); None: pure map."""
    tail_tokens: int = Field(32, ge=2)
    """Trailing tokens recomputed on the target after a map (the probe gate reads their loss)."""
    batch_decode: bool = True
    """Decode the requests running on one member together: one batched forward pass per step."""
    max_batch: int = Field(8, ge=1)
    """Rows in one member's decoding batch; more requests wait for a row to finish."""
    inline_tail_tokens: int = Field(256, ge=0)
    """A prompt whose uncached rest (past what is cached or being built, e.g. the shared document) is at most this
    many tokens leases only the cached part and computes the rest while decoding, storing no entry of its own:
    concurrent conversations over one document then hold one copy of it. 0: every prompt is cached whole."""
    allow_code: list[str] = Field(default_factory=list)
    """Module prefixes whose Python an inline pipeline (``POST /v1/runs`` with ``spec``) may name in its steps,
    tools and output models, e.g. ``mycompany.checks``; empty (the default): none, only the built-in tools.
    Pipelines in `pipelines_dir` are the operator's own and may name any Python. docs/serving.md#security."""
    pipelines_dir: Path | None = None
    """A folder of pipeline files that ``POST /v1/runs`` runs by name (its stem); None: inline pipelines only."""
    max_runs: int = Field(4, ge=1)
    """Pipeline runs (``POST /v1/runs``) running at once; more get 429."""
    kv_store: Path | None = None
    """A folder for the disk tier: caches built are written there and read back after a restart (None: memory only)."""
    kv_store_mb: int = Field(8192, ge=1)
    """Bytes the disk tier may hold, MiB (least recently used go first)."""
    cors_origins: list[str] = Field(default_factory=list)
    """Browser origins allowed to call the API from their pages (CORS), e.g. ``https://app.example.com``; ``*``
    for any; empty: no CORS headers (same-origin pages, such as the web view at /ui, need none)."""
    adapters: dict[str, str] = Field(default_factory=dict)
    """peft LoRA adapters served as members of their own over the source: model id -> adapter folder or Hub id.
    Each shares the source's weights and reaches a document the family computed through a map."""
    quantized: dict[str, str] = Field(default_factory=dict)
    """Quantized views served as members of their own: model id -> ``BASE:SCHEME`` (``root:int8``), the member
    quantized by torchao at load time."""
    on_missing_mapping: Literal["refuse", "calibrate"] = "refuse"
    """A pair without a calibrated mapping is re-prefilled (refuse) or calibrated inside the request (minutes)."""
    executor: ExecutorSpec = Field(default_factory=ExecutorSpec)
    """Where the models run: ``local`` (this process) or ``ray`` (one actor per member and replica, the
    caches in Ray's object store, each reply decoded and batched in its member's actor); the same shape
    as a pipeline's ``executor:`` (``{kind: ray, address: auto, members: {finetuned: {num_gpus: 1}}}``)."""

    @field_validator("gate")
    @classmethod
    def _no_answer_gate(cls, value: GatePolicy) -> GatePolicy:
        if value.answer is not None:
            raise ValueError("the answer gate re-runs a pipeline agent on a re-prefill after comparing its answer "
                             "with the source's; a served request's reply is streamed as it is decoded: drop "
                             "'answer' from the server's gate (pipelines run by POST /v1/runs keep their own)")
        return value

    @field_validator("quantized")
    @classmethod
    def _views(cls, value: dict[str, str]) -> dict[str, str]:
        for name, view in value.items():
            base, sep, scheme = view.partition(":")
            if not sep or not base or not scheme:
                raise ValueError(f"quantized view {name!r} is {view!r}: write BASE:SCHEME, e.g. root:int8")
        return value

    def views(self) -> dict[str, AdapterSpec | QuantizeSpec]:
        """The served adapters and quantized views as the registry takes them (model id -> spec)."""
        from orchestra.models.modelref import AdapterSpec, QuantizeSpec

        found: dict[str, AdapterSpec | QuantizeSpec] = {
            name: AdapterSpec(adapter=folder, base=self.source) for name, folder in self.adapters.items()}
        for name, view in self.quantized.items():
            base, _, scheme = view.partition(":")
            found[name] = QuantizeSpec(base=base, quantize=scheme)
        return found

    @field_validator("allow_code")
    @classmethod
    def _prefixes(cls, value: list[str]) -> list[str]:
        from agents.references import CodePolicy, stdlib_module

        CodePolicy(prefixes=tuple(value))  # each one a dotted module path
        trusted = [p for p in value if stdlib_module(p) or p.split(".")[0] in ("builtins", "__main__")]
        if trusted:
            raise ValueError(f"{trusted[0]!r} is part of Python itself: allowing it lets any client run commands "
                             "or read files as the server; allow only the packages of your own steps and tools")
        return value

    def code_policy(self) -> CodePolicy:
        """What inline pipelines may import: the `allow_code` prefixes and the built-in tools."""
        from agents.references import CodePolicy

        return CodePolicy(prefixes=tuple(self.allow_code))

    def cache_budget_bytes(self) -> int:
        """What the cache, the decoding rows and the builds may hold together: `cache_mb` less the runtime's
        reserve (never more than a quarter of it, so a small budget still caches)."""
        return (self.cache_mb << 20) - (min(self.runtime_reserve_mb, self.cache_mb // 4) << 20)

    def api_key(self) -> str | None:
        """The configured key, read from the environment now (so it is never logged or stored)."""
        if not self.api_key_env:
            return None
        value = os.environ.get(self.api_key_env)
        if not value:
            from orchestra.serve._errors import ConfigError

            raise ConfigError(f"--api-key-env names {self.api_key_env!r}, but that environment variable is empty; "
                              f"export {self.api_key_env}=<key> or drop the option")
        return value
