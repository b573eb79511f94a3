"""Quiet as a library: orchestra's log events go to the standard `logging` module, which shows no info lines
until the application turns logging on; an application's own structlog configuration is followed instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.waiting import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]

# A one-agent run on the tiny family through the Python API; prints the kinds of the events `on_event` got.
# transformers' own "Loading weights" bars are its business, not orchestra's: turned off so stderr is orchestra's.
_RUN = textwrap.dedent("""
    import json, logging, sys
    if sys.argv[2] == "info":
        logging.basicConfig(level=logging.INFO)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    from orchestra import Pipeline
    pipeline = (Pipeline("quiet", source="base", models={"base": sys.argv[1]}, default_device="cpu")
                .agent({"name": "a", "task": "Summarise.", "generation": {"max_new_tokens": 2}}, model="base"))
    kinds = []
    report = pipeline.run_sync("The committee reviewed the annual report. " * 5, on_event=lambda e: kinds.append(e.kind))
    pipeline.close()
    print(json.dumps({"kinds": kinds, "status": report.agent("a").status}))
""")


def _python(code: str, *args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ORCHESTRA_HOME": str(tmp_path / "home"), "ORCHESTRA_KV_STORE": "off",
           "TRANSFORMERS_VERBOSITY": "error"}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=HANG_GUARD_S)


@pytest.fixture(scope="module")
def runs(fam, tmp_path_factory) -> dict[str, subprocess.CompletedProcess[str]]:
    tmp = tmp_path_factory.mktemp("logging")
    return {mode: _python(_RUN, str(fam.parent), mode, tmp_path=tmp) for mode in ("quiet", "info")}


def test_a_run_through_the_python_api_prints_nothing(runs):
    quiet = runs["quiet"]
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert quiet.stderr == ""  # no info line of orchestra's (it printed one per event on stdout before)
    (line,) = quiet.stdout.splitlines()  # the script's own line alone
    result = json.loads(line)
    assert result["status"] == "succeeded"
    assert result["kinds"][0] == "run_started" and result["kinds"][-1] == "run_finished" and "token" in result["kinds"]


def test_with_logging_at_info_each_event_is_an_info_line_on_stderr_and_the_events_are_unchanged(runs):
    quiet, info = runs["quiet"], runs["info"]
    assert info.returncode == 0, info.stderr[-3000:]
    (line,) = info.stdout.splitlines()  # logs never go to stdout
    kinds = json.loads(line)["kinds"]
    assert kinds == json.loads(quiet.stdout)["kinds"]  # what on_event gets does not depend on logging
    logged = [entry.split(":", 2)[2] for entry in info.stderr.splitlines() if entry.startswith("INFO:orchestra:")]
    assert [entry.split(" ", 1)[0] for entry in logged] == [k for k in kinds if k != "token"], info.stderr[-3000:]
    started = next(entry for entry in logged if entry.startswith("agent_started "))
    assert " agent=a " in f"{started} " and " model=base" in started and " run_id=" in started


def test_warnings_reach_stderr_by_default_and_structlog_configured_by_the_application_is_followed(tmp_path):
    code = textwrap.dedent("""
        import structlog, structlog.testing
        from orchestra._logging import get_logger
        log = get_logger("orchestra.kvstore")
        log.info("kv_store_opened", path="/tmp/kv")  # below warnings: silent
        log.warning("kv_store_read_only", reason="no space left")
        with structlog.testing.capture_logs() as captured:  # the application configures structlog
            log.info("cache_loaded", member="root", tokens=3)
        print(captured)
    """)
    out = _python(code, tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr == "kv_store_read_only reason='no space left'\n"  # Python's last-resort handler: message only
    assert out.stdout.strip() == "[{'member': 'root', 'tokens': 3, 'event': 'cache_loaded', 'log_level': 'info'}]"
