"""Renders (SPEC §7): a recipe's whole train step for an R-device mesh, as one jax.export.

The step is `twinstep.step.train_step` — forward, loss, backward with its sync sites, the
gradient collective, k accumulated micro-steps, clip, optimizer, EMA — jitted over a 1-D
*abstract* mesh of R replicas, so rendering never needs the R devices. A render is three files:

- ``NAME.mlir``: the StableHLO text, for people. Locations carry op names and the sync site of
  every collective (`twinstep.collectives.SITES`), never file paths: the text depends only on
  the program, and two renders of one program are byte-identical.
- ``NAME.jaxexport``: the serialized ``jax.export.Exported``, for machines. It runs with no
  model code (`twinstep/artifact.py` is a runner that imports nothing from twinstep).
- ``NAME.json``: the manifest (`MANIFEST_KEYS`).

The exported function is flat so that it needs no pytree registrations to load:

    inputs  = state leaves, xs [k, R N, S, S, 3], ts [k, R N, K], key uint32[2]
    outputs = state leaves, loss (the step's mean loss), lr (the learning rate it used)

State leaves (`state_names`: "step", "params/<timm name>", "buffers/<timm name>",
"opt_state/...", "ema/0/<timm name>", ...) are replicated; xs and ts are sharded along their
R N axis, replica r holding rows r N ... (r + 1) N - 1 of each micro-batch. ts are soft targets
(BCE recipes transform them inside the step); key is ``jax.random.key_data`` of a threefry key.
At R = 1 the program is the single-device step at batch N: no mesh, no collective.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import twinstep
from twinstep import dp, step
from twinstep import recipe as recipes
from twinstep.collectives import GRADIENT_ONLY_CONTROLS, SINGLE, SITES
from twinstep.nets import get_net, layers
from twinstep.ops import conv
from twinstep.ops.precision import get_precision

# SPEC §3's reference count per micro-step: 3 per BN (mean, variance, backward pair) + 1 per
# parameter tensor. twinstep emits exactly these, plus one scalar for the reported loss.
BN_SITES = ("bn_forward_mean", "bn_forward_var", "bn_backward")
SMALL_RES = 32  # `render --all`: the resolution of the committed manifests
DEFAULT_CLASSES = 1000
SUFFIXES = (".mlir", ".jaxexport", ".json")
MANIFEST_KEYS = ("name", "recipe", "versions", "platform", "net", "replicas", "batch",
                 "global_batch", "accum", "res", "classes", "precision", "control", "parameters",
                 "mesh", "depthwise_path", "inputs", "outputs", "collectives", "convolutions",
                 "files")


class RenderError(ValueError):
    """A render that cannot be made as asked (bad name, resolution, replica count)."""


@dataclasses.dataclass(frozen=True)
class RenderConfig:
    name: str  # a recipe name or preset (twinstep.recipe)
    replicas: int = 1
    res: int | None = None  # None: the recipe's train resolution
    classes: int = DEFAULT_CLASSES
    precision: str | None = None  # None: the recipe's (bf16 with the bf16 token, else f32)
    platform: str | None = None  # None: this process's backend; the depthwise path follows it
    control: str = "none"  # a negative control (twinstep.collectives.CONTROLS): a broken step


@dataclasses.dataclass
class Render:
    config: RenderConfig
    recipe: recipes.Recipe
    exported: jax.export.Exported
    mlir: str
    serialized: bytes
    manifest: dict


def local_platform() -> str:
    """This process's backend as jax.export names platforms (cpu, cuda, rocm, tpu)."""
    backend = jax.default_backend()
    if backend != "gpu":
        return backend
    return "rocm" if "rocm" in jax.devices()[0].client.platform_version.lower() else "cuda"


def state_names(state) -> list[str]:
    """The flat names of a TrainState's leaves, in ``jax.tree.leaves`` order."""
    return ["/".join(step.path_parts(path)) for path, _ in
            jax.tree_util.tree_flatten_with_path(state)[0]]


