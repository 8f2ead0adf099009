"""The live calibration of a head's modelled acceptance (``eagle3_jax.decoding.calibration``):
the scale against tokens and rounds counted from the decoder's own output, and the held-out
prompts it decodes."""

from __future__ import annotations

import numpy as np
import pytest

from eagle3_jax.decoding.acceptance import expected_accept_length
from eagle3_jax.decoding.calibration import (CALIBRATION_TREES, accept_scale,
                                             measure_accept_scale)
from eagle3_jax.decoding.eagle import generate_eagle
from eagle3_jax.decoding.tree import TreeConfig
from test_eagle import _prompts, make_models


def test_the_scale_is_live_extra_tokens_over_modelled_ones():
    trees = [{"live_tau": 1.5, "modelled_tau": 2.0}, {"live_tau": 2.0, "modelled_tau": 3.0}]
    assert accept_scale(trees) == pytest.approx((0.5 + 1.0) / (1.0 + 2.0))
    with pytest.raises(ValueError, match="accept nothing"):
        accept_scale([{"live_tau": 1.0, "modelled_tau": 1.0}])


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
