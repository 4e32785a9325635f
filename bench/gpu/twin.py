"""The GPU's train step compiled here, without a GPU: what each kernel of it reads and writes.

XLA compiles for a GPU it cannot see when JAX is given the device's description (a target
config: `TARGETS`) and a CUDA compiler plugin is installed (`make gpu-twin` makes
``.venv-gpu``, with the JAX the lent GPU runs). The program is the one bench/gpu/step.py times
(``<net>in_adamdpbf16``, k = 1, one device, the state donated), built here on abstract
arguments; autotuning needs the device, so cuDNN and the GEMMs keep their default kernels, which
changes no fusion. The optimized HLO's kernels are every instruction of the entry computation and
of the loops it runs (times their trip count) that launches work. Each kernel moves, in this
model, its operands and its results once (an in-place update only its update), as whole arrays:
the HBM traffic of a step that L2 does not help, an upper bound on each kernel's own. The step
on one H100 is memory-bound (bench/RESULTS.md#gpu-profile), so bytes are where a lever that
moves fewer of them shows before a lease can time it — a prediction, never a timing.

Per net, ``twin_<net>_<res>.json`` under --out and a table: gigabytes and kernels by the
categories bench/gpu/kernel_profile.py times (`kernel_profile.category`), the --top kernels by
bytes (the op they come from, their result), and with --ab each lever of `kernel_profile.LEVERS`
against the default: its bytes in total and in fusions (XLA's fusions, copies and pads), and the
ratio of the totals. With --measured, a lease's profile (``profile_<net>.json``, bench/leases/)
beside the twin of the program it timed: each category's measured ms per step and the bandwidth
its bytes imply (bytes / time, which must stay under the device's peak for the model to hold),
and each A/B the lease timed, its speedup beside the bytes ratio of the same two programs here.
--write-results rewrites bench/RESULTS.md's section ``## GPU twin``.

    make gpu-twin                       # .venv-gpu: JAX and its CUDA plugin, ~1 GB
    .venv-gpu/bin/python bench/gpu/twin.py [--nets resnet50 mnv4] [--batch 512] [--res 224]
        [--target h100] [--ab] [--measured bench/leases/2026-12-05-h100] [--write-results]

Exit 0 when every net compiled, 2 without a CUDA plugin or on bad arguments, 3 when a compile
failed.
"""

from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import gzip
import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path


def deviceless_env() -> None:
    """What the compile needs set before JAX is imported (it finds its plugins then): the
    plugin's version check needs a driver, which a compile without the device does not;
    autotuning runs kernels on the device, so it is off (level 0)."""
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                        "--xla_gpu_autotune_level=0"]).strip()


if __name__ == "__main__":
    deviceless_env()
from bench.gpu.kernel_profile import CATEGORIES, LEVERS, category  # noqa: E402
from twinstep import program  # noqa: E402
from twinstep.nets import NETS  # noqa: E402
from twinstep.ops.levers import Levers  # noqa: E402

# XLA's GpuTargetConfig fields for the GPUs the leases lend, from NVIDIA's datasheets (SXM
# parts): SMs, boost clock, HBM bandwidth and size, L2; every Hopper SM has the same limits.
HOPPER_SM = {"threads_per_block_limit": 1024, "threads_per_warp": 32,
             "shared_memory_per_block": 48 * 1024, "shared_memory_per_block_optin": 227 * 1024,
             "shared_memory_per_core": 228 * 1024, "threads_per_core_limit": 2048,
             "fpus_per_core": 128, "registers_per_core_limit": 65536,
             "registers_per_block_limit": 65536, "block_dim_limit_x": 2**31 - 1,
             "block_dim_limit_y": 65535, "block_dim_limit_z": 65535}
TARGETS = {
    "h100": {"description": "NVIDIA H100 80GB HBM3", "core_count": 132, "clock_rate_ghz": 1.98,
             "memory_bandwidth": 3.35e12, "device_memory_size": 80 * 2**30,
             "l2_cache_size": 50 * 2**20},
    "h200": {"description": "NVIDIA H200", "core_count": 132, "clock_rate_ghz": 1.98,
             "memory_bandwidth": 4.8e12, "device_memory_size": 141 * 10**9,
             "l2_cache_size": 50 * 2**20},
}
# the compile's CUDA and cuDNN versions: the lent GPU's (CUDA 13, cuDNN 9)
RUNTIME = {"cuda": (13, 0), "cudnn": (9, 10)}

