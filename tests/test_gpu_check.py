"""scripts/gpu_check.py's parts that need no GPU: the vLLM steps' skip decision, the benchmark's headline
numbers and the summary's Markdown, and how a step out of time is stopped."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake_python(tmp_path: Path, body: str) -> str:
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def test_the_vllm_steps_are_skipped_with_the_reason_where_vllm_does_not_import(gpu_check, tmp_path):
    python = _fake_python(tmp_path, "echo \"ModuleNotFoundError: No module named 'vllm'\" >&2; exit 1")
    reason, version = gpu_check.vllm_skip_reason(python)
    assert version is None
    assert "No module named 'vllm'" in reason and "--vllm-python" in reason
    reason, _ = gpu_check.vllm_skip_reason(str(tmp_path / "missing-python"))
    assert reason is not None and "cannot run" in reason


def test_the_vllm_steps_run_where_vllm_imports(gpu_check, tmp_path):
    assert gpu_check.vllm_skip_reason(_fake_python(tmp_path, "echo 0.11.0")) == (None, "0.11.0")


def test_the_benchmarks_headline_numbers_per_way_in_the_benchmarks_order(gpu_check):
    report = {"runs": {way: {"wall_s": w, "document_tokens_computed": t, "decode_tokens_per_s": d, "ttft_s": {}}
                       for way, w, t, d in (("langgraph_vllm", 13.0, 2303, 15.1), ("orchestra", 10.7, 1190, 13.2),
                                            ("orchestra_vllm", 10.5, 1278, 17.2))}}
    headline = gpu_check.vllm_headline(report)
    assert list(headline) == ["orchestra", "orchestra_vllm", "langgraph_vllm"]
    assert headline["orchestra_vllm"] == {"wall_s": 10.5, "document_tokens_computed": 1278, "decode_tokens_per_s": 17.2}


def test_the_summary_reports_skipped_vllm_steps_as_skipped_not_failed(gpu_check):
    reason = "`import vllm` fails in python"
    summary = {"devices": ["cuda:0 H100"], "torch": "2.13", "member_devices": {}, "evaluate": {}, "runs": {},
               "ray_matches_local": None,
               "steps": [{"step": "demo_local", "rc": 0, "seconds": 3.0},
                         *({"step": name, "rc": None, "skipped": reason} for name in gpu_check.VLLM_STEPS)],
               "vllm": {"python": "python", "version": None, "skipped": reason, "bench": None,
                        "steps": dict.fromkeys(gpu_check.VLLM_STEPS, "skip")}}
    md = gpu_check._markdown(summary)
    assert "| vllm_connector | skipped | - |" in md and "| demo_local | 0 | 3.0 |" in md
    assert f"Skipped: {reason}." in md and "- vllm_family_bench: **skip**" in md


def test_the_summary_has_the_benchmarks_numbers_when_it_ran(gpu_check):
    vllm = {"python": "python", "version": "0.11.0", "skipped": None,
            "steps": {"vllm_connector": "pass", "vllm_family_bench": "pass"},
            "bench": {"report": "out/vllm/vllm_family.json",
                      "ways": {"orchestra_vllm": {"wall_s": 4.2, "document_tokens_computed": 1278,
                                                  "decode_tokens_per_s": 90.5}}}}
    md = "\n".join(gpu_check.vllm_markdown(vllm))
    assert "- vllm_connector: **pass**" in md and "| orchestra_vllm | 4.2 | 1278 | 90.5 |" in md


def test_a_step_out_of_time_is_stopped_with_what_it_started(gpu_check, tmp_path):
    pid_file = tmp_path / "child.pid"
    cmd = [sys.executable, "-c", "import subprocess, sys, time; "
           f"p = subprocess.Popen(['sleep', '30']); open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(30)"]
    t0 = time.monotonic()
    assert gpu_check.run_logged(cmd, tmp_path / "step.log", 0.5) == 124
    assert time.monotonic() - t0 < 5
    child = Path(f"/proc/{pid_file.read_text()}/stat")
    while time.monotonic() - t0 < 5 and _alive(child):  # SIGKILL is sent; its exit takes a moment
        time.sleep(0.01)
    assert not _alive(child)
    assert gpu_check.run_logged([sys.executable, "-c", "print('hi')"], tmp_path / "ok.log", 10, {"X": "1"}) == 0
    assert (tmp_path / "ok.log").read_text() == "hi\n"


def _alive(stat: Path) -> bool:
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False
