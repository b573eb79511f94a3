"""A client of the server cannot make it import or run Python, or reach a folder, that its operator did not allow.

Every case is sent as a client would (HTTP to the app of a tiny family's engine), and what the server would have
done is watched from outside: canary modules written for each test record, in marker files, being imported and
being called; `sys.modules` shows which modules loaded. A refusal is only a pass when nothing ran.
"""

from __future__ import annotations

import os
import re
import sys
import textwrap
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestra.family.corpus import data_text
from orchestra.pipelines.trust import client_spec_reach
from orchestra.serve import ServeConfig, create_app
from tests.orchestra.serve.conftest import asgi_client, finish_run, tiny_engine
from tests.orchestra.serve.test_app import assert_openai_error
from tests.waiting import HANG_GUARD_S, wait_until

DOC = data_text("gpl-3.txt")[:300]
AGENT = {"name": "summary", "model": "root", "spec": {"task": "Summarise.", "generation": {"max_new_tokens": 3}}}
# modules of Python itself that nothing in the server imports (the property test checks they stay unloaded)
UNLOADED_STDLIB = ("runpy", "pickletools", "tabnanny", "pdb", "xmlrpc.client", "smtplib", "ftplib", "telnetlib")


@dataclass
class Canary:
    """A package written for one test: importing it, or calling what it holds, leaves a marker file."""

    name: str
    markers: Path
    site: Path
    """The folder on sys.path that holds the package."""

    def imported(self) -> bool:
        return (self.markers / "imported").exists() or any(m in sys.modules for m in (self.name, f"{self.name}.steps"))

    def ran(self) -> bool:
        return any(self.markers.glob("ran-*"))

    def nothing_happened(self) -> bool:
        return not self.imported() and not self.ran() and not any(self.markers.iterdir())


