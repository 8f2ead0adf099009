"""Training-time test: the lax.scan equals a plainly unrolled reference, and the draft's step-i
logits in training equal what the same draft computes at inference, step by step over a KV
cache, for a node at depth i whose ancestors are the teacher-forced tokens."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.draft.config import DraftConfig
from eagle3_jax.draft.model import (draft_logits, draft_step_cached, empty_draft_cache,
                                    finish_layer, fuse_taps,
                                    project_qkv)
from eagle3_jax.draft.params import init_draft_params
from eagle3_jax.draft.ttt import STEP_WEIGHT_DECAY, TTTBatch, ttt_forward
from eagle3_jax.model.layers import attention
from xla_flags import AS_COMMANDS

B, T, V, VD, D = 2, 10, 64, 40, 32


def _setup(steps=4, kv_heads=2, seed=0, eagle31=False):
    cfg = DraftConfig(hidden_size=D, intermediate_size=48, num_heads=4, num_kv_heads=kv_heads,
                      head_dim=8, vocab_size=V, draft_vocab_size=VD, tap_layers=(1, 2, 3),
                      ttt_steps=steps, fc_norm=eagle31, norm_output=eagle31)
    keys = jax.random.split(jax.random.key(seed), 8)
    params = init_draft_params(cfg, keys[0], scale=0.3)
    params = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(keys[1], x.shape), params)
    embed = jax.random.normal(keys[2], (V, D))
    segs = jnp.ones((B, T), jnp.int32).at[1, -3:].set(0)  # row 1 is padded at the end
    batch = TTTBatch(
        tokens=jax.random.randint(keys[3], (B, T), 0, V),
        taps=jax.random.normal(keys[4], (B, T, 3 * D)),
        target_logp=jax.nn.log_softmax(2 * jax.random.normal(keys[5], (B, T, VD))),
        target_in_draft=jax.random.bernoulli(keys[6], 0.8, (B, T)),
        loss_mask=jax.random.bernoulli(keys[7], 0.7, (B, T)),
        segment_ids=segs,
        positions=jnp.broadcast_to(jnp.arange(T), (B, T)),
    )
    return cfg, params, embed, batch


def _ttt(params, cfg, embed, batch, **kwargs):
    """``ttt_forward`` compiled, as training runs it (eagerly, each of its ops would compile)."""
    return jax.jit(lambda p: ttt_forward(p, cfg, embed, batch, **kwargs))(params)


def _unrolled_reference(params, cfg, embed, batch, loss_mask="predicted", with_weights=False):
    """:func:`_unrolled_reference_ops` as one compiled program (NumPy results)."""
    return jax.tree.map(np.asarray, jax.jit(lambda p: _unrolled_reference_ops(
        p, cfg, embed, batch, loss_mask, with_weights))(params))


def _unrolled_reference_ops(params, cfg, embed, batch, loss_mask="predicted",
                            with_weights=False):
    """Python loop, keys concatenated step by step as the PyTorch reference caches them.

    The loss at step i, index t scores the label l_{t+1+i} (the prediction of x_{t+2+i}) with
    the mask of that predicted token, m_{t+2+i} ("predicted"), or with m_{t+i} ("reference").
    """
    offset = {"predicted": 2, "reference": 0}[loss_mask]
    k_steps = cfg.ttt_steps
    tokens, seg = np.asarray(batch.tokens), np.asarray(batch.segment_ids)
    rms = lambda x, w: x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps) * w  # noqa: E731
    taps = batch.taps
    if cfg.fc_norm:  # EAGLE-3.1: each tap normed by its own scale before fc
        taps = rms(taps.reshape(B, T, 3, D), params["fc_norm"]).reshape(B, T, 3 * D)
    g = taps @ params["fc"]
    keys, values, logits_all, losses, weights, labels = [], [], [], [], [], []
    idx = np.arange(T)
    for i in range(k_steps):
        tok = np.zeros_like(tokens)
        tok[:, : max(T - 1 - i, 0)] = tokens[:, 1 + i:]
        q, k, v = project_qkv(params, cfg, embed[tok], g, batch.positions + i)
        keys.append(k)
        values.append(v)
        all_k = jnp.concatenate(keys, axis=1).transpose(0, 2, 3, 1)  # [B, K, H, (i+1)T]
        all_v = jnp.concatenate(values, axis=1).transpose(0, 2, 1, 3)
        causal = (idx[:, None] >= idx[None, :])[None] & (seg[:, :, None] == seg[:, None, :])
        causal &= seg[:, :, None] > 0
        diag = np.broadcast_to(np.eye(T, dtype=bool), (B, T, T))
        mask = np.concatenate([causal] + [diag] * i, axis=-1)
        h = finish_layer(params, cfg, g, attention(q, [(all_k, all_v, jnp.asarray(mask))]))
        logits = draft_logits(params, cfg, h)
        g = rms(h, params["final_norm"]) if cfg.norm_output else h  # EAGLE-3.1 feeds back normed
        logits_all.append(logits)
        # Labels and weights shifted as the reference shifts them.
        def shift(x, by, fill):
            out = np.full_like(x, fill)
            out[:, : max(T - by, 0)] = x[:, by:]
            return out
        label = shift(np.asarray(batch.target_logp), i + 1, 0.0)
        w = (shift(np.asarray(batch.loss_mask), i + offset, False)
             & shift(np.asarray(batch.target_in_draft), i + 1, False)
             & (shift(seg, i + 1, 0) == seg) & (shift(seg, i + offset, 0) == seg)
             & (seg > 0)).astype(np.float32)
        per_pos = -jnp.sum(np.exp(label) * jax.nn.log_softmax(logits), -1)
        losses.append(jnp.sum(per_pos * w) / max(w.sum(), 1.0))
        weights.append(w)
        labels.append(label.argmax(-1))
    total = sum(STEP_WEIGHT_DECAY ** i * l for i, l in enumerate(losses))
    if with_weights:
        return total, jnp.stack(losses), jnp.stack(logits_all), np.stack(weights), np.stack(labels)
    return total, jnp.stack(losses), jnp.stack(logits_all)


@pytest.mark.parametrize("kv_heads,loss_mask,eagle31", [
    (1, "predicted", False), (2, "predicted", False), (4, "predicted", False),
    (2, "reference", False), (2, "predicted", True)])
def test_scan_equals_unrolled_reference(kv_heads, loss_mask, eagle31):
    cfg, params, embed, batch = _setup(kv_heads=kv_heads, eagle31=eagle31)
    if eagle31:  # scales away from 1, so a missing norm shows
        params = {**params, "fc_norm": params["fc_norm"] * jnp.array([[0.5], [1.0], [2.0]])}
    loss, metrics = _ttt(params, cfg, embed, batch, return_logits=True, loss_mask=loss_mask)
    ref_total, ref_losses, ref_logits = _unrolled_reference(params, cfg, embed, batch,
                                                            loss_mask)
    valid = np.asarray(batch.segment_ids) > 0  # padded queries see nothing: their output is unused
    np.testing.assert_allclose(np.asarray(metrics["logits"])[:, valid],
                               np.asarray(ref_logits)[:, valid], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(metrics["loss_per_step"], ref_losses, rtol=1e-5)
    np.testing.assert_allclose(float(loss), ref_total, rtol=1e-5)


def test_top_r_hit_rates_match_ranks_of_the_reference_logits():
    """hits_per_step[i, r-1]: the scored share whose target token is among the draft's r best
    at step i, counted here by sorting the unrolled reference's logits."""
    cfg, params, embed, batch = _setup(steps=3)
    _, metrics = _ttt(params, cfg, embed, batch, hit_ranks=VD)
    _, _, logits, weights, labels = _unrolled_reference(params, cfg, embed, batch,
                                                        with_weights=True)
    logits = np.asarray(logits)
    hits = np.asarray(metrics["hits_per_step"])  # [K, R]
    assert hits.shape == (cfg.ttt_steps, VD)
    for i in range(cfg.ttt_steps):
        order = np.argsort(-logits[i], axis=-1)  # [B, T, Vd] best first
        rank = np.argmax(order == labels[i][..., None], axis=-1)  # [B, T]
        for r in (1, 2, 5, VD):
            expected = (weights[i] * (rank < r)).sum() / weights[i].sum()
            assert hits[i, r - 1] == pytest.approx(expected, abs=1e-6), (i, r)
    np.testing.assert_allclose(hits[:, 0], metrics["acc_per_step"], atol=1e-6)
    np.testing.assert_allclose(hits[:, -1], 1.0, atol=1e-6)  # every label is somewhere
    assert np.all(np.diff(hits, axis=1) >= -1e-7)


