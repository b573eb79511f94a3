"""What a repair will cost in seconds on this machine: a model of one target's forward passes, fitted by timing.

The multiply-add measure (:func:`mappings.repair.compute_share`) prices a repair by arithmetic
alone, so it misses what a small pass pays regardless of its size: the Python and kernel-launch
overhead of every layer, dequantising int8 weights, the one copy of the cache a repair makes. On
the bundled family that made a 5 % plan cost 6.5-12 % measured. A :class:`PassCosts` is fitted
from a dozen timed passes of the model itself and prices the passes :func:`~mappings.recompute.token_passes`
lists, so a budget means a share of the target's own prefill *seconds*:

    seconds = per_pass * passes + per_token * tokens + per_key * causal keys + per_past_key * cached keys
              + per_past * cached positions + per_copied * positions copied

A pass of ``q`` tokens over ``p`` cached ones scores ``q (q + 1) / 2`` keys among its own tokens
(``causal keys``, what a prefill is made of) and ``q p`` cached keys. The two are priced apart:
on a CPU a prefill's blocked causal attention runs from cache, while a tail's queries read every
cached K/V of every layer, which costs more per key as the cache outgrows the processor's caches
(measured on the bundled family: a tail token over 3,584 cached keys costs 1.6x per key what it
does over 2,048). ``cached positions`` is ``p`` once per pass, whatever its queries: a
grouped-query model expands every cached K/V to all its query heads in every layer of every pass
(SmolLM2: a 4-token tail takes 0.17 s over 4,092 cached positions and 0.13 s over 2,044, the
4-token sink pass over none 0.09 s, while those queries' keys cost a tenth of the difference), which is what made small tails over long documents cost
1.5-2.5x their plan under version 2. ``positions copied`` is what a repair copies into its fresh
output once per call: every position before its trailing run (none for a prefill). The fit is a non-negative least
squares on relative error, so the 4-token sink pass weighs as much as the longest prefill, and
the passes are timed at the document lengths repairs run at (up to 4,096 tokens), so long
documents are interpolated rather than extrapolated. :func:`measure_pass_costs` times the passes;
:class:`PassCosts` saves to and loads from JSON, keyed by what changes the timings: the model's
architecture (:func:`architecture_hash`: its config and module types, not its weights, so a family's
same-shaped members, fine-tuned or with quantised-then-dequantised weights, share one timing),
device, dtype, attention kernel, torch threads and version.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

    from mappings.cache_io import KVLayers
    from mappings.types import KVCache, Model

__all__ = ["PassCosts", "CostModel", "measure_pass_costs", "load_or_measure", "pass_features", "prefill_features",
           "costs_key", "architecture_hash"]

PASSCOST_VERSION = 3

_T = TypeVar("_T")

FEATURES = ("passes", "tokens", "keys", "cached_keys", "cached_positions", "copied")
"""The names of a pass's features, in the order :func:`pass_features` returns them (and samples store them)."""


def pass_features(n: int, tokens: Sequence[int], *, flash: bool = False, copy: bool = True) -> tuple[float, ...]:
    """(passes, tokens, causal keys, cached keys, cached positions, positions copied) of a repair recomputing
    ``tokens`` of an ``n``-token cache."""
    from mappings.recompute import runs, token_passes

    passes = token_passes(n, tokens, flash=flash)
    causal = sum(q * (q + 1) / 2 for q, _ in passes)
    cached = sum(q * past for q, past in passes)
    spans = runs(tokens)
    kept = spans[-1][0] if spans and spans[-1][1] == n else n  # copied: every position before the trailing run
    return (float(len(passes)), float(sum(q for q, _ in passes)), float(causal), float(cached),
            float(sum(past for _, past in passes)), float(kept if copy and passes else 0))


def prefill_features(n: int) -> tuple[float, ...]:
    """(passes, tokens, causal keys, cached keys, cached positions, positions copied) of a causal prefill of
    ``n`` tokens."""
    return (1.0, float(n), n * (n + 1) / 2, 0.0, 0.0, 0.0)


