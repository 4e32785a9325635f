"""The two losses, each returning (mean loss, d logits) with the divisors of docs/sync-sites.md.

A replica calls them on its own shard and divides by ITS batch (N, or N·K for BCE); the single
device divides by R·N (R·N·K). Targets are soft rows [N, K] (one-hot, mixup or cutmix); both
cotangents are affine in the target.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from twinstep.defaults import LABEL_SMOOTHING


def smooth_targets(t, alpha: float):
    """(1 - alpha) t + alpha / K: label smoothing of soft targets t [N, K] (also timm's BCE
    smoothing of one-hot targets: on = 1 - alpha + alpha / K, off = alpha / K)."""
    return t if alpha == 0.0 else (1.0 - alpha) * t + alpha / t.shape[-1]


def smoothed_ce(logits, targets, alpha: float = LABEL_SMOOTHING, divisor=None):
    """Label-smoothed softmax cross-entropy. logits, targets [N, K].

    loss = -sum_{n,k} q log softmax(z) / divisor, q = smooth_targets(t, alpha), divisor = N;
    dlogits = (softmax(z) sum_k q - q) / divisor (= (softmax(z) - q) / N for rows summing to 1).
    """
    divisor = logits.shape[0] if divisor is None else divisor
    q = smooth_targets(targets.astype(logits.dtype), alpha)
    logp = jax.nn.log_softmax(logits, axis=-1)
    loss = -jnp.sum(q * logp) / divisor
    dlogits = (jnp.exp(logp) * jnp.sum(q, axis=-1, keepdims=True) - q) / divisor
    return loss, dlogits


def bce_targets(targets, smoothing: float = 0.0, thresh: float | None = None):
    """timm's BinaryCrossEntropy target transform: smoothing, then the optional threshold
    (targets > thresh become 1, else 0; RSB A1/A2 use 0.2)."""
    t = smooth_targets(targets, smoothing)
    return t if thresh is None else (t > thresh).astype(t.dtype)


def bce(logits, targets, divisor=None):
    """BCE-with-logits, stable softplus form. logits, targets [N, K] (already transformed).

    loss = sum(max(z, 0) - z t + log1p(exp(-|z|))) / divisor, divisor = N K;
    dlogits = (sigmoid(z) - t) / divisor.
    """
    divisor = logits.size if divisor is None else divisor
    t = targets.astype(logits.dtype)
    per = jnp.maximum(logits, 0) - logits * t + jnp.log1p(jnp.exp(-jnp.abs(logits)))
    return jnp.sum(per) / divisor, (jax.nn.sigmoid(logits) - t) / divisor


KINDS = ("ce", "bce")


def value_and_cotangent(kind: str, logits, targets, divisor, alpha: float = LABEL_SMOOTHING):
    """(mean loss, d logits [N, K]) of logits, targets [N, K]: ``"ce"`` is `smoothed_ce` with
    label smoothing alpha, ``"bce"`` is `bce` on targets already transformed (`bce_targets`;
    alpha unused). ``divisor``: `loss_divisor`'s, at this replica's batch."""
    if kind == "ce":
        return smoothed_ce(logits, targets, alpha, divisor)
    if kind == "bce":
        return bce(logits, targets, divisor)
    raise ValueError(f"unknown loss {kind!r}; choose {' or '.join(KINDS)}")


def loss_divisor(loss: str, n: int, k: int) -> int:
    """The divisor a batch of n examples uses: n for CE, n K for BCE."""
    return n if loss == "ce" else n * k