def test_gradients_equal_unrolled_reference():
    cfg, params, embed, batch = _setup(steps=3)
    g_scan = jax.jit(jax.grad(lambda p: ttt_forward(p, cfg, embed, batch)[0]))(params)

    g_ref = jax.jit(jax.grad(lambda p: _unrolled_reference_ops(p, cfg, embed, batch)[0]))(params)
    for name in g_scan:
        np.testing.assert_allclose(g_scan[name], g_ref[name], atol=1e-6, rtol=1e-4, err_msg=name)


def test_swiglu_gradient_equals_autodiff_of_its_definition():
    """``layers.swiglu`` writes its own gradient (x, gate, up kept): value and all four
    cotangents against autodiff of silu(x @ w_gate) * (x @ w_up) @ w_down."""
    from eagle3_jax.model.layers import swiglu

    keys = jax.random.split(jax.random.key(11), 5)
    x = jax.random.normal(keys[0], (2, 5, D))
    w_gate, w_up = (0.3 * jax.random.normal(k, (D, 48)) for k in keys[1:3])
    w_down = 0.3 * jax.random.normal(keys[3], (48, D))
    d_out = jax.random.normal(keys[4], (2, 5, D))

    def definition(x, w_gate, w_up, w_down):
        return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down

    args = (x, w_gate, w_up, w_down)
    got, vjp_got = jax.vjp(swiglu, *args)
    want, vjp_want = jax.vjp(definition, *args)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for name, a, r in zip(["x", "w_gate", "w_up", "w_down"], vjp_got(d_out), vjp_want(d_out)):
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("scale_shape", [(D,), (3, D)])
def test_rms_norm_gradient_equals_autodiff_of_its_definition(scale_shape):
    """``layers.rms_norm`` writes its own gradient (x kept, the norm recomputed): value and both
    cotangents against autodiff of x / sqrt(mean(x^2) + eps) * scale, for one scale and for
    per-tap scales (EAGLE-3.1's fc_norm); rows of very different sizes."""
    from eagle3_jax.model.layers import rms_norm

    eps = 1e-5
    keys = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(keys[0], (2, 5, 3, D)) * jnp.array([0.01, 1.0, 30.0])[:, None]
    scale = 1.0 + 0.3 * jax.random.normal(keys[1], scale_shape)
    d_out = jax.random.normal(keys[2], x.shape)

    def definition(x, scale):
        return x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale

    got, vjp_got = jax.vjp(lambda x, s: rms_norm(x, s, eps), x, scale)
    want, vjp_want = jax.vjp(definition, x, scale)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for name, a, r in zip(["x", "scale"], vjp_got(d_out), vjp_want(d_out)):
        assert a.shape == r.shape, name
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(r))),
                                   err_msg=name)


