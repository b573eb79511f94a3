"""Mappings per (source, target) pair: found by fingerprints, calibrated on demand, with probe references.

The probe gate compares the target's loss on the trailing document tokens (recomputed over the
mapped prefix) with a *reference* that needs no target prefill: the source's loss on the same
tokens plus the pair's calibrated offset (target loss − source loss, measured on calibration
text at calibration time). The offset is stored beside the mapping in ``probe_reference.json``.
"""

from __future__ import annotations

import json
import logging
import threading
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, cast

from mappings.atomic import write_atomic
from orchestra.errors import MappingUnavailableError, OperationCancelledError
from orchestra.models.registry import LoadedModel, ModelInfo, shared_layers

if TYPE_CHECKING:
    from mappings.manifest import MappingManifest
    from mappings.store import Mapping
    from mappings.types import KVCache, Tensor

__all__ = ["ProbeReference", "MappingStore", "MappingStoreConfig", "PROBE_FILE", "StoredMapping", "ReferenceWindows"]

ReferenceWindows: TypeAlias = "list[tuple[list[int], Tensor, KVCache]]"
"""The source's half of a probe reference: per held-out window, its token ids, tail logits and cache."""


class StoredMapping(Protocol):
    """What the store reads of a mapping to keep its probe reference beside it: the manifest (and ``path``,
    when it has one). A `mappings.store.Mapping`, or a remote executor's proxy of one loaded elsewhere."""

    @property
    def manifest(self) -> MappingManifest: ...

PROBE_FILE = "probe_reference.json"
log = logging.getLogger("orchestra.familycache.mapping_store")


@dataclass(frozen=True)
class ProbeReference:
    """The pair's calibrated relation between source and target loss on trailing tokens."""

    tokens: int
    offset_nll: float
    """mean(target NLL − source NLL) on calibration windows' trailing tokens."""
    mapped_excess_nll: float
    """mean(mapped-probe NLL − target NLL) there: what a healthy mapping costs."""
    source_kl: float
    """mean KL(source ‖ target) over the trailing positions: how far the pair's predictions differ."""
    windows: int


