"""A training run's logs in RUN_DIR: ``metrics.jsonl`` (one JSON record a line) and TensorBoard
event files under ``tb/``, written side by side by `RunLog`; `read_metrics` reads the records back
and `plot` draws them into a PNG.

Records. A train record is ``{"step": int, "epoch", "loss", "lr", "img_per_s": float,
"skipped": int}``; an eval record ``{"step": int, "eval": {"raw": {"loss", "top1", "top1_low",
"top1_high", "top5"}, "ema": {...}}}`` ("ema" only with EMA; top1_low / top1_high: top-1's 95 %
interval). In TensorBoard they are the scalars ``train/<field>`` and ``eval/<weights>/<metric>``
at global step = the record's step. Beside each eval record, ``correct/step_<step>.npz`` holds
which val images the evaluation got right (top-1), for pairing runs (`twinstep compare`).

Kills. Each record reaches the operating system before `RunLog.train` / `RunLog.eval` return,
as one JSON line (one ``write``) and one TFRecord holding all its scalars, so a process killed
later loses nothing it logged. A kill *during* a write can still leave a torn last line: readers
skip a final line without its newline, and a resumed `RunLog` rewrites the file without it.

Resuming from the checkpoint at step T: the records past T belong to the killed attempt, and the
resumed run writes its own. metrics.jsonl is rewritten (atomically) to the records with
step <= T. Event files are append-only, so instead each `RunLog` starts its own event file with
TensorBoard's purge marker, the ``SessionLog.START`` event at step T + 1 that tensorboardX's
``SummaryWriter(purge_step=T + 1)`` writes: TensorBoard's Python reader then drops every point at
step >= T + 1 read before it. TensorBoard's default reader (the Rust data server) ignores the
marker but drops a tag's points at steps >= s whenever a point at step s arrives, so there the
stale points go as the resumed run reaches their steps again.

The events go through tensorboardX's synchronous ``EventsWriter``, not ``SummaryWriter``: that
one queues events to a thread which flushes every ``flush_secs`` (its ``flush()`` does not wait
for the queue), so a kill could lose points at steps <= T that the resumed run never rewrites.

``import twinstep.training.run_log`` imports only the standard library: tensorboardX is imported by
`RunLog`, matplotlib by `plot`.
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
import time

from twinstep.errors import UsageError
from twinstep.processes import disk

METRICS = "metrics.jsonl"
TB = "tb"
CORRECT = "correct"  # each evaluation's per-image top-1 hits: correct/step_<step, 8 digits>.npz
CURVES = "curves.png"


def _import_tensorboardx():
    """The tensorboardX package, imported without torch: tensorboardX's writer imports torch
    when it is installed (only to recognise torch tensors, which twinstep never logs), 2.6 s
    on this machine, and twinstep's product code never loads torch (it is a test oracle here)."""
    # lazy: tensorboardX is imported under this sys.modules patch, and only by a RunLog (the
    # module docstring: this module imports only the standard library)
    if "tensorboardX" not in sys.modules and "torch" not in sys.modules:
        sys.modules["torch"] = None  # `import torch` raises ImportError, which it tolerates
        try:
            import tensorboardX
        finally:
            del sys.modules["torch"]
    import tensorboardX

    return tensorboardX