@pytest.mark.parametrize("seen", [0, 2])
def test_ttt_attention_value_and_gradient_equal_autodiff_of_the_softmax(seen):
    """``ttt_attention`` recomputes its probabilities in the backward pass: its value and every
    input's cotangent against autodiff of one softmax over the concatenated scores, with a fully
    masked (padding) query row and 0 or 2 diagonal steps seen."""
    from eagle3_jax.draft.ttt import ttt_attention

    b, t, kh, g, h, j = 2, 6, 2, 3, 4, 4
    keys = jax.random.split(jax.random.key(3), 6)
    q = jax.random.normal(keys[0], (b, t, kh, g, h))
    k0, v0 = (jax.random.normal(k, (b, t, kh, h)) for k in keys[1:3])
    diag_k, diag_v = (jax.random.normal(k, (j, b, t, kh, h)) for k in keys[3:5])
    d_out = jax.random.normal(keys[5], (b, t, kh, g, h))
    causal = jnp.tril(jnp.ones((t, t), bool))[None].repeat(b, 0).at[1, 2].set(False)
    diag_ok = (jnp.arange(j) >= 1) & (jnp.arange(j) <= seen)
    scale = 0.5

    def definition(q, k0, v0, diag_k, diag_v):
        neg = jnp.finfo(jnp.float32).min
        s_ctx = jnp.einsum("BTKGH,BSKH->BKGTS", q, k0) * scale
        s_diag = jnp.einsum("BTKGH,JBTKH->BKGTJ", q, diag_k) * scale
        s = jnp.concatenate([jnp.where(causal[:, None, None], s_ctx, neg),
                             jnp.where(diag_ok, s_diag, neg)], -1)
        p = jax.nn.softmax(s, -1)
        return (jnp.einsum("BKGTS,BSKH->BTKGH", p[..., :t], v0)
                + jnp.einsum("BKGTJ,JBTKH->BTKGH", p[..., t:], diag_v))

    args = (q, k0, v0, diag_k, diag_v)
    got, vjp_got = jax.vjp(lambda *a: ttt_attention(*a, causal, diag_ok, scale), *args)
    want, vjp_want = jax.vjp(definition, *args)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for name, a, r in zip(["q", "k0", "v0", "diag_k", "diag_v"], vjp_got(d_out), vjp_want(d_out)):
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("eagle31", [False, True])
def test_training_logits_equal_inference_step_by_step(eagle31):
    """Depth-i node at inference (context + ancestors in the draft KV cache) == TTT step i."""
    cfg, params, embed, batch = _setup(steps=4, eagle31=eagle31)
    _, metrics = ttt_forward(params, cfg, embed, batch, return_logits=True)
    train_logits = np.asarray(metrics["logits"])  # [K, B, T, Vd]
    tokens = np.asarray(batch.tokens)
    row = 0
    slots = T + cfg.ttt_steps
    # Step 0 over the whole context: slot s holds (feature f_s, token x_{s+1}) at position s.
    ctx_tok = np.zeros((1, T), np.int32)
    ctx_tok[0, :-1] = tokens[row, 1:]
    cache_k, cache_v = empty_draft_cache(cfg, 1, slots)
    mask0 = np.zeros((1, T, slots), bool)
    mask0[0, :, :T] = np.tril(np.ones((T, T), bool))
    g0 = fuse_taps(params, cfg, batch.taps[row:row + 1])
    h0, logits0, cache_k, cache_v = draft_step_cached(
        params, cfg, embed[ctx_tok], g0, jnp.arange(T)[None], jnp.asarray(mask0), cache_k,
        cache_v, jnp.arange(T)[None])
    np.testing.assert_allclose(logits0[0], train_logits[0, row], atol=2e-5, rtol=1e-5)
    for t in range(T - cfg.ttt_steps):
        g, ck, cv = h0[:, t:t + 1], cache_k, cache_v
        for depth in range(1, cfg.ttt_steps):
            slot = T + depth - 1
            mask = np.zeros((1, 1, slots), bool)
            mask[0, 0, : t + 1] = True  # the real context up to index t
            mask[0, 0, T: slot + 1] = True  # ancestors and itself
            tok = jnp.asarray([[tokens[row, t + 1 + depth]]])
            g, logits, ck, cv = draft_step_cached(
                params, cfg, embed[tok], g, jnp.asarray([[t + depth]]), jnp.asarray(mask), ck,
                cv, jnp.asarray([[slot]]))
            np.testing.assert_allclose(logits[0, 0], train_logits[depth, row, t], atol=3e-5,
                                       rtol=1e-5, err_msg=f"t={t} depth={depth}")