def abstract_state(net, recipe, classes: int, dtype):
    """(TrainState of ShapeDtypeStructs, optimizer) for the recipe at ``classes`` classes."""
    shapes = net.param_shapes(classes)
    params = {k: jax.ShapeDtypeStruct(s, dtype) for k, s in shapes.items()}
    buffers = {k: jax.ShapeDtypeStruct(s, dtype) for k, s in layers.buffer_shapes(shapes).items()}
    opt = step.make_optimizer(recipe, params)
    return jax.eval_shape(lambda p, b: step.init_state(recipe, p, b, opt), params, buffers), opt


def flat_step(net, recipe, opt, ctx, treedef):
    """The train step on flat arguments: (*state leaves, xs, ts, key data) -> (*state leaves,
    loss, lr)."""

    def fn(*args):
        *leaves, xs, ts, key_data = args
        state = jax.tree.unflatten(treedef, leaves)
        new, metrics = step.train_step(net, recipe, opt, state, xs, ts,
                                       jax.random.wrap_key_data(key_data), ctx)
        # the schedule runs in the canonical float (f64 under x64); report it in the loss's
        loss = metrics["loss"]
        return (*jax.tree.leaves(new), loss, metrics["lr"].astype(loss.dtype))

    return fn


def check_config(cfg: RenderConfig, recipe) -> int:
    """Reject what cannot be rendered (RenderError, one line); returns the resolution."""
    net = get_net(recipe.net)
    res = cfg.res or recipe.train_res
    if res <= 0 or res % net.INPUT_MULTIPLE:
        raise RenderError(f"--res must be a positive multiple of {net.INPUT_MULTIPLE} for "
                          f"{net.NAME}, got {res}")
    if cfg.replicas < 1:
        raise RenderError(f"--replicas must be >= 1, got {cfg.replicas}")
    if cfg.control != "none" and cfg.replicas == 1:
        raise RenderError(f"control {cfg.control!r} breaks a collective; R = 1 has none")
    if cfg.control in GRADIENT_ONLY_CONTROLS:
        raise RenderError(f"control {cfg.control!r} leaves each replica its own running "
                          f"statistics, which a whole step's replicated state cannot hold")
    if cfg.classes < 2:
        raise RenderError(f"--classes must be >= 2, got {cfg.classes}")
    return res


@dataclasses.dataclass
class Export:
    """What `export_step` made and the facts the manifest states about it."""

    exported: jax.export.Exported
    recipe: recipes.Recipe
    res: int
    precision: str
    depthwise_path: str
    names: list  # the state leaves' names (`state_names`)
    in_specs: list  # a PartitionSpec per input, as JSON lists ([] = replicated)


def _spec(spec: P) -> list:
    return list(spec)


