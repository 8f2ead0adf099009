"""Training-time test (reference §4): the draft unrolled over K of its own steps, one lax.scan.

Alignment, for a sequence x_0..x_{T-1} with target taps f_p and target logits l_p (l_p predicts
x_{p+1}) and loss mask m_p (assistant tokens). At step i and index t the draft reads

    feature  fc(f_t) at i = 0, else its own step i-1 output at index t
    token    x_{t+1+i}                      position  t + i
    label    softmax(l_{t+1+i}) restricted to the draft vocabulary: the prediction of x_{t+2+i}
    weight   m_{t+2+i} * t2d[argmax l_{t+1+i}]  (zero past the row end or the document)

The weight marks the token being predicted (``loss_mask="predicted"``, the default): every
assistant token is scored, from the first. ``loss_mask="reference"`` reads m_{t+i} instead, as the
reference's training forward does (its data preparation moves the mask to compensate; on our
mask it skips the first two tokens of every answer and scores the two after its end), for
like-for-like comparisons with it.

and attends to the step-0 keys of indices s <= t (same segment) plus, for j = 1..i, the step-j
key at its own index t ("the diagonal"): exactly what a depth-i tree node sees at inference,
the real context plus its own ancestors. Loss = sum_i 0.8**i * loss_i.

The per-position objective (``objective``): ``"kl"`` (the reference's): the cross-entropy of
the draft q against the target p, which is KL(p || q) plus p's entropy (a constant); or ``"lk"``,
the LK hybrid (arXiv 2602.23881) aimed at acceptance itself: with alpha = sum_x min(p, q) (the
chance a draft sample is accepted) and lambda = exp(-3 alpha) (held constant in the gradient),
lambda * KL(p || q) + (1 - lambda) * TV(p, q), TV = 1 - alpha: KL while the draft is far off,
total variation as it nears the target.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import struct

from eagle3_jax.draft.config import DraftConfig
from eagle3_jax.draft.model import (draft_logits, finish_layer, fuse_taps, head_input,
                                    next_feature, project_qkv)
from eagle3_jax.model.params import Params
from eagle3_jax.sharding.activations import shard_batch

STEP_WEIGHT_DECAY = 0.8
# loss_mask alignment -> offset of the mask read at step i, index t: m_{t + offset + i}.
LOSS_MASK_OFFSETS = {"predicted": 2, "reference": 0}
OBJECTIVES = ("kl", "lk")


@struct.dataclass
class TTTBatch:
    """One batch of TTT inputs, all aligned on the sequence index.

    tokens        [B, T] int32 token ids x_p
    taps          [B, T, 3D]   target hidden states entering the tapped layers, at p
    target_logp   [B, T, Vd]   log-softmax of the target logits restricted to the draft vocab, l_p
    target_in_draft [B, T] bool  t2d[argmax of the *full* target logits l_p]
    loss_mask     [B, T] bool  x_p is an assistant token
    segment_ids   [B, T] int32 sequence id per packed document; 0 = padding
    positions     [B, T] int32 RoPE position of x_p inside its document
    """

    tokens: jax.Array
    taps: jax.Array
    target_logp: jax.Array
    target_in_draft: jax.Array
    loss_mask: jax.Array
    segment_ids: jax.Array
    positions: jax.Array


def ttt_forward(
    params: Params,
    cfg: DraftConfig,
    embed_table: jax.Array,
    batch: TTTBatch,
    *,
    return_logits: bool = False,
    loss_mask: str = "predicted",
    hit_ranks: int = 0,
    objective: str = "kl",
):
    """Run K = cfg.ttt_steps draft steps over a batch.

    ``loss_mask``: "predicted" or "reference", which mask position weighs a step (module doc).
    ``hit_ranks``: R > 0 also measures top-r hit rates, r = 1..R (what the tree chooser models
    a tree from: how often the target's token is among the draft's r best at each depth).
    ``objective``: "kl" or "lk", the per-position loss (module doc).

    Returns:
      (loss scalar, metrics dict with ``loss_per_step`` [K], ``acc_per_step`` [K],
      ``weight_per_step`` [K] (number of scored positions), ``hits_per_step`` [K, R] (share of
      scored positions whose label is among the draft's top r + 1) when ``hit_ranks``, and
      ``logits`` [K, B, T, Vd] when ``return_logits``).
    """
    if loss_mask not in LOSS_MASK_OFFSETS:
        raise ValueError(f"loss_mask must be one of {sorted(LOSS_MASK_OFFSETS)}, got {loss_mask!r}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    mask_offset = LOSS_MASK_OFFSETS[loss_mask]
    k_steps = cfg.ttt_steps
    # Each chip runs its own sequences (under a mesh; ``eagle3_jax.sharding.activations``).
    batch = jax.tree.map(shard_batch, batch)
    b, t = batch.tokens.shape
    # Pad the sequence axis by K + 1 so index t + 2 + i is always in range; padding is segment 0.
    padded = lambda x, fill: jnp.pad(x, [(0, 0), (0, k_steps + 2)] + [(0, 0)] * (x.ndim - 2),
                                     constant_values=fill)
    tokens_p = padded(batch.tokens, 0)
    seg_p = padded(batch.segment_ids, 0)
    logp_p = padded(batch.target_logp, 0.0)
    in_draft_p = padded(batch.target_in_draft, False)
    loss_mask_p = padded(batch.loss_mask, False)
    # The target's token at every index, once: step i reads it shifted by i (one argmax over
    # [B, T + K + 2, Vd] rather than one a step; argmax is a slow reduction on XLA CPU).
    labels_p = jnp.argmax(logp_p, -1)
    shifted = lambda x, i: jax.lax.dynamic_slice_in_dim(x, i, t, axis=1)

    seg = batch.segment_ids
    idx = jnp.arange(t)
    causal = (idx[None, :, None] >= idx[None, None, :]) & (seg[:, :, None] == seg[:, None, :])
    causal = causal & (seg[:, :, None] > 0)  # [B, T(query), T(key)]

    g0 = shard_batch(fuse_taps(params, cfg, batch.taps))
    kv_shape = (k_steps, b, t, cfg.num_kv_heads, cfg.head_dim)
    zeros_kv = shard_batch(jnp.zeros(kv_shape, g0.dtype), axis=1)
    scale = 1.0 / math.sqrt(cfg.head_dim)

    def step(carry, i):
        g, k0, v0, diag_k, diag_v = carry
        tok = shifted(tokens_p, i + 1)
        embeds = shard_batch(jnp.take(embed_table, tok, axis=0))
        q, k, v = project_qkv(params, cfg, embeds, g, batch.positions + i)
        k0 = jnp.where(i == 0, k, k0)
        v0 = jnp.where(i == 0, v, v0)
        diag_k = diag_k.at[i].set(k)
        diag_v = diag_v.at[i].set(v)
        # Scores against step-0 keys (causal) and the diagonal keys of steps 1..i.
        qg = q.reshape(b, t, cfg.num_kv_heads, -1, cfg.head_dim)  # [B, T, K, G, H]
        steps = jnp.arange(k_steps)
        diag_ok = (steps >= 1) & (steps <= i)  # [K]
        attn = ttt_attention(qg, k0, v0, diag_k, diag_v, causal, diag_ok, scale)
        attn = attn.reshape(b, t, cfg.num_heads, cfg.head_dim)
        h = shard_batch(finish_layer(params, cfg, g, attn))

        # Labels: the target at x_{t+1+i} (predicting x_{t+2+i}), weighed by the loss mask.
        label_logp = shifted(logp_p, i + 1)
        # Label (t+1+i) and masked token (t+i+offset) in t's document: segments are contiguous,
        # so checking the later of the two is enough.
        same_doc = shifted(seg_p, i + max(1, mask_offset)) == seg
        weight = (shifted(loss_mask_p, i + mask_offset) & shifted(in_draft_p, i + 1) & same_doc
                  & (seg > 0)).astype(jnp.float32)
        n_scored = jnp.sum(weight)
        label = shifted(labels_p, i + 1)
        hits_i = None
        if objective == "kl" and not (return_logits or hit_ranks):
            # Training: the loss, its gradient through the output head and the draft's top-1
            # hit in one function (``head_cross_entropy``): nothing [B, T, Vd] is kept for
            # backward.
            loss_i, hit = head_cross_entropy(head_input(params, cfg, h), params["lm_head"],
                                             label_logp, weight / jnp.maximum(n_scored, 1.0),
                                             label)
            logits = None
        else:
            logits = draft_logits(params, cfg, h)  # [B, T, Vd]
            logq = jax.nn.log_softmax(logits, axis=-1)
            per_pos = position_loss(label_logp, logq, objective)  # [B, T]
            loss_i = jnp.sum(per_pos * weight) / jnp.maximum(n_scored, 1.0)
            if hit_ranks:
                # Rank of the label among the draft's logits (0 = its top-1: the same hit as
                # label_is_top1's), then top-r hit rates.
                label_logit = jnp.take_along_axis(logits, label[..., None], axis=-1)
                rank = jnp.sum(logits > label_logit, axis=-1)  # [B, T]
                hit = rank == 0
                within = rank[..., None] < jnp.arange(1, hit_ranks + 1)  # [B, T, R]
                hits_i = (jnp.sum(within * weight[..., None], axis=(0, 1))
                          / jnp.maximum(n_scored, 1.0))
            else:
                hit = label_is_top1(logits, label)
        acc_i = jnp.sum(hit * weight) / jnp.maximum(n_scored, 1.0)
        out = (loss_i, acc_i, n_scored, hits_i, logits if return_logits else None)
        return (shard_batch(next_feature(params, cfg, h)), k0, v0, diag_k, diag_v), out

    init = (g0, zeros_kv[0], zeros_kv[0], zeros_kv, zeros_kv)
    _, (losses, accs, counts, hits, logits) = jax.lax.scan(step, init, jnp.arange(k_steps))
    weights = STEP_WEIGHT_DECAY ** jnp.arange(k_steps, dtype=jnp.float32)
    metrics = {"loss_per_step": losses, "acc_per_step": accs, "weight_per_step": counts}
    if hit_ranks:
        metrics["hits_per_step"] = hits
    if return_logits:
        metrics["logits"] = logits
    return jnp.sum(weights * losses), metrics


def _ttt_scores(q, k0, diag_k, causal, diag_ok, scale):
    """Masked scores of ``ttt_attention``: ([B, K, G, T, S], [B, K, G, T, J]) float32."""
    neg = jnp.finfo(jnp.float32).min
    s_ctx = jnp.einsum("BTKGH,BSKH->BKGTS", q, k0, preferred_element_type=jnp.float32)
    s_diag = jnp.einsum("BTKGH,JBTKH->BKGTJ", q, diag_k, preferred_element_type=jnp.float32)
    return (jnp.where(causal[:, None, None], s_ctx * scale, neg),
            jnp.where(diag_ok, s_diag * scale, neg))


def _ttt_attention_fwd_parts(q, k0, v0, diag_k, diag_v, causal, diag_ok, scale):
    s_ctx, s_diag = _ttt_scores(q, k0, diag_k, causal, diag_ok, scale)
    # One softmax over both key sets, without concatenating them.
    m = jnp.maximum(jnp.max(s_ctx, -1), jnp.max(s_diag, -1))[..., None]  # [B, K, G, T, 1]
    e_ctx, e_diag = jnp.exp(s_ctx - m), jnp.exp(s_diag - m)
    inv = 1.0 / (jnp.sum(e_ctx, -1, keepdims=True) + jnp.sum(e_diag, -1, keepdims=True))
    p_ctx, p_diag = (e_ctx * inv).astype(v0.dtype), (e_diag * inv).astype(v0.dtype)
    out = (jnp.einsum("BKGTS,BSKH->BTKGH", p_ctx, v0)
           + jnp.einsum("BKGTJ,JBTKH->BTKGH", p_diag, diag_v))
    return out, (m, inv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def ttt_attention(q: jax.Array, k0: jax.Array, v0: jax.Array, diag_k: jax.Array,
                  diag_v: jax.Array, causal: jax.Array, diag_ok: jax.Array,
                  scale: float) -> jax.Array:
    """A TTT step's attention: the step-0 keys under ``causal`` plus the diagonal keys.

    Args:
      q: [B, T, K, G, H] queries (G query heads per kv head); k0, v0: [B, S=T, K, H] the
        step-0 keys and values; diag_k, diag_v: [J, B, T, K, H] each step's key and value at
        its own index; causal: [B, T, S] bool; diag_ok: [J] bool, the diagonal steps seen.
    Returns:
      [B, T, K, G, H] in v0's dtype: softmax over the S + J scores of each query.

    Its gradient recomputes the probabilities from q and the keys (flash attention's
    backward, untiled) instead of keeping them: autodiff kept two [K_steps, B, K, G, T, T + J]
    float32 stacks a training step (1.6 GB at 4 x 512 tokens, 7 steps), zero-filled and written
    every step. A fully masked row (padding) is uniform, as ``jax.nn.softmax`` makes it.
    """
    return _ttt_attention_fwd_parts(q, k0, v0, diag_k, diag_v, causal, diag_ok, scale)[0]


def _ttt_attention_fwd(q, k0, v0, diag_k, diag_v, causal, diag_ok, scale):
    out, (m, inv) = _ttt_attention_fwd_parts(q, k0, v0, diag_k, diag_v, causal, diag_ok,
                                             scale)
    return out, (q, k0, v0, diag_k, diag_v, causal, diag_ok, out, m, inv)


def _ttt_attention_bwd(scale, residuals, d_out):
    q, k0, v0, diag_k, diag_v, causal, diag_ok, out, m, inv = residuals
    f32 = jnp.float32
    s_ctx, s_diag = _ttt_scores(q, k0, diag_k, causal, diag_ok, scale)
    p_ctx, p_diag = jnp.exp(s_ctx - m) * inv, jnp.exp(s_diag - m) * inv
    d_out = d_out.astype(f32)
    d_v0 = jnp.einsum("BKGTS,BTKGH->BSKH", p_ctx, d_out)
    d_diag_v = jnp.einsum("BKGTJ,BTKGH->JBTKH", p_diag, d_out)
    dp_ctx = jnp.einsum("BTKGH,BSKH->BKGTS", d_out, v0, preferred_element_type=f32)
    dp_diag = jnp.einsum("BTKGH,JBTKH->BKGTJ", d_out, diag_v, preferred_element_type=f32)
    # softmax backward: ds = p * (dp - sum_s p dp), and sum_s p dp = <d_out, out> per query.
    delta = jnp.einsum("BTKGH,BTKGH->BKGT", d_out, out.astype(f32))[..., None]
    # Masked scores are constants: no gradient (a fully masked row has p > 0 there).
    ds_ctx = jnp.where(causal[:, None, None], p_ctx * (dp_ctx - delta) * scale, 0.0)
    ds_diag = jnp.where(diag_ok, p_diag * (dp_diag - delta) * scale, 0.0)
    d_q = (jnp.einsum("BKGTS,BSKH->BTKGH", ds_ctx, k0, preferred_element_type=f32)
           + jnp.einsum("BKGTJ,JBTKH->BTKGH", ds_diag, diag_k, preferred_element_type=f32))
    d_k0 = jnp.einsum("BKGTS,BTKGH->BSKH", ds_ctx, q, preferred_element_type=f32)
    d_diag_k = jnp.einsum("BKGTJ,BTKGH->JBTKH", ds_diag, q, preferred_element_type=f32)
    cast = lambda g, x: g.astype(x.dtype)  # noqa: E731
    return (cast(d_q, q), cast(d_k0, k0), cast(d_v0, v0), cast(d_diag_k, diag_k),
            cast(d_diag_v, diag_v), None, None)


ttt_attention.defvjp(_ttt_attention_fwd, _ttt_attention_bwd)


def position_loss(target_logp: jax.Array, draft_logq: jax.Array, objective: str) -> jax.Array:
    """Per-position loss [...] of the draft's log-probabilities against the target's, both
    [..., Vd] (module doc): "kl" the cross-entropy, "lk" the LK hybrid."""
    p = jnp.exp(target_logp)
    cross_entropy = -jnp.sum(p * draft_logq, axis=-1)
    if objective == "kl":
        return cross_entropy
    entropy = -jnp.sum(jnp.where(p > 0, p * target_logp, 0.0), axis=-1)
    alpha = jnp.sum(jnp.minimum(p, jnp.exp(draft_logq)), axis=-1)
    lam = jax.lax.stop_gradient(jnp.exp(-3.0 * alpha))
    return lam * (cross_entropy - entropy) + (1.0 - lam) * (1.0 - alpha)


def label_is_top1(logits: jax.Array, label: jax.Array) -> jax.Array:
    """[...] bool: the label's logit is the largest of ``logits`` [..., V] (rank 0; a tie counts
    as a hit). One max and one gather: XLA CPU runs a max as a fast vectorised reduction, an
    argmax (a variadic reduction) about 20x slower (37 ms over [2048, 8192])."""
    label_logit = jnp.take_along_axis(logits, label[..., None], axis=-1)[..., 0]
    return label_logit >= jnp.max(logits, axis=-1)


@jax.custom_vjp
def head_cross_entropy(x: jax.Array, w: jax.Array, target_logp: jax.Array,
                       weight: jax.Array, label: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The "kl" objective through the draft's output head, with its gradient computed forward.

    Args:
      x: [..., D] the normed hidden state; w: [D, Vd] the output head (``lm_head``).
      target_logp: [..., Vd] the target's log-probabilities over the draft vocabulary.
      weight: [...] each position's weight in the sum (no gradient).
      label: [...] int32 the target's token (in the draft vocabulary) at each position.
    Returns:
      (sum over positions of weight * cross-entropy(p, softmax(x @ w)) — a scalar, whether the
      label is the draft's top-1 [...] bool, :func:`label_is_top1`).

    The same value and gradients as autodiff of ``position_loss(..., "kl")`` over
    ``draft_logits``. But the loss is a scalar, so d loss / d logits =
    weight * (softmax(logits) * sum(p) - p) is known up to the scalar cotangent already in the
    forward pass: the forward computes the two head gradients there and keeps only them
    ([..., D] and [D, Vd]) for the backward, which scales them. Autodiff instead keeps the
    [..., Vd] logits of every TTT step (freshly zeroed scan buffers, hundreds of MB a step) and
    fuses the softmax backward into a transposing copy (``bench train``).
    """
    loss, hit, _ = _head_cross_entropy_fwd_parts(x, w, target_logp, weight, label, grads=False)
    return loss, hit