@pytest.mark.parametrize("eagle31", [False, True])
def test_outputs_at_one_position_equal_the_full_steps(eagle31):
    """``outputs_at`` (the decoder's prefill and catch-up: one output per row) writes the same
    cache as the full step and gives the full step's output at that position."""
    cfg, params, embed, batch = _setup(steps=2, eagle31=eagle31)
    b, slots = 2, T + 3
    tokens = jnp.asarray(batch.tokens[:b])
    g = fuse_taps(params, cfg, batch.taps[:b])
    positions = jnp.broadcast_to(jnp.arange(T), (b, T))
    mask = jnp.asarray(np.tril(np.ones((T, slots), bool), 0)[None].repeat(b, 0))
    cache = empty_draft_cache(cfg, b, slots)
    args = (params, cfg, embed[tokens], g, positions, mask, *cache, positions)
    h, logits, ck, cv = draft_step_cached(*args)
    at = jnp.asarray([T - 1, 5])
    h1, logits1, ck1, cv1 = draft_step_cached(*args, outputs_at=at[:, None])
    assert h1.shape == (b, 1, cfg.hidden_size) and logits1.shape == (b, 1, logits.shape[-1])
    np.testing.assert_array_equal(ck1, ck)
    np.testing.assert_array_equal(cv1, cv)
    rows = np.arange(b)
    np.testing.assert_allclose(h1[:, 0], np.asarray(h)[rows, at], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(logits1[:, 0], np.asarray(logits)[rows, at], atol=2e-5, rtol=1e-5)


def test_padding_and_documents_are_not_scored():
    cfg, params, embed, batch = _setup(steps=2)
    _, metrics = _ttt(params, cfg, embed, batch, loss_mask="reference")
    w0 = (np.asarray(batch.loss_mask)[:, :-1] & np.asarray(batch.target_in_draft)[:, 1:]
          & (np.asarray(batch.segment_ids)[:, 1:] == np.asarray(batch.segment_ids)[:, :-1])
          & (np.asarray(batch.segment_ids)[:, :-1] > 0))
    assert float(metrics["weight_per_step"][0]) == w0.sum()


@pytest.mark.parametrize("loss_mask", ["predicted", "reference"])
def test_each_step_scores_the_answer_tokens_it_predicts(loss_mask):
    """One conversation packed before a second: prompt x_0..x_3, answer x_4..x_7 (loss mask
    on), then the next document. Step i at index t predicts x_{t+2+i}: with "predicted" exactly
    the predictions of answer tokens are scored, from the answer's first token to its last;
    "reference" (m_{t+i}) skips the answer's first two tokens and scores past its end."""
    cfg, params, embed, batch = _setup(steps=3)
    answer = range(4, 8)
    seg = np.ones((B, T), np.int32)
    seg[:, 8:] = 2  # a second document starts at x_8 (it has no answer)
    mask = np.zeros((B, T), bool)
    mask[:, list(answer)] = True
    batch = batch.replace(loss_mask=jnp.asarray(mask), segment_ids=jnp.asarray(seg),
                          target_in_draft=jnp.ones((B, T), bool))
    _, metrics = _ttt(params, cfg, embed, batch, loss_mask=loss_mask)
    for i in range(cfg.ttt_steps):
        # Indices t whose step-i prediction is of x_{t+2+i} (inside document 1: t+1+i <= 7).
        if loss_mask == "predicted":
            scored = [t for t in range(T) if t + 2 + i in answer]
            assert [t + 2 + i for t in scored] == list(answer)  # every answer token
        else:
            scored = [t for t in range(T) if t + i in answer and t + 1 + i <= 7]
            # Skips the answer's first two tokens and predicts x_8, past the answer's end.
            assert [t + 2 + i for t in scored] == [6, 7, 8]
        assert float(metrics["weight_per_step"][i]) == B * len(scored), (loss_mask, i)


def test_lk_objective_matches_the_papers_equations():
    """The LK hybrid from arXiv 2602.23881 written out here: alpha = sum min(p, q),
    lambda = exp(-3 alpha), loss = lambda KL(p || q) + (1 - lambda) * 0.5 * sum |p - q|, averaged
    over the scored positions of each step; its gradient in the draft logits (lambda held
    constant) is lambda (q - p) + (1 - lambda) / 2 * (q * s - q (q . s)), s = sign(q - p)."""
    from eagle3_jax.draft.ttt import position_loss

    cfg, params, embed, batch = _setup(steps=3)
    _, metrics = _ttt(params, cfg, embed, batch, return_logits=True, objective="lk")
    _, _, logits, weights, _ = _unrolled_reference(params, cfg, embed, batch, with_weights=True)
    logp_all = np.asarray(batch.target_logp, np.float64)
    for i in range(cfg.ttt_steps):
        label_logp = np.zeros_like(logp_all)
        label_logp[:, : T - 1 - i] = logp_all[:, 1 + i:]
        p = np.exp(label_logp)
        p /= p.sum(-1, keepdims=True)
        z = np.asarray(logits[i], np.float64)
        q = np.exp(z - z.max(-1, keepdims=True))
        q /= q.sum(-1, keepdims=True)
        alpha = np.minimum(p, q).sum(-1)
        lam = np.exp(-3 * alpha)
        kl = (p * (np.log(p) - np.log(q))).sum(-1)
        tv = 0.5 * np.abs(p - q).sum(-1)
        expected = (weights[i] * (lam * kl + (1 - lam) * tv)).sum() / weights[i].sum()
        assert float(metrics["loss_per_step"][i]) == pytest.approx(expected, rel=1e-4), i

    rng = np.random.default_rng(0)
    target = jax.nn.log_softmax(jnp.asarray(rng.normal(size=(5, 12)) * 2))
    z = jnp.asarray(rng.normal(size=(5, 12)))
    grad = jax.grad(lambda z: position_loss(target, jax.nn.log_softmax(z), "lk").sum())(z)
    p, q = np.exp(np.asarray(target)), np.asarray(jax.nn.softmax(z))
    lam = np.exp(-3 * np.minimum(p, q).sum(-1, keepdims=True))
    s = np.sign(q - p)
    expected = lam * (q - p) + (1 - lam) / 2 * (q * s - q * (q * s).sum(-1, keepdims=True))
    np.testing.assert_allclose(grad, expected, atol=1e-5)
    # "kl" stays the reference's cross-entropy.
    ce = -(p * np.asarray(jax.nn.log_softmax(z))).sum(-1)
    np.testing.assert_allclose(position_loss(target, jax.nn.log_softmax(z), "kl"), ce, rtol=1e-5)


def test_training_path_loss_and_accuracy_equal_the_reference():
    """Training (no logits returned, no hit rates) takes ``head_cross_entropy``, which computes
    the head's gradient in the forward pass: its loss and top-1 accuracy are the reference's."""
    cfg, params, embed, batch = _setup(steps=3)
    loss, metrics = _ttt(params, cfg, embed, batch)
    ref_total, ref_losses, ref_logits, weights, labels = _unrolled_reference(
        params, cfg, embed, batch, with_weights=True)
    np.testing.assert_allclose(metrics["loss_per_step"], ref_losses, rtol=1e-5)
    np.testing.assert_allclose(float(loss), ref_total, rtol=1e-5)
    hits = np.asarray(ref_logits).argmax(-1) == labels
    expected = (hits * weights).sum(axis=(1, 2)) / weights.sum(axis=(1, 2))
    np.testing.assert_allclose(metrics["acc_per_step"], expected, atol=1e-6)


def test_head_cross_entropy_equals_autodiff_of_its_definition():
    """Value, top-1 hit and gradients (x, w) of the fused head loss against autodiff of
    sum weight * -sum p log softmax(x @ w), with the target restricted to part of the
    vocabulary (sum p < 1, as a draft vocabulary leaves it) and zero weights included; the hit
    against argmax, for labels that are the draft's top-1 at some positions and not at others."""
    from eagle3_jax.draft.ttt import head_cross_entropy

    keys = jax.random.split(jax.random.key(7), 4)
    x = jax.random.normal(keys[0], (3, 7, D))
    w = 0.3 * jax.random.normal(keys[1], (D, VD))
    full = jax.nn.log_softmax(2 * jax.random.normal(keys[2], (3, 7, VD + 9)))
    target = full[..., :VD]  # restricted: the rest of the mass is off the draft vocabulary
    weight = jax.random.uniform(keys[3], (3, 7)) * (jnp.arange(7) % 3 != 0)
    top1 = jnp.argmax(jnp.einsum("btd,dv->btv", x, w), -1)
    label = jnp.where(jnp.arange(7) % 2 == 0, top1, (top1 + 1) % VD)

    def definition(x, w):
        logq = jax.nn.log_softmax(jnp.einsum("btd,dv->btv", x, w), -1)
        return -jnp.sum(weight * jnp.sum(jnp.exp(target) * logq, -1))

    def fused(x, w):
        return head_cross_entropy(x, w, target, weight, label)[0]

    loss, hit = head_cross_entropy(x, w, target, weight, label)
    np.testing.assert_allclose(float(loss), float(definition(x, w)), rtol=1e-6)
    np.testing.assert_array_equal(hit, top1 == label)
    assert 0 < int(jnp.sum(hit)) < hit.size
    got, want = jax.grad(fused, (0, 1))(x, w), jax.grad(definition, (0, 1))(x, w)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)
    # Scaled by the cotangent (the step's 0.8**i weight and the micro-batch average).
    got = jax.grad(lambda x, w: 0.37 * fused(x, w), (0, 1))(x, w)
    want = jax.grad(lambda x, w: 0.37 * definition(x, w), (0, 1))(x, w)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss_mask", ["predicted", "reference"])
