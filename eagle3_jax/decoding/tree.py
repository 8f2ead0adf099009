"""EAGLE-2 dynamic draft tree, built on device with static shapes (reference §5).

From the root (the last token the target produced) the draft proposes ``tree_top_k`` children; at
each further level the ``tree_top_k`` frontier nodes each propose ``tree_top_k`` children scored by
cumulative log-probability, and the best ``tree_top_k`` of those ``tree_top_k**2`` become the next
frontier. Every proposed node is a candidate::

    candidates C = tree_top_k + (depth - 1) * tree_top_k**2      (level-major order)

and the best ``total_tokens - 1`` candidates by score (ties to the earlier candidate), re-sorted
by candidate index, plus the root form the verified tree. A child's score never exceeds its
parent's (log-probabilities are <= 0) and a parent precedes its children, so the selection is a
connected tree in parent-first order. ``tree_top_k = 1`` is a chain of ``depth`` tokens.

:func:`grow_tree` is that growth and selection for any proposer of log-probabilities:
:func:`build_tree` grows it with the draft head, ``eagle3_jax.decoding.ceiling`` with the
target's own distribution (the acceptance ceiling of a tree shape).

Tree arrays (B batch, N = total_tokens, root at index 0)::

    tokens    [B, N] int32  target token ids
    parents   [B, N] int32  tree index of the parent, -1 for the root
    depths    [B, N] int32  0 for the root
    ancestors [B, N, N] bool  ancestors[b, i, j]: node j is i or an ancestor of i
    paths     [B, N, depth + 1] int32  root-to-node tree indices, -1 past the node's depth

Draft-cache layout during the build: the committed context fills slots [0, end); the frontier
of level d (1-based) is written at slots ``end + (d-1)*tree_top_k + j``. A frontier node attends to
the context plus its own ancestors and itself, as training-time test trained it to.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import struct

from eagle3_jax.errors import Eagle3Error
from eagle3_jax.draft.config import DraftConfig
from eagle3_jax.draft.model import draft_step_cached
from eagle3_jax.draft.params import VocabMap
from eagle3_jax.kernels.matmul import weight_rows
from eagle3_jax.model.params import Params


class TreeError(Eagle3Error, ValueError):
    """Tree sizes that cannot form a tree; the message gives the valid range."""


@dataclasses.dataclass(frozen=True)
class TreeConfig:
    """Static tree shape: ``tree_top_k`` children per expanded node, ``depth`` draft levels, and
    ``total_tokens`` verified per round including the root."""

    tree_top_k: int = 4
    depth: int = 4
    total_tokens: int = 16

    def __post_init__(self):
        for name in ("tree_top_k", "depth", "total_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TreeError(f"tree {name} must be a positive integer, got {value!r}")
        if self.total_tokens < 2:
            raise TreeError("total_tokens must be at least 2 (the root and one draft token)")
        if self.total_tokens - 1 > self.num_candidates:
            raise TreeError(
                f"total_tokens={self.total_tokens} needs {self.total_tokens - 1} draft tokens but "
                f"tree_top_k={self.tree_top_k}, depth={self.depth} proposes only "
                f"{self.num_candidates} (tree_top_k + (depth-1)*tree_top_k^2); use total_tokens "
                f"<= {self.num_candidates + 1}"
            )

    @property
    def num_candidates(self) -> int:
        return self.tree_top_k + (self.depth - 1) * self.tree_top_k ** 2

    @property
    def draft_slots(self) -> int:
        """Draft-cache slots used past the context end during one round."""
        return max((self.depth - 1) * self.tree_top_k, self.depth + 1)

    @classmethod
    def chain(cls, depth: int) -> "TreeConfig":
        return cls(tree_top_k=1, depth=depth, total_tokens=depth + 1)


@struct.dataclass
class DraftTree:
    tokens: jax.Array
    parents: jax.Array
    depths: jax.Array
    ancestors: jax.Array
    paths: jax.Array


def tree_from_parents(tokens: jax.Array, parents: jax.Array, depth: int) -> DraftTree:
    """Complete a parent-first tree [B, N] (parents[:, 0] == -1) with depths, masks and paths."""
    b, n = parents.shape
    rows = jnp.arange(b)[:, None]
    parent_or_root = jnp.maximum(parents, 0)
    node = jnp.broadcast_to(jnp.arange(n), (b, n))
    ancestors = node[:, :, None] == jnp.arange(n)[None, None, :]
    depths = jnp.zeros((b, n), jnp.int32)
    chain = [node]
    for _ in range(depth):  # pointer jumping: one ancestor further per iteration
        is_root = node == 0
        node = parent_or_root[rows, node]
        depths = depths + (~is_root).astype(jnp.int32)
        ancestors = ancestors | (node[:, :, None] == jnp.arange(n)[None, None, :])
        chain.append(jnp.where(is_root, -1, node))
    # chain[i] = i-th ancestor (-1 past the root); path[d] = the ancestor at depth d.
    chain = jnp.stack(chain, axis=-1)  # [B, N, depth+1], chain[..., 0] = the node itself
    steps_up = depths[..., None] - jnp.arange(depth + 1)  # ancestor at depth d is steps_up up
    paths = jnp.where(steps_up >= 0,
                      jnp.take_along_axis(chain, jnp.clip(steps_up, 0, depth), axis=-1), -1)
    return DraftTree(tokens=tokens, parents=parents, depths=depths, ancestors=ancestors,
                     paths=paths.astype(jnp.int32))


def grow_tree(tree_cfg: TreeConfig, root_tokens: jax.Array, root_logp: jax.Array,
              to_target: jax.Array | None, expand: Callable, carry: Any) -> tuple[DraftTree, Any]:
    """Grow and select the tree (module docstring) for every row, whatever proposes the nodes.

    Args:
      root_tokens: [B] the token the target produced last (tree index 0).
      root_logp: [B, V'] log-probabilities of the root's children over the proposer's
        vocabulary.
      to_target: [V'] the target id of each proposer id, or None (the target's own vocabulary).
      expand: ``expand(level, tokens, parent, carry) -> (logp [B, k, V'], carry)``: the
        log-probabilities of the children of the frontier of ``level`` (1-based; its tokens
        [B, k] as target ids). ``parent`` [B, k] is each frontier node's parent in the frontier
        before (at level 1 all 0: the root).
      carry: what ``expand`` hands itself from level to level.
    Returns:
      (DraftTree with N = total_tokens nodes, the last carry).
    """
    k, depth = tree_cfg.tree_top_k, tree_cfg.depth
    b = root_tokens.shape[0]
    as_target = (lambda ids: ids) if to_target is None else (lambda ids: to_target[ids])
    num_cand = tree_cfg.num_candidates

    scores, ids = jax.lax.top_k(root_logp, k)  # [B, k]
    cand_tokens = [as_target(ids)]
    cand_scores = [scores]
    cand_parents = [jnp.full((b, k), -1, jnp.int32)]
    frontier_tokens, frontier_scores = as_target(ids), scores
    parent = jnp.zeros((b, k), jnp.int32)
    frontier_cand = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))
    offset = k
    for level in range(1, depth):
        logp, carry = expand(level, frontier_tokens, parent, carry)
        child_logp, child_ids = jax.lax.top_k(logp, k)  # [B, k, k]
        child_scores = (frontier_scores[:, :, None] + child_logp).reshape(b, k * k)
        child_tokens = as_target(child_ids).reshape(b, k * k)
        cand_tokens.append(child_tokens)
        cand_scores.append(child_scores)
        cand_parents.append(jnp.repeat(frontier_cand, k, axis=1))
        best_scores, best = jax.lax.top_k(child_scores, k)  # next frontier [B, k]
        parent = best // k
        frontier_tokens = jnp.take_along_axis(child_tokens, best, axis=1)
        frontier_scores = best_scores
        frontier_cand = offset + best
        offset += k * k

    cand_tokens = jnp.concatenate(cand_tokens, axis=1)  # [B, C]
    cand_scores = jnp.concatenate(cand_scores, axis=1)
    cand_parents = jnp.concatenate(cand_parents, axis=1)
    m = tree_cfg.total_tokens - 1
    _, chosen = jax.lax.top_k(cand_scores, m)  # ties go to the earlier (parent-first) candidate
    chosen = jnp.sort(chosen, axis=1)  # parent-first order
    rows = jnp.arange(b)[:, None]
    tree_index = jnp.full((b, num_cand), -1, jnp.int32).at[rows, chosen].set(
        jnp.arange(1, m + 1, dtype=jnp.int32))
    cand_parent = jnp.take_along_axis(cand_parents, chosen, axis=1)
    parents = jnp.where(cand_parent < 0, 0,
                        jnp.take_along_axis(tree_index, jnp.maximum(cand_parent, 0), axis=1))
    tokens = jnp.concatenate([root_tokens[:, None],
                              jnp.take_along_axis(cand_tokens, chosen, axis=1)], axis=1)
    parents = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), parents], axis=1)
    return tree_from_parents(tokens.astype(jnp.int32), parents.astype(jnp.int32), depth), carry


def build_tree(
    params: Params,
    cfg: DraftConfig,
    vocab: VocabMap,
    embed: jax.Array,
    tree_cfg: TreeConfig,
    root_tokens: jax.Array,
    root_logp: jax.Array,
    root_h: jax.Array,
    cache_k: jax.Array,
    cache_v: jax.Array,
    end: jax.Array,
) -> tuple[DraftTree, jax.Array, jax.Array]:
    """Grow the draft head's tree for every row (:func:`grow_tree`).

    Args:
      params, cfg, vocab: the draft head; embed [V, D] the target's embedding table, or its
        panels [V/16, D, 16] (``eagle3_jax.kernels.matmul.weight_rows``).
      root_tokens: [B] the token the target produced last (tree index 0).
      root_logp: [B, Vd] draft log-probabilities for the root's children.
      root_h: [B, D] the draft's output feature at the context's last index.
      cache_k [B, K, H, Sd], cache_v [B, K, Sd, H]: draft KV cache; slots [0, end) are the
        context.
      end: [B] committed draft context length (the root's draft position is end - 1).
    Returns:
      (DraftTree with N = total_tokens nodes, cache_k, cache_v): the caches hold the frontiers'
      entries at slots [end, end + (depth - 1) * tree_top_k), scratch that no later read sees
      (the next writes at ``end`` overwrite them; masks hide slots >= end from every query
      before its own entry). Handing them on lets XLA update the caches in place instead of
      copying them every round.
    """
    k = tree_cfg.tree_top_k
    b = root_tokens.shape[0]
    tree_slots = max((tree_cfg.depth - 1) * k, 1)
    rel = jnp.arange(cache_v.shape[2])[None, None, :] - end[:, None, None]  # slot - tree start
    in_tree = (rel >= 0) & (rel < tree_slots)
    at_rel = jnp.clip(rel, 0, tree_slots - 1).repeat(k, 1)

    def expand(level, tokens, parent, carry):
        """The frontier's draft step: each node sees the context and its ancestors' slots."""
        h, anc, cache_k, cache_v = carry  # the previous frontier's (the root's at level 1)
        own = (level - 1) * k + jnp.arange(k)  # this frontier's tree slots
        h = jnp.take_along_axis(h, parent[:, :, None], axis=1)
        anc = (jnp.take_along_axis(anc, parent[:, :, None], axis=1)
               | (jnp.arange(tree_slots)[None, None, :] == own[None, :, None]))
        mask = (rel < 0) | (in_tree & jnp.take_along_axis(anc, at_rel, axis=2))  # [B, k, Sd]
        positions = jnp.broadcast_to((end - 1 + level)[:, None], (b, k))
        h, logits, cache_k, cache_v = draft_step_cached(
            params, cfg, weight_rows(embed, tokens), h, positions, mask, cache_k, cache_v,
            end[:, None] + own[None, :])
        return jax.nn.log_softmax(logits, axis=-1), (h, anc, cache_k, cache_v)

    carry = (root_h[:, None, :], jnp.zeros((b, 1, tree_slots), bool), cache_k, cache_v)
    tree, (_, _, cache_k, cache_v) = grow_tree(tree_cfg, root_tokens, root_logp,
                                               vocab.draft_to_target, expand, carry)
    return tree, cache_k, cache_v