def _head_cross_entropy_fwd_parts(x, w, target_logp, weight, label, grads: bool):
    lead, d = x.shape[:-1], x.shape[-1]
    x2 = shard_batch(x.reshape(-1, d))
    logits = shard_batch(jnp.dot(x2, w, preferred_element_type=jnp.float32))  # [N, Vd]
    logq = jax.nn.log_softmax(logits, axis=-1)
    p = jnp.exp(target_logp.reshape(logits.shape).astype(jnp.float32))
    wt = weight.reshape(-1).astype(jnp.float32)
    loss = -jnp.sum(wt * jnp.sum(p * logq, axis=-1))
    hit = label_is_top1(logits, label.reshape(-1)).reshape(lead)
    if not grads:
        return loss, hit, None
    d_logits = wt[:, None] * (jnp.exp(logq) * jnp.sum(p, axis=-1, keepdims=True) - p)
    d_x = jnp.dot(d_logits, w.T.astype(jnp.float32), preferred_element_type=jnp.float32)
    d_w = jnp.dot(x2.T.astype(jnp.float32), d_logits, preferred_element_type=jnp.float32)
    return loss, hit, (d_x.reshape(x.shape), d_w)


def _head_cross_entropy_fwd(x, w, target_logp, weight, label):
    loss, hit, (d_x, d_w) = _head_cross_entropy_fwd_parts(x, w, target_logp, weight, label,
                                                          grads=True)
    return (loss, hit), (d_x.astype(x.dtype), d_w.astype(w.dtype))


def _head_cross_entropy_bwd(residuals, cotangents):
    d_x, d_w = residuals
    g = cotangents[0]
    # The target, the weights and the labels are data: no cotangent (None: zeros, nothing kept).
    return (g * d_x).astype(d_x.dtype), (g * d_w).astype(d_w.dtype), None, None, None


head_cross_entropy.defvjp(_head_cross_entropy_fwd, _head_cross_entropy_bwd)
