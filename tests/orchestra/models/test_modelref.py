"""Model references by folder or Hugging Face Hub id, and fingerprints computed once (orchestra.models.modelref, .fpcache).

The Hub cache here is a real one in huggingface_hub's layout (``models--org--name/{blobs,refs,snapshots}``,
snapshot files linked to blobs named by the content's sha256), built from the tiny llama family, and the
real huggingface_hub reads it offline. The Hub's refusals (missing, gated, unknown revision) come from a
local HTTP server answering as the Hub does, so huggingface_hub's own error handling is what runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner

import mappings.fingerprint as fingerprint_module
from mappings.fingerprint import fingerprint_dir
from orchestra.cli import app
from orchestra.errors import HubModelError, ModelFolderError, ModelNotCachedError, UnknownModelError
from orchestra.models.fpcache import CACHE_NAME, WRITE_STEP, folder_weights_digest
from orchestra.models.modelref import ModelRef
from orchestra.models.registry import ModelRegistry
from tests.fixtures.hubcache import set_ref as _ref
from tests.fixtures.hubcache import snapshot as _snapshot

REPO_ROOT = Path(__file__).resolve().parents[3]
COMMIT_A = hashlib.sha1(b"revision A").hexdigest()  # the parent's weights, tagged v1
COMMIT_B = hashlib.sha1(b"revision B").hexdigest()  # the child's weights, on main
COMMIT_C = hashlib.sha1(b"revision C").hexdigest()  # the parent again, copied instead of linked


@dataclass(frozen=True)
class HubCache:
    root: Path
    repo: Path  # models--tiny--llama


@pytest.fixture(scope="module")
def hub(fam, tmp_path_factory) -> HubCache:
    root = tmp_path_factory.mktemp("hf_hub_cache")
    repo = root / "models--tiny--llama"
    _snapshot(repo, COMMIT_A, fam.parent)
    _snapshot(repo, COMMIT_B, fam.child)
    _ref(repo, "main", COMMIT_B)
    _ref(repo, "v1", COMMIT_A)
    copied = root / "models--tiny--copied"
    _snapshot(copied, COMMIT_C, fam.parent, link=False)
    _ref(copied, "main", COMMIT_C)
    return HubCache(root, repo)


@pytest.fixture
def offline(hub, tmp_path, monkeypatch) -> HubCache:
    """The Hub cache above, offline; a private orchestra home."""
    monkeypatch.setenv("HF_HUB_CACHE", str(hub.root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("ORCHESTRA_HOME", str(tmp_path / "home"))
    return hub


@pytest.fixture
def folder(fam, tmp_path) -> Path:
    """A private copy of the tiny parent (its fingerprint cache file is this test's own)."""
    return Path(shutil.copytree(fam.parent, tmp_path / "parent", ignore=shutil.ignore_patterns(".*")))


def _refuse_tensor_hashing(monkeypatch) -> None:
    def refuse(path):
        raise AssertionError(f"the tensors of {path} were hashed again")

    monkeypatch.setattr(fingerprint_module, "weights_digest_dir", refuse)


# ---- parsing ----------------------------------------------------------------------------------------------


def test_parse_tells_hub_ids_from_folders(tmp_path, monkeypatch):
    ref = ModelRef.parse("HuggingFaceTB/SmolLM2-135M@v1.0")
    assert (ref.is_hub, ref.repo_id, ref.revision) == (True, "HuggingFaceTB/SmolLM2-135M", "v1.0")
    assert ModelRef.parse("org/name").revision is None
    assert ModelRef.parse("org/name@refs/pr/1").revision == "refs/pr/1"
    for local in ("root", "./org/name", "/abs/org/name", "~/org/name", "a/b/c", "org/../name", "org--x/name"):
        assert not ModelRef.parse(local).is_hub, local
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not ModelRef.parse("org/name").is_hub  # an existing folder wins over the Hub id
    assert not ModelRef.parse(Path("elsewhere/name")).is_hub  # a Path is always a folder


# ---- Hub ids, offline from the cache -----------------------------------------------------------------------


def test_a_hub_id_resolves_from_the_cache_offline_and_loads(offline, fam):
    registry = ModelRegistry({"m": "tiny/llama"}, default_device="cpu")
    info = registry.info("m")
    assert info.path == offline.repo / "snapshots" / COMMIT_B  # main
    assert info.name == "tiny--llama" and "/" not in info.name  # it names mapping folders
    assert info.num_layers == 4 and info.weight_bytes > 0
    loaded = registry.load("m")
    assert type(loaded.model).__name__ == "LlamaForCausalLM"
    assert loaded.handle().fingerprint.combined == info.fingerprint


def test_at_revision_picks_that_snapshot_by_tag_or_commit(offline):
    registry = ModelRegistry({"main": "tiny/llama", "tag": "tiny/llama@v1", "commit": f"tiny/llama@{COMMIT_A}"},
                             default_device="cpu")
    assert registry.info("main").path.name == COMMIT_B
    assert registry.info("tag").path.name == COMMIT_A
    assert registry.info("commit").path == registry.info("tag").path
    assert ModelRef.parse("tiny/llama@v1").resolve().commit == COMMIT_A


def test_hub_fingerprint_is_stable_differs_between_revisions_and_hashes_no_tensor(offline, monkeypatch):
    _refuse_tensor_hashing(monkeypatch)  # the weights part comes from the blob names alone
    first = ModelRegistry({"m": "tiny/llama@v1"}).info("m")
    again = ModelRegistry({"m": "tiny/llama@v1"}).info("m")
    other = ModelRegistry({"m": "tiny/llama"}).info("m")
    assert first.fingerprint == again.fingerprint
    assert first.fingerprint != other.fingerprint
    assert first.fingerprint_parts["weights"] != other.fingerprint_parts["weights"]
    # the shape of every fingerprint: only the weights part's source differs from a folder's
    assert set(first.fingerprint_parts) == {"config", "weights", "tokenizer", "combined"}
    # the same snapshot named by its path has the same fingerprint (mappings made either way match)
    by_path = ModelRegistry({"m": str(offline.repo / "snapshots" / COMMIT_A)}).info("m")
    assert by_path.fingerprint == first.fingerprint and by_path.name == "tiny--llama"
    assert fingerprint_dir(first.path).combined == first.fingerprint  # the mappings layer agrees


def test_hub_weights_digest_is_the_same_in_another_process(offline):
    code = ("from orchestra.models.modelref import ModelRef; "
            "print(ModelRef.parse('tiny/llama@v1').resolve().weights_digest())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT,
                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert out.stdout.strip() == ModelRef.parse("tiny/llama@v1").resolve().weights_digest()


def test_a_hub_id_missing_offline_is_a_typed_error_that_says_how_to_download_it(offline):
    with pytest.raises(ModelNotCachedError) as caught:
        ModelRef.parse("nobody/missing").resolve()
    message = str(caught.value)
    assert "is not in the Hugging Face cache" in message and "HF_HUB_OFFLINE is set" in message
    assert "`hf download nobody/missing`" in message and "huggingface-cli download nobody/missing" in message
    assert "\n" not in message
    with pytest.raises(ModelNotCachedError, match="--revision v9"):  # a revision the cache does not know
        ModelRef.parse("tiny/llama@v9").resolve()
    with pytest.raises(ModelNotCachedError, match="model 'm' -> nobody/missing"):  # the registry names the alias
        ModelRegistry({"m": "nobody/missing"}).info("m")


def test_orchestra_run_exits_2_with_one_line_for_a_hub_model_not_in_the_cache(offline, tmp_path):
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text("models: {base: nobody/missing}\nsource: base\ndefault_device: cpu\nagents:\n"
                        "  - {name: s, model: base, builtin: summarizer, args: {max_words: 20}}\n")
    document = tmp_path / "doc.txt"
    document.write_text("A short document.")
    result = CliRunner().invoke(app, ["run", str(pipeline), "--document", str(document),
                                      "--home", str(tmp_path / "nohome")])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ModelNotCachedError: model 'base' -> nobody/missing")
    assert "hf download nobody/missing" in lines[0]


def test_orchestra_calibrate_exits_2_for_a_hub_model_not_in_the_cache(offline, fam, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Some calibration text. " * 20)
    result = CliRunner().invoke(app, ["calibrate", "--source", "nobody/missing", "--target", str(fam.child),
                                      "--corpus", str(corpus), "--out", str(tmp_path / "map"), "--quiet"])
    assert result.exit_code == 2, result.output
    assert "ModelNotCachedError" in result.output and "hf download nobody/missing" in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_a_snapshot_of_copies_is_hashed_once_with_its_cache_file_in_the_orchestra_home(offline, tmp_path, monkeypatch):
    resolved = ModelRef.parse("tiny/copied").resolve()
    assert resolved.hub_weights is None  # no links to blobs: the tensors are hashed
    digest = resolved.weights_digest()
    assert not (resolved.path / CACHE_NAME).exists()  # huggingface_hub's folders are not written into
    assert len(list((tmp_path / "home" / "fingerprints").glob("*.json"))) == 1
    _refuse_tensor_hashing(monkeypatch)
    assert ModelRef.parse("tiny/copied").resolve().weights_digest() == digest


# ---- the Hub's refusals ------------------------------------------------------------------------------------


class _FakeHub(BaseHTTPRequestHandler):
    """Answers every request as the Hub does for a gated repo, an unknown revision or an unknown repo."""

    def _refuse(self) -> None:
        if "/gated" in self.path:
            status, code = 403, "GatedRepo"
        elif "/revision/nope" in self.path:
            status, code = 404, "RevisionNotFound"
        else:
            status, code = 404, "RepoNotFound"
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = _refuse

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass


@pytest.fixture
def fake_hub(tmp_path, monkeypatch) -> Iterator[str]:
    import huggingface_hub.constants

    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # read once, at its import
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    try:
        yield endpoint
    finally:
        server.shutdown()
        thread.join()


@pytest.mark.parametrize("text, why", [
    ("org/missing", "is not a model repository on the Hugging Face Hub"),
    ("org/gated", "is a gated repository: accept its terms"),
    ("org/there@nope", "has no revision 'nope'"),
])
def test_the_hubs_refusals_are_typed_one_line_errors(fake_hub, text, why):
    with pytest.raises(HubModelError) as caught:
        ModelRef.parse(text).resolve()
    assert why in str(caught.value) and "\n" not in str(caught.value)
    assert isinstance(caught.value, UnknownModelError)  # what pipelines and the CLI already handle


# ---- local folders ----------------------------------------------------------------------------------------


def test_a_folder_without_config_or_safetensors_is_a_typed_error(folder, tmp_path):
    with pytest.raises(ModelFolderError, match="does not exist"):
        ModelRef.parse(tmp_path / "nowhere").resolve()
    (folder / "model.safetensors").rename(tmp_path / "weights.bin")
    with pytest.raises(ModelFolderError, match=r"no \*.safetensors weights \(only safetensors are loaded\)"):
        ModelRef.parse(folder).resolve()
    (folder / "config.json").unlink()
    with pytest.raises(ModelFolderError, match="no config.json"):
        ModelRef.parse(folder).resolve()
    with pytest.raises(UnknownModelError, match="neither a family member"):  # the registry's own wording stays
        ModelRegistry({"m": str(folder)}).info("m")


def test_a_folders_fingerprint_is_reused_from_its_file_and_recomputed_when_a_file_changes(offline, folder,
                                                                                         monkeypatch):
    first = ModelRegistry({"m": str(folder)}).info("m")
    assert first.fingerprint == fingerprint_dir(folder).combined  # the same fingerprint as before caching
    cached = json.loads((folder / CACHE_NAME).read_text())
    assert cached["weights"] == first.fingerprint_parts["weights"]
    assert set(cached["files"]) == {"model.safetensors"}

    with monkeypatch.context() as patch:
        _refuse_tensor_hashing(patch)
        assert ModelRegistry({"m": str(folder)}).info("m").fingerprint == first.fingerprint  # read, not hashed
        weights = folder / "model.safetensors"
        os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1_000_000))
        with pytest.raises(AssertionError, match="hashed again"):  # a changed file is hashed again ...
            ModelRegistry({"m": str(folder)}).info("m")
    again = ModelRegistry({"m": str(folder)}).info("m")  # ... and the file follows the change
    assert again.fingerprint == first.fingerprint
    assert json.loads((folder / CACHE_NAME).read_text())["files"]["model.safetensors"]["mtime_ns"] == \
        weights.stat().st_mtime_ns


def test_a_corrupt_cache_file_is_ignored_and_rewritten(offline, folder):
    digest = folder_weights_digest(folder)
    (folder / CACHE_NAME).write_text('{"version": 1, "files": {"model.safe')  # cut short
    assert folder_weights_digest(folder) == digest
    assert json.loads((folder / CACHE_NAME).read_text())["weights"] == digest
    (folder / CACHE_NAME).write_text(json.dumps({"version": 1, "files": {}, "weights": "0" * 64}))  # not these files
    assert folder_weights_digest(folder) == digest


def test_the_cache_file_is_written_atomically(offline, folder, monkeypatch, tmp_path):
    digest = folder_weights_digest(folder)
    before = (folder / CACHE_NAME).read_bytes()
    weights = folder / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1_000_000))
    # every write of the cache fails as a full disk would, after the temporary file is written, before the rename
    monkeypatch.setenv("ORCHESTRA_FAULT", f"{WRITE_STEP}:ENOSPC")
    assert folder_weights_digest(folder) == digest  # caching is an optimisation: the digest still comes back
    assert (folder / CACHE_NAME).read_bytes() == before  # the old file whole, not half of the new one
    assert not [p.name for p in folder.iterdir() if ".tmp-" in p.name]  # no temporary sibling left behind
    assert not list((tmp_path / "home").rglob("*.json"))  # nor anything half-written in the home
    monkeypatch.delenv("ORCHESTRA_FAULT")
    folder_weights_digest(folder)
    assert json.loads((folder / CACHE_NAME).read_text())["files"]["model.safetensors"]["mtime_ns"] == \
        weights.stat().st_mtime_ns


def test_a_folder_whose_cache_file_cannot_be_written_keeps_it_in_the_orchestra_home(offline, folder, tmp_path,
                                                                                   monkeypatch):
    (folder / CACHE_NAME).mkdir()  # in the way: neither readable nor replaceable as a file
    digest = folder_weights_digest(folder)
    assert len(list((tmp_path / "home" / "fingerprints").glob("*.json"))) == 1
    _refuse_tensor_hashing(monkeypatch)
    assert folder_weights_digest(folder) == digest


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_keeps_its_cache_file_in_the_orchestra_home(offline, folder, tmp_path, monkeypatch):
    folder.chmod(0o555)
    try:
        digest = folder_weights_digest(folder)
        assert not (folder / CACHE_NAME).exists()
        assert len(list((tmp_path / "home" / "fingerprints").glob("*.json"))) == 1
        _refuse_tensor_hashing(monkeypatch)
        assert folder_weights_digest(folder) == digest
    finally:
        folder.chmod(0o755)