class CostModel(ABC):
    """Prices a repair as a share of one prefill of the same cache (what a :class:`RepairPolicy` budget bounds).

    Two kinds: the target's multiply-adds from its config (``kind == "compute"``, what
    :func:`mappings.repair.compute_share` uses without timings) and :class:`PassCosts` (``"measured"``
    seconds of this machine).
    """

    kind: str = "compute"

    @abstractmethod
    def share(self, n: int, tokens: Sequence[int]) -> float:
        """The passes recomputing ``tokens`` of an ``n``-token cache, as a share of its prefill."""


@dataclass(frozen=True)
class PassCosts(CostModel):
    """Seconds of one model's forward passes on one device, as a linear model fitted from timed passes."""

    per_pass: float
    """Seconds every pass pays whatever its size (per-layer overhead, weight dequantisation, the LM head row)."""
    per_token: float
    """Seconds per token through the layers (projections and MLP)."""
    per_key: float
    """Seconds per key a query scores among the pass's own tokens (causal attention, what a prefill does)."""
    per_past_key: float
    """Seconds per cached key a query scores (a tail over the mapped cache reads every cached K/V)."""
    per_past: float
    """Seconds per cached position a pass holds, once per pass (its K/V expanded to every query head)."""
    per_copied: float
    """Seconds per cache position a repair copies into its fresh output (once per repair)."""
    key: dict[str, str] = field(default_factory=dict)
    """What the timings hold for: model architecture, device, dtype, attention kernel, torch threads and version."""
    measured_on: str = ""
    """The fingerprint of the model that was timed (any model of the same architecture may use the timings)."""
    samples: list[dict[str, float | str]] = field(default_factory=list)
    """The timed passes: features, measured and fitted seconds (for the fit's own error)."""
    flash: bool = False
    """The model's attention takes no dense mask (interior runs are separate passes)."""
    kind: str = "measured"

    @property
    def coefficients(self) -> tuple[float, ...]:
        """Seconds per unit of each feature, in :data:`FEATURES` order."""
        return (self.per_pass, self.per_token, self.per_key, self.per_past_key, self.per_past, self.per_copied)

    def seconds(self, features: Sequence[float]) -> float:
        """Predicted seconds of a pass (or repair) with these features (:data:`FEATURES`, as
        :func:`pass_features` gives them)."""
        return float(sum(c * f for c, f in zip(self.coefficients, features, strict=True)))

    def prefill_seconds(self, n: int) -> float:
        """Predicted seconds of a causal prefill of ``n`` tokens."""
        return self.seconds(prefill_features(n))

    def repair_seconds(self, n: int, tokens: Sequence[int], *, copy: bool = True) -> float:
        """Predicted seconds of recomputing ``tokens`` of an ``n``-token cache (``copy``: into a fresh output)."""
        return self.seconds(pass_features(n, tokens, flash=self.flash, copy=copy))

    def share(self, n: int, tokens: Sequence[int]) -> float:
        return self.repair_seconds(n, tokens) / self.prefill_seconds(n)

    @property
    def fit_error(self) -> float:
        """Largest relative error of the fit over its own timed passes."""
        timed = [(float(s["fitted"]), float(s["seconds"])) for s in self.samples]
        return max((abs(fitted - seconds) / seconds for fitted, seconds in timed if seconds > 0),
                   default=0.0)

    def to_json(self) -> str:
        return json.dumps({"version": PASSCOST_VERSION, **asdict(self)}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> PassCosts:
        data = json.loads(text)
        if data.pop("version", None) != PASSCOST_VERSION:
            raise ValueError("pass-cost file of another version: measure again")
        return cls(**data)

    def save(self, path: str | Path) -> Path:
        from mappings.atomic import write_atomic

        return write_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path, key: dict[str, str] | None = None) -> PassCosts | None:
        """The timings at ``path``, or None when absent, unreadable, of another version or for another ``key``."""
        try:
            costs = cls.from_json(Path(path).read_text())
        except (OSError, ValueError, TypeError):
            return None
        if key is not None and costs.key != key:
            return None
        return costs


