"""Measured divergence of a family member from the root: mean next-token KL and top-1 agreement."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class HeldoutWindows:
    """Fixed token windows of a held-out text and the root's log-probabilities on them."""

    name: str
    windows: list[torch.Tensor]
    root_logprobs: list[torch.Tensor]


def heldout_windows(root, tokenizer, text: str, name: str, window: int = 512, count: int = 4) -> HeldoutWindows:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < window:
        raise ValueError(f"held-out text {name} has {len(ids)} tokens, fewer than one window of {window}")
    count = min(count, len(ids) // window)
    windows = [torch.tensor(ids[i * window : (i + 1) * window]).unsqueeze(0) for i in range(count)]
    with torch.no_grad():
        logprobs = [F.log_softmax(root(input_ids=w).logits.float(), -1)[0] for w in windows]
    return HeldoutWindows(name, windows, logprobs)


def measure_divergence(member, heldout: HeldoutWindows) -> tuple[float, float, int]:
    """Return (mean KL(root || member), top-1 agreement, positions) over the held-out windows."""
    kl_sum, agree, n = 0.0, 0, 0
    with torch.no_grad():
        for w, ref in zip(heldout.windows, heldout.root_logprobs, strict=True):
            lp = F.log_softmax(member(input_ids=w).logits.float(), -1)[0]
            kl_sum += float((ref.exp() * (ref - lp)).sum(-1).sum())
            agree += int((ref.argmax(-1) == lp.argmax(-1)).sum())
            n += ref.shape[0]
    return kl_sum / n, agree / n, n
