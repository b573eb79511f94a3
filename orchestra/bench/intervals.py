"""95 % intervals for the bench's shares and ratios, so a goal is read against its noise.

A task score on a few dozen questions moves by several points when one greedy answer flips on a
near-tie. The tables therefore print every share with an interval: a Wilson score interval for a
share of independent trials (agreement, a gate's catch and false-alarm rates, top-1 over scored
tokens), and a paired bootstrap for retention, a ratio of two shares over the *same* questions,
whose numerator and denominator move together.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

__all__ = ["wilson", "paired_ratio_interval", "Z95"]

Z95 = 1.959963984540054
"""The standard normal's two-sided 95 % point."""


def wilson(hits: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a share of ``hits`` in ``n`` ((0, 1) when ``n`` is 0: nothing is known)."""
    if n <= 0:
        return (0.0, 1.0)
    if not 0 <= hits <= n:
        raise ValueError(f"hits must lie in [0, n], got {hits} of {n}")
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def paired_ratio_interval(base: Sequence[bool], other: Sequence[bool], *, resamples: int = 4000, seed: int = 0,
                          level: float = 0.95) -> tuple[float, float] | None:
    """Percentile bootstrap interval of ``sum(other) / sum(base)`` over items resampled in pairs.

    ``base[i]`` and ``other[i]`` are the same question answered two ways (the member's own prefill and
    a mapped cache): resampling questions, not answers, keeps what the two have in common out of the
    interval's width. Resamples in which ``base`` has no hit are left out (the ratio is undefined there);
    None when ``base`` has none at all. The seed is fixed so a table reads the same on every run.
    """
    if len(base) != len(other):
        raise ValueError(f"paired samples differ in length: {len(base)} and {len(other)}")
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    n = len(base)
    if n == 0 or not any(base):
        return None
    pairs = [(int(b), int(o)) for b, o in zip(base, other, strict=True)]
    rng = random.Random(seed)
    ratios = []
    for _ in range(resamples):
        b_hits = o_hits = 0
        for b, o in rng.choices(pairs, k=n):
            b_hits += b
            o_hits += o
        if b_hits:
            ratios.append(o_hits / b_hits)
    ratios.sort()
    tail = (1 - level) / 2
    low = ratios[min(len(ratios) - 1, int(math.floor(tail * len(ratios))))]
    high = ratios[min(len(ratios) - 1, int(math.ceil((1 - tail) * len(ratios))) - 1)]
    return (low, high)
