"""Content fingerprints of a model: config, weights and tokenizer, hashed separately.

A mapping, a cached KV tensor and a family record are only valid for the exact models that
produced them; these hashes are what every cache key and manifest compares.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mappings.errors import StaleMappingError
from mappings.tokenizer_compat import id_parts

if TYPE_CHECKING:  # heavy imports stay out of the import path
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from mappings.manifest import MappingManifest
    from mappings.types import Tokenizer

__all__ = ["Fingerprint", "fingerprint_model", "fingerprint_dir", "config_digest", "tokenizer_digest",
           "token_ids_digest", "TOKEN_IDS_DIGEST_VERSION",
           "check_fingerprints", "weights_digest_dir", "snapshot_weights_digest", "fingerprint_with_weights"]

# Keys that change with the library or the save location, not with the model.
_VOLATILE_CONFIG_KEYS = {"transformers_version", "_name_or_path", "_commit_hash", "quantization_config"}


@dataclass(frozen=True)
class Fingerprint:
    config: str
    weights: str
    tokenizer: str

    @property
    def combined(self) -> str:
        return hashlib.sha256(f"{self.config}:{self.weights}:{self.tokenizer}".encode()).hexdigest()

    @property
    def short(self) -> str:
        return self.combined[:16]

    def as_dict(self) -> dict[str, str]:
        return {"config": self.config, "weights": self.weights, "tokenizer": self.tokenizer, "combined": self.combined}


def _canonical(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def config_digest(config_dict: Mapping[str, object]) -> str:
    clean = {k: v for k, v in config_dict.items() if k not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(_canonical(clean)).hexdigest()


def tokenizer_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    """The tokenizer part of a model's :class:`Fingerprint` (identity): its vocabulary and special-tokens map.

    Unchanged since the first manifests: family records, mapping manifests and the mapping folders
    named after them store fingerprints made with it, so changing it would make every stored mapping
    stale. It answers "is this the model a mapping was made for", not "can these two members share
    token ids": a base checkpoint and its instruct checkpoint differ here (other eos/pad) and still
    share ids. Compatibility is :func:`token_ids_digest`.
    """
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = {k: str(v) for k, v in tokenizer.special_tokens_map.items()}
    payload = {"vocab": vocab, "special": special, "class_free": True}
    return hashlib.sha256(_canonical(payload)).hexdigest()


TOKEN_IDS_DIGEST_VERSION = 1
"""What :func:`token_ids_digest` hashes; it leads the digest (``ids1:...``) so a digest made by another
version of the rule never equals one made by this one."""


def token_ids_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    """Equal for two tokenizers exactly when the same text gives the same token ids on both.

    Hashes only what decides ids (``mappings.tokenizer_compat.id_parts``): the vocabulary, the merges
    or the model's equivalent, the normalizer, the pre-tokenizer and the added tokens with their ids
    and splitting flags; never the special-token roles, chat template, post-processor or decoder.
    This is ``ModelInfo.tokenizer_digest``, what the registry and the FamilyCache compare; it is
    computed from the tokenizer each time and never stored, so no manifest depends on it.
    """
    return f"ids{TOKEN_IDS_DIGEST_VERSION}:" + hashlib.sha256(_canonical(id_parts(tokenizer))).hexdigest()


def _tensor_digest(name_free_bytes: bytes, dtype: str, shape: tuple[int, ...]) -> str:
    h = hashlib.sha256()
    h.update(f"{dtype}{shape}".encode())
    h.update(name_free_bytes)
    return h.hexdigest()


def _tensor_bytes(t: torch.Tensor) -> bytes:
    import torch

    t = t.detach().to("cpu").contiguous()
    # numpy has no bfloat16: view the raw bits instead.
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def _weights_digest(digests: list[str]) -> str:
    # Tied weights appear once on disk but twice in memory; a set of contents makes both agree.
    return hashlib.sha256("".join(sorted(set(digests))).encode()).hexdigest()


def fingerprint_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Fingerprint:
    """Fingerprint an in-memory model and tokenizer."""
    digests = [
        _tensor_digest(_tensor_bytes(t), str(t.dtype).replace("torch.", ""), tuple(t.shape))
        for t in model.state_dict().values()
    ]
    return Fingerprint(
        config=config_digest(model.config.to_dict()),
        weights=_weights_digest(digests),
        tokenizer=tokenizer_digest(tokenizer),
    )


def fingerprint_dir(path: str | Path) -> Fingerprint:
    """Fingerprint a saved model folder (safetensors weights, config.json, tokenizer files).

    The weights part of a Hugging Face cache snapshot comes from the hashes the cache already holds
    (:func:`snapshot_weights_digest`); of any other folder, from its tensors (:func:`weights_digest_dir`).
    """
    return fingerprint_with_weights(path, snapshot_weights_digest(path) or weights_digest_dir(path))


def fingerprint_with_weights(path: str | Path, weights: str, tokenizer: Tokenizer | None = None) -> Fingerprint:
    """The folder's fingerprint around a weights part already known (``tokenizer``: the folder's, if loaded).

    Config and tokenizer parts are always computed here, from the files (cheap), so a cached weights
    part is the only thing that is ever reused.
    """
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(str(path))
    tok = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(str(path))
    return Fingerprint(config=config_digest(config.to_dict()), weights=weights, tokenizer=tokenizer_digest(tok))


def weights_digest_dir(path: str | Path) -> str:
    """The weights part of a folder's fingerprint from its tensors' contents: reads every tensor (the slow part)."""
    from safetensors import safe_open

    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    digests: list[str] = []
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                t = sf.get_tensor(key)
                digests.append(_tensor_digest(_tensor_bytes(t), str(t.dtype).replace("torch.", ""), tuple(t.shape)))
    return _weights_digest(digests)


# A blob's name is its etag: the sha256 of the content for LFS files (weights), the git blob sha1 otherwise.
_BLOB_NAME = re.compile(r"^(?:[0-9a-f]{64}|[0-9a-f]{40})$")


def snapshot_weights_digest(path: str | Path) -> str | None:
    """The weights part of a Hugging Face cache snapshot, from the blob hashes the cache holds; else None.

    In the hub cache, ``models--org--name/snapshots/<commit>/<file>`` is a link to ``../../blobs/<etag>``,
    and huggingface_hub checks a download against that etag (the content's sha256 for LFS files), so the
    sorted (file, etag) pairs of the ``*.safetensors`` files name the weights without reading a tensor.
    It depends on the content only (not on the repository, revision or commit), so the same snapshot
    reached by id or by path has one fingerprint. None when `path` is not such a snapshot or a weights
    file is not such a link (a cache on a file system without symlinks): hash the tensors then.
    """
    path = Path(path)
    blobs = path.parent.parent / "blobs"
    if path.parent.name != "snapshots" or not path.parent.parent.name.startswith("models--") or not blobs.is_dir():
        return None
    pairs: list[str] = []
    for f in sorted(path.glob("*.safetensors")):
        if not f.is_symlink() or not f.is_file():
            return None
        # one level of the link only: the blob's own name is the hash (it may itself be a link elsewhere)
        target = os.path.join(f.parent, os.readlink(f))
        same_dir = os.path.realpath(os.path.dirname(target)) == os.path.realpath(blobs)
        if not same_dir or not _BLOB_NAME.match(os.path.basename(target)):
            return None
        pairs.append(f"{f.name}:{os.path.basename(target)}")
    if not pairs:
        return None
    return hashlib.sha256(("hub-blobs-v1\n" + "\n".join(pairs)).encode()).hexdigest()


def _fp_dict(fp: Fingerprint | dict[str, str] | str | None) -> dict[str, str] | None:
    if fp is None:
        return None
    if isinstance(fp, str):
        return {"combined": fp}
    if isinstance(fp, dict):
        return fp
    return fp.as_dict()


def check_fingerprints(
    manifest: MappingManifest,
    source_fp: Fingerprint | dict[str, str] | str | None = None,
    target_fp: Fingerprint | dict[str, str] | str | None = None,
) -> None:
    """Raise :class:`StaleMappingError` naming what differs when the mapping was made for other models.

    Each fingerprint may be a :class:`Fingerprint`, its ``as_dict()`` or just the combined hash; a
    side given as None is not checked. It lives here, not in the store, because the evaluator and
    the repair calibration check loaded models against a manifest without loading tensors.
    """
    for side, given in (("source", _fp_dict(source_fp)), ("target", _fp_dict(target_fp))):
        if given is None:
            continue
        stored = getattr(manifest, side).fingerprint
        if given.get("combined") == stored.get("combined"):
            continue
        parts = [k for k in ("config", "weights", "tokenizer") if k in given and given[k] != stored.get(k)]
        what = ", ".join(parts) if parts else "combined fingerprint"
        raise StaleMappingError(
            f"this mapping was made for another {side} model ({what} differ: mapping has "
            f"{stored.get('combined', '?')[:12]}, given {given.get('combined', '?')[:12]}); "
            "recalibrate for this pair with `orchestra calibrate`"
        )
