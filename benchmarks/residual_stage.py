"""Does a second stage on the shipped map's error make a long served map more faithful?

    python benchmarks/residual_stage.py [--features 256] [--tokens 8192] [--home DIR] [--out DIR]

The root -> fine-tuned mapping is calibrated as `orchestra family calibrate` does (the method as
shipped: identity-anchored, rank 32, first 4 positions exact, values weighted by attention, per-layer
λ by held-out KL). Then, per mapped layer, a second stage is fitted by ridge on the calibration
windows to the error that map leaves (target K/V minus mapped K/V, keys in content space, the 4
sink positions left out as the map leaves them out), from features of the source's own K/V at
that layer:

- ``cross``: the source's keys *and* values, linear, both feeding each of the target's keys and
  values. The shipped map predicts keys from keys only; a target key is a projection of the
  target's hidden state, and the source's values see directions of that state its keys do not.
- ``gelu features``: a non-linear residual, ``gelu(z P)`` with ``z`` the standardised source
  ``[K, V]`` and ``P`` a fixed random ``[2w, m]`` projection (random features: still one closed-form
  solve, streaming-friendly, nothing trained by gradient).
- ``cross + gelu features``: both.

Each stage's ridge strength, per layer and for keys and values apart, is the one of
(1e-3 ... 10) x mean feature power with the lowest error on the 2 held-out calibration windows; a
stage that lowers none is left out. Every variant is scored with ``mappings.evaluate`` on the
held-out GPL-3 text as `benchmarks/fit_ablation.py` scores it (test: 2 windows of 3,584 + 128 from
token 0; dev: 1 window from token 1,800; served = first 4 positions exact, + tail = also the last
32 recomputed), and at 512-token windows at the same offsets, to tell an error of length from an
error of text.

Writes benchmarks/results/residual_stage.json and .md.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _results import command_line, write_results  # noqa: E402  (after the path insert)

from mappings.apply import LinearKVMap  # noqa: E402  (after the path insert, as every benchmark)

if TYPE_CHECKING:
    import torch

    from mappings.apply import KVLayers

MODES = {"cross": ("cross",), "gelu features": ("gelu",), "cross + gelu features": ("cross", "gelu")}
ALPHAS = (1e-3, 1e-2, 1e-1, 1.0, 10.0)
SINKS, TAIL, SUFFIX, DEV_OFFSET = 4, 32, 128, 1800
LENGTHS = (3584, 512)


@dataclass
class Stage:
    """One layer's second stage: ``[K, V]`` of source layer ``source`` -> the error of the map's keys and values."""

    source: int
    mean: torch.Tensor
    scale: torch.Tensor
    parts: tuple[str, ...]
    projection: torch.Tensor
    weights: dict[str, torch.Tensor]
    """``k`` / ``v``: ``[features, target width]``."""

    def features(self, xk: torch.Tensor, xv: torch.Tensor) -> torch.Tensor:
        import torch

        z = (torch.cat([xk, xv], 1) - self.mean) / self.scale
        cols = [torch.ones(z.shape[0], 1, dtype=z.dtype, device=z.device)]
        if "cross" in self.parts:
            cols.append(z)
        if "gelu" in self.parts:
            cols.append(torch.nn.functional.gelu(z @ self.projection))
        return torch.cat(cols, 1)


@dataclass
class StagedMap(LinearKVMap):
    """The shipped map with a second stage added to some layers (keys' stage rotated by the target's RoPE:
    rotation is linear, so ``R(map + stage) = R(map) + R(stage)``)."""

    stages: dict[int, Stage] = field(default_factory=dict)

    def apply(self, source_layers: KVLayers, positions: torch.Tensor | None = None, **kwargs: Any) -> KVLayers:
        import torch

        from mappings.calibrate import token_rows

        out = super().apply(source_layers, positions, **kwargs)
        for ti, stage in self.stages.items():
            if out[ti][0] is None:
                continue
            k_out, v_out = out[ti]
            sk, sv = source_layers[stage.source]
            b, _, t, _ = sk.shape
            pos = torch.arange(t, device=k_out.device) if positions is None else positions.to(k_out.device)
            seq = int(pos.max()) + 1
            xk = self.source_rope.strip(sk.to(k_out.device, torch.float32), pos, seq_len=seq)
            f = stage.features(token_rows(xk), token_rows(sv.to(k_out.device, torch.float32)))
            heads, dim = k_out.shape[1], k_out.shape[3]
            rk = (f @ stage.weights["k"]).view(b, t, heads, dim).transpose(1, 2)
            rk = self.target_rope.apply(rk, pos, seq_len=seq)
            rv = (f @ stage.weights["v"]).view(b, t, heads, dim).transpose(1, 2)
            out[ti] = ((k_out.float() + rk).to(k_out.dtype), (v_out.float() + rv).to(v_out.dtype))
        return out


def _capture(src: Any, tgt: Any, kv: LinearKVMap, windows: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Per layer ``[source K (content), source V, target K (content), target V]`` rows, sinks left out."""
    import torch

    from mappings.capture import capture_windows

    per: list[list[list[torch.Tensor]]] = []
    for sc, tc in zip(capture_windows(src.model, windows, progress=False),
                      capture_windows(tgt.model, windows, progress=False), strict=True):
        seq, keep = max(sc.lengths), sc.positions >= SINKS
        for i in range(len(sc.keys)):
            parts = (kv.source_rope.strip(sc.keys[i], sc.positions, seq_len=seq), sc.values[i],
                     kv.target_rope.strip(tc.keys[i], tc.positions, seq_len=seq), tc.values[i])
            if len(per) <= i:
                per.append([[], [], [], []])
            for j, t in enumerate(parts):
                per[i][j].append(t.reshape(t.shape[0], -1)[keep])
    return [[torch.cat(p) for p in layer] for layer in per]


