"""Load a model + tokenizer + fingerprint from a folder, or wrap one already in memory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mappings.fingerprint import Fingerprint, fingerprint_dir, fingerprint_model

if TYPE_CHECKING:
    from mappings.types import DeviceLike, DType, Model, Tokenizer

__all__ = ["ModelHandle", "load_model"]


@dataclass
class ModelHandle:
    """A causal LM ready for capture: model (eval mode), tokenizer, fingerprint, origin."""

    model: Model
    """The transformers causal LM."""
    tokenizer: Tokenizer
    """Its tokenizer."""
    fingerprint: Fingerprint
    """Content hashes of config, weights and tokenizer."""
    path: Path | None = None
    """The folder it was loaded from (None for an in-memory model)."""

    @property
    def name(self) -> str:
        if self.path is not None:
            return str(self.path)
        return str(getattr(self.model.config, "_name_or_path", "") or type(self.model).__name__)


def load_model(
    source: str | Path | ModelHandle | Model,
    tokenizer: Tokenizer | None = None,
    *,
    device: DeviceLike = "cpu",
    dtype: DType | str | None = None,
    fingerprint: Fingerprint | None = None,
) -> ModelHandle:
    """A :class:`ModelHandle` from a model folder, a handle, or an in-memory model (+ its tokenizer).

    Folders are fingerprinted from their files; in-memory models from their state dict.
    ``dtype`` (e.g. ``"float32"``) overrides the stored dtype when loading a folder.
    """
    import torch

    if isinstance(source, ModelHandle):
        return source
    if isinstance(source, (str, Path)):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(source)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a model folder (no config.json)")
        torch_dtype: DType | None = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        kwargs: dict[str, DType] = {"dtype": torch_dtype} if torch_dtype is not None else {}
        try:
            loaded = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
        except TypeError:  # transformers 4 spells it torch_dtype
            loaded = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch_dtype)
        loaded.to(device).eval()  # type: ignore[arg-type]  # transformers' @wraps(Module.to) hides the bound self
        tok = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(str(path))
        return ModelHandle(loaded, tok, fingerprint or fingerprint_dir(path), path)
    model = source
    if tokenizer is None:
        from transformers import AutoTokenizer

        name = getattr(model.config, "_name_or_path", None)
        if not name:
            raise ValueError("an in-memory model needs its tokenizer: pass tokenizer=")
        tokenizer = AutoTokenizer.from_pretrained(name)
    model.eval()
    return ModelHandle(model, tokenizer, fingerprint or fingerprint_model(model, tokenizer), None)