@pytest.mark.parametrize("eagle31", [False, True])
def test_loss_and_gradients_match_an_independent_pytorch_reference(tmp_path, loss_mask, eagle31):
    """The TTT loss and every gradient against ``tests/torch_eagle3_reference.ttt_loss``, written
    in PyTorch from the definition and reading the head as exported (vLLM's layout, which
    carries EAGLE-3.1's flags); the gradients are exported the same way, so names line up."""
    import torch
    from safetensors.torch import load_file
    from torch_eagle3_reference import Eagle3Reference, ttt_loss

    from eagle3_jax.draft.export import export_draft_head
    from eagle3_jax.draft.params import DraftHead, VocabMap

    cfg, params, embed, batch = _setup(steps=3, eagle31=eagle31)
    if eagle31:
        params = {**params, "fc_norm": params["fc_norm"] * jnp.array([[0.5], [1.0], [2.0]])}
    vocab = VocabMap.from_used_ids(np.arange(VD), V)
    fn = lambda p: ttt_forward(p, cfg, embed, batch, loss_mask=loss_mask)[0]  # noqa: E731
    # Compiled as the commands compile (float32 against float64 at the tolerances below).
    loss, grads = jax.jit(jax.value_and_grad(fn), compiler_options=AS_COMMANDS)(params)

    export_draft_head(DraftHead(params=params, vocab=vocab, cfg=cfg), tmp_path / "head",
                      format="speculators")
    export_draft_head(DraftHead(params=grads, vocab=vocab, cfg=cfg), tmp_path / "grad",
                      format="speculators")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    leaves = {k: v.to(torch.float64).requires_grad_() for k, v in
              load_file(str(tmp_path / "head" / "model.safetensors")).items()
              if v.is_floating_point()}
    ref = Eagle3Reference(leaves, config)
    t = lambda x: torch.from_numpy(np.array(x))  # noqa: E731
    ref_loss = ttt_loss(ref, t(embed), t(batch.tokens).long(), t(batch.taps),
                        t(batch.target_logp), t(batch.target_in_draft), t(batch.loss_mask),
                        t(batch.segment_ids), t(batch.positions), cfg.ttt_steps,
                        mask_offset={"predicted": 2, "reference": 0}[loss_mask])
    ref_loss.backward()
    assert float(loss) == pytest.approx(ref_loss.item(), rel=1e-5)
    want = load_file(str(tmp_path / "grad" / "model.safetensors"))
    for name, leaf in leaves.items():
        np.testing.assert_allclose(want[name].numpy(), leaf.grad.numpy(), rtol=2e-4, atol=2e-6,
                                   err_msg=name)


