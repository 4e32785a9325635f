"""`twinstep train`: the recipe's tied step (`program.train_program`, the program `twinstep tie
--recipe` checks) looped over real data, with checkpoints, evaluation and logs.

A run lives in RUN_DIR: ``config.json`` (the resolved configuration), ``metrics.jsonl`` and
``tb/`` (a train record every ``log_every`` steps, an eval record at each evaluation:
`twinstep.runlog`), ``checkpoints/`` (orbax, the last ``keep``). Everything a step depends on —
parameters, global BN running statistics, optimizer state, EMA, the step count — is in the
checkpoint, once: one whole host copy (the replicated tensors read from one replica, the
optimizer state's slices gathered from all) is written by process 0 and laid out on the run's
replicas again at restore (`program.TrainProgram.place`), whatever their number. The batch, its
augmentation and the step's key are functions of (seed, step) (`twinstep.data.loader`), so a run
resumed from any checkpoint continues bit for bit as the uninterrupted run would have, with any
number of loader workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from twinstep import dp, files, hosts, program, recipes, runtime
from twinstep.data import loader
from twinstep.defaults import WARMUP_LR
from twinstep.errors import UsageError
from twinstep.nets import get_net, layers
from twinstep.ops.precision import NAMES as PRECISIONS
from twinstep.ops.precision import get_precision

# what must match for a RUN_DIR to be continued: anything else changes the trajectory (the
# number of loader workers does not, nor the topology: R and N may change at the same R N, and
# the recipe's name with N — its other fields must match, `_check_run_dir`)
RESUME_FIELDS = ("data", "res", "steps", "precision", "seed", "init_from", "randaugment",
                 "mixup", "cutmix", "artifact")
# what a render fixes, which a run with --artifact must give alike
ARTIFACT_FIELDS = ("recipe", "replicas", "batch", "res", "precision")
AUGMENT_FIELDS = ("randaugment", "mixup", "cutmix")  # the recipe's, unless given
MAX_WORKERS = 64
INIT_FORMATS = (".safetensors", ".pth", ".pt")


class NonFinite(RuntimeError):
    """The loss went NaN or infinite; the last checkpoint is intact."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What `run` trains; checks itself on construction (UsageError, one line)."""

    recipe: str
    out: str
    data: str = "digits"  # or an image folder: DIR/train/<class>/..., DIR/val/<class>/...
    replicas: int = 1
    batch: int | None = None  # per replica; None: the recipe's
    res: int = 32
    steps: int = 200
    epochs: int | None = None  # given: steps = ceil(epochs x train images / (R N k))
    eval_every: int = 50
    ckpt_every: int = 50
    keep: int = 2
    log_every: int = 10
    precision: str = "f32"
    seed: int = 0
    workers: int = 0  # loader processes (0: a background thread); results do not depend on it
    randaugment: int | None = None  # these three: None keeps the recipe's (recipes.Recipe)
    mixup: float | None = None
    cutmix: float | None = None
    init_from: str | None = None  # a timm state dict (.pth / .safetensors) to start from
    artifact: str | None = None  # a render's NAME.jaxexport to run instead of the Python step
    resume: bool = False  # insist on continuing: refuse a RUN_DIR that holds no run
    fast_compile: bool = False  # dp.FAST_COMPILE: the same numerics, compiled at -O0

    def __post_init__(self):
        if self.data != "digits" and not os.path.isdir(self.data):
            raise UsageError(f"--data {self.data}: no such directory (or 'digits', the "
                             f"embedded set)")
        if not 0 <= self.workers <= MAX_WORKERS:
            raise UsageError(f"--workers must be in [0, {MAX_WORKERS}], got {self.workers}")
        if self.init_from is not None:
            if not self.init_from.endswith(INIT_FORMATS):
                raise UsageError(f"--init-from {self.init_from}: a timm state dict "
                                 f"({', '.join(INIT_FORMATS)})")
            if not os.path.isfile(self.init_from):
                raise UsageError(f"--init-from {self.init_from}: no such file")
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
        if self.artifact is not None:
            self._check_artifact()
        if self.epochs is not None:
            if self.epochs < 1:
                raise UsageError(f"--epochs must be >= 1, got {self.epochs}")
            per_step = self.rows * recipe.accum
            object.__setattr__(self, "steps", -(-self.epochs * loader.train_size(self.data)
                                                // per_step))

    def _check_artifact(self) -> None:
        """The render's manifest (NAME.json beside it) against this run: a render fixes its
        recipe, R, N, S and precision."""
        if not self.artifact.endswith(".jaxexport") or not os.path.isfile(self.artifact):
            raise UsageError(f"--artifact {self.artifact}: a NAME.jaxexport file from "
                             f"'twinstep render'")
        try:
            with open(self.artifact[:-len(".jaxexport")] + ".json") as f:
                manifest = json.load(f)
            given = {"recipe": manifest["name"], "replicas": manifest["replicas"],
                     "batch": manifest["batch"], "res": manifest["res"],
                     "precision": manifest["precision"]}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UsageError(f"--artifact {self.artifact}: cannot read its manifest "
                             f"({type(e).__name__})") from None
        for field in ARTIFACT_FIELDS:
            if given[field] != getattr(self, field):
                raise UsageError(f"--artifact {self.artifact} was rendered with {field} = "
                                 f"{given[field]!r}, this run has {getattr(self, field)!r}")
        if self.randaugment or self.mixup or self.cutmix or self.epochs:
            raise UsageError("--artifact runs the render's schedule and the recipe's "
                             "augmentation: drop --epochs, --randaugment, --mixup, --cutmix")

    def parsed_recipe(self) -> recipes.Recipe:
        """The recipe with this run's overrides: its N, its length, a warmup of a tenth from
        timm's warmup lr. With --artifact, the rendered recipe as it is: the render holds its
        schedule."""
        if self.artifact is not None:
            return recipes.parse(self.recipe)
        try:
            r = recipes.parse(self.recipe)
            given = {f: getattr(self, f) for f in AUGMENT_FIELDS if getattr(self, f) is not None}
            return dataclasses.replace(r, batch=self.batch or r.batch, total_steps=self.steps,
                                       warmup_steps=self.steps // 10,
                                       warmup_lr=min(WARMUP_LR, r.lr), **given)
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


def _check_run_dir(cfg: TrainConfig) -> bool:
    """Whether RUN_DIR holds a run to continue; refuses one trained with other settings."""
    path = os.path.join(cfg.out, "config.json")
    if not os.path.exists(path):
        if cfg.resume:
            raise UsageError(f"--resume: {cfg.out} holds no run to continue")
        os.makedirs(cfg.out, exist_ok=True)
        return False
    with open(path) as f:
        old = json.load(f)
    new = {**dataclasses.asdict(cfg), "resolved_recipe": _as_json(
        dataclasses.asdict(cfg.parsed_recipe()))}
    # the topology may change (R x N at the same global batch: the tied step is the same
    # mathematics), so the recipe is compared field by field without N
    old_recipe, new_recipe = ({k: v for k, v in c.get("resolved_recipe", {}).items()
                               if k != "batch"} for c in (old, new))
    changed = [(f, old.get(f), new[f]) for f in RESUME_FIELDS if old.get(f) != new[f]]
    changed += [(f"recipe field {k}", old_recipe.get(k), v) for k, v in new_recipe.items()
                if old_recipe.get(k) != v]
    if changed:
        field, was, now = changed[0]
        raise UsageError(f"{cfg.out} holds a run with {field} = {was!r}, not {now!r}: use "
                         f"another --out to start a new run")
    rows = old.get("replicas", 0) * old.get("batch", 0)
    if rows != cfg.rows:
        raise UsageError(f"{cfg.out} holds a run at the global batch R N = {old.get('replicas')} x "
                         f"{old.get('batch')} = {rows}; this one is {cfg.replicas} x {cfg.batch} "
                         f"= {cfg.rows}: a run moves between topologies only at the same R N")
    return True


def _as_json(value):
    """``value`` as it reads back from config.json (tuples as lists)."""
    return json.loads(json.dumps(value))


def init_state(cfg: TrainConfig, net, prog, classes: int):
    """The step's state at step 0: timm's initialisation (zero-init last BN gammas), or
    --init-from's weights — all of them but a classifier of another width, which keeps its
    initialisation (fine-tuning to K classes, as timm resets it)."""
    from twinstep import weights

    prec = get_precision(cfg.precision)
    shapes = net.param_shapes(classes)
    params = layers.init_params(jax.random.key(cfg.seed), shapes, net.zero_init_bns(), prec.dtype)
    buffers = layers.init_buffers(shapes, prec.dtype)
    if cfg.init_from is not None:
        try:
            loaded, loaded_buffers, k = weights.to_net(net, weights.load(cfg.init_from),
                                                       prec.dtype)
        except (KeyError, ValueError, OSError) as e:
            raise UsageError(f"--init-from {cfg.init_from}: {str(e).splitlines()[0]}") from None
        head = list(shapes)[-2:] if k != classes else []
        params = {n: params[n] if n in head else jnp.asarray(loaded[n]) for n in shapes}
        buffers = {n: jnp.asarray(v) for n, v in loaded_buffers.items()}
    return prog.init(params, buffers)


def eval_placement(replicas: int) -> tuple:
    """(weights, rows) shardings of a sharded evaluation: the weights on every replica, each
    replica a contiguous 1/R of the rows (eval-mode BN reads no batch statistics, so nothing
    crosses replicas and each row's logits are the single device's)."""
    if replicas == 1:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return one, one
    mesh = dp.mesh(replicas)
    return (jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()),
            jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(dp.AXIS)))


