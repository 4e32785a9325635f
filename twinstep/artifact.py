"""Run a twinstep render with no model code: jax, numpy and the render's manifest only.

    python artifact.py NAME.jaxexport --inputs IN.npz --outputs OUT.npz [--fast-compile]

IN.npz holds one array per input of the manifest (NAME.json beside the artifact), by name:
every state leaf ("step", "params/conv1.weight", ...), "xs", "ts" and "key". OUT.npz receives
one array per output: the state after the step, "loss" and "lr". The artifact runs on the first
R devices (on CPU this script asks XLA for R virtual devices), its arguments sharded as the
manifest's specs say. This file imports nothing from twinstep, so that it can be copied next to
an artifact and run where twinstep is not installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

# XLA:CPU at -O0 with the loop emitters: the same numerics, a several times quicker compile and
# a slower run (twinstep's dp.FAST_COMPILE, repeated here because this file imports no twinstep;
# a test holds the two equal).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", help="NAME.jaxexport (NAME.json must lie beside it)")
    p.add_argument("--inputs", required=True, help=".npz with one array per manifest input")
    p.add_argument("--outputs", required=True, help=".npz to write the outputs to")
    p.add_argument("--fast-compile", action="store_true",
                   help="compile at -O0: the same numerics, a quicker compile, a slower run")
    args = p.parse_args(argv)
    if not args.artifact.endswith(".jaxexport"):
        p.error(f"{args.artifact}: an artifact is a NAME.jaxexport file")
    try:
        with open(args.artifact[:-len(".jaxexport")] + ".json") as f:
            manifest = json.load(f)
        with open(args.artifact, "rb") as f:
            blob = f.read()
    except (OSError, ValueError) as e:
        p.error(f"cannot read the artifact and its manifest: {e}")
    digest = manifest["files"].get(os.path.basename(args.artifact), {}).get("sha256")
    if hashlib.sha256(blob).hexdigest() != digest:
        p.error(f"{args.artifact}: sha256 differs from its manifest's (a different render?)")
    r = manifest["mesh"]["size"]
    if "jax" not in sys.modules:  # R virtual CPU devices (ignored by GPU backends)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={r}")
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    dtypes = {i["dtype"] for i in manifest["inputs"] + manifest["outputs"]}
    jax.config.update("jax_enable_x64", "float64" in dtypes)
    exported = jax.export.deserialize(bytearray(blob))
    inputs = np.load(args.inputs)
    missing = [i["name"] for i in manifest["inputs"] if i["name"] not in inputs]
    if missing:
        p.error(f"{args.inputs} lacks inputs {missing[:3]}{' ...' if len(missing) > 3 else ''}")
    for i in manifest["inputs"]:  # no silent casts or broadcasts
        a = inputs[i["name"]]
        if list(a.shape) != i["shape"] or str(a.dtype) != i["dtype"]:
            p.error(f"input {i['name']} is {a.dtype}{list(a.shape)}; the artifact takes "
                    f"{i['dtype']}{i['shape']}")
    mesh = Mesh(np.array(jax.devices()[:r]), (manifest["mesh"]["axis"],))
    placed = [jax.device_put(inputs[i["name"]], NamedSharding(mesh, PartitionSpec(*i["spec"])))
              for i in manifest["inputs"]]
    outputs = jax.jit(exported.call,
                      compiler_options=FAST_COMPILE if args.fast_compile else None)(*placed)
    np.savez(args.outputs, **{o["name"]: np.asarray(v)
                              for o, v in zip(manifest["outputs"], outputs, strict=True)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
