"""Model references: a local folder or a Hugging Face Hub id (``org/name`` or ``org/name@revision``).

Every place that names a model (a pipeline's ``models:``, ``Pipeline(models=)``, ``ModelRegistry``,
``orchestra calibrate`` / ``evaluate``) parses it with :meth:`ModelRef.parse` and turns it into a
folder with :meth:`ModelRef.resolve`:

- a text naming an existing path is that folder (a folder called ``org/name`` wins over the Hub id);
- otherwise ``org/name[@revision]`` is a Hub id, fetched with ``huggingface_hub.snapshot_download``
  into the user's Hugging Face cache (``HF_HUB_CACHE``, ``HF_HOME``), only the config, tokenizer,
  generation-config and ``*.safetensors`` files (:data:`HUB_PATTERNS`: no pickles, no code, so
  ``trust_remote_code`` has nothing to run). With ``HF_HUB_OFFLINE=1`` only the cache is read;
- anything else is a folder path that does not exist, refused with what to fix.

The fingerprint (:meth:`ResolvedModel.fingerprint`) has the usual config / weights / tokenizer parts;
its weights part comes from the hashes the Hub cache already holds for a snapshot
(`mappings.fingerprint.snapshot_weights_digest`) and, for any other folder, from its tensors,
hashed once and kept beside it (`orchestra.fpcache`). Errors are typed (`orchestra.errors`
``ModelFolderError``, ``ModelNotCachedError``, ``HubModelError``) and say in one line what to do.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from orchestra.errors import HubModelError, ModelFolderError, ModelNotCachedError, ModelReferenceError

if TYPE_CHECKING:
    from mappings.fingerprint import Fingerprint
    from mappings.types import Tokenizer

__all__ = ["ModelRef", "ResolvedModel", "HUB_PATTERNS", "hub_cache_dir", "hub_offline"]

# What a Hub id looks like: one slash, letters, digits, '-', '_', '.'; a revision (branch, tag, commit, or
# a ref such as refs/pr/1) after '@'. huggingface_hub validates the details when it is resolved.
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w./-]+))?$")

HUB_PATTERNS: tuple[str, ...] = (
    "config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
    # tokenizers: fast (tokenizer.json), BPE (vocab + merges), sentencepiece, chat templates kept apart
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)
"""The files fetched for a Hub model: what loading it with safetensors needs, nothing executable."""

_TRUE = {"1", "on", "yes", "true"}


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment now (huggingface_hub reads it once, at import).

    So do ``HF_HUB_OFFLINE`` (:func:`hub_offline`) and ``HF_ENDPOINT``: they are passed to
    ``snapshot_download`` explicitly, so a setting made after huggingface_hub was imported still counts.
    """
    env = os.environ
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return Path(env[name]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    xdg = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` is set (read now; huggingface_hub's own flag was read at its import)."""
    value = os.environ.get("HF_HUB_OFFLINE")
    if value is not None:
        return value.strip().lower() in _TRUE
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


@dataclass(frozen=True)
class ModelRef:
    """A model as named by a user: :meth:`parse` a text, then :meth:`resolve` it to a folder."""

    text: str
    """The reference as given."""
    repo_id: str | None = None
    """``org/name`` for a Hub id; None for a local folder."""
    revision: str | None = None
    """The part after ``@`` (a branch, tag or commit); None: the default branch."""

    @classmethod
    def parse(cls, text: str | os.PathLike[str]) -> ModelRef:
        """A folder when `text` is a Path or names an existing path, else a Hub id when it looks like one."""
        raw = os.fspath(text).strip()
        if not raw:
            raise ModelReferenceError("an empty model reference: give a model folder or a Hub id org/name[@revision]")
        if isinstance(text, os.PathLike) or Path(raw).expanduser().exists():
            return cls(raw)
        match = _HUB_ID.match(raw)
        if match is None or ".." in raw or "--" in match["repo"]:
            return cls(raw)
        return cls(raw, repo_id=match["repo"], revision=match["rev"])

    @property
    def is_hub(self) -> bool:
        return self.repo_id is not None

    @property
    def folder(self) -> Path:
        """The folder a local reference names (expanded, not resolved)."""
        return Path(self.text).expanduser()

    def __str__(self) -> str:
        return self.text

    def resolve(self) -> ResolvedModel:
        """The folder holding the model (downloaded into the Hub cache for a Hub id), checked for loadable files."""
        if self.repo_id is None:
            return _checked(self, self.folder.resolve(), None)
        return _checked(self, self._snapshot(self.repo_id), self.repo_id)

    def _snapshot(self, repo_id: str) -> Path:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import (
            GatedRepoError,
            HfHubHTTPError,
            HFValidationError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        cache, offline = hub_cache_dir(), hub_offline()
        try:
            return Path(snapshot_download(repo_id, revision=self.revision, cache_dir=cache,
                                          allow_patterns=list(HUB_PATTERNS), local_files_only=offline,
                                          endpoint=os.environ.get("HF_ENDPOINT") or None))
        except GatedRepoError as exc:  # before RepositoryNotFoundError: it is one
            site = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
            raise HubModelError(f"{self.text} is a gated repository: accept its terms on {site}/{repo_id} and "
                                "log in (`hf auth login`, or set HF_TOKEN), then retry") from exc
        except RepositoryNotFoundError as exc:
            raise HubModelError(f"{repo_id} is not a model repository on the Hugging Face Hub (or it is private "
                                "and you are not logged in): fix the id, or log in with `hf auth login`") from exc
        except RevisionNotFoundError as exc:
            raise HubModelError(f"{repo_id} has no revision {self.revision!r} on the Hugging Face Hub: fix the part "
                                "after '@' (a branch, tag or commit hash)") from exc
        except LocalEntryNotFoundError as exc:
            raise ModelNotCachedError(self._not_cached(repo_id, cache, offline, exc)) from exc
        except HfHubHTTPError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise HubModelError(f"the Hugging Face Hub refused {self.text}: {first}") from exc
        except HFValidationError as exc:
            raise ModelReferenceError(f"{self.text!r} is neither an existing folder nor a valid Hub id "
                                      f"(org/name[@revision]): {str(exc).strip().splitlines()[0]}") from exc

    def _not_cached(self, repo_id: str, cache: Path, offline: bool, exc: Exception) -> str:
        download = f"hf download {repo_id}" + (f" --revision {self.revision}" if self.revision else "")
        legacy = download.replace("hf download", "huggingface-cli download", 1)
        if type(exc).__name__ == "IncompleteSnapshotError":
            what = f"{self.text} is only partly in the Hugging Face cache ({cache})"
        else:
            what = f"{self.text} is not in the Hugging Face cache ({cache})"
        if offline:
            return f"{what} and HF_HUB_OFFLINE is set: run `{download}` (or `{legacy}`) online first"
        return f"{what} and the Hub cannot be reached: connect, or run `{download}` where there is a connection"


def _checked(ref: ModelRef, path: Path, repo_id: str | None) -> ResolvedModel:
    from mappings.fingerprint import snapshot_weights_digest

    what = f"{ref.text} ({path})" if repo_id is not None else str(path)
    if not path.exists():
        raise ModelFolderError(f"{what} does not exist: fix the path (a Hub model is written org/name[@revision])")
    if not (path / "config.json").is_file():
        raise ModelFolderError(f"{what} is not a model folder: it has no config.json")
    if not any(path.glob("*.safetensors")):
        raise ModelFolderError(f"{what} has no *.safetensors weights (only safetensors are loaded): "
                               "save the model with safe_serialization, or pick a revision that ships safetensors")
    snapshot = path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--")
    if repo_id is not None:
        name = repo_id.replace("/", "--")  # it names mapping folders: no slash
    elif snapshot:
        name = path.parent.parent.name.removeprefix("models--")
    else:
        name = path.name
    return ResolvedModel(ref=ref, path=path, name=name, commit=path.name if snapshot else None,
                         hub_weights=snapshot_weights_digest(path))


@dataclass(frozen=True)
class ResolvedModel:
    """A model reference resolved to a folder with a config.json and ``*.safetensors`` weights."""

    ref: ModelRef
    path: Path
    """The folder: the local one, or the snapshot in the Hugging Face cache."""
    name: str
    """A short name for reports and mapping-folder names (the folder's, or ``org--name`` for a Hub model)."""
    commit: str | None
    """The snapshot's commit hash, for a folder in the Hugging Face cache."""
    hub_weights: str | None
    """The fingerprint's weights part from the Hub cache's blob hashes (read at resolution, no tensor
    read); None for another folder, whose weights are hashed once and kept beside it."""

    def weights_digest(self) -> str:
        """The weights part of the fingerprint: the Hub cache's hashes, else the folder's cached tensor digest."""
        if self.hub_weights is not None:
            return self.hub_weights
        from orchestra.fpcache import folder_weights_digest

        return folder_weights_digest(self.path)

    def fingerprint(self, tokenizer: Tokenizer | None = None) -> Fingerprint:
        """Config, weights and tokenizer digests (`tokenizer`: the folder's, when already loaded)."""
        from mappings.fingerprint import fingerprint_with_weights

        return fingerprint_with_weights(self.path, self.weights_digest(), tokenizer)