def evaluate(src, cfg: TrainConfig, state, eval_fn) -> dict:
    """{"raw": {loss, top1, top5}, "ema": ...} over the whole val split, sharded over the
    replicas (`eval_placement`): eval-mode BN, the last batch padded and masked so every image
    counts once (an image that does not decode is replaced by the next, `twinstep.data.loader`).
    A process reads and scores its own replicas' rows; the sums are totalled over processes."""
    dtype = get_precision(cfg.precision).dtype
    sums = {name: np.zeros(3) for name in ("raw", "ema")
            if name == "raw" or state.ema is not None}
    weights = {"raw": (state.params, state.buffers), "ema": state.ema}
    on_all, by_rows = eval_placement(cfg.replicas)
    placed = {n: weights[n] if hosts.count() > 1 else jax.device_put(weights[n], on_all)
              for n in sums}  # with several processes the state is on the replicas already
    part = hosts.local_rows(cfg.rows)
    for x, y, valid, _ in loader.val_stream(src, cfg.rows, cfg.workers, part):
        x = hosts.global_array(np.asarray(x, dtype), by_rows, (cfg.rows, *x.shape[1:]))
        for name, (params, buffers) in placed.items():
            logits = hosts.local_rows_of(hosts.run_together(eval_fn, params, buffers, x),
                                         part).astype(np.float64)
            logp = logits - logits.max(1, keepdims=True)
            logp -= np.log(np.exp(logp).sum(1, keepdims=True))
            rank = (logits > logits[np.arange(len(y)), y][:, None]).sum(1)
            sums[name] += [-(logp[np.arange(len(y)), y] * valid).sum(),
                           ((rank < 1) & valid).sum(), ((rank < 5) & valid).sum()]
    n = len(src.val_labels)
    return {name: dict(zip(("loss", "top1", "top5"), (float(v) / n for v in hosts.total(s)),
                           strict=True)) for name, s in sums.items()}


