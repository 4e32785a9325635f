"""Renders (docs/renders.md): a recipe's whole train step for an R-device mesh, as one jax.export.

The step is `twinstep.step.train_step` — forward, loss, backward with its sync sites, the
gradient collective, k accumulated micro-steps, clip, optimizer, EMA — jitted over a 1-D
*abstract* mesh of R replicas, so rendering never needs the R devices. A render is three files:

- ``NAME.mlir``: the StableHLO text, for people. Locations carry op names and the sync site of
  every collective (`twinstep.collectives.SITES`), never file paths: the text depends only on
  the program, and two renders of one program are byte-identical.
- ``NAME.jaxexport``: the serialized ``jax.export.Exported``, for machines. It runs with no
  model code (`twinstep/artifact.py` is a runner that imports nothing from twinstep).
- ``NAME.json``: the manifest (`MANIFEST_KEYS`).
- ``NAME.vmfb`` (``--target iree``, R = 1): the StableHLO compiled by IREE for its llvm-cpu
  backend (`twinstep.iree_backend`); the manifest's "iree" entry records the compiler and flags.

The exported function is flat so that it needs no pytree registrations to load:

    inputs  = state leaves, xs [k, R N, S, S, 3], ts [k, R N, K], key uint32[2]
    outputs = state leaves, loss (the step's mean loss), lr (the learning rate it used)

State leaves (`step.state_names`: "step", "params/<timm name>", "buffers/<timm name>",
"opt_state/...", "ema/0/<timm name>", ...) are replicated; xs and ts are sharded along their
R N axis, replica r holding rows r N ... (r + 1) N - 1 of each micro-batch. ts are soft targets
(BCE recipes transform them inside the step); key is ``jax.random.key_data`` of a threefry key.
At R = 1 the program is the single-device step at batch N: no mesh, no collective.

Dense convolutions are rendered as XLA convolutions on every platform (the ``conv`` path of
`twinstep.ops.conv`), the form every XLA backend and IREE lower and the manifest counts; the
Python step on XLA:CPU multiplies matrices instead (``matmul``), so a CPU render runs slower than
`twinstep train` does without ``--artifact``. Depthwise convolutions take the platform's path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

import twinstep
from twinstep import dp, files, hlo, iree_backend, program, recipes, runtime, step
from twinstep.collectives import CONTROLS, GRADIENT_ONLY_CONTROLS, SITES, grad_buckets
from twinstep.errors import UsageError
from twinstep.nets import get_net, layers
from twinstep.ops import conv
from twinstep.ops.precision import NAMES as PRECISIONS
from twinstep.ops.precision import get_precision

# The reference count (docs/sync-sites.md): 2 per BN (the gathered forward moments, the backward
# pair) in each micro-step + 1 per gradient bucket after the scan. twinstep emits exactly these,
# plus one scalar for the reported loss.
BN_SITES = ("bn_forward", "bn_backward")
SMALL_RES = 32  # `render --all`: the resolution of the committed manifests
DEFAULT_CLASSES = 1000
SUFFIXES = (".mlir", ".jaxexport", ".json")
IREE_SUFFIX = ".vmfb"  # the fourth file of an IREE-target render
MANIFEST_KEYS = ("name", "recipe", "versions", "platform", "net", "replicas", "batch",
                 "global_batch", "accum", "res", "classes", "precision", "control", "parameters",
                 "mesh", "depthwise_path", "inputs", "outputs", "collectives", "convolutions",
                 "files")


class RenderError(UsageError):
    """A render that cannot be made as asked (bad name, resolution, replica count)."""


PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
# xla: the three files; iree: and NAME.vmfb, IREE's llvm-cpu build of the StableHLO, whose
# depthwise convolutions are grouped convolutions (IREE lowers them as depthwise convolutions:
# in bench/RESULTS.md's MNv4 step a faster compile and step than the shifted multiply-adds
# XLA:CPU needs, which in bf16 exceed IREE's stack limit for a dispatch)
TARGETS = ("xla", "iree")


@dataclasses.dataclass(frozen=True)
class RenderConfig:
    """What to render; checks itself on construction (RenderError, one line) and resolves the
    recipe (``recipe``) and, when None, the resolution and precision from it."""

    name: str  # a recipe name or preset (twinstep.recipes)
    replicas: int = 1
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
    iree_backend.version()  # installed, or a one-line BackendError now


def iree_refusal(recipe: recipes.Recipe) -> str | None:
    """Why IREE cannot run the recipe's step, if it cannot (bench/iree_renders.py compiles
    these anyway and shows the failure)."""
    if recipe.accum > 1 and (recipe.drop or recipe.dropout):
        return (f"{recipe.name}: IREE 3.13's runtime fails steps that draw masks (drop path, "
                f"dropout) in k >= 2 micro-steps: 'indirect buffer reference slot 0 is out "
                f"range' (python bench/iree_masks.py); a recipe with masks renders for IREE at "
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
    depthwise_path: str
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
    depthwise = "grouped" if cfg.target == "iree" else conv.default_depthwise_path(platform)
    replicas = 1 if single else cfg.replicas
    mesh = dp.abstract_mesh(replicas) if replicas > 1 else None
    with runtime.jax_settings(jax_enable_x64=prec.name == "f64",
                              jax_traceback_in_locations_limit=0):
        made = program.train_program(net, recipe, cfg.classes, replicas, prec,
                                     "none" if single else cfg.control,
                                     mesh=mesh, flat=True, depthwise_path=depthwise,
                                     dense_path="conv")
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
    return Export(exported, recipe, cfg.res, prec.name, depthwise, names,
                  [list(sp) for sp in made.in_specs])


def collective_summary(ops: list[dict], net, classes: int, dtype, accum: int) -> dict:
    """The manifest's collectives: by kind and by site (count, payload bytes, dtypes) as the
    StableHLO text holds them — the scan over micro-steps holds its collectives once — then per
    micro-step (those in the scan) and per optimizer step of ``accum`` micro-steps (k times
    those, + those after the scan), and the reference count
    (docs/sync-sites.md) from the parameter shapes and their gradients' ``dtype``."""
    def summary(group):
        return {"count": len(group), "payload_bytes": sum(o["bytes"] for o in group),
                "dtypes": sorted({d for o in group for _, d in o["operands"]})}

    kinds = {k: summary([o for o in ops if o["kind"] == k]) for k in hlo.COLLECTIVE_KINDS
             if any(o["kind"] == k for o in ops)}
    sites = {s: summary([o for o in ops if o["site"] == s]) for s in SITES}
    unattributed = [o for o in ops if o["site"] is None]
    if unattributed:
        sites["unattributed"] = summary(unattributed)
    micro = summary([o for o in ops if o["in_loop"]])
    once = summary([o for o in ops if not o["in_loop"]])
    shapes = net.param_shapes(classes)
    bns = len(layers.bn_names(shapes))
    buckets = grad_buckets([jax.ShapeDtypeStruct(s, dtype) for s in jax.tree.leaves(
        shapes, is_leaf=lambda x: isinstance(x, tuple))])
    return {"in_text": len(ops), "by_kind": kinds, "by_site": sites,
            "per_micro_step": micro["count"],
            "per_optimizer_step": {
                "count": accum * micro["count"] + once["count"],
                "payload_bytes": accum * micro["payload_bytes"] + once["payload_bytes"]},
            "spec_reference": len(BN_SITES) * bns + len(buckets),
            "note": "the reference count (docs/sync-sites.md): 2 per BN (in each micro-step) "
                    "+ 1 per gradient bucket (once per optimizer step, after the k "
                    "micro-steps); the 'loss' site (the reported mean loss, a scalar, each "
                    "micro-step) is the one collective beyond it."}


