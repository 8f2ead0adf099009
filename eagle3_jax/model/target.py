"""The target model's forward pass: one pure function for prefill, decode and tree verification.

The caller gives explicit ``positions`` and a boolean ``mask`` over (query, cache slot), so the
same jitted code runs a causal prefill, a one-token decode step, or a whole draft tree whose
tokens see only their ancestors. Stacked layers (training) are scanned with ``lax.scan``; the
serving layout (``to_serving``, what ``load_target`` gives for decoding) runs as a Python loop.

KV cache (fixed size, functional)::

    KVCache.k      L arrays [B, K, H, S]   S = max_len slots per row; keys slots-last and
    KVCache.v      L arrays [B, K, S, H]   values head-major, the layouts ``attention`` reads
                                           without a transpose; one buffer per layer, so each is
                                           read and updated in place without slicing a stack
    KVCache.end    [B] int32               slots [0, end) hold committed tokens

``forward`` writes the T new keys/values of row b at slots ``[end[b], end[b] + T)`` and does not
move ``end``: plain decoding advances it by T, tree verification by the accepted length after
compacting the accepted path (``eagle3_jax.decoding``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import struct

from eagle3_jax.kernels import rows_matmul
from eagle3_jax.kernels.attention import uses_attention_kernel
from eagle3_jax.kernels.library import kernels_in_use
from eagle3_jax.kernels.matmul import panel_matmul, weight_rows
from eagle3_jax.model.config import TargetConfig
from eagle3_jax.model.layers import (ACTIVATIONS, attention_with_cache, empty_kv, resize_kv,
                                     rms_norm, rope_cos_sin, rope_inv_freq, write_kv)
from eagle3_jax.model.moe import moe_mlp
from eagle3_jax.model.params import Params, is_serving, to_serving_layer
from eagle3_jax.sharding.activations import expert_mesh, shard_batch


@struct.dataclass
class KVCache:
    k: tuple[jax.Array, ...]  # L arrays [B, K, H, S]
    v: tuple[jax.Array, ...]  # L arrays [B, K, S, H]
    end: jax.Array  # [B] int32

    @property
    def max_len(self) -> int:
        return self.v[0].shape[2]

    @classmethod
    def zeros(cls, cfg: TargetConfig, batch: int, max_len: int) -> "KVCache":
        layers = [empty_kv(batch, cfg.num_kv_heads, cfg.head_dim, max_len, jnp.dtype(cfg.dtype))
                  for _ in range(cfg.num_layers)]
        k, v = (tuple(x) for x in zip(*layers))
        return cls(k, v, jnp.zeros((batch,), jnp.int32))

    def resized(self, max_len: int) -> "KVCache":
        """This cache with ``max_len`` slots: the first ones kept, new ones empty, or the last
        ones cut (``end`` unchanged)."""
        k, v = (tuple(x) for x in zip(*(resize_kv(k, v, max_len)
                                        for k, v in zip(self.k, self.v))))
        return dataclasses.replace(self, k=k, v=v)


@struct.dataclass
class ForwardOutput:
    logits: jax.Array | None  # [B, T, V] (or [B, P, V] at logit_positions), float32
    cache: KVCache | None
    taps: jax.Array | None  # [B, T, len(tap_layers) * D]: hidden states entering those layers
    hidden: jax.Array  # [B, T, D] final hidden state after the last norm
    new_kv: tuple | None = None  # (keys, values): per layer [B, T, K, H], with write_cache=False


def causal_mask(cache_end: jax.Array, num_new: int, max_len: int) -> jax.Array:
    """Mask [B, T, S] for T new tokens appended at ``cache_end`` [B]: slot s <= end + t."""
    slots = jnp.arange(max_len)[None, None, :]
    query_slots = cache_end[:, None, None] + jnp.arange(num_new)[None, :, None]
    return slots <= query_slots


def packed_causal_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, T] segment ids (0 = padding) -> [B, T, T] causal mask within each document.

    The mask of a cache-less forward over packed rows (training, offline features): token t
    sees s <= t of its own document; padding sees nothing.
    """
    t = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))[None]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return causal & same & (segment_ids[:, :, None] > 0)


