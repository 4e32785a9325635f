"""RUN_DIR/checkpoints: orbax's CheckpointManager, holding the last ``keep`` checkpoints and,
with ``keep_every`` K, every K-th step's for good (timm's checkpoint history).

A checkpoint is the whole train state once — parameters, global BN running statistics,
optimizer state, EMA, the step — as one host copy (the replicated tensors read from one
replica, the optimizer state's slices gathered from all), so it restores onto any number of
replicas (`twinstep.program.TrainProgram.place`). Every process writes and restores together;
orbax writes in a thread of its own while the next steps run, uncompressed, and publishes a
checkpoint only once it is whole (docs/training.md#checkpoints).
"""

from __future__ import annotations

import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from twinstep.processes import cluster

FOLDER = "checkpoints"


class Checkpoints:
    """The checkpoints of one run; a context manager that waits for the last write on exit."""

    def __init__(self, run_dir: str, keep: int, keep_every: int | None = None):
        self.manager = ocp.CheckpointManager(
            os.path.abspath(os.path.join(run_dir, FOLDER)), item_handlers=_handler(),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, keep_period=keep_every,
                                                 enable_async_checkpointing=True))

    def latest(self) -> int | None:
        """The step of the latest whole checkpoint (waiting for one being written)."""
        self.manager.wait_until_finished()
        return self.manager.latest_step()

    def restore(self, like):
        """The latest checkpoint as host arrays shaped as ``like`` (a state), or ``like`` itself
        when there is none."""
        step = self.manager.latest_step()
        if step is None:
            return like
        return jax.device_put(self.manager.restore(step, args=_as_numpy(like, like)))

    def save(self, step: int, state) -> None:
        """Checkpoint ``state`` at ``step``: one host copy (orbax took 2.2x as long over R
        replicated arrays; docs/training.md#checkpoints)."""
        self.manager.save(step, args=ocp.args.PyTreeSave(
            jax.tree.map(cluster.whole, state)))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def load_state(run_dir: str, step: int | None = None):
    """A checkpoint of RUN_DIR (the latest by default) as saved — nested dicts of NumPy arrays in
    their own dtypes (float64 too, whether or not JAX has x64 on) — in any process, whatever
    devices the run had."""
    path = os.path.abspath(os.path.join(run_dir, FOLDER))
    with ocp.CheckpointManager(path, item_handlers=_handler()) as m:
        step = m.latest_step() if step is None else step
        meta = m.item_metadata(step)
        return m.restore(step, args=_as_numpy(None, getattr(meta, "tree", meta)))


def _handler():
    """orbax's handler of a tree of arrays, writing without compression: zstd saved 5-21 % of
    the disk for 16-45 % more CPU time, taken from the steps and the data loader while a write
    runs (docs/training.md#checkpoints)."""
    return ocp.PyTreeCheckpointHandler(use_compression=False)


def _as_numpy(item, like):
    """orbax's restore arguments reading a checkpoint as NumPy arrays of ``like``'s dtypes
    (``like``: arrays or orbax's metadata of them), into ``item``'s tree (None: the tree as
    saved, nested dicts and lists)."""
    return ocp.args.PyTreeRestore(item, restore_args=jax.tree.map(
        lambda a: ocp.RestoreArgs(restore_type=np.ndarray, dtype=a.dtype), like))
