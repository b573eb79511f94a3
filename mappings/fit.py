"""Closed-form linear maps from streaming sufficient statistics.

A map sends source features ``x`` (one token's keys or values of one or more source layers,
heads concatenated) to target features ``y``: ``y ≈ x W + b``. Everything the solvers need is in
:class:`RegressionStats` (``XᵀX``, ``XᵀY``, ``YᵀY``, sums, count, float64), accumulated batch by
batch so calibration memory does not grow with the corpus.

Solvers (all via Cholesky on the regularised normal equations, ``lstsq`` as fallback; never an
explicit inverse):

- plain ridge ``argmin ‖Y − XW‖² + λ‖W‖²`` (the paper's ``W = (XᵀX+λI)⁻¹XᵀY``);
- identity-anchored ridge ``argmin ‖Y − XW‖² + λ‖W − W₀‖²`` with ``W₀ = I`` (or any prior);
- bias: none, free (solved by centering, not regularised) or regularised toward 0 with the same λ;
- reduced-rank: the correction ``W − W₀`` is projected onto its top-``r`` output directions;
- blocks: one independent solve per (input, output) index block, e.g. per KV head.

``λ = alpha · trace(XᵀX)/p``: ``alpha`` is relative to the mean feature power, so one grid works
for keys and values of every layer and model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

__all__ = [
    "RegressionStats",
    "LayerStats",
    "Block",
    "BiasMode",
    "Prior",
    "solve_regularized",
    "fit_linear",
    "head_blocks",
    "identity_prior",
    "apply_linear",
    "factorize",
]

BiasMode = Literal["none", "free", "regularized"]
Prior = Literal["ridge", "anchored"]


@dataclass(frozen=True)
class Block:
    """One independent sub-problem: which input features predict which output features."""

    inputs: tuple[int, ...]
    """Input feature indices."""
    outputs: tuple[int, ...]
    """Output feature indices."""


@dataclass
class RegressionStats:
    """Sufficient statistics of a multi-output linear regression, float64."""

    n: int
    """Number of rows (tokens) accumulated."""
    sum_x: torch.Tensor
    """``[p]`` column sums of X."""
    sum_y: torch.Tensor
    """``[q]`` column sums of Y."""
    xtx: torch.Tensor
    """``[p, p]`` XᵀX."""
    xty: torch.Tensor
    """``[p, q]`` XᵀY."""
    yty: torch.Tensor
    """``[q, q]`` YᵀY."""

    @classmethod
    def zeros(cls, p: int, q: int, device: str | torch.device = "cpu") -> RegressionStats:
        import torch

        def z(*size: int) -> torch.Tensor:
            return torch.zeros(*size, dtype=torch.float64, device=device)

        return cls(0, z(p), z(q), z(p, p), z(p, q), z(q, q))

    @classmethod
    def from_data(cls, x: torch.Tensor, y: torch.Tensor) -> RegressionStats:
        stats = cls.zeros(x.shape[1], y.shape[1], x.device)
        stats.update(x, y)
        return stats

    @property
    def p(self) -> int:
        return int(self.xtx.shape[0])

    @property
    def q(self) -> int:
        return int(self.yty.shape[0])

    def update(self, x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Add rows ``x`` ``[n, p]`` and ``y`` ``[n, q]``, each weighing ``weights[i]`` (default 1).

        Each batch's products are formed in the inputs' precision (at least fp32; fp64 inputs stay
        fp64) and accumulated in fp64, so rounding does not grow with the corpus. Weighted rows make
        every statistic a weighted sum (``XᵀWX``, ...) and ``n`` the weights' total, rounded: callers
        normalise weights to a mean of 1 so that ``n`` stays the row count.
        """
        import torch

        if x.shape[0] != y.shape[0]:
            raise ValueError(f"x has {x.shape[0]} rows, y has {y.shape[0]}")
        work = torch.float64 if torch.float64 in (x.dtype, y.dtype) else torch.float32
        x = x.to(self.xtx.device, work)
        y = y.to(self.xtx.device, work)
        if weights is None:
            self.n += int(x.shape[0])
            wx, wy = x, y
        else:
            if weights.shape != (x.shape[0],):
                raise ValueError(f"weights have shape {tuple(weights.shape)}, expected ({x.shape[0]},)")
            w = weights.to(self.xtx.device, work)[:, None]
            self.n += int(round(float(weights.sum())))
            wx, wy = x * w, y * w
        self.sum_x += wx.sum(0, dtype=torch.float64)
        self.sum_y += wy.sum(0, dtype=torch.float64)
        self.xtx += (wx.T @ x).double()
        self.xty += (wx.T @ y).double()
        self.yty += (wy.T @ y).double()

    def merge(self, other: RegressionStats) -> RegressionStats:
        """Statistics of both data sets together."""
        return RegressionStats(
            self.n + other.n, self.sum_x + other.sum_x, self.sum_y + other.sum_y,
            self.xtx + other.xtx, self.xty + other.xty, self.yty + other.yty,
        )

    def select_inputs(self, index: Sequence[int]) -> RegressionStats:
        """Statistics restricted to some input columns (e.g. the chosen source layers)."""
        import torch

        idx = torch.as_tensor(list(index), dtype=torch.long, device=self.xtx.device)
        return RegressionStats(
            self.n, self.sum_x[idx].clone(), self.sum_y.clone(), self.xtx[idx][:, idx].clone(),
            self.xty[idx].clone(), self.yty.clone(),
        )

    # ------------------------------------------------------------------ errors from stats
    def sse(self, w: torch.Tensor, b: torch.Tensor | None = None) -> float:
        """``‖Y − XW − 1b‖²`` computed from the statistics alone."""
        import torch

        w = w.to(self.xtx.device, torch.float64)
        total = self.yty.trace() - 2 * (w * self.xty).sum() + (w * (self.xtx @ w)).sum()
        if b is not None:
            b = b.to(self.xtx.device, torch.float64)
            total = total - 2 * (b @ self.sum_y) + 2 * (b @ (w.T @ self.sum_x)) + self.n * (b @ b)
        return float(total.clamp_min(0.0))

    def total_ss(self, centered: bool = True) -> float:
        """Sum of squares of Y (about its mean when ``centered``)."""
        ss = self.yty.trace()
        if centered and self.n:
            ss = ss - (self.sum_y @ self.sum_y) / self.n
        return float(ss)

    def relative_error(self, w: torch.Tensor, b: torch.Tensor | None = None) -> float:
        """``‖Y − Ŷ‖² / ‖Y‖²``."""
        return self.sse(w, b) / max(self.total_ss(centered=False), 1e-300)

    def r2(self, w: torch.Tensor, b: torch.Tensor | None = None) -> float:
        """Coefficient of determination over all output features."""
        return 1.0 - self.sse(w, b) / max(self.total_ss(centered=True), 1e-300)

    # ------------------------------------------------------------------ serialisation
    def to_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        import torch

        return {
            f"{prefix}.n": torch.tensor([self.n], dtype=torch.int64),
            f"{prefix}.sum_x": self.sum_x.cpu(), f"{prefix}.sum_y": self.sum_y.cpu(),
            f"{prefix}.xtx": self.xtx.cpu(), f"{prefix}.xty": self.xty.cpu(), f"{prefix}.yty": self.yty.cpu(),
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str) -> RegressionStats:
        return cls(
            int(tensors[f"{prefix}.n"][0]), tensors[f"{prefix}.sum_x"], tensors[f"{prefix}.sum_y"],
            tensors[f"{prefix}.xtx"], tensors[f"{prefix}.xty"], tensors[f"{prefix}.yty"],
        )


