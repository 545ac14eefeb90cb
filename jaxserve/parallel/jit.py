"""Programs owned by an object (an engine's runner, a pipeline): a jax.jit of a fresh function
object, so its compiled executables are freed with their owner instead of living in JAX's
module-level caches for the life of the process."""

from __future__ import annotations

import functools

import jax


def fresh_jit(fn, **jit_kwargs):
    """jax.jit of a new function object that calls `fn`: its compiled executables live in JAX's
    caches only as long as the returned wrapper (and anything it compiled) is referenced."""
    def program(*args, **kwargs):
        return fn(*args, **kwargs)

    functools.update_wrapper(program, fn)  # the signature (static_argnames) and the name
    return jax.jit(program, **jit_kwargs)
