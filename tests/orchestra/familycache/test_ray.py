"""The ray executor on a tiny family: one local Ray per module (2 CPUs, no dashboard), actors per member.

Same token ids, cache paths and gate decisions as the local executor; FamilyCache entries hold
ObjectRefs; an actor killed mid-run fails its agent with a typed error naming actor and node while
its sibling succeeds, and the next run works; a LoRA adapter and an int8 view run in actors of their own as
they run locally; cancelled runs, `close()` and Ctrl-C on a driver leave
no actors or placement groups behind.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from orchestra.family.corpus import data_text
from orchestra.familycache.mapping_store import PROBE_FILE, MappingStore
from orchestra.observability.events import TokenEvent
from orchestra.pipelines.spec import PipelineSpec
from orchestra.runs.scheduler import Orchestra
from tests.tiny_family import build_tiny_family
from tests.waiting import HANG_GUARD_S, wait_for_exit, wait_until

ray = pytest.importorskip("ray")

from orchestra.familycache._ray import NAMESPACE, RemoteKV  # noqa: E402  (needs ray)

DOC = data_text("gpl-3.txt")[:320]
SHORT = DOC[:100]  # leaves room for long generations (tiny models take 512 positions)
CORPUS = [("mpl", data_text("mpl-2.0.txt")[:6000]), ("apache", data_text("apache-2.0.txt")[:6000])]

# The agent ran to the end: the tiny random models' few tokens may be judged degenerate, which is the
# degenerate check doing its job, not the executor failing.
RAN = ("succeeded", "degenerate")


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def fam(tiny_root):
    return build_tiny_family(tiny_root, "llama")


@pytest.fixture(scope="module")
def maps(tmp_path_factory, fam):
    """A store with the parent -> child mapping calibrated (offline, as the ray executor needs)."""
    from orchestra.models.registry import ModelRegistry

    directory = tmp_path_factory.mktemp("ray_maps")
    registry = ModelRegistry({"base": str(fam.parent), "child": str(fam.child)}, default_device="cpu")
    _store(directory).get(registry.load("base"), registry.load("child"))
    return directory


def _spec(name, model, upstream=(), task="Summarise the document.", max_new_tokens=8):
    return {"name": name, "model": model, "upstream": list(upstream),
            "spec": {"role": "You are careful.", "task": task,
                     "generation": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}}


def _pipeline(fam, agents, **extra) -> PipelineSpec:
    return PipelineSpec.model_validate({
        "name": "t", "models": {"base": str(fam.parent), "child": str(fam.child)},
        "source": "base", "default_device": "cpu", "agents": agents, **extra,
    })


def _store(directory, **kw) -> MappingStore:
    return MappingStore(Path(directory), tokens=2048, corpus=CORPUS, **kw)


def _ours() -> list[dict]:
    return [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]


def _live_groups() -> list[str]:
    return [pg["name"] for pg in ray.util.placement_group_table().values()
            if pg["name"].startswith("orchestra-") and pg["state"] != "REMOVED"]


def _gates(report):
    return {a.name: [(g["gate"], g["passed"], {k: v for k, v in g["metrics"].items() if isinstance(v, float)})
                     for g in a.gate] for a in report.agents}


def _assert_same_gates(got, expected):
    """Same gates with the same verdicts; metrics equal up to float summation order.

    An actor's torch runs on the threads Ray gives it, not the driver's, so its reductions add in another order
    and a probe NLL moves in the third decimal (6.856 vs 6.857 seen in CI); rounding both sides cannot absorb
    that, because a value near a rounding boundary lands on either side of it.
    """
    a, b = _gates(got), _gates(expected)
    assert a.keys() == b.keys()
    for name in a:
        assert [(g, p, m.keys()) for g, p, m in a[name]] == [(g, p, m.keys()) for g, p, m in b[name]], name
        for (_, _, mg), (_, _, me) in zip(a[name], b[name], strict=True):
            assert mg == pytest.approx(me, rel=1e-3, abs=5e-3), name


async def test_ray_matches_local(ray_cluster, fam, maps):
    """Outputs, token ids, cache paths, gates and repair plans equal the local executor's; entries hold ObjectRefs."""
    from agents import DocumentPrompt

    agents = [_spec("a", "base"), _spec("b", "child"), _spec("c", "base", upstream=["b"], task="Check {b}")]
    json_agent = _spec("j", "child", task="List the parties as JSON.")  # a tiny model cannot: a typed failure
    json_agent["spec"]["output"] = {"kind": "json", "json_schema": {"type": "object", "required": ["parties"]},
                                    "max_repairs": 0}
    agents.append(json_agent)
    extra = {"gate": {"offline": None, "probe": {"tokens": 16, "max_excess_nll": 100.0}},
             # scattered-token repair: the source ranks positions in its actor, the target repairs in its own.
             # Priced by multiply-adds: timed pass costs belong to a process's thread count (an actor's differs
             # from the driver's), so under them the two executors may legitimately buy different repairs
             "mapping": {"repair": {"budget": 0.3, "scattered_share": 0.5, "probe_tokens": 8},
                         "repair_costs": "compute"}}
    local = Orchestra(_pipeline(fam, agents, **extra), mappings=_store(maps))
    expected = await local.run(DOC)
    reference = json.loads(next(maps.glob(f"*/{PROBE_FILE}")).read_text())
    next(maps.glob(f"*/{PROBE_FILE}")).unlink()  # the ray run measures it again, split over both actors

    remote = Orchestra(_pipeline(fam, agents, executor={"kind": "ray"}, **extra), mappings=_store(maps))
    try:
        got = await remote.run(DOC)
        assert got.executor == "ray" and expected.executor == "local"
        assert [a.status for a in got.agents] == [a.status for a in expected.agents] == ["succeeded"] * 3 + ["failed"]
        # the agent's own error crosses the process boundary as itself (type, message)
        assert (got.agent("j").error_type, got.agent("j").error) == (expected.agent("j").error_type,
                                                                     expected.agent("j").error)
        assert got.agent("j").error_type in {"OutputValidationError", "TruncatedOutputError", "ContextOverflowError"}
        assert [a.output for a in got.agents] == [a.output for a in expected.agents]
        assert [a.cache_path for a in got.agents] == [a.cache_path for a in expected.agents] == \
            ["exact", "mapped", "exact", "mapped"]
        _assert_same_gates(got, expected)
        planned = [c.repair["tokens"] for c in expected.caches if c.repair]
        assert [c.repair["tokens"] for c in got.caches if c.repair] == planned and planned and all(planned)
        assert [(a.actor, bool(a.node)) for a in got.agents] == [("base#0", True), ("child#0", True), ("base#0", True),
                                                                 ("child#0", True)]
        assert expected.agents[0].actor is None
        # base's document cache went into child's actor to be mapped: that crossed processes, and was counted
        assert got.kv_bytes_moved > 0 and got.kv_bytes_moved_across_nodes == 0 and got.result_bytes_to_driver > 0
        again = json.loads(next(maps.glob(f"*/{PROBE_FILE}")).read_text())
        assert again.keys() == reference.keys() and len(again) == 2
        tail = next(k for k in again if k != "mapping_sha256")
        assert again[tail] == pytest.approx(reference[tail], rel=1e-4, abs=1e-5)

        entries = remote.cache.pool.entries()
        assert entries and all(isinstance(e.cache, RemoteKV) and isinstance(e.cache.ref, ray.ObjectRef)
                               for e in entries)
        assert {e.cache.producer for e in entries} == {"base#0", "child#0"}

        # the same lease gives the same token ids whichever executor decodes it
        ids = DocumentPrompt(DOC).token_ids(remote.cache.executor.tokenizer("base"))
        spec = remote.specs["b"]
        tokens = []
        for orch in (local, remote):
            with orch.cache.acquire_sync("child", ids) as lease:
                assert lease.hit and lease.path == "mapped"
                result = await orch.cache.executor.generate("child", spec, prefix_ids=ids, prefix_cache=lease.cache,
                                                            upstream={})
            tokens.append(result.token_ids)
        assert tokens[0] == tokens[1] and tokens[0]
    finally:
        remote.close()
    assert not _ours() and not _live_groups()


