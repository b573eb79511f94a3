"""Durable runs: a run killed (SIGKILL) at an agent resumes from its checkpoint to what an uninterrupted run gives.

The runs are real processes on the tiny llama pair: one is killed by its own event hook at a known point
(an agent finished, or an agent started), another resumes it from the SQLite checkpoint.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from orchestra.errors import RunResumeError
from orchestra.family.corpus import data_text
from orchestra.observability.report import AgentReport
from orchestra.runs.checkpoint import MemoryCheckpointer, RunIdentity, SqliteCheckpointer
from tests.cli_run import run_pipeline_text
from tests.waiting import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[3]
DOC = data_text("gpl-3.txt")[:300]

RUNNER = textwrap.dedent("""
    import json, os, signal, sys
    from orchestra import Pipeline
    parent, child, maps, db, doc_path, kill_at, out = sys.argv[1:8]
    p = (Pipeline("durable", source="base", models={"base": parent, "child": child}, default_device="cpu",
                  mapping={"directory": maps, "on_missing": "calibrate"}, kv_store={"enabled": False})
         .with_checkpointer(db)
         .agent({"name": "first", "task": "Answer briefly: who may copy it?", "generation": {"max_new_tokens": 4}},
                model="base")
         .agent({"name": "second", "task": "Check this answer: {first}", "generation": {"max_new_tokens": 4}},
                model="child")
         .agent({"name": "third", "task": "Say if {second} agrees with {first}.",
                 "generation": {"max_new_tokens": 4}}, model="base"))

    def hook(event):
        if kill_at != "-" and f"{event.kind}:{getattr(event, 'agent', '')}" == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    report = p.run_sync(open(doc_path).read(), on_event=hook, run_id="r1", resume=kill_at == "-" and os.path.exists(out + ".resume"))
    open(out, "w").write(report.model_dump_json())
""")


def _run(fam, mapstore, tmp_path: Path, db: Path, kill_at: str, out: Path, *, resume: bool = False) -> int:
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    if resume:
        Path(str(out) + ".resume").write_text("")
    done = subprocess.run([sys.executable, "-c", RUNNER, str(fam.parent), str(fam.child), str(mapstore.directory),
                           str(db), str(doc), kill_at, str(out)], cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert done.returncode in (0, -9), done.stderr[-3000:]
    return done.returncode


@pytest.fixture(scope="module")
def uninterrupted(fam, mapstore, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    out = tmp / "report.json"
    assert _run(fam, mapstore, tmp, tmp / "runs.sqlite", "-", out) == 0
    report = json.loads(out.read_text())
    assert [a["status"] for a in report["agents"]] == ["succeeded"] * 3, report["agents"]
    return report


@pytest.mark.parametrize(("kill_at", "kept"), [
    ("agent_finished:first", ["first"]),
    ("agent_started:third", ["first", "second"]),
    ("agent_finished:third", ["first", "second", "third"]),
])
def test_a_run_killed_at_an_agent_resumes_to_what_an_uninterrupted_run_gives(fam, mapstore, tmp_path, uninterrupted,
                                                                              kill_at, kept):
    db, out = tmp_path / "runs.sqlite", tmp_path / "report.json"
    assert _run(fam, mapstore, tmp_path, db, kill_at, out) == -9 and not out.exists()
    recorded = SqliteCheckpointer(db).get("r1")
    assert recorded is not None and not recorded.finished and sorted(recorded.agents) == sorted(kept)
    assert _run(fam, mapstore, tmp_path, db, "-", out, resume=True) == 0
    resumed = json.loads(out.read_text())
    assert resumed["restored"] == kept
    assert [(a["name"], a["status"], a["output"]) for a in resumed["agents"]] == \
        [(a["name"], a["status"], a["output"]) for a in uninterrupted["agents"]]
    assert SqliteCheckpointer(db).get("r1").finished


def _identity(**change) -> RunIdentity:
    return RunIdentity(**{"pipeline": "p", "pipeline_digest": "a", "document_digest": "d", "inputs": {}, **change})


@pytest.mark.parametrize("checkpointer", ["memory", "sqlite"])
def test_a_run_resumes_only_with_its_own_pipeline_document_and_inputs(tmp_path, checkpointer):
    store = MemoryCheckpointer() if checkpointer == "memory" else SqliteCheckpointer(tmp_path / "runs.sqlite")
    with pytest.raises(RunResumeError, match="no run 'r1' to resume"):
        store.resume_state("r1", _identity(), must_exist=True)
    assert store.resume_state("r1", _identity()) is None  # a new run under that id
    store.begin("r1", _identity())
    store.record("r1", AgentReport(name="a", model="m", status="succeeded", output="x"), "x")
    store.record("r1", AgentReport(name="b", model="m", status="failed"), None)
    state = store.resume_state("r1", _identity(), must_exist=True)
    assert state is not None and set(state.agents) == {"a", "b"} and state.outputs == {"a": "x"}
    for change, why in [({"pipeline_digest": "b"}, "is not the pipeline"), ({"document_digest": "e"}, "the document"),
                        ({"inputs": {"q": "?"}}, "the inputs differ")]:
        with pytest.raises(RunResumeError, match=why):
            store.resume_state("r1", _identity(**change))


def test_the_cli_resume_of_an_unknown_run_is_exit_2_and_one_line(fam, mapstore, tmp_path):
    yaml = (f"models: {{base: '{fam.parent}'}}\nsource: base\ndefault_device: cpu\n"
            f"mapping: {{directory: '{mapstore.directory}'}}\n"
            "agents:\n  - {name: a, model: base, spec: {task: 'Answer: who may copy it?', "
            "generation: {max_new_tokens: 3}}}\n")
    code, lines, out = run_pipeline_text(tmp_path, yaml, DOC, "--resume", "nosuchrun")
    assert code == 2 and len(lines) == 1 and "no run 'nosuchrun' to resume" in lines[0], out
    code, lines, out = run_pipeline_text(tmp_path, yaml, DOC)
    assert code == 0, out
    run_id = out.split("--resume ", 1)[1].split("`", 1)[0]
    code, lines, out = run_pipeline_text(tmp_path, yaml, DOC, "--resume", run_id, "--report", str(tmp_path / "r.json"))
    assert code == 0, out
    assert json.loads((tmp_path / "r.json").read_text())["restored"] == ["a"]  # a finished run keeps its results