def fit_stages(kv: LinearKVMap, train: list[list[torch.Tensor]], held: list[list[torch.Tensor]],
               parts: tuple[str, ...], features: int, seed: int = 0) -> tuple[dict[int, Stage], list[float]]:
    """A stage per mapped layer (where one lowers the held-out error), and each layer's held-out error cut."""
    import torch

    from mappings.apply import map_product

    gen = torch.Generator().manual_seed(seed)
    stages, cuts = {}, []
    for ti, lm in enumerate(kv.layers):
        if lm.mode != "map" or len(lm.sources) != 1:
            continue
        s = lm.sources[0]
        x = torch.cat(train[s][:2], 1)
        stage = Stage(s, x.mean(0), x.std(0) + 1e-6, parts,
                      torch.randn(x.shape[1], features, generator=gen) / x.shape[1] ** 0.5, {})
        f, hf = stage.features(*train[s][:2]).double(), stage.features(*held[s][:2]).double()
        gram = f.T @ f
        power = float(gram.trace()) / gram.shape[0]
        before = after = 0.0
        for kind, j in (("k", 0), ("v", 1)):
            w = lm.prepared(kind, "cpu")
            err = (train[ti][2 + j] - map_product(train[s][j], w, lm.anchored)).double()
            herr = (held[ti][2 + j] - map_product(held[s][j], w, lm.anchored)).double()
            base = float((herr ** 2).sum())
            best, best_w = base, torch.zeros(f.shape[1], err.shape[1], dtype=torch.float64)
            for a in ALPHAS:
                sol = torch.linalg.solve(gram + a * power * torch.eye(gram.shape[0], dtype=torch.float64), f.T @ err)
                e = float(((herr - hf @ sol) ** 2).sum())
                if e < best:
                    best, best_w = e, sol
            stage.weights[kind] = best_w.float()
            before, after = before + base, after + best
        if after < before:
            stages[ti] = stage
        cuts.append(1 - after / before)
    return stages, cuts


def score(mapping: Any, ids: list[int], src: Any, tgt: Any) -> dict[str, Any]:
    from mappings.evaluate import EvaluationSettings, evaluate

    own = mapping.manifest.method.name
    out: dict[str, Any] = {}
    for length in LENGTHS:
        for split, doc, windows in (("test", ids, 2), ("dev", ids[DEV_OFFSET:], 1)):
            settings = EvaluationSettings(prefix_tokens=length, suffix_tokens=SUFFIX, windows=windows, tail_tokens=TAIL,
                                          greedy_tokens=0, baselines=(), layer_curves=False, sink_tokens=SINKS,
                                          repair_costs="compute")
            report = evaluate(mapping, doc, settings, source=src, target=tgt, document_name="gpl-3.txt")
            served, tailed, pure = report.row(f"{own}+sinks{SINKS}"), report.row(f"{own}+tail{TAIL}"), report.row(own)
            out[f"{split}@{length}"] = {"kl": served.kl, "top1": served.top1, "tail_kl": tailed.kl,
                                        "tail_top1": tailed.top1, "pure_kl": pure.kl}
    return out


