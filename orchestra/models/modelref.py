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
hashed once and kept beside it (`orchestra.models.fpcache`). Errors are typed (`orchestra.errors`
``ModelFolderError``, ``ModelNotCachedError``, ``HubModelError``) and say in one line what to do.

A LoRA adapter (peft's ``save_pretrained``: ``adapter_config.json`` + ``adapter_model.safetensors``) is
named the same ways and resolved with :meth:`ModelRef.resolve_adapter` (a Hub id fetches those two files
only); :class:`AdapterSpec` says which declared model it goes on (`orchestra.models.lora` applies it).
:class:`QuantizeSpec` names a declared model whose weights are loaded again and quantized by torchao
(`orchestra.models.quantize`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from orchestra.errors import (
    AdapterError,
    HubModelError,
    ModelFolderError,
    ModelNotCachedError,
    ModelReferenceError,
    QuantizeError,
)

if TYPE_CHECKING:
    from mappings.fingerprint import Fingerprint
    from mappings.types import Tokenizer

__all__ = ["ModelRef", "ResolvedModel", "HUB_PATTERNS", "hub_cache_dir", "hub_offline", "AdapterSpec",
           "ResolvedAdapter", "ADAPTER_FILES", "is_adapter_folder", "QuantizeSpec"]

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

ADAPTER_FILES: tuple[str, ...] = ("adapter_config.json", "adapter_model.safetensors")
"""A LoRA adapter's files, all that is fetched for a Hub adapter (safetensors only, as for models)."""

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
        return _checked(self, self._snapshot(self.repo_id, HUB_PATTERNS), self.repo_id)

    def resolve_adapter(self) -> ResolvedAdapter:
        """The folder holding a LoRA adapter (a Hub id fetches its two `ADAPTER_FILES` only), checked and read."""
        if self.repo_id is None:
            return _checked_adapter(self, self.folder.resolve(), None)
        return _checked_adapter(self, self._snapshot(self.repo_id, ADAPTER_FILES), self.repo_id)

    def _snapshot(self, repo_id: str, patterns: tuple[str, ...]) -> Path:
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
                                          allow_patterns=list(patterns), local_files_only=offline,
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
        if any((path / f).is_file() for f in ADAPTER_FILES):
            raise ModelFolderError(f"{what} is a LoRA adapter, not a model: declare it as "
                                   f"{{adapter: {ref.text}, base: <the alias of the model it goes on>}}")
        raise ModelFolderError(f"{what} is not a model folder: it has no config.json")
    if not any(path.glob("*.safetensors")):
        raise ModelFolderError(f"{what} has no *.safetensors weights (only safetensors are loaded): "
                               "save the model with safe_serialization, or pick a revision that ships safetensors")
    name, commit = _name_and_commit(path, repo_id)
    return ResolvedModel(ref=ref, path=path, name=name, commit=commit, hub_weights=snapshot_weights_digest(path))


def _name_and_commit(path: Path, repo_id: str | None) -> tuple[str, str | None]:
    """A short name for reports and mapping folders, and the snapshot's commit for a Hub cache folder."""
    snapshot = path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--")
    if repo_id is not None:
        name = repo_id.replace("/", "--")  # it names mapping folders: no slash
    elif snapshot:
        name = path.parent.parent.name.removeprefix("models--")
    else:
        name = path.name
    return name, path.name if snapshot else None


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
        from orchestra.models.fpcache import folder_weights_digest

        return folder_weights_digest(self.path)

    def fingerprint(self, tokenizer: Tokenizer | None = None) -> Fingerprint:
        """Config, weights and tokenizer digests (`tokenizer`: the folder's, when already loaded)."""
        from mappings.fingerprint import fingerprint_with_weights

        return fingerprint_with_weights(self.path, self.weights_digest(), tokenizer)


def is_adapter_folder(path: Path) -> bool:
    """Whether `path` is a LoRA adapter folder (an ``adapter_config.json`` and no model ``config.json``)."""
    return (path / "adapter_config.json").is_file() and not (path / "config.json").is_file()


@dataclass(frozen=True)
class AdapterSpec:
    """A LoRA adapter as a family member: its weights go on top of another declared model's, held once.

    In a pipeline's ``models``: ``tuned: {adapter: ./my-lora, base: root}``.
    """

    adapter: str
    """The adapter: a folder with adapter_config.json and adapter_model.safetensors, or a Hub id org/name[@revision]."""
    base: str
    """The alias, in the same ``models``, of the model the adapter was trained on (a plain model, not an adapter)."""

    def __str__(self) -> str:
        return f"{self.adapter} (LoRA over {self.base})"


@dataclass(frozen=True)
class QuantizeSpec:
    """A quantized view of another declared model as a member: its weights loaded again and quantized by torchao.

    In a pipeline's ``models``: ``q8: {base: root, quantize: int8}``. The view holds its own copy of the
    weights (quantized ones cannot share the base's), so it costs its quantized size, not the base's.
    """

    base: str
    """The alias, in the same ``models``, of the model whose weights are quantized (a plain model, not a view or an adapter)."""
    quantize: str
    """The scheme: ``int8`` (weight-only), ``int8-dynamic`` (int8 activations too) or ``int4`` (CUDA only)."""

    def __post_init__(self) -> None:
        from orchestra.models.quantize import SCHEMES

        if self.quantize not in SCHEMES:
            import difflib

            close = difflib.get_close_matches(str(self.quantize).strip().lower().replace("_", "-"), list(SCHEMES), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise QuantizeError(f"unknown quantize scheme {self.quantize!r}{hint}; use one of {', '.join(SCHEMES)}")

    def canonical(self) -> str:
        """What the view computes besides its base's weights, as canonical JSON: the scheme and how it is run."""
        import json

        from orchestra.models.quantize import RECIPE_VERSION, SCHEMES

        scheme = SCHEMES[self.quantize]
        return json.dumps({"quantize": scheme.name, "config": scheme.config, "modules": "decoder-linear",
                           "recipe": RECIPE_VERSION}, sort_keys=True, separators=(",", ":"))

    def __str__(self) -> str:
        return f"{self.base} quantized to {self.quantize} (torchao)"


def _checked_adapter(ref: ModelRef, path: Path, repo_id: str | None) -> ResolvedAdapter:
    import json

    from mappings.fingerprint import snapshot_weights_digest

    what = f"{ref.text} ({path})" if repo_id is not None else str(path)
    if not path.is_dir():
        raise AdapterError(f"adapter {what} does not exist: fix the path (a Hub adapter is written org/name[@revision])")
    missing = [f for f in ADAPTER_FILES if not (path / f).is_file()]
    if missing:
        raise AdapterError(f"adapter {what} has no {' or '.join(missing)}: save it with peft's save_pretrained "
                           "(safe_serialization, the default), which writes both")
    try:
        config = json.loads((path / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise AdapterError(f"adapter {what}: adapter_config.json cannot be read as JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {what}: adapter_config.json is not a JSON object")
    name, commit = _name_and_commit(path, repo_id)
    return ResolvedAdapter(ref=ref, path=path, name=name, commit=commit, config=config,
                           hub_weights=snapshot_weights_digest(path))


# adapter_config.json keys that name where the base was, or how peft was run, not what the adapter computes
_VOLATILE_ADAPTER_KEYS = {"base_model_name_or_path", "revision", "inference_mode", "peft_version", "auto_mapping"}


@dataclass(frozen=True)
class ResolvedAdapter:
    """A LoRA adapter reference resolved to a folder holding both `ADAPTER_FILES`."""

    ref: ModelRef
    path: Path
    """The folder: the local one, or the snapshot in the Hugging Face cache."""
    name: str
    """A short name for reports and mapping-folder names (the folder's, or ``org--name`` for a Hub adapter)."""
    commit: str | None
    """The snapshot's commit hash, for a folder in the Hugging Face cache."""
    config: dict[str, object] = field(hash=False, compare=False, repr=False)
    """adapter_config.json as read."""
    hub_weights: str | None = None
    """The Hub cache's blob-hash digest of adapter_model.safetensors; None for another folder."""

    @property
    def base_reference(self) -> str | None:
        """The base the adapter names (``base_model_name_or_path``): a Hub id or a path, as it was trained."""
        value = self.config.get("base_model_name_or_path")
        return value if isinstance(value, str) and value.strip() else None

    @property
    def tokenizer_folder(self) -> Path | None:
        """The adapter folder when it ships a tokenizer of its own (else the member uses its base's)."""
        shipped = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        return self.path if any((self.path / f).is_file() for f in shipped) else None

    def digest(self) -> str:
        """sha256 of what the adapter computes: its config (canonical JSON) and its tensors (or their Hub blob hash).

        Tensor names count (they say which layer a factor belongs to), unlike a model's weights digest.
        """
        import hashlib
        import json

        clean = {k: v for k, v in self.config.items() if k not in _VOLATILE_ADAPTER_KEYS}
        tensors = self.hub_weights or _named_tensors_digest(self.path / "adapter_model.safetensors")
        payload = json.dumps(clean, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(f"lora-adapter-v1\n{payload}\n{tensors}".encode()).hexdigest()


def _named_tensors_digest(file: Path) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order (an adapter is small: no cache)."""
    import hashlib

    import torch
    from safetensors import safe_open

    h = hashlib.sha256()
    with safe_open(str(file), framework="pt") as sf:
        for key in sorted(sf.keys()):
            t = sf.get_tensor(key).contiguous()
            h.update(f"{key}:{t.dtype}:{tuple(t.shape)}\n".encode())
            h.update((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes())
    return h.hexdigest()
