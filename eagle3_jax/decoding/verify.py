"""Tree verification: one target forward over the tree, the acceptance walk, the path's KV write.

Acceptance (reference §5) walks down from the root. At each level the node's children are
tried in tree order; child x is accepted with probability p(x), where p is the target's
sampling distribution at the node (temperature / top-k / top-p applied exactly as plain
sampling applies them). On rejection p(x) is set to 0 and p renormalised before the next
sibling. When no child is accepted (or the deepest node is reached) one more token is sampled
from the current p: the target's bonus token. This is recursive rejection sampling with one-hot
draft proposals, which leaves the target's distribution unchanged. Greedy decoding is the same
walk with p one-hot at the target's argmax: the longest path agreeing with the target's argmax,
plus the argmax after it. ``accept`` runs it as exactly that, on the [B, N] argmax tokens, with no
[B, N, V] distribution and no bonus draw (about 3 ms of a SmolLM2 round on a 2-core CPU).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from eagle3_jax.decoding.sampling import SamplingParams, greedy_argmax, probs
from eagle3_jax.decoding.tree import DraftTree
from eagle3_jax.model.config import TargetConfig
from eagle3_jax.model.layers import write_kv
from eagle3_jax.model.params import Params
from eagle3_jax.model.target import KVCache, forward


def tree_attention_mask(tree: DraftTree, end: jax.Array, max_len: int) -> jax.Array:
    """[B, N, S]: each tree node sees slots [0, end) and its ancestors at end + tree index."""
    n = tree.tokens.shape[1]
    rel = jnp.arange(max_len)[None, None, :] - end[:, None, None]  # [B, 1, S]
    in_tree = (rel >= 0) & (rel < n)
    anc = jnp.take_along_axis(tree.ancestors, jnp.clip(rel, 0, n - 1).repeat(n, 1), axis=2)
    return (rel < 0) | (in_tree & anc)


def verify_forward(params: Params, cfg: TargetConfig, tree: DraftTree, cache: KVCache,
                   tap_layers):
    """Target forward over all N tree tokens at positions end + depth, each seeing the cache and
    its ancestors. The cache is not written: :func:`commit_path` writes the accepted path's
    entries only (the tree's whole block, written and then compacted, cost two more scatters a
    layer).

    Returns (logits [B, N, V], new_kv: per layer keys and values [B, N, K, H], taps [B, N, 3D]).
    """
    positions = cache.end[:, None] + tree.depths
    mask = tree_attention_mask(tree, cache.end, cache.max_len)
    out = forward(params, cfg, tree.tokens, positions, mask, cache, tap_layers=tap_layers,
                  write_cache=False)
    return out.logits, out.new_kv, out.taps


@struct.dataclass
class Acceptance:
    path: jax.Array  # [B, depth + 1] tree indices root-first, -1 past the accepted length
    num_accepted: jax.Array  # [B] accepted draft tokens a (path has a + 1 valid entries)
    bonus: jax.Array  # [B] the target's own next token after the path


def accept(key: jax.Array, tree: DraftTree, logits: jax.Array, sampling: SamplingParams,
           tree_top_k: int) -> Acceptance:
    """Walk the tree (see module docstring). logits [B, N, V] from :func:`verify_forward`."""
    if sampling.greedy:
        return _accept_greedy(tree, greedy_argmax(logits))
    b, n = tree.tokens.shape
    depth = tree.paths.shape[-1] - 1
    rows = jnp.arange(b)
    target_p = probs(logits, sampling)  # [B, N, V]
    node = jnp.zeros((b,), jnp.int32)
    p = target_p[:, 0]
    alive = jnp.ones((b,), bool)
    path = [node]
    num_accepted = jnp.zeros((b,), jnp.int32)
    keys = jax.random.split(key, depth * tree_top_k + 1)
    for level in range(depth):
        is_child = tree.parents == node[:, None]  # [B, N]
        # Children in tree order (at most tree_top_k of them: one node proposes tree_top_k).
        order = jnp.argsort(~is_child, axis=1, stable=True)[:, :tree_top_k]
        valid = jnp.take_along_axis(is_child, order, axis=1)
        chosen = jnp.full((b,), -1, jnp.int32)
        for j in range(tree_top_k):
            child = order[:, j]
            token = tree.tokens[rows, child]
            trying = valid[:, j] & alive & (chosen < 0)
            p_token = p[rows, token]
            u = jax.random.uniform(keys[level * tree_top_k + j], (b,))
            ok = trying & (u < p_token)
            chosen = jnp.where(ok, child, chosen)
            rejected = trying & ~ok
            zeroed = p.at[rows, token].set(0.0)
            zeroed = zeroed / jnp.maximum(jnp.sum(zeroed, axis=-1, keepdims=True), 1e-30)
            p = jnp.where(rejected[:, None], zeroed, p)
        moved = alive & (chosen >= 0)
        node = jnp.where(moved, chosen, node)
        p = jnp.where(moved[:, None], target_p[rows, node], p)
        path.append(jnp.where(moved, chosen, -1))
        num_accepted = num_accepted + moved.astype(jnp.int32)
        alive = moved
    bonus = jax.random.categorical(keys[-1], jnp.log(p), axis=-1).astype(jnp.int32)
    return Acceptance(path=jnp.stack(path, axis=1).astype(jnp.int32), num_accepted=num_accepted,
                      bonus=bonus)


def _accept_greedy(tree: DraftTree, best: jax.Array) -> Acceptance:
    """The greedy walk on the target's argmax ``best`` [B, N] at every node: from the root, move
    to the first child (tree order) whose token is the argmax of its parent, while one is."""
    b, _ = tree.tokens.shape
    depth = tree.paths.shape[-1] - 1
    rows = jnp.arange(b)
    node = jnp.zeros((b,), jnp.int32)
    alive = jnp.ones((b,), bool)
    path = [node]
    num_accepted = jnp.zeros((b,), jnp.int32)
    for _ in range(depth):
        hit = (tree.parents == node[:, None]) & (tree.tokens == best[rows, node][:, None])
        moved = alive & jnp.any(hit, axis=1)
        node = jnp.where(moved, jnp.argmax(hit, axis=1).astype(jnp.int32), node)
        path.append(jnp.where(moved, node, -1))
        num_accepted = num_accepted + moved.astype(jnp.int32)
        alive = moved
    return Acceptance(path=jnp.stack(path, axis=1).astype(jnp.int32), num_accepted=num_accepted,
                      bonus=best[rows, node])


def commit_path(cache: KVCache, new_kv, path: jax.Array, active: jax.Array) -> KVCache:
    """Write the accepted path's KV entries at contiguous slots and advance ``end``.

    new_kv: (keys, values), per layer [B, N, K, H] at tree index (:func:`verify_forward`);
    path [B, P] lists the accepted tree indices root-first (-1 past the end). Entry path[j] is
    written at slot end + j. Rows not ``active`` keep their cache end.
    """
    b, width = path.shape
    rows = jnp.arange(b)[:, None]
    valid = path >= 0
    src = jnp.maximum(path, 0)
    dst = jnp.where(valid, cache.end[:, None] + jnp.arange(width)[None, :], cache.max_len)
    moved = [write_kv(k, v, rows, dst, nk[rows, src], nv[rows, src])
             for k, v, nk, nv in zip(cache.k, cache.v, *new_kv)]
    k, v = (tuple(layers) for layers in zip(*moved))
    new_end = cache.end + jnp.where(active, jnp.sum(valid, axis=1), 0).astype(jnp.int32)
    return dataclasses.replace(cache, k=k, v=v, end=new_end)
