"""Calibration rows: the sinks left out of the fit, value rows weighed by the attention they receive."""

from __future__ import annotations

import pytest
import torch

from mappings.calibrate import (
    CalibrationSettings,
    HeldOut,
    KLJudge,
    MapLayout,
    accumulate_stats,
    capture_heldout,
    prepare_windows,
)
from mappings.capture import capture_kv, kv_shape
from mappings.errors import CorpusTooSmallError
from mappings.methods import METHODS
from mappings.rope import RopeSpec
from mappings.weighting import RowWeighting
from tests.mappings.conftest import WINDOW, load, load_tokenizer


def test_served_methods_weigh_rows_and_baselines_do_not():
    assert RowWeighting.of(METHODS["anchored_kl"]) == RowWeighting(skip=4, values="attention", mix=0.5, queries=128)
    assert RowWeighting.of(METHODS["ridge_kl"]).skip == 4
    for plain in ("ridge", "paper", "anchored", "perhead_rope"):
        assert RowWeighting.of(METHODS[plain]).plain  # the textbook formulas stay textbook


def test_rows_keep_all_but_the_sinks_and_weigh_values_by_received_attention(llama_family):
    model = load(llama_family.child)
    ids = torch.randint(3, 300, (2, 48), generator=torch.Generator().manual_seed(3))
    cap = capture_kv(model, ids, queries=True)
    rows = RowWeighting(skip=4, values="attention", mix=0.5, queries=16).rows(cap, model)
    assert rows.keep.tolist() == [p >= 4 for p in cap.positions.tolist()]
    assert rows.values is not None and len(rows.values) == kv_shape(model.config).num_layers
    for w in rows.values:
        assert w.shape == (2 * 44,) and float(w.min()) >= 0.5 * 0.5 and w.mean().item() == pytest.approx(1.0)
    # the weights follow the attention: the last position is seen by one of the 16 queries alone, so some
    # earlier position always weighs more, and the weights are not all alike
    w0 = rows.values[0].view(2, 44)
    assert float(w0.std()) > 0 and torch.all(w0[:, :28].max(1).values > w0[:, -1])
    with pytest.raises(ValueError, match="queries"):
        RowWeighting(values="attention").rows(capture_kv(model, ids), model)
    assert RowWeighting(skip=4).rows(cap, model).values is None


def test_fit_statistics_leave_out_the_sinks_and_plain_ones_keep_every_row(llama_family, corpus):
    source, target = load(llama_family.parent), load(llama_family.child)
    windows = prepare_windows(corpus, load_tokenizer(llama_family.parent), CalibrationSettings(tokens=256, window=WINDOW))
    s, t = kv_shape(source.config), kv_shape(target.config)
    ropes = RopeSpec.from_config(source.config), RopeSpec.from_config(target.config)
    layout = MapLayout([(i,) for i in range(t.num_layers)], s, t, *ropes)
    fit, plain = accumulate_stats(source, target, windows.train, layout, "content", progress=False,
                                  weighting=RowWeighting.of(METHODS["anchored_kl"]))
    alone, same = accumulate_stats(source, target, windows.train, layout, "content", progress=False)
    assert alone is same  # without a weighting the fit sees the plain statistics
    rows = len(windows.train) * WINDOW
    for a, b, c in zip(fit, plain, alone, strict=True):
        assert b.keys.n == b.values.n == rows and a.keys.n == a.values.n == rows - 4 * len(windows.train)
        torch.testing.assert_close(b.values.xtx, c.values.xtx)
        assert not torch.allclose(a.values.xtx / a.values.n, b.values.xtx / b.values.n, rtol=1e-3)


def test_the_judge_scores_candidates_with_the_targets_own_sinks(llama_family, corpus):
    source, target = load(llama_family.parent), load(llama_family.child)
    windows = prepare_windows(corpus, load_tokenizer(llama_family.parent), CalibrationSettings(tokens=256, window=WINDOW))
    held = capture_heldout(source, target, windows.heldout, queries=False)
    with_sinks, bare = KLJudge(target, held, 16, sinks=4), KLJudge(target, held, 16)
    candidate = with_sinks.source_prefix  # the source's K/V unchanged, as a candidate map
    patched = [(torch.cat([tk[:, :, :4], k[:, :, 4:]], 2), torch.cat([tv[:, :, :4], v[:, :, 4:]], 2))
               for (k, v), (tk, tv) in zip(candidate, held.target, strict=True)]
    assert with_sinks.kl(candidate) == pytest.approx(bare.kl(patched), rel=1e-5)
    assert with_sinks.kl(candidate) != pytest.approx(bare.kl(candidate), rel=1e-3)
    assert isinstance(held, HeldOut)


def test_the_judge_with_a_tail_recomputes_it_over_the_candidate_and_ignores_its_map_there(llama_family, corpus):
    source, target = load(llama_family.parent), load(llama_family.child)
    windows = prepare_windows(corpus, load_tokenizer(llama_family.parent), CalibrationSettings(tokens=256, window=WINDOW))
    held = capture_heldout(source, target, windows.heldout, queries=False)
    judge, bare = KLJudge(target, held, 16, sinks=4, tail=8), KLJudge(target, held, 16, sinks=4)
    prefix = judge.prefix
    truth = [(k[:, :, :prefix], v[:, :, :prefix]) for k, v in held.target]
    assert judge.kl(truth) == pytest.approx(0.0, abs=1e-5)  # the tail recomputed over the own prefix is the own tail

    def spoil(layers, start, stop):  # the candidate's K/V at [start, stop) replaced by noise
        out = []
        for k, v in layers:
            k, v = k.clone(), v.clone()
            k[:, :, start:stop] = torch.randn_like(k[:, :, start:stop]) * 3
            v[:, :, start:stop] = torch.randn_like(v[:, :, start:stop]) * 3
            out.append((k, v))
        return out

    torch.manual_seed(0)
    in_tail, before_tail = spoil(truth, prefix - 8, prefix), spoil(truth, prefix - 16, prefix - 8)
    assert judge.kl(in_tail) == pytest.approx(0.0, abs=1e-5)  # what the candidate maps there is never read
    assert bare.kl(in_tail) > 1e-3  # ... while a judge without the tail scores it
    assert judge.kl(before_tail) > 1e-3  # positions before the tail still count, through the recomputed tail too


def test_windows_no_longer_than_the_sinks_are_refused(llama_family, corpus):
    from mappings.calibrate import calibrate

    with pytest.raises(CorpusTooSmallError, match="raise --window"):
        calibrate(llama_family.parent, llama_family.child, corpus, CalibrationSettings(tokens=64, window=4),
                  progress=False)
