"""Test session set-up: float64 for the exact checks, 8 virtual CPU devices for the replica
programs (both before JAX's first operation), a deterministic hypothesis profile so CI draws the
same shapes every run, and the tiers.

Tiers (markers, pyproject.toml): ``slow`` compiles a whole network, ``oracle``, ``iree`` and
``nvimgcodec`` run an extra's library, ``gpu_twin`` compiles for a GPU in ``.venv-gpu``,
``process`` runs twinstep commands whole in processes of their own (10 s or more each: the
inner loop leaves them to `make test`), ``all`` belongs to the exhaustive matrix.
The Makefile's FAST_MARKERS and TEST_MARKERS select `make test-fast` and `make test`; `make
test-all` runs everything, with TWINSTEP_HYPOTHESIS=all for the whole-network sweeps' random draws
(`SWEEP_PHASES`). What each tier runs: the README's table (tests/tiers.py).
"""

import os

# Each pytest worker's share of the cores for torch's OpenMP threads and numpy's BLAS: idle
# OpenMP threads spin, so two workers' torch at two threads each on two cores run several
# times slower than at one each, and slow an XLA program beside them too. Set before either
# library starts (torch is imported on first use, oracle_libs); the CLI processes tests start
# inherit it.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

from twinstep import dp  # noqa: E402
from twinstep.checking import tie  # noqa: E402

dp.ensure_devices(8)

import ctypes  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import oracle_libs  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, Phase, settings  # noqa: E402

