"""Process-wide JAX settings, changed only here and only for the block that needs them."""

from __future__ import annotations

import contextlib

import jax


@contextlib.contextmanager
def jax_settings(**updates):
    """Set JAX config options (e.g. ``jax_enable_x64=True``) for the block, then restore what
    was set before, so a library call never leaves the caller's process changed."""
    before = {name: getattr(jax.config, name) for name in updates}
    try:
        for name, value in updates.items():
            jax.config.update(name, value)
        yield
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
