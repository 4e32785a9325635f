"""IREE (the [iree] extra): a render's StableHLO compiled for IREE's llvm-cpu backend, run by
IREE's runtime — the same train step with no XLA in the loop (docs/renders.md, "IREE").

Single-device renders only: IREE reads neither Shardy's ``sdy`` dialect (the mesh and manual
computation of an R > 1 render) nor GSPMD's sharding annotations, and its local CPU driver has
no collectives (docs/renders.md states the errors).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from importlib import metadata

import numpy as np

from twinstep.errors import BackendError

INSTALL = "pip install -e '.[iree]' in twinstep's clone"
INPUT_TYPE = "stablehlo"
# IREE's CPU code for this machine's instruction set (a .vmfb is as portable as -march=native)
FLAGS = ("--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu",
         "--iree-llvmcpu-target-cpu=host")
# IREE demotes f64 to f32 by default. Its embedded ELF links no libm for f64 (the cosine
# schedule's f64 cos is left undefined), so f64 programs link as system shared libraries, with
# the system's linker, and resolve cos from the process's libm. And in f64 programs that draw
# masks, IREE 3.13's hoisting of constant expressions into globals leaves one unset when the
# step first reads it (the runtime fails: "indirect buffer reference slot 0 is out range of the
# declared binding capacity"), so f64 programs compute those expressions in the step.
F64_FLAGS = ("--iree-input-demote-f64-to-f32=false", "--iree-llvmcpu-link-embedded=false",
             "--iree-opt-const-expr-hoisting=false")
DRIVER = "local-task"  # the multithreaded CPU driver


def _compiler():
    try:  # lazy: the [iree] extra, maybe absent (a BackendError in one line)
        from iree.compiler import tools
    except ImportError:
        raise BackendError(f"IREE's compiler is not installed: {INSTALL}") from None
    return tools


def _runtime():
    try:  # lazy: the [iree] extra, maybe absent (a BackendError in one line)
        import iree.runtime as rt
    except ImportError:
        raise BackendError(f"IREE's runtime is not installed: {INSTALL}") from None
    return rt


def version() -> str:
    """The installed IREE compiler's version (what a manifest records)."""
    _compiler()
    return metadata.version("iree-base-compiler")


def flags(precision: str) -> list[str]:
    """iree-compile's flags for a render of ``precision`` (f32, bf16, f64), as a command line
    would give them."""
    return [f"--iree-input-type={INPUT_TYPE}", *_target_flags(precision)]


def _target_flags(precision: str) -> list[str]:
    return [*FLAGS, *(F64_FLAGS if precision == "f64" else ())]


def compile_mlir(mlir: str, precision: str) -> bytes:
    """The .vmfb (IREE's VM flatbuffer) of a render's StableHLO text; BackendError with the
    compiler's first error line when IREE cannot compile it."""
    tools = _compiler()
    with tempfile.TemporaryDirectory(prefix="twinstep-iree-") as tmp:
        src, out = os.path.join(tmp, "step.mlir"), os.path.join(tmp, "step.vmfb")
        with open(src, "w") as f:
            f.write(mlir)
        try:
            tools.compile_file(src, output_file=out, input_type=INPUT_TYPE,
                               extra_args=_target_flags(precision))
        except tools.CompilerToolError as e:
            lines = [ln.strip() for ln in str(e).splitlines() if "error" in ln]
            raise BackendError("iree-compile failed: " + (lines[0] if lines else
                                                          str(e).splitlines()[0])) from None
        with open(out, "rb") as f:
            return f.read()


def load(vmfb: bytes) -> Callable[..., list[np.ndarray]]:
    """The compiled step as a function of host arrays (the manifest's inputs, in order) to host
    arrays (its outputs, in order), on IREE's CPU driver."""
    rt = _runtime()
    # Loading a system-library module (f64) leaves an empty $TMPDIR/iree_dylib_XXXXXX behind:
    # point IREE at a folder of ours for the load, then remove it (the library is loaded).
    scratch, before = tempfile.mkdtemp(prefix="twinstep-iree-"), os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = scratch
    try:
        module = rt.load_vm_flatbuffer(vmfb, driver=DRIVER)
    except (RuntimeError, ValueError) as e:
        raise BackendError(f"IREE's runtime cannot load the module: {e}") from None
    finally:
        if before is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = before
        shutil.rmtree(scratch, ignore_errors=True)
    main = module.main

    def call(*args: np.ndarray) -> list[np.ndarray]:
        try:  # asarray, not ascontiguousarray: that makes a 0-d array 1-d
            out = main(*(np.asarray(a, order="C") for a in args))
        except (RuntimeError, ValueError, IndexError) as e:  # IREE's status codes as Python's
            raise BackendError(f"IREE's runtime failed: {str(e).splitlines()[0]}") from None
        return [o.to_host() for o in (out if isinstance(out, (list, tuple)) else [out])]

    return call
