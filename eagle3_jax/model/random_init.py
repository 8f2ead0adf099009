"""Random normal weights for ``init_params`` and ``init_draft_params``, with few compiles.

``normal_values(key, shape, scale, offset)`` is ``offset + scale * jax.random.normal(key, shape)``
value for value. Called outside a trace, it draws the normals as the first elements of a flat
draw whose size is the next power of two: with JAX's partitionable threefry (the default),
element i of a draw depends only on the key and i, not on the shape. A model's leaves then share
a few compiled random programs, one per power of two, instead of one per shape (about 0.3 s to
compile each on a CPU); what is left per shape is a small program that slices, scales and
reshapes. Under ``jit`` (a sharded init) it is the plain draw.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp


@functools.partial(jax.jit, static_argnums=1)
def _flat_normal(key: jax.Array, size: int) -> jax.Array:
    """[size] float32 normals of ``key``."""
    return jax.random.normal(key, (size,), jnp.float32)


@functools.partial(jax.jit, static_argnames="shape")
def _scaled(flat: jax.Array, scale: jax.Array, *, shape: tuple[int, ...]) -> jax.Array:
    """``scale`` times the first prod(shape) of ``flat``, as ``shape``."""
    return flat[:math.prod(shape)].reshape(shape) * scale


def normal_values(key: jax.Array, shape: tuple[int, ...], scale: float,
                  offset: float | None = None, dtype="float32") -> jax.Array:
    """``shape`` values of ``noise * scale`` (``offset`` None) or ``offset + scale * noise``,
    noise = ``jax.random.normal(key, shape, float32)``, cast to ``dtype``."""
    shape = tuple(int(d) for d in shape)
    if isinstance(key, jax.core.Tracer) or not jax.config.jax_threefry_partitionable:
        noise = jax.random.normal(key, shape, jnp.float32)
        value = noise * scale if offset is None else offset + scale * noise
        return value.astype(dtype)
    size = 1 << max(math.prod(shape) - 1, 0).bit_length()
    value = _scaled(_flat_normal(key, size), jnp.float32(scale), shape=shape)
    # The offset added apart: inside one program XLA fuses the product and the sum into an FMA,
    # whose rounding differs from the two operations of the plain form.
    return (value if offset is None else offset + value).astype(dtype)
