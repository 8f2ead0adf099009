"""The live calibration of a head's modelled acceptance (``eagle3_jax.decoding.calibration``):
the scale against tokens and rounds counted from the decoder's own output, and the held-out
prompts it decodes."""

from __future__ import annotations

import numpy as np
import pytest

from eagle3_jax.decoding.acceptance import expected_accept_length, level_sums
from eagle3_jax.decoding.calibration import (CALIBRATION_TREES, DECAYS, accept_scale,
                                             fit_live_scale, live_level_scale,
                                             measure_accept_scale)
from eagle3_jax.decoding.eagle import generate_eagle
from eagle3_jax.decoding.tree import TreeConfig
from test_eagle import _prompts, make_models


def test_the_scale_is_live_extra_tokens_over_modelled_ones():
    trees = [{"live_tau": 1.5, "modelled_tau": 2.0}, {"live_tau": 2.0, "modelled_tau": 3.0}]
    assert accept_scale(trees) == pytest.approx((0.5 + 1.0) / (1.0 + 2.0))
    with pytest.raises(ValueError, match="accept nothing"):
        accept_scale([{"live_tau": 1.0, "modelled_tau": 1.0}])


def test_level_sums_split_the_modelled_tau_by_draft_level():
    """Worked by hand: top-1 rates 0.5 then 0.4, siblings a (1 - a)^r. Level 0: 0.5, 0.25;
    level 1: 0.5 x (0.4, 0.24) and 0.25 x (0.4, 0.24). The best three: 0.5, 0.25 | 0.2."""
    tree = TreeConfig(tree_top_k=2, depth=2, total_tokens=4)
    assert level_sums(tree, [0.5, 0.4]) == pytest.approx([0.75, 0.2])
    assert 1 + level_sums(tree, [0.5, 0.4]).sum() == pytest.approx(
        expected_accept_length(tree, [0.5, 0.4]))
    chain = TreeConfig(tree_top_k=1, depth=3, total_tokens=4)
    assert level_sums(chain, [0.5, 0.4, 0.3]) == pytest.approx([0.5, 0.2, 0.06])


def _records(trees, rates, scale, decay):
    return [{"tree_top_k": t.tree_top_k, "depth": t.depth, "total_tokens": t.total_tokens,
             "live_tau": 1 + scale * float(level_sums(t, rates) @ decay ** np.arange(t.depth))}
            for t in trees]


def test_the_per_level_fit_recovers_a_known_scale_and_decay():
    """Live taus made with scale 0.6 and decay 0.8 per level (or no decay) are fitted back
    exactly; a decay of 1 is the pooled scale; one tree cannot show a decay, so a record with
    one keeps its pooled scale."""
    rates = [[0.7, 0.8, 0.85], [0.65, 0.75, 0.8], [0.6, 0.7, 0.78], [0.6, 0.7, 0.75]]
    for scale, decay in ((0.6, 0.8), (0.5, 1.0), (0.7, 0.65)):
        assert decay in DECAYS
        records = _records(CALIBRATION_TREES, rates, scale, decay)
        fitted = fit_live_scale(records, rates)
        assert fitted == pytest.approx((scale, decay))
    pooled = _records(CALIBRATION_TREES, rates, 0.5, 1.0)
    for r in pooled:
        r["modelled_tau"] = expected_accept_length(
            TreeConfig(tree_top_k=r["tree_top_k"], depth=r["depth"],
                       total_tokens=r["total_tokens"]), rates)
    assert fit_live_scale(pooled, rates)[0] == pytest.approx(accept_scale(pooled))
    one = _records(CALIBRATION_TREES[2:3], rates, 0.6, 0.8)
    with pytest.raises(ValueError, match="two calibration trees"):
        fit_live_scale(one, rates)
    assert live_level_scale({"scale": 0.57, "trees": one}, rates) == (0.57, 1.0)
    assert live_level_scale({"scale": 0.57, "trees": records}, rates) == pytest.approx(
        fit_live_scale(records, rates))


def test_live_tau_is_new_tokens_over_rounds_of_the_decoded_prompts():
    """Each tree's live tau equals the tokens the decoder emitted after its prefill token over
    its rounds (counted from the output, not the histogram); its modelled tau is the chooser's
    for the given rates; the scale pools them."""
    cfg, params, head = make_models()
    tokens, lengths = _prompts([11, 6, 3], cfg.vocab_size)
    counted = {}

    def decode(tree):
        out = generate_eagle(params, cfg, head, tokens, lengths, max_new_tokens=24, tree=tree)
        counted[tree] = (int(np.sum(np.asarray(out.num_generated) - 1)),
                         int(np.sum(out.rounds)))
        return np.asarray(out.accept_hist).sum(axis=0)

    rates = [0.5, 0.4, 0.3]
    trees = (TreeConfig(tree_top_k=1, depth=2, total_tokens=2),
             TreeConfig(tree_top_k=2, depth=3, total_tokens=5))
    result = measure_accept_scale(decode, rates, trees)
    extra_live = extra_modelled = 0.0
    for tree, record in zip(trees, result["trees"]):
        new, rounds = counted[tree]
        assert record["rounds"] == rounds > 0
        assert record["live_tau"] == pytest.approx(new / rounds)
        assert record["modelled_tau"] == pytest.approx(expected_accept_length(tree, rates))
        extra_live += new / rounds - 1
        extra_modelled += expected_accept_length(tree, rates) - 1
    assert result["scale"] == pytest.approx(extra_live / extra_modelled)
    assert len(CALIBRATION_TREES) >= 3


def test_held_out_prompts_are_spread_distinct_in_range_and_exclude_what_is_asked(
        monkeypatch):
    from eagle3_jax.data import sources

    records = [{"conversations": [{"from": "human", "value": "x" * n},
                                  {"from": "gpt", "value": "ok"}]} for n in range(1, 40)]
    records.append(records[20])  # a duplicate
    monkeypatch.setattr(sources, "iter_raw_records", lambda source: iter(records))
    texts = sources.held_out_prompts(4, min_chars=10, max_chars=30, exclude={"x" * 12})
    assert texts == ["x" * 10, "x" * 17, "x" * 24, "x" * 30]
    with pytest.raises(sources.DataError, match="fewer than the 40"):
        sources.held_out_prompts(40, min_chars=10, max_chars=30)
