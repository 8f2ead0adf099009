"""The target model's forward pass: one pure function for prefill, decode and tree verification.

The caller gives explicit ``positions`` and a boolean ``mask`` over (query, cache slot), so the
same jitted code runs a causal prefill, a one-token decode step, or a whole draft tree whose
tokens see only their ancestors. Layers are scanned (``lax.scan`` over the stacked weights).

KV cache (fixed size, functional)::

    KVCache.k, .v  [L, B, K, S, H]   S = max_len slots per row, head-major (see attention)
    KVCache.end    [B] int32         slots [0, end) hold committed tokens

``forward`` writes the T new keys/values of row b at slots ``[end[b], end[b] + T)`` and does not
move ``end``: plain decoding advances it by T, tree verification by the accepted length after
compacting the accepted path (``eagle3_jax.decoding``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import struct

from eagle3_jax.model.config import TargetConfig
from eagle3_jax.model.layers import apply_rope, attention, rms_norm, rope_inv_freq, swiglu
from eagle3_jax.model.params import Params


@struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, K, S, H]
    v: jax.Array  # [L, B, K, S, H]
    end: jax.Array  # [B] int32

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @classmethod
    def zeros(cls, cfg: TargetConfig, batch: int, max_len: int) -> "KVCache":
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        dtype = jnp.dtype(cfg.dtype)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))


@struct.dataclass
class ForwardOutput:
    logits: jax.Array | None  # [B, T, V] (or [B, P, V] at logit_positions), float32
    cache: KVCache | None
    taps: jax.Array | None  # [B, T, len(tap_layers) * D]: hidden states entering those layers
    hidden: jax.Array  # [B, T, D] final hidden state after the last norm


def causal_mask(cache_end: jax.Array, num_new: int, max_len: int) -> jax.Array:
    """Mask [B, T, S] for T new tokens appended at ``cache_end`` [B]: slot s <= end + t."""
    slots = jnp.arange(max_len)[None, None, :]
    query_slots = cache_end[:, None, None] + jnp.arange(num_new)[None, :, None]
    return slots <= query_slots


def forward(
    params: Params,
    cfg: TargetConfig,
    tokens: jax.Array,
    positions: jax.Array,
    mask: jax.Array,
    cache: KVCache | None = None,
    *,
    tap_layers: Sequence[int] = (),
    logit_positions: jax.Array | None = None,
    compute_logits: bool = True,
) -> ForwardOutput:
    """Run the target over T new tokens.

    Args:
      params: pytree of ``eagle3_jax.model.params.param_specs(cfg)``.
      tokens: [B, T] int32 token ids.
      positions: [B, T] int32 RoPE positions.
      mask: [B, T, S] bool over cache slots (S = cache.max_len), or [B, T, T] without a cache.
      cache: KV cache; the new keys/values are written at slots [end, end + T).
      tap_layers: return the hidden states *entering* these layers (EAGLE-3: 2, L//2, L-3).
      logit_positions: [B, P] indices into T; compute logits only there (saves the vocab matmul).
      compute_logits: False skips the output head entirely (feature extraction).
    Returns:
      ForwardOutput with float32 logits, the updated cache, taps and the final hidden state.
    """
    dtype = jnp.dtype(cfg.dtype)
    layer_params = params["layers"]
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    b, t = tokens.shape
    h = jnp.take(params["embed"], tokens, axis=0).astype(dtype)  # [B, T, D]

    tap_layers = tuple(tap_layers)
    taps0 = jnp.zeros((len(tap_layers), b, t, cfg.hidden_size), dtype)
    if cache is not None:
        rows = jnp.arange(b)[:, None]
        slots = cache.end[:, None] + jnp.arange(t)[None, :]  # [B, T]

    def layer(carry, xs):
        h, cache_k, cache_v, taps = carry
        p, index = xs
        for j, tap in enumerate(tap_layers):
            taps = taps.at[j].set(jnp.where(index == tap, h, taps[j]))
        x = rms_norm(h, p["attn_norm"], cfg.rms_norm_eps)
        q = jnp.einsum("BTD,DNH->BTNH", x, p["wq"])
        k = jnp.einsum("BTD,DKH->BTKH", x, p["wk"])
        v = jnp.einsum("BTD,DKH->BTKH", x, p["wv"])
        if cfg.attention_bias:
            q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
        if cfg.qk_norm:
            q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)
        if cache_k is None:
            keys, values = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, H]
        else:
            # [index, rows, :, slots] takes k as [B, T, K, H]. Out-of-range slots are dropped;
            # decoders stop before the cache is full.
            cache_k = cache_k.at[index, rows, :, slots].set(k, mode="drop")
            cache_v = cache_v.at[index, rows, :, slots].set(v, mode="drop")
            keys, values = cache_k[index], cache_v[index]  # [B, K, S, H]
        attn = attention(q, keys, values, mask)
        h = h + jnp.einsum("BTNH,NHD->BTD", attn, p["wo"])
        x = rms_norm(h, p["mlp_norm"], cfg.rms_norm_eps)
        h = h + swiglu(x, p["w_gate"], p["w_up"], p["w_down"])
        return (h, cache_k, cache_v, taps), None

    cache_k = cache.k if cache is not None else None
    cache_v = cache.v if cache is not None else None
    (h, cache_k, cache_v, taps), _ = jax.lax.scan(
        layer, (h, cache_k, cache_v, taps0), (layer_params, jnp.arange(cfg.num_layers))
    )
    hidden = rms_norm(h, params["final_norm"], cfg.rms_norm_eps)

    logits = None
    if compute_logits:
        head_in = hidden
        if logit_positions is not None:
            head_in = jnp.take_along_axis(hidden, logit_positions[:, :, None], axis=1)
        logits = output_logits(params, cfg, head_in)
    new_cache = None if cache is None else dataclasses.replace(cache, k=cache_k, v=cache_v)
    tap_out = None
    if tap_layers:
        tap_out = jnp.concatenate([taps[j] for j in range(len(tap_layers))], axis=-1)
    return ForwardOutput(logits=logits, cache=new_cache, taps=tap_out, hidden=hidden)


def output_logits(params: Params, cfg: TargetConfig, hidden: jax.Array) -> jax.Array:
    """Final-normed hidden [B, T, D] -> float32 logits [B, T, V] (tied or untied head)."""
    if cfg.tie_word_embeddings:
        return jnp.einsum("BTD,VD->BTV", hidden, params["embed"],
                          preferred_element_type=jnp.float32)
    return jnp.einsum("BTD,DV->BTV", hidden, params["lm_head"], preferred_element_type=jnp.float32)
