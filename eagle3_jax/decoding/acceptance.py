"""Acceptance length (tau): tokens emitted per verification round, measured and modelled.

One definition everywhere: tau = new tokens / verification rounds, where a round emits its
accepted draft tokens plus the target's bonus token, and the prefill's first token is not a
round. Tokens after an end-of-sequence token or past ``max_new_tokens`` are not emitted, so they
are not counted either (:func:`eagle3_jax.decoding.eagle` records each round's emitted count in
``accept_hist``).

* :func:`mean_accept_length`: measured, from a histogram of emitted tokens per round.
* :func:`chain_accept_length`: modelled for a chain of drafts with per-step accuracies (the
  training eval's simulated tau).
* :func:`expected_accept_length`: modelled for a dynamic tree (the tree chooser's, see
  :mod:`eagle3_jax.decoding.autotune`); a chain (``tree_top_k=1``) gives
  :func:`chain_accept_length`.

Per-depth rates (d = 0 for the root's children), one entry per depth, either

* a number ``a_d``: the chance that the draft's top-1 token at depth d equals the target's,
  given its path was accepted; the rank-r sibling (0-based) is then modelled to catch the
  target's token with ``a_d (1 - a_d)^r`` (an assumption, optimistic for weak heads), or
* a list of measured top-r hit rates ``[h_d(1), h_d(2), ..., h_d(R)]`` (the training eval's
  ``hits_per_step``): the rank-r sibling catches it with ``h_d(r + 1) - h_d(r)``, exactly what
  was measured, and ranks past R with 0.

A node is accepted with the product of its path's factors, so ``E[tau] = 1 + sum over non-root
nodes of that product``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from eagle3_jax.decoding.tree import TreeConfig
from eagle3_jax.errors import Eagle3Error

DEFAULT_FIRST_RATE, DEFAULT_DECAY = 0.6, 0.9


class AcceptRatesError(Eagle3Error, ValueError):
    """Acceptance rates outside [0, 1]; the message shows them."""


def mean_accept_length(accept_hist) -> float:
    """Measured tau: ``accept_hist[j]`` counts rounds that emitted j tokens (summed over rows
    and prompts); returns sum_j j * hist[j] / sum_j hist[j] (0 rounds -> 0)."""
    hist = np.asarray(accept_hist, np.float64)
    return float((hist * np.arange(len(hist))).sum() / max(hist.sum(), 1.0))


def chain_accept_length(rates: Sequence[float]) -> float:
    """Modelled tau of a chain of len(rates) drafts: 1 + sum_k prod_{i<=k} rates_i."""
    return 1.0 + float(np.sum(np.cumprod(np.asarray(rates, np.float64)))) if len(rates) else 1.0


def default_accept_rates(depth: int) -> list[float]:
    """The documented fallback profile a_d = 0.6 * 0.9**d, d = 0 .. depth-1."""
    return [DEFAULT_FIRST_RATE * DEFAULT_DECAY ** d for d in range(depth)]


# A depth's rate: a top-1 rate, or measured cumulative top-r hit rates (module docstring).
Rate = float | Sequence[float]


def _check_rate(rate: Rate) -> float | list[float]:
    if np.ndim(rate) == 0:
        values = [float(rate)]
    else:
        values = [float(r) for r in rate]
    if not values or any(not 0.0 <= r <= 1.0 for r in values):
        raise AcceptRatesError(f"acceptance rates must lie in [0, 1], got {rate}")
    if any(b < a - 1e-9 for a, b in zip(values, values[1:])):
        raise AcceptRatesError(f"top-r hit rates must not decrease with r, got {rate}")
    return values[0] if np.ndim(rate) == 0 else values


def rates_for_depth(rates: Sequence[Rate] | None, depth: int) -> list[float | list[float]]:
    """``rates`` cut or extended (the last depth's rates x 0.9 per extra level) to ``depth``
    entries; None or empty gives the default profile."""
    if rates is None or len(rates) == 0:
        return default_accept_rates(depth)
    rates = [_check_rate(r) for r in rates]
    while len(rates) < depth:
        last = rates[-1]
        rates.append(last * DEFAULT_DECAY if isinstance(last, float)
                     else [r * DEFAULT_DECAY for r in last])
    return rates[:depth]


def rank_probabilities(rate: Rate, tree_top_k: int) -> np.ndarray:
    """[tree_top_k]: the chance that the draft's rank-r token (r = 0..k-1) is the target's,
    given the parent was accepted (module docstring)."""
    rate = _check_rate(rate)
    if isinstance(rate, float):
        return np.array([rate * (1 - rate) ** r for r in range(tree_top_k)])
    probs = np.diff(np.concatenate([[0.0], rate]))
    return np.pad(probs, (0, max(0, tree_top_k - len(probs))))[:tree_top_k]


def candidates(tree_top_k: int, depth: int,
               rates: Sequence[Rate] | None) -> tuple[np.ndarray, np.ndarray]:
    """(probabilities, levels): the modelled acceptance probability of every candidate node and
    its draft level (0: the root's children), by probability descending (ties: the shallower).

    Which nodes the tree holds follows the real build (``decoding/tree.py``) with the model's
    probabilities standing in for the draft's scores: level 1 is the root's k children, each
    further level the k children of the best k nodes of the level above.
    """
    a = rates_for_depth(rates, depth)
    rank = lambda d: rank_probabilities(a[d], tree_top_k)  # noqa: E731
    level = rank(0)
    probs, levels = [level], [np.zeros(len(level), np.int64)]
    for d in range(1, depth):
        frontier = np.sort(level)[::-1][:tree_top_k]
        level = (frontier[:, None] * rank(d)[None, :]).reshape(-1)
        probs.append(level)
        levels.append(np.full(len(level), d, np.int64))
    probs, levels = np.concatenate(probs), np.concatenate(levels)
    order = np.argsort(-probs, kind="stable")
    return probs[order], levels[order]


def level_sums(tree: TreeConfig, rates: Sequence[Rate] | None = None) -> np.ndarray:
    """[depth]: the modelled accepted drafts of ``tree`` by draft level (its best
    ``total_tokens - 1`` candidates' probabilities summed per level); they sum to E[tau] - 1."""
    probs, levels = candidates(tree.tree_top_k, tree.depth, rates)
    n = tree.total_tokens - 1
    return np.bincount(levels[:n], weights=probs[:n], minlength=tree.depth)


def expected_accept_length(tree: TreeConfig, rates: Sequence[Rate] | None = None) -> float:
    """Modelled E[tau] (tokens per round, bonus included) of ``tree``: 1 + the best
    ``total_tokens - 1`` candidates' acceptance probabilities."""
    return 1.0 + float(np.sum(level_sums(tree, rates)))