def _read_json(path: Path) -> dict[str, Any]:
    """A probe-reference file, or {} when it is missing or unreadable (it is measured again then)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        log.warning("ignoring the unreadable probe reference %s; measuring it again", path)
        return {}
    return data if isinstance(data, dict) else {}


def _info(model: LoadedModel | ModelInfo) -> ModelInfo:
    return model if isinstance(model, ModelInfo) else model.info


def _calibration_corpus() -> list[tuple[str, str]]:
    from orchestra.documents.texts import CALIBRATION_TEXTS, data_text

    return [(name, data_text(name)) for name in CALIBRATION_TEXTS]


@dataclass(frozen=True)
class MappingStoreConfig:
    """What a `MappingStore` is made from: enough to rebuild it in another process (a Ray actor), no state."""

    directory: str
    on_missing: str = "calibrate"
    """"calibrate" a missing mapping on demand, or "refuse" (a gate failure)."""
    method: str = "auto"
    tokens: int = 8192
    """Calibration tokens for an on-demand calibration."""

    def build(self, *, on_missing: str | None = None) -> MappingStore:
        """The store (a fresh one: loaded mappings and probe references are not carried); `on_missing` overrides."""
        return MappingStore(Path(self.directory), on_missing=on_missing or self.on_missing, method=self.method,
                            tokens=self.tokens)


class MappingStore:
    """A folder of mapping directories, one per (source fingerprint, target fingerprint)."""

    def __init__(self, directory: Path, *, on_missing: str = "calibrate", method: str | None = None,
                 tokens: int = 8192, corpus: list[tuple[str, str]] | None = None) -> None:
        self.directory = Path(directory)
        self.on_missing = on_missing
        self.method = method or "auto"
        self.tokens = tokens
        self._corpus = corpus
        self._cache: dict[tuple[str, str], Mapping] = {}
        self._probe: dict[tuple[str, str, int], ProbeReference] = {}
        self._lock = threading.Lock()

    @property
    def config(self) -> MappingStoreConfig:
        """This store's settings (the calibration corpus is not part of them: a rebuilt store reads the default)."""
        return MappingStoreConfig(str(self.directory), self.on_missing, self.method, self.tokens)

    @property
    def corpus(self) -> list[tuple[str, str]]:
        if self._corpus is None:
            self._corpus = _calibration_corpus()
        return self._corpus

    def path_for(self, source: LoadedModel | ModelInfo, target: LoadedModel | ModelInfo) -> Path:
        s, t = _info(source), _info(target)
        return self.directory / f"{s.name}__to__{t.name}__{s.fingerprint[:10]}_{t.fingerprint[:10]}"

    def has(self, source: LoadedModel | ModelInfo, target: LoadedModel | ModelInfo) -> bool:
        """Whether a mapping for the pair is loaded or on disk (never calibrates)."""
        s, t = _info(source), _info(target)
        return (s.fingerprint, t.fingerprint) in self._cache or (self.path_for(s, t) / "manifest.json").is_file()

    def add(self, path: Path, source: LoadedModel, target: LoadedModel) -> Mapping:
        """Use the mapping in `path` for this pair (whatever its folder is called); checked against both fingerprints."""
        from mappings.store import load_mapping

        mapping = load_mapping(path, source.info.fingerprint, target.info.fingerprint, device=target.device)
        with self._lock:
            self._cache[(source.info.fingerprint, target.info.fingerprint)] = mapping
        return mapping

    def get(self, source: LoadedModel, target: LoadedModel, log: Callable[[str], None] | None = None,
            cancel: threading.Event | None = None) -> tuple[Mapping, bool]:
        """The mapping for the pair (loaded and fingerprint-checked) and whether it was calibrated just now.

        A folder at the pair's path without a manifest is a half-written mapping (an interrupted save of an
        older version, or a copy cut short): it counts as missing and a calibration replaces it. Setting
        `cancel` (from another thread) stops an on-demand calibration at its next forward pass; nothing is saved.
        """
        from mappings.store import load_mapping

        key = (source.info.fingerprint, target.info.fingerprint)
        with self._lock:
            if key in self._cache:
                return self._cache[key], False
            path = self.path_for(source, target)
            calibrated = False
            if not (path / "manifest.json").is_file():
                half = " (the folder there is a half-written mapping without a manifest)" if path.exists() else ""
                if self.on_missing == "refuse":
                    if source.info.quantized is not None or target.info.quantized is not None:
                        # `orchestra calibrate` loads folders as they are stored: it would fit the base, not the view
                        raise MappingUnavailableError(
                            f"no mapping for {source.info.name} -> {target.info.name} in {self.directory}{half}, and a "
                            "quantized view is only made when a pipeline loads it: set mapping.on_missing: calibrate"
                        )
                    raise MappingUnavailableError(
                        f"no mapping for {source.info.name} -> {target.info.name} in {self.directory}{half}; run "
                        f"`orchestra family calibrate`, or `orchestra calibrate --source {source.info.path} "
                        f"--target {target.info.path} --corpus FILE --out {path}`, or set mapping.on_missing: calibrate"
                    )
                msg = (f"no mapping for {source.info.name} -> {target.info.name}{half}: calibrating one now on "
                       f"{self.tokens} tokens (do this offline with `orchestra family calibrate` or `orchestra calibrate`)")
                warnings.warn(msg, stacklevel=2)
                if log:
                    log(msg)
                calibrated = self._calibrate_missing(source, target, path, cancel)
            mapping = load_mapping(path, source.info.fingerprint, target.info.fingerprint, device=target.device)
            self._cache[key] = mapping
            return mapping, calibrated

    def _calibrate_missing(self, source: LoadedModel, target: LoadedModel, path: Path,
                           cancel: threading.Event | None) -> bool:
        """Calibrate the pair at `path` unless another process saved it while this one waited; whether it did.

        Two processes on one home (a server and a script, or two test workers) that miss the same pair at
        once would otherwise both spend the calibration; the file lock makes the second load the first's.
        """
        from filelock import FileLock

        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path.parent / f".{path.name}.lock")):
            if (path / "manifest.json").is_file():
                return False
            self.calibrate(source, target, path, cancel=cancel)
            return True

    def fit(self, source: LoadedModel, target: LoadedModel, cancel: threading.Event | None = None) -> Mapping:
        """Calibrate the pair's mapping in memory (not saved); `cancel` stops it at the next forward pass."""
        from mappings.atomic import fault_point
        from mappings.calibrate import CalibrationSettings, calibrate

        fault_point("mapstore.calibrate")

        def check(module: object, args: object, kwargs: object = None) -> None:
            if cancel is not None and cancel.is_set():
                raise OperationCancelledError(
                    f"calibration of {source.info.name} -> {target.info.name} was cancelled; nothing was saved")

        # a base and its LoRA adapters compute the layers below the first one adapted identically
        settings = CalibrationSettings(method=self.method, tokens=self.tokens,
                                       exact_layers=shared_layers(source.info, target.info))
        handles = [m.register_forward_pre_hook(check) for m in {id(source.model): source.model,
                                                                  id(target.model): target.model}.values()]
        try:  # the handles carry the registry's fingerprints: what `get` checks the mapping by
            return calibrate(source.handle(), target.handle(), self.corpus, settings, progress=False)
        finally:
            for handle in handles:
                handle.remove()

    def calibrate(self, source: LoadedModel, target: LoadedModel, path: Path | None = None, *,
                  cancel: threading.Event | None = None) -> Mapping:
        """Calibrate the pair and save it at `path` (default: the pair's path) crash-safely.

        An existing mapping there is replaced only once the new one is complete, so it stays usable if this
        fails or is interrupted; the new mapping replaces a cached one for the pair.
        """
        path = path or self.path_for(source, target)
        mapping = self.fit(source, target, cancel)
        if cancel is not None and cancel.is_set():
            raise OperationCancelledError(
                f"calibration of {source.info.name} -> {target.info.name} was cancelled; nothing was saved")
        mapping.save(path)
        self._cache.pop((source.info.fingerprint, target.info.fingerprint), None)
        return mapping

    def probe_reference(self, source: LoadedModel, target: LoadedModel, mapping: StoredMapping, tokens: int,
                        window: int = 512, windows: int = 2,
                        measure: Callable[[int, int, int], ProbeReference] | None = None) -> ProbeReference:
        """Load or measure the pair's probe reference for `tokens` trailing tokens.

        `measure(tokens, window, windows)` replaces the in-process measurement (a remote executor runs
        `reference_source` where the source lives and `reference_target` where the target lives); without
        it `mapping` is the loaded `mappings.store.Mapping` itself, whose tensors the measurement runs.
        """
        key = (source.info.fingerprint, target.info.fingerprint, tokens)
        if key in self._probe:
            return self._probe[key]
        folder = getattr(mapping, "path", None)
        path = Path(folder) / PROBE_FILE if folder else None
        if path is not None and path.is_file():
            stored = _read_json(path)
            entry = stored.get(str(tokens))
            if entry is not None and stored.get("mapping_sha256") == mapping.manifest.tensors.sha256:
                try:
                    ref = ProbeReference(**entry)
                except TypeError:  # written by an older version: measure again
                    ref = None
            else:
                ref = None
            if ref is not None:
                self._probe[key] = ref
                return ref
        if measure is not None:
            ref = measure(tokens, window, windows)
        else:
            ref = self._measure_reference(source, target, cast("Mapping", mapping), tokens, window, windows)
        self._probe[key] = ref
        if path is not None:
            try:
                stored = _read_json(path)
                if stored.get("mapping_sha256") != mapping.manifest.tensors.sha256:
                    stored = {"mapping_sha256": mapping.manifest.tensors.sha256}
                stored[str(tokens)] = asdict(ref)
                write_atomic(path, json.dumps(stored, indent=2))
            except OSError as exc:  # a read-only home: the reference is measured again next time
                log.warning("cannot store the probe reference in %s (%s); it will be measured again next time",
                            path, exc.strerror or exc)
        return ref

    def _measure_reference(self, source: LoadedModel, target: LoadedModel, mapping: Mapping, tokens: int,
                           window: int, windows: int) -> ProbeReference:
        measured = self.reference_source(source, tokens, window, windows)
        return self.reference_target(target, mapping, measured, tokens)

    def reference_source(self, source: LoadedModel, tokens: int, window: int = 512,
                         windows: int = 2) -> ReferenceWindows:
        """The source's half of a probe reference: per held-out window, its ids, tail logits and cache."""
        import torch

        from mappings.cache_io import forward_with_cache

        ids_all: list[int] = []
        for _name, text in self.corpus:
            ids_all += source.tokenizer(text, add_special_tokens=False)["input_ids"]
        count = max(1, min(windows, len(ids_all) // window))
        # the last windows of the corpus: the calibration's own held-out part
        starts = [len(ids_all) - (i + 1) * window for i in range(count)]
        out = []
        with torch.no_grad():
            for start in starts:
                ids = ids_all[start : start + window]
                s_logits, s_cache, _ = forward_with_cache(source.model, torch.tensor([ids], device=source.device), None,
                                                          logits_to_keep=tokens)
                out.append((ids, s_logits[0].float(), s_cache))
        return out

    @staticmethod
    def reference_target(target: LoadedModel, mapping: Mapping, measured: ReferenceWindows,
                         tokens: int) -> ProbeReference:
        """The target's half: its own and the mapped tail loss on the windows `reference_source` measured."""
        import torch

        from mappings.apply import map_cache, tail_recompute
        from mappings.cache_io import forward_with_cache
        from mappings.metrics import mean_kl, tail_nll

        offsets, excess, kls = [], [], []
        with torch.no_grad():
            for window_ids, s_logits, s_cache in measured:
                ids = torch.tensor([window_ids], device=target.device)
                tail = torch.tensor(window_ids[-tokens:])
                s_logits = s_logits.to(target.device)
                t_logits, _, _ = forward_with_cache(target.model, ids, None, logits_to_keep=tokens)
                mapped = map_cache(mapping.kv_map, s_cache, target.model)
                m_logits, _ = tail_recompute(target.model, mapped, ids, tokens)
                s_nll, t_nll, m_nll = tail_nll(s_logits, tail), tail_nll(t_logits[0], tail), tail_nll(m_logits[0], tail)
                offsets.append(t_nll - s_nll)
                excess.append(m_nll - t_nll)
                kls.append(mean_kl(s_logits, t_logits[0]))
        return ProbeReference(tokens=tokens, offset_nll=sum(offsets) / len(offsets),
                              mapped_excess_nll=sum(excess) / len(excess), source_kl=sum(kls) / len(kls),
                              windows=len(measured))
