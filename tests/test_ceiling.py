"""The acceptance ceiling (the target drafting for itself): its tree is the one a draft with
q = p grows (each node among the top-k of the target's distribution at its parent, read from a
fresh forward of the whole path), and at temperature 0 every round accepts the whole depth."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.decoding import GREEDY, SamplingParams, generate, probs
from eagle3_jax.decoding import driver
from eagle3_jax.decoding import eagle as eagle_mod
from eagle3_jax.decoding.ceiling import TargetProposer
from eagle3_jax.model.target import forward
from test_eagle import TREES, _prompts, models  # noqa: F401  (models: the fixture)


@pytest.mark.parametrize("tree", ["wide", "deep"])
def test_greedy_ceiling_accepts_the_whole_depth_every_round(models, tree):
    cfg, params, head = models
    tree_cfg = TREES[tree]
    tokens, lengths = _prompts([9, 4], cfg.vocab_size)
    new = 1 + 5 * (tree_cfg.depth + 1)  # the prefill's token, then five whole rounds
    out = eagle_mod.generate_eagle(params, cfg, head, tokens, lengths, max_new_tokens=new,
                                   tree=tree_cfg, proposer=TargetProposer(GREEDY))
    np.testing.assert_array_equal(out.tokens, generate(params, cfg, tokens, lengths,
                                                       max_new_tokens=new).tokens)
    hist = np.asarray(out.accept_hist)
    assert (hist[:, tree_cfg.depth + 1] == 5).all() and (hist.sum(1) == 5).all(), hist


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=1.0),
                                      SamplingParams(temperature=0.7, top_k=20)],
                         ids=["t1", "t0.7-k20"])
def test_each_node_is_among_the_targets_top_k_at_its_parent(models, sampling):
    """Every node's token is among the ``tree_top_k`` most likely under the target's sampling
    distribution after the prompt, the root and the node's path (a fresh causal forward), and
    the root's best child is the tree's first node."""
    cfg, params, head = models
    tree_cfg = TREES["deep"]
    k = tree_cfg.tree_top_k
    tokens, lengths = _prompts([9, 4], cfg.vocab_size)
    spec, tokens, lengths = eagle_mod.eagle_decoding(
        cfg, head.serving(), tokens, lengths, max_new_tokens=20, tree=tree_cfg,
        sampling=sampling)
    state = driver.start(spec, (params, head.serving()), tokens, lengths, jax.random.key(0))
    tree, _, _ = jax.jit(TargetProposer(sampling), static_argnums=(3, 4))(
        params, head.serving(), state, cfg, tree_cfg)
    # The reference: one jitted causal forward of each path, padded at the end to one width
    # (a causal mask keeps the padding out of the logits at the path's last position).
    width = int(lengths.max()) + tree_cfg.depth + 1
    fresh_forward = jax.jit(lambda seq: forward(params, cfg, seq[None], jnp.arange(width)[None],
                                                jnp.tril(jnp.ones((width, width), bool))[None]
                                                ).logits[0])
    checked = 0
    for row in range(2):
        prompt = np.asarray(tokens[row, :int(lengths[row])])
        nodes = np.asarray(tree.tokens[row])
        for node in range(1, tree_cfg.total_tokens):
            path = [int(i) for i in np.asarray(tree.paths[row, node]) if i >= 0]
            seq = np.concatenate([prompt, nodes[path[:-1]]])  # up to the parent (the root first)
            n = len(seq)
            logits = fresh_forward(jnp.asarray(np.pad(seq, (0, width - n)), jnp.int32))[n - 1]
            p = np.asarray(probs(logits[None], sampling)[0])
            top = np.argsort(-p, kind="stable")[:k]
            assert nodes[node] in top, (row, node, nodes[node], top)
            if node == 1:
                assert nodes[node] == top[0]
            checked += 1
    assert checked == 2 * (tree_cfg.total_tokens - 1)