def export_step(cfg: RenderConfig, single: bool = False) -> Export:
    """Export the recipe's step. ``single``: the single-device step at the global batch R N
    instead (the program the R-replica step is tied to).

    The export runs with jax_enable_x64 on exactly for f64 renders, whatever the process has
    set: an f32 or bf16 render is the same program from the CLI and from an x64 test."""
    try:
        recipe = recipes.parse(cfg.name)
    except recipes.RecipeError as e:
        raise RenderError(str(e)) from None
    net = get_net(recipe.net)
    res = check_config(cfg, recipe)
    try:
        step.check_recipe(net, recipe)
    except ValueError as e:
        raise RenderError(str(e)) from None
    prec = get_precision(cfg.precision or ("bf16" if recipe.bf16 else "f32"))
    platform = cfg.platform or local_platform()
    depthwise = conv.default_depthwise_path(platform)
    r = cfg.replicas
    # locations name ops and sync sites, never the files and lines that traced them
    limit = jax.config.jax_traceback_in_locations_limit
    jax.config.update("jax_traceback_in_locations_limit", 0)
    try:
        with jax.enable_x64(prec.name == "f64"):
            state, opt = abstract_state(net, recipe, cfg.classes, prec.dtype)
            leaves, treedef = jax.tree.flatten(state)
            k, rows = recipe.accum, r * recipe.batch
            avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in leaves] + [
                jax.ShapeDtypeStruct((k, rows, res, res, 3), prec.dtype),
                jax.ShapeDtypeStruct((k, rows, cfg.classes), prec.dtype),
                jax.ShapeDtypeStruct((2,), jnp.uint32)]
            if single or r == 1:
                ctx = layers.Ctx(SINGLE if single else dp.replicas(1), prec,
                                 depthwise_path=depthwise)
                in_specs = [dp.REPLICATED] * len(avals)
                program = dp.jit(flat_step(net, recipe, opt, ctx, treedef))
            else:
                mesh = dp.abstract_mesh(r)
                ctx = layers.Ctx(dp.replicas(r, cfg.control), prec, depthwise_path=depthwise)
                in_specs = [dp.REPLICATED] * len(leaves) + [dp.MICRO_BATCH, dp.MICRO_BATCH,
                                                            dp.REPLICATED]
                program = dp.replica_map(flat_step(net, recipe, opt, ctx, treedef), r,
                                         tuple(in_specs), (dp.REPLICATED,) * (len(leaves) + 2),
                                         on=mesh)
                avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, sp))
                         for a, sp in zip(avals, in_specs, strict=True)]
            exported = jax.export.export(program, platforms=[platform])(*avals)
    finally:
        jax.config.update("jax_traceback_in_locations_limit", limit)
    names = state_names(state)
    for n, a, b in zip(names, leaves, exported.out_avals, strict=False):
        if (a.shape, a.dtype) != (b.shape, b.dtype):  # the step must map a state onto its own type
            raise AssertionError(f"{n}: the step takes {a.dtype}{list(a.shape)} and returns "
                                 f"{b.dtype}{list(b.shape)}")
    return Export(exported, recipe, res, prec.name, depthwise, names,
                  [_spec(sp) for sp in in_specs])


# ------------------------------------------------------------------------ reading the StableHLO


_TENSOR = re.compile(r"tensor<([^>]*)>")
_LOC_DEF = re.compile(r"^(#loc\d*) = loc\((.*)\)$", re.M)
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                    "collective_permute", "collective_broadcast")
_COLLECTIVE = re.compile(r'"stablehlo\.(' + "|".join(COLLECTIVE_KINDS) + r')"\(')
_FUNC = re.compile(r"^\s*func\.func (?:public |private )?@([\w.$-]+)\(")


def tensor_types(signature: str) -> list[tuple[tuple[int, ...], str]]:
    """[(shape, dtype)] of every ``tensor<...>`` in a type signature, in order."""
    out = []
    for t in _TENSOR.findall(signature):
        *dims, dtype = t.split("x")
        out.append((tuple(int(d) for d in dims), dtype))
    return out


