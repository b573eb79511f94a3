"""What `orchestra run --events` prints: each event once, on one line, and warnings as one line each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestra.commands._live import RunDisplay, format_event
from orchestra.family.corpus import data_text
from orchestra.familycache import CacheStep
from orchestra.observability.events import AgentStarted, CacheStepEvent, GateResult, RunStarted, TokenEvent
from tests.tiny_family import build_tiny_family
from tests.waiting import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def fam(tiny_root):
    return build_tiny_family(tiny_root, "llama")


def _run(fam, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    pipeline = tmp_path / "p.yaml"
    # on_missing: calibrate, with no mapping in the store: calibrating on demand warns, which is the point
    pipeline.write_text(
        f"models: {{base: '{fam.parent}', child: '{fam.child}'}}\nsource: base\ndefault_device: cpu\n"
        "gate: {offline: null, probe: {tokens: 8, max_excess_nll: 100.0, max_excess_kl: 100.0}}\n"
        "mapping: {on_missing: calibrate, tokens: 512, method: ridge}\n"
        "agents:\n"
        "  - {name: first, model: base, spec: {task: Summarise., generation: {max_new_tokens: 4}}}\n"
        "  - {name: second, model: child, spec: {task: 'Check {first}', generation: {max_new_tokens: 4}}}\n")
    document = tmp_path / "doc.txt"
    document.write_text(data_text("gpl-3.txt")[:250])
    env = {**os.environ, "ORCHESTRA_HOME": str(tmp_path / "home"), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "orchestra", "run", str(pipeline), "--document", str(document),
                           *extra], capture_output=True, text=True, cwd=ROOT, env=env, timeout=HANG_GUARD_S)


def test_run_with_events_prints_each_event_once_and_warnings_as_one_line(fam, tmp_path):
    result = _run(fam, tmp_path, "--events")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    lines = out.splitlines()
    for agent, model in (("first", "base"), ("second", "child")):
        assert lines.count(f"{agent}: started on {model}") == 1, out
        assert lines.count(f"{agent}: finished") == 1, out
    assert sum(line.startswith("run ") and "agents over" in line for line in lines) == 1, out
    # structlog's own rendering of the same events (it was printed beside the console's line)
    assert "agent_started" not in out and "[info" not in out, out
    # the on-demand calibration warning: one line, no Python warning machinery around it
    warned = [line for line in lines if line.startswith("warning:")]
    assert warned and all("UserWarning" not in line for line in warned), out
    assert "UserWarning" not in result.stderr and "warnings.warn" not in result.stderr, result.stderr
    assert "Loading weights" not in result.stderr, result.stderr  # transformers' own bars, once per model
    assert len(warned) == len(set(warned)), out
    # the end: each agent's answer under its name, then the one table
    assert "first on base (succeeded)" in out and "second on child (succeeded)" in out
    assert "prefill s saved" in out and "cache" in out and "gates" in out


def test_run_without_events_prints_no_event_lines(fam, tmp_path):
    result = _run(fam, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "started on" not in result.stdout and "first on base (succeeded)" in result.stdout


def test_format_event_gives_one_line_and_none_for_tokens():
    step = CacheStepEvent(run_id="r", agent="facts", step=CacheStep(step="map", member="tuned", tokens=4470,
                                                                    source="root", seconds=0.42))
    assert format_event(step) == "facts: mapped 4,470 tokens root -> tuned (0.42 s)"
    gate = GateResult(run_id="r", agent="facts", model="tuned", passed=False, reason="probe NLL too high",
                      metrics={"excess_nll": 0.61})
    assert format_event(gate) == "facts: gate FAILED on tuned (excess_nll 0.61): probe NLL too high"
    assert format_event(TokenEvent(run_id="r", agent="facts", text="x", index=0)) is None
    started = RunStarted(run_id="r", agents=["a", "b"], source_model="root", document_tokens=4500)
    assert "\n" not in format_event(started)


def test_display_tracks_agent_state_from_events():
    from rich.console import Console

    console = Console(file=open(os.devnull, "w"), force_terminal=False)
    display = RunDisplay(console, [("facts", "tuned")])
    with display:
        display(AgentStarted(run_id="r", agent="facts", model="tuned"))
        assert display.rows["facts"].state == "getting its cache"
        display(TokenEvent(run_id="r", agent="facts", text="x", index=6))
    assert display.rows["facts"].state == "generating" and display.rows["facts"].tokens == 7
