"""A head's live acceptance against its modelled one: the scale the tree chooser applies.

The tree chooser (:mod:`eagle3_jax.decoding.autotune`) models a tree's tau from the head's
held-out per-depth hit rates (training-time test, teacher forced). Decoding sees fewer hits
than those rates say, for reasons the rates cannot show:

* the held-out answers run to 512 tokens, and a small target's long greedy answers fall into
  repetitions the draft predicts easily (SmolLM2's shipped head: top-1 at depth 1 0.64 on an
  answer's first 128 tokens, 0.89 on its next 128);
* a round starts right after the draft missed more often than at a random position (a hit
  moves the next round past the easy token), so the first drafts of a round are harder than
  the average position; a simulation of chain rounds on the teacher-forced per-position hits
  reproduces the live count of accepted drafts (stop 22);
* positions whose target token lies outside the draft vocabulary are not scored.

Together they act as one factor on a tree's extra tokens, similar for every tree shape (the
shipped head, stop 22: 0.64 for one draft token, 0.55 for 4 and 8 nodes, 0.52 for 16, 0.544
pooled; the same trees' live tau on MT-bench was within 3% of ShareGPT's). So the
chooser's tau is ``1 + scale * (E[tau] - 1)``, ``scale`` measured here by decoding held-out chat
prompts (ShareGPT first user turns the head was not trained on, never the evaluation sets) with
a few trees: ``scale = sum(live tau - 1) / sum(modelled tau - 1)``. ``python -m eagle3_jax.bench
calibrate`` runs it and stores it in a released head's ``acceptance.json``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from eagle3_jax.decoding.acceptance import (Rate, expected_accept_length,
                                            mean_accept_length)
from eagle3_jax.decoding.tree import TreeConfig

# Tree shapes (tree_top_k, depth, total_tokens) decoded to calibrate: one token, a small
# tree, the 8-node tree the chooser liked on this CPU, and a wider one.
CALIBRATION_TREES = (TreeConfig(tree_top_k=1, depth=2, total_tokens=2),
                     TreeConfig(tree_top_k=2, depth=3, total_tokens=4),
                     TreeConfig(tree_top_k=4, depth=4, total_tokens=8),
                     TreeConfig(tree_top_k=4, depth=6, total_tokens=16))


def accept_scale(trees: Sequence[dict[str, Any]]) -> float:
    """``sum(live - 1) / sum(modelled - 1)`` over records ``{"live_tau", "modelled_tau"}``."""
    live = sum(t["live_tau"] - 1.0 for t in trees)
    modelled = sum(t["modelled_tau"] - 1.0 for t in trees)
    if modelled <= 0:
        raise ValueError("the modelled trees accept nothing: no scale can be measured")
    return live / modelled


def measure_accept_scale(decode: Callable[[TreeConfig], Sequence[int]],
                         rates: Sequence[Rate] | None,
                         trees: Sequence[TreeConfig] = CALIBRATION_TREES,
                         log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Live against modelled tau for ``trees``.

    ``decode(tree) -> accept_hist``: decodes the calibration prompts greedily with ``tree``
    and returns the summed histogram of tokens emitted per round (e.g.
    :class:`eagle3_jax.decoding.decoders.EagleDecoder` over a batch of prompts).
    Returns ``{"scale", "trees": [{tree_top_k, depth, total_tokens, live_tau, modelled_tau,
    rounds}]}``.
    """
    records = []
    for tree in trees:
        hist = np.asarray(decode(tree), np.int64)
        record = {"tree_top_k": tree.tree_top_k, "depth": tree.depth,
                  "total_tokens": tree.total_tokens, "live_tau": mean_accept_length(hist),
                  "modelled_tau": expected_accept_length(tree, rates),
                  "rounds": int(hist.sum())}
        log(f"[calibrate: tree {tree.tree_top_k}/{tree.depth}/{tree.total_tokens}: live tau "
            f"{record['live_tau']:.3f} over {record['rounds']} rounds, modelled "
            f"{record['modelled_tau']:.3f}]")
        records.append(record)
    return {"scale": accept_scale(records), "trees": records}
