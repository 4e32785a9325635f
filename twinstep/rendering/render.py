"""A render (docs/renders.md): a recipe's whole train step for an R-device mesh, as one
jax.export — `twinstep.step.train_step` jitted over a 1-D *abstract* mesh of R replicas, so
rendering never needs the R devices — written as NAME.mlir (StableHLO, byte-identical for one
program), NAME.jaxexport (the serialized export), NAME.json (`twinstep.rendering.manifest`) and,
with ``--target iree``, NAME.vmfb (`twinstep.rendering.iree`).

The exported function is flat, so it loads with no pytree registrations
(docs/renders.md#the-flat-signature):

    inputs  = state leaves, xs [k, R N, S, S, 3], ts [k, R N, K], key uint32[2]
    outputs = state leaves, loss (the step's mean loss), lr (the learning rate it used)

Dense convolutions render as XLA convolutions on every platform (the ``conv`` path), the form
every XLA backend and IREE lower; depthwise convolutions take the platform's path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from twinstep import dp, presets, program, recipes, step
from twinstep.collectives import CONTROLS, GRADIENT_ONLY_CONTROLS
from twinstep.errors import RenderError
from twinstep.nets import get_net
from twinstep.ops.levers import Levers
from twinstep.ops.precision import NAMES as PRECISIONS
from twinstep.ops.precision import get_precision
from twinstep.processes import disk, settings
from twinstep.rendering import iree, manifest
from twinstep.rendering.manifest import PLATFORMS

SMALL_RES = 32  # `render --all`: the resolution of the committed manifests
DEFAULT_CLASSES = 1000
SUFFIXES = (".mlir", ".jaxexport", ".json")
IREE_SUFFIX = ".vmfb"  # the fourth file of an IREE-target render

# xla: the three files; iree: and NAME.vmfb, IREE's llvm-cpu build of the StableHLO, whose
# depthwise convolutions are grouped convolutions (IREE lowers them as depthwise convolutions:
# in bench/probes/RESULTS.md#iree_step a faster compile and step than the shifted multiply-adds
# XLA:CPU needs, which in bf16 exceed IREE's stack limit for a dispatch)
TARGETS = ("xla", "iree")


@dataclasses.dataclass(frozen=True)
class RenderConfig:
    """What to render; checks itself on construction (RenderError, one line) and resolves the
    recipe (``recipe``) and, when None, the resolution and precision from it."""

    name: str  # a recipe name or preset (twinstep.recipes)
    replicas: int = 1
    _: dataclasses.KW_ONLY  # the rest by name
    res: int | None = None  # None: the recipe's train resolution
    classes: int = DEFAULT_CLASSES
    precision: str | None = None  # None: the recipe's (bf16 with the bf16 token, else f32)
    platform: str | None = None  # None: this process's backend; the depthwise path follows it
    control: str = "none"  # a negative control (twinstep.collectives.CONTROLS): a broken step
    target: str = "xla"  # TARGETS; iree: for CPU (platform cpu), R = 1

    def __post_init__(self):
        try:
            recipe = recipes.parse(self.name)
            step.check_recipe(get_net(recipe.net), recipe)
        except ValueError as e:
            raise RenderError(str(e)) from None
        net = get_net(recipe.net)
        res = self.res or recipe.train_res
        if res <= 0 or res % net.INPUT_MULTIPLE:
            raise RenderError(f"--res must be a positive multiple of {net.INPUT_MULTIPLE} for "
                              f"{net.NAME}, got {res}")
        if self.replicas < 1:
            raise RenderError(f"--replicas must be >= 1, got {self.replicas}")
        if self.control not in CONTROLS:
            raise RenderError(f"unknown --control {self.control!r}; choose from "
                              f"{', '.join(CONTROLS)}")
        if self.control != "none" and self.replicas == 1:
            raise RenderError(f"control {self.control!r} breaks a collective; R = 1 has none")
        if self.control in GRADIENT_ONLY_CONTROLS:
            raise RenderError(f"control {self.control!r} leaves each replica its own running "
                              f"statistics, which a whole step's replicated state cannot hold")
        if self.classes < 2:
            raise RenderError(f"--classes must be >= 2, got {self.classes}")
        for field, allowed in (("precision", PRECISIONS), ("platform", PLATFORMS),
                               ("target", TARGETS)):
            if getattr(self, field) not in (None, *allowed):
                raise RenderError(f"unknown --{field} {getattr(self, field)!r}; choose from "
                                  f"{', '.join(allowed)}")
        object.__setattr__(self, "recipe", recipe)
        object.__setattr__(self, "res", res)
        object.__setattr__(self, "precision", self.precision or ("bf16" if recipe.bf16 else "f32"))
        if self.target == "iree":
            _check_iree(self)
            object.__setattr__(self, "platform", "cpu")


def _check_iree(cfg: RenderConfig) -> None:
    """What an IREE-target render needs, before anything is exported."""
    if cfg.replicas != 1:
        raise RenderError("--target iree renders one device (--replicas 1): IREE reads neither "
                          "Shardy's sdy dialect nor GSPMD's shardings, and its CPU driver has "
                          "no collectives (docs/renders.md#iree)")
    if cfg.platform not in (None, "cpu"):
        raise RenderError(f"--target iree compiles for IREE's llvm-cpu backend: --platform cpu, "
                          f"not {cfg.platform}")
    refusal = iree_refusal(cfg.recipe)
    if refusal:
        raise RenderError(refusal)
    iree.version()  # installed, or a one-line BackendError now


def iree_refusal(recipe: recipes.Recipe) -> str | None:
    """Why IREE cannot run the recipe's step, if it cannot (bench/probes/iree_renders.py
    compiles these anyway and shows the failure)."""
    if recipe.accum > 1 and (recipe.drop or recipe.dropout):
        return (f"{recipe.name}: IREE 3.13's runtime fails steps that draw masks (drop path, "
                f"dropout) in k >= 2 micro-steps: 'indirect buffer reference slot 0 is out "
                f"range' (tests/test_iree.py::test_iree_masks_with_x64); masks render for IREE at "
                f"k = 1")
    return None


@dataclasses.dataclass
class Render:
    config: RenderConfig
    recipe: recipes.Recipe
    exported: jax.export.Exported
    mlir: str
    serialized: bytes
    manifest: dict
    vmfb: bytes | None = None  # --target iree: IREE's module


def local_platform() -> str:
    """This process's backend as jax.export names platforms (cpu, cuda, rocm, tpu)."""
    backend = jax.default_backend()
    if backend != "gpu":
        return backend
    return "rocm" if "rocm" in jax.devices()[0].client.platform_version.lower() else "cuda"