async def test_killed_actor_fails_its_agent_only_and_restarts(ray_cluster, fam, maps):
    agents = [_spec("a", "base"), _spec("b", "child", max_new_tokens=200)]
    pipe = _pipeline(fam, agents, gate={"offline": None, "probe": {"tokens": 16, "max_excess_nll": 100.0}},
                     executor={"kind": "ray", "max_restarts": 2})
    orch = Orchestra(pipe, mappings=_store(maps))
    killed = []

    def kill_child_mid_generation(event) -> None:
        if isinstance(event, TokenEvent) and event.agent == "b" and not killed:
            actor = orch.cache.executor.actors("child")[0]
            killed.append(actor.node)
            ray.kill(actor.handle, no_restart=False)

    try:
        report = await orch.run(SHORT, on_event=kill_child_mid_generation)
        assert killed, report
        a, b = report.agent("a"), report.agent("b")
        assert a.status in RAN
        assert b.status == "failed" and b.error_type == "ActorLostError", b
        assert "child#0" in b.error and killed[0] in b.error and b.node == killed[0]

        again = await orch.run(SHORT)  # the actor restarted; its stored caches outlived it
        assert all(x.status in RAN for x in again.agents), again.agent("b")
        assert again.agent("b").cache_path == "mapped" and again.store_hits == 3
    finally:
        orch.close()
    assert not _ours() and not _live_groups()


