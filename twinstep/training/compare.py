"""Training runs compared image by image (``twinstep compare``, docs/training.md#comparing-runs):
at the last evaluation step the runs share, each run's top-1 with its 95 % interval and, against
the first run, the difference with McNemar's exact test on the paired val images; and the runs'
curves overlaid in one PNG. Reads only what `twinstep train` wrote: metrics.jsonl and
correct/step_<step>.npz (`twinstep.training.run_log`).
"""

from __future__ import annotations

import os

from twinstep.errors import UsageError
from twinstep.processes import disk
from twinstep.training import run_log
from twinstep.training.stats import ALPHA, interval, mcnemar


def last_common_step(run_dirs: list[str]) -> int:
    """The last evaluation step whose per-image hits every run saved; UsageError when none."""
    steps = []
    for run in run_dirs:
        run_log.read_metrics(run)  # a RUN_DIR at all?
        saved = run_log.read_correct_steps(run)
        if not saved:
            raise UsageError(f"{run}: no per-image results (correct/); runs trained before "
                             f"twinstep saved them cannot be paired")
        steps.append(set(saved))
    common = set.intersection(*steps)
    if not common:
        raise UsageError("the runs share no evaluation step: " + "; ".join(
            f"{run} evaluated at {sorted(s)[:3]}{'...' if len(s) > 3 else ''}"
            for run, s in zip(run_dirs, steps, strict=True)))
    return max(common)


def compare(run_dirs: list[str], weights: str = "raw", step: int | None = None) -> dict:
    """{"step", "weights", "images", "runs": [{"run", "top1", "low", "high"}], "pairs":
    [{"run", "diff", "only_first", "only_run", "p"}] (each run after the first against the
    first)}. UsageError: a run without that step or weights, or evaluated on another val split
    than the first run."""
    if len(run_dirs) < 2:
        raise UsageError("compare needs at least two runs")
    step = last_common_step(run_dirs) if step is None else step
    hits, first_val = [], None
    for run in run_dirs:
        if step not in run_log.read_correct_steps(run):
            raise UsageError(f"{run}: no evaluation at step {step}")
        val, correct = run_log.read_correct(run, step)
        if weights not in correct:
            raise UsageError(f"{run}: no {weights} weights evaluated (a recipe without ema?)")
        if first_val is not None and val != first_val:
            raise UsageError(f"{run} was evaluated on another val split than {run_dirs[0]} "
                             f"(images, classes or labels differ): its images cannot be paired")
        first_val = val
        hits.append(correct[weights])
    n = len(hits[0])
    runs = []
    for run, h in zip(run_dirs, hits, strict=True):
        low, high = interval(int(h.sum()), n)
        runs.append({"run": run, "top1": float(h.mean()), "low": low, "high": high})
    pairs = []
    for run, h in zip(run_dirs[1:], hits[1:], strict=True):
        only_first, only_run, p = mcnemar(hits[0], h)
        pairs.append({"run": run, "diff": float(h.mean() - hits[0].mean()),
                      "only_first": only_first, "only_run": only_run, "p": p})
    return {"step": step, "weights": weights, "images": n, "runs": runs, "pairs": pairs}


def report(found: dict) -> str:
    """`compare`'s result as lines for a terminal: the runs lettered A, B, ... in order, each
    one after A against A."""
    letters = [chr(ord("A") + i) if i < 26 else str(i + 1) for i in range(len(found["runs"]))]
    lines = [f"step {found['step']}, {found['weights']} weights, {found['images']} val images",
             "    top-1    95% interval   run"]
    lines += [f"{x:<2}  {r['top1']:6.2%}  {r['low']:5.1%}–{r['high']:5.1%}   {r['run']}"
              for x, r in zip(letters, found["runs"], strict=True)]
    for x, q in zip(letters[1:], found["pairs"], strict=True):
        verdict = "significant" if q["p"] < ALPHA else "not significant"
        lines.append(f"{x} − A: {100 * q['diff']:+.2f} points; right only in A: "
                     f"{q['only_first']}, only in {x}: {q['only_run']}; McNemar exact p = "
                     f"{q['p']:.3g} ({verdict} at {ALPHA})")
    return "\n".join(lines)


def overlay(run_dirs: list[str], out: str, weights: str = "raw") -> str:
    """The runs' train loss and val top-1 (with its 95 % interval as a band) against the step,
    one colour per run, into the PNG ``out`` (written whole or not at all); returns its path."""
    fig = disk.png_figure(out, "--out", (11, 3.8))
    fig.subplots_adjust(left=0.06, right=0.99, bottom=0.14, top=0.88, wspace=0.18)
    ax_loss, ax_top1 = fig.subplots(1, 2)
    for run in run_dirs:
        train, evals = run_log.read_metrics(run)
        name = os.path.basename(os.path.abspath(run))
        line, = ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1.2,
                             label=name)
        points = [(r["step"], r["eval"][weights]) for r in evals if weights in r["eval"]]
        if points:
            steps = [s for s, _ in points]
            ax_top1.plot(steps, [m["top1"] for _, m in points], "o-", ms=3,
                         color=line.get_color(), label=name)
            if all("top1_low" in m for _, m in points):
                ax_top1.fill_between(steps, [m["top1_low"] for _, m in points],
                                     [m["top1_high"] for _, m in points], alpha=0.2,
                                     color=line.get_color(), lw=0)
    ax_loss.set_title("train loss")
    ax_top1.set_title(f"val top-1 ({weights}), 95% interval shaded")
    for ax in (ax_loss, ax_top1):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return disk.publish_png(fig, out)