def _scalars(prefix: str, tree: dict) -> dict[str, float]:
    """{"prefix/key/subkey": float} for every int or float leaf of a nested dict; "step",
    booleans and anything non-numeric are left out."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_scalars(f"{prefix}/{key}", value))
        elif isinstance(value, int | float) and not isinstance(value, bool) and key != "step":
            out[f"{prefix}/{key}"] = float(value)
    return out


def _parse(path: str, data: bytes) -> list[tuple[bytes, dict]]:
    """[(line with its newline, record)] for the whole lines of metrics.jsonl's bytes. A final
    line without its newline was cut short by a kill mid-write and is skipped; any other line
    that is not a record with an integer "step" is damage we did not cause: UsageError."""
    lines = data.split(b"\n")
    out = []
    for number, line in enumerate(lines[:-1], 1):  # lines[-1]: b"" or the torn tail
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not (isinstance(record, dict) and type(record.get("step")) is int):
            raise UsageError(f"{path} line {number}: not a metrics record: {line[:60]!r}")
        out.append((line + b"\n", record))
    return out


def _truncate(path: str, step: int) -> None:
    """Keep metrics.jsonl's records with step <= ``step`` (and drop a torn last line): the
    file is replaced whole, so a kill meanwhile leaves the old file or the new, not a mix."""
    if not os.path.exists(path):
        return
    with open(path, "rb") as f:
        data = f.read()
    kept = b"".join(line for line, record in _parse(path, data) if record["step"] <= step)
    if kept != data:
        disk.publish({path: kept})


def _correct_path(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, CORRECT, f"step_{step:08d}.npz")


def _drop_correct_after(run_dir: str, step: int) -> None:
    """Remove the per-image hits a killed attempt saved past ``step`` (the resumed run saves
    its own)."""
    for at in read_correct_steps(run_dir):
        if at > step:
            os.unlink(_correct_path(run_dir, at))


def read_correct_steps(run_dir: str) -> list[int]:
    """The steps whose per-image hits RUN_DIR holds (`RunLog.correct`), ascending."""
    folder = os.path.join(run_dir, CORRECT)
    if not os.path.isdir(folder):
        return []
    return sorted(int(name[5:13]) for name in os.listdir(folder)
                  if name.startswith("step_") and name.endswith(".npz") and len(name) == 17)


def read_correct(run_dir: str, step: int) -> tuple[str, dict]:
    """(the val split's fingerprint, {"raw": bool [n], "ema": ...}) of evaluation ``step``."""
    import numpy as np  # lazy: this module imports only the standard library (its docstring)

    with np.load(_correct_path(run_dir, step)) as f:
        return str(f["val"]), {k: f[k] for k in f.files if k != "val"}


class RunLog:
    """RUN_DIR's metrics.jsonl and TensorBoard event files (``RUN_DIR/tb``), written together.

    ``resume_step``: the step of the checkpoint the run continues from; None (or 0) for a run
    from scratch. Records a previous attempt wrote past it are dropped (metrics.jsonl) or purged
    (TensorBoard) — for a run from scratch, all of them. One `RunLog` at a time per RUN_DIR;
    use it as a context manager or `close` it.
    """

    def __init__(self, run_dir: str, resume_step: int | None = None):
        start = resume_step or 0
        if start < 0:
            raise ValueError(f"resume_step must be >= 0, got {resume_step}")
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, METRICS)
        os.makedirs(run_dir, exist_ok=True)
        _truncate(self.path, start)
        _drop_correct_after(run_dir, start)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        self._events = None
        try:
            self._open_events(os.path.join(run_dir, TB), start + 1)
        except BaseException:
            os.close(self._fd)
            raise

    def _open_events(self, tb_dir: str, purge_step: int) -> None:
        _import_tensorboardx()  # lazy, below: only after torch is hidden from tensorboardX
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.proto.summary_pb2 import Summary

        self._event, self._summary = Event, Summary
        os.makedirs(tb_dir, exist_ok=True)
        # A new file per attempt, named events.out.tfevents.<unix second>.<host><suffix>: the
        # readers take a run's files in name order, and two attempts within one second must
        # neither share a name (tensorboardX opens with "wb", which would erase the first) nor
        # sort out of order, hence the attempt number.
        attempt = sum("tfevents" in name for name in os.listdir(tb_dir))
        self._events = EventsWriter(os.path.join(tb_dir, "events"), f".{attempt:06d}")
        # Written for a run from scratch too (at step 1): TensorBoard's Python reader takes the
        # first START it sees for the run's beginning and purges only at later ones.
        self._events.write_event(Event(wall_time=time.time(), step=purge_step,
                                       session_log=SessionLog(status=SessionLog.START)))
        self._events.flush()

    def _append(self, record: dict, scalars: dict[str, float]) -> None:
        if self._fd is None:
            raise ValueError(f"RunLog for {self.run_dir} is closed")
        step = record.get("step")
        if type(step) is not int:
            raise ValueError(f"a record's step must be an int, got {step!r}")
        line = (json.dumps(record) + "\n").encode()
        size = os.fstat(self._fd).st_size
        try:
            done = 0
            while done < len(line):  # os.write may write part (a full disk, a signal)
                done += os.write(self._fd, line[done:])
        except BaseException:
            os.ftruncate(self._fd, size)  # no partial line for the next append to extend
            raise
        # one event per record, simple_value (float32, TensorBoard's scalar type) per scalar:
        # a kill leaves all of the record's scalars or none
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=value)
                                       for tag, value in scalars.items()])
        self._events.write_event(self._event(wall_time=time.time(), step=step, summary=summary))
        self._events.flush()  # to the OS, and fsync (~4 ms here): a kill loses nothing

    def train(self, record: dict) -> None:
        """Log a train record {"step": int, "epoch", "loss", "lr", "img_per_s": float}: its
        JSON line, and its numbers as TensorBoard scalars train/<field> at global step
        record["step"]."""
        self._append(record, _scalars("train", record))

    def eval(self, step: int, metrics: dict) -> None:
        """Log an evaluation {"raw": {"loss", "top1", ...: float}, "ema": {...}} at ``step``:
        the JSON line {"step": step, "eval": metrics}, and the scalars eval/raw/top1, ..."""
        self._append({"step": step, "eval": metrics}, _scalars("eval", metrics))

    def correct(self, step: int, correct: dict, val: str) -> None:
        """Save evaluation ``step``'s per-image top-1 hits {"raw": bool [n], "ema": ...} as
        RUN_DIR/correct/step_<step>.npz beside ``val``, the val split's fingerprint
        (`twinstep.training.evaluation.val_fingerprint`); written whole or not at all."""
        import numpy as np  # lazy: this module imports only the standard library (its docstring)

        os.makedirs(os.path.join(self.run_dir, CORRECT), exist_ok=True)
        npz = io.BytesIO()
        np.savez_compressed(npz, val=np.array(val), **{k: np.asarray(v, bool)
                                                       for k, v in correct.items()})
        disk.publish({_correct_path(self.run_dir, step): npz.getvalue()})

    def close(self) -> None:
        """Flush both logs to disk and close them; closing again does nothing."""
        if self._events is not None:
            self._events.close()  # flushes and fsyncs
            self._events = None
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(run_dir: str) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) of RUN_DIR/metrics.jsonl, each list in file (= step) order;
    a torn last line is skipped. UsageError when RUN_DIR has no metrics.jsonl."""
    path = os.path.join(run_dir, METRICS)
    if not os.path.isfile(path):
        raise UsageError(f"{run_dir}: no {METRICS} here (not a `twinstep train` run directory?)")
    with open(path, "rb") as f:
        records = [record for _, record in _parse(path, f.read())]
    return ([r for r in records if "eval" not in r], [r for r in records if "eval" in r])


def _run_config(run_dir: str) -> dict:
    """RUN_DIR's config.json ({} where it has none: only its metrics are drawn)."""
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _schedule(run: dict):
    """(steps, lr) of the run's whole schedule — the recipe's, as the optimizer steps it,
    evaluated in NumPy — or None for a config that does not hold one."""
    import numpy as np  # lazy: the module docstring

    from twinstep import optim, recipes

    try:
        recipe = recipes.Recipe(**run["resolved_recipe"])
        steps = np.arange(1, run["steps"] + 1)
        return steps, optim.recipe_schedule(recipe, xp=np)(steps - 1)  # step s runs lr(s - 1)
    except (KeyError, TypeError, ValueError):
        return None


