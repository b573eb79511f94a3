"""Mappings per (source, target) pair: found by fingerprints, calibrated on demand, with probe references.

The probe gate compares the target's loss on the trailing document tokens (recomputed over the
mapped prefix) with a *reference* that needs no target prefill: the source's loss on the same
tokens plus the pair's calibrated offset (target loss − source loss, measured on calibration
text at calibration time). The offset is stored beside the mapping in ``probe_reference.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from orchestra.errors import MappingUnavailableError
from orchestra.registry import LoadedModel, ModelInfo

__all__ = ["ProbeReference", "MappingStore", "PROBE_FILE"]

PROBE_FILE = "probe_reference.json"


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


def _calibration_corpus() -> list[tuple[str, str]]:
    from orchestra.family.corpus import CALIBRATION_TEXTS, data_text

    return [(name, data_text(name)) for name in CALIBRATION_TEXTS]


class MappingStore:
    """A folder of mapping directories, one per (source fingerprint, target fingerprint)."""

    def __init__(self, directory: Path, *, on_missing: str = "calibrate", method: str | None = None,
                 tokens: int = 8192, corpus: list[tuple[str, str]] | None = None) -> None:
        self.directory = Path(directory)
        self.on_missing = on_missing
        self.method = method or "auto"
        self.tokens = tokens
        self._corpus = corpus
        self._cache: dict[tuple[str, str], Any] = {}
        self._probe: dict[tuple[str, str, int], ProbeReference] = {}
        self._lock = threading.Lock()

    @property
    def corpus(self) -> list[tuple[str, str]]:
        if self._corpus is None:
            self._corpus = _calibration_corpus()
        return self._corpus

    def path_for(self, source: LoadedModel | ModelInfo, target: LoadedModel | ModelInfo) -> Path:
        s, t = getattr(source, "info", source), getattr(target, "info", target)
        return self.directory / f"{s.name}__to__{t.name}__{s.fingerprint[:10]}_{t.fingerprint[:10]}"

    def has(self, source: LoadedModel | ModelInfo, target: LoadedModel | ModelInfo) -> bool:
        """Whether a mapping for the pair is loaded or on disk (never calibrates)."""
        s, t = getattr(source, "info", source), getattr(target, "info", target)
        return (s.fingerprint, t.fingerprint) in self._cache or (self.path_for(s, t) / "manifest.json").is_file()

    def add(self, path: Path, source: LoadedModel, target: LoadedModel) -> Any:
        """Use the mapping in `path` for this pair (whatever its folder is called); checked against both fingerprints."""
        from mappings.store import load_mapping

        mapping = load_mapping(path, source.info.fingerprint, target.info.fingerprint, device=target.device)
        with self._lock:
            self._cache[(source.info.fingerprint, target.info.fingerprint)] = mapping
        return mapping

    def get(self, source: LoadedModel, target: LoadedModel, log=None) -> tuple[Any, bool]:
        """The mapping for the pair (loaded and fingerprint-checked) and whether it was calibrated just now."""
        from mappings.store import load_mapping

        key = (source.info.fingerprint, target.info.fingerprint)
        with self._lock:
            if key in self._cache:
                return self._cache[key], False
            path = self.path_for(source, target)
            calibrated = False
            if not (path / "manifest.json").is_file():
                if self.on_missing == "refuse":
                    raise MappingUnavailableError(
                        f"no mapping for {source.info.name} -> {target.info.name} in {self.directory}; run "
                        f"`orchestra calibrate --source {source.info.path} --target {target.info.path} "
                        f"--corpus FILE --out {path}` or set mapping.on_missing: calibrate"
                    )
                msg = (f"no mapping for {source.info.name} -> {target.info.name}: calibrating one now on "
                       f"{self.tokens} tokens (do this offline with `orchestra calibrate`)")
                warnings.warn(msg, stacklevel=2)
                if log:
                    log(msg)
                self._calibrate(source, target, path)
                calibrated = True
            mapping = load_mapping(path, source.info.fingerprint, target.info.fingerprint, device=target.device)
            self._cache[key] = mapping
            return mapping, calibrated

    def _calibrate(self, source: LoadedModel, target: LoadedModel, path: Path) -> None:
        from mappings.calibrate import calibrate

        mapping = calibrate(
            source.model, target.model, self.corpus, method=self.method, tokens=self.tokens, progress=False,
            source_tokenizer=source.tokenizer, target_tokenizer=target.tokenizer,
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".tmp-{path.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            mapping.save(tmp)
            os.replace(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def probe_reference(self, source: LoadedModel, target: LoadedModel, mapping: Any, tokens: int,
                        window: int = 512, windows: int = 2) -> ProbeReference:
        """Load or measure the pair's probe reference for `tokens` trailing tokens."""
        key = (source.info.fingerprint, target.info.fingerprint, tokens)
        if key in self._probe:
            return self._probe[key]
        path = Path(mapping.path) / PROBE_FILE if getattr(mapping, "path", None) else None
        if path is not None and path.is_file():
            stored = json.loads(path.read_text())
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
        ref = self._measure_reference(source, target, mapping, tokens, window, windows)
        self._probe[key] = ref
        if path is not None:
            stored = json.loads(path.read_text()) if path.is_file() else {}
            if stored.get("mapping_sha256") != mapping.manifest.tensors.sha256:
                stored = {"mapping_sha256": mapping.manifest.tensors.sha256}
            stored[str(tokens)] = asdict(ref)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(stored, indent=2))
            os.replace(tmp, path)
        return ref

    def _measure_reference(self, source: LoadedModel, target: LoadedModel, mapping: Any, tokens: int,
                           window: int, windows: int) -> ProbeReference:
        import torch

        from mappings.apply import map_cache, tail_recompute
        from mappings.cache_io import forward_with_cache
        from mappings.metrics import mean_kl, tail_nll

        ids_all: list[int] = []
        for _name, text in self.corpus:
            ids_all += source.tokenizer(text, add_special_tokens=False)["input_ids"]
        count = max(1, min(windows, len(ids_all) // window))
        # the last windows of the corpus: the calibration's own held-out part
        starts = [len(ids_all) - (i + 1) * window for i in range(count)]
        offsets, excess, kls = [], [], []
        with torch.no_grad():
            for start in starts:
                ids = torch.tensor(ids_all[start : start + window]).unsqueeze(0)
                tail = ids[0, -tokens:]
                s_logits, s_cache, _ = forward_with_cache(source.model, ids.to(source.device), None, logits_to_keep=tokens)
                t_logits, _, _ = forward_with_cache(target.model, ids.to(target.device), None, logits_to_keep=tokens)
                mapped = map_cache(mapping.kv_map, s_cache, target.model)
                m_logits, _ = tail_recompute(target.model, mapped, ids.to(target.device), tokens)
                s_nll, t_nll, m_nll = tail_nll(s_logits[0], tail), tail_nll(t_logits[0], tail), tail_nll(m_logits[0], tail)
                offsets.append(t_nll - s_nll)
                excess.append(m_nll - t_nll)
                kls.append(mean_kl(s_logits[0], t_logits[0]))
        return ProbeReference(tokens=tokens, offset_nll=sum(offsets) / len(offsets),
                              mapped_excess_nll=sum(excess) / len(excess), source_kl=sum(kls) / len(kls),
                              windows=len(starts))