def split_cache_mask(mask: jax.Array, cache_end: jax.Array, num_new: int):
    """Split a mask over cache slots [B, T, S] into (past [B, T, S], new [B, T, T]).

    ``past`` keeps only committed slots (< end); ``new[b, t, j]`` is the mask at slot end + j,
    where new token j is written. Slots past the cache end read as False.
    """
    slots = jnp.arange(mask.shape[-1])
    past = mask & (slots[None, None, :] < cache_end[:, None, None])
    new_slots = cache_end[:, None, None] + jnp.arange(num_new)[None, None, :]
    new_slots = jnp.broadcast_to(new_slots, mask.shape[:2] + (num_new,))
    new = jnp.take_along_axis(mask, new_slots, axis=2, mode="fill", fill_value=False)
    return past, new


# XLA CPU runs a matrix-vector dot as small as the attention output projection (D x N*H) on one
# core unless it is split into row blocks (eagle3_jax.kernels.matmul._xla_single_row);
# used only where the CPU kernel is not.
CPU_MATVEC_ROW_BLOCKS = 8


class Attend(NamedTuple):
    """What one kind of layer (global, or local: sliding window) attends with: RoPE (cos, sin)
    [B, T, H/2] of the new tokens' positions, the mask over the new tokens [B, T, T] and over
    the cache [B, T, S] (None without a cache)."""

    rope: tuple[jax.Array, jax.Array]
    new_mask: jax.Array
    past_mask: jax.Array | None


def layer_inputs(cfg: TargetConfig, positions: jax.Array, new_mask: jax.Array,
                 past_mask: jax.Array | None) -> tuple[Attend, Attend | None]:
    """(global, local) :class:`Attend` of T new tokens at ``positions`` [B, T]; local is None
    without sliding-window layers.

    A local layer's token at position p sees keys at positions > p - W (its own path's last W,
    itself included, as HF's sliding-window mask). A committed cache slot s holds the token at
    position s (every decoder writes a row's tokens at their positions), so the window over the
    cache is slot > p - W; over the new tokens it compares their positions (a draft tree's
    nodes sit at end + depth, so a node's window runs along its own path)."""
    inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    rope = rope_cos_sin(positions, inv)
    global_ = Attend(rope, new_mask, past_mask)
    if not cfg.local_layers:
        return global_, None
    if cfg.local_rope_theta is not None:
        rope = rope_cos_sin(positions, rope_inv_freq(cfg.head_dim, cfg.local_rope_theta, None))
    start = positions[:, :, None] - cfg.sliding_window  # [B, T, 1]: keys must lie past it
    new = new_mask & (positions[:, None, :] > start)
    past = None
    if past_mask is not None:
        past = past_mask & (jnp.arange(past_mask.shape[-1])[None, None, :] > start)
    return global_, Attend(rope, new, past)


def _norm(x: jax.Array, scale: jax.Array, cfg: TargetConfig) -> jax.Array:
    """RMSNorm with the family's scale: w (Llama, Qwen) or 1 + w in float32 (Gemma)."""
    if cfg.norm_plus_one:
        scale = scale.astype(jnp.float32) + 1.0
    return rms_norm(x, scale, cfg.rms_norm_eps)


