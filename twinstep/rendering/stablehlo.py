"""Reading StableHLO text: tensor types, the collectives by sync site, the convolutions and the
multiply-accumulates. The renders' manifests and `twinstep info` are written from these."""

from __future__ import annotations

import math
import re

from twinstep.collectives import SITES

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


def _find(loc: str, aliases: dict, pattern: re.Pattern, depth: int = 0) -> str | None:
    """The innermost match of ``pattern`` among the components of a location's name stack,
    following the location aliases it refers to."""
    text = aliases.get(loc, loc)
    found = pattern.findall(text)
    if found:
        return found[-1]
    if depth < 8:
        for ref in re.findall(r"#loc\d*", text):
            if ref != loc and (found := _find(ref, aliases, pattern, depth + 1)):
                return found
    return None


_CALL = re.compile(r"call @([\w.$-]+)\(")


def _in_loops(lines: list[str]) -> tuple[set[int], set[str]]:
    """(the line numbers inside a ``stablehlo.while``'s regions, the functions called from them,
    directly or through other functions). The scan over micro-steps lowers to such a loop, its
    body often outlined into a function that the loop calls."""
    inside: set[int] = set()
    for i, line in enumerate(lines):
        if "stablehlo.while(" not in line:
            continue
        indent = len(line) - len(line.lstrip())
        for j in range(i + 1, len(lines)):
            here = len(lines[j]) - len(lines[j].lstrip())
            if here <= indent and lines[j].strip() not in ("cond {", "} do {"):
                break
            inside.add(j)
    called = {c for i in inside for c in _CALL.findall(lines[i])}
    bodies: dict[str, list[str]] = {}
    function = None
    for line in lines:
        if (f := _FUNC.match(line)) is not None:
            function = f.group(1)
        elif function is not None:
            bodies.setdefault(function, []).append(line)
    frontier = list(called)
    while frontier:
        for c in _CALL.findall("\n".join(bodies.get(frontier.pop(), []))):
            if c not in called:
                called.add(c)
                frontier.append(c)
    return inside, called


def collectives(mlir: str) -> list[dict]:
    """Every collective op in StableHLO text: {"kind", "site", "in_loop", "operands": [(shape,
    dtype)], "bytes"} (bytes of this replica's operands; in_loop: in a while loop, i.e. the
    accumulation scan, which the text holds once for its k iterations). A collective with a
    reduction region has its signature on the line that closes the region,
    ``}) : (operands) -> results loc(...)``."""
    aliases = dict(_LOC_DEF.findall(mlir))
    lines = mlir.splitlines()
    loop_lines, loop_functions = _in_loops(lines)
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
        ref = loc.group(1) if loc else None
        ops.append({"kind": m.group(1),
                    "site": _find(ref, aliases, _SITE_COMPONENT) if ref else None,
                    "in_loop": i in loop_lines or function in loop_functions,
                    "operands": types, "bytes": _nbytes(types)})
    return ops


def _typed_ops(mlir: str, op: str):
    """The operand and result types, [(shape, dtype)], of every ``stablehlo.<op>`` line."""
    for line in mlir.splitlines():
        if f"stablehlo.{op}" in line:
            yield tensor_types(line.rsplit(" : ", 1)[1])


_KERNEL_DIMS = re.compile(r"dim_numbers = \[[^\]]*\]x\[([^\]]*)\]")


_LHS_DILATE = re.compile(r"lhs_dilate = \[([^\]]*)\]")


def convolutions(mlir: str) -> list[dict]:
    """Every ``stablehlo.convolution``: {"operands": [(shape, dtype)] x 2, "result": (shape,
    dtype), "kernel_out": the kernel's output-feature dimension, "lhs_dilate": the input's
    dilation, one factor per spatial dimension}."""
    out = []
    for line in mlir.splitlines():
        if "stablehlo.convolution(" in line:
            t = tensor_types(line.rsplit(" : ", 1)[1])
            kernel = [d.strip() for d in _KERNEL_DIMS.search(line).group(1).split(",")]
            dilate = _LHS_DILATE.search(line)
            out.append({"operands": t[:2], "result": t[2], "kernel_out": kernel.index("o"),
                        "lhs_dilate": tuple(int(d) for d in dilate.group(1).split(","))
                        if dilate else (1,)})
    return out


def macs(mlir: str, useful: bool = False) -> int:
    """Multiply-accumulates of the convolutions (|output| x |kernel| / its output features,
    e.g. I x kh x kw) and the dot products (|output| x contracted width). ``useful``: without
    the zeros a strided convolution's input gradient dilates its cotangent with (a convolution
    with ``lhs_dilate`` d multiplies a zero in all but 1 / prod(d) of its taps)."""
    total = sum(math.prod(c["result"][0]) * math.prod(c["operands"][1][0])
                // c["operands"][1][0][c["kernel_out"]]
                // (math.prod(c["lhs_dilate"]) if useful else 1) for c in convolutions(mlir))
    return total + sum(math.prod(out[0]) * lhs[0][-1]
                       for lhs, _, out in _typed_ops(mlir, "dot_general"))