async def test_missing_mapping_is_refused_and_cancelled_runs_leave_nothing(ray_cluster, fam, tmp_path):
    """No calibration on demand under Ray (a re-prefill, saying why); a cancelled run, then close(): nothing left."""
    agents = [_spec("a", "base"), _spec("b", "child", max_new_tokens=200)]
    orch = Orchestra(_pipeline(fam, agents, executor="ray"), mappings=_store(tmp_path / "empty"))
    try:
        report = await orch.run(SHORT)
        b = report.agent("b")
        assert b.status in RAN and b.cache_path == "reprefilled"
        assert "does not calibrate mappings on demand" in b.fallback_reason
        assert not (tmp_path / "empty").exists() or not any((tmp_path / "empty").iterdir())

        first_token = anyio.Event()

        async def on_event(event) -> None:
            if isinstance(event, TokenEvent) and event.agent == "b":
                first_token.set()

        async def runner() -> None:
            await orch.run(SHORT, on_event=on_event)
            pytest.fail("the run should have been cancelled")

        with anyio.move_on_after(120):
            async with anyio.create_task_group() as tg:
                tg.start_soon(runner)
                await first_token.wait()
                tg.cancel_scope.cancel()
        assert first_token.is_set()
        assert len(_ours()) == 2 and len(_live_groups()) == 1
    finally:
        orch.close()
    assert not _ours() and not _live_groups()


async def test_adapter_and_quantized_view_members_run_in_actors_of_their_own(ray_cluster, fam, tmp_path_factory):
    """A LoRA adapter and an int8 view over the source under Ray: each actor is given its alias and its base's,
    loads only its own model (the base's weights again, in that actor), reports the fingerprint the driver
    resolved, and maps the source's document cache as a local run does: same cache paths, same outputs."""
    from orchestra.familycache._ray import _actor_aliases
    from orchestra.models.modelref import AdapterSpec, QuantizeSpec
    from tests.fixtures.adapters import make_lora_adapter

    folder = tmp_path_factory.mktemp("ray_views")
    lora = str(make_lora_adapter(fam.parent, folder / "lora", scale=0.02, seed=1))
    models = {"base": str(fam.parent), "tuned": {"adapter": lora, "base": "base"}}
    agents = [_spec("a", "base"), _spec("b", "tuned")]
    if importlib.util.find_spec("torchao") is not None:  # the quant extra; int8 runs on the CPU
        models["q8"] = {"base": "base", "quantize": "int8"}
        agents.append(_spec("c", "q8"))

    def pipeline(**extra) -> PipelineSpec:
        return PipelineSpec.model_validate({
            "name": "views", "models": models, "source": "base", "default_device": "cpu", "agents": agents,
            "gate": {"offline": None, "probe": {"tokens": 16, "max_excess_nll": 100.0}}, **extra})

    # the local run calibrates base -> each view on demand (a view's mapping is only made by a run that loads
    # it); the ray run, which never calibrates, finds them there
    store = MappingStore(folder / "maps", tokens=1024, corpus=CORPUS)
    expected = await Orchestra(pipeline(), mappings=store).run(SHORT)
    remote = Orchestra(pipeline(executor={"kind": "ray", "num_cpus": 0.5}), mappings=store)
    try:
        got = await remote.run(SHORT)
        paths = {a.name: a.cache_path for a in got.agents}
        assert paths == {a.name: a.cache_path for a in expected.agents} == {
            "a": "exact", "b": "mapped", **({"c": "mapped"} if "q8" in models else {})}
        assert [a.status for a in got.agents] == [a.status for a in expected.agents]
        assert all(a.status in RAN for a in got.agents)
        assert [a.output for a in got.agents] == [a.output for a in expected.agents]
        assert {a.name: a.actor for a in got.agents} == {"a": "base#0", "b": "tuned#0",
                                                         **({"c": "q8#0"} if "q8" in models else {})}

        executor = remote.cache.executor
        assert _actor_aliases(executor.registry, "tuned") == {"tuned": AdapterSpec(lora, "base"),
                                                              "base": str(fam.parent)}
        assert _actor_aliases(executor.registry, "base") == {"base": str(fam.parent)}
        if "q8" in models:
            assert _actor_aliases(executor.registry, "q8") == {"q8": QuantizeSpec("base", "int8"),
                                                               "base": str(fam.parent)}
        # each actor's model is the member the driver resolved: the fingerprints the caches and maps are keyed by
        for member in models:
            who = ray.get(executor.actors(member)[0].handle.whoami.remote())
            assert who["fingerprint"] == executor.info(member).fingerprint == expected_fp(fam, lora, member)
        mapped = {e.member: e.cache.producer for e in remote.cache.pool.entries() if e.namespace.kind == "mapped"}
        assert mapped == {m: f"{m}#0" for m in models if m != "base"}  # mapped in the view's own actor
    finally:
        remote.close()
    assert not _ours() and not _live_groups()