_TYPE = re.compile(r"\b(pred|[su](?:4|8|16|32|64)|f8e\w+|bf16|f16|f32|f64|c64|c128)\[([\d,]*)\]")
_WIDTH = {"pred": 1, "bf16": 2, "f16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16}
# instructions that launch nothing: names, tuples, views and the control flow around kernels
_NO_KERNEL = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while",
              "conditional", "call", "after-all", "opt-barrier", "partition-id", "replica-id",
              "add-dependency", "domain"}


def target_config(name: str) -> str:
    """The text-format GpuTargetConfig proto of `TARGETS` ``name``."""
    t = TARGETS[name]
    info = {**HOPPER_SM, "core_count": t["core_count"], "clock_rate_ghz": t["clock_rate_ghz"],
            "memory_bandwidth": int(t["memory_bandwidth"]),
            "device_memory_size": int(t["device_memory_size"]),
            "l2_cache_size": int(t["l2_cache_size"])}
    fields = "\n".join(f"  {k}: {v}" for k, v in info.items())
    return (f"gpu_device_info {{\n{fields}\n  cuda_compute_capability {{ major: 9 }}\n}}\n"
            f'platform_name: "CUDA"\n'
            f"dnn_version_info {{ major: {RUNTIME['cudnn'][0]} minor: {RUNTIME['cudnn'][1]} }}\n"
            f"runtime_version {{ major: {RUNTIME['cuda'][0]} minor: {RUNTIME['cuda'][1]} }}\n"
            f'device_description_str: "{t["description"]}"\n')


def cuda_plugin() -> str | None:
    """The installed CUDA PJRT plugin's module, or None."""
    for name in ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"):
        try:  # a dotted name imports its parent package, which may be missing too
            if importlib.util.find_spec(name) is not None:
                return name
        except ModuleNotFoundError:
            return None
    return None


