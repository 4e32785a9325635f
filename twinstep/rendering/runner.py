"""Run a twinstep render with no model code: jax, numpy and the render's manifest only.

    python runner.py NAME.jaxexport --inputs IN.npz --outputs OUT.npz [--fast-compile]

IN.npz holds one array per input of the manifest (NAME.json beside the render), by name:
every state leaf ("step", "params/conv1.weight", ...), "xs", "ts" and "key". OUT.npz receives
one array per output: the state after the step, "loss" and "lr". The render runs on the first
R devices (on CPU this script asks XLA for R virtual devices), its arguments sharded as the
manifest's specs say. This file imports nothing from twinstep, so that it can be copied next to
a render and run where twinstep is not installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile

# XLA:CPU at -O0 with the loop emitters: the same numerics, a several times quicker compile and
# a slower run (twinstep's dp.FAST_COMPILE, repeated here because this file imports no twinstep;
# a test holds the two equal).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
# The exit statuses this script uses: twinstep's `ExitStatus` (docs/cli.md#exit-status), repeated
# by name for the same reason (a test holds them equal).
SUCCESS, USAGE, INTERNAL, INTERRUPTED = 0, 2, 3, 130


def _known(options: dict) -> dict:
    """``options`` less those this process's XLA does not know (it refuses them; JAX 0.12's has
    no legacy loop emitters), as twinstep's dp.compiler_options."""
    import jax  # lazy, a script's reason (run's, below); loaded by run already

    def compiles(option, value) -> bool:
        try:
            jax.jit(lambda x: x).lower(0.0).compile({option: value})
        except jax.errors.JaxRuntimeError:
            return False
        return True

    return {k: v for k, v in options.items() if compiles(k, v)}


class Refused(Exception):
    """Bad usage or input: one line on stderr, exit USAGE."""


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise Refused(f"cannot read {path}: {e.strerror}") from None


def load_checked(path: str) -> tuple[dict, bytes]:
    """(manifest, serialized program): NAME.mlir and NAME.jaxexport must have the sha256 their
    manifest NAME.json holds (twinstep writes the manifest last), or the set is refused."""
    if not path.endswith(".jaxexport"):
        raise Refused(f"{path}: a render is a NAME.jaxexport file")
    stem = path[:-len(".jaxexport")]
    try:
        manifest = json.loads(_read(stem + ".json"))
        files, replicas = manifest["files"], manifest["mesh"]["size"]
        inputs, outputs = manifest["inputs"], manifest["outputs"]
    except (ValueError, KeyError, TypeError) as e:
        raise Refused(f"{stem}.json is not a render manifest ({type(e).__name__}: {e})") from None
    if not (isinstance(replicas, int) and replicas >= 1 and isinstance(inputs, list)
            and isinstance(outputs, list)):
        raise Refused(f"{stem}.json is not a render manifest (mesh, inputs, outputs)")
    blobs = {s: _read(stem + s) for s in (".mlir", ".jaxexport")}
    for suffix, blob in blobs.items():
        entry = files.get(os.path.basename(stem + suffix)) if isinstance(files, dict) else None
        if not isinstance(entry, dict) or hashlib.sha256(blob).hexdigest() != entry.get("sha256"):
            raise Refused(f"{stem + suffix}: sha256 differs from its manifest's (a different or "
                          f"partly written render?)")
    return manifest, blobs[".jaxexport"]


def run(args) -> int:
    manifest, blob = load_checked(args.render)
    r = manifest["mesh"]["size"]
    if "jax" not in sys.modules:  # R virtual CPU devices (ignored by GPU backends)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={r}")
    # lazy, a script's reason: its usage and the render's files are checked before JAX loads
    # (this file imports nothing from twinstep, and no JAX at the top)
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    dtypes = {i["dtype"] for i in manifest["inputs"] + manifest["outputs"]}
    jax.config.update("jax_enable_x64", "float64" in dtypes)
    try:
        exported = jax.export.deserialize(bytearray(blob))
    except Exception as e:  # noqa: BLE001 - any failure to deserialize is a bad file
        raise Refused(f"{args.render} cannot be deserialized ({type(e).__name__})") from None
    signature = [(list(a.shape), str(a.dtype)) for a in exported.in_avals]
    if exported.nr_devices != r or signature != [(i["shape"], i["dtype"])
                                                 for i in manifest["inputs"]]:
        raise Refused(f"{args.render}: its devices or inputs differ from its manifest's")
    try:
        inputs = np.load(args.inputs)
    except (OSError, ValueError) as e:
        raise Refused(f"cannot read {args.inputs}: {e}") from None
    missing = [i["name"] for i in manifest["inputs"] if i["name"] not in inputs]
    if missing:
        raise Refused(f"{args.inputs} lacks inputs {missing[:3]}"
                      f"{' ...' if len(missing) > 3 else ''}")
    for i in manifest["inputs"]:  # no silent casts or broadcasts
        a = inputs[i["name"]]
        if list(a.shape) != i["shape"] or str(a.dtype) != i["dtype"]:
            raise Refused(f"input {i['name']} is {a.dtype}{list(a.shape)}; the render takes "
                          f"{i['dtype']}{i['shape']}")
    if len(jax.devices()) < r:
        raise Refused(f"the render runs on {r} devices; this process has {len(jax.devices())}")
    mesh = Mesh(np.array(jax.devices()[:r]), (manifest["mesh"]["axis"],))
    placed = [jax.device_put(inputs[i["name"]], NamedSharding(mesh, PartitionSpec(*i["spec"])))
              for i in manifest["inputs"]]
    outputs = jax.jit(exported.call,
                      compiler_options=_known(FAST_COMPILE) if args.fast_compile else None)(*placed)
    folder = os.path.dirname(os.path.abspath(args.outputs))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".render-", suffix=".npz")
    try:  # whole or absent: written aside, then renamed into place
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **{o["name"]: np.asarray(v)
                           for o, v in zip(manifest["outputs"], outputs, strict=True)})
        os.replace(tmp, args.outputs)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return SUCCESS


def main(argv=None) -> int:
    """Exit SUCCESS written, USAGE bad usage or input (argparse's errors too), INTERNAL an
    internal error, INTERRUPTED interrupted; errors are one line on stderr."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("render", help="NAME.jaxexport (NAME.json and NAME.mlir beside it)")
    p.add_argument("--inputs", required=True, help=".npz with one array per manifest input")
    p.add_argument("--outputs", required=True, help=".npz to write the outputs to")
    p.add_argument("--fast-compile", action="store_true",
                   help="compile at -O0: the same numerics, a quicker compile, a slower run")
    args = p.parse_args(argv)
    try:
        return run(args)
    except Refused as e:
        print(f"runner.py: {e}", file=sys.stderr)
        return USAGE
    except KeyboardInterrupt:
        print("runner.py: interrupted", file=sys.stderr)
        return INTERRUPTED
    except Exception as e:  # noqa: BLE001 - the verdict is the exit status, the cause one line
        print(f"runner.py: internal error: {type(e).__name__}: {e}", file=sys.stderr)
        return INTERNAL


if __name__ == "__main__":
    sys.exit(main())
