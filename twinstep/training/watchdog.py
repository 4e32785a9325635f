"""The training loop's watchdog (docs/training.md#stalls): a thread that ends the process — one
line on stderr, `ExitStatus.INTERNAL` — when the loop makes no progress for longer than its
limit, so that a hung collective, a stuck loader or a frozen peer becomes a failure a
supervisor restarts (`twinstep launch --max-restarts`) instead of a silent wait.

The loop reports progress at each of its boundaries (`progress`: a metrics read-back, which
waits for the devices) and the thread compares the time since the last report with the limit:
``--stall-timeout`` when given, else max(STALL_FACTOR x the median time between reports,
STALL_FLOOR_S). It is armed only after the first report (the first step, a render's compile)
and is held off meanwhile by ``paused`` (the first evaluation compiles too).

With several processes each publishes (step, beat) in the runtime's key-value store every
BEAT_S; a stalled process names the processes whose step is behind its own, or whose beat
stopped (a process frozen whole).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import threading
import time

from jax._src import distributed  # the runtime's key-value store: no public API

from twinstep.data import workers
from twinstep.errors import ExitStatus

STALL_FACTOR = 10
STALL_FLOOR_S = 300.0
BEAT_S = 2.0
_KEY = "twinstep/heartbeat/"


class Watchdog:
    """``with Watchdog(timeout, process, processes) as dog:`` — ``dog.progress(step)`` at each
    boundary; ``timeout`` None: the default limit (module docstring)."""

    def __init__(self, timeout: float | None, process: int = 0, processes: int = 1):
        self.timeout, self.process, self.processes = timeout, process, processes
        self.step, self.last, self.gaps = 0, None, []
        self.paused_since, self.beats = None, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="twinstep-watchdog")

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)

    def progress(self, step: int) -> None:
        now = time.monotonic()
        if self.last is not None:
            self.gaps.append(now - self.last)
        self.step, self.last = step, now

    @contextlib.contextmanager
    def paused(self, when: bool = True):
        """Hold the watchdog off for the block when ``when`` (e.g. a first compile)."""
        if not when:
            yield
            return
        self.paused_since = time.monotonic()
        try:
            yield
        finally:  # the pause does not count as time without progress
            if self.last is not None:
                self.last += time.monotonic() - self.paused_since
            self.paused_since = None

    def limit(self) -> float:
        if self.timeout is not None:
            return self.timeout
        return max(STALL_FACTOR * statistics.median(self.gaps), STALL_FLOOR_S) if self.gaps \
            else STALL_FLOOR_S

    def _watch(self) -> None:
        seen: dict[int, tuple[int, int]] = {}
        while not self._stop.wait(min(BEAT_S, self.limit() / 4)):
            peers = self._beat()
            if self.last is None or self.paused_since is not None:
                seen = peers
                continue
            idle = time.monotonic() - self.last
            if idle > self.limit():
                self._stall(idle, peers, seen)
            seen = peers

    def _beat(self) -> dict[int, tuple[int, int]]:
        """Publish this process's (step, beat); {process: (step, beat)} of every process."""
        if self.processes == 1:
            return {}
        client = distributed.global_state.client
        self.beats += 1
        try:
            client.key_value_set(f"{_KEY}{self.process}", f"{self.step} {self.beats}",
                                 allow_overwrite=True)
            return {int(k.rsplit("/", 1)[1]): tuple(int(x) for x in v.split())
                    for k, v in client.key_value_dir_get(_KEY)}
        except Exception:  # noqa: BLE001 - a coordinator gone is reported by the runtime
            return {}

    def _stall(self, idle: float, peers: dict, seen: dict) -> None:
        behind = sorted(p for p, (step, _) in peers.items() if step < self.step)
        frozen = sorted(p for p, (_, beat) in peers.items()
                        if p != self.process and seen.get(p, (0, -1))[1] == beat)
        who = (f"; process {', '.join(map(str, behind))} reported step "
               f"{min(peers[p][0] for p in behind)} last" if behind else
               f"; process {', '.join(map(str, frozen))} stopped reporting" if frozen else "")
        print(f"twinstep train: no progress for {idle:.0f} s after step {self.step} (the "
              f"stall limit, {self.limit():.0f} s: --stall-timeout){who}", file=sys.stderr,
              flush=True)
        sys.stdout.flush()
        workers.abandon()  # what closing the loader would have done
        # the main thread may be blocked in XLA for good: nothing else ends it
        os._exit(ExitStatus.INTERNAL)
