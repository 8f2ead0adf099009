"""The draft head's forward pieces, shared by training-time test and tree decoding.

One draft step over T positions (B batch, D hidden, N/K heads, H head_dim, Vd draft vocab)::

    g        [B, T, D]   feature: fc(target taps) at step 0, the draft's own output afterwards
                         (:func:`next_feature`: h, or final_norm(h) for EAGLE-3.1 heads)
    embeds   [B, T, D]   target embedding of the token paired with each feature
    x = concat(attn_norm(embeds), hidden_norm(g))                       [B, T, 2D]
    h = g + wo(attention(q, k, v from x))                               [B, T, D]
    h = h + mlp(mlp_norm(h))          -> the next step's feature
    logits = lm_head(final_norm(h))                                    [B, T, Vd]

Training (``eagle3_jax.draft.ttt``) and decoding only differ in which keys each query sees, so
both call :func:`project_qkv` and :func:`finish_layer` and supply their own attention. Every
function takes the params in either layout (``draft/params.py``): as trained ([in, out]
matrices, XLA dots, or the [in, out] CPU kernel where it is faster, on AVX-512), or the serving
layout decoding uses ([out, in], q/k/v and gate/up fused: the CPU rows kernel for the few rows of
a draft step, the XLA dot elsewhere).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle3_jax.draft.config import DraftConfig
from eagle3_jax.draft.params import is_serving
from eagle3_jax.kernels import rows_matmul, uses_attention_kernel
from eagle3_jax.model.layers import (attention, attention_with_cache, empty_kv, rms_norm,
                                     rope_cos_sin, rope_inv_freq, rotate, swiglu, write_kv)
from eagle3_jax.model.params import Params


def _matmul(params: Params, name: str, x: jax.Array, **kwargs) -> jax.Array:
    """x [..., in] times the draft matrix ``name``: its serving form ``name_t`` [out, in] in
    the serving layout, else the [in, out] matrix as trained."""
    if is_serving(params):
        return rows_matmul(x, params[name + "_t"], **kwargs)
    return rows_matmul(x, params[name], in_out=True, **kwargs)


def fuse_taps(params: Params, cfg: DraftConfig, taps: jax.Array) -> jax.Array:
    """Target taps [B, T, 3D] (low, mid, high) -> step-0 feature [B, T, D]; with
    ``cfg.fc_norm`` (EAGLE-3.1) each tap is RMS-normed by its own scale first."""
    # The head's dtype is its norms': serving matrices may be held narrower (bfloat16 values
    # read by the CPU kernel, ``DraftHead.serving``) and still compute in it.
    taps = taps.astype(params["hidden_norm"].dtype)
    if cfg.fc_norm:
        b, t, _ = taps.shape
        per_tap = taps.reshape(b, t, cfg.num_taps, cfg.hidden_size)
        taps = rms_norm(per_tap, params["fc_norm"], cfg.rms_norm_eps).reshape(b, t, -1)
    return _matmul(params, "fc", taps)


def next_feature(params: Params, cfg: DraftConfig, h: jax.Array) -> jax.Array:
    """The feature the next draft step reads from this step's output h [B, T, D]: h itself
    (EAGLE-3), or ``final_norm(h)`` with ``cfg.norm_output`` (EAGLE-3.1)."""
    return rms_norm(h, params["final_norm"], cfg.rms_norm_eps) if cfg.norm_output else h


def project_qkv(params: Params, cfg: DraftConfig, embeds: jax.Array, g: jax.Array,
                positions: jax.Array):
    """q [B, T, N, H], k, v [B, T, K, H] from the embedding and feature, rotated at positions."""
    q, k, v = _qkv(params, cfg, embeds, g)
    rope = _rope(cfg, positions)
    return rotate(q, *rope), rotate(k, *rope), v


def _rope(cfg: DraftConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [B, T, H/2] of ``positions`` [B, T] for the head's RoPE."""
    return rope_cos_sin(positions, rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))


def _qkv(params: Params, cfg: DraftConfig, embeds: jax.Array, g: jax.Array):
    """q [B, T, N, H], k, v [B, T, K, H] from the embedding and feature, not yet rotated."""
    x = jnp.concatenate([rms_norm(embeds.astype(g.dtype), params["attn_norm"], cfg.rms_norm_eps),
                         rms_norm(g, params["hidden_norm"], cfg.rms_norm_eps)], axis=-1)
    b, t, e = x.shape
    n, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    if is_serving(params):
        qkv = rows_matmul(x, params["wqkv_t"])
        q, k, v = jnp.split(qkv, [n * hd, (n + kv) * hd], axis=-1)
    else:
        q, k, v = (rows_matmul(x, params[w].reshape(e, -1), in_out=True)
                   for w in ("wq", "wk", "wv"))
    return q.reshape(b, t, n, hd), k.reshape(b, t, kv, hd), v.reshape(b, t, kv, hd)


def finish_layer(params: Params, cfg: DraftConfig, g: jax.Array, attn: jax.Array) -> jax.Array:
    """Residual around attention output [B, T, N, H], then the SwiGLU block -> h [B, T, D].
    The residual is the feature g, or ``hidden_norm(g)`` with ``cfg.norm_before_residual``."""
    b, t, n, hd = attn.shape
    if cfg.norm_before_residual:
        g = rms_norm(g, params["hidden_norm"], cfg.rms_norm_eps)
    if is_serving(params):
        h = g + rows_matmul(attn.reshape(b, t, n * hd), params["wo_t"])
        x = rms_norm(h, params["mlp_norm"], cfg.rms_norm_eps)
        gate, up = jnp.split(rows_matmul(x, params["w_gate_up_t"]), 2, axis=-1)
        return h + rows_matmul(jax.nn.silu(gate) * up, params["w_down_t"])
    h = g + rows_matmul(attn.reshape(b, t, n * hd), params["wo"].reshape(n * hd, -1), in_out=True)
    x = rms_norm(h, params["mlp_norm"], cfg.rms_norm_eps)
    return h + swiglu(x, params["w_gate"], params["w_up"], params["w_down"])