def _layer(p: Params, cfg: TargetConfig, h: jax.Array, attend: Attend,
           past: tuple[jax.Array, jax.Array] | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One decoder layer in the serving layout: h [B, T, D] -> (h, k [B, T, K, H], v [B, T, K, H]).

    ``p`` holds one layer's weights as ``eagle3_jax.model.params.serving_layer_specs`` lays them
    out: q/k/v and gate/up fused, every matrix [out, in], applied as 2-D matmuls over the last
    (contiguous) axis. ``attend``: the RoPE and masks of this layer's kind (global or local).
    ``past`` is None or this layer's cache (k [B, K, H, S], v [B, K, S, H]). The returned k is
    rotated.
    """
    b, t, d = h.shape
    n, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    g = n // kv
    x = _norm(h, p["attn_norm"], cfg)
    qkv = _matmul(x, p, "wqkv", (-1, d)).reshape(b, t, kv, g + 2, hd)
    if cfg.attention_bias:
        qkv = qkv + p["bqkv"]
    q, k, v = qkv[:, :, :, :g].reshape(b, t, n, hd), qkv[:, :, :, g], qkv[:, :, :, g + 1]
    if cfg.qk_norm:
        q = _norm(q, p["q_norm"], cfg)
        k = _norm(k, p["k_norm"], cfg)
    if cfg.query_pre_attn_scalar is not None and cfg.query_pre_attn_scalar != hd:
        # Attention divides scores by sqrt(head_dim); Gemma divides by sqrt(this scalar).
        q = q * jnp.asarray(math.sqrt(hd / cfg.query_pre_attn_scalar), q.dtype)
    past_kv = None if past is None else (*past, attend.past_mask)
    attn, k = attention_with_cache(q, k, v, attend.rope, past_kv, attend.new_mask)
    attn = _matmul(attn.reshape(b, t, n * hd), p, "wo", (d, n * hd),
                   xla_single_row_blocks=CPU_MATVEC_ROW_BLOCKS)
    if cfg.sandwich_norms:
        attn = _norm(attn, p["post_attn_norm"], cfg)
    h = h + attn
    x = _norm(h, p["mlp_norm"], cfg)
    if cfg.is_moe:  # under a mesh with an expert axis, each device runs its own experts
        mesh, expert_axis = expert_mesh()
        mlp = moe_mlp(x.reshape(b * t, d), p["router"], p["expert_gate"], p["expert_up"],
                      p["expert_down"], top_k=cfg.experts_per_token, normalize=cfg.norm_topk_prob,
                      activation=cfg.mlp_activation, mesh=mesh,
                      expert_axis=expert_axis).reshape(b, t, d)
    else:
        gate_up = _matmul(x, p, "w_gate_up", (-1, d)).reshape(b, t, 2, -1)
        act = ACTIVATIONS[cfg.mlp_activation]
        mlp = _matmul(act(gate_up[:, :, 0]) * gate_up[:, :, 1], p, "w_down", (d, -1))
    if cfg.sandwich_norms:
        mlp = _norm(mlp, p["post_mlp_norm"], cfg)
    return h + mlp, k, v


def _matmul(x: jax.Array, p: Params, name: str, shape: tuple[int, int], **kwargs) -> jax.Array:
    """x [..., in] times the layer's matrix ``name`` seen as [out, in] (``shape``), held as it
    is or as its panels ``<name>_panels`` (``eagle3_jax.model.params.to_panels``)."""
    if name + "_panels" in p:
        return panel_matmul(x, p[name + "_panels"])
    return rows_matmul(x, p[name].reshape(shape), **kwargs)


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
    cache_is_empty: bool = False,
    write_cache: bool = True,
) -> ForwardOutput:
    """Run the target, in the serving layout, over T new tokens.

    Args:
      params: serving layout (``to_serving``: a tuple of per-layer fused weights, run as a
        Python loop, the fast form for decoding; XLA CPU would copy a layer's weights out of a
        stack on every step). Stacked params go to :func:`forward_stacked`.
      tokens: [B, T] int32 token ids.
      positions: [B, T] int32 RoPE positions.
      mask: [B, T, S] bool over cache slots (S = cache.max_len), or [B, T, T] without a cache.
      cache: KV cache; the new keys/values are written at slots [end, end + T), once, after all
        layers have read the cache (so XLA updates it in place).
      tap_layers: return the hidden states *entering* these layers (EAGLE-3: 2, L//2, L-3).
      logit_positions: [B, P] indices into T; compute logits only there (saves the vocab matmul).
      compute_logits: False skips the output head entirely (feature extraction).
      cache_is_empty: the cache holds nothing yet (a prefill from scratch): attention skips the
        cache block, which would be fully masked. Results are the same; XLA is spared
        constant-folding a fully masked [B, K, G*T, S] block, which takes seconds of compile
        time for long prompts.
      write_cache: False leaves the cache as it was and returns the new keys and values in
        ``new_kv`` instead (tree verification writes only the accepted path's).
    Returns:
      ForwardOutput with float32 logits, the updated cache, taps and the final hidden state.
    Raises:
      TypeError: ``params`` are in the stacked layout.
    """
    if not is_serving(params):
        raise TypeError("forward() takes serving-layout params (eagle3_jax.model.to_serving); "
                        "use forward_stacked() for the stacked training layout")
    t = tokens.shape[1]
    h = _embed(params, cfg, tokens)
    tap_layers = tuple(tap_layers)
    if cache is None:
        new_mask, past_mask = mask, None
    else:
        past_mask, new_mask = split_cache_mask(mask, cache.end, t)
    kinds = layer_inputs(cfg, positions, new_mask, past_mask)
    taps, new_k, new_v = [None] * len(tap_layers), [], []
    for index, p in enumerate(params["layers"]):
        for j, tap in enumerate(tap_layers):
            if index == tap:
                taps[j] = h
        past = None
        if cache is not None and not cache_is_empty:
            past = (cache.k[index], cache.v[index])
        h, k, v = _layer(p, cfg, h, kinds[cfg.is_local(index)], past)
        new_k.append(k)
        new_v.append(v)
    out = _finish(params, cfg, h, taps, logit_positions, compute_logits)
    if cache is not None and write_cache:
        out = dataclasses.replace(out, cache=_write_cache(cache, new_k, new_v, after=out.hidden))
    elif cache is not None:
        out = dataclasses.replace(out, cache=cache, new_kv=(tuple(new_k), tuple(new_v)))
    return out


def forward_stacked(
    params: Params,
    cfg: TargetConfig,
    tokens: jax.Array,
    positions: jax.Array,
    mask: jax.Array,
    *,
    tap_layers: Sequence[int] = (),
    logit_positions: jax.Array | None = None,
    compute_logits: bool = True,
) -> ForwardOutput:
    """Run the target, in the stacked layout (``param_specs``), over T tokens without a cache.

    The layers are a ``lax.scan`` over the stacked weights: one layer is traced and compiled
    whatever the depth (training: online targets, TPU plans of 80-layer models). Arguments and
    result as :func:`forward` (mask [B, T, T]; ``cache`` is None).

    Raises:
      TypeError: ``params`` are in the serving layout.
    """
    if is_serving(params):
        raise TypeError("forward_stacked() takes stacked params (eagle3_jax.model.to_stacked); "
                        "use forward() for the serving layout")
    b, t = tokens.shape
    # Each chip runs its own sequences (under a mesh; ``eagle3_jax.sharding.activations``).
    h = shard_batch(_embed(params, cfg, tokens))
    tap_layers = tuple(tap_layers)
    global_, local = layer_inputs(cfg, positions, mask, None)
    is_local = jnp.asarray([cfg.is_local(i) for i in range(cfg.num_layers)])

    def layer(carry, xs):
        h, taps = carry
        p, index, local_layer = xs
        for j, tap in enumerate(tap_layers):
            taps = taps.at[j].set(jnp.where(index == tap, h, taps[j]))
        attend = global_
        if local is not None:  # this layer's kind, chosen on device (one scanned body)
            attend = jax.tree.map(lambda a, b: jnp.where(local_layer, a, b), local, global_)
        h, _, _ = _layer(to_serving_layer(p, cfg), cfg, h, attend, None)
        return (shard_batch(h), taps), None

    taps0 = shard_batch(jnp.zeros((len(tap_layers), b, t, cfg.hidden_size), h.dtype), axis=1)
    (h, taps), _ = jax.lax.scan(layer, (h, taps0), (params["layers"], jnp.arange(cfg.num_layers),
                                                    is_local))
    return _finish(params, cfg, h, [taps[j] for j in range(len(tap_layers))], logit_positions,
                   compute_logits)


def _embed(params: Params, cfg: TargetConfig, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] -> embeddings [B, T, D] in the target's dtype (times sqrt(D), rounded to
    that dtype, for Gemma)."""
    dtype = jnp.dtype(cfg.dtype)
    h = weight_rows(params["embed"], tokens).astype(dtype)
    if cfg.scale_embeddings:
        h = h * jnp.asarray(math.sqrt(cfg.hidden_size), dtype)
    return h


def _finish(params: Params, cfg: TargetConfig, h: jax.Array, taps: list, logit_positions,
            compute_logits: bool) -> ForwardOutput:
    """The last layer's output h [B, T, D] -> ForwardOutput (no cache): final norm, logits at
    ``logit_positions`` (or everywhere, or none), taps [B, T, len(taps) * D] (or None)."""
    hidden = _norm(h, params["final_norm"], cfg)
    logits = None
    if compute_logits:
        head_in = hidden
        if logit_positions is not None:
            head_in = jnp.take_along_axis(hidden, logit_positions[:, :, None], axis=1)
        logits = output_logits(params, cfg, head_in)
    tap_out = jnp.concatenate(taps, axis=-1) if taps else None
    return ForwardOutput(logits=logits, cache=None, taps=tap_out, hidden=hidden)


def prefill(params: Params, cfg: TargetConfig, tokens: jax.Array, lengths: jax.Array,
            max_len: int, *, tap_layers: Sequence[int] = (),
            chunk: int | None | str = "auto", prefix: KVCache | None = None) -> ForwardOutput:
    """Run right-padded prompts tokens [B, P] (real lengths [B]) into a cache of ``max_len``
    slots: the decoders' first step.

    Returns logits [B, 1, V] and the final hidden state [B, 1, D] at each row's last real token,
    taps [B, P, len(tap_layers) * D], and the cache with ``end = lengths``. Pad tokens were
    written at slots [length, P); ending the cache there lets decoding overwrite them, and the
    causal mask (slot <= end) never shows them to anyone.

    ``prefix``: a cache of ``max_len`` slots that already holds the first ``prefix.end`` [B]
    tokens of each prompt (an earlier turn's, :meth:`KVCache.resized`; each row keeps at least
    its last token to run). Only the rest run; their taps are written, the taps of the
    tokens before ``prefix.end`` are zeros. None: a fresh cache.

    ``chunk``: None runs the prompt as one forward. An int C (dividing P) runs it as forwards
    of C tokens appended to the cache in a ``lax.while_loop`` that stops after the chunk
    holding the longest row's last token: the bucket's padding past that chunk costs nothing
    (its taps are zeros, its slots empty). The same values up to float32 round-off.
    "auto" (the default): :func:`prefill_chunk`.
    """
    b, p = tokens.shape
    if chunk == "auto":
        chunk = prefill_chunk(cfg, p)
    last = jnp.maximum(lengths - 1, 0)[:, None]  # [B, 1]
    if prefix is None and (chunk is None or chunk >= p):
        cache = KVCache.zeros(cfg, b, max_len)
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32)[None, :], (b, p))
        out = forward(params, cfg, tokens, positions, causal_mask(cache.end, p, max_len), cache,
                      tap_layers=tap_layers, logit_positions=last, cache_is_empty=True)
        return dataclasses.replace(out, cache=out.cache.replace(end=lengths.astype(jnp.int32)),
                                   hidden=jnp.take_along_axis(out.hidden, last[:, :, None], axis=1))
    chunk = p if chunk is None else chunk
    if p % chunk:
        raise ValueError(f"prefill chunk {chunk} does not divide the prompt width {p}")
    if prefix is None:
        prefix = KVCache.zeros(cfg, b, max_len)
    elif prefix.max_len != max_len:
        raise ValueError(f"prefill prefix has {prefix.max_len} slots, not max_len {max_len}")
    start = prefix.end.astype(jnp.int32)  # [B] tokens already in the cache
    rows = jnp.arange(b)[:, None]
    taps0 = (jnp.zeros((b, p, len(tap_layers) * cfg.hidden_size), jnp.dtype(cfg.dtype))
             if tap_layers else None)

    def body(carry):
        c, cache, last_h, taps = carry
        first = start + c * chunk  # [B]
        slots = first[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None]  # [B, C]
        out = forward(params, cfg, jnp.take_along_axis(tokens, jnp.minimum(slots, p - 1), axis=1),
                      slots, causal_mask(first, chunk, max_len), cache.replace(end=first),
                      tap_layers=tap_layers, compute_logits=False)
        at = last[:, 0] - first  # [B]: the row's last token within this chunk
        mine = (at >= 0) & (at < chunk)
        h = jnp.take_along_axis(out.hidden, jnp.clip(at, 0, chunk - 1)[:, None, None], axis=1)
        last_h = jnp.where(mine[:, None, None], h, last_h)
        if taps is not None:
            taps = taps.at[rows, slots].set(out.taps, mode="drop")
        return c + 1, out.cache, last_h, taps

    chunks = jnp.max((lengths - start + chunk - 1) // chunk)
    init = (jnp.zeros((), jnp.int32), prefix, jnp.zeros((b, 1, cfg.hidden_size),
                                                       jnp.dtype(cfg.dtype)), taps0)
    _, cache, last_h, taps = jax.lax.while_loop(lambda carry: carry[0] < chunks, body, init)
    return ForwardOutput(logits=output_logits(params, cfg, last_h),
                         cache=cache.replace(end=lengths.astype(jnp.int32)), taps=taps,
                         hidden=last_h)


# Tokens per forward of a chunked prefill on CPU. The kernels stream the weights once per 64
# rows at most, so chunks of 32-64 cost about the same per token (SmolLM2, one row, 512 slots:
# 300 real tokens in 514 ms at 32, 499 at 64; 130 in a 256 bucket: 243 at 32, 291 at 64, 437
# as one forward), and a smaller chunk skips more of a bucket's padding; 16 costs more per
# token (552 ms for the 300).
PREFILL_CHUNK = 32


def prefill_chunk(cfg: TargetConfig, width: int) -> int | None:
    """Tokens per forward of a prefill over ``width`` prompt slots: ``PREFILL_CHUNK`` where the
    CPU kernels run a chunk's matmuls and attention (float32 on CPU; the attention kernel reads
    the cache only up to the last slot a chunk sees), so the padding of a prompt's bucket past
    its last chunk is skipped at about the same cost per token; None (one forward of the whole
    width) elsewhere: accelerators, other dtypes or head sizes, a width of one chunk."""
    dtype = jnp.dtype(cfg.dtype)
    chunk_queries = (1, PREFILL_CHUNK, cfg.num_heads, cfg.head_dim)
    if width > PREFILL_CHUNK and width % PREFILL_CHUNK == 0 and kernels_in_use(dtype, "matmul") \
            and uses_attention_kernel(chunk_queries, cfg.num_kv_heads, dtype):
        return PREFILL_CHUNK
    return None


def _write_cache(cache: KVCache, new_k, new_v, after: jax.Array) -> KVCache:
    """Write each layer's new keys / values [B, T, K, H] at slots [end, end + T).

    Out-of-range slots are dropped; decoders stop before the cache is full. ``after`` (the final
    hidden state, [B, T, D]) orders every write after every read of the cache
    (:func:`write_kv`), so XLA updates the buffers in place instead of copying each layer's
    cache every step.
    """
    b, t = after.shape[:2]
    rows = jnp.arange(b)[:, None]
    slots = cache.end[:, None] + jnp.arange(t)[None, :]  # [B, T]
    written = [write_kv(k, v, rows, slots, nk, nv, after=after)
               for k, v, nk, nv in zip(cache.k, cache.v, new_k, new_v)]
    k, v = (tuple(layers) for layers in zip(*written))
    return dataclasses.replace(cache, k=k, v=v)


def output_logits(params: Params, cfg: TargetConfig, hidden: jax.Array) -> jax.Array:
    """Final-normed hidden [B, T, D] -> float32 logits [B, T, V] (tied or untied head; soft-capped
    as c * tanh(logits / c) where the config sets c)."""
    logits = _head(params, cfg, hidden)
    if cfg.final_logit_softcap is not None:
        cap = cfg.final_logit_softcap
        logits = jnp.tanh(logits / cap) * cap
    return logits


def _head(params: Params, cfg: TargetConfig, hidden: jax.Array) -> jax.Array:
    if cfg.tie_word_embeddings and params["embed"].ndim == 3:  # embed as panels
        return panel_matmul(hidden, params["embed"], preferred_element_type=jnp.float32)
    if cfg.tie_word_embeddings:  # embed [V, D] is [out, in]
        return rows_matmul(hidden, params["embed"], preferred_element_type=jnp.float32)
    if "lm_head_panels" in params:
        return panel_matmul(hidden, params["lm_head_panels"], preferred_element_type=jnp.float32)
    return rows_matmul(hidden, params["lm_head"], in_out=True,  # lm_head [D, V] is [in, out]
                       preferred_element_type=jnp.float32)