# --------------------------------------------------------------------------------- the files


def _io(names, avals, specs) -> list[dict]:
    return [{"name": n, "shape": list(a.shape), "dtype": str(a.dtype), "spec": s}
            for n, a, s in zip(names, avals, specs, strict=True)]


def render(cfg: RenderConfig) -> Render:
    """Export the recipe's step and describe it (nothing written)."""
    e = export_step(cfg)
    exported, recipe, names = e.exported, e.recipe, e.names
    net = get_net(recipe.net)
    mlir = exported.mlir_module()
    serialized = bytes(exported.serialize())
    shapes = net.param_shapes(cfg.classes)
    convs = hlo.convolutions(mlir)
    manifest = {
        "name": cfg.name,  # as asked: a preset keeps its lr and schedule, its grammar name not
        "recipe": recipe.name,
        "versions": {"twinstep": twinstep.__version__, "jax": jax.__version__,
                     "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
                     "calling_convention": exported.calling_convention_version},
        "platform": exported.platforms[0],
        "net": recipe.net,
        "replicas": cfg.replicas,
        "batch": recipe.batch,
        "global_batch": cfg.replicas * recipe.batch,
        "accum": recipe.accum,
        "res": e.res,
        "classes": cfg.classes,
        "precision": e.precision,
        "control": cfg.control,
        "parameters": {"tensors": len(shapes),
                       "scalars": int(sum(math.prod(s) for s in shapes.values()))},
        "mesh": {"axis": dp.AXIS, "size": cfg.replicas},
        "depthwise_path": e.depthwise_path,
        "inputs": _io(names + ["xs", "ts", "key"], exported.in_avals, e.in_specs),
        "outputs": _io(names + ["loss", "lr"], exported.out_avals,
                       [[]] * (len(names) + 2)),
        "collectives": collective_summary(hlo.collectives(mlir), net, cfg.classes,
                                          get_precision(e.precision).dtype, recipe.accum),
        "convolutions": {"count": len(convs),
                         "dtypes": sorted({d for c in convs
                                           for _, d in c["operands"] + [c["result"]]})},
    }
    if cfg.target != "iree":
        return Render(cfg, recipe, exported, mlir, serialized, manifest)
    manifest["iree"] = {"compiler": iree_backend.version(), "flags": iree_backend.flags(
        e.precision), "driver": iree_backend.DRIVER}
    return Render(cfg, recipe, exported, mlir, serialized, manifest,
                  iree_backend.compile_mlir(mlir, e.precision))


