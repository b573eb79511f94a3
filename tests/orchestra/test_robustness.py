"""Robustness: crash-safe stores, gate fallbacks on broken mappings, a relocatable family home and the
CLI's error path. (Interrupted writes need a process to kill: tests/orchestra/test_crash_safety.py; the
table of bad inputs: tests/orchestra/test_cli_errors.py.)"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mappings.errors import CorruptMappingError
from mappings.store import file_sha256, load_mapping, read_manifest
from orchestra.cli import app
from orchestra.errors import DocumentError
from orchestra.family.corpus import data_text
from orchestra.family.manifest import MANIFEST_NAME, MEMBER_MARKER, family_dir, load_family
from orchestra.familycache.mapping_store import MappingStore
from orchestra.observability.events import Fallback, GateResult
from orchestra.pipelines.spec import PipelineSpec
from orchestra.runs.scheduler import Orchestra
from tests.tiny_family import build_tiny_family

runner = CliRunner()
DOC = data_text("gpl-3.txt")[:320]
CORPUS = [("mpl", data_text("mpl-2.0.txt")[:6000]), ("apache", data_text("apache-2.0.txt")[:6000])]
# The agent ran to its end: a tiny random model's two tokens may be judged degenerate (the check doing its
# job); these tests are about caches and fallbacks, not the reply.
FINISHED = ("succeeded", "degenerate")
PERMISSIVE = {"offline": None, "probe": {"tokens": 8, "max_excess_nll": 100.0, "max_excess_kl": 100.0}}


@pytest.fixture(scope="module")
def fam(tiny_root):
    return build_tiny_family(tiny_root, "llama")


def _pipeline(fam, agents=None, **extra) -> PipelineSpec:
    agents = agents or [{"name": "b", "model": "child",
                         "spec": {"task": "Summarise.", "generation": {"max_new_tokens": 2, "temperature": 0}}}]
    return PipelineSpec.model_validate({"name": "t", "models": {"base": str(fam.parent), "child": str(fam.child)},
                                        "source": "base", "default_device": "cpu", "agents": agents,
                                        "gate": PERMISSIVE, **extra})


@pytest.fixture(scope="module")
def pristine(fam, tmp_path_factory) -> tuple[Path, str]:
    """A valid mapping for the tiny pair, and the folder name the store looks for."""
    directory = tmp_path_factory.mktemp("pristine")
    store = MappingStore(directory, tokens=512, corpus=CORPUS, method="ridge")
    orch = Orchestra(_pipeline(fam), mappings=store)
    source, target = orch.registry.load("base"), orch.registry.load("child")
    path = store.path_for(source, target)
    store.calibrate(source, target, path)
    return path, path.name


def _store_with(pristine, tmp_path, on_missing="calibrate") -> tuple[MappingStore, Path]:
    path, name = pristine
    directory = tmp_path / "maps"
    shutil.copytree(path, directory / name)
    return MappingStore(directory, tokens=512, corpus=CORPUS, on_missing=on_missing, method="ridge"), directory / name


def _edit_manifest(folder: Path, edit) -> None:
    data = json.loads((folder / "manifest.json").read_text())
    edit(data)
    (folder / "manifest.json").write_text(json.dumps(data))


def _nan_weights(folder: Path) -> None:
    """NaN in the map's weights, with the manifest's hash and size updated to match (so only a value check sees it)."""
    from safetensors.torch import load_file, save_file

    path = folder / "mapping.safetensors"
    tensors = load_file(str(path))
    first = next(k for k in tensors if k.endswith("weight"))
    tensors[first][0, 0] = float("nan")
    save_file(tensors, str(path), metadata={"mapping_version": "1"})

    def fix(data):
        data["tensors"].update(sha256=file_sha256(path), bytes=path.stat().st_size)

    _edit_manifest(folder, fix)


def _corrupt(folder: Path, kind: str) -> None:
    if kind == "corrupt manifest":
        (folder / "manifest.json").write_text("{ not json")
    elif kind == "stale fingerprint":
        _edit_manifest(folder, lambda d: d["source"]["fingerprint"].update(combined="0" * 64, weights="0" * 64))
    elif kind == "NaN weights":
        _nan_weights(folder)
    elif kind == "half-written folder":
        (folder / "manifest.json").unlink()
    elif kind == "tensor name outside the folder":
        _edit_manifest(folder, lambda d: d["tensors"].update(name="../../../../etc/passwd"))
    elif kind == "truncated tensors":
        raw = (folder / "mapping.safetensors").read_bytes()
        (folder / "mapping.safetensors").write_bytes(raw[: len(raw) // 2])


# ---- item 6: any broken mapping is a failed gate and a re-prefill, never a failed agent -----------------


@pytest.mark.parametrize("kind, why", [
    ("corrupt manifest", "not valid JSON"),
    ("stale fingerprint", "fingerprint"),
    ("NaN weights", "NaN"),
    ("half-written folder", "half-written"),
    ("tensor name outside the folder", "plain file name"),
    ("truncated tensors", "does not match its manifest"),
])
async def test_broken_mapping_falls_back_to_reprefill_with_the_reason(fam, pristine, tmp_path, kind, why):
    store, folder = _store_with(pristine, tmp_path, on_missing="refuse")
    _corrupt(folder, kind)
    events = []
    report = await Orchestra(_pipeline(fam), mappings=store).run(DOC, on_event=events.append)
    agent = report.agent("b")
    assert agent.status in FINISHED, agent.error
    assert agent.cache_path == "reprefilled"
    assert "mapping gate failed" in agent.fallback_reason and why in agent.fallback_reason, agent.fallback_reason
    assert agent.gate and agent.gate[0]["gate"] == "mapping" and not agent.gate[0]["passed"]
    assert any(isinstance(e, Fallback) and e.agent == "b" and why in e.reason for e in events)
    assert any(isinstance(e, GateResult) and not e.passed and e.reason.startswith("mapping:") for e in events)


async def test_half_written_folder_is_recalibrated_in_place_of_failing(fam, pristine, tmp_path):
    """Item 2 (pipeline side): a folder without a manifest at the pair's path used to make every run fail
    with OSError (the calibration could not rename over it); now it is replaced by a whole mapping."""
    store, folder = _store_with(pristine, tmp_path, on_missing="calibrate")
    _corrupt(folder, "half-written folder")
    report = await Orchestra(_pipeline(fam), mappings=store).run(DOC)
    assert report.agent("b").status in FINISHED and report.agent("b").cache_path == "mapped"
    assert load_mapping(folder).manifest.tensors.sha256  # whole again
    # nothing half-written beside it; the pair's lock file stays, as filelock keeps it (it is not data)
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".") and p.suffix != ".lock"]


def test_two_stores_that_miss_the_same_pair_at_once_calibrate_it_once(fam, tmp_path):
    """Two processes on one home (a server and a script, two test workers) share a mappings folder: the
    second to miss the pair waits on the first's calibration and loads what it saved instead of fitting
    its own. Two store objects stand for the two processes (each has its own in-memory cache and lock)."""
    import threading
    import warnings

    stores = [MappingStore(tmp_path / "maps", tokens=512, corpus=CORPUS, method="ridge") for _ in range(2)]
    orch = Orchestra(_pipeline(fam), mappings=stores[0])
    source, target = orch.registry.load("base"), orch.registry.load("child")
    start, results, errors = threading.Barrier(2), [None, None], []

    def get(i: int) -> None:
        try:
            start.wait()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "calibrating one now" is the point
                results[i] = stores[i].get(source, target)
        except Exception as exc:  # surfaced below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=get, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(calibrated for _, calibrated in results) == [False, True]
    path = stores[0].path_for(source, target)
    assert load_mapping(path).manifest.tensors.sha256
    assert results[0][0].manifest.tensors.sha256 == results[1][0].manifest.tensors.sha256


def test_family_calibrate_replaces_a_half_written_mapping(tiny_family_home, tmp_path):
    home = tmp_path / "home"
    shutil.copytree(tiny_family_home, home)
    first = runner.invoke(app, ["family", "calibrate", "--home", str(home), "--member", "finetuned",
                                "--tokens", "512", "--no-repair"])
    assert first.exit_code == 0, first.output
    folder = next(p for p in (home / "mappings").iterdir() if not p.name.startswith("."))
    (folder / "manifest.json").unlink()  # what an interrupted first `calibrate --out <this folder>` left
    again = runner.invoke(app, ["family", "calibrate", "--home", str(home), "--member", "finetuned",
                                "--tokens", "512", "--no-repair"])
    assert again.exit_code == 0, again.output
    assert "half-written" in again.output and "Traceback" not in again.output
    load_mapping(folder)


def test_run_exits_3_and_names_failed_and_skipped_agents(fam, tmp_path):
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(
        f"models: {{base: '{fam.parent}'}}\nsource: base\ndefault_device: cpu\n"
        "agents:\n"
        "  - {name: a, model: base, timeout_s: 0.0001, spec: {task: Summarise., generation: {max_new_tokens: 2}}}\n"
        "  - {name: b, model: base, spec: {task: 'Check {a}', generation: {max_new_tokens: 2}}}\n"
        "  - {name: c, model: base, spec: {task: Summarise., generation: {max_new_tokens: 2}}}\n")
    document = tmp_path / "doc.txt"
    document.write_text(DOC)
    out = tmp_path / "report.json"
    result = runner.invoke(app, ["run", str(pipeline), "--document", str(document), "--report", str(out),
                                 "--home", str(tmp_path / "nohome")])
    assert result.exit_code == 3, result.output
    assert "a failed (TimeoutError" in result.output and "b skipped (upstream a did not succeed)" in result.output
    assert "c failed" not in result.output and "Traceback" not in result.output
    assert json.loads(out.read_text())["agents"][2]["status"] in FINISHED  # the report is still written


# ---- item 5: a moved or copied home works as is ----------------------------------------------------------


def test_family_home_is_relocatable_and_its_files_are_readable(tiny_family_home, tmp_path):
    moved = tmp_path / "moved"
    shutil.copytree(tiny_family_home, tmp_path / "original")
    os.rename(tmp_path / "original", moved)  # a moved home (the original location is gone)
    copy = tmp_path / "copy"
    shutil.copytree(moved, copy)  # and a copy beside it
    for home in (moved, copy):
        manifest = load_family(home)
        assert Path(manifest.home) == home.resolve()
        for record in manifest.members.values():
            assert Path(record.path).is_relative_to(home.resolve()), record.path
    raw = json.loads((family_dir(copy) / MANIFEST_NAME).read_text())
    assert raw["home"] == "." and all(not Path(r["path"]).is_absolute() for r in raw["members"].values())
    umask = os.umask(0)
    os.umask(umask)
    member = Path(load_family(copy).member("root").path)
    for path in (family_dir(copy) / MANIFEST_NAME, member / MEMBER_MARKER):
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path  # not 0600


def test_absolute_paths_of_an_older_family_json_follow_the_copy(tiny_family_home, tmp_path):
    original = tmp_path / "original"
    shutil.copytree(tiny_family_home, original)
    path = family_dir(original) / MANIFEST_NAME
    raw = json.loads(path.read_text())  # as an older version wrote it: absolute paths
    raw["home"] = str(original.resolve())
    for record in raw["members"].values():
        record["path"] = str(original.resolve() / record["path"])
    path.write_text(json.dumps(raw))
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    shutil.rmtree(original)
    for record in load_family(copy).members.values():
        assert Path(record.path).is_relative_to(copy.resolve()) and Path(record.path).is_dir()


def test_mapping_manifests_in_a_copied_home_name_the_copys_models(fam, tmp_path):
    home = tmp_path / "home"
    shutil.copytree(fam.parent, home / "family" / "parent")
    shutil.copytree(fam.child, home / "family" / "child")
    folder = home / "mappings" / "parent-to-child"
    data = Path(__file__).resolve().parents[2] / "orchestra" / "family" / "data"
    made = runner.invoke(app, ["calibrate", "--source", str(home / "family" / "parent"), "--target",
                               str(home / "family" / "child"), "--corpus", str(data / "mpl-2.0.txt"), "--out",
                               str(folder), "--tokens", "256", "--window", "32", "--method", "ridge", "--quiet"])
    assert made.exit_code == 0, made.output
    assert json.loads((folder / "manifest.json").read_text())["source"]["path"] == "../../family/parent"
    copy = tmp_path / "copy"
    shutil.copytree(home, copy)
    shutil.rmtree(home)
    manifest = read_manifest(copy / "mappings" / folder.name)
    assert Path(manifest.source.path) == (copy / "family" / "parent").resolve()
    assert Path(manifest.target.path) == (copy / "family" / "child").resolve()


# ---- item 7: evaluate refuses a NaN mapping ---------------------------------------------------------------


def test_evaluate_on_a_nan_mapping_is_an_error_not_a_nan_table(fam, pristine, tmp_path):
    _, folder = _store_with(pristine, tmp_path)
    _nan_weights(folder)
    document = tmp_path / "doc.txt"
    document.write_text(data_text("gpl-3.txt")[:3000])
    result = runner.invoke(app, ["evaluate", "--mapping", str(folder), "--document", str(document),
                                 "--source", str(fam.parent), "--target", str(fam.child), "--prefix-tokens", "64",
                                 "--suffix-tokens", "8", "--greedy-tokens", "0", "--tail-tokens", "0",
                                 "--no-layer-curves", "--no-served"])
    assert result.exit_code == 2, result.output
    assert "NaN" in result.output and "recalibrate" in result.output
    assert "top-1" not in result.output and "Traceback" not in result.output  # no table of nan scores


# ---- item 8: a read-only home is read, not refused ---------------------------------------------------------


def test_run_on_a_read_only_home(tiny_family_home, tmp_path, monkeypatch):
    """Root may write anywhere, so the home is made read-only the way the code sees it: os.access says no."""
    import orchestra.paths

    home = tmp_path / "home"
    shutil.copytree(tiny_family_home, home)
    real_access = os.access

    def access(path, mode, *args, **kwargs):
        if mode & os.W_OK and Path(path).resolve().is_relative_to(home.resolve()):
            return False
        return real_access(path, mode, *args, **kwargs)

    monkeypatch.setattr(orchestra.paths.os, "access", access)
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(
        "models: {root: root, tuned: finetuned}\nsource: root\ndefault_device: cpu\n"
        "mapping: {on_missing: refuse}\n"
        "agents:\n  - {name: b, model: tuned, spec: {task: Summarise., generation: {max_new_tokens: 2}}}\n")
    document = tmp_path / "doc.txt"
    document.write_text(DOC)
    result = runner.invoke(app, ["run", str(pipeline), "--document", str(document), "--home", str(home)])
    # exit 3 only when the tiny model's two tokens are judged degenerate: the run itself went through
    assert result.exit_code == 0 or (result.exit_code == 3 and "b degenerate" in result.output), result.output
    assert "no family loaded" not in result.output and "reprefilled" in result.output
    shown = runner.invoke(app, ["family", "show", "--home", str(home)])
    assert shown.exit_code == 0, shown.output
    # writing still needs a writable home, and says so in one line
    build = runner.invoke(app, ["family", "build", "--home", str(home)])
    assert build.exit_code == 2 and "not writable" in build.output and "Traceback" not in build.output


# ---- item 10: the length message names the fix that works --------------------------------------------------


async def test_too_many_new_tokens_says_lower_max_new_tokens(fam):
    from orchestra.errors import PipelineError

    # the refusals' messages (chunking: auto would chunk such a document instead, making room for the reply)
    NEVER = {"mode": "never"}  # noqa: N806

    big = [{"name": "a", "model": "base", "spec": {"task": "S.", "generation": {"max_new_tokens": 60000}}}]
    with pytest.raises(PipelineError) as refused:  # the 60000: refused before any model loads
        _pipeline(fam, big)
    assert "max_new_tokens" in str(refused.value) and "shorten" not in str(refused.value)
    agents = [{"name": "a", "model": "base", "spec": {"task": "Summarise.", "generation": {"max_new_tokens": 600}}}]
    orch = Orchestra(_pipeline(fam, agents, chunking=NEVER), mappings=MappingStore(Path("/nonexistent"), on_missing="refuse"))
    with pytest.raises(DocumentError) as err:
        await orch.run(DOC[:200])
    message = str(err.value)
    assert "lower the agent's max_new_tokens to at most" in message and "shorten" not in message
    # a document that does not fit by itself: shorten it
    agents[0]["spec"]["generation"]["max_new_tokens"] = 4
    orch = Orchestra(_pipeline(fam, agents, chunking=NEVER), mappings=MappingStore(Path("/nonexistent"), on_missing="refuse"))
    with pytest.raises(DocumentError, match="shorten the document by"):
        await orch.run(data_text("gpl-3.txt")[:4000])
    # both fixes work: both are named, with numbers that fit
    agents[0]["spec"]["generation"]["max_new_tokens"] = 300
    orch = Orchestra(_pipeline(fam, agents, chunking=NEVER), mappings=MappingStore(Path("/nonexistent"), on_missing="refuse"))
    with pytest.raises(DocumentError, match=r"at most \d+, or shorten the document by \d+ tokens"):
        await orch.run(DOC[:200])


# ---- item 12: tensor names are plain file names in the folder ------------------------------------------------


def test_tensor_names_outside_the_folder_are_refused_before_opening(pristine, tmp_path, monkeypatch):
    _, folder = _store_with(pristine, tmp_path)
    for name in ("../../../../etc/passwd", "/etc/passwd", "sub/mapping.safetensors", ".hidden", ".."):
        _edit_manifest(folder, lambda d, name=name: d["tensors"].update(name=name))
        with pytest.raises(CorruptMappingError, match="plain file name"):
            read_manifest(folder)
    # even a manifest object that skipped validation cannot make the loader open a file elsewhere
    from mappings.manifest import FileRecord
    from mappings.store import _load_tensors

    opened = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: opened.append(str(p)) or real_open(p, *a, **k))
    record = FileRecord.model_construct(name="../../../../etc/passwd", sha256="0", bytes=0)
    with pytest.raises(CorruptMappingError, match="not a plain file"):
        _load_tensors(folder / record.name, record)
    assert not any("passwd" in p for p in opened)


def test_nan_mapping_is_refused_at_load(pristine, tmp_path):
    _, folder = _store_with(pristine, tmp_path)
    _nan_weights(folder)
    with pytest.raises(CorruptMappingError, match="NaN or inf"):  # the hash matches: the values are checked
        load_mapping(folder)
