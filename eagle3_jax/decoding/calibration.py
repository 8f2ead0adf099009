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
  reproduces the live count of accepted drafts (measured 2026-12-05);
* positions whose target token lies outside the draft vocabulary are not scored.

They act as a factor on a tree's extra tokens that shrinks with the draft level: one pooled
factor (``scale = sum(live tau - 1) / sum(modelled tau - 1)``, :func:`accept_scale`) was 0.64
for one draft token and 0.52 for the 16-node tree of depth 6 (the shipped head, 2026-12-05;
0.544 pooled), and it rated deep trees too high: on MT-bench (a 2-core AMD EPYC with AVX-512,
2026-12-06) tree 2/5/8 was modelled at tau 2.18 and measured 2.13, 2/3/8 modelled 2.02 and
measured 2.06, so the chooser preferred the deeper, dearer tree. So the chooser credits a node
at draft level l (0: the root's children) with ``scale * decay**l`` of its modelled acceptance
(:func:`fit_live_scale`: least squares over the calibration trees; decay 1 is the pooled
factor): for the shipped head scale 0.62, decay 0.86, which gives those MT-bench trees 2.14 and
2.05 and the four calibration trees' live tau within 0.02 (the pooled factor: within 0.09).

Both are measured by decoding held-out chat prompts (ShareGPT first user turns the head was not
trained on, never the evaluation sets) with a few trees; ``python -m eagle3_jax.bench
calibrate`` runs it and stores the trees' live and modelled tau in a released head's
``acceptance.json``, where :func:`fit_live_scale` reads them.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from eagle3_jax.decoding.acceptance import (Rate, expected_accept_length, level_sums,
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


# The level decays :func:`fit_live_scale` tries (1: the pooled factor, no decay).
DECAYS = np.round(np.arange(0.5, 1.0 + 1e-9, 0.005), 3)


def fit_live_scale(trees: Sequence[dict[str, Any]],
                   rates: Sequence[Rate] | None) -> tuple[float, float]:
    """(scale, decay) that best turn ``rates``' modelled tau of the calibration ``trees``
    (records ``{"tree_top_k", "depth", "total_tokens", "live_tau"}``) into their live tau:
    ``live - 1 ~ sum over levels l of scale * decay**l * level_sums(tree)[l]``, least squares
    over ``DECAYS`` (the scale in closed form for each). Needs two trees or more (one shows no
    decay: :func:`live_level_scale`)."""
    if len(trees) < 2:
        raise ValueError(f"a decay needs two calibration trees or more, got {len(trees)}")
    modelled = [level_sums(TreeConfig(tree_top_k=t["tree_top_k"], depth=t["depth"],
                                      total_tokens=t["total_tokens"]), rates) for t in trees]
    live = np.array([t["live_tau"] - 1.0 for t in trees])
    best = None
    for decay in DECAYS[::-1]:  # ties: the decay nearer 1
        x = np.array([m @ decay ** np.arange(len(m)) for m in modelled])
        if x @ x <= 0:
            continue
        scale = float(x @ live / (x @ x))
        error = float(np.sum((scale * x - live) ** 2))
        if best is None or error < best[0] - 1e-12:
            best = (error, scale, float(decay))
    if best is None:
        raise ValueError("the modelled trees accept nothing: no scale can be measured")
    return best[1], best[2]


def live_level_scale(live: dict[str, Any], rates: Sequence[Rate] | None) -> tuple[float, float]:
    """(scale, decay) the chooser uses from a head's ``"live"`` record (``acceptance.json``):
    :func:`fit_live_scale` of its trees where it has two or more, else its pooled ``"scale"``
    and decay 1. KeyError / TypeError / ValueError for a record that has neither."""
    trees = live.get("trees") or []
    if len(trees) >= 2:
        return fit_live_scale(trees, rates)
    return float(live["scale"]), 1.0


def measure_accept_scale(decode: Callable[[TreeConfig], Sequence[int]],
                         rates: Sequence[Rate] | None,
                         trees: Sequence[TreeConfig] = CALIBRATION_TREES,
                         log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Live against modelled tau for ``trees``.

    ``decode(tree) -> accept_hist``: decodes the calibration prompts greedily with ``tree``
    and returns the summed histogram of tokens emitted per round (e.g.
    :class:`eagle3_jax.decoding.decoders.EagleDecoder` over a batch of prompts).
    Returns ``{"scale" (pooled), "trees": [{tree_top_k, depth, total_tokens, live_tau,
    modelled_tau, rounds}]}``, the record :func:`live_level_scale` reads.
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
