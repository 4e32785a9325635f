"""`twinstep train`: the recipe's tied step (`program.train_program`, the program `twinstep tie
--recipe` checks) looped over real data, with checkpoints, evaluation and logs.

`run` reads top to bottom: set-up (the recipe, the data, RUN_DIR, the programs) -> restore (the
latest checkpoint, or step 0) -> the loop (step, log, evaluate, checkpoint). What RUN_DIR holds
and why a resumed run continues bit for bit: docs/training.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time

import jax

from twinstep import dp, program, recipes
from twinstep.data import loader, sources
from twinstep.data.mix import MixParams
from twinstep.errors import UsageError
from twinstep.nets import get_net
from twinstep.processes import cluster, disk, settings
from twinstep.rendering import reader
from twinstep.training import evaluation, state_dict
from twinstep.training.checkpoint import Checkpoints
from twinstep.training.config import TrainConfig, check_run_dir
from twinstep.training.run_log import RunLog
from twinstep.training.skipped import Skipped
from twinstep.training.watchdog import Watchdog

EVAL_PHASES = ("compiling the evaluation", "evaluating")  # the first evaluation compiles


class NonFinite(RuntimeError):
    """The loss went NaN or infinite; the last checkpoint is intact."""


def run(cfg: TrainConfig, progress=None, warn=None) -> dict:
    """Train; returns the last evaluation. ``progress(step, metrics)`` is told of every step and
    of each evaluation as it starts (metrics["phase"]); ``warn(text)`` of each image that does
    not read, once (`twinstep.training.skipped`). With several processes
    (`twinstep.processes.cluster`) all run this together: each loads its replicas' rows,
    process 0 alone writes the config and logs; all checkpoint."""
    # --- set-up: the recipe, the data (a folder is scanned, and refused, before compiling),
    # RUN_DIR (read by every process before process 0 writes it), the programs
    recipe = cfg.parsed_recipe()
    net = get_net(recipe.net)
    src = sources.get_source(cfg.data, cfg.res, cfg.loader, cfg.eval_res, splits=cfg.splits)
    resuming = check_run_dir(cfg)
    cluster.barrier("run-dir-read")
    # skipped.txt before config.json: a RUN_DIR with a config.json has the screen's list
    bad = Skipped(cfg.out, cfg.splits, cfg.left_out, resuming=resuming,
                  warn=warn or (lambda text: None), primary=cluster.is_primary())
    if cluster.is_primary():
        config = {**dataclasses.asdict(cfg), "chosen": cfg.chosen, "net": recipe.net,
                  "classes": src.classes, "class_names": (
                      list(cfg.splits[0].classes) if cfg.splits else
                      [str(k) for k in range(src.classes)]),
                  "train_images": len(src.train_labels), "val_images": len(src.val_labels),
                  "processes": cluster.count(), "resolved_recipe": dataclasses.asdict(recipe)}
        disk.publish({os.path.join(cfg.out, "config.json"): json.dumps(config, indent=1).encode()})
    augment = _augment(src, recipe)
    prog, eval_fn, prepare = _programs(cfg, net, recipe, src, augment)

    # --- restore: the latest checkpoint, else step 0 (timm's initialisation or --init-from)
    checkpoints = Checkpoints(cfg.out, cfg.keep, cfg.keep_every)
    state, start = _restored(state_dict.initial_state(cfg, net, prog, src.classes),
                             checkpoints, prog, resuming)
    _say_finished(cfg, start)

    # --- the loop: step, log, evaluate, checkpoint. The host waits for the devices only at a
    # boundary (the first step; a log, eval or checkpoint step; the last): the next batch goes
    # to them while a step runs, and the metrics are read back at the next boundary, which
    # stops at the first non-finite loss before anything of it is written.
    per_step = cfg.rows * recipe.accum  # images per optimizer step
    stream = loader.train_stream(src, augment, seed=cfg.seed, start=start, stop=cfg.steps,
                                 micro=recipe.accum, rows=cfg.rows, workers=cfg.workers,
                                 part=cluster.local_rows(cfg.rows))
    say = progress if progress and cluster.is_primary() else (lambda step, metrics: None)
    last_eval, pending, t0 = {}, [], time.perf_counter()
    record = dict(step=start, epoch=0.0, loss=math.nan, lr=math.nan, skipped=0, img_per_s=0.0)
    dog = Watchdog(cfg.stall_timeout, jax.process_index(), cluster.count())
    with _run_log(cfg.out, start) as log, checkpoints, contextlib.closing(stream), dog:
        for s, (batch, sk) in zip(range(start, cfg.steps), _ahead(stream, cfg), strict=True):
            done = s + 1
            bad.met("train", sk)
            key = jax.random.fold_in(jax.random.key(cfg.seed), s)
            xs, ts = cluster.run_together(prepare, *batch)
            state, m = cluster.run_together(prog.step, state, xs, ts, key)
            pending.append((done, m))
            record |= {"step": done, "epoch": done * per_step / len(src.train_labels)}
            logs, evals, saves = (done % k == 0 or done == cfg.steps
                                  for k in (cfg.log_every, cfg.eval_every, cfg.ckpt_every))
            if not (logs or evals or saves or done == start + 1):
                say(done, dict(record))
                continue
            loss = _read_back(pending, checkpoints)
            bad.name_new()  # the images met since the last read-back, gathered
            dog.progress(done)  # the devices have caught up: armed from the first step on
            if done == start + 1:
                t0 = time.perf_counter()  # img/s from the first step's end
            record |= {"loss": loss, "lr": float(cluster.local_value(m["lr"])),
                       "skipped": bad.count, "img_per_s": (done - start - 1) * per_step
                       / max(time.perf_counter() - t0, 1e-9)}
            if logs or done == 1:  # the first step too: the warmup's start in the curves
                log.train(record)
            if evals:
                say(done, {**record, "phase": EVAL_PHASES[bool(last_eval)]})
                with dog.paused(not last_eval):  # the first evaluation compiles
                    last_eval, correct = evaluation.evaluate(src, cfg, state, eval_fn,
                                                             met=bad.met)
                bad.name_new()
                log.eval(done, last_eval)
                log.correct(done, correct, evaluation.val_fingerprint(src))
            if saves:
                checkpoints.save(done, state)
            say(done, {**record, **({"eval": last_eval} if last_eval else {})})
        return last_eval or evaluation.evaluate(src, cfg, state, eval_fn)[0]


def _restored(state, checkpoints: Checkpoints, prog, resuming: bool) -> tuple:
    """(the state the run starts from, placed on the replicas; its step): the latest checkpoint
    when continuing, else ``state``. A continued run says which step, in every process, read
    from the state it placed, not from the checkpoint folder (the resume tests hold it)."""
    if resuming:
        state = checkpoints.restore(state)
    state = prog.place(state)
    start = int(cluster.local_value(state.step))
    if resuming:
        print(f"twinstep train: resumed from step {start}" + (
            "" if start else " (no checkpoint yet: from the start)"), flush=True)
    return state, start


def _say_finished(cfg: TrainConfig, start: int) -> None:
    """A run continued at its last step has nothing to run: it says so, once."""
    if start == cfg.steps and cluster.is_primary():
        print(f"twinstep train: {cfg.out} already finished at step {start}; its last weights "
              f"are evaluated again (a longer run: another --out, or --init-from its "
              f"weights)", flush=True)


def _read_back(pending: list, checkpoints: Checkpoints) -> float:
    """The losses of the steps run since the last read-back ([(step, metrics)], emptied), which
    waits for the devices; NonFinite at the first that is not finite. Returns the last, once
    the heap memory freed meanwhile is handed back (docs/speed.md#memory)."""
    for at, metrics in pending:
        loss = float(cluster.local_value(metrics["loss"]))
        if not math.isfinite(loss):
            raise NonFinite(f"the loss is {loss} at step {at}; the last checkpoint (step "
                            f"{checkpoints.latest()}) is intact")
    pending.clear()
    settings.release_freed_memory()  # the compile's, and the step threads' arenas
    return loss


def _ahead(stream, cfg: TrainConfig):
    """The stream's batches (`twinstep.data.loader.Batch`) as ((xs, labels, mix, box, plan) on
    the replicas, images skipped), each put one step before it runs: batch s + 1 while step s
    runs. With several processes each puts its own rows into the global batch."""
    rows, everywhere = _batch_sharding(cfg)

    def place(a):
        if cluster.count() > 1:
            return cluster.global_array(a, rows, (a.shape[0], cfg.rows, *a.shape[2:]))
        return jax.device_put(a, rows)

    placed = None
    for xs, labels, mix, box, plan, skipped in stream:  # a Batch (a plain tuple from workers)
        ahead = (place(xs), place(labels), *cluster.placed((mix, box), everywhere),
                 place(plan)), skipped
        if placed is not None:
            yield placed
        placed = ahead
    if placed is not None:
        yield placed


def _augment(src: sources.Source, recipe: recipes.Recipe) -> sources.Augment:
    """The recipe's augmentation where the source augments (not the digits)."""
    if not src.augments:
        return sources.Augment()
    mixing = recipe.mixup > 0 or recipe.cutmix > 0
    return sources.Augment(recipe.randaugment,
                           MixParams(recipe.mixup, recipe.cutmix) if mixing else None)


class _NoLog:
    """The logs of a process other than 0: nothing is written."""

    def train(self, record: dict) -> None:
        pass

    def eval(self, step: int, result: dict) -> None:
        pass

    def correct(self, step: int, correct: dict, val: str) -> None:
        pass


def _run_log(run_dir: str, start: int):
    """RUN_DIR's logs (`twinstep.training.run_log.RunLog`), written by process 0 only."""
    if cluster.is_primary():
        return RunLog(run_dir, resume_step=start)
    return contextlib.nullcontext(_NoLog())


def _batch_sharding(cfg: TrainConfig):
    """(where a step's rows go — their R N rows, axis 1, over the replicas —, where what every
    replica reads goes)."""
    if cfg.replicas == 1:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return one, one
    mesh = dp.mesh(cfg.replicas)
    return (jax.sharding.NamedSharding(mesh, dp.MICRO_BATCH),
            jax.sharding.NamedSharding(mesh, dp.REPLICATED))


def _programs(cfg: TrainConfig, net, recipe, src, augment) -> tuple:
    """(the train program, the eval program, the prepare program); the train step a render's or
    compiled now, last, before the state and data exist (the run's peak)."""
    setup, fast = cfg.setup, cfg.fast_compile
    prog = program.train_program(net, recipe, setup, classes=src.classes, fast_compile=fast)
    eval_fn = program.eval_program(net, setup, fast_compile=fast)
    prepare = program.prepare_program(src.classes, setup, fast_compile=fast,
                                      layout=src.layout(augment))
    if cfg.render:
        prog = _render_program(cfg, prog, src.classes)
    else:
        prog = _compiled_step(prog, setup, micro=(recipe.accum, cfg.rows), res=cfg.res,
                              classes=src.classes)
    return prog, eval_fn, prepare


def _compiled_step(prog, setup, *, micro: tuple[int, int], res: int, classes: int):
    """``prog`` with its step compiled ahead of time (`program.compile_step`), then the freed
    compile memory handed back: the compile peaks on its own, not on top of a run under way
    (docs/speed.md#memory)."""
    compiled = program.compile_step(prog, setup, micro=micro, res=res, classes=classes)
    settings.release_freed_memory()
    return prog._replace(step=compiled)


def _render_program(cfg: TrainConfig, prog, classes: int):
    """``prog`` with its step replaced by the render's (--render; its hashes and signature
    checked by `twinstep.rendering.reader.load`)."""
    exported, manifest = reader.load(cfg.render)  # RenderError: a UsageError
    if manifest["classes"] != classes:
        raise UsageError(f"--render {cfg.render} was rendered for {manifest['classes']} "
                         f"classes; the data has {classes}")
    return prog._replace(step=reader.step(exported, manifest, cfg.fast_compile),
                         place=lambda state: dp.replicate(state, cfg.replicas))