def dump_manifest(manifest: dict) -> str:
    """JSON with one line per input / output of the signature (hundreds of them)."""
    parts = []
    for key, value in manifest.items():
        if key in ("inputs", "outputs"):
            rows = ",\n".join("  " + json.dumps(v) for v in value)
            parts.append(f' {json.dumps(key)}: [\n{rows}\n ]')
        else:
            parts.append(f" {json.dumps(key)}: " + json.dumps(value, indent=1).replace("\n",
                                                                                       "\n "))
    return "{\n" + ",\n".join(parts) + "\n}\n"


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
    blobs[".json"] = dump_manifest(r.manifest).encode()
    # the manifest last: it holds the hashes, so an interrupted or concurrent publish leaves a
    # set that `load` refuses, never a mixed one that loads
    files.publish({stem + suffix: blob for suffix, blob in blobs.items()},
                  lock=os.path.join(out, f".{r.config.name}.lock"))
    return {suffix: stem + suffix for suffix in blobs}


def all_names() -> list[str]:
    """`render --all`: the reference names (docs/recipes.md), then the presets."""
    return list(recipes.REFERENCE_NAMES) + list(recipes.PRESETS)


# ------------------------------------------------------------------------- running an artifact


def check_manifest(manifest, where: str) -> recipes.Recipe:
    """A manifest's schema (keys, types, ranges) and its fields against its name's recipe
    (RenderError, one line); returns the recipe."""
    if not isinstance(manifest, dict):
        raise RenderError(f"{where} is not a render manifest")
    missing = [k for k in MANIFEST_KEYS if k not in manifest]
    if missing:
        raise RenderError(f"{where} is not a render manifest (no {missing[0]!r})")
    for key, low in (("replicas", 1), ("batch", 1), ("global_batch", 1), ("accum", 1),
                     ("res", 1), ("classes", 2)):
        value = manifest[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise RenderError(f"{where}: {key} = {value!r}; expected an int >= {low}")
    for key, allowed in (("precision", PRECISIONS), ("platform", PLATFORMS),
                         ("control", tuple(CONTROLS))):
        if manifest[key] not in allowed:
            raise RenderError(f"{where}: {key} = {manifest[key]!r}; expected one of {allowed}")
    try:
        recipe = recipes.parse(manifest["name"])
    except recipes.RecipeError as e:
        raise RenderError(f"{where}: {e}") from None
    fields = {"recipe": recipe.name, "net": recipe.net, "batch": recipe.batch,
              "accum": recipe.accum, "global_batch": manifest["replicas"] * recipe.batch}
    wrong = [k for k, v in fields.items() if manifest[k] != v]
    if wrong:
        raise RenderError(f"{where}: {wrong[0]} = {manifest[wrong[0]]!r} contradicts its name "
                          f"{manifest['name']!r} ({fields[wrong[0]]!r})")
    for key in ("inputs", "outputs"):
        rows = manifest[key]
        if not isinstance(rows, list) or not all(
                isinstance(r, dict) and {"name", "shape", "dtype", "spec"} <= set(r) for r in rows):
            raise RenderError(f"{where}: {key} is not a list of name/shape/dtype/spec rows")
    return recipe


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise RenderError(f"cannot read {path}: {e.strerror}") from None


def load(path: str) -> tuple[jax.export.Exported, dict]:
    """(Exported, manifest) of NAME.jaxexport, trusted only when the set is whole: the manifest
    NAME.json beside it passes `check_manifest`, NAME.mlir and NAME.jaxexport have the sha256
    it holds, and the deserialized program's devices, platform and signature are the ones it
    states — all before anything runs (RenderError, one line)."""
    if not path.endswith(".jaxexport"):
        raise RenderError(f"{path}: an artifact is a NAME.jaxexport file")
    exported, manifest, _ = _load_set(path[:-len(".jaxexport")], path)
    return exported, manifest


def load_iree(path: str) -> tuple[bytes, jax.export.Exported, dict]:
    """(the IREE module, Exported, manifest) of NAME.vmfb from 'render --target iree', checked
    as `load` checks a set, NAME.vmfb's sha256 included."""
    if not path.endswith(IREE_SUFFIX):
        raise RenderError(f"{path}: an IREE artifact is a NAME{IREE_SUFFIX} file")
    exported, manifest, vmfb = _load_set(path[:-len(IREE_SUFFIX)], path, IREE_SUFFIX)
    if "iree" not in manifest:
        raise RenderError(f"{path}: its manifest records no IREE build ('render --target iree')")
    return vmfb, exported, manifest


def _load_set(stem: str, path: str, extra: str | None = None):
    """(Exported, manifest, the ``extra`` file's bytes or None) of the render at ``stem``."""
    try:
        manifest = json.loads(_read(stem + ".json"))
    except ValueError as e:
        raise RenderError(f"{stem}.json is not JSON: {e}") from None
    check_manifest(manifest, stem + ".json")
    blobs = {suffix: _read(stem + suffix) for suffix in (".mlir", ".jaxexport", extra) if suffix}
    for suffix, blob in blobs.items():
        entry = manifest["files"].get(os.path.basename(stem + suffix)) if isinstance(
            manifest["files"], dict) else None
        if not isinstance(entry, dict) or hashlib.sha256(blob).hexdigest() != entry.get("sha256"):
            raise RenderError(f"{stem + suffix}: sha256 differs from its manifest's (a different "
                              f"or partly written render?)")
    try:
        exported = jax.export.deserialize(bytearray(blobs[".jaxexport"]))
    except Exception as e:  # noqa: BLE001 - any failure to deserialize is a bad file
        raise RenderError(f"{stem}.jaxexport cannot be deserialized ({type(e).__name__}): a "
                          f"corrupt render?") from None
    _check_signature(exported, manifest, path)
    return exported, manifest, blobs.get(extra)


def _check_signature(exported, manifest: dict, path: str) -> None:
    """The deserialized program against its manifest: device count, platform, every input's
    and output's shape and dtype."""
    if exported.nr_devices != manifest["replicas"]:
        raise RenderError(f"{path} runs on {exported.nr_devices} devices; its manifest says "
                          f"{manifest['replicas']}")
    if tuple(exported.platforms) != (manifest["platform"],):
        raise RenderError(f"{path} was lowered for {', '.join(exported.platforms)}; its manifest "
                          f"says {manifest['platform']}")
    for key, avals in (("inputs", exported.in_avals), ("outputs", exported.out_avals)):
        have = [(list(a.shape), str(a.dtype)) for a in avals]
        want = [(r["shape"], r["dtype"]) for r in manifest[key]]
        if have != want:
            raise RenderError(f"{path}: its {key} differ from its manifest's")
