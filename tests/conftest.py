"""Test session set-up: float64 for the exact checks, 8 virtual CPU devices for the replica
programs (both before JAX's first operation), and a deterministic hypothesis profile so CI
draws the same shapes every run."""

import jax

jax.config.update("jax_enable_x64", True)

from twinstep import dp  # noqa: E402

dp.ensure_devices(8)

import gc  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("twinstep", derandomize=True, deadline=None, max_examples=12,
                          suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.load_profile("twinstep")


@pytest.fixture
def rng():
    return np.random.default_rng(20261129)


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """Drop JAX's compiled executables after each test: the suite compiles hundreds of
    whole-network programs, and kept alive together they outgrow a 24 GiB CI machine."""
    yield
    jax.clear_caches()
    gc.collect()
