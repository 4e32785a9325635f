"""A run's images that do not read, each named once — in the log (a warning) and in RUN_DIR's
``skipped.txt`` — and counted once: the ``skipped`` of metrics.jsonl is how many distinct images
the run has left out or replaced so far, a resumed run's too (docs/training.md#bad-images).

Those left out before the first step come from the config's screen (`twinstep.data.screen`);
those the loader meets later arrive as indices of their split, each process's own rows', and
are named at the next read-back, gathered over the processes (`Skipped.name_new`).
"""

from __future__ import annotations

import os

import numpy as np

from twinstep.data import screen
from twinstep.data.folder import SPLITS
from twinstep.processes import cluster, disk

WIDTH = 64  # images met per process and split handed over at one read-back; more wait
SHOWN = 20  # warnings at once: the rest are in skipped.txt only


class Skipped:
    """The run's images that do not read. ``splits``: the run's (train, val) as the loader reads
    them; ``left_out``: those the screen left out (`twinstep.training.config.TrainConfig`);
    ``resuming``: RUN_DIR's ``skipped.txt`` holds the run's so far. Only ``primary`` (process
    0) writes and warns."""

    def __init__(self, run_dir: str, splits, left_out, *, resuming: bool, warn, primary: bool):
        self.path = os.path.join(run_dir, screen.FILE)
        self.splits = dict(zip(SPLITS, splits, strict=True)) if splits else {}
        self.warn = warn if primary else (lambda text: None)
        self.primary = primary
        known = (screen.read(run_dir) or []) if resuming else list(left_out)
        self.named = {(b.split, b.name) for b in known}
        self.pending = {split: [] for split in SPLITS}
        if not resuming and primary:
            disk.publish({self.path: screen.text(known, header=True).encode()})
        if resuming and known:
            self.warn(f"images that do not read so far: {len(known)}, named in {self.path}")
        else:
            self._say(known)

    @property
    def count(self) -> int:
        """Distinct images left out or replaced so far."""
        return len(self.named)

    def met(self, split: str, indices) -> None:
        """Images ``indices`` of ``split`` did not decode where the loader met them."""
        self.pending[split].extend(int(i) for i in indices)

    def name_new(self) -> None:
        """Name the images met since the last call, in every process at the same step (they
        are gathered over the processes): each new one once, with its reason."""
        mine = np.full((len(SPLITS), WIDTH), -1, np.int64)
        for row, split in enumerate(SPLITS):
            seen = list(dict.fromkeys(self.pending[split]))
            mine[row, :len(seen[:WIDTH])] = seen[:WIDTH]
            self.pending[split] = seen[WIDTH:]
        everyone, new = cluster.each(mine), []
        for row, split in enumerate(SPLITS):
            for i in sorted(set(everyone[:, row].ravel().tolist()) - {-1}):
                name = self.splits[split].name(i)
                if (split, name) not in self.named:
                    self.named.add((split, name))
                    why = self.splits[split].problem(i) or "did not decode once"
                    new.append(screen.Bad(split, screen.REPLACED, why, name))
        if new and self.primary:
            with open(self.path, "a") as f:
                f.write(screen.text(new))
        self._say(new)

    def _say(self, bad: list) -> None:
        for b in bad[:SHOWN]:
            self.warn(f"{b.split} image {b.name} does not read ({b.reason}): "
                      + ("left out before the first step" if b.action == screen.LEFT_OUT
                         else "replaced by the next image of its split"))
        if len(bad) > SHOWN:
            self.warn(f"and {len(bad) - SHOWN} more images that do not read: {self.path}")