def architecture_hash(model: Model) -> str:
    """A hash of what a model's pass timings depend on in the model itself: its config and module types.

    Weight values are left out (a dense matmul takes as long whatever the numbers), and so are the
    config's names and paths. Quantised weights that stay quantised at run time show in their module
    types (and the config's ``quantization_config``), or, quantized in place by torchao, in their
    parameters' tensor types, so they hash apart from the dense model.
    """
    import hashlib
    from collections import Counter

    config = model.config.to_dict() if hasattr(model.config, "to_dict") else dict(vars(model.config))
    drop = {"name_or_path", "transformers_version", "architectures", "auto_map"}
    shape = {k: v for k, v in config.items() if not k.startswith("_") and k not in drop}
    modules = Counter(f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules())
    dtypes = Counter(_weight_kind(p) for p in model.parameters())
    blob = json.dumps({"config": shape, "modules": sorted(modules.items()), "dtypes": sorted(dtypes.items())},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _weight_kind(p: torch.Tensor) -> str:
    """A parameter's dtype, and its tensor type when it is a subclass (torchao's int8 weights report float32)."""
    import torch

    kind = type(p)
    if kind in (torch.Tensor, torch.nn.Parameter):
        return str(p.dtype)  # what plain models always hashed: their stored timings stay valid
    return f"{kind.__module__}.{kind.__qualname__}:{p.dtype}"


def costs_key(model: Model) -> dict[str, str]:
    """What a model's pass timings depend on: its architecture, device, dtype, attention kernel and threads."""
    import torch

    from mappings.cache_io import model_device, model_dtype

    return {"architecture": architecture_hash(model), "device": str(model_device(model)), "dtype": str(model_dtype(model)),
            "attention": str(getattr(model.config, "_attn_implementation", None) or "eager"),
            "threads": str(torch.get_num_threads()), "torch": torch.__version__.split("+")[0]}


def _nnls(rows: list[tuple[float, ...]], y: list[float]) -> list[float]:
    """Non-negative least squares by active set (six unknowns: dropping negatives one at a time suffices)."""
    import torch

    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(y, dtype=torch.float64)
    active = list(range(a.shape[1]))
    while active:
        sol = torch.linalg.lstsq(a[:, active], b[:, None]).solution[:, 0]
        if bool((sol >= 0).all()):
            out = [0.0] * a.shape[1]
            for j, c in zip(active, sol.tolist(), strict=True):
                out[j] = c
            return out
        active.pop(int(sol.argmin()))
    return [0.0] * a.shape[1]


def measure_pass_costs(model: Model, *, max_tokens: int = 4096, repeats: int = 2, key: dict[str, str] | None = None,
                       seed: int = 0, measured_on: str = "") -> PassCosts:
    """Time ``model``'s prefills and repair passes on random tokens and fit a :class:`PassCosts`.

    Prefills of ``max_tokens / 8 .. max_tokens`` (capped by the model's positions) and repairs shaped
    as plans are (sinks, tails, sinks and a tail, a scattered run) of the largest cache, and tails of
    the half-length one (so cached keys and cached positions are priced at two cache sizes). A
    prefill is the fastest of ``repeats`` runs after a warm-up (the longest runs once), a repair pass
    the fastest of ``repeats + 1`` (they are short, and the small ones are the noisiest). About four
    prefills of the largest length in all: 50-75 s for a 135M model at 4,096 tokens on 2 CPU cores.
    """
    import torch

    from mappings.cache_io import model_device

    limit = getattr(model.config, "max_position_embeddings", None) or max_tokens
    n = max(64, min(int(max_tokens), int(limit) - 1))
    gen = torch.Generator().manual_seed(seed)
    vocab = int(getattr(model.config, "vocab_size", 1000))
    ids = torch.randint(0, vocab, (1, n), generator=gen)
    dev = model_device(model)
    flash = "flash" in str(getattr(model.config, "_attn_implementation", None) or "")
    bench = _Bench(model, ids, dev, repeats, flash)
    timed = _Timed()
    with torch.no_grad():
        layers = _time_prefills(bench, timed)
        _time_repairs(bench, layers, timed)
    return _fit_pass_costs(timed, key, flash, measured_on)


@dataclass(frozen=True)
class _Bench:
    """What every timed pass of one measurement shares: the model, its random document, device and repeats."""

    model: Model
    ids: torch.Tensor
    """``[1, n]`` random token ids (shorter prefills and the half-length cache read their leading part)."""
    dev: torch.device
    repeats: int
    flash: bool

    @property
    def n(self) -> int:
        """The longest prefill's length (the repairs' cache)."""
        return int(self.ids.shape[1])

    def fastest(self, fn: Callable[[], _T], times: int) -> tuple[float, _T]:
        """The fastest of ``times`` runs of ``fn`` in seconds (device work included), with its last output."""
        from mappings.cache_io import sync_device

        t0 = time.perf_counter()
        out = fn()
        sync_device(self.dev)
        best = time.perf_counter() - t0
        for _ in range(times - 1):
            t0 = time.perf_counter()
            out = fn()
            sync_device(self.dev)
            best = min(best, time.perf_counter() - t0)
        return best, out


@dataclass
class _Timed:
    """The timed passes so far: their names, features (:data:`FEATURES`) and fastest seconds, in order."""

    labels: list[str] = field(default_factory=list)
    rows: list[tuple[float, ...]] = field(default_factory=list)
    ys: list[float] = field(default_factory=list)

    def add(self, label: str, features: tuple[float, ...], seconds: float) -> None:
        """Nothing: records one timed pass."""
        self.rows.append(features)
        self.ys.append(seconds)
        self.labels.append(label)


def _time_prefills(bench: _Bench, timed: _Timed) -> KVLayers:
    """The longest prefill's cache layers, after timing prefills of ``n / 8 .. n`` tokens into ``timed``."""
    from mappings.cache_io import cache_layers, forward_with_cache

    model, ids, n = bench.model, bench.ids, bench.n
    forward_with_cache(model, ids[:, : min(n, 32)], None, logits_to_keep=1)  # warm-up: allocations, kernels
    cache: KVCache | None = None
    for m in sorted({max(8, n // 8), max(8, n // 4), max(8, n // 2), n}):
        # the longest prefill is timed once (seconds long, it varies least) and its cache is the repairs' own
        secs, out = bench.fastest(partial(forward_with_cache, model, ids[:, :m], None, logits_to_keep=1),
                                  1 if m == n else bench.repeats)
        timed.add(f"prefill {m}", prefill_features(m), secs)
        cache = out[1]
    assert cache is not None  # the loop above runs at least once
    return list(cache_layers(cache))


def _repair_plans(n: int) -> dict[str, Sequence[int]]:
    """The repairs timed over an ``n``-token cache, by name: shaped as plans are (sinks, tails, a run)."""
    sink = min(4, n // 8)
    mid = n // 2
    return {
        "sinks": range(sink),
        "tail 4": range(n - 4, n),
        "tail 16": range(n - 16, n),
        f"tail {n // 16}": range(n - n // 16, n),
        f"tail {n // 8}": range(n - n // 8, n),
        "sinks + tail 64": [*range(sink), *range(n - 64, n)],
        f"sinks + tail {n // 4}": [*range(sink), *range(n - n // 4, n)],
        "run 32 + tail 16": [*range(mid, mid + 32), *range(n - 16, n)],
    }


def _time_repairs(bench: _Bench, layers: KVLayers, timed: _Timed) -> None:
    """Nothing: times the plans' repairs over ``layers`` and tails over its first half into ``timed``."""
    from mappings.recompute import repair_tokens_and_logits

    model, ids, n, flash = bench.model, bench.ids, bench.n, bench.flash
    mid = n // 2
    for name, tokens in _repair_plans(n).items():
        pos = sorted(set(tokens))
        secs, _ = bench.fastest(partial(repair_tokens_and_logits, model, layers, ids, pos), bench.repeats + 1)
        timed.add(name, pass_features(n, pos, flash=flash), secs)
    # Tails of a second, half-length cache: cached keys and cached positions are priced at two cache sizes.
    half = [(k[:, :, :mid], v[:, :, :mid]) for k, v in layers]
    for q in (4, max(8, mid // 16), max(8, mid // 8)):
        pos = list(range(mid - q, mid))
        secs, _ = bench.fastest(partial(repair_tokens_and_logits, model, half, ids[:, :mid], pos),
                                bench.repeats + 1)
        timed.add(f"tail {q} of {mid}", pass_features(mid, pos, flash=flash), secs)


def _fit_pass_costs(timed: _Timed, key: dict[str, str] | None, flash: bool, measured_on: str) -> PassCosts:
    """The :class:`PassCosts` fitted to the timed passes, which it keeps as its samples."""
    rows, ys, labels = timed.rows, timed.ys, timed.labels
    # Relative error: divide every row by its seconds, so small passes weigh as much as prefills.
    coef = _nnls([tuple(f / y for f in r) for r, y in zip(rows, ys, strict=True)], [1.0] * len(ys))
    per_pass, per_token, per_key, per_past_key, per_past, per_copied = coef  # one per FEATURES entry
    costs = PassCosts(per_pass, per_token, per_key, per_past_key, per_past, per_copied, key=dict(key or {}),
                      flash=flash)
    samples: list[dict[str, float | str]] = [
        {"pass": label, **dict(zip(FEATURES, r, strict=True)), "seconds": y, "fitted": costs.seconds(r)}
        for label, r, y in zip(labels, rows, ys, strict=True)]
    return replace(costs, measured_on=measured_on, samples=samples)


_MEASURED: dict[tuple[tuple[str, str], ...], PassCosts] = {}
_MEASURED_LOCK = threading.Lock()


def load_or_measure(model: Model, fingerprint: str, directory: str | Path | None, *, max_tokens: int = 4096,
                    log: Callable[[str], object] | None = None) -> PassCosts:
    """``model``'s pass costs: kept from earlier in this process, read from ``directory``, or measured now and stored.

    Timings belong to an architecture (:func:`architecture_hash`), not to one model's weights: the
    first member of a family timed prices the repairs of every member shaped like it, which also
    keeps one member's noisy measurement from pricing its repairs apart from its siblings'. The
    file is ``<directory>/<architecture[:16]>-<device>-<dtype>-t<threads>.json``; one written for
    other settings (attention kernel, torch version) is measured again. ``fingerprint`` (the timed
    model's) is recorded in it. Measuring takes about six prefills of ``max_tokens`` tokens; the
    caller holds the model alone meanwhile (timings of a shared model are worthless). A folder that
    cannot be written only costs a measurement next time.
    """
    key = costs_key(model)
    memo = tuple(sorted(key.items()))
    path = None
    if directory is not None:
        name = f"{key['architecture'][:16]}-{key['device'].replace(':', '')}-{key['dtype'].replace('torch.', '')}" \
               f"-t{key['threads']}.json"
        path = Path(directory) / name
    with _MEASURED_LOCK:
        costs = _MEASURED.get(memo)
    if costs is None and path is not None:
        costs = PassCosts.load(path, key)
        if costs is not None:
            with _MEASURED_LOCK:
                _MEASURED[memo] = costs
            return costs
    if costs is None:
        t0 = time.perf_counter()
        costs = measure_pass_costs(model, max_tokens=max_tokens, key=key, measured_on=fingerprint)
        if log is not None:
            log(f"timed {len(costs.samples)} passes in {time.perf_counter() - t0:.1f} s to price repairs on this "
                f"machine (largest fit error {costs.fit_error:.0%})")
        with _MEASURED_LOCK:
            _MEASURED[memo] = costs
    if path is not None and not path.is_file():  # measured now, or earlier in this process for another folder
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            costs.save(path)
        except OSError as exc:
            logging.getLogger("mappings.passcost").warning(
                "cannot store pass costs in %s (%s); they will be measured again", path, exc.strerror or exc)
    return costs
