"""The family cache inside real vLLM engines: saved by one member's engine, loaded exact by the next engine of
that member, loaded mapped by another member's, recomputed when an entry is damaged or a map is missing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from orchestra.vllm import connector_config

DRIVER = Path(__file__).with_name("driver.py")
ROOT = Path(__file__).resolve().parents[2]
DOCUMENT = ("The committee reviewed the annual report and found that revenue grew in every region. "
            "Costs fell as the new plant came online, and the board approved a dividend. ") * 4
PROMPTS = [DOCUMENT + q for q in (" Revenue", " Costs fell", " The board")]


def run_engine(model: Path, tmp: Path, *, home: Path | None = None, member: str | None = None,
               store: Path | None = None) -> tuple[list[dict], list[dict]]:
    """One engine over PROMPTS: its answers, and the connector's events (none without a connector)."""
    prompts = tmp / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    cmd = [sys.executable, str(DRIVER), str(model), str(prompts)]
    events = tmp / f"events-{len(list(tmp.glob('events-*')))}.jsonl"
    if home is not None and member is not None:
        config = connector_config(str(home), member, store=str(store) if store else None, events=str(events),
                                  min_tokens=32, min_mapped_tokens=32)
        path = tmp / "connector.json"
        path.write_text(json.dumps(config))
        cmd += ["--connector", str(path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    answers = [json.loads(line[len("RESULT "):]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(answers) == len(PROMPTS), done.stdout[-2000:]
    log = [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []
    return answers, log


def of(log: list[dict], event: str) -> list[dict]:
    return [e for e in log if e["event"] == event]


@pytest.fixture(scope="module")
def family(calibrated_family: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The calibrated family, and the base's answers computed by a first engine, which saved every prompt."""
    tmp = tmp_path_factory.mktemp("seed")
    answers, log = run_engine(calibrated_family["tiny"].parent, tmp, home=calibrated_family["home"], member="base")
    return {**calibrated_family, "tmp": tmp, "base": answers, "seed_log": log}


@pytest.fixture(scope="module")
def tuned_own(calibrated_family: dict, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The tuned member's answers on its own prefill: its engine without the connector."""
    answers, _ = run_engine(calibrated_family["tiny"].child, tmp_path_factory.mktemp("own"))
    return answers


def test_the_first_engine_saves_every_prompt_it_computes_under_its_members_exact_namespace(family: dict) -> None:
    from orchestra.familycache import KVStore

    assert len(of(family["seed_log"], "saved")) == len(PROMPTS)
    assert not of(family["seed_log"], "load")  # an empty store gives nothing
    entries = KVStore(family["home"] / "kv").entries()
    assert {e.namespace.kind for e in entries} == {"exact"}
    # the prompts share the document: the store keeps an entry only where a prompt adds enough new tokens
    assert 1 <= len({e.tokens for e in entries}) <= len(PROMPTS)
    assert min(len(e.tokens) for e in entries) >= 300


def test_a_new_engine_of_the_member_loads_its_stored_prompts_exact_and_answers_the_same(family: dict,
                                                                                        tmp_path: Path) -> None:
    answers, log = run_engine(family["tiny"].parent, tmp_path, home=family["home"], member="base")
    loads = of(log, "loaded")
    # the first prompt loads the document from the store; the others find it in vLLM's own prefix cache
    assert loads and {e["kind"] for e in loads} == {"exact"}
    assert all(e["tokens"] >= 128 for e in loads)
    assert [a["ids"] for a in answers] == [a["ids"] for a in family["base"]]
    assert all(a["cached"] >= 128 for a in answers)  # vLLM counts the loaded tokens as cached


def test_another_member_loads_the_document_mapped_and_answers_as_on_its_own_prefill(family: dict, tuned_own: list,
                                                                                   tmp_path: Path) -> None:
    from orchestra.family.manifest import load_family
    from orchestra.familycache import KVStore

    answers, log = run_engine(family["tiny"].child, tmp_path, home=family["home"], member="tuned")
    planned = of(log, "load")
    # mapped blocks never enter vLLM's exact prefix cache: every prompt loads its own mapped prefix
    assert [e["kind"] for e in planned] == ["mapped"] * len(PROMPTS)
    assert all(e["source"] == "base" and "offline=pass" in e["gates"] for e in planned)
    assert [a["ids"] for a in answers] == [a["ids"] for a in tuned_own]
    # mapped KV never passes for exact: nothing was saved under the member's exact namespace
    assert not of(log, "save")
    tuned = load_family(family["home"]).member("tuned").fingerprint["combined"]
    kinds = {e.namespace.kind for e in KVStore(family["home"] / "kv").entries()
             if e.namespace.member_fingerprint == tuned}
    assert "exact" not in kinds


def test_a_damaged_entry_is_recomputed_by_the_engine_and_the_answer_is_unchanged(family: dict,
                                                                                tmp_path: Path) -> None:
    store = tmp_path / "kv"
    shutil.copytree(family["home"] / "kv", store, ignore=shutil.ignore_patterns(".lock"))
    for f in store.rglob("*.safetensors"):
        data = bytearray(f.read_bytes())
        data[-64:] = bytes(64)  # the tensors' last bytes: the header still reads, the hash fails
        f.write_bytes(bytes(data))
    answers, log = run_engine(family["tiny"].parent, tmp_path, home=family["home"], member="base", store=store)
    assert of(log, "load_failed")  # the hash check refuses it: the engine recomputes those blocks
    assert not of(log, "loaded")
    assert [a["ids"] for a in answers] == [a["ids"] for a in family["base"]]
    # removed when found, so that a later save replaces it
    assert not any(Path(e["entry"]).exists() for e in of(log, "load_failed"))


def test_a_member_without_a_map_computes_its_own_prefill(family: dict, tuned_own: list, tmp_path: Path) -> None:
    home = tmp_path / "home"
    shutil.copytree(family["home"], home, ignore=shutil.ignore_patterns("mappings", "kv-handoff", ".lock"))
    answers, log = run_engine(family["tiny"].child, tmp_path, home=home, member="tuned")
    assert not of(log, "loaded")
    assert len(of(log, "refused")) == len(PROMPTS)
    assert [a["ids"] for a in answers] == [a["ids"] for a in tuned_own]
