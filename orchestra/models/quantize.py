"""Quantized views of a member: its base's weights, loaded afresh and quantized at load time by torchao.

A pipeline declares one as ``q8: {base: root, quantize: int8}`` (`orchestra.models.modelref.QuantizeSpec`). The
registry loads the base's safetensors again (a quantized model cannot share the base's full-precision
tensors) and :func:`quantize_decoder` swaps every ``Linear`` weight inside the decoder layers for a torchao
tensor subclass holding integer data and scales. Embeddings and ``lm_head`` stay in the compute dtype: an
error there lands on every logit directly, and many checkpoints (SmolLM2 among them) tie ``lm_head`` to
the embeddings, which quantizing one of the two would untie into two copies.

Schemes (:data:`SCHEMES`):

- ``int8``: int8 weights with one scale per output channel (``Int8WeightOnlyConfig``); activations stay
  in the compute dtype, so a pass dequantizes weights as it goes;
- ``int8-dynamic``: the same weights, activations quantized to int8 per token at run time
  (``Int8DynamicActivationInt8WeightConfig``);
- ``int4``: 4-bit weights in groups, packed for the tinygemm kernel (``Int4WeightOnlyConfig``, tile-packed):
  a CUDA device of compute capability 8.0 or more, computing in bfloat16. torchao has no packed int4
  format for the CPU (its CPU int4 stores one value per byte: no smaller than int8), so it is refused there.

torchao is the ``quant`` extra; it is imported only when a view is loaded, and its
absence is a `MissingDependencyError` naming the install command, raised when the view is resolved.

Once installed, transformers imports torchao whenever it loads any model, and that import logs warnings
that concern no scheme here (:func:`quiet_torchao_import` drops those, and only those).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from orchestra.errors import QuantizeError

if TYPE_CHECKING:
    import torch

    from mappings.types import Model

__all__ = ["Scheme", "SCHEMES", "RECIPE_VERSION", "torchao_version", "check_device",
           "quantize_decoder", "resident_bytes", "estimate_bytes", "quantized_linears", "quiet_torchao_import"]


RECIPE_VERSION = 1
"""Bump when what a scheme computes changes (which modules, which torchao config): views fingerprint apart."""


@dataclass(frozen=True)
class Scheme:
    """One quantization scheme a view may name, as it is run and fingerprinted."""

    name: str
    """What a pipeline writes after ``quantize:``."""
    config: str
    """The torchao config it applies, with the arguments that change the result (part of the fingerprint)."""
    weight_bits: int
    """Bits per quantized weight (scales and zero points aside)."""
    cuda_only: bool
    """Whether torchao runs it on CUDA devices only."""
    compute_dtype: str | None
    """The dtype the view must compute in whatever the pipeline's (None: the pipeline's)."""


SCHEMES: dict[str, Scheme] = {
    "int8": Scheme("int8", "Int8WeightOnlyConfig(granularity=PerRow)", 8, False, None),
    "int8-dynamic": Scheme("int8-dynamic", "Int8DynamicActivationInt8WeightConfig(granularity=PerRow)", 8, False,
                           None),
    "int4": Scheme("int4", "Int4WeightOnlyConfig(packing=tile_packed_to_4d, qparams=tinygemm, group_size=auto)",
                   4, True, "bfloat16"),
}

# int4 group sizes tried, largest first: the largest that divides every quantized Linear's input width
_INT4_GROUPS = (128, 64, 32)


def torchao_version(alias: str) -> str:
    """The installed torchao's version (read from its metadata, not imported); else MissingDependencyError."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchao")
    except PackageNotFoundError:
        from agents.errors import MissingDependencyError
        from orchestra.errors import install_command

        raise MissingDependencyError(
            f"model {alias!r} is a quantized view, which torchao makes, and torchao is not installed: "
            f"{install_command('quant')}", name="torchao") from None


def check_device(alias: str, scheme: Scheme, device: str) -> None:
    """Refuse, in one line, a scheme `device` cannot run (``auto`` stands for the device it would pick)."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if scheme.cuda_only and not device.startswith("cuda"):
        raise QuantizeError(
            f"model {alias!r}: quantize {scheme.name} runs on CUDA only (torchao packs int4 for the GPU kernel; "
            f"on the CPU it would take as much memory as int8), and this view would load on {device}: use "
            "quantize: int8, or place it on a CUDA device with devices")
    if scheme.name == "int4" and torch.cuda.is_available():
        try:
            major, minor = torch.cuda.get_device_capability(torch.device(device))
        except (AssertionError, RuntimeError, ValueError):
            return  # not a device of this machine: placement refuses it, naming the ones there are
        if major < 8:
            raise QuantizeError(
                f"model {alias!r}: quantize int4 needs a CUDA device of compute capability 8.0 or more (torchao's "
                f"tinygemm kernel), and {device} has {major}.{minor}: use quantize: int8")


class _ImportNoise(logging.Filter):
    """Drops the warnings torchao's import logs that concern nothing a user of these schemes can act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        import sys

        message = record.getMessage()
        if record.name == "torchao" and message.startswith("Failed to load "):
            # the wheel's CUDA-only kernel libraries (mxfp8, cutlass): they cannot load on a CPU build of torch
            torch = sys.modules.get("torch")
            return not (torch is not None and getattr(torch.version, "cuda", None) is None)
        # torchao registers Enums with torch's pytree, which torch 2.13 reports as deprecated to library authors
        return "is an Enum subclass and is now natively supported" not in message


