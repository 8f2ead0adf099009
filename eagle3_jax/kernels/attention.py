"""``cached_attention``: RoPE and grouped-query attention of T new tokens over (KV cache,
themselves), the attention of a decode step or a tree verification, as one CPU custom call.

On CPU, for float32, at most ``KERNEL_MAX_TOKENS`` new tokens and a head dim of 16..128 in
steps of 16, this runs the package's C++ kernel (``kernels/cpu/attention.cc``; ``library.py``):
RoPE, scores, mask, softmax and the weighted sum of values in one call per layer, reading the cache
only up to the last slot any query sees. XLA CPU runs the same as about ten small ops a layer
(RoPE of q and k, two score einsums, masks, a softmax, two value einsums, transposes), which
at T = 8 cost a forward about as much as its matmuls' extra rows (``bench forward`` shows both). Everywhere
else the caller's XLA formulation (``eagle3_jax.model.layers``) runs instead: it is passed in,
so that this layer stays below the model.

The choice is made at trace time from shapes and dtype and, inside the program, per backend
(``lax.platform_dependent``): a program lowered for an accelerator holds only the XLA ops.
Differentiable: the JVP is the XLA formulation's. A query row that sees no slot at all gets
zeros (XLA's softmax would average every slot's value).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax

from eagle3_jax.kernels.library import kernel_available, kernels_in_use
from eagle3_jax.kernels.matmul import KERNEL_MAX_ROWS

FFI_TARGET = "eagle3_cached_attention"
# New tokens per call the kernel takes: the row limit of the matmul kernel (the same forwards).
KERNEL_MAX_TOKENS = KERNEL_MAX_ROWS


def uses_attention_kernel(q_shape: tuple[int, ...], kv_heads: int, dtype) -> bool:
    """Whether attention for queries of ``q_shape`` [B, T, N, H] traced now would use the kernel."""
    _, t, n, h = q_shape
    return (0 < t <= KERNEL_MAX_TOKENS and h % 16 == 0 and 16 <= h <= 128
            and n % kv_heads == 0 and kernels_in_use(dtype, "attention"))


@functools.cache
def _kernel(xla: Callable) -> Callable:
    """The custom call as a differentiable function of its nine operands (JVP: ``xla``'s)."""

    @jax.custom_jvp
    def attend(q, k_new, v_new, cos, sin, k_past, v_past, m_past, m_new):
        out_types = (jax.ShapeDtypeStruct(q.shape, q.dtype),
                     jax.ShapeDtypeStruct(k_new.shape, k_new.dtype))
        return jax.ffi.ffi_call(FFI_TARGET, out_types, vmap_method="sequential")(
            q, k_new, v_new, cos, sin, k_past, v_past, m_past, m_new)

    attend.defjvp(lambda primals, tangents: jax.jvp(xla, primals, tangents))
    return attend


def cached_attention(q: jax.Array, k_new: jax.Array, v_new: jax.Array, cos: jax.Array,
                     sin: jax.Array, k_past: jax.Array, v_past: jax.Array, m_past: jax.Array,
                     m_new: jax.Array, *, xla: Callable) -> tuple[jax.Array, jax.Array]:
    """RoPE, then attention of the T new tokens' queries over the cache and themselves.

    Args:
      q: [B, T, N, H] queries, not yet rotated.
      k_new, v_new: [B, T, K, H] the new tokens' keys (not yet rotated) and values.
      cos, sin: [B, T, H/2] float32, their RoPE (rotate-half convention).
      k_past, v_past: the cache, keys [B, K, H, S] (rotated) and values [B, K, S, H].
      m_past: [B, T, S] bool, True where token t may attend cache slot s.
      m_new: [B, T, T] bool, True where token t may attend new token j.
      xla: the same function of the same nine operands in XLA ops, run where the kernel is
        not (off CPU, or the library absent). Check ``uses_attention_kernel`` first: this
        emits the kernel on CPU whatever the shape, dtype or switch.
    Returns:
      (attention output [B, T, N, H], the rotated new keys [B, T, K, H] for the cache write).
    """
    args = (q, k_new, v_new, cos, sin, k_past, v_past, m_past, m_new)
    if not kernel_available():  # also loads and registers the library
        return xla(*args)
    return jax.lax.platform_dependent(*args, cpu=_kernel(xla), default=xla)
