"""Building blocks of the target and the draft head: RMSNorm, RoPE, attention (both), SwiGLU
(the draft head; the target applies its fused gate/up weights in ``target._layer``).

Einsum letters: B batch, T new tokens, S cache slots, D hidden, N query heads, K kv heads,
G query heads per kv head (N = K*G), H head_dim, F mlp width.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp

from eagle3_jax.kernels import cached_attention, rows_matmul, uses_attention_kernel
from eagle3_jax.model.config import RopeScaling

# The gated MLPs' activations by ``TargetConfig.mlp_activation`` (``config.MLP_ACTIVATIONS``):
# SiLU (SwiGLU: Llama, Qwen, Mixtral) and GELU's tanh approximation (GeGLU: Gemma,
# HF ``gelu_pytorch_tanh``).
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
}


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in float32, returned in ``x.dtype``; ``scale``'s
    shape is x's trailing shape ([D], or [taps, D] for per-tap norms).

    Its gradient keeps only x (in its own dtype) and recomputes the float32 norm: autodiff kept
    float32 copies of every normed array of every TTT step (bfloat16 training on a TPU: eight
    [K_steps, B, T, D] float32 stacks, 14 GB a chip for the 8B config on a v5p-16).
    """
    return (_rms_norm_parts(x, eps)[0] * scale.astype(jnp.float32)).astype(x.dtype)


def _rms_norm_parts(x, eps):
    """(x / rms(x), 1 / rms(x)) in float32: [..., D] and [..., 1]."""
    x32 = x.astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return x32 * inv_rms, inv_rms


def _rms_norm_fwd(x, scale, eps):
    return rms_norm(x, scale, eps), (x, scale)