@dataclasses.dataclass
class Export:
    """What `export_step` made and the facts the manifest states about it."""

    exported: jax.export.Exported
    recipe: recipes.Recipe
    res: int
    precision: str
    levers: Levers  # both programs' (the manifest states its depthwise path)
    names: list  # the state leaves' names (`step.state_names`)
    in_specs: list  # a PartitionSpec per input, as JSON lists ([] = replicated)


def export_step(cfg: RenderConfig, single: bool = False) -> Export:
    """Export the recipe's step (`program.train_program`, flat, over an abstract mesh).
    ``single``: the single-device step at the global batch R N instead (the program the
    R-replica step is tied to).

    The export runs with jax_enable_x64 on exactly for f64 renders, whatever the process has
    set: an f32 or bf16 render is the same program from the CLI and from an x64 test. Locations
    name ops and sync sites, never the files and lines that traced them."""
    recipe, net = cfg.recipe, get_net(cfg.recipe.net)
    prec = get_precision(cfg.precision)
    platform = cfg.platform or local_platform()
    replicas = 1 if single else cfg.replicas
    mesh = dp.abstract_mesh(replicas) if replicas > 1 else None
    with settings.jax_settings(jax_enable_x64=prec.name == "f64",
                              jax_traceback_in_locations_limit=0):
        levers = dataclasses.replace(Levers.of(platform), dense_path="conv")
        if cfg.target == "iree":  # IREE compiles grouped depthwise and only the cropped padding
            levers = dataclasses.replace(levers, depthwise_path="grouped", crop_unread=True)
        setup = program.Setup(replicas=replicas, precision=prec,
                              control="none" if single else cfg.control, levers=levers)
        made = program.train_program(net, recipe, setup, classes=cfg.classes, mesh=mesh,
                                     flat=True)
        leaves = jax.tree.leaves(made.state)
        rows = cfg.replicas * recipe.batch
        avals = [*leaves, jax.ShapeDtypeStruct((recipe.accum, rows, cfg.res, cfg.res, 3),
                                               prec.dtype),
                 jax.ShapeDtypeStruct((recipe.accum, rows, cfg.classes), prec.dtype),
                 jax.ShapeDtypeStruct((2,), jnp.uint32)]  # jax.random.key_data of a threefry key
        if mesh is not None:
            avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, sp))
                     for a, sp in zip(avals, made.in_specs, strict=True)]
        exported = jax.export.export(made.step, platforms=[platform])(*avals)
    names = step.state_names(made.state)
    for n, a, b in zip(names, leaves, exported.out_avals, strict=False):
        if (a.shape, a.dtype) != (b.shape, b.dtype):  # the step must map a state onto its own type
            raise AssertionError(f"{n}: the step takes {a.dtype}{list(a.shape)} and returns "
                                 f"{b.dtype}{list(b.shape)}")
    return Export(exported, recipe, cfg.res, prec.name, levers, names,
                  [list(sp) for sp in made.in_specs])


def make(cfg: RenderConfig) -> Render:
    """Export the recipe's step and describe it (nothing written)."""
    e = export_step(cfg)
    mlir = e.exported.mlir_module()
    made = Render(cfg, e.recipe, e.exported, mlir, bytes(e.exported.serialize()),
                  manifest.build(cfg, e, mlir))
    if cfg.target == "iree":
        made.manifest["iree"] = {"compiler": iree.version(), "flags": iree.flags(e.precision),
                                 "driver": iree.DRIVER}
        made.vmfb = iree.compile_mlir(mlir, e.precision)
    return made


def write(r: Render, out: str) -> dict[str, str]:
    """Write NAME.mlir, NAME.jaxexport (and NAME.vmfb) and NAME.json into ``out``; returns
    {suffix: path}. All go to temporary files first and are renamed into place together, so a
    failed write leaves neither partial files nor a manifest whose hashes describe other files."""
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, r.config.name)
    blobs = {".mlir": r.mlir.encode(), ".jaxexport": r.serialized}
    if r.vmfb is not None:
        blobs[IREE_SUFFIX] = r.vmfb
    r.manifest["files"] = {os.path.basename(stem + s): {"bytes": len(b),
                                                         "sha256": hashlib.sha256(b).hexdigest()}
                           for s, b in blobs.items()}
    blobs[".json"] = manifest.dump(r.manifest).encode()
    # the manifest last: it holds the hashes, so an interrupted or concurrent publish leaves a
    # set that `twinstep.rendering.reader.load` refuses, never a mixed one that loads
    disk.publish({stem + suffix: blob for suffix, blob in blobs.items()},
                  lock=os.path.join(out, f".{r.config.name}.lock"))
    return {suffix: stem + suffix for suffix in blobs}


def all_names() -> list[str]:
    """`render --all`: the reference names (docs/recipes.md), then the presets."""
    return list(presets.REFERENCE_NAMES) + list(presets.PRESETS)
