"""Calibrate a KV map for a source → target pair on a text corpus.

1. Check the pair (tokenizers must match; shape and RoPE differences are bridged).
2. Cut the corpus into windows. Held-out windows come from the *last* corpus text when several
   are given (a different domain than the fitting text — the issue's trap: text overlapping the
   target's fine-tuning data makes every map look better than it is), else from the tail.
3. When depths differ, pick each target layer's source layers by held-out single-source fit.
4. Stream the training windows through both models, accumulating per-layer statistics
   (keys in RoPE-stripped content space).
5. Per layer, choose λ (or "pass the source KV through unchanged") by held-out next-token KL:
   one coordinate sweep over the layers, every other layer at its current choice, scored by the
   target's KL on the last ``m`` tokens of each held-out window given the mapped prefix.
6. Record held-out fit metrics per layer: cosine, relative MSE and R² of keys and values, and the
   cosine of the target's attention output (its own true queries, captured by a hook on the
   query projection, attending to mapped vs true K/V of that layer with the causal mask).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Sequence
from collections.abc import Mapping as MappingABC
from dataclasses import dataclass, field, fields, replace
from datetime import datetime, timezone
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from mappings.errors import CorpusTooSmallError, DocumentTooLongError, ShapeMismatchError

if TYPE_CHECKING:
    from pathlib import Path

    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from mappings.apply import LayerMap, LinearKVMap
    from mappings.capture import KVCapture, KVShape
    from mappings.compat import PairCard
    from mappings.fit import LayerStats
    from mappings.manifest import MappingManifest
    from mappings.methods import MethodSpec
    from mappings.models import ModelHandle
    from mappings.rope import RopeSpec
    from mappings.store import Mapping
    from mappings.weighting import RowWeighting

__all__ = ["CalibrationSettings", "CalibrationConfig", "calibrate", "prepare_windows", "CorpusWindows", "MapLayout",
           "HeldOut", "capture_heldout", "accumulate_stats", "screen_sources", "select_layers", "layer_metrics",
           "KLJudge", "corpus_digest", "model_info", "token_rows"]

Corpus = Sequence[str] | Sequence[tuple[str, str]] | MappingABC[str, str]

_T = TypeVar("_T")


@dataclass(frozen=True)
class CalibrationSettings:
    """What a calibration fits, on how much text, and how: the method, the budget and splits, the layers passed
    through unfitted, and the device and dtype the models load in.

    ``calibrate(source, target, corpus, CalibrationSettings(tokens=4096))``; every field also reads as a keyword of
    :func:`calibrate` (``calibrate(source, target, corpus, tokens=4096)``), applied over the settings given.
    """

    method: str | MethodSpec = "auto"
    """A method name (``auto``: the best this pair allows) or a spec (:mod:`mappings.methods`)."""
    tokens: int = 16384
    """Training tokens to fit on (whole windows)."""
    window: int = 512
    """Tokens per window (each window is one independent sequence starting at position 0)."""
    stride: int | None = None
    """Start-to-start distance of fitting windows; None: disjoint windows, overlapping only if the corpus is short."""
    heldout_fraction: float = 0.125
    """Held-out windows as a fraction of training windows (at least 1, at most ``max_heldout_windows``)."""
    max_heldout_windows: int = 8
    """Upper bound on held-out windows (they are kept in memory)."""
    batch_size: int = 4
    """Windows per forward pass."""
    screen_tokens: int = 1024
    """Training tokens used to pick source layers when depths differ."""
    sweeps: int = 1
    """Coordinate sweeps of the per-layer KL selection."""
    exact_layers: int = 0
    """Leading layers the caller knows both models compute identically (a LoRA adapter leaving them untouched,
    over its base): passed through exactly, not fitted (needs identical layouts)."""
    device: str = "cpu"
    """Torch device the models are loaded on (models given as folders)."""
    dtype: torch.dtype | str | None = None
    """dtype the models are loaded in (models given as folders; None: as stored)."""


CalibrationConfig = CalibrationSettings
"""The former name of :class:`CalibrationSettings` (its budget and splits were all it held)."""


class _Dataclass(Protocol):
    """A dataclass instance (what `dataclasses.replace` takes), without reaching for typeshed's private name."""

    __dataclass_fields__: ClassVar[dict[str, Any]]


_S = TypeVar("_S", bound=_Dataclass)


def _with_overrides(kind: type[_S], settings: _S | None, overrides: MappingABC[str, object], caller: str) -> _S:
    """``settings`` (None: ``kind()``) with the fields named in ``overrides`` replaced.

    The keyword path of :func:`calibrate` and :func:`~mappings.evaluate.evaluate`: a name that is no field is a
    TypeError naming the fields, as a misspelt keyword argument would be.
    """
    if settings is None:
        settings = kind()
    elif not isinstance(settings, kind):
        raise TypeError(f"{caller}() takes its settings as a {kind.__name__}, not {type(settings).__name__}")
    if not overrides:
        return settings
    known = [f.name for f in fields(kind)]
    unknown = [name for name in overrides if name not in known]
    if unknown:
        names = ", ".join(repr(name) for name in unknown)
        raise TypeError(f"{caller}() got an unexpected keyword argument {names}; its settings ({kind.__name__}) "
                        f"are: {', '.join(known)}")
    return replace(settings, **overrides)


