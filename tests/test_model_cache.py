"""KV-cache forward equals the plain causal forward: decode steps, chunked prefill, tree masks.

All comparisons run the same JAX code with and without a cache, so they differ only in the
order of float32 reductions over (differently placed, differently masked) cache slots: ~1e-6 on
logits of std ~1. atol 1e-5 is a fixed bound ten times above that.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.model.config import TargetConfig
from eagle3_jax.model.params import init_params, to_serving
from eagle3_jax.model.target import KVCache, causal_mask, forward, forward_stacked

ATOL = 1e-5
MAX_LEN = 32

jit_forward = jax.jit(forward, static_argnums=1)
jit_stacked = jax.jit(forward_stacked, static_argnums=1)

# GQA with q/k/v bias and q/k norm so every attention input path goes through the cache.
CFG = TargetConfig(arch="qwen3", vocab_size=101, hidden_size=32, intermediate_size=48,
                   num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                   attention_bias=True, qk_norm=True)
# Scale 0.2 ~ 1/sqrt(D): logits of std ~1, so ATOL is meaningful in absolute terms.
PARAMS = init_params(CFG, jax.random.key(0), scale=0.2)
# Cached runs use the serving layout (what decoding loads); the no-cache reference scans the
# stacked layout, so every comparison below also checks one layout against the other.
SERVING = to_serving(PARAMS, CFG)


def _full_logits(tokens: np.ndarray) -> np.ndarray:
    """No-cache causal forward of right-padded rows [B, T] -> logits [B, T, V]."""
    b, t = tokens.shape
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    out = jit_stacked(PARAMS, CFG, jnp.asarray(tokens), positions, mask)
    assert 0.3 < float(out.logits.std()) < 3, "params not at the intended O(1) scale"
    return np.asarray(out.logits)


def _prefill(tokens: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, KVCache]:
    """Prefill right-padded prompts [B, T]; returns logits and a cache with end = lengths."""
    b, t = tokens.shape
    cache = KVCache.zeros(CFG, b, MAX_LEN)
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    out = jit_forward(SERVING, CFG, jnp.asarray(tokens), positions,
                      causal_mask(cache.end, t, MAX_LEN), cache)
    # Padding wrote junk at slots [length, T); end = length hides it and the next write
    # overwrites it.
    return np.asarray(out.logits), out.cache.replace(end=jnp.asarray(lengths, jnp.int32))


def test_prefill_that_skips_the_empty_cache_changes_nothing():
    """``cache_is_empty=True`` (the decoders' prefill) leaves out the fully masked cache block:
    the logits and the written cache equal a prefill that reads it."""
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, CFG.vocab_size, (2, 9)))
    cache = KVCache.zeros(CFG, 2, MAX_LEN)
    args = (SERVING, CFG, tokens, jnp.broadcast_to(jnp.arange(9), (2, 9)),
            causal_mask(cache.end, 9, MAX_LEN), cache)
    read = jit_forward(*args)
    skipped = jax.jit(forward, static_argnums=1, static_argnames="cache_is_empty")(
        *args, cache_is_empty=True)
    np.testing.assert_allclose(np.asarray(skipped.logits), np.asarray(read.logits), atol=ATOL,
                               rtol=0)
    for got, want in zip(skipped.cache.k + skipped.cache.v, read.cache.k + read.cache.v):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=ATOL, rtol=0)


def test_prefill_then_decode_steps_equal_full_forward_with_ragged_rows():
    rng = np.random.default_rng(0)
    lengths = np.array([5, 9, 2])
    steps = 6
    full = rng.integers(0, CFG.vocab_size, (3, lengths.max() + steps))
    continuation = np.stack([full[b, n:n + steps] for b, n in enumerate(lengths)])
    for b, n in enumerate(lengths):  # everything after a row's real tokens is padding
        full[b, n + steps:] = 0
    expected = _full_logits(full)

    prompts = np.where(np.arange(lengths.max()) < lengths[:, None], full[:, :lengths.max()], 0)
    logits, cache = _prefill(prompts, lengths)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(logits[b, :n], expected[b, :n], atol=ATOL, rtol=0)

    for i in range(steps):
        token = jnp.asarray(continuation[:, i:i + 1])
        positions = cache.end[:, None]
        out = jit_forward(SERVING, CFG, token, positions, causal_mask(cache.end, 1, MAX_LEN),
                          cache)
        np.testing.assert_array_equal(out.cache.end, cache.end)  # forward never moves end
        for b, n in enumerate(lengths):
            np.testing.assert_allclose(np.asarray(out.logits[b, 0]), expected[b, n + i],
                                       atol=ATOL, rtol=0, err_msg=f"row {b} step {i}")
        cache = out.cache.replace(end=out.cache.end + 1)


def test_chunked_prefill_equals_full_forward():
    rng = np.random.default_rng(1)
    chunk, total = 4, 16
    tokens = rng.integers(0, CFG.vocab_size, (2, total))
    expected = _full_logits(tokens)

    cache = KVCache.zeros(CFG, 2, MAX_LEN)
    for start in range(0, total, chunk):
        positions = cache.end[:, None] + jnp.arange(chunk)
        out = jit_forward(SERVING, CFG, jnp.asarray(tokens[:, start:start + chunk]), positions,
                          causal_mask(cache.end, chunk, MAX_LEN), cache)
        np.testing.assert_allclose(np.asarray(out.logits), expected[:, start:start + chunk],
                                   atol=ATOL, rtol=0, err_msg=f"chunk at {start}")
        cache = out.cache.replace(end=out.cache.end + chunk)

    # The cache holds the same keys/values as a single full prefill.
    _, one_shot = _prefill(tokens, np.array([total, total]))
    for got, want in ((cache.k, one_shot.k), (cache.v, one_shot.v)):  # k [B,K,H,S], v [B,K,S,H]
        slot_axis = 3 if got is cache.k else 2
        np.testing.assert_allclose(np.stack(got).take(np.arange(total), axis=1 + slot_axis),
                                   np.stack(want).take(np.arange(total), axis=1 + slot_axis),
                                   atol=ATOL, rtol=0)


# Token tree, node i has parent TREE_PARENTS[i]:   0 ── 1 ── 3 ── 5
#                                                    │    └── 4
#                                                    └── 2
TREE_PARENTS = (-1, 0, 0, 1, 1, 3)


def _tree_paths(parents) -> list[list[int]]:
    """Root-to-node path of every node."""
    paths = []
    for node in range(len(parents)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
    return paths


def test_tree_mask_node_logits_equal_their_branch_run_alone():
    rng = np.random.default_rng(2)
    context_lengths = np.array([6, 3])
    n = len(TREE_PARENTS)
    paths = _tree_paths(TREE_PARENTS)
    depth = np.array([len(p) - 1 for p in paths])
    ancestor_or_self = np.zeros((n, n), bool)  # [node, node]
    for node, path in enumerate(paths):
        ancestor_or_self[node, path] = True

    context = rng.integers(0, CFG.vocab_size, (2, context_lengths.max()))
    _, cache = _prefill(context, context_lengths)
    tree_tokens = rng.integers(0, CFG.vocab_size, (2, n))

    # Tree node j sits at slot C + j, RoPE position C + depth(j); it sees the context and
    # its ancestors-or-self only.
    mask = np.zeros((2, n, MAX_LEN), bool)
    for b, c in enumerate(context_lengths):
        mask[b, :, :c] = True
        mask[b, :, c:c + n] = ancestor_or_self
    tree = jit_forward(SERVING, CFG, jnp.asarray(tree_tokens),
                       jnp.asarray(context_lengths[:, None] + depth[None, :]), jnp.asarray(mask),
                       cache)

    for node, path in enumerate(paths):
        branch = tree_tokens[:, path]  # [B, len(path)]
        positions = cache.end[:, None] + jnp.arange(len(path))
        alone = jit_forward(SERVING, CFG, jnp.asarray(branch), positions,
                            causal_mask(cache.end, len(path), MAX_LEN), cache)
        np.testing.assert_allclose(np.asarray(tree.logits[:, node]),
                                   np.asarray(alone.logits[:, -1]), atol=ATOL, rtol=0,
                                   err_msg=f"tree node {node} (path {path})")


def test_logit_positions_select_the_same_logits():
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, CFG.vocab_size, (2, 8))
    expected = _full_logits(tokens)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((8, 8), bool)), (2, 8, 8))
    picks = jnp.array([[7, 0], [3, 3]])
    out = jit_stacked(PARAMS, CFG, jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(8), (2, 8)),
                      mask, logit_positions=picks)
    np.testing.assert_allclose(np.asarray(out.logits),
                               np.take_along_axis(expected, np.asarray(picks)[..., None], axis=1),
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("overflow", [0, 3])
def test_writes_past_the_cache_end_are_dropped(overflow):
    """A write at slots >= max_len must not wrap around onto committed slots."""
    tokens = np.random.default_rng(4).integers(0, CFG.vocab_size, (1, 4))
    cache = KVCache.zeros(CFG, 1, 8).replace(end=jnp.array([4 + overflow], jnp.int32))
    positions = cache.end[:, None] + jnp.arange(4)
    out = jit_forward(SERVING, CFG, jnp.asarray(tokens), positions, causal_mask(cache.end, 4, 8),
                      cache)
    k = np.stack(out.cache.k).transpose(0, 1, 4, 2, 3)  # [L, B, K, H, S] -> [L, B, S, K, H]
    assert not np.any(k[:, :, :4 + overflow]), "a write wrapped onto slots before end"
    assert np.all(np.any(k[:, :, 4 + overflow:] != 0, axis=(-1, -2))), "in-range slots not written"
