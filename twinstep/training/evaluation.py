"""Evaluation during training: the raw and EMA weights over the whole val split, in eval mode,
sharded over the replicas (eval-mode BN reads no batch statistics, so each row's logits are the
single device's whatever R is).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

from twinstep import dp
from twinstep.data import loader
from twinstep.processes import cluster


def eval_placement(replicas: int) -> tuple:
    """(weights, rows) shardings of a sharded evaluation: the weights on every replica, each
    replica a contiguous 1/R of the rows."""
    if replicas == 1:
        one = SingleDeviceSharding(jax.devices()[0])
        return one, one
    mesh = dp.mesh(replicas)
    return NamedSharding(mesh, dp.REPLICATED), NamedSharding(mesh, dp.BATCH)


def evaluate(src, cfg, state, eval_fn) -> dict:
    """{"raw": {loss, top1, top5}, "ema": ...} of ``state`` for the run ``cfg`` (a
    `TrainConfig`) over the whole val split, sharded over the replicas (`eval_placement`), the
    last batch padded and masked so every image counts once (an image that does not decode is
    replaced by the next, `twinstep.data.loader`). A process reads and scores its own replicas'
    rows; the sums are totalled over processes."""
    sums = {name: np.zeros(3) for name in ("raw", "ema")
            if name == "raw" or state.ema is not None}
    weights = {"raw": (state.params, state.buffers), "ema": state.ema}
    on_all, by_rows = eval_placement(cfg.replicas)
    placed = {n: weights[n] if cluster.count() > 1 else jax.device_put(weights[n], on_all)
              for n in sums}  # with several processes the state is on the replicas already
    part = cluster.local_rows(cfg.rows)
    for x, y, valid, _ in loader.val_stream(src, cfg.rows, cfg.workers, part):
        x = cluster.global_array(x, by_rows, (cfg.rows, *x.shape[1:]))  # normalised there
        for name, (params, buffers) in placed.items():
            logits = cluster.local_rows_of(cluster.run_together(eval_fn, params, buffers, x),
                                           part).astype(np.float64)
            logp = logits - logits.max(1, keepdims=True)
            logp -= np.log(np.exp(logp).sum(1, keepdims=True))
            rank = (logits > logits[np.arange(len(y)), y][:, None]).sum(1)
            sums[name] += [-(logp[np.arange(len(y)), y] * valid).sum(),
                           ((rank < 1) & valid).sum(), ((rank < 5) & valid).sum()]
    n = len(src.val_labels)
    return {name: dict(zip(("loss", "top1", "top5"), (float(v) / n for v in cluster.total(s)),
                           strict=True)) for name, s in sums.items()}