def measure(tokens: int, features: int, home: str | None) -> dict[str, Any]:
    import dataclasses

    from mappings.calibrate import CalibrationSettings, calibrate, prepare_windows
    from mappings.compat import check_pair
    from mappings.methods import resolve_method
    from mappings.models import load_model
    from orchestra.documents.texts import CALIBRATION_TEXTS, HELDOUT_TEXT, data_text
    from orchestra.family import load_family

    family = load_family(home)
    root = next(m for m in family.members.values() if m.role == "root")
    member = next(m for m in family.members.values() if m.role == "finetuned")
    src, tgt = load_model(family.member_path(root.name)), load_model(family.member_path(member.name))
    card = check_pair(src.model, src.tokenizer, tgt.model, tgt.tokenizer)
    spec = resolve_method("auto", same_kv_shape=card.same_kv_shape, same_kv_heads=card.same_kv_heads,
                          same_depth=card.same_depth)
    corpus = [(name, data_text(name)) for name in CALIBRATION_TEXTS]
    settings = CalibrationSettings(method=spec, tokens=tokens, window=512)
    t0 = time.perf_counter()
    mapping = calibrate(src, tgt, corpus, settings, progress=False)
    calibration_s = time.perf_counter() - t0
    shipped = mapping.kv_map
    ids = tgt.tokenizer(data_text(HELDOUT_TEXT), add_special_tokens=False)["input_ids"]
    rows = [{"variant": "shipped", "stage_seconds": 0.0, "layers": 0, "cut": [], **score(mapping, ids, src, tgt)}]
    print(f"shipped: {rows[-1]['test@3584']}", flush=True)
    t0 = time.perf_counter()
    windows = prepare_windows(corpus, tgt.tokenizer, settings)
    train, held = _capture(src, tgt, shipped, windows.train), _capture(src, tgt, shipped, windows.heldout)
    capture_s = time.perf_counter() - t0
    for label, parts in MODES.items():
        t0 = time.perf_counter()
        stages, cuts = fit_stages(shipped, train, held, parts, features)
        fit_s = time.perf_counter() - t0
        mapping.kv_map = StagedMap(**{f.name: getattr(shipped, f.name) for f in dataclasses.fields(shipped)},
                                   stages=stages)
        rows.append({"variant": label, "stage_seconds": capture_s + fit_s, "layers": len(stages),
                     "cut": cuts, **score(mapping, ids, src, tgt)})
        print(f"{label}: {rows[-1]['test@3584']}", flush=True)
    mapping.kv_map = shipped
    return {"member": "finetuned", "name": member.name, "method": spec.name, "features": features,
            "calibration_seconds": calibration_s, "rows": rows}


def markdown(res: dict[str, Any], command: str) -> str:
    lines = [
        "# A second stage on the shipped map's error", "",
        f"Command: `{command}`", "",
        f"Root -> fine-tuned ({res['method']}, calibrated in {res['calibration_seconds']:.0f} s), then per mapped "
        "layer a ridge fit of the error it leaves on the calibration windows, from the source's own keys and values "
        f"at that layer (cross: linear; gelu features: {res['features']} random gelu features). Held-out error cut: "
        "the share of the map's error on the 2 held-out calibration windows that the stage removes (mean over "
        "layers). Scored on the held-out GPL-3 text: served = first 4 positions exact; + tail = also the last 32 "
        "recomputed, as a FamilyCache serves it. KL in nats per token against the member's own prefill.", "",
        "| variant | held-out error cut | test KL / top-1 at 3,584 | + tail | dev KL / top-1 at 3,584 | + tail | "
        "test KL at 512 | dev KL at 512 | pure map test KL at 3,584 | stage s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        cut = f"{sum(r['cut']) / len(r['cut']):.0%}" if r["cut"] else "-"
        t, d = r["test@3584"], r["dev@3584"]
        lines.append(f"| {r['variant']} | {cut} | {t['kl']:.4f} / {t['top1']:.3f} | {t['tail_kl']:.4f} / "
                     f"{t['tail_top1']:.3f} | {d['kl']:.4f} / {d['top1']:.3f} | {d['tail_kl']:.4f} / "
                     f"{d['tail_top1']:.3f} | {r['test@512']['kl']:.4f} | {r['dev@512']['kl']:.4f} | "
                     f"{t['pure_kl']:.4f} | {r['stage_seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--features", type=int, default=256, help="random gelu features per layer")
    parser.add_argument("--tokens", type=int, default=8192, help="fitting tokens")
    parser.add_argument("--home", default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    res = measure(args.tokens, args.features, args.home)
    command = command_line("residual_stage.py", argv)
    write_results(args.out, "residual_stage", {"command": command, **res}, markdown(res, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