def expected_fp(fam, lora: str, member: str) -> str:
    """`member`'s fingerprint as a local registry resolves it."""
    from orchestra.models.modelref import AdapterSpec, QuantizeSpec
    from orchestra.models.registry import ModelRegistry

    return ModelRegistry({"base": str(fam.parent), "tuned": AdapterSpec(lora, "base"),
                          "q8": QuantizeSpec("base", "int8")}, default_device="cpu").info(member).fingerprint


# The CLI, with one hook: the first token event writes the marker file and holds the run there (the event
# sink never returns), so the run is still in progress, at a known point, whenever the signal comes.
HELD_CLI = """
import sys
from pathlib import Path

import anyio

from orchestra.observability.events import TokenEvent
from orchestra.runs.scheduler import Orchestra

marker = Path(sys.argv.pop(1))
unheld = Orchestra.run


async def run(self, document, *, on_event=None, run_id=None, inputs=None, resume=False):
    async def held(event):
        if on_event is not None:
            result = on_event(event)
            if result is not None:
                await result
        if isinstance(event, TokenEvent):
            marker.write_text(event.agent)
            await anyio.sleep_forever()

    return await unheld(self, document, on_event=held, run_id=run_id, inputs=inputs, resume=resume)


Orchestra.run = run
from orchestra.cli import main  # noqa: E402

sys.argv[0] = "orchestra"
main()
"""


def test_the_typed_requests_give_the_same_answers_on_the_local_and_the_ray_executor(ray_cluster, fam, maps):
    """The executor seam's contract: each request object, run by either executor, answers the same result."""
    import torch

    from mappings.repair import RepairPolicy
    from orchestra.familycache import (
        ComputeRequest,
        ImportanceRequest,
        MappingRequest,
        MapRequest,
        ProbeReferenceRequest,
        TailLogitsRequest,
        make_executor,
    )
    from orchestra.models.registry import ModelRegistry

    registry = ModelRegistry({"base": str(fam.parent), "child": str(fam.child)}, default_device="cpu")
    ids = tuple(registry.load("base").tokenizer(DOC, add_special_tokens=False)["input_ids"][:64])
    repair = RepairPolicy(budget=0.3, scattered_share=0.5, probe_tokens=8)
    answers = {}
    for kind in ("local", "ray"):
        executor = make_executor(kind, registry, members=["base", "child"], name="typed", start=True)
        try:
            computed = executor.compute(ComputeRequest("base", ids, keep_logits=4))
            again = executor.tail_logits(TailLogitsRequest("base", computed.cache, ids, len(ids), 4))
            store = _store(maps)
            loaded = executor.load_mapping(MappingRequest("base", "child", store))
            reference = executor.probe_reference(ProbeReferenceRequest("base", "child", store, loaded.mapping, 4))
            ranked = executor.importance(ImportanceRequest("base", computed.cache, ids, 8))
            mapped = executor.map_cache(MapRequest("child", loaded.mapping, computed.cache, ids, 4, repair,
                                                   source="base"))
            assert not loaded.calibrated and ranked.scores.shape[-1] == len(ids)
            assert mapped.repair is not None and mapped.repair.tokens > 0
            answers[kind] = (computed.logits, again.logits, reference.source_kl, ranked.scores, mapped.computed.logits)
        finally:
            executor.close()
    for local, remote in zip(answers["local"], answers["ray"], strict=True):
        assert torch.allclose(torch.as_tensor(local), torch.as_tensor(remote), atol=1e-3), (local, remote)