def compile_step(net_name: str, batch: int, res: int, classes: int, target: str,
                 **levers) -> str:
    """The optimized HLO text of the bf16 train step (step.build's program) at ``batch``
    examples of ``res``², compiled for ``target`` without its device; ``levers``: the
    `twinstep.ops.levers.Levers` set over a GPU's."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies

    from twinstep import recipes
    from twinstep.nets import get_net

    topology = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                            target_config=target_config(target))
    where = jax.sharding.SingleDeviceSharding(topology.devices[0])

    def placed(tree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where),
                            tree)

    recipe = dataclasses.replace(recipes.parse(f"{net_name}in_adamdpbf16"), batch=batch)
    setup = program.Setup(precision="bf16", levers=Levers.chosen(gpu=True, **levers))
    made = program.train_program(get_net(net_name), recipe, setup, classes=classes, donate=True)
    xs = jax.ShapeDtypeStruct((1, batch, res, res, 3), jnp.float32, sharding=where)
    ts = jax.ShapeDtypeStruct((1, batch, classes), jnp.float32, sharding=where)
    key = placed(jax.eval_shape(lambda: jax.random.key(1)))
    return made.step.lower(placed(made.state), xs, ts, key).compile().as_text()


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    type: str  # the result's type text: an array type or a tuple of them
    opcode: str
    operands: tuple[str, ...]
    attributes: str  # everything after the operands


def type_bytes(text: str, workspace: bool = True) -> int:
    """Bytes of every array in a type's text (``f32[2,3]{1,0}``, or a tuple of arrays);
    ``workspace=False`` leaves out u8 arrays (a custom-call's scratch)."""
    total = 0
    for dtype, dims in _TYPE.findall(text):
        if dtype == "u8" and not workspace:
            continue
        width = _WIDTH.get(dtype) or max(1, int(re.sub(r"\D", "", dtype) or 8) // 8)
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        total += width * count
    return total


def _closing(text: str, start: int) -> int:
    """The index just past the bracket that closes the one opening at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        depth += text[i] in "({"
        depth -= text[i] in ")}"
        if depth == 0:
            return i + 1
    return len(text)


def parse_instruction(line: str) -> Instruction | None:
    m = re.match(r"\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*", line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):
        end = _closing(rest, 0)
        type_text, rest = rest[:end], rest[end:].lstrip()
    else:
        type_text, _, rest = rest.partition(" ")
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
        return None
    end = _closing(rest, op.end() - 1)
    operands = tuple(re.findall(r"%([\w.\-]+)", rest[op.end():end - 1]))
    return Instruction(m.group(1), type_text, op.group(1), operands, rest[end:])


def computations(hlo: str) -> tuple[str, dict[str, list[Instruction]]]:
    """(the entry computation's name, {name: its instructions}) of an HLO module's text."""
    comps, entry, current = {}, None, None
    for line in hlo.splitlines():
        head = re.match(r"(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            current = comps.setdefault(head.group(2), [])
            entry = head.group(2) if head.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            instruction = parse_instruction(line)
            if instruction:
                current.append(instruction)
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text")
    return entry, comps


def _trip_count(attributes: str) -> int:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', attributes)
    return int(m.group(1)) if m else 1


def kernels(hlo: str) -> list[dict]:
    """Every kernel of an optimized HLO module (see the module docstring): name, category,
    bytes (per step, its loop's trip count included), result type, the jax op it comes from."""
    entry, comps = computations(hlo)
    types = {i.name: i.type for instrs in comps.values() for i in instrs}
    roots = {name: instrs[-1] for name, instrs in comps.items() if instrs}
    out, stack = [], [(entry, 1)]
    while stack:
        comp, times = stack.pop()
        for i in comps.get(comp, []):
            called = dict(re.findall(r"\b(body|condition|to_apply)=%([\w.\-]+)", i.attributes))
            if i.opcode == "while":
                stack += [(called["body"], times * _trip_count(i.attributes)),
                          (called["condition"], times)]
            elif i.opcode == "conditional":
                stack += [(c, times) for c in re.findall(r"%([\w.\-]+)", " ".join(
                    re.findall(r"(?:branch_computations=\{[^}]*\}|_computation=%[\w.\-]+)",
                               i.attributes)))]
            elif i.opcode == "call" and "to_apply" in called:
                stack.append((called["to_apply"], times))
            if i.opcode in _NO_KERNEL:
                continue
            fused = re.search(r"\bcalls=%([\w.\-]+)", i.attributes)
            root = roots.get(fused.group(1)) if fused else None
            if root is not None and root.opcode == "dynamic-update-slice":
                # in place: reads and writes the update, not the buffer it lands in
                moved = 2 * sum(type_bytes(types.get(o, "")) for o in i.operands[1:])
            else:
                moved = (type_bytes(i.type, workspace=i.opcode != "custom-call")
                         + sum(type_bytes(types.get(o, "")) for o in i.operands))
            source = re.search(r'op_name="([^"]*)"', i.attributes)
            out.append({"name": i.name, "category": category(i.name, ""),
                        "bytes": moved * times, "result": re.sub(r"\{[^}]*\}", "", i.type),
                        "op": (source.group(1).split("/")[-1] if source else "")})
    return out


def account(found: list[dict], top: int) -> dict:
    """{"gb": total, "categories": {name: {"gb", "kernels"}}, "top": the ``top`` by bytes}."""
    gb, count = collections.Counter(), collections.Counter()
    for k in found:
        gb[k["category"]] += k["bytes"] / 1e9
        count[k["category"]] += 1
    ordered = [c for c, _ in CATEGORIES if c in gb] + (["other"] if "other" in gb else [])
    return {"gb": sum(gb.values()), "kernels": len(found),
            "categories": {c: {"gb": gb[c], "kernels": count[c]} for c in ordered},
            "top": sorted(found, key=lambda k: -k["bytes"])[:top]}


def _value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _lever(key: str) -> dict:
    """``"crop_unread=False"`` -> {"crop_unread": False}, as a lease's A/B names its lever."""
    name, _, value = key.partition("=")
    return {name: _value(value)}


def twin_net(net_name: str, args) -> dict:
    """One net's twin: its accounts, its levers' and, with --measured, the lease's programs."""
    def accounted(**levers) -> dict:
        return account(kernels(compile_step(net_name, args.batch, args.res, args.classes,
                                            args.target, **levers)), 0)

    t0 = time.perf_counter()
    hlo = compile_step(net_name, args.batch, args.res, args.classes, args.target)
    out = {"net": net_name, "target": args.target, "batch": args.batch, "res": args.res,
           "compile_s": time.perf_counter() - t0, **account(kernels(hlo), args.top)}
    if args.hlo:
        with gzip.open(args.out / f"twin_hlo_{net_name}_{args.res}.txt.gz", "wt") as f:
            f.write(hlo)
    if args.ab:
        out["ab"] = {}
        for lever, (kwargs, nets) in LEVERS.items():
            if net_name in nets:
                out["ab"][lever] = _ab(out, accounted(**kwargs))
    if args.measured:
        out["measured"] = measured(net_name, args, accounted)
    return out


def _ab(default: dict, lever: dict) -> dict:
    fusions = ("XLA fusions", "copies and pads")
    moved = {name: sum(a["categories"].get(c, {}).get("gb", 0.0) for c in fusions)
             for name, a in (("default", default), ("lever", lever))}
    return {"gb": lever["gb"], "default_gb": default["gb"],
            "fusion_gb": moved["lever"], "default_fusion_gb": moved["default"],
            "bytes_ratio": default["gb"] / lever["gb"]}


def measured(net_name: str, args, accounted) -> dict:
    """A lease's profile of ``net_name`` beside the twin of the program it timed: the lease's
    default was the step without the levers adopted since (`kernel_profile.LEVERS`' first), and
    each of its A/B levers was timed over that default. ``accounted(**levers)``: the account
    of ``net_name``'s step with those levers."""
    path = args.measured / f"profile_{net_name}.json"
    lease = json.loads(path.read_text())
    if (lease["batch"], lease["res"]) != (args.batch, args.res):
        raise ValueError(f"{path} timed batch {lease['batch']} at {lease['res']}², not "
                         f"{args.batch} at {args.res}²")
    before = next(iter(LEVERS.values()))[0]
    then = accounted(**before)
    rows = {}
    for name, c in lease["categories"].items():
        gb = then["categories"].get(name, {}).get("gb", 0.0)
        rows[name] = {"ms_per_step": c["ms_per_step"], "gb": gb,
                      "implied_gb_s": gb / (c["ms_per_step"] / 1e3) if c["ms_per_step"] else 0}
    ab = {}
    for key, timed in lease.get("ab", {}).items():
        ab[key] = {"speedup": timed["speedup"], **_ab(then, accounted(**{**before, **_lever(key)}))}
    return {"lease": str(path), "device": lease["device"], "jax": lease["jax"],
            "step_ms": lease["step_ms"], "gb": then["gb"],
            "implied_gb_s": then["gb"] / (lease["step_ms"] / 1e3),
            "categories": rows, "ab": ab}


def print_twin(t: dict) -> None:
    print(f"{t['net']}: batch {t['batch']} at {t['res']}², compiled for {t['target']} "
          f"without it in {t['compile_s']:.0f} s: {t['kernels']} kernels, {t['gb']:.1f} GB a "
          f"step", flush=True)
    for name, c in t["categories"].items():
        print(f"  {name:22s} {c['gb']:8.2f} GB {c['kernels']:5d} kernels", flush=True)
    for k in t["top"]:
        print(f"    {k['bytes'] / 1e9:7.2f} GB  {k['name']:40s} {k['result'][:48]:48s} "
              f"{k['op']}", flush=True)
    for lever, r in t.get("ab", {}).items():
        print(f"  A/B {lever}: {r['gb']:.1f} against {r['default_gb']:.1f} GB, in fusions "
              f"{r['fusion_gb']:.1f} against {r['default_fusion_gb']:.1f} GB, bytes ratio "
              f"{r['bytes_ratio']:.3f}", flush=True)
    m = t.get("measured")
    if m:
        print(f"  the lease ({m['device']}, JAX {m['jax']}): {m['step_ms']:.1f} ms a step, "
              f"{m['gb']:.1f} GB here, {m['implied_gb_s']:,.0f} GB/s implied", flush=True)
        for name, c in m["categories"].items():
            print(f"    {name:22s} {c['ms_per_step']:7.2f} ms {c['gb']:7.2f} GB "
                  f"{c['implied_gb_s']:8,.0f} GB/s", flush=True)
        for lever, r in m["ab"].items():
            print(f"    A/B {lever}: timed speedup {r['speedup']:.3f}, bytes ratio "
                  f"{r['bytes_ratio']:.3f} (fusions {r['default_fusion_gb']:.1f} -> "
                  f"{r['fusion_gb']:.1f} GB)", flush=True)


def results_table(twins: list[dict]) -> str:
    """The markdown of ``## GPU twin``: bytes by category and each lever's ratio per net."""
    lines = ["| net | category | GB a step | kernels | lease ms a step | implied GB/s |",
             "|---|---|---:|---:|---:|---:|"]
    for t in twins:
        m = t.get("measured", {}).get("categories", {})
        for name, c in t["categories"].items():
            lease = m.get(name)
            lines.append(f"| {t['net']} | {name} | {c['gb']:.2f} | {c['kernels']} | "
                         + (f"{lease['ms_per_step']:.2f} | {lease['implied_gb_s']:,.0f} |"
                            if lease else "— | — |"))
    lines += ["", "| net | lever | GB a step (default) | in fusions (default) | bytes ratio "
              "| the lease's timed speedup |", "|---|---|---:|---:|---:|---:|"]
    for t in twins:
        for lever, r in t.get("ab", {}).items():
            lines.append(f"| {t['net']} | {lever} | {r['gb']:.1f} ({r['default_gb']:.1f}) | "
                         f"{r['fusion_gb']:.1f} ({r['default_fusion_gb']:.1f}) | "
                         f"{r['bytes_ratio']:.3f} | — |")
        for lever, r in t.get("measured", {}).get("ab", {}).items():
            lines.append(f"| {t['net']} | {lever}, over the lease's default | {r['gb']:.1f} "
                         f"({r['default_gb']:.1f}) | {r['fusion_gb']:.1f} "
                         f"({r['default_fusion_gb']:.1f}) | {r['bytes_ratio']:.3f} | "
                         f"{r['speedup']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nets", nargs="+", default=["resnet50", "mnv4"], choices=list(NETS),
                   help="any of the catalogue's nets (default: resnet50 mnv4)")
    p.add_argument("--batch", type=int, default=512, help="examples a step (default 512)")
    p.add_argument("--res", type=int, default=224, help="image side (default 224)")
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--target", default="h100", choices=sorted(TARGETS),
                   help="the GPU compiled for (default: h100, the first lease's)")
    p.add_argument("--top", type=int, default=15, help="kernels listed by bytes")
    p.add_argument("--ab", action="store_true",
                   help=f"also each lever against the default ({', '.join(LEVERS)})")
    p.add_argument("--measured", type=Path, metavar="LEASE_DIR",
                   help="a lease's profile_<net>.json files, set beside their twins")
    p.add_argument("--hlo", action="store_true", help="also write the optimized HLO, gzipped")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "profile",
                   help="where twin_<net>_<res>.json go (default: bench/profile)")
    p.add_argument("--write-results", action="store_true",
                   help="rewrite bench/RESULTS.md's section '## GPU twin'")
    args = p.parse_args(argv)
    if cuda_plugin() is None:
        print("gpu_twin: no CUDA plugin for JAX in this Python; `make gpu-twin` makes "
              ".venv-gpu with one", file=sys.stderr)
        return 2
    if args.batch < 1 or args.res < 32 or args.classes < 2:
        print("gpu_twin: --batch must be >= 1, --res >= 32 and --classes >= 2", file=sys.stderr)
        return 2
    if args.measured and not args.measured.is_dir():
        print(f"gpu_twin: --measured {args.measured}: no such directory", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    twins, failed = [], 0
    for net_name in args.nets:
        try:
            twin = twin_net(net_name, args)
        except Exception as e:  # one net's failure keeps the other's result
            print(f"{net_name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}",
                  file=sys.stderr, flush=True)
            failed += 1
            continue
        (args.out / f"twin_{net_name}_{args.res}.json").write_text(json.dumps(twin, indent=1))
        print_twin(twin)
        twins.append(twin)
    if args.write_results and twins:
        import jax

        from bench.common import RESULTS, write_results

        command = "python bench/gpu/twin.py " + " ".join(argv if argv is not None
                                                         else sys.argv[1:])
        write_results(RESULTS, "GPU twin",
                      f"The bf16 train step compiled for one {TARGETS[args.target]['description']}"
                      f" on this machine, without one (JAX {jax.__version__}): batch "
                      f"{args.batch} at {args.res}², bytes each kernel reads and writes, "
                      "a model of HBM traffic (bench/gpu/twin.py).",
                      command, results_table(twins))
    return 3 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