def _augment(src, recipe: recipes.Recipe) -> loader.Augment:
    """The recipe's augmentation for an image folder; the digits are not augmented."""
    if isinstance(src, loader.Digits):
        return loader.Augment()
    mixing = recipe.mixup > 0 or recipe.cutmix > 0
    return loader.Augment(recipe.randaugment,
                          loader.mix.MixParams(recipe.mixup, recipe.cutmix) if mixing else None)


def run(cfg: TrainConfig, progress=None, warn=None) -> dict:
    """Train; returns the last evaluation. ``progress(step, metrics)`` is told of every step;
    ``warn(text)`` once of images that do not decode. With several processes (`twinstep.hosts`)
    every process runs this together: each loads its replicas' rows, process 0 alone writes the
    config and the logs, and all write and restore the checkpoints together."""
    import orbax.checkpoint as ocp

    recipe = cfg.parsed_recipe()
    net = get_net(recipe.net)
    src = loader.source(cfg.data, cfg.res)  # a folder is scanned (and refused) before compiling
    resuming = _check_run_dir(cfg)
    hosts.barrier("run-dir-read")  # every process has read RUN_DIR before process 0 writes
    config = {**dataclasses.asdict(cfg), "net": recipe.net, "classes": src.classes,
              "train_images": len(src.train_labels), "val_images": len(src.val_labels),
              "processes": hosts.count(), "resolved_recipe": dataclasses.asdict(recipe)}
    if hosts.is_primary():
        files.publish({os.path.join(cfg.out, "config.json"):
                       json.dumps(config, indent=1).encode()})
    prog = program.train_program(net, recipe, src.classes, cfg.replicas, cfg.precision,
                                 fast_compile=cfg.fast_compile)
    eval_fn = program.eval_program(net, cfg.precision, cfg.fast_compile)
    state = init_state(cfg, net, prog, src.classes)
    if cfg.artifact is not None:
        prog = _artifact_program(cfg, prog, src.classes)
    manager = ocp.CheckpointManager(os.path.abspath(os.path.join(cfg.out, "checkpoints")),
                                    options=ocp.CheckpointManagerOptions(max_to_keep=cfg.keep))
    if resuming and manager.latest_step() is not None:
        target = jax.tree.map(lambda a: np.empty(a.shape, a.dtype), state)
        state = jax.device_put(manager.restore(manager.latest_step(),
                                               args=ocp.args.StandardRestore(target)))
    state = prog.place(state)
    start = int(hosts.local_value(state.step))
    stream = loader.train_stream(src, _augment(src, recipe), cfg.seed, start, cfg.steps,
                                 recipe.accum, cfg.rows, get_precision(cfg.precision).dtype,
                                 cfg.workers, hosts.local_rows(cfg.rows))
    with _run_log(cfg.out, start) as log:
        try:
            last_eval = _loop(cfg, recipe, src, prog, eval_fn, state, manager, stream, log,
                              progress if hosts.is_primary() else None, warn or (lambda t: None))
        finally:
            stream.close()
            manager.wait_until_finished()
            manager.close()
    return last_eval