def test_ctrl_c_on_the_cli_leaves_no_actors(ray_cluster, fam, maps, tmp_path):
    """Ctrl-C while agents are generating (held at their first token): exit 130, no actors or groups left."""
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(
        f"name: ctrlc\nmodels: {{base: '{fam.parent}', child: '{fam.child}'}}\nsource: base\ndefault_device: cpu\n"
        f"mapping: {{directory: '{maps}'}}\n"
        "agents:\n"
        "  - {name: a, model: base, spec: {task: Summarise., generation: {max_new_tokens: 200}}}\n"
        "  - {name: b, model: child, spec: {task: Summarise., generation: {max_new_tokens: 200}}}\n"
    )
    document = tmp_path / "doc.txt"
    document.write_text(SHORT)
    cli, marker = tmp_path / "held_cli.py", tmp_path / "first-token"
    cli.write_text(HELD_CLI)
    env = {**os.environ, "RAY_ADDRESS": ray_cluster}
    proc = subprocess.Popen([sys.executable, str(cli), str(marker), "run", str(pipeline), "--document", str(document),
                             "--executor", "ray", "--ray-address", "auto"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        # the marker, not a time budget: the run holds at its first token until signalled, however loaded
        # the machine is; a CLI that exits first fails the wait with its output below
        try:
            wait_until(marker.exists, what="the first token", alive=proc)
        except AssertionError:
            raise AssertionError(wait_for_exit(proc).decode()[-2000:]) from None
        assert proc.poll() is None and len(_ours()) == 2
        proc.send_signal(signal.SIGINT)
        out = wait_for_exit(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out.decode()[-2000:]
    assert b"interrupted" in out
    wait_until(lambda: not _ours() and not _live_groups(), what="Ray to remove the run's actors and groups")


def test_executor_settings_validate_and_cli_overrides(fam):
    from orchestra.builder import Pipeline

    pipe = _pipeline(fam, [_spec("a", "base")], executor={"kind": "ray", "members": {"child": {"num_gpus": 1,
                                                                                                "replicas": 2}}})
    assert pipe.executor.resources("child").replicas == 2 and pipe.executor.resources("base").num_cpus == 1.0
    built = Pipeline.from_spec(pipe).with_executor("local", address="auto")
    assert built.spec.executor.kind == "local" and built.spec.executor.address == "auto"
    assert built.spec.executor.members["child"].num_gpus == 1
    from orchestra.errors import PipelineValidationError

    with pytest.raises(PipelineValidationError, match="executor.members names model 'nope'"):
        _pipeline(fam, [_spec("a", "base")], executor={"kind": "ray", "members": {"nope": {}}})
    with pytest.raises(PipelineValidationError, match="executor.kind"):
        _pipeline(fam, [_spec("a", "base")], executor="dask")


def test_ray_started_from_a_worker_thread_outlives_it(tmp_path):
    """Ray's GCS and raylet die with the thread that spawned them: a private Ray started from an op's
    worker thread (which anyio retires when idle) must be spawned from a thread that lasts."""
    script = tmp_path / "start.py"
    script.write_text(
        "import threading, time, ray\n"
        "from orchestra.familycache._ray import _init_from_a_lasting_thread\n"
        "t = threading.Thread(target=_init_from_a_lasting_thread, args=({'address': 'local', 'num_cpus': 1,\n"
        "                     'include_dashboard': False, 'log_to_driver': False},))\n"
        "t.start(); t.join(); time.sleep(1.0)  # the worker thread is gone\n"
        "print('alive', ray.get(ray.remote(lambda: 41).remote(), timeout=900) + 1)\n"
        "ray.shutdown()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=HANG_GUARD_S, env=env)
    assert "alive 42" in out.stdout, out.stderr[-2000:]