def _nbytes(types) -> int:
    """Bytes of tensors typed f32, bf16, i1, f8E4M3FN, ... (the bit width is in the name)."""
    return sum(math.prod(s) * max(1, int(re.search(r"\d+", d).group()) // 8) for s, d in types)


_SITE_COMPONENT = re.compile(r'(?:^|[/"])(' + "|".join(SITES) + r")/")


def _site(loc: str, aliases: dict, depth: int = 0) -> str | None:
    """The sync site a location names: the innermost `SITES` key among the components of its
    name stack."""
    text = aliases.get(loc, loc)
    found = _SITE_COMPONENT.findall(text)
    if found:
        return found[-1]
    if depth < 8:
        for ref in re.findall(r"#loc\d*", text):
            if ref != loc and (found := _site(ref, aliases, depth + 1)):
                return found
    return None


def collectives(mlir: str) -> list[dict]:
    """Every collective op in StableHLO text: {"kind", "site", "operands": [(shape, dtype)],
    "bytes"} (bytes of this replica's operands). A collective with a reduction region has its
    signature on the line that closes the region, ``}) : (operands) -> results loc(...)``."""
    aliases = dict(_LOC_DEF.findall(mlir))
    lines = mlir.splitlines()
    ops = []
    function = None
    for i, line in enumerate(lines):
        if (f := _FUNC.match(line)) is not None:
            function = f.group(1)
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        # a function called from several places would hold one collective for each call: the
        # count would then be per call site, so refuse rather than miscount
        calls = function and len(re.findall(r"call @" + re.escape(function) + r"\(", mlir))
        if function not in (None, "main") and calls != 1:
            raise ValueError(f"a collective in @{function}, which is called {calls} times")
        j = i
        if line.rstrip().endswith("({"):
            j = next(j for j in range(i + 1, len(lines)) if lines[j].lstrip().startswith("})"))
        sig = lines[j].rsplit(" : ", 1)[1]
        operands, _ = sig.split(" -> ", 1)
        loc = re.search(r"loc\((#loc\d*)\)\s*$", lines[j])
        types = tensor_types(operands)
        ops.append({"kind": m.group(1), "site": _site(loc.group(1), aliases) if loc else None,
                    "operands": types, "bytes": _nbytes(types)})
    return ops


def convolutions(mlir: str) -> list[dict]:
    """Every ``stablehlo.convolution``: {"operands": [(shape, dtype)] x 2, "result": (shape,
    dtype)}."""
    out = []
    for line in mlir.splitlines():
        if "stablehlo.convolution(" in line:
            types = tensor_types(line.rsplit(" : ", 1)[1])
            out.append({"operands": types[:2], "result": types[2]})
    return out


def collective_summary(ops: list[dict], net) -> dict:
    """The manifest's collectives: by kind and by site (count, payload bytes, dtypes), and the
    reference count of SPEC §3."""
    def summary(group):
        return {"count": len(group), "payload_bytes": sum(o["bytes"] for o in group),
                "dtypes": sorted({d for o in group for _, d in o["operands"]})}

    kinds = {k: summary([o for o in ops if o["kind"] == k]) for k in COLLECTIVE_KINDS
             if any(o["kind"] == k for o in ops)}
    sites = {s: summary([o for o in ops if o["site"] == s]) for s in SITES}
    unattributed = [o for o in ops if o["site"] is None]
    if unattributed:
        sites["unattributed"] = summary(unattributed)
    shapes = net.param_shapes(2)
    bns = len(layers.bn_names(shapes))
    return {"per_micro_step": len(ops), "by_kind": kinds, "by_site": sites,
            "spec_reference": len(BN_SITES) * bns + len(shapes),
            "note": "counted in the StableHLO text, where the scan over micro-steps holds each "
                    "collective once: these are per micro-step. SPEC §3's reference is 3 per BN + "
                    "1 per parameter tensor; the 'loss' site (the reported mean loss, a scalar) "
                    "is the one collective beyond it."}


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
    convs = convolutions(mlir)
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
                       [_spec(dp.REPLICATED)] * (len(names) + 2)),
        "collectives": collective_summary(collectives(mlir), net),
        "convolutions": {"count": len(convs),
                         "dtypes": sorted({d for c in convs
                                           for _, d in c["operands"] + [c["result"]]})},
    }
    return Render(cfg, recipe, exported, mlir, serialized, manifest)


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
    """Write NAME.mlir, NAME.jaxexport and NAME.json into ``out``; returns {suffix: path}.
    All three go to temporary files first and are renamed into place together, so a failed
    write leaves neither partial files nor a manifest whose hashes describe other files."""
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, r.config.name)
    blobs = {".mlir": r.mlir.encode(), ".jaxexport": r.serialized}
    r.manifest["files"] = {os.path.basename(stem + s): {"bytes": len(b),
                                                         "sha256": hashlib.sha256(b).hexdigest()}
                           for s, b in blobs.items()}
    blobs[".json"] = dump_manifest(r.manifest).encode()
    umask = os.umask(0)
    os.umask(umask)
    temps = {}
    try:
        for suffix, blob in blobs.items():
            fd, temps[suffix] = tempfile.mkstemp(dir=out, prefix=".render-")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.chmod(temps[suffix], 0o666 & ~umask)  # mkstemp's 0600 -> what open() makes
        for suffix, tmp in temps.items():
            os.replace(tmp, stem + suffix)
    finally:
        for tmp in temps.values():
            if os.path.exists(tmp):
                os.unlink(tmp)
    return {suffix: stem + suffix for suffix in blobs}