def _rms_norm_bwd(eps, residuals, d_out):
    x, scale = residuals
    normed, inv_rms = _rms_norm_parts(x, eps)
    d_out = d_out.astype(jnp.float32)
    d_normed = d_out * scale.astype(jnp.float32)
    # d/dx of x * inv_rms(x): inv_rms * (d_normed - normed * mean(d_normed * normed)).
    d_x = inv_rms * (d_normed - normed * jnp.mean(d_normed * normed, axis=-1, keepdims=True))
    d_scale = jnp.sum(d_out * normed, axis=tuple(range(x.ndim - scale.ndim)))
    return d_x.astype(x.dtype), d_scale.astype(scale.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> jax.Array:
    """Inverse frequencies [H/2], with Llama-3.1 or linear scaling applied as HF does."""
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return inv / scaling.factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, smooth ramp between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    mid = (1 - smooth) * inv / scaling.factor + smooth * inv
    return jnp.where(wavelen > low_wavelen, inv / scaling.factor,
                     jnp.where(wavelen < high_wavelen, inv, mid))


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """RoPE angles of ``positions`` [B, T] as (cos, sin), each [B, T, H/2] float32."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x`` [B, T, heads, H] by (cos, sin) [B, T, H/2] (HF rotate-half convention)."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate ``x`` [B, T, heads, H] by ``positions`` [B, T] (HF rotate-half convention)."""
    return rotate(x, *rope_cos_sin(positions, inv_freq))


def empty_kv(batch: int, kv_heads: int, head_dim: int, slots: int,
             dtype) -> tuple[jax.Array, jax.Array]:
    """A zeroed KV buffer in the layouts :func:`attention` reads: keys [B, K, H, S] (slots last,
    so the score matmul streams each key row) and values [B, K, S, H]."""
    return (jnp.zeros((batch, kv_heads, head_dim, slots), dtype),
            jnp.zeros((batch, kv_heads, slots, head_dim), dtype))


def resize_kv(k: jax.Array, v: jax.Array, slots: int) -> tuple[jax.Array, jax.Array]:
    """A KV buffer (:func:`empty_kv` layouts) with ``slots`` slots: the first ones kept, new ones
    empty (zeros) or the last ones cut."""
    def fit(x, axis):
        if x.shape[axis] >= slots:
            return jax.lax.slice_in_dim(x, 0, slots, axis=axis)
        return jnp.pad(x, [(0, slots - x.shape[axis] if a == axis else 0) for a in range(x.ndim)])
    return fit(k, 3), fit(v, 2)


def write_kv(k: jax.Array, v: jax.Array, rows: jax.Array, slots: jax.Array, new_k: jax.Array,
             new_v: jax.Array, after: jax.Array | None = None):
    """Write [B, T, K, H] blocks at ``slots`` [B, T] of ``rows`` [B, 1]; slots past the end are
    dropped. (In k [B, K, H, S] the advanced indices are apart, so theirs come first.)

    ``after``: an array [B, T, ...] computed from the buffers' last reads (a layer's output, an
    attention kernel's). The blocks are made to depend on it (adding 0 changes nothing for finite
    values), so XLA orders the writes after every read of ``k`` and ``v`` and updates them in
    place instead of copying them."""
    if after is not None:
        b, t = new_k.shape[:2]
        order = (0 * after.reshape(b, t, -1)[:, :, None, :1]).astype(new_v.dtype)  # [B, T, 1, 1]
        new_k, new_v = new_k + order, new_v + order
    return (k.at[rows, :, :, slots].set(new_k, mode="drop"),
            v.at[rows, :, slots].set(new_v, mode="drop"))


def attention(q: jax.Array, blocks: Sequence[tuple[jax.Array, jax.Array, jax.Array]]) -> jax.Array:
    """Grouped-query attention with one softmax over several blocks of keys.

    Args:
      q: [B, T, N, H] queries (already rotated).
      blocks: ``(k, v, mask)`` triples: keys [B, K, H, S_i] and values [B, K, S_i, H] (the KV
        cache layout, :func:`empty_kv`) and mask [B, T, S_i] bool, True where query t may attend
        slot s. The target passes its cache and the new tokens as two blocks, so the
        cache is only read here and written once after the forward.
    Returns:
      [B, T, N, H].
    """
    b, t, n, h = q.shape
    kv_heads = blocks[0][0].shape[1]
    g = n // kv_heads
    # [B, K, G*T, H]: one batched matmul per block; rows are (query head in group, token).
    qg = q.reshape(b, t, kv_heads, g, h).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, g * t, h)
    scores = []
    for k, _, mask in blocks:
        s = jnp.einsum("BKQH,BKHS->BKQS", qg, k, preferred_element_type=jnp.float32)
        m = jnp.broadcast_to(mask[:, None, None], (b, kv_heads, g, t, mask.shape[-1]))
        scores.append(jnp.where(m.reshape(b, kv_heads, g * t, -1), s / math.sqrt(h),
                                jnp.finfo(jnp.float32).min))
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
    out, start = 0.0, 0
    for k, v, _ in blocks:
        size = k.shape[3]
        p = probs[..., start:start + size].astype(v.dtype)
        out = out + jnp.einsum("BKQS,BKSH->BKQH", p, v)
        start += size
    return out.reshape(b, kv_heads, g, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def attention_with_cache(q: jax.Array, k: jax.Array, v: jax.Array,
                         rope: tuple[jax.Array, jax.Array],
                         past: tuple[jax.Array, jax.Array, jax.Array] | None,
                         new_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """RoPE, then attention of T new tokens over the KV cache and themselves: the target's
    attention, and the draft's for the few tokens of a decoding step
    (``draft.model.draft_step_cached``).

    Args:
      q: [B, T, N, H] queries, as projected (not yet rotated).
      k, v: [B, T, K, H] the new tokens' keys (not yet rotated) and values.
      rope: (cos, sin) [B, T, H/2] of the new tokens' positions (:func:`rope_cos_sin`).
      past: None (no cache to read) or the cache's (keys [B, K, H, S], values [B, K, S, H],
        mask [B, T, S] bool).
      new_mask: [B, T, T] bool, True where new token t may attend new token j.
    Returns:
      (output [B, T, N, H], rotated keys [B, T, K, H]). On CPU with a cache and few new tokens
      this is one custom call per layer (``eagle3_jax.kernels.cached_attention``); otherwise
      :func:`rotate` and :func:`attention`.
    """
    if past is not None and uses_attention_kernel(q.shape, k.shape[2], q.dtype):
        return cached_attention(q, k, v, *rope, *past, new_mask, xla=_cached_attention_xla)
    return _attention_xla(q, k, v, rope, past, new_mask)


def _attention_xla(q, k, v, rope, past, new_mask):
    q, k = rotate(q, *rope), rotate(k, *rope)
    new = (k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), new_mask)
    return attention(q, [new] if past is None else [past, new]), k


def _cached_attention_xla(q, k, v, cos, sin, k_past, v_past, m_past, m_new):
    """:func:`attention_with_cache` with a cache, in XLA ops, on the kernel's nine operands."""
    return _attention_xla(q, k, v, (cos, sin), (k_past, v_past, m_past), m_new)


@jax.custom_vjp
def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """SwiGLU MLP: [..., D] -> [..., D], weights [in, out] (``rows_matmul``: the CPU kernel
    for few rows).

    Its gradient (the draft head's, in training) keeps only x, gate and up [..., F] and writes
    each matrix gradient as one plain dot: autodiff kept four [..., F] arrays of every TTT step
    and, on XLA CPU, fused the SiLU derivative into a transposing copy (66 ms a step at
    2048 x 1536, reading five arrays across their rows; ``bench train``).
    """
    return _swiglu_parts(x, w_gate, w_up, w_down)[0]


def _swiglu_parts(x, w_gate, w_up, w_down):
    gate = rows_matmul(x, w_gate, in_out=True)
    up = rows_matmul(x, w_up, in_out=True)
    return rows_matmul(jax.nn.silu(gate) * up, w_down, in_out=True), (gate, up)


def _swiglu_fwd(x, w_gate, w_up, w_down):
    out, (gate, up) = _swiglu_parts(x, w_gate, w_up, w_down)
    return out, (x, w_gate, w_up, w_down, gate, up)


def _swiglu_bwd(residuals, d_out):
    x, w_gate, w_up, w_down, gate, up = residuals
    f32 = jnp.float32
    dot = lambda a, b: jnp.dot(a, b, preferred_element_type=f32)  # noqa: E731
    rows = lambda a: a.reshape(-1, a.shape[-1])  # noqa: E731
    x2, d2 = rows(x), rows(d_out)
    g, u = rows(gate).astype(f32), rows(up).astype(f32)
    sig = jax.nn.sigmoid(g)
    silu = g * sig
    d_act = dot(d2, w_down.T)  # [N, F]
    d_up = (d_act * silu).astype(x.dtype)
    # silu'(g) = sig(g) * (1 + g * (1 - sig(g)))
    d_gate = (d_act * u * sig * (1.0 + g * (1.0 - sig))).astype(x.dtype)
    d_x = dot(d_gate, w_gate.T) + dot(d_up, w_up.T)
    return (d_x.reshape(x.shape).astype(x.dtype),
            dot(x2.T, d_gate).astype(w_gate.dtype), dot(x2.T, d_up).astype(w_up.dtype),
            dot((silu * u).astype(x.dtype).T, d2).astype(w_down.dtype))


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
