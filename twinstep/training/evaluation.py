"""Evaluation during training: the raw and EMA weights over the whole val split, in eval mode,
sharded over the replicas (eval-mode BN reads no batch statistics, so each row's logits are the
single device's whatever R is).
"""

from __future__ import annotations

import hashlib

import jax
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

from twinstep import dp
from twinstep.data import batches, loader
from twinstep.processes import cluster
from twinstep.training.stats import interval


def eval_placement(replicas: int) -> tuple:
    """(weights, rows) shardings of a sharded evaluation: the weights on every replica, each
    replica a contiguous 1/R of the rows."""
    if replicas == 1:
        one = SingleDeviceSharding(jax.devices()[0])
        return one, one
    mesh = dp.mesh(replicas)
    return NamedSharding(mesh, dp.REPLICATED), NamedSharding(mesh, dp.BATCH)


def evaluate(src, cfg, state, eval_fn, met=None) -> tuple[dict, dict]:
    """(metrics, correct) of ``state`` for the run ``cfg`` (a `TrainConfig`) over the whole val
    split: metrics {"raw": {loss, top1, top1_low, top1_high, top5}, "ema": ...} (top-1's 95 %
    `interval`), correct {"raw": bool [n]: image i's top-1 is right, "ema": ...}. Sharded over
    the replicas (`eval_placement`), the last batch padded and masked so every image counts
    once (an image that does not decode is replaced by the next, `twinstep.data.sources`, and
    told to ``met("val", indices)``). A
    process reads and scores its own replicas' rows; sums and hits are totalled over
    processes."""
    n = len(src.val_labels)
    names = [name for name in ("raw", "ema") if name == "raw" or state.ema is not None]
    sums, hits = {name: np.zeros(3) for name in names}, {name: np.zeros(n) for name in names}
    weights = {"raw": (state.params, state.buffers), "ema": state.ema}
    on_all, by_rows = eval_placement(cfg.replicas)
    placed = {w: weights[w] if cluster.count() > 1 else jax.device_put(weights[w], on_all)
              for w in names}  # with several processes the state is on the replicas already
    part = cluster.local_rows(cfg.rows)
    for b, (x, y, valid, skipped) in enumerate(loader.val_stream(src, cfg.rows, cfg.workers,
                                                                 part)):
        if met is not None:
            met("val", skipped)
        images = batches.eval_rows(b, cfg.rows, n)[0][part][valid]
        x = cluster.global_array(x, by_rows, (cfg.rows, *x.shape[1:]))  # normalised there
        for name, (params, buffers) in placed.items():
            logits = cluster.local_rows_of(cluster.run_together(eval_fn, params, buffers, x),
                                           part).astype(np.float64)
            logp = logits - logits.max(1, keepdims=True)
            logp -= np.log(np.exp(logp).sum(1, keepdims=True))
            rank = (logits > logits[np.arange(len(y)), y][:, None]).sum(1)
            sums[name] += [-(logp[np.arange(len(y)), y] * valid).sum(),
                           ((rank < 1) & valid).sum(), ((rank < 5) & valid).sum()]
            hits[name][images] = rank[valid] < 1
    metrics, correct = {}, {}
    for name in names:
        loss, top1, top5 = cluster.total(sums[name])
        low, high = interval(int(top1), n)
        metrics[name] = {"loss": float(loss) / n, "top1": float(top1) / n, "top1_low": low,
                         "top1_high": high, "top5": float(top5) / n}
        correct[name] = cluster.total(hits[name]) > 0
    return metrics, correct


def val_fingerprint(src) -> str:
    """What identifies ``src``'s val split for pairing runs image by image: a hash of its kind
    (the digits or a folder), class names and labels in order (a folder and its packed copy
    share it)."""
    h = hashlib.sha256(src.val_kind().encode())
    h.update(np.asarray(src.val_labels, np.int64).tobytes())
    return h.hexdigest()[:16]