class _NoLog:
    """The logs of a process other than 0: nothing is written."""

    def train(self, record: dict) -> None:
        pass

    def eval(self, step: int, result: dict) -> None:
        pass


def _run_log(run_dir: str, start: int):
    """RUN_DIR's logs (`twinstep.runlog.RunLog`), written by process 0 only."""
    from twinstep.runlog import RunLog

    return RunLog(run_dir, resume_step=start) if hosts.is_primary() else (
        contextlib.nullcontext(_NoLog()))


def _batch_sharding(cfg: TrainConfig):
    """Where a step's xs and ts go: their R N rows (axis 1) over the replicas."""
    if cfg.replicas == 1:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.sharding.NamedSharding(dp.mesh(cfg.replicas), dp.MICRO_BATCH)


def _artifact_program(cfg: TrainConfig, prog, classes: int):
    """``prog`` with its step replaced by the render's deserialized one (its hashes and
    signature checked: `twinstep.renders.load`)."""
    from twinstep import renders

    try:
        exported, manifest = renders.load(cfg.artifact)
    except renders.RenderError as e:
        raise UsageError(str(e)) from None
    if manifest["classes"] != classes:
        raise UsageError(f"--artifact {cfg.artifact} was rendered for {manifest['classes']} "
                         f"classes; the data has {classes}")
    return prog._replace(step=program.artifact_program(exported, manifest, cfg.fast_compile),
                         place=lambda state: dp.replicate(state, cfg.replicas))


def _loop(cfg, recipe, src, prog, eval_fn, state, manager, stream, log, progress, warn) -> dict:
    """The steps from the state's to cfg.steps: step, log, evaluate, checkpoint."""
    import orbax.checkpoint as ocp

    start = int(state.step)
    last_eval: dict = {}
    skipped = 0
    per_step = cfg.rows * recipe.accum
    rows = _batch_sharding(cfg) if hosts.count() > 1 else None  # where each process's rows go
    t0 = time.perf_counter()  # from the end of the first step: it compiles
    for s, (xs, ts, sk) in zip(range(start, cfg.steps), stream, strict=True):
        if sk and not skipped:
            warn(f"step {s + 1}: an image that does not decode was replaced by the next one "
                 f"of its split (counted as 'skipped' in metrics.jsonl)")
        skipped += sk
        key = jax.random.fold_in(jax.random.key(cfg.seed), s)
        if rows is not None:  # this process's rows, into the global batch
            xs, ts = (hosts.global_array(a, rows, (a.shape[0], cfg.rows, *a.shape[2:]))
                      for a in (xs, ts))
        state, m = hosts.run_together(prog.step, state, xs, ts, key)
        loss = float(hosts.local_value(m["loss"]))
        if not math.isfinite(loss):
            manager.wait_until_finished()
            raise NonFinite(f"the loss is {loss} at step {s + 1}; the last checkpoint "
                            f"(step {manager.latest_step()}) is intact")
        done = s + 1
        if done == start + 1:
            t0 = time.perf_counter()
        record = {"step": done, "epoch": done * per_step / len(src.train_labels),
                  "loss": loss, "lr": float(hosts.local_value(m["lr"])), "skipped": skipped,
                  "img_per_s": (done - start - 1) * per_step
                  / max(time.perf_counter() - t0, 1e-9)}
        if done % cfg.log_every == 0 or done == cfg.steps:
            log.train({**record, "skipped": int(hosts.total([skipped])[0])})
        if done % cfg.eval_every == 0 or done == cfg.steps:
            last_eval = evaluate(src, cfg, state, eval_fn)
            log.eval(done, last_eval)
        if done % cfg.ckpt_every == 0 or done == cfg.steps:
            # one host copy: orbax took 3.3x as long over R replicated arrays (bench/checkpoint.py)
            manager.save(done, args=ocp.args.StandardSave(jax.tree.map(hosts.whole, state)))
        if progress is not None:
            progress(done, {**record, **({"eval": last_eval} if last_eval else {})})
    return last_eval or evaluate(src, cfg, state, eval_fn)
