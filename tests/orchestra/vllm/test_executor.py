"""The vllm executor's side in this process (no vLLM needed): which members it serves, what a request to an
engine carries and says it cannot, how an engine's cache becomes a run's lease, and the error without vLLM.
The engines themselves run in tests/vllm/test_pipeline.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from agents.decoding import DecodeRequest
from agents.spec import GenerationSettings
from orchestra import Pipeline
from orchestra.errors import ExecutorError, ExecutorUnavailableError
from orchestra.familycache._requests import EngineCache
from orchestra.familycache._settings import ExecutorSpec
from orchestra.vllm.executor import VllmDecoder, VllmExecutor, indented_grammar


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory):
    from orchestra.family import load_family
    from orchestra.family.init import init_family
    from tests.tiny_family import build_tiny_family

    tmp = tmp_path_factory.mktemp("vllm-executor")
    tiny = build_tiny_family(tmp / "models", "llama", head_dim=32)
    init_family("tiny", [f"base={tiny.parent}", f"tuned={tiny.child}"], home=tmp / "home")
    return load_family(tmp / "home"), tiny


def _executor(family, models: dict[str, object]) -> VllmExecutor:
    from orchestra.models.registry import ModelRegistry

    registry = ModelRegistry(models, family=family[0], default_device="cpu")
    return VllmExecutor(registry, ExecutorSpec(kind="vllm"), members=list(models))


def test_family_members_are_served_by_name_and_other_models_are_refused(family, tmp_path: Path) -> None:
    from orchestra.models.modelref import QuantizeSpec

    executor = _executor(family, {"base": "base", "tuned": "tuned"})
    assert executor.kind == "vllm" and not executor.holds_caches and not executor.in_process
    with pytest.raises(ExecutorError, match="quantized view"):
        _executor(family, {"base": "base", "small": QuantizeSpec(base="base", quantize="int8")})
    with pytest.raises(ExecutorError, match="no member of the family"):
        _executor(family, {"base": "base", "stray": str(_copy(family[1].child, tmp_path / "stray"))})
    with pytest.raises(ExecutorError, match="runs no model work in this process"):
        executor.run(["base"], print)


def _copy(folder: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(folder, to)
    return to


def test_a_request_carries_the_agents_settings_and_names_what_vllm_cannot_apply() -> None:
    schema = {"type": "object", "properties": {"facts": {"type": "array", "items": {"type": "string",
              "enum": ["Revenue grew."]}, "maxItems": 1}}, "required": ["facts"]}
    request = DecodeRequest(agent="facts", prompt_ids=[1, 2, 3], prefix_tokens=2, max_new_tokens=40,
                            settings=GenerationSettings(max_new_tokens=8, temperature=0.7, top_k=5, seed=3,
                                                        repetition_penalty=1.15, no_repeat_ngram_size=4),
                            schema=schema, stop=("\n\n",), grounded=True, attempt=1)
    body, missing = VllmDecoder("http://engine", "tuned").body(request)
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 40 and body["model"] == "tuned"
    assert (body["temperature"], body["top_k"], body["seed"], body["stop"]) == (0.7, 5, 4, ["\n\n"])
    assert "repetition_penalty" not in body  # vLLM's would penalise the document's tokens too
    assert body["structured_outputs"] == {"grammar": indented_grammar(schema)}
    assert [m.split(":")[0] for m in missing] == ["no_repeat_ngram_size=4", "repetition_penalty=1.15",
                                                  "distinct list items"]
    plain = DecodeRequest(agent="notes", prompt_ids=[1], prefix_tokens=1, max_new_tokens=8,
                          settings=GenerationSettings(max_new_tokens=8), schema=None)
    body, missing = VllmDecoder("http://engine", "base").body(plain)
    assert missing == () and "structured_outputs" not in body and "seed" not in body


def test_the_grammar_sent_to_the_engine_holds_the_reply_to_the_agents_layout() -> None:
    import xgrammar as xgr

    grammar = indented_grammar({"type": "object", "properties": {"facts": {"type": "array",
                                "items": {"type": "string"}}}, "required": ["facts"]})
    xgr.Grammar.from_ebnf(grammar)  # what vLLM's xgrammar backend compiles
    reply = json.dumps({"facts": ["a"]}, indent=2)
    assert "\\n" in grammar and reply.startswith("{\n  ")


async def test_an_engines_cache_becomes_the_runs_lease_with_its_gates_and_fallback() -> None:
    from orchestra.runs._engine import engine_lease
    from orchestra.runs._state import RunState

    class Engine:
        def __init__(self, held: EngineCache) -> None:
            self.held = held

        def engine_cache(self, member, ids, *, mapped=True):
            return self.held

    events: list = []

    async def emit(event) -> None:
        events.append(event)

    run = RunState("r1", 0.0, [1, 2, 3], emit)
    mapped = await engine_lease(Engine(EngineCache("mapped", 96, 4, 0.5, "base", ("offline=pass", "probe=pass"))),
                                run, "facts", "tuned", list(range(100)), mapped=True)
    assert (mapped.path, mapped.source, mapped.reused_tokens, mapped.map_seconds, mapped.hit) == \
        ("mapped", "base", 96, 0.5, False)
    assert [(g.gate, g.passed) for g in mapped.gates] == [("offline", True), ("probe", True)]
    refused = await engine_lease(Engine(EngineCache("reprefilled", 0, 100, 2.0, "base", ("offline=fail",),
                                                    "offline gate failed")), run, "facts", "tuned",
                                 list(range(100)), mapped=True)
    assert refused.fallback_reason == "offline gate failed" and refused.prefill_seconds == 2.0
    kinds = [(e.kind, getattr(e, "passed", None)) for e in events]
    assert kinds == [("gate", True), ("gate", True), ("gate", False), ("fallback", None)]
    again = await engine_lease(Engine(EngineCache("exact", 100, 0, 0.01)), run, "notes", "base",
                               list(range(100)), mapped=False)
    first = await engine_lease(Engine(EngineCache("exact", 0, 100, 3.0)), run, None, "base", list(range(100)),
                               mapped=False)
    assert again.hit and not first.hit and again.entry_id == first.entry_id  # one entry: charged once


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_a_pipeline_on_vllm_without_vllm_says_how_to_install_it(family) -> None:
    pipeline = (Pipeline("p", family=family[0], models={"base": "base"}, source="base", executor="vllm")
                .agent({"name": "notes", "task": "Say something."}, model="base"))
    with pytest.raises(ExecutorUnavailableError, match="needs vLLM.*pip install"):
        pipeline.run_sync("Revenue grew in every region last year. The board approved a dividend.")


def test_waiting_for_a_save_ends_when_the_store_has_it_and_at_once_when_nothing_was_saved(tmp_path: Path) -> None:
    import time

    from orchestra.vllm.engines import VllmEngines

    engines = VllmEngines(home=tmp_path, run_dir=tmp_path)
    now = time.time()
    lines = [{"time": now - 3600, "event": "save", "request": "cmpl-forgotten-0", "tokens": 900},
             {"time": now - 3599, "event": "stored", "request": "cmpl-forgotten-0", "tokens": 900},
             {"time": now + 10.0, "event": "save", "request": "cmpl-old-0", "tokens": 900},
             {"time": now + 10.5, "event": "stored", "request": "cmpl-old-0", "tokens": 900},
             {"time": now + 20.0, "event": "save", "request": "cmpl-hold-1", "tokens": 900}]
    engines.events.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert not engines.wait_stored("cmpl-none", timeout_s=5)  # planned no save: no wait
    assert not engines.wait_stored("hold-1", timeout_s=0.2)  # planned, not yet written
    with engines.events.open("a") as fh:
        fh.write(json.dumps({"time": now + 21.0, "event": "stored", "request": "cmpl-hold-1"}) + "\n")
    assert engines.wait_stored(since=now + 15.0, timeout_s=5)  # the save planned after 15 s, not the older one
    assert engines.wait_stored("old", timeout_s=5)
    assert not engines.wait_stored("forgotten", timeout_s=5)  # an hour old: a server does not keep every save