settings.register_profile("twinstep", derandomize=True, deadline=None, max_examples=12,
                          suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.load_profile("twinstep")
# the whole-network sweeps: their explicit examples in `make test`, random draws too in test-all
SWEEP_PHASES = (tuple(Phase) if os.environ.get("TWINSTEP_HYPOTHESIS") == "all"
                else (Phase.explicit,))


# XLA at -O0 (dp.FAST_COMPILE, the same numerics) halves a compile and runs the program 14-18x
# slower (bench/probes/opt_level.py): it pays only for programs that run a few times, as a
# one-step tie's do for both nets (tests/test_tie.py, tests/test_sweep.py compile them so). Of
# whole steps, MobileNetV4's are dominated by compiling; ResNet-50's by running, so they run at
# the default (its R = 4 whole-step tie: 148 s at -O0, 34 s at the default). ResNet-18's small
# steps, which the process tests run, are compiling's too (a 3-step f64 run at 32²: 25 s cold
# at -O0, 32 s at the default). The other mobile nets' steps, depthwise as MobileNetV4's, too.
FAST_COMPILE_NETS = {"mnv4", "mnv4s", "mnv4l", "mobilenetv2", "efficientnet", "resnet18"}

_LIBC = ctypes.CDLL("libc.so.6")


def _importable(*modules: str):
    def present() -> bool:
        try:  # a dotted name imports its parent package, which may be missing too
            return all(importlib.util.find_spec(m) is not None for m in modules)
        except ModuleNotFoundError:
            return False
    return present


# marker -> whether its extra is installed, and the line that refuses a run without it
EXTRAS = (
    ("oracle", oracle_libs.available, oracle_libs.MISSING),
    ("iree", _importable("iree.compiler", "iree.runtime"),
     "the iree tests need IREE: install the [iree] extra, or run `make test-fast`, which leaves "
     "them out"),
    ("nvimgcodec", _importable("nvidia.nvimgcodec"),
     "the nvimgcodec tests need nvImageCodec: install the [nvimgcodec] extra, or run `make "
     "test-fast`, which leaves them out"),
    ("gpu_twin", (Path(__file__).resolve().parent.parent / ".venv-gpu" / "bin" / "python").exists,
     "the gpu_twin tests need .venv-gpu (JAX's CUDA plugin): `make .venv-gpu/.installed`, or run "
     "`make test-fast`, which leaves them out"),
)


@pytest.hookimpl(trylast=True)  # after -m has deselected and xdist has named the groups
def pytest_collection_modifyitems(config, items):
    for marker, present, missing in EXTRAS:  # a selected test of an extra never skips
        if (not config.option.collectonly and not present()
                and any(i.get_closest_marker(marker) for i in items)):
            raise pytest.UsageError(missing)
    # a group's heavy tests share one worker (and its memory); xdist marks them "...@group"
    grouping = getattr(config.option, "loadgroup", False)  # set on xdist's workers
    if grouping and any(i.get_closest_marker("xdist_group") and "@" not in i.nodeid
                        for i in items):
        raise pytest.UsageError(f"pytest-xdist's --dist loadgroup did not group the tests under "
                                f"pytest {pytest.__version__}: install pytest < 9.2")
    # the compiling tests first (a stable sort: each keeps its place among its kind): xdist deals
    # tests out in this order, so the quick ones fill the end instead of one worker idling while
    # the other finishes a long test
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture
def grad_program_text():
    """(net name, `twinstep.program.Setup`) -> the StableHLO of that gradient step, lowered on
    abstract inputs (N = 2, 32², K = 10): what a lever puts in a whole net's program."""
    from twinstep import program
    from twinstep.nets import get_net

    def text(net_name: str, setup) -> str:
        net = get_net(net_name)
        params, buffers = program.abstract_params(net, 10, jax.numpy.float32)
        x = jax.ShapeDtypeStruct((2, 32, 32, 3), jax.numpy.float32)
        t = jax.ShapeDtypeStruct((2, 10), jax.numpy.float32)
        return program.grad_program(net, setup).lower(params, buffers, x, t).as_text()
    return text


@pytest.fixture
def rng():
    return np.random.default_rng(20261129)


def _release() -> None:
    jax.clear_caches()
    tie.single_side.cache_clear()  # a tie's inputs and single-device results
    gc.collect()
    _LIBC.malloc_trim(0)  # hand the freed heap back: a worker's RSS would stay at its peak


@pytest.fixture
def release_memory():
    """What `_release_compiled_programs` does after a test, for a test to call between two
    heavy phases (its own references to their results dropped first)."""
    return _release


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """Drop JAX's compiled executables after each test: the suite compiles hundreds of
    whole-network programs, and kept alive together they outgrow a 24 GiB CI machine. (With the
    persistent compilation cache that `make test` sets up, a program compiled again is loaded.)"""
    yield
    _release()
    loaded = {lib for lib in FREEZE_AFTER if lib in sys.modules}
    if loaded - _FROZEN:  # the oracle's libraries came in with this test: frozen with them is
        _FROZEN.update(loaded)  # what outlived its collection (once per library and worker)
        gc.freeze()


# A collection after each test scanned every object the imported libraries made: 0.2-0.5 s a
# test, 250 s of a make test's 1,880 s of worker time. Those live as long as the process, so
# they are frozen (gc.freeze: a collection skips them; 2 ms a test) — those the test modules
# imported once collected, torch's and timm's (imported on first use, oracle_libs) after the
# test that loads them.
FREEZE_AFTER = ("torch", "timm")
_FROZEN: set = set()


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


def pytest_terminal_summary(terminalreporter):
    """The tie sweep's count (tests/test_sweep.py records it on each group's report, passed or
    failed: an inconclusive tie fails its group)."""
    totals: dict = {}
    for report in [*terminalreporter.stats.get("passed", []),
                   *terminalreporter.stats.get("failed", [])]:
        for key, value in getattr(report, "user_properties", []):
            if key.startswith("sweep_"):
                totals[key[len("sweep_"):]] = totals.get(key[len("sweep_"):], 0) + value
    if totals:
        terminalreporter.write_line(
            f"tie sweep: {totals['ties'] - totals['inconclusive']} of {totals['ties']} random "
            f"f64 ties tied ({totals['inconclusive']} inconclusive, each failing its group), "
            f"{totals['controls']} random controls broke theirs, "
            f"{totals['seconds']:.0f} s of worker time")
