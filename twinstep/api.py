"""twinstep's Python API, what ``import twinstep`` offers (the CLI runs the same functions).

Each function sets JAX up as it needs: the virtual CPU devices for R replicas (possible only
before JAX's first operation — otherwise a one-line UsageError says what to do), and float64
for the exact checks, switched on for the call and restored after it. Configurations are
checked before anything compiles; bad ones raise `twinstep.UsageError` with one line.

Importing this module imports JAX and the rest of the package, and starts no JAX backend (no
module of twinstep does at import: tests/test_imports.py), so those settings still take.
``import twinstep`` alone imports neither: the facade loads this module when first asked.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from twinstep import dp, nets, recipes
from twinstep.checking import trajectory
from twinstep.checking.tie import TieConfig, run_tie
from twinstep.data import packed
from twinstep.errors import UsageError
from twinstep.processes import cluster, disk, settings
from twinstep.rendering import reader
from twinstep.rendering import render as renders
from twinstep.training import loop
from twinstep.training.config import TrainConfig


def get_net(name: str):
    """The network ``name`` ("resnet50", "mnv4"): a module implementing `twinstep.nets.Net`."""
    try:
        return nets.get_net(name)
    except ValueError as e:
        raise UsageError(str(e)) from None


def parse_recipe(name: str):
    """The `twinstep.recipes.Recipe` a recipe name or preset stands for."""
    return recipes.parse(name)


def join(coordinator: str | None = None, num_processes: int | None = None,
         process_id: int | None = None, replicas: int = 1) -> None:
    """Join JAX's multi-controller runtime as process ``process_id`` of ``num_processes``, the
    coordinator (process 0) at ``coordinator`` HOST:PORT — or as the environment says (SLURM,
    JAX_COORDINATOR_ADDRESS); with neither, stay one process. Call before JAX's first operation,
    in every process; then `tie` and `train` run over every process's devices together
    (`twinstep.processes.cluster`). ``replicas``: how many replicas the processes will run
    together (on CPU each process asks for its share of virtual devices). Raises
    `twinstep.errors.ClusterError` when the runtime cannot be joined."""
    dp.ensure_devices(-(-replicas // (num_processes or 1)))  # before JAX starts, as joining is
    cluster.initialize(coordinator, num_processes, process_id)  # checks the flags first


def devices(replicas: int) -> None:
    """Make sure JAX has ``replicas`` devices: on CPU, ask for that many virtual devices, which
    is possible only before JAX's first operation. With several processes R is shared out
    evenly (`twinstep.processes.cluster.replica_devices`)."""
    dp.ensure_devices(replicas)
    if cluster.count() > 1:
        cluster.replica_devices(replicas)  # refuses an R the processes cannot share
        return
    have = len(jax.devices())
    if have < replicas:
        raise UsageError(
            f"{replicas} replicas need {replicas} devices and JAX has {have}: call twinstep "
            f"before any other JAX operation, or set JAX_NUM_CPU_DEVICES={replicas}")


def _x64(precision: str):
    """float64 for the call when the check is exact (f64, and bf16's f64 around bf16 convs)."""
    return settings.jax_settings(jax_enable_x64=precision in ("f64", "bf16"))


def tie(net: str = "resnet50", progress=None, **config):
    """Tie one gradient step: R replicas of N against one device at R N, every parameter
    gradient, BN statistic, the loss and the running statistics. ``config``: the fields of
    `twinstep.checking.tie.TieConfig`, by keyword (each a `twinstep tie` flag: docs/tie.md;
    ``levers`` a `twinstep.Levers`, e.g. ``Levers.chosen(gpu=True, store="bf16")``).
    Returns a `twinstep.checking.tie.TieReport` (``.ok``, ``.verdict()``, ``.to_json()``);
    ``progress(text)`` is told what runs now."""
    cfg = TieConfig(net=net, **config)
    if cfg.recipe:
        raise UsageError("a recipe ties whole steps: call twinstep.tie_steps")
    devices(cfg.replicas)
    with _x64(cfg.precision):
        return run_tie(cfg, progress=progress)


def tie_steps(recipe: str, steps: int | None = None, progress=None, **config):
    """Tie ``steps`` (default 3) whole training steps of ``recipe`` (a name or preset) in
    float64: every parameter, optimizer-state, EMA and running-statistics tensor after every
    step. ``config``: TieConfig's fields (the net, batch and loss come from the recipe).
    Returns a `twinstep.checking.trajectory.StepsReport`; with several processes, process 0's
    holds the comparison and the others' only its status (docs/hosts.md)."""
    cfg = TieConfig(recipe=recipe, **config)  # the net: the recipe's, unless config names one
    devices(cfg.replicas)
    with _x64(cfg.precision):
        return trajectory.run_steps_tie(cfg, steps=trajectory.STEPS if steps is None else steps,
                                        progress=progress)


class LoadedRender(NamedTuple):
    """A render read back: the deserialized jax.export.Exported and its manifest (a dict)."""

    exported: object
    manifest: dict
    path: str

    def step(self, fast_compile: bool = False, donate: bool = False):
        """The render as a train step (state, xs, ts, key) -> (state, {"loss", "lr"}), on the
        manifest's R devices."""
        devices(self.manifest["replicas"])
        return reader.step(self.exported, self.manifest, fast_compile, donate)


def load_render(path: str) -> LoadedRender:
    """NAME.jaxexport and the NAME.json beside it, checked against each other (sha256)."""
    devices(reader.read_manifest(path).get("replicas", 1))  # before JAX starts: its R devices
    exported, manifest = reader.load(path)
    return LoadedRender(exported, manifest, path)


def tie_render(path: str, steps: int | None = None, *, seed: int = 0, shift: bool = True,
               fast_compile: bool = False, progress=None):
    """Tie a render's step (an f64 render) against the single-device Python step over ``steps``
    whole steps; net, R, N, resolution, classes and recipe come from its manifest. ``path``:
    NAME.jaxexport (the deserialized program on XLA, rendered for this platform) or NAME.vmfb
    ('render --target iree': IREE's module on IREE's CPU driver). Returns a
    `twinstep.checking.trajectory.StepsReport`."""
    on_iree = path.endswith(reader.IREE_SUFFIX)
    if on_iree:
        vmfb, exported, m = reader.load_iree(path)
    else:
        loaded = load_render(path)
        m = loaded.manifest
    if m["precision"] != "f64":
        raise UsageError(f"{path} is a {m['precision']} render; the tie is exact in f64: render "
                         f"it again with --precision f64 (the same program in f64)")
    if not on_iree and m["platform"] != renders.local_platform():
        raise UsageError(f"{path} was rendered for {m['platform']}; this process runs "
                         f"{renders.local_platform()}")
    cfg = TieConfig(net=m["net"], replicas=m["replicas"], batch=m["batch"], res=m["res"],
                    classes=m["classes"], precision="f64", seed=seed, shift=shift,
                    fast_compile=fast_compile, recipe=m["name"])
    with _x64("f64"):
        replica = (reader.iree_step(vmfb, exported, m) if on_iree
                   else loaded.step(fast_compile, donate=True))
        report = trajectory.run_steps_tie(cfg, steps=trajectory.STEPS if steps is None else steps,
                                          progress=progress, replica=replica)
    report.render = path
    return report


def train(recipe, out: str | None = None, progress=None, warn=None, **config) -> dict:
    """Train ``recipe`` (a name or preset) into RUN_DIR ``out`` with its tied step, continuing
    the run already there; returns the last evaluation ({"raw": {loss, top1, top5}, "ema":
    ...}). ``config``: the other fields of `twinstep.training.config.TrainConfig`, by keyword
    — or ``recipe`` a TrainConfig already made, alone. ``progress(step, metrics)`` is told of
    every step and of each evaluation as it starts (metrics["phase"]); ``warn(text)`` once of
    images that do not decode."""
    if isinstance(recipe, TrainConfig):
        if out is not None or config:
            raise UsageError("train(TrainConfig) takes no other configuration")
        cfg = recipe
    else:
        cfg = TrainConfig(recipe, out, **config)
    disk.check_writable_folder(cfg.out, "--out")
    devices(cfg.replicas)
    with _x64(cfg.precision):
        return loop.run(cfg, progress, warn)


def pack(folder: str, out: str, max_side: int | None = None, quality: int | None = None,
         progress=None) -> dict:
    """Pack the image folder ``folder`` into the new folder ``out`` for training (`twinstep.data
    .packed`: images re-encoded with their short side at most ``max_side``, default 320, as
    ArrayRecord shards); returns its manifest. ``progress(split, done, total)`` is told of
    every image."""
    disk.check_writable_folder(out, "--out")
    return packed.pack(folder, out, max_side=max_side or packed.MAX_SIDE,
                       quality=quality or packed.QUALITY, progress=progress)


def render(name: str, replicas: int = 1, out: str | None = None, **config):
    """Export recipe ``name``'s whole train step for an R-device mesh (no R devices needed).
    ``config``: the fields of `twinstep.rendering.render.RenderConfig`, by keyword (each a
    `twinstep render` flag: docs/renders.md). With ``out`` the three files are written there
    (and NAME.vmfb with target="iree"). Returns a `twinstep.rendering.render.Render`
    (``.exported``, ``.mlir``, ``.manifest``, ``.vmfb``)."""
    cfg = renders.RenderConfig(name, replicas, **config)
    if out is not None:
        disk.check_writable_folder(out, "out")
    made = renders.make(cfg)
    if out is not None:
        try:
            renders.write(made, out)
        except OSError as e:
            raise UsageError(f"cannot write into {out}: {e}") from None
    return made
