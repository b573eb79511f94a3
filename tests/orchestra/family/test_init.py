"""`orchestra family init`: a family of one's own models (Hub ids from an offline cache, folders) that pipelines
run on like the bundled one, with fingerprints computed once at init and typed refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import mappings.fingerprint as fingerprint_module
from orchestra.cli import app
from orchestra.errors import CrossFamilyError, FamilyError
from orchestra.family import init_family, load_family
from orchestra.family.corpus import data_text
from orchestra.family.init import parse_member_arg
from orchestra.models.registry import ModelRegistry
from orchestra.pipelines.spec import PipelineSpec
from orchestra.runs.scheduler import Orchestra
from tests.fixtures.hubcache import hub_repo
from tests.tokenizer_variants import model_folder, save_edited_tokenizer, swap_ids

DOC = data_text("gpl-3.txt")[:320]


@pytest.fixture
def own(fam, tmp_path, monkeypatch):
    """The tiny parent as a Hub model in an offline cache, the tiny child as a plain folder, a fresh home."""
    cache = tmp_path / "hub"
    hub_repo(cache, "tiny/base", fam.parent)
    child = Path(shutil.copytree(fam.child, tmp_path / "tuned", ignore=shutil.ignore_patterns(".*")))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    home = tmp_path / "home"
    monkeypatch.setenv("ORCHESTRA_HOME", str(home))
    return home, child


def test_member_arguments_are_named_or_bare_references():
    assert parse_member_arg("tuned=/models/x").name == "tuned"
    assert parse_member_arg("org/name@v1").name is None
    assert parse_member_arg("org/name@v1").reference == "org/name@v1"


def test_init_records_hub_and_folder_members_with_the_registrys_fingerprints(own, fam, monkeypatch):
    home, child = own
    manifest = init_family("mine", ["tiny/base", f"tuned={child}"], home=home)
    assert manifest.family == "mine" and list(manifest.members) == ["base", "tuned"]
    base, tuned = manifest.member("root"), manifest.member("tuned")
    assert base.name == "base" and base.made_by["kind"] == "hub" and base.made_by["reference"] == "tiny/base"
    assert tuned.role == "external" and tuned.parent == "base" and tuned.made_by["kind"] == "folder"
    assert tuned.num_layers == json.loads((child / "config.json").read_text())["num_hidden_layers"]
    assert tuned.bytes == sum(f.stat().st_size for f in child.glob("*.safetensors")) and tuned.num_parameters > 0
    # the same fingerprints a pipeline naming the models directly computes, so stored mappings are shared
    direct = ModelRegistry({"b": "tiny/base", "t": str(child)}, default_device="cpu")
    assert base.fingerprint["combined"] == direct.info("b").fingerprint
    assert tuned.fingerprint["combined"] == direct.info("t").fingerprint
    # a run on the family reads the recorded fingerprints: no weight is hashed again
    monkeypatch.setattr(fingerprint_module, "weights_digest_dir", lambda p: pytest.fail(f"hashed {p} again"))
    loaded = load_family(home)
    registry = ModelRegistry({"root": "root", "tuned": "tuned"}, family=loaded, default_device="cpu")
    assert registry.info("tuned").fingerprint == tuned.fingerprint["combined"]


@pytest.mark.filterwarnings("ignore:no mapping for")  # calibrated on demand, as a first run does
async def test_a_pipeline_on_an_own_family_prefills_once_and_maps_into_the_other_member(own, mapstore):
    home, child = own
    init_family("mine", ["tiny/base", f"tuned={child}"], home=home)
    family = load_family(home)
    agents = [{"name": n, "model": m, "spec": {"role": "You are careful.", "task": "Summarise the document.",
                                              "generation": {"max_new_tokens": 4, "temperature": 0.0}}}
              for n, m in (("a", "root"), ("b", "tuned"))]
    spec = PipelineSpec.model_validate({"name": "t", "models": {"root": "root", "tuned": "tuned"}, "source": "root",
                                        "default_device": "cpu", "agents": agents,
                                        "gate": {"offline": None, "probe": {"tokens": 16, "max_excess_nll": 100.0}}})
    report = await Orchestra(spec, family=family, mappings=mapstore).run(DOC)
    assert [a.status for a in report.agents] == ["succeeded", "succeeded"]
    assert report.agent("a").cache_path == "exact" and report.agent("b").cache_path == "mapped"
    assert [c.model for c in report.caches if c.path == "exact"] == ["root"]


def test_a_changed_member_is_reported_with_how_to_reinitialise(own):
    home, child = own
    init_family("mine", ["tiny/base", f"tuned={child}"], home=home)
    weights = next(child.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes() + b"\0" * 8)
    with pytest.raises(FamilyError, match=r"family member tuned: its weights at .* changed .*orchestra family init mine"):
        load_family(home)


def test_refusals_are_typed_one_liners(own, fam, tmp_path):
    home, child = own
    swapped = model_folder(fam.child, tmp_path / "swapped",
                           lambda out: save_edited_tokenizer(fam.parent, out, swap_ids("Ġthe", "Ġa")))
    with pytest.raises(CrossFamilyError, match="member swapped's tokenizer differs from the source's"):
        init_family("mine", ["tiny/base", str(swapped)], home=home)
    with pytest.raises(FamilyError, match="both be named 'tuned'"):
        init_family("mine", [f"tuned={child}", f"tuned={fam.child}"], home=home)
    with pytest.raises(FamilyError, match="--source 'nope' is none of the members"):
        init_family("mine", ["tiny/base"], home=home, source="nope")
    init_family("mine", ["tiny/base"], home=home)
    with pytest.raises(FamilyError, match="pass --force"):
        init_family("mine", ["tiny/base"], home=home)
    assert list(init_family("mine", ["tiny/base", str(child)], home=home, force=True).members) == ["base", "tuned"]


def test_the_cli_inits_and_shows_and_exits_2_on_a_model_missing_offline(own):
    home, child = own
    runner = CliRunner()
    made = runner.invoke(app, ["family", "init", "mine", "tiny/base", f"tuned={child}", "--home", str(home)])
    assert made.exit_code == 0, made.output
    shown = runner.invoke(app, ["family", "show", "--home", str(home)])
    assert shown.exit_code == 0 and "tuned" in shown.output and "mine family" in shown.output
    missing = runner.invoke(app, ["family", "init", "other", "tiny/absent", "--home", str(home / "2")])
    assert missing.exit_code == 2
    lines = [line for line in missing.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "hf download tiny/absent" in lines[0]
