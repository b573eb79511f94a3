"""LoRA adapters in one vLLM engine share a document's cache: a request on an adapter loads, mapped, the document
its base or a sibling adapter computed in the same engine, instead of computing it again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestra.vllm import connector_config
from tests.fixtures.adapters import make_lora_adapter

DRIVER = Path(__file__).with_name("driver.py")
ROOT = Path(__file__).resolve().parents[2]
DOCUMENT = ("The committee reviewed the annual report and found that revenue grew in every region. "
            "Costs fell as the new plant came online, and the board approved a dividend. ") * 4
QUESTIONS = (" Revenue", " Costs fell", " The board")


@pytest.fixture(scope="module")
def adapters(calibrated_family: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("loras")
    base = calibrated_family["tiny"].parent
    # `legal` adapts every layer; `code` only the upper two, so its maps keep the lower layers' K/V exact
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    return {"legal": make_lora_adapter(base, tmp / "legal", targets=attention, scale=0.05, seed=1),
            "code": make_lora_adapter(base, tmp / "code", layers=[2, 3], targets=attention, scale=0.05, seed=2)}


def run_engine(family: dict, adapters: dict[str, Path], tmp: Path, prompts: list[dict], *,
               connector: bool = True) -> tuple[list[dict], list[dict]]:
    """One engine of the base serving both adapters, the prompts one after another: answers and events."""
    (tmp / "prompts.json").write_text(json.dumps(prompts))
    cmd = [sys.executable, str(DRIVER), str(family["tiny"].parent), str(tmp / "prompts.json"), "--sequential"]
    cmd += [f"--lora={name}={folder}" for name, folder in adapters.items()]
    events = tmp / "events.jsonl"
    if connector:
        config = connector_config(str(family["home"]), "base", store=str(tmp / "kv"), events=str(events),
                                  mapping_dir=str(tmp / "mappings"), min_tokens=32, min_mapped_tokens=32,
                                  adapters={name: str(folder) for name, folder in adapters.items()},
                                  calibrate=True, calibrate_tokens=2048)
        (tmp / "connector.json").write_text(json.dumps(config))
        cmd += ["--connector", str(tmp / "connector.json")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    answers = [json.loads(line[len("RESULT "):]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(answers) == len(prompts), done.stdout[-2000:]
    log = [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []
    return answers, log


def of(log: list[dict], event: str) -> list[dict]:
    return [e for e in log if e["event"] == event]


def on(lora: str | None, question: str) -> dict:
    return {"prompt": DOCUMENT + question, "lora": lora}


@pytest.fixture(scope="module")
def own_prefill(calibrated_family: dict, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Each adapter's answers on its own prefill: the same engine without the connector."""
    prompts = [on(lora, q) for lora in ("legal", "code") for q in QUESTIONS]
    answers, _ = run_engine(calibrated_family, adapters, tmp_path_factory.mktemp("own"), prompts, connector=False)
    return {(p["lora"], p["prompt"]): a["ids"] for p, a in zip(prompts, answers, strict=True)}


def test_an_adapter_loads_the_document_its_base_computed_mapped_in_the_same_engine(
        calibrated_family: dict, adapters: dict[str, Path], own_prefill: dict, tmp_path: Path) -> None:
    from orchestra.familycache import KVStore

    prompts = [on(None, QUESTIONS[0]), on("legal", QUESTIONS[1]), on("code", QUESTIONS[2])]
    answers, log = run_engine(calibrated_family, adapters, tmp_path, prompts)
    saves, loads = of(log, "save"), of(log, "load")
    assert [e["member"] for e in saves] == ["base"]  # only the base's prefill is the engine's own
    assert [(e["member"], e["kind"], e["source"]) for e in loads] == [("legal", "mapped", "base"),
                                                                     ("code", "mapped", "base")]
    assert all(e["tokens"] >= 128 and "offline=pass" in e["gates"] for e in loads)
    assert answers[1]["cached"] >= 128 and answers[2]["cached"] >= 128  # vLLM counts them as cached
    for prompt, answer in zip(prompts[1:], answers[1:], strict=True):
        assert answer["ids"] == own_prefill[(prompt["lora"], prompt["prompt"])]
    # mapped KV never passes for exact: the store holds exact entries of the base only
    exact = {e.namespace.member_fingerprint for e in KVStore(tmp_path / "kv").entries() if e.namespace.kind == "exact"}
    assert len(exact) == 1
    # `code` leaves layers 0-1 alone: its map from the base passes them through, fitted only above
    manifests = {p.parent.name.split("__to__")[1].split("__")[0]: json.loads(p.read_text())
                 for p in (tmp_path / "mappings").glob("*/manifest.json")}
    assert manifests["code"]["exact_layers"] == 2 and manifests["legal"]["exact_layers"] == 0


def test_an_adapter_loads_the_document_a_sibling_adapter_computed_mapped(
        calibrated_family: dict, adapters: dict[str, Path], own_prefill: dict, tmp_path: Path) -> None:
    prompts = [on("legal", QUESTIONS[0]), on("code", QUESTIONS[1]), on("legal", QUESTIONS[2])]
    answers, log = run_engine(calibrated_family, adapters, tmp_path, prompts)
    assert {e["member"] for e in of(log, "save")} == {"legal"}  # both of legal's prompts; code's was mapped
    loads = of(log, "load")
    # `code` maps the document `legal` computed; `legal`'s second question finds it in vLLM's own prefix cache
    assert [(e["member"], e["kind"], e["source"]) for e in loads] == [("code", "mapped", "legal")]
    assert answers[1]["cached"] >= 128 and answers[2]["cached"] >= 128
    assert answers[1]["ids"] == own_prefill[("code", prompts[1]["prompt"])]
    assert answers[2]["ids"] == own_prefill[("legal", prompts[2]["prompt"])]


def test_a_lora_the_connector_was_not_told_of_is_neither_loaded_nor_saved(
        calibrated_family: dict, adapters: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "prompts.json").write_text(json.dumps([on(None, QUESTIONS[0]), on("legal", QUESTIONS[1])]))
    config = connector_config(str(calibrated_family["home"]), "base", store=str(tmp_path / "kv"),
                              events=str(tmp_path / "events.jsonl"), min_tokens=32, min_mapped_tokens=32)
    (tmp_path / "connector.json").write_text(json.dumps(config))
    done = subprocess.run([sys.executable, str(DRIVER), str(calibrated_family["tiny"].parent),
                           str(tmp_path / "prompts.json"), "--sequential", f"--lora=legal={adapters['legal']}",
                           "--connector", str(tmp_path / "connector.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    log = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["adapter"] for e in of(log, "unknown_adapter")] == ["legal"]
    assert [e["member"] for e in of(log, "save")] == ["base"]
    assert not of(log, "load")