@dataclass
class CorpusWindows:
    """Token windows cut from the corpus."""

    train: list[torch.Tensor]
    """Windows the statistics are accumulated on."""
    heldout: list[torch.Tensor]
    """Windows used for selection and metrics only."""
    heldout_from: str
    """Where the held-out windows came from."""
    digest: str
    """sha256 of the corpus texts."""
    names: list[str]
    """Corpus text names."""
    stride: int = 0
    """Start-to-start distance of the fitting windows."""


@dataclass(frozen=True)
class MapLayout:
    """What a map is fitted between: the source layers feeding each target layer, both caches' shapes and RoPE."""

    plan: Sequence[tuple[int, ...]]
    """Per target layer, the source layers its map reads (concatenated, best first)."""
    source: KVShape
    """The source's KV shape."""
    target: KVShape
    """The target's KV shape."""
    source_rope: RopeSpec
    """The source's RoPE (stripped from its keys in content space)."""
    target_rope: RopeSpec
    """The target's RoPE."""

    def fit(self, stats: Sequence[LayerStats], spec: MethodSpec,
            choices: Sequence[float | None] | None = None) -> LinearKVMap:
        """The map fitted on ``stats``: per-layer α, or pass-through where ``choices`` says None (default: α
        ``spec.default_alpha`` everywhere)."""
        from mappings.assemble import fit_kv_map

        return fit_kv_map(stats, spec, self.plan, self.source, self.target, self.source_rope, self.target_rope,
                          choices)


def _named(corpus: Corpus) -> list[tuple[str, str]]:
    if isinstance(corpus, MappingABC):
        return [(str(k), str(v)) for k, v in corpus.items()]
    if isinstance(corpus, str):
        return [("text0", corpus)]
    out = []
    for i, item in enumerate(corpus):
        if isinstance(item, tuple):
            out.append((str(item[0]), str(item[1])))
        else:
            out.append((f"text{i}", str(item)))
    return out


def corpus_digest(texts: Sequence[str]) -> str:
    """sha256 over the texts in order (length-prefixed, so boundaries count)."""
    h = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8")
        h.update(f"{len(data)}:".encode())
        h.update(data)
    return h.hexdigest()


def _spread(items: list[_T], k: int) -> list[_T]:
    """``k`` items spread evenly over ``items`` (all when k >= len)."""
    if k >= len(items):
        return list(items)
    if k <= 0:
        return []
    step = len(items) / k
    return [items[int(i * step)] for i in range(k)]


