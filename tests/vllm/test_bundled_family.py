"""The bundled SmolLM2 family in real vLLM engines: a document computed on the root is answered on the fine-tuned
member from the mapped cache, gated, as that member answers on its own prefill."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestra.documents.texts import data_text
from orchestra.vllm import connector_config

DRIVER = Path(__file__).with_name("driver.py")
ROOT = Path(__file__).resolve().parents[2]
QUESTION = "In one sentence: what does this licence let people do with the software?"


@pytest.fixture(scope="module")
def bundled(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The family the main suite builds (CI runs it first) and a store of this test's own."""
    from orchestra.errors import OrchestraError
    from orchestra.family.manifest import load_family
    from orchestra.paths import resolve_home

    home = resolve_home(os.environ.get("ORCHESTRA_HOME"))
    try:
        family = load_family(home)
    except OrchestraError as exc:
        raise AssertionError(f"these tests need the bundled family: run `orchestra family build` first ({exc})") from exc
    names = {r.role: n for n, r in family.members.items()}
    mapping = next((home / "mappings").glob(f"{names['root']}__to__{names['finetuned']}__*"), None)
    assert mapping is not None, "the root -> finetuned map is missing: run the main suite or `orchestra family calibrate`"
    return {"home": home, "family": family, "names": names, "tmp": tmp_path_factory.mktemp("bundled")}


def run_chat(bundled: dict, role: str, prompt: str, *, connector: bool) -> tuple[dict, list[dict]]:
    tmp: Path = bundled["tmp"]
    prompts = tmp / "prompts.json"
    prompts.write_text(json.dumps([prompt]))
    member = bundled["names"][role]
    cmd = [sys.executable, str(DRIVER), str(bundled["family"].member(member).path), str(prompts), "--chat",
           "--max-tokens", "16", "--max-model-len", "2048"]
    events = tmp / f"events-{role}.jsonl"
    if connector:
        config = tmp / f"connector-{role}.json"
        config.write_text(json.dumps(connector_config(str(bundled["home"]), member, store=str(tmp / "kv"),
                                                      events=str(events))))
        cmd += ["--connector", str(config)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    answer = next(json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT "))
    log = [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []
    return answer, log


def test_the_finetuned_member_answers_from_the_roots_document_mapped_as_on_its_own_prefill(bundled: dict) -> None:
    prompt = f"{data_text('gpl-3.txt')[:4500]}\n\n{QUESTION}"
    own, _ = run_chat(bundled, "finetuned", prompt, connector=False)
    _, root_log = run_chat(bundled, "root", prompt, connector=True)
    assert [e["tokens"] for e in root_log if e["event"] == "saved"] == [own["prompt_tokens"]]
    mapped, log = run_chat(bundled, "finetuned", prompt, connector=True)
    loads = [e for e in log if e["event"] == "load"]
    assert [e["kind"] for e in loads] == ["mapped"], log
    assert loads[0]["gates"] == ["offline=pass", "probe=pass"]
    assert mapped["cached"] >= loads[0]["tokens"] > 1000  # the document came from the root, through the map
    assert mapped["ids"] == own["ids"]