def plot(run_dir: str, out: str | None = None) -> str:
    """Draw RUN_DIR's curves — train loss, learning rate (as logged, over the recipe's whole
    schedule), eval top-1
    (raw, and EMA when the run has it; 0 to 1) against the step, 0 to the run's last, on one
    axis — into a PNG at ``out`` (default RUN_DIR/curves.png), written
    whole or not at all; returns its path. UsageError when there is nothing to draw."""
    train, evals = read_metrics(run_dir)
    if not train and not evals:
        raise UsageError(f"{os.path.join(run_dir, METRICS)}: no records yet")
    path = out if out is not None else os.path.join(run_dir, CURVES)
    fig = disk.png_figure(path, "--out", (13, 3.8))
    # fixed margins: a layout engine would draw the figure twice (~2x the time)
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.14, top=0.84, wspace=0.22)
    ax_loss, ax_lr, ax_top1 = fig.subplots(1, 3, sharex=True)  # one step axis: the run's
    steps = [r["step"] for r in train]
    for ax, key, title in ((ax_loss, "loss", "train loss"), (ax_lr, "lr", "learning rate")):
        ax.plot(steps, [r.get(key, math.nan) for r in train], ".-" if len(steps) < 50 else "-",
                lw=1.2, ms=3)
        ax.set_title(title)
    run = _run_config(run_dir)
    if (schedule := _schedule(run)) is not None:  # every step's lr: the warmup drawn whole
        ax_lr.plot(*schedule, lw=0.8, color="0.6", zorder=0, label="schedule")
        ax_lr.legend(["logged", "schedule"], fontsize=8)
    last = max([run.get("steps") or 0] + steps + [r["step"] for r in evals])
    ax_loss.set_xlim(0, max(last, 1))
    ax_top1.set_ylim(0, 1)
    for name, style in (("raw", "o-"), ("ema", "s--")):
        points = [(r["step"], r["eval"][name]["top1"]) for r in evals if name in r["eval"]]
        if points:
            ax_top1.plot(*zip(*points, strict=True), style, ms=4, label=name)
    if evals:
        ax_top1.legend()
    else:
        ax_top1.text(0.5, 0.5, "no evaluation yet", ha="center", va="center",
                     transform=ax_top1.transAxes)
    ax_top1.set_title("eval top-1 (fraction of val images)")
    for ax in (ax_loss, ax_lr, ax_top1):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(os.path.basename(os.path.abspath(run_dir)))
    return disk.publish_png(fig, path)