@pytest.mark.parametrize("outputs_at", [False, True])
def test_draft_step_on_the_attention_kernel_equals_xla(outputs_at):
    """On CPU a draft step over a few tokens runs the cached-attention kernel over the cache as
    it was and the tokens being written (``split_write_mask``), then writes the keys; the same
    step with that kernel off (keys written first, XLA's attention over the cache) is the
    reference: tree masks over a cache already holding entries, one token's slot past the cache
    (dropped: no one sees it), and with ``outputs_at`` (the catch-up's one output per row)."""
    from eagle3_jax.kernels import library, uses_attention_kernel

    if not library.kernel_available():
        pytest.skip("the CPU kernels are not built here")
    cfg = DraftConfig(hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2,
                      head_dim=16, vocab_size=V, draft_vocab_size=VD, tap_layers=(1, 2, 3),
                      ttt_steps=2)
    params = init_draft_params(cfg, jax.random.key(3), scale=0.3)
    b, t, slots = 2, 5, 24
    rng = np.random.default_rng(0)
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape).astype(np.float32))
    cache_k, cache_v = f32(b, 2, 16, slots), f32(b, 2, slots, 16)
    write_slots = np.array([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]])  # 24: past the cache
    mask = rng.random((b, t, slots)) < 0.5
    for r in range(b):
        for j in range(t):
            if write_slots[r, j] < slots:
                mask[r, j, write_slots[r, j]] = True  # each token sees itself
    at = jnp.asarray([[4], [2]]) if outputs_at else None
    args = (params, cfg, f32(b, t, 64), f32(b, t, 64), jnp.asarray(write_slots),
            jnp.asarray(mask), cache_k, cache_v, jnp.asarray(write_slots))
    assert uses_attention_kernel((b, t, 4, 16), 2, jnp.float32)
    previous = library.set_kernel_enabled(None)
    try:
        kernel = draft_step_cached(*args, outputs_at=at)
        library.set_kernel_enabled(tuple(f for f in library.FAMILIES if f != "attention"))
        xla = draft_step_cached(*args, outputs_at=at)
    finally:
        library.set_kernel_enabled(previous)
    for name, got, want in zip(("feature", "logits", "cache_k", "cache_v"), kernel, xla):
        assert got.shape == want.shape, name
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5, err_msg=name)
    np.testing.assert_array_equal(kernel[3], xla[3])  # values are written as they are