def prepare_windows(corpus: Corpus, tokenizer: PreTrainedTokenizerBase, config: CalibrationSettings) -> CorpusWindows:
    """Tokenize the corpus and split it into training and held-out windows (``config``'s budget and splits)."""
    from mappings.capture import make_windows

    named = _named(corpus)
    texts = [t for _, t in named]
    if not named or not any(t.strip() for t in texts):
        raise CorpusTooSmallError("the calibration corpus is empty: pass one or more non-empty text files")
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    window, stride = config.window, config.stride or config.window
    need = max(1, math.ceil(config.tokens / window))
    n_held = min(config.max_heldout_windows, max(1, round(config.heldout_fraction * need)))
    if len(named) >= 2 and len(ids[-1]) >= window:
        held_pool = make_windows(ids[-1], window)
        train_ids = ids[:-1]
        heldout_from = f"last corpus text ({named[-1][0]})"
    else:
        # One text: the held-out windows are its tail, cut off before the (maybe overlapping) fitting windows.
        last = ids[-1]
        cut = max(0, len(last) - n_held * window)
        held_pool = make_windows(last[cut:], window) if cut > 0 else []
        train_ids = [*ids[:-1], last[:cut]]
        heldout_from = "tail of the corpus"
    # Without an explicit stride, overlap fitting windows (half, then quarter window) only if the corpus
    # is too small for disjoint ones: overlapping windows put the same text at other positions.
    strides = [stride] if config.stride else [window, max(1, window // 2), max(1, window // 4)]
    for stride in strides:
        train_pool = [w for t in train_ids for w in make_windows(t, window, stride)]
        if len(train_pool) >= need:
            break
    if len(train_pool) < need or not held_pool:
        total = sum(len(t) for t in ids)
        raise CorpusTooSmallError(
            f"the corpus has {total} tokens, giving {len(train_pool)} fitting window(s) of {window} "
            f"(stride {stride}) and {len(held_pool)} held-out window(s); calibration needs {need} fitting "
            f"windows ({need * window} tokens) plus {n_held} held-out: add more text, or lower --tokens / --window"
        )
    return CorpusWindows(
        stride=stride,
        train=_spread(train_pool, need),
        heldout=_spread(held_pool, n_held),
        heldout_from=heldout_from,
        digest=corpus_digest(texts),
        names=[n for n, _ in named],
    )


# --------------------------------------------------------------------------- held-out captures
@dataclass
class HeldOut:
    """Held-out windows captured on both models, dense ``[B, heads, T, dim]`` per layer."""

    ids: torch.Tensor
    """``[B, T]`` token ids."""
    source: list[tuple[torch.Tensor, torch.Tensor]]
    """Source (K, V) per layer, as cached (RoPE applied)."""
    target: list[tuple[torch.Tensor, torch.Tensor]]
    """Target (K, V) per layer, as cached."""
    queries: list[torch.Tensor] | None
    """Target queries per layer ``[B, q_heads, T, dim]`` with RoPE applied."""


def _dense(cap: KVCapture, batch: int, seq: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for k, v in zip(cap.keys, cap.values, strict=True):
        out.append((k.view(batch, seq, *k.shape[1:]).transpose(1, 2), v.view(batch, seq, *v.shape[1:]).transpose(1, 2)))
    return out


def capture_heldout(source: PreTrainedModel, target: PreTrainedModel, windows: Sequence[torch.Tensor], *, queries: bool = True,
                    batch_size: int = 4) -> HeldOut:
    """Capture equal-length windows on both models and keep them (fp32, CPU)."""
    import torch

    from mappings.capture import capture_kv

    ids = torch.stack(list(windows))
    batch, seq = ids.shape
    src_parts, tgt_parts, q_parts = [], [], []
    for start in range(0, batch, batch_size):
        chunk = ids[start : start + batch_size]
        sc = capture_kv(source, chunk)
        tc = capture_kv(target, chunk, queries=queries)
        src_parts.append(_dense(sc, chunk.shape[0], seq))
        tgt_parts.append(_dense(tc, chunk.shape[0], seq))
        if queries:
            assert tc.queries is not None  # capture_kv records them when asked to
            q_parts.append([q.view(chunk.shape[0], seq, *q.shape[1:]).transpose(1, 2) for q in tc.queries])

    def cat(parts):
        return [(torch.cat([p[i][0] for p in parts]).cpu(), torch.cat([p[i][1] for p in parts]).cpu())
                for i in range(len(parts[0]))]

    qs = [torch.cat([p[i] for p in q_parts]).cpu() for i in range(len(q_parts[0]))] if queries else None
    return HeldOut(ids, cat(src_parts), cat(tgt_parts), qs)


# --------------------------------------------------------------------------- layer screening
def token_rows(t: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, D]`` -> ``[B*T, H*D]``: one row per token, its heads side by side (what a map's fit sees)."""
    return t.transpose(1, 2).reshape(t.shape[0] * t.shape[2], -1)


def _content(layers: list[tuple[torch.Tensor, torch.Tensor]], rope: RopeSpec, key_space: str,
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    import torch

    seq = layers[0][0].shape[2]
    pos = torch.arange(seq)
    keys = [token_rows(rope.strip(k, pos, seq_len=seq) if key_space == "content" else k) for k, _ in layers]
    values = [token_rows(v) for _, v in layers]
    return keys, values


def screen_sources(
    source: PreTrainedModel, target: PreTrainedModel, windows: Sequence[torch.Tensor], heldout: HeldOut,
    src_rope: RopeSpec,
    tgt_rope: RopeSpec, top_k: int, key_space: str, batch_size: int,
) -> tuple[list[tuple[int, ...]], list[list[float]]]:
    """Per target layer, the ``top_k`` source layers with the best held-out single-source R² (best first)."""
    import torch

    from mappings.fit import RegressionStats, fit_linear

    train = capture_heldout(source, target, windows, queries=False, batch_size=batch_size)
    sk, sv = _content(train.source, src_rope, key_space)
    tk, tv = _content(train.target, tgt_rope, key_space)
    hsk, hsv = _content(heldout.source, src_rope, key_space)
    htk, htv = _content(heldout.target, tgt_rope, key_space)
    scores = torch.zeros(len(tk), len(sk), dtype=torch.float64)
    for j in range(len(sk)):
        for t in range(len(tk)):
            r2 = []
            for xs, ys, hx, hy in ((sk[j], tk[t], hsk[j], htk[t]), (sv[j], tv[t], hsv[j], htv[t])):
                w, b = fit_linear(RegressionStats.from_data(xs, ys), alpha=0.01, bias="free")
                r2.append(RegressionStats.from_data(hx, hy).r2(w, b))
            scores[t, j] = sum(r2) / 2
    k = min(top_k, len(sk))
    plan = [tuple(int(i) for i in scores[t].argsort(descending=True)[:k]) for t in range(len(tk))]
    return plan, scores.tolist()


# --------------------------------------------------------------------------- KL judge
class KLJudge:
    """Scores a candidate set of mapped prefix caches by the target's next-token KL on held-out suffixes."""

    def __init__(self, target_model: PreTrainedModel, heldout: HeldOut, suffix_tokens: int, *, sinks: int = 0,
                 tail: int = 0) -> None:
        """``sinks``: the first positions of every candidate are the target's own before it is scored, as in
        a cache a FamilyCache serves (its ``sink_tokens``), so the choice fits what is served. ``tail``: the
        last prefix positions are recomputed on the target over the candidate before the suffix is scored, as
        a FamilyCache recomputes its probe tail; the candidate's own maps of them are not used."""
        from mappings.cache_io import build_cache, forward_with_cache, model_device, model_dtype, slice_layers

        self.model = target_model
        seq = heldout.ids.shape[1]
        self.m = max(1, min(suffix_tokens, seq // 4))
        self.prefix = seq - self.m
        self.sinks = max(0, min(int(sinks), self.prefix))
        self.tail = max(0, min(int(tail), self.prefix - self.sinks))
        self.suffix_ids = heldout.ids[:, self.prefix :]
        self.scored_ids = heldout.ids[:, self.prefix - self.tail :]
        # what a candidate map converts: the recomputed tail's own map is never read, so it is never made
        self.source_prefix = slice_layers(heldout.source, 0, self.prefix - self.tail)
        true_prefix = slice_layers(heldout.target, 0, self.prefix)
        self._true_sinks = slice_layers(heldout.target, 0, self.sinks)
        cache = build_cache(true_prefix, target_model.config, model_device(target_model), model_dtype(target_model))
        logits, _, _ = forward_with_cache(target_model, self.suffix_ids, cache)
        self.true_logits = logits.float()
        self._build = build_cache

    def kl(self, prefix_layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """The target's mean next-token KL over the held-out suffixes with ``prefix_layers`` as its cache: the
        candidate's map of ``source_prefix`` (positions after it, a recomputed tail's, are not read)."""
        from mappings.cache_io import forward_with_cache, model_device, model_dtype, slice_layers
        from mappings.metrics import kl_divergence

        layers = list(prefix_layers)
        if self.sinks:
            layers = _true_prefix(layers, self._true_sinks, self.sinks)
        if self.tail:
            layers = slice_layers(layers, 0, self.prefix - self.tail)
        cache = self._build(layers, self.model.config, model_device(self.model), model_dtype(self.model))
        logits, _, _ = forward_with_cache(self.model, self.scored_ids, cache)
        logits = logits[:, self.tail :]
        return float(kl_divergence(self.true_logits, logits.float().to(self.true_logits.device)).mean())


def _option_name(alpha: float | None) -> str:
    return "passthrough" if alpha is None else f"alpha={alpha:g}"


def select_layers(
    stats: Sequence[LayerStats], spec: MethodSpec, layout: MapLayout, judge: KLJudge | None, heldout: HeldOut, *,
    sweeps: int = 1, progress: bool = False, exact: int = 0,
) -> tuple[LinearKVMap, list[float | None], list[dict[str, float]]]:
    """Choose per-layer α / pass-through (``spec.selection``); returns the map, choices and scores.

    The first ``exact`` layers are passed through, neither fitted nor scored: both models compute them alike.
    """
    from mappings.assemble import PASSTHROUGH

    t = layout.target
    choices: list[float | None] = [PASSTHROUGH if i < exact else spec.default_alpha for i in range(t.num_layers)]
    free = range(min(exact, t.num_layers), t.num_layers)
    kv_map = layout.fit(stats, spec, choices)
    scores: list[dict[str, float]] = [{} for _ in range(t.num_layers)]
    if spec.selection == "none":
        return kv_map, choices, scores
    options: list[float | None] = list(spec.alphas)
    if spec.passthrough:
        options.append(None)
    search = _LayerSearch(stats, spec, layout, kv_map, choices, scores, free, options)
    if spec.selection == "error":
        _select_by_error(search, heldout)
    else:
        assert judge is not None
        _select_by_kl(search, judge, sweeps, progress)
    return kv_map, choices, scores


@dataclass(frozen=True)
class _LayerSearch:
    """One per-layer selection: the map it changes, its choices and scores so far, the options it tries."""

    stats: Sequence[LayerStats]
    spec: MethodSpec
    layout: MapLayout
    kv_map: LinearKVMap
    choices: list[float | None]
    scores: list[dict[str, float]]
    free: range
    """The layers to choose for (the exact ones before them stay passed through)."""
    options: list[float | None]
    """α values, and None for pass-through when the method allows it."""
    fitted: dict[tuple[int, float | None], LayerMap] = field(default_factory=dict)

    def layer_for(self, i: int, option: float | None) -> LayerMap:
        """Layer ``i``'s map fitted with ``option`` (fitted once, then reused by every score and choice)."""
        from mappings.assemble import fit_layer

        if (i, option) not in self.fitted:
            self.fitted[(i, option)] = fit_layer(self.stats[i], self.spec, option, self.layout.plan[i],
                                                 self.layout.source, self.layout.target)
        return self.fitted[(i, option)]

    def choose(self, i: int, option: float | None) -> None:
        """Nothing: records ``option`` as layer ``i``'s choice and puts its map in place."""
        self.choices[i] = option
        self.kv_map.layers[i] = self.layer_for(i, option)


def _select_by_error(search: _LayerSearch, heldout: HeldOut) -> None:
    """Nothing: chooses each free layer's option by its held-out relative error of keys plus values."""
    from mappings.fit import RegressionStats

    layout, spec, scores = search.layout, search.spec, search.scores
    hk, hv = _content(heldout.source, layout.source_rope, spec.key_space)
    tk, tv = _content(heldout.target, layout.target_rope, spec.key_space)
    for i in search.free:
        xk = _cat_sources(hk, layout.plan[i])
        xv = _cat_sources(hv, layout.plan[i])
        sk, sv = RegressionStats.from_data(xk, tk[i]), RegressionStats.from_data(xv, tv[i])
        for option in search.options:
            lm = search.layer_for(i, option)
            wk, wv = _effective(lm, xk.shape[1], tk[i].shape[1])
            error = sk.relative_error(wk, lm.k_bias) + sv.relative_error(wv, lm.v_bias)
            scores[i][_option_name(option)] = error
        search.choose(i, min(search.options, key=lambda o: scores[i][_option_name(o)]))


def _select_by_kl(search: _LayerSearch, judge: KLJudge, sweeps: int, progress: bool) -> None:
    """Nothing: chooses each free layer's option by ``judge``'s held-out KL, in coordinate sweeps."""
    from tqdm.auto import tqdm

    spec, kv_map, scores = search.spec, search.kv_map, search.scores
    current = kv_map.apply(judge.source_prefix)
    # Options in order of increasing regularisation; pass-through is the α → ∞ end of the same line.
    ordered = sorted(o for o in search.options if o is not None) + ([None] if None in search.options else [])
    start = ordered.index(spec.default_alpha) if spec.default_alpha in ordered else len(ordered) // 2

    def score(i: int, option: float | None) -> float:
        name = _option_name(option)
        if name not in scores[i]:
            kv_map.layers[i] = search.layer_for(i, option)
            trial = list(current)
            trial[i] = kv_map.apply(judge.source_prefix, only={i})[i]
            scores[i][name] = judge.kl(trial)
            bar.update(1)
        return scores[i][name]

    per_layer = len(ordered) if spec.search == "grid" else min(len(ordered), 4)
    bar = tqdm(total=sweeps * len(search.free) * per_layer, desc="selecting per-layer maps",
               disable=not progress)
    try:
        for sweep in range(sweeps):
            for i in search.free:
                if sweep:
                    scores[i] = {}
                if spec.search == "grid":
                    best = min(ordered, key=lambda o: score(i, o))
                else:
                    best = _local_search(ordered, start, partial(score, i))
                search.choose(i, best)
                current[i] = kv_map.apply(judge.source_prefix, only={i})[i]
    finally:
        bar.close()


def _local_search(ordered: Sequence[_T], start: int, cost: Callable[[_T], float]) -> _T:
    """Walk an ordered grid from ``start`` toward lower cost until it rises (assumes one valley)."""
    best = start
    left = cost(ordered[start - 1]) if start > 0 else float("inf")
    right = cost(ordered[start + 1]) if start + 1 < len(ordered) else float("inf")
    here = cost(ordered[start])
    if here <= left and here <= right:
        return ordered[start]
    step = -1 if left < right else 1
    best, best_cost = start + step, min(left, right)
    while 0 <= best + step < len(ordered):
        nxt = cost(ordered[best + step])
        if nxt >= best_cost:
            break
        best, best_cost = best + step, nxt
    return ordered[best]


def _cat_sources(feats: Sequence[torch.Tensor], sources: Sequence[int]) -> torch.Tensor:
    import torch

    return torch.cat([feats[j] for j in sources], -1) if len(sources) > 1 else feats[sources[0]]


def _effective(lm: LayerMap, p: int, q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights of a layer map as matrices (pass-through: identity on the first source)."""
    from mappings.fit import identity_prior

    if lm.mode == "passthrough":
        w = identity_prior(p, q).float()
        return w, w
    return lm.dense("k"), lm.dense("v")


def _true_prefix(layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 true: Sequence[tuple[torch.Tensor, torch.Tensor]], n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``layers`` with their first ``n`` positions taken from ``true`` (the target's own K/V), as a cache is served."""
    import torch

    return [(torch.cat([tk[:, :, :n].to(k), k[:, :, n:]], 2), torch.cat([tv[:, :, :n].to(v), v[:, :, n:]], 2))
            for (k, v), (tk, tv) in zip(layers, true, strict=True)]


# --------------------------------------------------------------------------- metrics
def layer_metrics(
    kv_map: LinearKVMap, heldout: HeldOut, target_model: PreTrainedModel, identity: LinearKVMap | None, *,
    sinks: int = 0,
) -> list[dict[str, object]]:
    """Held-out fit metrics per target layer (keys compared as cached, i.e. target RoPE applied).

    ``sinks``: the first positions of the mapped cache are the target's own, as served (a map fitted
    without them would otherwise be scored on positions it never serves).
    """

    from mappings.capture import decoder_layers
    from mappings.metrics import attention_output, fit_quality, mean_cosine

    mapped = kv_map.apply(heldout.source)
    if sinks:
        mapped = _true_prefix(mapped, heldout.target, sinks)
    ident = identity.apply(heldout.source) if identity is not None else None
    attn_modules = decoder_layers(target_model)
    out = []
    for i, ((mk, mv), (tk, tv)) in enumerate(zip(mapped, heldout.target, strict=True)):
        row: dict[str, object] = {"layer": i, "keys": fit_quality(token_rows(mk), token_rows(tk)),
                               "values": fit_quality(token_rows(mv), token_rows(tv))}
        if heldout.queries is not None:
            attn = getattr(attn_modules[i], "self_attn", None)
            scaling = float(getattr(attn, "scaling", tk.shape[-1] ** -0.5))
            q = heldout.queries[i]
            true_out = attention_output(q, tk, tv, scaling)
            row["attn_cosine"] = mean_cosine(attention_output(q, mk, mv, scaling), true_out)
            if ident is not None:
                row["identity_attn_cosine"] = mean_cosine(attention_output(q, *ident[i], scaling), true_out)
        out.append(row)
    return out


def accumulate_stats(
    source: PreTrainedModel, target: PreTrainedModel, windows: Sequence[torch.Tensor], layout: MapLayout,
    key_space: str, *, batch_size: int = 4, progress: bool = True, weighting: RowWeighting | None = None,
) -> tuple[list[LayerStats], list[LayerStats]]:
    """Stream equal-length windows through both models into per-target-layer statistics.

    Keys enter in content space (each model's RoPE stripped) unless ``key_space == "rotated"``;
    target layer ``i`` regresses on the concatenated source layers ``layout.plan[i]``. Returns ``(fit, plain)``:
    the statistics the map is fitted on, with ``weighting``'s rows (sinks left out, values weighted; the
    same list as ``plain`` without one), and the plain statistics of every row, which a mapping stores so
    that baselines refit on it are the textbook formulas.
    """
    from tqdm.auto import tqdm

    from mappings.capture import capture_windows
    from mappings.fit import LayerStats, RegressionStats

    plan, s, t, src_rope, tgt_rope = layout.plan, layout.source, layout.target, layout.source_rope, layout.target_rope

    def zeros() -> list[LayerStats]:
        return [LayerStats(RegressionStats.zeros(len(plan[i]) * s.width, t.width),
                           RegressionStats.zeros(len(plan[i]) * s.width, t.width)) for i in range(t.num_layers)]

    active = weighting if weighting is not None and not weighting.plain else None  # None: every row plain
    stats = zeros()
    fit = zeros() if active is not None else stats
    src_iter = capture_windows(source, windows, batch_size=batch_size, progress=False)
    tgt_iter = capture_windows(target, windows, batch_size=batch_size, progress=False,
                               queries=active is not None and active.needs_queries)
    bar = tqdm(total=len(windows), desc="capturing source+target KV", unit="win", disable=not progress)
    try:
        for sc, tc in zip(src_iter, tgt_iter, strict=True):
            seq = max(sc.lengths)
            if key_space == "content":
                sk = [src_rope.strip(k, sc.positions, seq_len=seq).reshape(k.shape[0], -1) for k in sc.keys]
                tk = [tgt_rope.strip(k, tc.positions, seq_len=seq).reshape(k.shape[0], -1) for k in tc.keys]
            else:
                sk = [k.reshape(k.shape[0], -1) for k in sc.keys]
                tk = [k.reshape(k.shape[0], -1) for k in tc.keys]
            sv = [v.reshape(v.shape[0], -1) for v in sc.values]
            tv = [v.reshape(v.shape[0], -1) for v in tc.values]
            rows = active.rows(tc, target) if active is not None else None
            for i in range(t.num_layers):
                xk, xv = _cat_sources(sk, plan[i]), _cat_sources(sv, plan[i])
                stats[i].keys.update(xk, tk[i])
                stats[i].values.update(xv, tv[i])
                if rows is not None:
                    keep = rows.keep.to(xk.device)
                    fit[i].keys.update(xk[keep], tk[i][keep])
                    fit[i].values.update(xv[keep], tv[i][keep], None if rows.values is None else rows.values[i])
            bar.update(len(sc.lengths))
    finally:
        bar.close()
    return fit, stats


def _spec_fits(spec: MethodSpec, card: PairCard) -> bool:
    if spec.needs_same_shape and not card.same_kv_shape:
        return False
    return not (spec.granularity == "head" and not card.same_kv_heads)


def model_info(handle: ModelHandle) -> dict[str, object]:
    """The manifest's description of one side of the pair."""
    from mappings.cache_io import model_dtype
    from mappings.capture import kv_shape
    from mappings.rope import RopeSpec

    config = handle.model.config
    return {
        "path": str(handle.path.resolve()) if handle.path is not None else None,
        "fingerprint": handle.fingerprint.as_dict(),
        "dtype": str(model_dtype(handle.model)).replace("torch.", ""),
        "kv_shape": kv_shape(config).as_dict(),
        "rope": RopeSpec.from_config(config).describe(),
        "config": json.loads(config.to_json_string(use_diff=False)),
    }


# --------------------------------------------------------------------------- entry point
def calibrate(
    source: str | Path | ModelHandle | PreTrainedModel,
    target: str | Path | ModelHandle | PreTrainedModel,
    corpus: Corpus,
    settings: CalibrationSettings | None = None,
    *,
    source_tokenizer: PreTrainedTokenizerBase | None = None,
    target_tokenizer: PreTrainedTokenizerBase | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    **overrides: object,
) -> Mapping:
    """Fit a KV map from ``source`` to ``target`` (model folders, handles or in-memory models) on ``corpus``.

    ``settings`` says what to fit and how (:class:`CalibrationSettings`; None: its defaults); any of its fields
    may be given as a keyword instead, over ``settings`` (``calibrate(src, tgt, corpus, tokens=4096)``), and a
    keyword that is no field is a TypeError. ``source_tokenizer``/``target_tokenizer``: for in-memory models
    (default: loaded by name); ``progress``: progress bars; ``log``: receives the pair card and a line per stage.

    Returns a :class:`~mappings.store.Mapping` (call ``.save(dir)``), with its manifest and the
    calibration statistics. Raises :class:`TokenizerMismatchError`, :class:`CorpusTooSmallError`,
    :class:`NonFiniteKVError`, :class:`ShapeMismatchError` (method not possible for this pair).
    """
    from mappings.models import load_model
    from mappings.store import Mapping
    from mappings.weighting import RowWeighting

    cfg = _with_overrides(CalibrationSettings, settings, overrides, "calibrate")
    say = log or (lambda _msg: None)
    started = time.perf_counter()
    src = load_model(source, source_tokenizer, device=cfg.device, dtype=cfg.dtype)
    tgt = load_model(target, target_tokenizer, device=cfg.device, dtype=cfg.dtype)
    pair = _check_pair(src, tgt, corpus, cfg, say)
    heldout = capture_heldout(src.model, tgt.model, pair.windows.heldout, queries=True,
                              batch_size=cfg.batch_size)
    layout = pair.layout(_layer_plan(pair, heldout, cfg, say))
    fit_stats, stats = accumulate_stats(src.model, tgt.model, pair.windows.train, layout, pair.spec.key_space,
                                        batch_size=cfg.batch_size, progress=progress,
                                        weighting=RowWeighting.of(pair.spec))
    fitted = _select_and_measure(pair, layout, heldout, fit_stats, sweeps=cfg.sweeps, progress=progress)
    summary = fitted.summary
    say(f"held-out KL {summary['kl']:.4f}" + (
        f" (source KV unchanged: {summary['kl_identity']:.4f})" if summary["kl_identity"] is not None else ""))
    manifest = _manifest(src, tgt, fitted, pair.windows, cfg.window, pair.card.differences,
                         seconds=round(time.perf_counter() - started, 3))
    return Mapping(fitted.kv_map, manifest, stats)


@dataclass(frozen=True)
class _Pair:
    """A checked pair: both models, its card, the method, exact layers, corpus windows, KV shapes and RoPE."""

    src: ModelHandle
    tgt: ModelHandle
    card: PairCard
    spec: MethodSpec
    exact: int
    """Leading layers passed through unfitted (both models compute them alike)."""
    windows: CorpusWindows
    source_shape: KVShape
    target_shape: KVShape
    source_rope: RopeSpec
    target_rope: RopeSpec

    def layout(self, plan: Sequence[tuple[int, ...]]) -> MapLayout:
        """The pair's map layout with ``plan``'s source layers feeding each target layer."""
        return MapLayout(plan, self.source_shape, self.target_shape, self.source_rope, self.target_rope)


def _check_pair(src: ModelHandle, tgt: ModelHandle, corpus: Corpus, cfg: CalibrationSettings,
                say: Callable[[str], None]) -> _Pair:
    """The pair checked for ``cfg``'s method, window and exact layers, with its corpus windows cut."""
    from mappings.capture import kv_shape
    from mappings.compat import check_pair
    from mappings.rope import RopeSpec

    card = check_pair(src.model, src.tokenizer, tgt.model, tgt.tokenizer, source_name=src.name, target_name=tgt.name)
    say(card.render())
    spec = _method_for(cfg.method, card)
    _check_window(cfg.window, spec, card)
    exact = _exact_layers(cfg.exact_layers, card)
    windows = prepare_windows(corpus, src.tokenizer, cfg)
    s, t = kv_shape(src.model.config), kv_shape(tgt.model.config)
    src_rope, tgt_rope = RopeSpec.from_config(src.model.config), RopeSpec.from_config(tgt.model.config)
    say(f"method {spec.name}: {len(windows.train)} x {cfg.window} fitting tokens, "
        f"{len(windows.heldout)} held-out window(s) from the {windows.heldout_from}")
    return _Pair(src, tgt, card, spec, exact, windows, s, t, src_rope, tgt_rope)


def _layer_plan(pair: _Pair, heldout: HeldOut, cfg: CalibrationSettings,
                say: Callable[[str], None]) -> list[tuple[int, ...]]:
    """Per target layer, the source layers its map reads: its own at equal depths, else the best screened."""
    if pair.card.same_depth:
        return [(i,) for i in range(pair.target_shape.num_layers)]
    n_screen = max(1, min(len(pair.windows.train), cfg.screen_tokens // cfg.window))
    plan, _ = screen_sources(pair.src.model, pair.tgt.model, pair.windows.train[:n_screen], heldout,
                             pair.source_rope, pair.target_rope, pair.spec.top_k, pair.spec.key_space,
                             cfg.batch_size)
    say("layer plan: " + ", ".join(f"{i}<-{list(p)}" for i, p in enumerate(plan)))
    return plan


def _select_and_measure(pair: _Pair, layout: MapLayout, heldout: HeldOut, fit_stats: Sequence[LayerStats], *,
                        sweeps: int, progress: bool) -> _Fitted:
    """The map with each layer's option selected, its held-out metrics and KL summary."""
    from mappings.apply import identity_map

    spec, tgt_model = pair.spec, pair.tgt.model
    judge = KLJudge(tgt_model, heldout, spec.kl_suffix_tokens, sinks=spec.exact_sinks, tail=spec.judged_tail)
    kv_map, choices, scores = select_layers(fit_stats, spec, layout, judge, heldout, sweeps=sweeps,
                                            progress=progress, exact=pair.exact)
    identity = identity_map(pair.src.model.config, tgt_model.config) if pair.card.identical_layout else None
    summary = _heldout_summary(judge, kv_map, identity, heldout)
    if spec.selection == "kl":
        summary["kl_default_alpha"] = _default_alpha_kl(judge, fit_stats, spec, layout, pair.exact)
    metrics = _selected_metrics(kv_map, heldout, tgt_model, identity, judge.sinks, spec, choices, scores)
    return _Fitted(spec, layout.plan, kv_map, metrics, summary, pair.exact)


def _default_alpha_kl(judge: KLJudge, stats: Sequence[LayerStats], spec: MethodSpec, layout: MapLayout,
                      exact: int) -> float:
    """Held-out KL of the map at the default α in every fitted layer: what the per-layer selection gained."""
    from mappings.assemble import PASSTHROUGH

    choices = [PASSTHROUGH if i < exact else spec.default_alpha for i in range(layout.target.num_layers)]
    return judge.kl(layout.fit(stats, spec, choices).apply(judge.source_prefix))


def _method_for(method: str | MethodSpec, card: PairCard) -> MethodSpec:
    """The method named (``auto``: the best this pair allows), or the spec given if the pair fits it."""
    from mappings.methods import resolve_method

    if isinstance(method, str):
        return resolve_method(method, same_kv_shape=card.same_kv_shape, same_kv_heads=card.same_kv_heads,
                              same_depth=card.same_depth)
    if not _spec_fits(method, card):
        raise ShapeMismatchError(
            f"method {method.name!r} needs equal KV heads (and head size for identity anchors); this pair "
            "differs: use a plain-ridge, per-layer method"
        )
    return method


def _exact_layers(count: int, card: PairCard) -> int:
    """The exact layers asked for, refused unless the pair's caches have one layout (else no layer is the same)."""
    if count <= 0:
        return 0
    if not (card.identical_layout and card.same_rope):
        raise ShapeMismatchError(
            f"{count} exact layers were asked for, but the pair's KV layouts or RoPE differ, so no layer's K/V "
            "can be the same on both: calibrate without exact layers"
        )
    return min(count, card.target.num_layers)


def _check_window(window: int, spec: MethodSpec, card: PairCard) -> None:
    """Refuse a window that leaves nothing to fit past the sinks, or that either model cannot position."""
    if window <= spec.exact_sinks:
        raise CorpusTooSmallError(
            f"calibration windows of {window} tokens leave nothing to fit after the first {spec.exact_sinks} "
            "positions (exact in a served cache): raise --window"
        )
    for side, info in (("source", card.source), ("target", card.target)):
        if info.max_positions is not None and window > info.max_positions:
            raise DocumentTooLongError(
                f"calibration windows of {window} tokens exceed the {side}'s {info.max_positions} positions; "
                "lower --window"
            )


def _heldout_summary(judge: KLJudge, kv_map: LinearKVMap, identity: LinearKVMap | None, heldout: HeldOut) -> dict[str, float | None]:
    """The fitted map's held-out KL beside the source KV's unchanged (identical layouts only)."""
    return {
        "kl": judge.kl(kv_map.apply(judge.source_prefix)),
        "kl_identity": judge.kl(identity.apply(judge.source_prefix)) if identity is not None else None,
        "suffix_tokens": float(judge.m),
        "windows": float(heldout.ids.shape[0]),
        "exact_sinks": float(judge.sinks),
    }


def _selected_metrics(kv_map: LinearKVMap, heldout: HeldOut, target_model: PreTrainedModel,
                      identity: LinearKVMap | None, sinks: int, spec: MethodSpec, choices: Sequence[float | None],
                      scores: Sequence[dict[str, float]]) -> list[dict[str, object]]:
    """Per-layer held-out metrics, with the KL of every option the selection scored (and, when it selected by
    KL, the chosen option's as the layer's KL)."""
    import torch

    with torch.no_grad():
        metrics = layer_metrics(kv_map, heldout, target_model, identity, sinks=sinks)
    for i, row in enumerate(metrics):
        if scores[i]:
            row["kl_by_option"] = scores[i]
            if spec.selection == "kl":
                row["kl"] = scores[i][_option_name(choices[i])]
    return metrics


@dataclass(frozen=True)
class _Fitted:
    """What one calibration chose and measured, as its manifest records it."""

    spec: MethodSpec
    plan: Sequence[tuple[int, ...]]
    kv_map: LinearKVMap
    metrics: list[dict[str, object]]
    """Per-layer held-out metrics."""
    summary: dict[str, float | None]
    """The held-out KL summary."""
    exact_layers: int


def _manifest(src: ModelHandle, tgt: ModelHandle, fitted: _Fitted, windows: CorpusWindows, window: int,
              differences: list[str], *, seconds: float) -> MappingManifest:
    """The mapping's manifest; its tensor record is filled in when the mapping is saved."""
    from mappings.manifest import (
        CalibrationInfo,
        FileRecord,
        LayerMetrics,
        LayerPlanEntry,
        MappingManifest,
        ModelInfo,
    )

    return MappingManifest(
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        source=ModelInfo(**model_info(src)),
        target=ModelInfo(**model_info(tgt)),
        method=fitted.spec,
        layer_plan=[
            LayerPlanEntry(target_layer=i, sources=list(fitted.plan[i]), mode=lm.mode, alpha=lm.alpha,
                           bias=lm.mode == "map" and lm.k_bias is not None, form=lm.form, anchored=lm.anchored)
            for i, lm in enumerate(fitted.kv_map.layers)
        ],
        calibration=CalibrationInfo(
            corpus_sha256=windows.digest, corpus_names=windows.names,
            token_count=len(windows.train) * window, heldout_tokens=len(windows.heldout) * window,
            window=window, stride=windows.stride, train_windows=len(windows.train),
            heldout_windows=len(windows.heldout),
            heldout_from=windows.heldout_from, seconds=seconds,
        ),
        metrics=[LayerMetrics(**row) for row in fitted.metrics],
        heldout=fitted.summary,
        pair_differences=differences,
        tensors=FileRecord(name="mapping.safetensors", sha256="", bytes=0),
        exact_layers=fitted.exact_layers,
    )
