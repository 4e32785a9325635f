"""The levers: how a step's ops are lowered and what they keep between them — choices that
change how a program computes, never what (docs/precision.md#gpu-levers) — as one value.

Each field of `Levers` is one lever: its choices, a GPU's and every other platform's value,
its help and how a summary says it live on the field (`lever`), and one op reads it. Everything
else is generated from ``dataclasses.fields(Levers)``: `twinstep tie`'s flags and summary line,
the bench sweeps' options and A/B lists. A field left None takes the platform's value when a
program is built (`Levers.on`); an op only ever sees a resolved one.

Adding a lever: one `lever` field here, and the op that reads it from ``ctx.levers``
(`twinstep.nets.layers`); tie it in bf16 (``twinstep tie NET --precision bf16 --gpu-levers
--NAME VALUE``) before a GPU times it.
"""

from __future__ import annotations

import dataclasses

import jax

from twinstep.errors import UsageError
from twinstep.ops.activation import MASKS
from twinstep.ops.batchnorm import MOMENTS
from twinstep.ops.conv import DENSE_PATHS, DEPTHWISE_PATHS
from twinstep.ops.precision import STORES, Precision

GPU_PLATFORMS = ("gpu", "cuda", "rocm")  # jax.default_backend's gpu, jax.export's cuda, rocm


def lever(*, cpu, gpu, choices: tuple, help: str, says: str, candidates: tuple = ()):
    """A `Levers` field: ``cpu`` and ``gpu`` its values on every other platform and on a GPU,
    ``choices`` every value an op takes, ``candidates`` the values tied but not yet timed on a
    GPU (bench/gpu/kernel_profile.py times each), ``help`` its flag's help, ``says`` how a summary
    reads a value ("{}" the value)."""
    return dataclasses.field(default=None, metadata={
        "cpu": cpu, "gpu": gpu, "choices": choices, "help": help, "says": says,
        "candidates": candidates})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Levers:
    """One value per lever; None: the platform's (`on`). Checks itself on construction."""

    dense_path: str | None = lever(
        cpu="matmul", gpu="conv", choices=DENSE_PATHS, says="{} dense convolutions",
        help="how a dense convolution is lowered: one XLA convolution (conv, a GPU's: cuDNN) "
             "or windows times the kernel matrix (matmul, XLA:CPU's) (docs/platform.md)")
    depthwise_path: str | None = lever(
        cpu="shift", gpu="grouped", choices=DEPTHWISE_PATHS, says="{} depthwise",
        candidates=("phased", "shift-one-pass"),
        help="how a depthwise convolution is lowered: shift (XLA:CPU's), grouped (a GPU's: "
             "cuDNN), phased or shift-one-pass (GPU candidates) (docs/precision.md#gpu-levers)")
    crop_unread: bool | None = lever(
        cpu=True, gpu=False, choices=(True, False), says="unread padding cropped: {}",
        help="whether a strided convolution crops the padded row no window reads (the only "
             "form IREE compiles) or pads both sides (a GPU's) (docs/precision.md#gpu-levers)")
    bn_moments: str | None = lever(
        cpu="two-pass", gpu="one-pass", choices=MOMENTS, says="{} BN moments",
        help="how BN computes each shard's moments: two-pass, or one-pass E[x²] - E[x]² (a "
             "GPU's) (docs/precision.md#gpu-levers)")
    store: str | None = lever(
        cpu="dtype", gpu="dtype", choices=STORES, says="stored in {}", candidates=("bf16",),
        help="how activations and cotangents are stored between ops: in the precision's "
             "dtype, or rounded to bf16 as timm's AMP stores them (bf16 precision only; a GPU "
             "candidate, docs/precision.md#bf16-storage)")
    relu_mask: str | None = lever(
        cpu="bool", gpu="bool", choices=MASKS, says="ReLU masks as {}", candidates=("bits",),
        help="how each ReLU keeps its mask for the backward: a byte an element (bool) or a "
             "bit (bits: an eighth of the bytes; a GPU candidate, "
             "docs/precision.md#relu-masks-as-bits)")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and value not in f.metadata["choices"]:
                raise UsageError(f"unknown {f.name} {value!r}; choose from "
                                 f"{', '.join(map(str, f.metadata['choices']))}")

    @classmethod
    def of(cls, platform: str) -> Levers:
        """Every lever at ``platform``'s value: a GPU's on "gpu", "cuda" or "rocm", else
        every other platform's."""
        side = "gpu" if platform in GPU_PLATFORMS else "cpu"
        return cls(**{f.name: f.metadata[side] for f in dataclasses.fields(cls)})

    @classmethod
    def chosen(cls, *, gpu: bool = False, **given) -> Levers:
        """A GPU's levers (``gpu``) or the platform's, with the ``given`` ones not None in
        their place: what `twinstep tie`'s flags and the bench sweeps' options ask for."""
        base = cls.of("gpu") if gpu else cls()
        return dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})

    def on(self, platform: str | None = None) -> Levers:
        """Every lever resolved: the ones left None at ``platform``'s value (default: this
        process's backend — which starts JAX's, so call it once its devices are set)."""
        if all(getattr(self, f.name) is not None for f in dataclasses.fields(self)):
            return self
        if platform is None:
            platform = jax.default_backend()
        default = type(self).of(platform)
        return type(self)(**{f.name: getattr(default, f.name) if getattr(self, f.name) is None
                         else getattr(self, f.name) for f in dataclasses.fields(self)})

    def check(self, precision: Precision) -> None:
        """The rule between a lever and the precision (UsageError, one line): only bf16 stores
        in bf16."""
        if self.store == "bf16" and precision.name != "bf16":
            raise UsageError(f"store='bf16' needs the bf16 precision, not {precision.name!r} "
                             f"(only bf16 stores activations in bf16)")

    def given(self) -> dict:
        """{name: value} of the levers set (not None), in field order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}

    def describe(self) -> str:
        """What these levers set, for a summary line: "" for none; "a GPU's levers" when every
        lever a GPU sets otherwise is at a GPU's value, then each other one set, as its field
        ``says`` (e.g. "a GPU's levers, stored in bf16")."""
        given, gpu, cpu = self.given(), type(self).of("gpu"), type(self).of("cpu")
        gpu_own = [f.name for f in dataclasses.fields(self)
                   if getattr(gpu, f.name) != getattr(cpu, f.name)]
        parts = []
        if all(given.get(k) == getattr(gpu, k) for k in gpu_own):
            parts.append("a GPU's levers")
            given = {k: v for k, v in given.items() if v != getattr(gpu, k)}
        says = {f.name: f.metadata["says"] for f in dataclasses.fields(self)}
        return ", ".join(parts + [says[k].format(v) for k, v in given.items()])


def fields() -> tuple:
    """The levers' fields, in order: what flags, sweeps and summaries are generated from."""
    return dataclasses.fields(Levers)


def candidates() -> dict:
    """{"name=value": {name: value}} for every lever value tied but not yet timed on a GPU, in
    field order: the entries of bench/gpu/kernel_profile.py's A/B."""
    return {f"{f.name}={v}": {f.name: v} for f in fields() for v in f.metadata["candidates"]}