@pytest.fixture
def canary(tmp_path, monkeypatch) -> Canary:
    name = f"canary_{uuid.uuid4().hex[:10]}"
    package = tmp_path / "site" / name
    package.mkdir(parents=True)
    markers = tmp_path / "markers"
    markers.mkdir()
    body = f"""
        import pathlib
        from subprocess import run as shell  # a re-export: reachable as {name}:shell
        from pydantic import BaseModel

        MARKERS = pathlib.Path({str(markers)!r})
        (MARKERS / "imported").touch()

        def step(document: str, **inputs) -> str:
            (MARKERS / "ran-step").touch()
            return "step ran over " + str(len(document)) + " characters"

        def lookup(text: str) -> str:
            \"\"\"A typed tool.\"\"\"
            (MARKERS / "ran-tool").touch()
            return text

        def _private(**kwargs) -> str:
            (MARKERS / "ran-private").touch()
            return "private"

        class Out(BaseModel):
            answer: str
    """
    (package / "__init__.py").write_text(textwrap.dedent(body))
    (package / "steps.py").write_text(f"from {name} import step, lookup\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    yield Canary(name, markers, tmp_path / "site")
    for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[module]


def _with_step(call: str, **step: object) -> dict:
    return {"models": {"root": "root"}, "agents": [AGENT], "steps": [{"name": "x", "call": call, **step}]}


def _with_agent_spec(**spec: object) -> dict:
    agent = {**AGENT, "spec": {**AGENT["spec"], **spec}}  # type: ignore[dict-item]
    return {"models": {"root": "root"}, "agents": [agent]}


def _attack(marker: Path) -> dict:
    """The request that ran a shell command on the server: a step calling subprocess.run with the client's inputs."""
    spec = {**_with_step("subprocess:run"), "inputs": ["args", "shell"]}
    return {"spec": spec, "document": DOC, "inputs": {"args": f"touch {marker}", "shell": "1"}}


async def test_a_client_pipeline_running_a_shell_command_is_refused_and_runs_nothing(runs_client, runs_engine, tmp_path):
    marker = tmp_path / "MARKER"
    runs = len(runs_engine.runs.list())
    error = assert_openai_error(await runs_client.post("/v1/runs", json=_attack(marker)), 403, "not_allowed", param="spec")
    assert "steps[0].call" in error["message"] and "--allow-code" in error["message"]
    assert len(runs_engine.runs.list()) == runs  # no run was started
    assert not marker.exists()


REFERENCES = ["subprocess:run", "os:system", "builtins:exec", "importlib:import_module", "pickle:loads",
              "runpy:run_path", "os.system", "os:path.join", "os:system:x", "subprocess:Popen.__init__"]


def _naming(place: str, ref: str) -> dict:
    """A pipeline that names `ref` as a step, a tool (text or mapping), an output model or a condition."""
    if place == "step":
        return _with_step(ref)
    if place == "tool":
        return _with_agent_spec(tools=[ref])
    if place == "tool_mapping":
        return _with_agent_spec(tools=[{"name": "t", "description": "", "call": ref, "parameters": {}}])
    if place == "output_model":
        return _with_agent_spec(output={"kind": "json", "model": ref})
    return {"models": {"root": "root"}, "agents": [{**AGENT, "when": ref}]}


@pytest.mark.parametrize("reference", REFERENCES)
@pytest.mark.parametrize("place", ["step", "tool", "tool_mapping", "output_model", "condition"])
async def test_python_named_anywhere_in_a_client_pipeline_is_refused_before_import(runs_client, canary, place, reference):
    for ref in (reference, f"{canary.name}:step", f"{canary.name}.steps:step"):
        spec = _naming(place, ref)
        response = await runs_client.post("/v1/runs", json={"spec": spec, "document": DOC})
        assert 400 <= response.status_code < 500, response.text
        assert response.status_code == 403, response.text
    assert canary.nothing_happened()


async def test_a_client_cannot_reach_code_through_an_allowed_module_or_its_private_names(
        tiny_serve_family, canary):
    engine = tiny_engine(tiny_serve_family, allow_code=[canary.name])
    async with asgi_client(engine) as client:
        for place in ("step", "tool", "output_model"):
            for ref in (f"{canary.name}:shell", f"{canary.name}:_private", f"{canary.name}:MARKERS.write_text"):
                if place == "step" and ref.endswith("write_text"):
                    continue  # a step names a module's own function: refused as malformed (400) before any import
                response = await client.post("/v1/runs", json={"spec": _naming(place, ref), "document": DOC})
                assert_openai_error(response, 403, "not_allowed")
                assert not canary.ran()
        # what the operator allowed runs: the step, the typed tool and the output model of the canary package
        allowed = {**_with_step(f"{canary.name}.steps:step"), "agents": [
            {**AGENT, "spec": {**AGENT["spec"], "tools": [f"{canary.name}:lookup"]}},
            {"name": "typed", "model": "root", "spec": {"task": "Answer.", "generation": {"max_new_tokens": 8},
                                                         "output": {"kind": "json", "model": f"{canary.name}.Out",
                                                                    "max_repairs": 0}}}]}
        response = await client.post("/v1/runs", json={"spec": allowed, "document": DOC})
        assert response.status_code == 201, response.text
        status = await finish_run(client, response.json()["id"])
        steps = {a["name"]: a for a in status["report"]["agents"]}
        assert steps["x"]["status"] == "succeeded" and steps["x"]["output"] == f"step ran over {len(DOC)} characters"
        assert (canary.markers / "ran-step").exists() and not (canary.markers / "ran-private").exists()


async def test_folders_and_addresses_in_a_client_pipeline_are_refused(runs_client, tmp_path):
    for section, key, value in [("mapping", "directory", str(tmp_path / "maps")),
                                ("kv_store", "directory", str(tmp_path / "kv")),
                                ("executor", "address", "ray://10.0.0.1:10001"),
                                ("executor", "vllm", {"store": str(tmp_path / "vllm-kv"), "args": [
                                    "--kv-transfer-config", '{"kv_connector_module_path": "attacker"}']})]:
        spec = {"models": {"root": "root"}, "agents": [AGENT], section: {key: value}}
        if section == "executor":
            spec[section]["kind"] = "ray" if key == "address" else "vllm"
        error = assert_openai_error(await runs_client.post("/v1/runs", json={"spec": spec, "document": DOC}), 403)
        assert f"{section}.{key}" in error["message"]
    assert list(tmp_path.iterdir()) == []  # no folder was made


async def test_pipeline_and_model_names_never_reach_a_path(runs_client, runs_engine, canary, tmp_path):
    outside = runs_engine.config.pipelines_dir.parent / "outside.yaml"  # a pipeline file beside the folder, not in it
    outside.write_text(f"models: {{root: root}}\nsteps: [{{name: s, call: '{canary.name}:step'}}]\n"
                       "agents: [{name: a, model: root, spec: {task: x}}]\n")
    for name in ("../outside", str(outside.with_suffix("")), "qa/../../outside", "..", "~/outside", "qa\x00"):
        response = await runs_client.post("/v1/runs", json={"pipeline": name, "document": DOC})
        assert_openai_error(response, 400, param="pipeline")
    folder = tmp_path / "model"
    folder.mkdir()
    for model in (str(folder), "../model", "HuggingFaceTB/SmolLM2-135M-Instruct", "~/model"):
        spec = {"models": {"root": model}, "agents": [AGENT]}
        error = assert_openai_error(await runs_client.post("/v1/runs", json={"spec": spec, "document": DOC}), 400)
        assert "not a member of this server's family" in error["message"]
    assert canary.nothing_happened()


async def test_a_document_that_names_a_file_is_read_as_text(runs_client, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the secret " * 60)
    spec = {"models": {"root": "root"}, "agents": [AGENT]}
    tokens = {}
    for document in (str(secret), secret.read_text()):
        response = await runs_client.post("/v1/runs", json={"spec": spec, "document": document})
        tokens[document] = (await finish_run(runs_client, response.json()["id"]))["report"]["document_tokens"]
    assert tokens[str(secret)] < tokens[secret.read_text()]  # the path's own few tokens, not the file's words


async def test_the_operators_pipelines_name_their_own_python(tiny_serve_family, canary, tmp_path):
    folder = tmp_path / "pipelines"
    folder.mkdir()
    (folder / "own.yaml").write_text(f"models: {{root: root}}\nsteps: [{{name: s, call: '{canary.name}:step'}}]\n"
                                     "agents: [{name: a, model: root, spec: {task: x, generation: "
                                     "{max_new_tokens: 2}}}]\n")
    engine = tiny_engine(tiny_serve_family, pipelines_dir=folder)
    async with asgi_client(engine) as client:
        response = await client.post("/v1/runs", json={"pipeline": "own", "document": DOC})
        assert response.status_code == 201, response.text
        report = (await finish_run(client, response.json()["id"]))["report"]
    assert {a["name"]: a["status"] for a in report["agents"]}["s"] == "succeeded"
    assert (canary.markers / "ran-step").exists()


async def test_a_client_pipeline_may_use_the_built_in_tool(runs_client):
    response = await runs_client.post("/v1/runs", json={"spec": _with_agent_spec(tools=["agents.tools:find"]),
                                                   "document": DOC})
    assert response.status_code == 201, response.text
    assert (await runs_client.delete(f"/v1/runs/{response.json()['id']}")).status_code in (200, 409)


def test_the_operator_cannot_allow_python_itself():
    for prefix in ("os", "subprocess", "builtins", "importlib.util", "__main__"):
        with pytest.raises(ValueError, match="part of Python itself"):
            ServeConfig(allow_code=[prefix])
    with pytest.raises(ValueError, match="not a module prefix"):
        ServeConfig(allow_code=["my pkg"])


# -- generated pipelines ----------------------------------------------------------------------------------------
def _references(canary_names: list[str]) -> st.SearchStrategy[str]:
    modules = st.sampled_from([*canary_names, *UNLOADED_STDLIB, "os", "subprocess", "builtins", "importlib",
                               "pickle", "ctypes", "shutil"])
    attrs = st.sampled_from(["run", "step", "system", "loads", "Popen", "exec", "run_path", "main", "Out",
                             "_private", "shell", "lookup", "__init__", "path.join"])
    return st.one_of(
        st.builds(lambda m, a: f"{m}:{a}", modules, attrs),
        st.builds(lambda m, a: f"{m}.{a}", modules, attrs),  # the dotted form an output model may take
        st.builds(lambda m, a, b: f"{m}:{a}:{b}", modules, attrs, attrs),
        st.builds(lambda m, a: f" {m}:{a}\n", modules, attrs),
    )


def _specs(references: st.SearchStrategy[str]) -> st.SearchStrategy[dict]:
    json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8), references)
    noise = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                            st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                         max_leaves=6)
    tool = st.one_of(references, st.fixed_dictionaries({"name": st.just("t"), "description": st.just(""),
                                                        "call": references, "parameters": st.just({})}))
    agent_spec = st.fixed_dictionaries({"task": st.just("x")}, optional={
        "tools": st.one_of(references, st.lists(tool, max_size=3)),
        "output": st.fixed_dictionaries({"kind": st.just("json")}, optional={"model": references}),
        "extra": noise})
    agent = st.fixed_dictionaries({"name": st.sampled_from(["a", "b"]), "model": st.just("root"),
                                   "spec": agent_spec}, optional={"when": st.one_of(references, noise)})
    step = st.fixed_dictionaries({"name": st.sampled_from(["s", "t"]), "call": references},
                                 optional={"when": references, "upstream": noise})
    # at least one step, so that every pipeline names Python and none starts a run
    return st.fixed_dictionaries({"models": st.just({"root": "root"}), "agents": st.lists(agent, min_size=1,
                                                                                          max_size=3),
                                  "steps": st.lists(step, min_size=1, max_size=3)},
                                 optional={"inputs": noise, "name": noise})


