"""Mixup / CutMix of a batch, as timm's `Mixup` in its default mode 'batch', in NumPy.

One draw per batch: with probability `prob` the batch is mixed — by CutMix with probability
`switch_prob` when both alphas are > 0, else by mixup — with λ ~ Beta(α, α) of the chosen kind.
Row i is mixed with row B-1-i (the batch against its reverse). CutMix pastes a box of the reversed
batch whose sides are sqrt(1 - λ) of the image's around a uniform centre, clipped to the image,
and λ is then recomputed from the clipped box's area (timm's correct_lam).

`draw` makes every random choice of a batch; `apply` is deterministic given them. The targets
are the un-smoothed mixed one-hots; twinstep's loss smooths them (`twinstep.ops.loss
.smooth_targets`, linear in the target, so smoothing after mixing is timm's `mixup_target`).

Deliberate difference from timm: the mix is drawn and applied over the GLOBAL batch of a step,
pairing row i with row B-1-i of the whole batch, whereas timm's training script mixes each
process's local batch. Mixing globally keeps a step's inputs, and so the trajectory, the same
for any number of replicas. Images here are NHWC (timm's are NCHW tensors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from twinstep.data.batches import one_hot

Box = tuple[int, int, int, int]  # (y_lo, y_hi, x_lo, x_hi), half-open


@dataclass(frozen=True)
class MixParams:
    """timm's Mixup arguments: an alpha of 0 turns that kind off; `prob` is the chance a batch
    is mixed at all; `switch_prob` the chance of CutMix when both kinds are on."""

    mixup_alpha: float
    cutmix_alpha: float
    switch_prob: float = 0.5
    prob: float = 1.0


def cutmix_box(lam: float, cy: int, cx: int, height: int, width: int) -> tuple[Box, float]:
    """timm's rand_bbox (no margin) around centre (cy, cx) of a height x width image, and λ
    recomputed from the clipped box: (box, 1 - box area / image area)."""
    side = math.sqrt(1.0 - lam)
    cut_h, cut_w = int(height * side), int(width * side)
    y_lo, y_hi = min(max(cy - cut_h // 2, 0), height), min(max(cy + (cut_h + 1) // 2, 0), height)
    x_lo, x_hi = min(max(cx - cut_w // 2, 0), width), min(max(cx + (cut_w + 1) // 2, 0), width)
    return (y_lo, y_hi, x_lo, x_hi), 1.0 - (y_hi - y_lo) * (x_hi - x_lo) / float(height * width)


def draw(rng: np.random.Generator, params: MixParams, height: int,
         width: int) -> tuple[float, Box | None]:
    """One batch's mix: (λ, CutMix box or None for mixup). (1.0, None) is no mix. The draws
    follow timm's order: mix?, CutMix?, λ, then the box centre (y, then x)."""
    if not (params.mixup_alpha > 0 or params.cutmix_alpha > 0):
        raise ValueError("MixParams: mixup_alpha or cutmix_alpha must be > 0")
    if not rng.random() < params.prob:
        return 1.0, None
    if params.mixup_alpha > 0 and params.cutmix_alpha > 0:
        use_cutmix = bool(rng.random() < params.switch_prob)
    else:
        use_cutmix = params.cutmix_alpha > 0
    alpha = params.cutmix_alpha if use_cutmix else params.mixup_alpha
    lam = float(rng.beta(alpha, alpha))
    if lam == 1.0 or not use_cutmix:  # timm leaves the batch alone at λ = 1 (draws no box)
        return lam, None
    cy, cx = int(rng.integers(0, height)), int(rng.integers(0, width))
    box, lam = cutmix_box(lam, cy, cx, height, width)
    return lam, box


def apply(x: np.ndarray, labels: np.ndarray, classes: int, lam: float,
          box: Box | None) -> tuple[np.ndarray, np.ndarray]:
    """Mix x [B, H, W, C] float with its reverse along the batch: the CutMix box pasted from
    x[::-1] when `box` is given, else λ x + (1 - λ) x[::-1]. Returns (mixed x, same dtype,
    a new array; targets [B, classes] float32 = λ onehot(y) + (1 - λ) onehot(y[::-1]))."""
    labels = np.asarray(labels)
    return apply_pairs(x, x[::-1], labels, labels[::-1], classes=classes, lam=lam, box=box)


def apply_pairs(x: np.ndarray, partner: np.ndarray, labels: np.ndarray,
                partner_labels: np.ndarray, *, classes: int, lam: float,
                box: Box | None) -> tuple[np.ndarray, np.ndarray]:
    """`apply` for some rows of a batch: row i of x mixed with row i of ``partner`` (its row
    B-1-i in the batch), element for element as `apply` mixes it — what a process that holds
    only its own rows computes."""
    # a Python float stays weak in NumPy's promotion: float32 images are mixed in float32,
    # rounding as timm's tensor ops do (an np.float64 λ would promote them to float64)
    lam = float(lam)
    if box is not None:
        y_lo, y_hi, x_lo, x_hi = box
        out = x.copy()
        out[:, y_lo:y_hi, x_lo:x_hi] = partner[:, y_lo:y_hi, x_lo:x_hi]
    elif lam == 1.0:
        out = x.copy()
    else:
        out = x * lam + partner * (1.0 - lam)
    onehot = one_hot(np.asarray(labels), classes, np.float32)
    return out, onehot * lam + one_hot(np.asarray(partner_labels), classes, np.float32) * (
        1.0 - lam)
