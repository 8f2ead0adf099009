"""The acceptance ceiling of a tree: the target drafts for itself.

A round's acceptance (``verify.accept``) takes a proposed child x with the target's probability
p(x) and, on a rejection, removes x from p before the next sibling: a node at the end of path
x_1 .. x_d is reached with probability p(x_1) p(x_2 | x_1) ... p(x_d | x_<d), whoever proposed
it. So the best a draft can do with a tree shape is to propose what the target itself would
rank first: the EAGLE-2 tree (:func:`eagle3_jax.decoding.tree.grow_tree`) grown with the
target's own sampling distribution at every node, a draft with q = p. Its acceptance length is
the ceiling a head can reach for that tree, target and temperature (at temperature 0 it is
``depth + 1``: the target's argmax chain), which says whether a missed tau target is the head's
or the target's entropy.

:class:`TargetProposer` is a round's ``proposer`` (``eagle.EagleDecoding.proposer``). It runs
the target ``depth`` times a round (the root, then each frontier, each a tree forward over the
tree grown so far), so it measures acceptance, not speed. The head's caches still follow the
committed tokens (the round's catch-up) but nothing reads them.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from eagle3_jax.decoding.sampling import SamplingParams, probs
from eagle3_jax.decoding.tree import TreeConfig, grow_tree, tree_from_parents
from eagle3_jax.decoding.verify import verify_forward
from eagle3_jax.model.config import TargetConfig


@dataclasses.dataclass(frozen=True)
class TargetProposer:
    """``proposer(target_params, head, state, cfg, tree_cfg) -> (DraftTree, draft_k,
    draft_v)`` whose tree is grown with the target's ``sampling`` distribution (frozen and
    hashable: part of a static decoding spec)."""

    sampling: SamplingParams

    def __call__(self, target_params, head, state, cfg: TargetConfig, tree_cfg: TreeConfig):
        k = tree_cfg.tree_top_k
        b = state.root.shape[0]

        def log_p(tokens, parents, depth):
            """log p [B, N, V] at every node of the parent-first tree grown so far."""
            tree = tree_from_parents(tokens, parents, depth)
            logits, _, _ = verify_forward(target_params, cfg, tree, state.cache, ())
            return jnp.log(probs(logits, self.sampling))

        def expand(level, frontier, parent, grown):
            """The frontier of ``level`` joins the tree; the target's log p at its nodes."""
            tokens, parents = grown
            first_of_previous = 0 if level == 1 else 1 + (level - 2) * k  # its tree index
            tokens = jnp.concatenate([tokens, frontier], axis=1)
            parents = jnp.concatenate([parents, first_of_previous + parent], axis=1)
            return log_p(tokens, parents, level)[:, -k:], (tokens, parents)

        root = (state.root[:, None], jnp.full((b, 1), -1, jnp.int32))
        root_logp = log_p(*root, 1)[:, 0]  # [B, V]
        tree, _ = grow_tree(tree_cfg, state.root, root_logp, None, expand, root)
        return tree, state.draft_k, state.draft_v