def test_no_generated_client_pipeline_imports_a_module_the_operator_did_not_allow(runs_engine, tmp_path_factory):
    site = tmp_path_factory.mktemp("canary_site")
    markers = tmp_path_factory.mktemp("canary_markers")
    names = [f"canary_{uuid.uuid4().hex[:10]}" for _ in range(3)]
    for name in names:
        (site / f"{name}.py").write_text(f"import pathlib\npathlib.Path({str(markers)!r}, {name!r}).touch()\n"
                                         "def run(**kw) -> str:\n    return 'ran'\n")
    before = set(sys.modules)
    sys.path.insert(0, str(site))
    try:
        with TestClient(create_app(engine=runs_engine)) as http:
            @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
            @given(_specs(_references(names)))
            def refused(spec: dict) -> None:
                response = http.post("/v1/runs", json={"spec": spec, "document": DOC})
                assert 400 <= response.status_code < 500, response.text
                loaded = {m.split(".")[0] for m in set(sys.modules) - before}
                assert not loaded & {*names, *(m.split(".")[0] for m in UNLOADED_STDLIB)}, loaded
                assert not any(markers.iterdir())
                assert client_spec_reach(spec).code and response.status_code == 403, response.text

            refused()
    finally:
        sys.path.remove(str(site))


# -- a live server --------------------------------------------------------------------------------------------------
def test_a_live_server_refuses_client_code_over_http_and_the_openai_client(tiny_family_home, canary, server_factory,
                                                                          tmp_path):
    """`orchestra serve` as an operator starts it, allowing one package: the attack and a re-export of it are
    refused to raw HTTP and to the official client (PermissionDeniedError), while the allowed step runs."""
    server = server_factory(tiny_family_home, "--allow-code", canary.name, env={"PYTHONPATH": os.pathsep.join(
        filter(None, [str(canary.site), os.environ.get("PYTHONPATH")]))})
    marker = tmp_path / "MARKER"
    response = httpx.post(f"{server.base_url}/v1/runs", json=_attack(marker), timeout=HANG_GUARD_S)
    assert_openai_error(response, 403, "not_allowed", param="spec")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD_S)
    for call in ("subprocess:run", f"{canary.name}:shell", f"{canary.name}:_private"):
        with pytest.raises(openai.PermissionDeniedError, match=re.escape(call)):
            client.post("/runs", cast_to=object, body={"spec": _with_step(call), "document": DOC})
    assert not marker.exists() and not canary.ran()
    started = client.post("/runs", cast_to=object, body={"spec": _with_step(f"{canary.name}.steps:step"),
                                                          "document": DOC})
    status: dict = {}

    def ended() -> bool:
        status.update(httpx.get(f"{server.base_url}/v1/runs/{started['id']}", timeout=HANG_GUARD_S).json())  # type: ignore[index]
        return status["status"] != "running"

    wait_until(ended, what="the allowed run to end", alive=server.process)
    assert status["status"] == "succeeded", status
    assert (canary.markers / "ran-step").exists()