@dataclass
class LayerStats:
    """Calibration statistics of one target layer (keys in content space, values).

    Kept next to :class:`RegressionStats` because it is nothing but a pair of them: calibration
    accumulates it, the store saves and loads it, assembly fits from it.
    """

    keys: RegressionStats
    values: RegressionStats


def solve_regularized(
    gram: torch.Tensor, rhs: torch.Tensor, reg: torch.Tensor | float
) -> torch.Tensor:
    """Solve ``(gram + diag(reg)) W = rhs`` by Cholesky; ``lstsq`` when not positive definite.

    ``reg`` is a scalar or a vector of per-feature penalties. Float64 throughout.
    """
    import torch

    gram = gram.to(torch.float64)
    rhs = rhs.to(torch.float64)
    a = gram.clone()
    if isinstance(reg, (int, float)):
        a.diagonal().add_(float(reg))
    else:
        a.diagonal().add_(reg.to(a))
    chol, info = torch.linalg.cholesky_ex(a)
    if int(info) == 0:
        return torch.cholesky_solve(rhs, chol)
    # Singular (no regularisation on rank-deficient data): minimum-norm least squares.
    return torch.linalg.lstsq(a, rhs, driver="gelsd" if a.device.type == "cpu" else None).solution


def head_blocks(sources: int, src_heads: int, src_dim: int, tgt_heads: int, tgt_dim: int) -> list[Block]:
    """Per-KV-head blocks: target head ``h`` is predicted from head ``h`` of every source layer.

    Needs equal head counts; the head sizes may differ.
    """
    if src_heads != tgt_heads:
        raise ValueError(f"per-head maps need equal KV head counts (source {src_heads}, target {tgt_heads})")
    blocks = []
    width = src_heads * src_dim
    for h in range(tgt_heads):
        ins = tuple(s * width + h * src_dim + i for s in range(sources) for i in range(src_dim))
        outs = tuple(h * tgt_dim + i for i in range(tgt_dim))
        blocks.append(Block(ins, outs))
    return blocks


