"""A render's manifest, NAME.json (docs/renders.md#the-manifest): what the exported step is —
versions, platform, net, R, N, k, resolution, precision, parameter counts, the flat signature,
the collectives by kind and by site, the convolutions, the files' sha256 — built from the
export (`build`), written one signature row a line (`dump`), and checked when read (`check`).
"""

from __future__ import annotations

import json
import math

import jax

from twinstep import dp, recipes
from twinstep.collectives import CONTROLS, SITES, grad_buckets
from twinstep.defaults import MAX_REPLICAS
from twinstep.errors import RenderError, UsageError
from twinstep.nets import get_net, layers
from twinstep.ops.precision import NAMES as PRECISIONS
from twinstep.ops.precision import get_precision
from twinstep.rendering import stablehlo
from twinstep.version import __version__

KEYS = ("name", "recipe", "versions", "platform", "net", "replicas", "batch", "global_batch",
        "accum", "res", "classes", "precision", "control", "parameters", "mesh",
        "depthwise_path", "inputs", "outputs", "collectives", "convolutions", "files")
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
# The reference count (docs/sync-sites.md#collective-count): 2 per BN (the gathered forward
# moments, the backward pair) in each micro-step + 1 per gradient bucket after the scan.
# twinstep emits exactly these, plus one scalar for the reported loss.
BN_SITES = ("bn_forward", "bn_backward")


def build(cfg, export, mlir: str) -> dict:
    """The manifest of ``export`` (a `twinstep.rendering.render.Export` of the render ``cfg``)
    whose StableHLO text is ``mlir``; "files" is added when the files are written."""
    exported, recipe, names = export.exported, export.recipe, export.names
    net = get_net(recipe.net)
    shapes = net.param_shapes(cfg.classes)
    convs = stablehlo.convolutions(mlir)
    return {
        "name": cfg.name,  # as asked: a preset keeps its lr and schedule, its grammar name not
        "recipe": recipe.name,
        "versions": {"twinstep": __version__, "jax": jax.__version__,
                     "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
                     "calling_convention": exported.calling_convention_version},
        "platform": exported.platforms[0],
        "net": recipe.net,
        "replicas": cfg.replicas,
        "batch": recipe.batch,
        "global_batch": cfg.replicas * recipe.batch,
        "accum": recipe.accum,
        "res": export.res,
        "classes": cfg.classes,
        "precision": export.precision,
        "control": cfg.control,
        "parameters": {"tensors": len(shapes),
                       "scalars": int(sum(math.prod(s) for s in shapes.values()))},
        "mesh": {"axis": dp.AXIS, "size": cfg.replicas},
        "depthwise_path": export.levers.depthwise_path,
        "inputs": _io(names + ["xs", "ts", "key"], exported.in_avals, export.in_specs),
        "outputs": _io(names + ["loss", "lr"], exported.out_avals,
                       [[]] * (len(names) + 2)),
        "collectives": collective_summary(stablehlo.collectives(mlir), net, cfg.classes,
                                          get_precision(export.precision).dtype, recipe.accum),
        "convolutions": {"count": len(convs),
                         "dtypes": sorted({d for c in convs
                                           for _, d in c["operands"] + [c["result"]]})},
    }


def _io(names, avals, specs) -> list[dict]:
    return [{"name": n, "shape": list(a.shape), "dtype": str(a.dtype), "spec": s}
            for n, a, s in zip(names, avals, specs, strict=True)]


def collective_summary(ops: list[dict], net, classes: int, dtype, accum: int) -> dict:
    """The manifest's collectives: by kind and by site (count, payload bytes, dtypes) as the
    StableHLO text holds them — the scan over micro-steps holds its collectives once — then per
    micro-step (those in the scan) and per optimizer step of ``accum`` micro-steps (k times
    those, + those after the scan), and the reference count
    (docs/sync-sites.md) from the parameter shapes and their gradients' ``dtype``."""
    def summary(group):
        return {"count": len(group), "payload_bytes": sum(o["bytes"] for o in group),
                "dtypes": sorted({d for o in group for _, d in o["operands"]})}

    kinds = {k: summary([o for o in ops if o["kind"] == k]) for k in stablehlo.COLLECTIVE_KINDS
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



def dump(manifest: dict) -> str:
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



def check(manifest, where: str) -> recipes.Recipe:
    """A manifest's schema (keys, types, ranges) and its fields against its name's recipe
    (RenderError, one line); returns the recipe."""
    if not isinstance(manifest, dict):
        raise RenderError(f"{where} is not a render manifest")
    missing = [k for k in KEYS if k not in manifest]
    if missing:
        raise RenderError(f"{where} is not a render manifest (no {missing[0]!r})")
    for key, low, high in (("replicas", 1, MAX_REPLICAS), ("batch", 1, None),
                           ("global_batch", 1, None), ("accum", 1, None), ("res", 1, None),
                           ("classes", 2, None)):
        value = manifest[key]
        if (isinstance(value, bool) or not isinstance(value, int) or value < low
                or (high is not None and value > high)):
            raise RenderError(f"{where}: {key} = {value!r}; expected an int >= {low}"
                              + (f" and <= {high}" if high is not None else ""))
    for key, allowed in (("precision", PRECISIONS), ("platform", PLATFORMS),
                         ("control", tuple(CONTROLS))):
        if manifest[key] not in allowed:
            raise RenderError(f"{where}: {key} = {manifest[key]!r}; expected one of {allowed}")
    try:
        recipe = recipes.parse(manifest["name"])
    except UsageError as e:
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
    _check_batch_rows(manifest, where)
    return recipe


def _check_batch_rows(manifest: dict, where: str) -> None:
    """The fields a step's batch is built from — accum, res, classes — against the manifest's own
    xs [k, R N, res, res, 3] and ts [k, R N, K] rows, to which the program's signature is held
    when it loads: a field edited alone is refused here, before JAX starts, not by the step's
    signature once a tie has compiled and run its single-device side. (R N is held by the
    program's device count and the name's N; rows that are not there, by the signature.)"""
    shapes = {r["name"]: r["shape"] for r in manifest["inputs"] if isinstance(r["name"], str)}
    xs, ts = shapes.get("xs"), shapes.get("ts")
    held = []
    if isinstance(xs, list) and len(xs) == 5:
        held += [("accum", xs[0]), ("res", xs[2]), ("res", xs[3])]
    if isinstance(ts, list) and len(ts) == 3:
        held += [("accum", ts[0]), ("classes", ts[2])]
    for key, have in held:
        if manifest[key] != have:
            raise RenderError(f"{where}: {key} = {manifest[key]!r} contradicts its inputs "
                              f"(xs {xs}, ts {ts})")
