"""The statistics of comparing accuracies (docs/training.md#accuracy): a top-1's 95 % interval
and McNemar's exact test on two runs' per-image results (numpy and the standard library: no JAX)."""

from __future__ import annotations

import math

import numpy as np

ALPHA = 0.05  # the level a difference is called significant at
Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile: a two-sided 95 % interval


def interval(correct: int, images: int) -> tuple[float, float]:
    """The 95 % Wilson score interval (low, high) of an accuracy of ``correct`` of ``images``
    (docs/training.md#accuracy)."""
    if images <= 0:
        raise ValueError("an interval needs at least one image")
    p, z2 = correct / images, Z95 * Z95
    centre = (p + z2 / (2 * images)) / (1 + z2 / images)
    half = Z95 * math.sqrt(p * (1 - p) / images + z2 / (4 * images * images)) / (1 + z2 / images)
    return max(0.0, centre - half), min(1.0, centre + half)


def mcnemar(a, b) -> tuple[int, int, float]:
    """(images only ``a`` got right, only ``b`` got right, the two-sided exact p-value) of two
    runs' per-image hits (bool [n], the same images in the same order): under "neither is
    better" each of the k = only_a + only_b discordant images goes either way with probability
    1/2, and p = min(1, 2 P[X <= min(only_a, only_b)]) for X ~ Binomial(k, 1/2); 1 when k = 0."""
    a, b = np.asarray(a, bool), np.asarray(b, bool)
    only_a, only_b = int((a & ~b).sum()), int((b & ~a).sum())
    k, low = only_a + only_b, min(only_a, only_b)
    if k == 0:
        return only_a, only_b, 1.0
    # P[X <= low] summed in logs: exact integer binomials would be ~k/3 digits long
    logs = [math.lgamma(k + 1) - math.lgamma(i + 1) - math.lgamma(k - i + 1) - k * math.log(2)
            for i in range(low + 1)]
    top = max(logs)
    tail = math.exp(top) * sum(math.exp(x - top) for x in logs)
    return only_a, only_b, min(1.0, 2 * tail)
