"""`twinstep train`'s configuration: `TrainConfig` checks itself on construction (UsageError,
one line, before anything compiles), and `check_run_dir` decides whether RUN_DIR holds a run to
continue (docs/training.md#resuming).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

from twinstep import program, recipes
from twinstep.collectives import CONTROLS, GRADIENT_ONLY_CONTROLS
from twinstep.data import screen, sources
from twinstep.defaults import WARMUP_LR
from twinstep.errors import UsageError
from twinstep.nets import get_net
from twinstep.ops.precision import NAMES as PRECISIONS
from twinstep.rendering import reader

# what must match for a RUN_DIR to be continued: anything else changes the trajectory (the
# number of loader workers does not, nor the topology: R and N may change at the same R N, and
# the recipe's name with N — its other fields must match, `check_run_dir`)
RESUME_FIELDS = ("data", "val_split", "res", "steps", "precision", "seed", "init_from",
                 "randaugment", "mixup", "cutmix", "render", "loader", "control")
# what a render fixes, which a run with --render must give alike
RENDER_FIELDS = ("recipe", "replicas", "batch", "res", "precision")
AUGMENT_FIELDS = ("randaugment", "mixup", "cutmix")  # the recipe's, unless given
MAX_WORKERS = 64
# the digits' defaults (a smoke run); an image folder takes the recipe's (`TrainConfig.chosen`)
DIGITS_RES = 32
SMOKE_STEPS = 200
INIT_FORMATS = (".safetensors", ".pth", ".pt")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What `twinstep.training.loop.run` trains; checks and resolves itself on construction
    (UsageError, one line): the recipe parsed once, with this run's overrides
    (`parsed_recipe`), the data's splits opened once (``splits``, None for the digits), and
    where each default came from (``chosen``)."""

    recipe: str
    out: str
    _: dataclasses.KW_ONLY  # the rest by name
    data: str = "digits"  # or an image folder: DIR/train/<class>/..., DIR/val/<class>/...
    val_split: float | None = None  # a folder with train/ only: hold out this share as val
    check_images: str = screen.DEFAULT_CHECK  # screen.CHECKS: read before the first step
    replicas: int = 1
    batch: int | None = None  # per replica; None: the recipe's
    res: int | None = None  # None: DIGITS_RES on the digits, else the recipe's train res
    eval_res: int | None = None  # None: res on the digits, else the recipe's eval res
    steps: int | None = None  # None: the recipe's epochs on a folder (a preset's), else SMOKE_STEPS
    epochs: int | None = None  # given: steps = ceil(epochs x train images / (R N k))
    eval_every: int = 50
    ckpt_every: int = 50
    keep: int = 2
    keep_every: int | None = None  # also keep every K-th step's checkpoint for good
    log_every: int = 10
    precision: str | None = None  # None: bf16 with the recipe's bf16 token, else f32
    seed: int = 0
    workers: int = 0  # loader processes (0: a background thread); results do not depend on it
    loader: str = "pillow"  # or "device" (sources.LOADERS): who decodes and augments a folder
    randaugment: int | None = None  # these three: None keeps the recipe's (recipes.Recipe)
    mixup: float | None = None
    cutmix: float | None = None
    init_from: str | None = None  # a timm state dict (.pth / .safetensors) to start from
    render: str | None = None  # a render's NAME.jaxexport to run instead of the Python step
    resume: bool = False  # insist on continuing: refuse a RUN_DIR that holds no run
    fast_compile: bool = False  # dp.FAST_COMPILE: the same numerics, compiled at -O0
    stall_timeout: float | None = None  # s without progress that end the run; None: watchdog's
    control: str = "none"  # a negative control (twinstep.collectives.CONTROLS): a broken step

    def __post_init__(self):
        object.__setattr__(self, "data", sources.resolve(self.data))
        sources.check(self.data, self.loader)
        base = recipes.parse(self.recipe)
        if not 0 <= self.workers <= MAX_WORKERS:
            raise UsageError(f"--workers must be in [0, {MAX_WORKERS}], got {self.workers}")
        if self.stall_timeout is not None and not 1 <= self.stall_timeout <= 86400:
            raise UsageError(f"--stall-timeout must be in [1, 86400] s, got {self.stall_timeout}")
        if self.init_from is not None:
            if not self.init_from.endswith(INIT_FORMATS):
                raise UsageError(f"--init-from {self.init_from}: a timm state dict "
                                 f"({', '.join(INIT_FORMATS)})")
            if not os.path.isfile(self.init_from):
                raise UsageError(f"--init-from {self.init_from}: no such file")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise UsageError(f"unknown --precision {self.precision!r}; choose from "
                             f"{', '.join(PRECISIONS)}")
        for field in ("replicas", "batch", "res", "eval_res", "steps", "epochs", "eval_every",
                      "ckpt_every", "keep", "log_every"):
            if getattr(self, field) is not None and getattr(self, field) < 1:
                raise UsageError(f"--{field.replace('_', '-')} must be >= 1, "
                                 f"got {getattr(self, field)}")
        if self.keep_every is not None and (self.keep_every < 1
                                            or self.keep_every % self.ckpt_every):
            raise UsageError(f"--keep-every must be a multiple of --ckpt-every "
                             f"({self.ckpt_every}), got {self.keep_every}")
        if not 0 <= self.seed < 2**31:
            raise UsageError(f"--seed must be >= 0 and < 2^31, got {self.seed}")
        self._check_control()
        self._open_splits()
        self._choose_defaults(base)
        object.__setattr__(self, "_recipe", self._resolve(base))
        recipe = self.parsed_recipe()
        multiple = get_net(recipe.net).INPUT_MULTIPLE
        for field in ("res", "eval_res"):
            if getattr(self, field) % multiple:
                raise UsageError(f"--{field.replace('_', '-')} must be a multiple of {multiple} "
                                 f"for {recipe.net}, got {getattr(self, field)}")
        if recipe.dp != (self.replicas > 1) and self.replicas > 1:
            raise UsageError(f"{self.recipe} has no 'dp' token: it trains on one device; "
                             f"use a dp recipe for --replicas {self.replicas}")
        if self.render is not None:
            self._check_render()

    def _open_splits(self) -> None:
        """``splits``: the data's, less the images that do not read (``left_out``): screened now
        (--check-images), or as the run in RUN_DIR left them out when it started."""
        if self.val_split is not None and not 0 < self.val_split < 1:
            raise UsageError(f"--val-split must be a fraction in (0, 1), e.g. 0.1, got "
                             f"{self.val_split}")
        if self.check_images not in screen.CHECKS:
            raise UsageError(f"unknown --check-images {self.check_images!r}; choose from "
                             f"{', '.join(screen.CHECKS)}")
        splits = sources.open_splits(self.data, self.val_split)
        known = (screen.read(self.out)
                 if os.path.exists(os.path.join(self.out, "config.json")) else None)
        if splits is None:
            left_out = []
        elif known is None:
            splits, left_out = screen.screen(splits, self.check_images)
        else:
            left_out = [b for b in known if b.action == screen.LEFT_OUT]
            splits = screen.without(splits, left_out)
        object.__setattr__(self, "splits", splits)
        object.__setattr__(self, "left_out", tuple(left_out))

    def _check_control(self) -> None:
        """--control: a whole step's negative control, on the Python step of R > 1 replicas."""
        if self.control not in CONTROLS:
            raise UsageError(f"unknown --control {self.control!r}; choose from "
                             f"{', '.join(CONTROLS)}")
        if self.control == "none":
            return
        if self.replicas == 1:
            raise UsageError(f"--control {self.control} breaks a collective; R = 1 has none")
        if self.control in GRADIENT_ONLY_CONTROLS:
            raise UsageError(f"--control {self.control} leaves each replica its own running "
                             f"statistics, which a whole step's replicated state cannot hold")
        if self.render is not None:
            raise UsageError("--control breaks the Python step; a render carries its own "
                             "('twinstep render --control')")

    def _choose_defaults(self, r: recipes.Recipe) -> None:
        """Fill in what was not given (docs/training.md#defaults): on the digits their small
        defaults; on an image folder the recipe's train and eval resolutions — its eval
        resolution only at its own train resolution — and a preset's epochs, else SMOKE_STEPS
        steps; N the recipe's; bf16 with its bf16 token, else f32. ``chosen``: {field: where
        its value came from}."""
        recipe_s, train_s = "the recipe's", "the train res"
        if self.data == "digits":
            picks = {"res": (DIGITS_RES, "the digits' default"),
                     "eval_res": (self.res or DIGITS_RES, train_s)}
        else:
            picks = {"res": (r.train_res, recipe_s),
                     "eval_res": (r.test_res, recipe_s) if self.res in (None, r.train_res)
                     else (self.res, train_s)}
            if self.steps is None and r.epochs is not None:
                picks["epochs"] = (r.epochs, recipe_s)
        picks["batch"] = (r.batch, recipe_s)
        picks["precision"] = ("bf16", recipe_s) if r.bf16 else ("f32", "the default")
        chosen = {}
        for field, (value, why) in picks.items():
            if getattr(self, field) is None:
                object.__setattr__(self, field, value)
                chosen[field] = why
        if self.epochs is not None:
            per_step = self.rows * r.accum
            object.__setattr__(self, "steps", -(-self.epochs * self.train_images // per_step))
        elif self.steps is None:
            object.__setattr__(self, "steps", SMOKE_STEPS)
            chosen["steps"] = "the default"
        object.__setattr__(self, "chosen", chosen)

    def summary(self) -> str:
        """One line: the resolutions, length and precision this run trains with, and where each
        came from (given, the recipe's, a default)."""
        def src(*fields):
            why = next((self.chosen[f] for f in fields if f in self.chosen), "given")
            return f" ({why})"

        length = (f"{self.epochs} epochs = {self.steps:,} steps" if self.epochs is not None
                  else f"{self.steps:,} steps")
        data = ("the embedded digits" if self.data == sources.DIGITS
                else f"{os.path.abspath(self.data)} ({len(self.splits[0]):,} train, "
                     f"{len(self.splits[1]):,} val images" + (
                         f"; {len(self.left_out)} left out, which do not read: "
                         f"{os.path.join(self.out, screen.FILE)}" if self.left_out else "") + (
                         f"; val held out by --val-split {self.val_split:g}"
                         if self.val_split else "") + ")")
        return (f"{self.recipe} on {data}: train {self.res}²{src('res')}, eval "
                f"{self.eval_res}²{src('eval_res')}, {length}{src('epochs', 'steps')}, "
                f"N = {self.batch} x R = {self.replicas}, {self.precision}{src('precision')}"
                + self._lr_note())

    def _lr_note(self) -> str:
        """Where the run's global batch is not the one its lr was published for: both, and the
        lr timm's linear rule would give (not applied: the recipe's lr is the run's)."""
        r = self.parsed_recipe()
        published, global_batch = recipes.lr_batch(self.recipe, r), self.rows * r.accum
        if published is None or published == global_batch:
            return ""
        return (f"; note: lr {r.lr:g} was published for a global batch of {published:,}, this "
                f"run's is {global_batch:,} (timm's linear rule would give "
                f"{r.lr * global_batch / published:.2g})")

    def _check_render(self) -> None:
        """The render's manifest (NAME.json beside it) against this run: a render fixes its
        recipe, R, N, S and precision."""
        if not self.render.endswith(".jaxexport") or not os.path.isfile(self.render):
            raise UsageError(f"--render {self.render}: a NAME.jaxexport file from "
                             f"'twinstep render'")
        manifest = reader.read_manifest(self.render)  # its schema checked
        given = {"recipe": manifest["name"], "replicas": manifest["replicas"],
                 "batch": manifest["batch"], "res": manifest["res"],
                 "precision": manifest["precision"]}
        for field in RENDER_FIELDS:
            if given[field] != getattr(self, field):
                raise UsageError(f"--render {self.render} was rendered with {field} = "
                                 f"{given[field]!r}, this run has {getattr(self, field)!r}")
        if self.randaugment or self.mixup or self.cutmix or (
                self.epochs and "epochs" not in self.chosen):
            raise UsageError("--render runs the render's schedule and the recipe's "
                             "augmentation: drop --epochs, --randaugment, --mixup, --cutmix")

    def parsed_recipe(self) -> recipes.Recipe:
        """The recipe with this run's overrides, resolved on construction."""
        return self._recipe

    @property
    def train_images(self) -> int:
        """How many training images the data holds."""
        return sources.train_size(self.data, self.splits)

    def _resolve(self, r: recipes.Recipe) -> recipes.Recipe:
        """``r`` with this run's overrides: its N, its length, a warmup of a tenth from timm's
        warmup lr. With --render, the rendered recipe as it is: the render holds its
        schedule."""
        if self.render is not None:
            return r
        given = {f: getattr(self, f) for f in AUGMENT_FIELDS if getattr(self, f) is not None}
        # the recipe's warmup share (a preset's 5 epochs of its length, a name's tenth), and a
        # step decay's interval its share alike
        if r.decay_steps is not None:
            given["decay_steps"] = r.decay_steps * self.steps / r.total_steps
        return dataclasses.replace(r, batch=self.batch or r.batch, total_steps=self.steps,
                                   warmup_steps=self.steps * r.warmup_steps // r.total_steps,
                                   warmup_lr=min(WARMUP_LR, r.lr), **given)

    @functools.cached_property
    def setup(self):
        """The step's `twinstep.program.Setup`, made once: R, precision, control; the
        platform's levers."""
        return program.Setup(replicas=self.replicas, precision=self.precision,
                             control=self.control)

    @property
    def rows(self) -> int:
        return self.replicas * self.batch


def check_run_dir(cfg: TrainConfig) -> bool:
    """Whether RUN_DIR holds a run to continue; refuses one trained with other settings."""
    path = os.path.join(cfg.out, "config.json")
    if not os.path.exists(path):
        if cfg.resume:
            raise UsageError(f"--resume: {cfg.out} holds no run to continue")
        os.makedirs(cfg.out, exist_ok=True)
        return False
    with open(path) as f:
        old = json.load(f)
    # "artifact": --render's retired name; null was the Python step, as render None is
    if old.get("artifact") is not None:
        raise UsageError(f"{cfg.out} holds a run that an older twinstep trained with a render "
                         f"(config.json's 'artifact'): use another --out to start a new run")
    new = {**dataclasses.asdict(cfg), "resolved_recipe": _as_json(
        dataclasses.asdict(cfg.parsed_recipe()))}
    # the topology may change (R x N at the same global batch: the tied step is the same
    # mathematics), so the recipe is compared field by field without N
    old_recipe, new_recipe = ({k: v for k, v in c.get("resolved_recipe", {}).items()
                               if k != "batch"} for c in (old, new))
    # a field a run older than it did not record had its default (the recipe's alike)
    was = {f.name: old.get(f.name, f.default) for f in dataclasses.fields(TrainConfig)}
    changed = [(f, was[f], new[f]) for f in RESUME_FIELDS if was[f] != new[f]]
    recipe_was = {f.name: old_recipe.get(f.name, None if f.default is dataclasses.MISSING
                                         else f.default)
                  for f in dataclasses.fields(recipes.Recipe)}
    changed += [(f"recipe field {k}", recipe_was.get(k), v) for k, v in new_recipe.items()
                if recipe_was.get(k) != v]
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
