"""A small real run on the bundled SmolLM2 family: root -> fine-tuned member (about a minute on 2 CPU cores)."""

from __future__ import annotations

import math

import pytest

from tests.mappings.conftest import DATA

pytestmark = pytest.mark.real_model


def test_root_to_finetuned_small_calibration(real_family, tmp_path):
    from mappings.apply import map_cache
    from mappings.cache_io import forward_with_cache, prefill
    from mappings.calibrate import calibrate
    from mappings.evaluate import evaluate
    from mappings.models import load_model
    from mappings.store import load_mapping

    root, finetuned = real_family.member_path("root"), real_family.member_path("finetuned")
    corpus = [(name, (DATA / name).read_text(encoding="utf-8")) for name in ("apache-2.0.txt", "mpl-2.0.txt")]
    # 4 x 256 fitting tokens; fixed α (no per-layer sweep) keeps this fast.
    mapping = calibrate(root, finetuned, corpus, method="anchored", tokens=1024, window=256, progress=False)
    out = mapping.save(tmp_path / "root-to-finetuned")
    loaded = load_mapping(out)
    assert loaded.manifest.source.kv_shape == {"num_layers": 30, "kv_heads": 3, "head_dim": 64}

    document = (DATA / "gpl-3.txt").read_text(encoding="utf-8")
    report = evaluate(out, document, prefix_tokens=256, suffix_tokens=32, tail_tokens=0, greedy_tokens=8,
                      baselines=("identity",), layer_curves=False)
    anchored, identity = report.row("anchored"), report.row("identity")
    assert math.isfinite(anchored.kl) and math.isfinite(identity.kl)
    assert anchored.kl <= 2 * identity.kl
    # the mapped cache runs on the target
    source, target = load_model(root), load_model(finetuned)
    ids = target.tokenizer(document, add_special_tokens=False, return_tensors="pt")["input_ids"][:, :80]
    _, cache = prefill(source.model, ids[:, :64])
    logits, _, _ = forward_with_cache(target.model, ids[:, 64:], map_cache(loaded.kv_map, cache, target.model))
    assert logits.isfinite().all()
