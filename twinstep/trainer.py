"""`twinstep train`: the recipe's tied step (`program.train_program`, the program `twinstep tie
--recipe` checks) looped over real data, with checkpoints, evaluation and logs.

A run lives in RUN_DIR: ``config.json`` (the resolved configuration), ``metrics.jsonl`` (a train
line every ``log_every`` steps, an eval line at each evaluation), ``checkpoints/`` (orbax, the
last ``keep``). Everything a step depends on — parameters, global BN running statistics,
optimizer state, EMA, the step count — is in the checkpoint; the batch and the step's key are
functions of (seed, step) (`twinstep.data.batches`), so a run resumed from any checkpoint
continues bit for bit as the uninterrupted run would have.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from twinstep import dp, files, program, recipes, runtime
from twinstep.data import batches, digits
from twinstep.errors import UsageError
from twinstep.nets import get_net, layers
from twinstep.ops.precision import NAMES as PRECISIONS
from twinstep.ops.precision import get_precision

DATASETS = ("digits",)
# what must match for a RUN_DIR to be continued: anything else changes the trajectory
RESUME_FIELDS = ("recipe", "data", "replicas", "batch", "res", "steps", "precision", "seed")


class NonFinite(RuntimeError):
    """The loss went NaN or infinite; the last checkpoint is intact."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What `run` trains; checks itself on construction (UsageError, one line)."""

    recipe: str
    out: str
    data: str = "digits"
    replicas: int = 1
    batch: int | None = None  # per replica; None: the recipe's
    res: int = 32
    steps: int = 200
    eval_every: int = 50
    ckpt_every: int = 50
    keep: int = 2
    log_every: int = 10
    precision: str = "f32"
    seed: int = 0
    fast_compile: bool = False  # dp.FAST_COMPILE: the same numerics, compiled at -O0

    def __post_init__(self):
        if self.data not in DATASETS:
            raise UsageError(f"--data {self.data!r}: only the embedded {DATASETS} so far")
        if self.precision not in PRECISIONS:
            raise UsageError(f"unknown --precision {self.precision!r}; choose from "
                             f"{', '.join(PRECISIONS)}")
        for field in ("replicas", "res", "steps", "eval_every", "ckpt_every", "keep",
                      "log_every"):
            if getattr(self, field) < 1:
                raise UsageError(f"--{field.replace('_', '-')} must be >= 1, "
                                 f"got {getattr(self, field)}")
        if self.batch is not None and self.batch < 1:
            raise UsageError(f"--batch must be >= 1, got {self.batch}")
        if not 0 <= self.seed < 2**31:
            raise UsageError(f"--seed must be >= 0 and < 2^31, got {self.seed}")
        recipe = self.parsed_recipe()
        multiple = get_net(recipe.net).INPUT_MULTIPLE
        if self.res % multiple:
            raise UsageError(f"--res must be a multiple of {multiple} for {recipe.net}, "
                             f"got {self.res}")
        if recipe.dp != (self.replicas > 1) and self.replicas > 1:
            raise UsageError(f"{self.recipe} has no 'dp' token: it trains on one device; "
                             f"use a dp recipe for --replicas {self.replicas}")
        object.__setattr__(self, "batch", self.batch or recipe.batch)

    def parsed_recipe(self) -> recipes.Recipe:
        """The recipe with this run's overrides: its N, its length, a warmup of a tenth."""
        try:
            r = recipes.parse(self.recipe)
            return dataclasses.replace(r, batch=self.batch or r.batch, total_steps=self.steps,
                                       warmup_steps=self.steps // 10)
        except recipes.RecipeError as e:
            raise UsageError(str(e)) from None

    @property
    def rows(self) -> int:
        return self.replicas * self.batch


def load_state(run_dir: str, step: int | None = None):
    """A checkpoint of RUN_DIR (the latest by default) as saved — nested dicts of NumPy arrays in
    their own dtypes (float64 too, whether or not JAX has x64 on) — in any process, whatever
    devices the run had."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.path.join(run_dir, "checkpoints"))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with runtime.jax_settings(jax_enable_x64=True), ocp.CheckpointManager(
            path, item_handlers=ocp.StandardCheckpointHandler()) as m:
        step = m.latest_step() if step is None else step
        meta = m.item_metadata(step)
        target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one),
                              getattr(meta, "tree", meta))
        tree = m.restore(step, args=ocp.args.StandardRestore(target))
        return jax.tree.map(np.asarray, tree)


FORMATS = ("safetensors", "pth")


def export(run_dir: str, fmt: str = "safetensors", ema: bool = False,
           out: str | None = None) -> str:
    """Write RUN_DIR's latest weights — parameters and BN running statistics, or their EMA — as a
    timm state dict (float32, timm's names) that ``timm.create_model(TIMM_NAME, num_classes=K,
    pretrained=True, pretrained_cfg_overlay=dict(file=PATH, num_classes=K))`` loads (without K in
    the overlay timm drops a classifier whose size is not its pretrained 1000). Returns the
    path."""
    from twinstep import weights

    if fmt not in FORMATS:
        raise UsageError(f"unknown --format {fmt!r}; choose from {', '.join(FORMATS)}")
    if not os.path.isdir(os.path.join(run_dir, "checkpoints")):
        raise UsageError(f"{run_dir}: no checkpoints/ here (a RUN_DIR of 'twinstep train')")
    state = load_state(run_dir)
    if ema:
        if not state.get("ema"):
            raise UsageError(f"{run_dir}: this run has no EMA (its recipe has no 'ema' token)")
        averaged = state["ema"]
        params, buffers = averaged if isinstance(averaged, (list, tuple)) else (
            averaged["0"], averaged["1"])
    else:
        params, buffers = state["params"], state["buffers"]
    path = out or os.path.join(run_dir, f"model{'_ema' if ema else ''}.{fmt}")
    if not path.endswith("." + fmt):
        raise UsageError(f"--out {path}: a .{fmt} file name for --format {fmt}")
    files.check_writable_file(path, "--out")
    weights.save(path, {k: np.asarray(v, np.float32) for k, v in {**params, **buffers}.items()})
    return path


def _json_line(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _truncate_metrics(path: str, step: int) -> None:
    """Drop the lines a killed run wrote after the checkpoint it resumes from."""
    if os.path.exists(path):
        with open(path) as f:
            kept = [line for line in f if json.loads(line)["step"] <= step]
        files.publish({path: "".join(kept).encode()})


def _check_run_dir(cfg: TrainConfig) -> bool:
    """Whether RUN_DIR holds a run to continue; refuses one trained with other settings."""
    path = os.path.join(cfg.out, "config.json")
    if not os.path.exists(path):
        os.makedirs(cfg.out, exist_ok=True)
        return False
    with open(path) as f:
        old = json.load(f)
    for field in RESUME_FIELDS:
        if old.get(field) != getattr(cfg, field):
            raise UsageError(f"{cfg.out} holds a run with {field} = {old.get(field)!r}, not "
                             f"{getattr(cfg, field)!r}: use another --out to start a new run")
    return True


def init_state(cfg: TrainConfig, net, prog):
    """The step's state at step 0: timm's initialisation (zero-init last BN gammas)."""
    prec = get_precision(cfg.precision)
    shapes = net.param_shapes(digits.CLASSES)
    params = layers.init_params(jax.random.key(cfg.seed), shapes, net.zero_init_bns(), prec.dtype)
    return prog.init(params, layers.init_buffers(shapes, prec.dtype))


def evaluate(net, cfg: TrainConfig, state, eval_fn) -> dict:
    """{"raw": {loss, top1, top5}, "ema": ...} over the whole val split: eval-mode BN, the last
    batch padded and masked so every image counts once."""
    images, labels = digits.split("val", cfg.res)
    dtype = get_precision(cfg.precision).dtype
    out = {}
    weights = {"raw": (state.params, state.buffers)}
    if state.ema is not None:
        weights["ema"] = state.ema
    for name, (params, buffers) in weights.items():
        params, buffers = jax.device_put((params, buffers), jax.devices()[0])
        loss = top1 = top5 = 0.0
        for x, y, valid in batches.eval_batches(images, labels, cfg.rows):
            logits = np.asarray(eval_fn(params, buffers, jnp.asarray(x, dtype)), np.float64)
            logp = logits - logits.max(1, keepdims=True)
            logp -= np.log(np.exp(logp).sum(1, keepdims=True))
            rank = (logits > logits[np.arange(len(y)), y][:, None]).sum(1)
            loss += float(-(logp[np.arange(len(y)), y] * valid).sum())
            top1 += float(((rank < 1) & valid).sum())
            top5 += float(((rank < 5) & valid).sum())
        out[name] = {"loss": loss / len(labels), "top1": top1 / len(labels),
                     "top5": top5 / len(labels)}
    return out


def run(cfg: TrainConfig, progress=None) -> dict:
    """Train; returns the last evaluation. ``progress(step, metrics)`` is told of every step."""
    import orbax.checkpoint as ocp

    recipe = cfg.parsed_recipe()
    net = get_net(recipe.net)
    dtype = get_precision(cfg.precision).dtype
    resuming = _check_run_dir(cfg)
    config = {**dataclasses.asdict(cfg), "net": recipe.net,
              "resolved_recipe": dataclasses.asdict(recipe)}
    files.publish({os.path.join(cfg.out, "config.json"): json.dumps(config, indent=1).encode()})
    prog = program.train_program(net, recipe, digits.CLASSES, cfg.replicas, cfg.precision,
                                 fast_compile=cfg.fast_compile)
    eval_fn = program.eval_program(net, cfg.precision, cfg.fast_compile)
    state = dp.replicate(init_state(cfg, net, prog), cfg.replicas)
    manager = ocp.CheckpointManager(os.path.abspath(os.path.join(cfg.out, "checkpoints")),
                                    options=ocp.CheckpointManagerOptions(max_to_keep=cfg.keep))
    if resuming and manager.latest_step() is not None:
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
        state = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(target))
    images, labels = digits.split("train", cfg.res)
    metrics_path = os.path.join(cfg.out, "metrics.jsonl")
    last_eval: dict = {}
    start = int(state.step)
    _truncate_metrics(metrics_path, start)
    t0 = time.perf_counter()  # from the end of the first step: it compiles
    for s in range(start, cfg.steps):
        xs, ts = batches.train_batch(images, labels, digits.CLASSES, cfg.seed, s, recipe.accum,
                                     cfg.rows, dtype)
        key = jax.random.fold_in(jax.random.key(cfg.seed), s)
        state, m = prog.step(state, xs, ts, key)
        loss = float(m["loss"])
        if not math.isfinite(loss):
            manager.wait_until_finished()
            raise NonFinite(f"the loss is {loss} at step {s + 1}; the last checkpoint "
                            f"(step {manager.latest_step()}) is intact")
        done = s + 1
        if done == start + 1:
            t0 = time.perf_counter()
        record = {"step": done, "epoch": done * cfg.rows * recipe.accum / len(labels),
                  "loss": loss, "lr": float(m["lr"]),
                  "img_per_s": (done - start - 1) * cfg.rows * recipe.accum
                  / max(time.perf_counter() - t0, 1e-9)}
        if done % cfg.log_every == 0 or done == cfg.steps:
            _json_line(metrics_path, record)
        if done % cfg.eval_every == 0 or done == cfg.steps:
            last_eval = evaluate(net, cfg, state, eval_fn)
            _json_line(metrics_path, {"step": done, "eval": last_eval})
        if done % cfg.ckpt_every == 0 or done == cfg.steps:
            manager.save(done, args=ocp.args.StandardSave(state))
        if progress is not None:
            progress(done, {**record, **({"eval": last_eval} if last_eval else {})})
    manager.wait_until_finished()
    manager.close()
    return last_eval or evaluate(net, cfg, state, eval_fn)
