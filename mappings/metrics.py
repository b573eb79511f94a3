"""Metrics shared by calibration, evaluation and the runtime gates.

Fit quality, attention output and next-token agreement (fp64, for calibration and evaluation
tables), and :func:`mean_kl` / :func:`tail_nll` (fp32 scalars, for the probe and shadow gates of
the scheduler and the chat backend): one implementation of each, so offline numbers and gate
decisions measure the same thing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "fit_quality",
    "attention_output",
    "mean_cosine",
    "kl_divergence",
    "mean_kl",
    "entropy",
    "tail_nll",
    "next_token_agreement",
]


def mean_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean cosine similarity of matching rows (last dim), fp64."""
    import torch

    a = a.reshape(-1, a.shape[-1]).double()
    b = b.reshape(-1, b.shape[-1]).double()
    return float(torch.nn.functional.cosine_similarity(a, b, dim=-1, eps=1e-12).mean())


def fit_quality(pred: torch.Tensor, true: torch.Tensor) -> dict[str, float]:
    """``cosine`` (per token, heads concatenated), ``rel_mse`` and ``r2`` of ``pred`` vs ``true``.

    Inputs are ``[..., tokens, features]``-like; everything but the last dim is treated as tokens.
    """
    p = pred.reshape(-1, pred.shape[-1]).double()
    t = true.reshape(-1, true.shape[-1]).double()
    sse = float(((p - t) ** 2).sum())
    ss = float((t**2).sum())
    ssc = float(((t - t.mean(0)) ** 2).sum())
    return {"cosine": mean_cosine(p, t), "rel_mse": sse / max(ss, 1e-300), "r2": 1.0 - sse / max(ssc, 1e-300)}


def attention_output(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Causal ``softmax(QKᵀ·scaling)V`` for ``q`` ``[B, Hq, T, D]``, ``k``/``v`` ``[B, Hkv, T, D]`` (GQA ok).

    Returns ``[B, T, Hq*D]`` (what the attention module feeds its output projection).
    """
    import torch

    q, k, v = q.float(), k.float(), v.float()
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def attention_received(
    q: torch.Tensor, k: torch.Tensor, query_positions: torch.Tensor, scaling: float | None = None
) -> torch.Tensor:
    """Mean causal attention that queries ``q`` ``[B, Hq, t, D]`` pay to each key of ``k`` ``[B, Hkv, n, D]``.

    ``query_positions`` ``[t]`` are the queries' positions (keys sit at ``0..n-1``; a query sees the
    keys at or before it). Returns ``[B, Hkv, n]``: softmax weights averaged over the queries and over
    the query heads sharing each KV head. Queries and keys carry RoPE as cached.
    """
    import math

    import torch

    groups = q.shape[1] // k.shape[1]
    keys = k.float().repeat_interleave(groups, dim=1) if groups > 1 else k.float()
    scores = (q.float() @ keys.transpose(-1, -2)) * (scaling if scaling is not None else 1 / math.sqrt(q.shape[-1]))
    causal = torch.arange(k.shape[2], device=scores.device)[None, :] > query_positions.to(scores.device)[:, None]
    scores.masked_fill_(causal, -math.inf)
    weights = scores.softmax(-1).mean(2)  # [B, Hq, n]
    return weights.view(k.shape[0], k.shape[1], groups, k.shape[2]).mean(2)


def kl_divergence(logits_true: torch.Tensor, logits_other: torch.Tensor) -> torch.Tensor:
    """Per-position ``KL(p_true || p_other)`` in nats, shape ``logits.shape[:-1]``."""
    import torch

    lp = torch.log_softmax(logits_true.double(), -1)
    lq = torch.log_softmax(logits_other.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def mean_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean over positions of ``KL(softmax(p) ‖ softmax(q))`` in nats, computed in fp32.

    ``p_logits``/``q_logits``: ``[..., vocab]`` of the same shape; every leading index is a
    position. ``q`` is moved to ``p``'s device. fp32 (not :func:`kl_divergence`'s fp64) because
    the gates compare it with thresholds calibrated in fp32 and run it on the accelerator.
    """
    import torch.nn.functional as F

    p = F.log_softmax(p_logits.float(), -1)
    q = F.log_softmax(q_logits.float().to(p.device), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def entropy(logits: torch.Tensor) -> float:
    """Mean over positions of the next-token entropy of ``softmax(logits)`` (nats, fp32); ``[..., vocab]``."""
    import torch.nn.functional as F

    lp = F.log_softmax(logits.float(), -1)
    return float(-(lp.exp() * lp).sum(-1).mean())


def tail_nll(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """Mean NLL (nats, fp32) of ``ids[1:]`` under ``logits[:-1]``: how well a model predicts a tail.

    ``logits``: ``[m, vocab]`` (any leading shape flattening to ``m`` positions) for the ``m``
    trailing positions whose ids are ``ids`` (``m`` of them); position ``i``'s logits predict id
    ``i + 1``. Raises ValueError with fewer than 2 ids (nothing to predict).
    """
    import torch.nn.functional as F

    logits = logits.float().reshape(-1, logits.shape[-1])
    ids = ids.reshape(-1).to(logits.device)
    if ids.numel() < 2:
        raise ValueError("the probe needs at least 2 trailing tokens")
    return float(F.cross_entropy(logits[:-1], ids[1:]))


def next_token_agreement(
    logits_true: torch.Tensor, logits_other: torch.Tensor, labels: torch.Tensor | None = None
) -> dict[str, float]:
    """KL, top-1 / top-5 agreement and NLL delta of ``other`` against ``true`` (``[B, M, vocab]``).

    ``top1``: both argmaxes agree. ``top5``: the true argmax is in the other's top 5. ``nll_delta``:
    mean NLL(other) − NLL(true) of ``labels`` ``[B, M]`` (positions with label < 0 are skipped).
    """
    import torch

    kl = kl_divergence(logits_true, logits_other)
    top_true = logits_true.argmax(-1)
    top1 = (logits_other.argmax(-1) == top_true).double()
    top5_idx = logits_other.topk(min(5, logits_other.shape[-1]), -1).indices
    top5 = (top5_idx == top_true[..., None]).any(-1).double()
    out = {"kl": float(kl.mean()), "top1": float(top1.mean()), "top5": float(top5.mean()), "nll_delta": float("nan")}
    if labels is not None:
        mask = labels >= 0
        if bool(mask.any()):
            lt = torch.log_softmax(logits_true.double(), -1)
            lo = torch.log_softmax(logits_other.double(), -1)
            idx = labels.clamp_min(0)[..., None]
            nll_t = -lt.gather(-1, idx)[..., 0]
            nll_o = -lo.gather(-1, idx)[..., 0]
            out["nll_delta"] = float((nll_o - nll_t)[mask].mean())
    return out