def identity_prior(p: int, q: int) -> torch.Tensor:
    """``[p, q]`` prior: identity on the first ``q`` inputs (the anchor source layer), zero elsewhere."""
    import torch

    if p < q:
        raise ValueError(f"an identity prior needs at least as many inputs ({p}) as outputs ({q})")
    w0 = torch.zeros(p, q, dtype=torch.float64)
    w0[:q, :q] = torch.eye(q, dtype=torch.float64)
    return w0


def _fit_block(
    stats: RegressionStats,
    ins: torch.Tensor,
    outs: torch.Tensor,
    w0: torch.Tensor,
    alpha: float,
    bias: BiasMode,
    rank: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    import torch

    n = max(stats.n, 1)
    g = stats.xtx[ins][:, ins]
    c = stats.xty[ins][:, outs]
    sx, sy = stats.sum_x[ins], stats.sum_y[outs]
    p = g.shape[0]
    if bias == "free":
        g = g - torch.outer(sx, sx) / n
        c = c - torch.outer(sx, sy) / n
    lam = float(alpha) * float(g.trace()) / max(p, 1)
    b = None
    if bias == "regularized":
        ga = torch.zeros(p + 1, p + 1, dtype=torch.float64, device=g.device)
        ga[:p, :p], ga[:p, p], ga[p, :p], ga[p, p] = g, sx, sx, float(stats.n)
        ca = torch.cat([c, sy[None]], 0)
        w0a = torch.cat([w0, torch.zeros(1, w0.shape[1], dtype=torch.float64, device=g.device)], 0)
        sol = solve_regularized(ga, ca + lam * w0a, lam)
        w, b = sol[:p], sol[p]
    else:
        w = solve_regularized(g, c + lam * w0, lam)
    if rank is not None and rank < min(w.shape):
        delta = w - w0
        gram = g + lam * torch.eye(p, dtype=torch.float64, device=g.device)
        m = delta.T @ gram @ delta
        _, vecs = torch.linalg.eigh((m + m.T) / 2)
        top = vecs[:, -rank:]
        w = w0 + delta @ top @ top.T
        if bias == "regularized":
            b = (sy - w.T @ sx) / (stats.n + lam)
    if bias == "free":
        b = (sy - w.T @ sx) / n
    return w, b


def fit_linear(
    stats: RegressionStats,
    *,
    alpha: float,
    prior: torch.Tensor | None = None,
    bias: BiasMode = "none",
    rank: int | None = None,
    blocks: Sequence[Block] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fit ``W`` ``[p, q]`` (and ``b`` ``[q]`` unless ``bias == "none"``) from statistics.

    ``prior`` is ``W₀`` (None: plain ridge toward 0). ``blocks`` solves each block separately
    (other entries of W stay 0). ``rank`` limits the rank of ``W − W₀`` per block. Returns float32.
    """
    import torch

    p, q = stats.p, stats.q
    w0 = torch.zeros(p, q, dtype=torch.float64) if prior is None else prior.to(torch.float64)
    w0 = w0.to(stats.xtx.device)
    if w0.shape != (p, q):
        raise ValueError(f"prior has shape {tuple(w0.shape)}, expected {(p, q)}")
    if stats.n == 0:
        raise ValueError("no data accumulated: cannot fit a map")
    if blocks is None:
        blocks = [Block(tuple(range(p)), tuple(range(q)))]
    w = torch.zeros(p, q, dtype=torch.float64, device=stats.xtx.device)
    b = torch.zeros(q, dtype=torch.float64, device=stats.xtx.device) if bias != "none" else None
    for block in blocks:
        ins = torch.as_tensor(block.inputs, dtype=torch.long, device=w.device)
        outs = torch.as_tensor(block.outputs, dtype=torch.long, device=w.device)
        wb, bb = _fit_block(stats, ins, outs, w0[ins][:, outs], alpha, bias,
                            None if rank is None else min(rank, len(block.inputs), len(block.outputs)))
        w[ins[:, None], outs[None, :]] = wb
        if b is not None and bb is not None:
            b[outs] = bb
    return w.float(), (b.float() if b is not None else None)


def apply_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``x W + b`` in the dtype of ``w``."""
    y = x.to(w.dtype) @ w
    return y + b if b is not None else y


def factorize(w: torch.Tensor, prior: torch.Tensor | None, rank: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``W − W₀ = down @ up`` with ``rank`` columns, when that stores (and costs) less than ``W``; else None.

    Lives with the solvers because KV maps and residual maps both store a fitted ``W`` this way.
    """
    import torch

    p, q = w.shape
    if rank * (p + q) >= p * q:
        return None
    delta = w.double() - (prior.double() if prior is not None else 0.0)
    u, sv, vh = torch.linalg.svd(delta, full_matrices=False)
    return (u[:, :rank] * sv[:rank]).float().contiguous(), vh[:rank].float().contiguous()
