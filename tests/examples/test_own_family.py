"""examples/own_family/run.py on tiny models: a Hub-id base and a folder instruct sibling made a family with
`orchestra family init`, a peft LoRA adapter and an int8 view beside them, one pipeline over one prefill."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from examples.own_family import run as own_family
from orchestra.errors import install_command
from tests.fixtures.adapters import make_lora_adapter
from tests.fixtures.hubcache import hub_repo
from tests.tiny_family import build_tiny_family

CONTEXT = 4096  # the tiny models are made with 512 positions; the document and the agents' prompts need more
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> SimpleNamespace:
    """The tiny llama pair (in a folder of this module's own, its context raised) and a LoRA adapter over the parent."""
    scratch = tmp_path_factory.mktemp("own_family")
    fam = build_tiny_family(scratch, "llama")
    for folder in (fam.parent, fam.child):
        config = json.loads((folder / "config.json").read_text())
        config["max_position_embeddings"] = CONTEXT
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    adapter = make_lora_adapter(fam.parent, scratch / "legal-lora", layers=[2, 3], rank=4, scale=0.02, seed=1)
    return SimpleNamespace(base=fam.parent, instruct=fam.child, adapter=adapter)


@pytest.fixture
def offline_hub(models, tmp_path, monkeypatch) -> str:
    """The tiny parent as the Hub model `tiny/base` in a Hugging Face cache read offline; its id."""
    hub_repo(tmp_path / "hub", "tiny/base", models.base)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return "tiny/base"


@pytest.mark.filterwarnings("ignore:no mapping for")  # base -> adapter and base -> view are fitted on demand
def test_family_init_then_one_prefill_on_the_base_and_mapped_caches_for_instruct_adapter_and_int8_view(
        models, offline_hub, short_document_file, tmp_path, capsys):
    home, report_file = tmp_path / "home", tmp_path / "report.json"
    code = own_family.main(["--base", offline_hub, "--instruct", str(models.instruct), "--adapter", str(models.adapter),
                            "--document", str(short_document_file), "--home", str(home), "--tokens", "2048",
                            "--report", str(report_file)])
    out = capsys.readouterr().out
    assert code == 0, out

    # `orchestra family init` made the family: the Hub model is the source, the folder a member by its name
    manifest = json.loads((home / "family" / "family.json").read_text())
    assert manifest["family"] == "own" and list(manifest["members"]) == ["base", "instruct"]
    assert manifest["members"]["base"]["role"] == "root" and manifest["members"]["base"]["made_by"]["kind"] == "hub"
    assert "$ orchestra family init own base=tiny/base instruct=" in out and "calibrated base__to__instruct" in out

    report = json.loads(report_file.read_text())
    agents = {a["name"]: a for a in report["agents"]}
    expected = {"answer": "base", "summary": "instruct", "clauses": "legal"} | ({"check": "base8"} if HAS_TORCHAO else {})
    assert {name: a["model"] for name, a in agents.items()} == expected
    assert all(a["status"] == "succeeded" and a["output"].strip() for a in agents.values()), agents
    assert [c["model"] for c in report["caches"] if c["path"] == "exact"] == ["base"]  # one document prefill
    assert agents["answer"]["cache_path"] == "exact"
    for name in expected.keys() - {"answer"}:  # the others run on the base's cache mapped into them, gates passed
        assert agents[name]["cache_path"] == "mapped" and agents[name]["fallback_reason"] is None, agents[name]
        assert {g["gate"] for g in agents[name]["gate"] if g["passed"]} == {"offline", "probe"}
    for name, member in expected.items():
        assert f"== {name} on {member} (succeeded, cache: {agents[name]['cache_path']})" in out
    if not HAS_TORCHAO:
        assert install_command("quant") in out


def test_a_missing_adapter_folder_is_one_line_and_exit_2(models, short_document_file, tmp_path, capsys):
    code = own_family.main(["--base", str(models.base), "--instruct", str(models.instruct),
                            "--adapter", str(tmp_path / "no-such-lora"), "--document", str(short_document_file),
                            "--home", str(tmp_path / "home")])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().splitlines() == [f"error: --adapter {tmp_path / 'no-such-lora'} does not exist"]
    assert not (tmp_path / "home").exists()  # refused before `family init` wrote anything


def test_a_base_model_not_in_the_offline_hub_cache_is_one_line_and_exit_2(models, offline_hub, short_document_file,
                                                                          tmp_path, capsys):
    code = own_family.main(["--base", "tiny/absent", "--instruct", str(models.instruct), "--adapter",
                            str(models.adapter), "--document", str(short_document_file), "--home", str(tmp_path / "h")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and "hf download tiny/absent" in err[0], err


def test_the_example_pipeline_declares_an_adapter_and_an_int8_view(tmp_path: Path):
    from orchestra import PipelineSpec
    from orchestra.models.modelref import AdapterSpec, QuantizeSpec

    spec = PipelineSpec.model_validate(own_family.pipeline_spec(tmp_path / "lora", 512, int8=True))
    assert spec.models["legal"] == AdapterSpec(adapter=str(tmp_path / "lora"), base="base")
    assert spec.models["base8"] == QuantizeSpec(base="base", quantize="int8")
    without = PipelineSpec.model_validate(own_family.pipeline_spec(tmp_path / "lora", 512, int8=False))
    assert "base8" not in without.models and all(a.model != "base8" for a in without.agents)
