"""Content fingerprints of a model: config, weights and tokenizer, hashed separately.

A mapping, a cached KV tensor and a family record are only valid for the exact models that
produced them; these hashes are what every cache key and manifest compares.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mappings.errors import StaleMappingError

if TYPE_CHECKING:  # heavy imports stay out of the import path
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from mappings.manifest import MappingManifest

__all__ = ["Fingerprint", "fingerprint_model", "fingerprint_dir", "config_digest", "tokenizer_digest",
           "check_fingerprints"]

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
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = {k: str(v) for k, v in tokenizer.special_tokens_map.items()}
    payload = {"vocab": vocab, "special": special, "class_free": True}
    return hashlib.sha256(_canonical(payload)).hexdigest()


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
    """Fingerprint a saved model folder (safetensors weights, config.json, tokenizer files)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

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
    config = AutoConfig.from_pretrained(str(path))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return Fingerprint(
        config=config_digest(config.to_dict()),
        weights=_weights_digest(digests),
        tokenizer=tokenizer_digest(tokenizer),
    )


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
