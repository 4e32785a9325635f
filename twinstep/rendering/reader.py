"""A render read back (docs/renders.md#running-a-render): the set NAME.mlir, NAME.jaxexport
(NAME.vmfb) and NAME.json trusted only when whole — the manifest checked, every file's sha256
the manifest's, the deserialized program's devices, platform and signature the ones it states —
and turned into a train step, `step` on XLA or `iree_step` on IREE's runtime, callable as
`twinstep.program.train_program`'s step.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from twinstep import dp
from twinstep import step as steps
from twinstep.errors import RenderError, UsageError
from twinstep.processes import cluster
from twinstep.rendering import iree
from twinstep.rendering import manifest as manifests

SUFFIXES = (".jaxexport", ".vmfb")  # XLA's serialized export; IREE's module
IREE_SUFFIX = ".vmfb"


def read_manifest(path: str) -> dict:
    """The manifest (NAME.json) of the render NAME.jaxexport or NAME.vmfb, its schema checked
    (`twinstep.rendering.manifest.check`; RenderError, one line) but not its files: enough to
    know, before JAX starts, how many devices it needs."""
    suffix = next((s for s in SUFFIXES if path.endswith(s)), None)
    if suffix is None:
        raise UsageError(f"{path}: a render is a NAME.jaxexport or NAME.vmfb file from "
                         f"'twinstep render'")
    where = path[:-len(suffix)] + ".json"
    try:
        with open(where) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read the render's manifest: {e}") from None
    manifests.check(manifest, where)
    return manifest


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise RenderError(f"cannot read {path}: {e.strerror}") from None


def load(path: str) -> tuple[jax.export.Exported, dict]:
    """(Exported, manifest) of NAME.jaxexport, trusted only when the set is whole: the manifest
    NAME.json beside it passes `twinstep.rendering.manifest.check`, NAME.mlir and NAME.jaxexport
    have the sha256 it holds, and the deserialized program's devices, platform and signature are
    the ones it states — all before anything runs (RenderError, one line)."""
    if not path.endswith(".jaxexport"):
        raise RenderError(f"{path}: a render is a NAME.jaxexport file")
    exported, manifest, _ = _load_set(path[:-len(".jaxexport")], path)
    return exported, manifest


def load_iree(path: str) -> tuple[bytes, jax.export.Exported, dict]:
    """(the IREE module, Exported, manifest) of NAME.vmfb from 'render --target iree', checked
    as `load` checks a set, NAME.vmfb's sha256 included."""
    if not path.endswith(IREE_SUFFIX):
        raise RenderError(f"{path}: an IREE render is a NAME{IREE_SUFFIX} file")
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
    manifests.check(manifest, stem + ".json")
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


def step(exported: jax.export.Exported, manifest: dict, fast_compile: bool = False,
         donate: bool = False):
    """A render's deserialized step as `twinstep.program.train_program`'s step: (state, xs, ts,
    key) -> (state, {"loss", "lr"}), its arguments checked against the manifest's signature
    (UsageError, one line) and placed on the first R devices as the manifest shards them —
    with several processes, on the R devices of every process's share
    (`twinstep.processes.cluster`), each process placing its own devices' shards."""
    r = manifest["replicas"]
    inputs = manifest["inputs"]
    state_args = tuple(range(len(inputs) - 3))  # all but xs, ts, key
    call = dp.jit(exported.call, fast_compile, donate=state_args if donate else ())
    mesh = dp.mesh(r) if r > 1 else None

    def place(args):
        if mesh is None:
            return args
        return cluster.placed(args, [NamedSharding(mesh, P(*i["spec"])) for i in inputs])

    return _flat_step(inputs, lambda args: cluster.run_together(call, *place(args)))


def iree_step(vmfb: bytes, exported: jax.export.Exported, manifest: dict):
    """A render's IREE module (NAME.vmfb, `twinstep.rendering.iree`) as `step` is, on
    IREE's CPU driver: host arrays in, host arrays out (single-device renders only). The
    module's main takes only the inputs the program reads (``exported.module_kept_var_idx``:
    jax.export drops the rest, e.g. the key of a step that draws no masks)."""
    if manifest["replicas"] != 1:
        raise UsageError("IREE runs single-device renders (R = 1) only")
    call, kept = iree.load(vmfb), sorted(exported.module_kept_var_idx)
    return _flat_step(manifest["inputs"], lambda args: [
        jax.numpy.asarray(o) for o in call(*(np.asarray(args[i]) for i in kept))])


def _flat_step(inputs: list[dict], call):
    """A train step over a flat render signature: state leaves, xs, ts and the key's
    data in (checked against the manifest's ``inputs``), state leaves, loss and lr out."""
    def run(state, xs, ts, key):
        leaves, treedef = jax.tree.flatten(state)
        args = [*leaves, xs, ts, jax.random.key_data(key)]
        names = steps.state_names(state) + ["xs", "ts", "key"]
        want = [(n, list(np.shape(a)), str(a.dtype)) for n, a in zip(names, args, strict=True)]
        have = [(i["name"], i["shape"], i["dtype"]) for i in inputs]
        if want != have:
            diff = next((w, h) for w, h in itertools.zip_longest(want, have) if w != h)
            raise UsageError(f"the render's inputs differ from this step's: it takes {diff[1]}"
                             f" where this step has {diff[0]}")
        *leaves, loss, lr = call(args)
        return jax.tree.unflatten(treedef, leaves), {"loss": loss, "lr": lr}

    return run