_FILTER = _ImportNoise()


def quiet_torchao_import() -> None:
    """Drop the import-time warnings of torchao that `_ImportNoise` names (once; other records pass)."""
    for name in ("torchao", "torch.utils._pytree"):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


def _config(scheme: Scheme, group_size: int) -> object:
    quiet_torchao_import()
    from torchao.quantization import (
        Int4WeightOnlyConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
    )
    # set_inductor_config=False: the default rewrites torch._inductor's global settings, for torch.compile,
    # which nothing here runs
    if scheme.name == "int8":
        return Int8WeightOnlyConfig(set_inductor_config=False)
    if scheme.name == "int8-dynamic":
        return Int8DynamicActivationInt8WeightConfig(set_inductor_config=False)
    return Int4WeightOnlyConfig(group_size=group_size, int4_packing_format="tile_packed_to_4d",
                                set_inductor_config=False)


def _decoder_linears(model: Model) -> dict[str, torch.nn.Linear]:
    """The ``Linear`` modules inside the decoder layers, by their names in `model`."""
    import torch

    from mappings.capture import decoder_layers

    inside = {id(m) for layer in decoder_layers(model) for m in layer.modules()}
    return {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and id(m) in inside}


def _group_size(alias: str, scheme: Scheme, linears: dict[str, torch.nn.Linear]) -> int:
    if scheme.weight_bits != 4:
        return 0
    widths = {m.in_features for m in linears.values()}
    for size in _INT4_GROUPS:
        if all(w % size == 0 for w in widths):
            return size
    raise QuantizeError(f"model {alias!r}: quantize int4 needs Linear input widths divisible by 32, and this model "
                        f"has {', '.join(str(w) for w in sorted(widths))}: use quantize: int8")


def quantize_decoder(model: Model, alias: str, scheme: Scheme, device: str) -> int:
    """Quantize every decoder ``Linear`` of `model` in place on `device` (the model ends there); how many.

    A refusal of torchao's (a kernel missing on this device, a shape it does not take) is a one-line
    `QuantizeError`, and so is a scheme that left some of those layers full precision.
    """
    import torch

    linears = _decoder_linears(model)
    if not linears:
        raise QuantizeError(f"model {alias!r}: {type(model).__name__} has no Linear layers in its decoder to quantize")
    config = _config(scheme, _group_size(alias, scheme, linears))
    from torchao.quantization import quantize_

    targets = {id(m) for m in linears.values()}
    try:
        quantize_(model, config, filter_fn=lambda module, _name: id(module) in targets, device=torch.device(device))
    except (ImportError, NotImplementedError, AssertionError, ValueError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise QuantizeError(f"model {alias!r}: torchao {torchao_version(alias)} cannot run quantize {scheme.name} on "
                            f"{device}: {first}") from exc
    model.to(torch.device(device))  # type: ignore[arg-type]  # transformers' @wraps(Module.to) hides the bound self
    quantized = quantized_linears(model)
    plain = [name for name in _decoder_linears(model) if name not in quantized]
    if plain:
        raise QuantizeError(f"model {alias!r}: torchao left {len(plain)} of {len(linears)} decoder Linear layers in "
                            f"full precision under quantize {scheme.name} (first: {plain[0]}): use quantize: int8")
    return len(linears)


def quantized_linears(model: Model) -> dict[str, torch.Tensor]:
    """The weights of `model`'s Linear layers that are torchao tensor subclasses, by module name."""
    import torch

    return {name: m.weight for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and type(m.weight) not in (torch.Tensor, torch.nn.Parameter)}


def _storages(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors holding `t`'s data: itself, or a tensor subclass's components, recursively."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None:
        yield t
        return
    names, _meta = flatten()
    for name in names:
        inner = getattr(t, name)
        if inner is not None:
            yield from _storages(inner)


def resident_bytes(*modules: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind the modules' parameters and buffers, torchao's components included."""
    seen: dict[int, int] = {}
    for module in modules:
        for t in (*module.parameters(), *module.buffers()):
            for part in _storages(t):
                storage = part.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def estimate_bytes(folder: Path, scheme: Scheme, dtype_size: int, num_layers: int) -> int:
    """The view's resident bytes, from the tensor shapes in the base's safetensors headers (no tensor read).

    A 2-D ``.weight`` inside a decoder layer takes ``weight_bits`` per value plus its scales and zero points
    (per row for int8, per group of the smallest size for int4); everything else ``dtype_size`` per value.
    """
    import re
    import struct

    layer = re.compile(r"(?:^|\.)(?:layers|h|blocks|block|layer)\.(\d+)\.")
    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            shape = [int(d) for d in entry["shape"]]
            count = 1
            for d in shape:
                count *= d
            found = layer.search(name)
            if len(shape) == 2 and name.endswith(".weight") and found and int(found[1]) < num_layers:
                if scheme.weight_bits == 4:  # tile packing pads the input width to a multiple of 1024
                    width = -(-shape[1] // 1024) * 1024
                    total += shape[0] * width // 2 + shape[0] * (width // _INT4_GROUPS[-1]) * 4
                else:
                    total += count + shape[0] * 5  # int8 values, a float32 scale and an int8 zero point per row
            else:
                total += count * dtype_size
    return total