def head_input(params: Params, cfg: DraftConfig, h: jax.Array) -> jax.Array:
    """h [B, T, D] -> what the output head ``lm_head`` [D, Vd] multiplies: the final norm."""
    return rms_norm(h, params["final_norm"], cfg.rms_norm_eps)


def draft_logits(params: Params, cfg: DraftConfig, h: jax.Array) -> jax.Array:
    """h [B, T, D] -> float32 logits over the draft vocabulary [B, T, Vd]."""
    return _matmul(params, "lm_head", head_input(params, cfg, h),
                   preferred_element_type=jnp.float32)


def empty_draft_cache(cfg: DraftConfig, batch: int, slots: int) -> tuple[jax.Array, jax.Array]:
    """A zeroed draft KV cache: (k [B, K, H, S], v [B, K, S, H]), as ``layers.empty_kv``."""
    return empty_kv(batch, cfg.num_kv_heads, cfg.head_dim, slots, jnp.dtype(cfg.dtype))


def draft_step_cached(params: Params, cfg: DraftConfig, embeds: jax.Array, g: jax.Array,
                      positions: jax.Array, mask: jax.Array, cache_k: jax.Array,
                      cache_v: jax.Array, write_slots: jax.Array,
                      outputs_at: jax.Array | None = None):
    """One draft step at inference over a KV cache.

    Args:
      embeds, g: [B, T, D]; positions: [B, T].
      mask: [B, T, S] bool over cache slots (after this step's keys are written).
      cache_k: [B, K, H, S]; cache_v: [B, K, S, H] (``empty_draft_cache``).
      write_slots: [B, T] slots for this step's keys.
      outputs_at: [B, T'] positions per row, or None (all T): every position's keys and values
        enter the cache, but the layer's output (MLP, output head; the attention too where the
        CPU kernel does not run it) is computed at these positions only. A prefill over a long
        prompt then pays for one output, not one per prompt token.
    Returns:
      (the next step's feature [B, T', D] (:func:`next_feature`), logits [B, T', Vd], cache_k,
      cache_v).

    On CPU, for the few tokens of a tree level or a catch-up, the attention is the target's
    custom call (``kernels.cached_attention``: RoPE, scores, softmax and values in one call
    instead of a dozen small XLA ops; a 2/3/8 round 1.5 ms less on a 2-core CPU): it reads the
    cache as it was, with ``mask`` split into the slots not being written and the new tokens
    themselves (:func:`split_write_mask`), and the rotated keys are written after it. Elsewhere
    the keys are written first and XLA's attention reads the cache with ``mask`` as it is. The
    same values up to float32 round-off.
    """
    q, k, v = _qkv(params, cfg, embeds, g)
    rope = _rope(cfg, positions)
    rows = jnp.arange(k.shape[0])[:, None]
    if uses_attention_kernel(q.shape, cfg.num_kv_heads, q.dtype):
        past_mask, new_mask = split_write_mask(mask, write_slots)
        attn, k = attention_with_cache(q, k, v, rope, (cache_k, cache_v, past_mask), new_mask)
        # Written after the kernel's read of both caches, in place (the values, unlike the
        # rotated keys, would not depend on the kernel otherwise, and XLA copied their cache).
        cache_k, cache_v = write_kv(cache_k, cache_v, rows, write_slots, k, v, after=attn)
        if outputs_at is not None:
            attn, g = (a[rows, outputs_at] for a in (attn, g))
    else:
        q, k = rotate(q, *rope), rotate(k, *rope)
        cache_k, cache_v = write_kv(cache_k, cache_v, rows, write_slots, k, v)  # [B, T, K, H]
        if outputs_at is not None:
            q, g, mask = (a[rows, outputs_at] for a in (q, g, mask))
        attn = attention(q, [(cache_k, cache_v, mask)])
    h = finish_layer(params, cfg, g, attn)
    return next_feature(params, cfg, h), draft_logits(params, cfg, h), cache_k, cache_v


def split_write_mask(mask: jax.Array, write_slots: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A mask over the cache after a write -> the same visibility over (the cache before it,
    the tokens being written).

    Args:
      mask: [B, T, S] bool, True where token t may see slot s once the T tokens are written.
      write_slots: [B, T] the tokens' slots (a slot past the cache drops its token, which no
        one then sees).
    Returns:
      (past [B, T, S]: ``mask`` without the slots being written, new [B, T, T]: token t sees
      token j where ``mask`` shows j's slot).
    """
    b, t, s = mask.shape
    rows = jnp.arange(b)[:, None]
    written = jnp.zeros((b, s), bool).at[rows, write_slots].set(True, mode="drop")
    inside = write_slots < s  # [B, T]
    at = jnp.broadcast_to(jnp.clip(write_slots, 0, s - 1)[:, None, :], (b, t, t))
    new = jnp.take_along_axis(mask, at, axis=2) & inside[:, None, :]
    return mask & ~written[:, None, :], new
