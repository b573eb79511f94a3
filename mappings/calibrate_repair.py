"""Calibrate layer repair for an existing mapping: fit its residual-stream maps and record the plan.

The workflow behind ``orchestra calibrate-repair``: load both models (checked against the
mapping's fingerprints), cut the corpus into windows the way KV calibration does, fit one
residual map per target layer (:mod:`mappings.residual`) and record in the manifest the
per-layer repair scores and the blocks the planner (:mod:`mappings.repair`) would pick for small
layer budgets. It sits on top of calibration, residual maps and the planner, and nothing below it
imports it, which is what keeps those modules free of import cycles.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from mappings.calibrate import Corpus
    from mappings.models import ModelHandle
    from mappings.store import Mapping
    from mappings.types import Model

__all__ = ["add_residual_maps"]


def add_residual_maps(
    mapping: Mapping,
    source: str | Path | ModelHandle | Model,
    target: str | Path | ModelHandle | Model,
    corpus: Corpus,
    *,
    tokens: int = 4096,
    window: int = 512,
    progress: bool = False,
) -> Mapping:
    """Fit residual-stream maps for ``mapping``'s pair on ``corpus`` and record them in its manifest.

    ``source``/``target``: model folders, handles or loaded models (checked against the mapping's
    fingerprints: :class:`~mappings.errors.StaleMappingError` for other models). The planner's
    per-layer blocks for layer budgets of 1..5 layers are recorded too. Save the mapping afterwards
    (``mapping.save(dir)``) to keep them. ``progress`` is accepted for symmetry with
    :func:`~mappings.calibrate.calibrate`; fitting shows no bar.
    """
    from mappings.calibrate import CalibrationSettings, prepare_windows
    from mappings.fingerprint import check_fingerprints
    from mappings.manifest import RepairInfo
    from mappings.models import load_model
    from mappings.repair import choose_blocks, layer_scores
    from mappings.residual import fit_residual_maps

    src, tgt = load_model(source), load_model(target)
    check_fingerprints(mapping.manifest, src.fingerprint, tgt.fingerprint)
    windows = prepare_windows(corpus, tgt.tokenizer, CalibrationSettings(tokens=tokens, window=window))
    plan = [lm.sources[0] for lm in mapping.kv_map.layers]
    residual = fit_residual_maps(src.model, tgt.model, windows.train, windows.heldout, plan)
    scores = layer_scores(mapping.manifest)
    blocks = {str(k): [list(b) for b in choose_blocks(scores, k)] for k in range(1, min(5, len(scores)) + 1)}
    mapping.residual = residual
    mapping.manifest = mapping.manifest.model_copy(update={"repair": RepairInfo(
        layer_scores=scores,
        residual_cosine=[lm.cosine for lm in residual.layers],
        residual_identity_cosine=[lm.identity_cosine for lm in residual.layers],
        residual_r2=[lm.r2 for lm in residual.layers],
        residual_alpha=[lm.alpha for lm in residual.layers],
        residual_tokens=residual.tokens, residual_seconds=residual.seconds, blocks=blocks,
    )})
    return mapping