def all_names() -> list[str]:
    """`render --all`: SPEC §6's reference names, then the presets."""
    return list(recipes.REFERENCE_NAMES) + list(recipes.PRESETS)


# ------------------------------------------------------------------------- running an artifact


def load(path: str) -> tuple[jax.export.Exported, dict]:
    """(Exported, manifest) of NAME.jaxexport and the NAME.json beside it."""
    if not path.endswith(".jaxexport"):
        raise RenderError(f"{path}: an artifact is a NAME.jaxexport file")
    manifest_path = path[:-len(".jaxexport")] + ".json"
    if not os.path.exists(manifest_path):
        raise RenderError(f"{path}: its manifest {manifest_path} is missing")
    with open(path, "rb") as f:
        blob = f.read()
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        digest = manifest["files"][os.path.basename(path)]["sha256"]
    except (ValueError, KeyError) as e:
        raise RenderError(f"{manifest_path} is not the manifest of {os.path.basename(path)} "
                          f"(renamed? {type(e).__name__}: {e})") from None
    if hashlib.sha256(blob).hexdigest() != digest:
        raise RenderError(f"{path}: sha256 differs from its manifest's (a different render?)")
    return jax.export.deserialize(bytearray(blob)), manifest


def artifact_step(exported: jax.export.Exported, manifest: dict, fast_compile: bool = False,
                  donate: bool = False):
    """The artifact as a replica step: (state, xs, ts, key) -> (state, {"loss", "lr"}), its
    arguments checked against the manifest's signature and placed on the first R devices as
    the manifest shards them. fast_compile: XLA compiles the artifact as `dp.FAST_COMPILE`;
    donate: the step may reuse the state's buffers (the caller drops the old state)."""
    r = manifest["replicas"]
    state_args = tuple(range(len(manifest["inputs"]) - 3))  # all but xs, ts, key
    call = dp.jit(exported.call, fast_compile, donate=state_args if donate else ())
    mesh = dp.mesh(r) if r > 1 else None
    inputs = manifest["inputs"]

    def run(state, xs, ts, key):
        leaves, treedef = jax.tree.flatten(state)
        args = [*leaves, xs, ts, jax.random.key_data(key)]
        names = state_names(state) + ["xs", "ts", "key"]
        want = [(n, list(np.shape(a)), str(a.dtype)) for n, a in zip(names, args, strict=True)]
        have = [(i["name"], i["shape"], i["dtype"]) for i in inputs]
        if want != have:
            diff = next((w, h) for w, h in itertools.zip_longest(want, have) if w != h)
            raise RenderError(f"the artifact's inputs differ from this step's: it takes {diff[1]}"
                              f" where this step has {diff[0]}")
        if mesh is not None:
            args = [jax.device_put(a, NamedSharding(mesh, P(*i["spec"])))
                    for a, i in zip(args, inputs, strict=True)]
        *leaves, loss, lr = call(*args)
        return jax.tree.unflatten(treedef, leaves), {"loss": loss, "lr": lr}

    return run
