"""Tree autotuning (``eagle3_jax.decoding.autotune``): the acceptance model, the selection on
synthetic cost curves (flat like an accelerator, steep like a CPU), and the per-machine cache."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from eagle3_jax.decoding import autotune
from eagle3_jax.decoding.acceptance import (chain_accept_length, default_accept_rates,
                                            expected_accept_length, level_sums,
                                            mean_accept_length)
from eagle3_jax.decoding.autotune import CostModel, select_tree
from eagle3_jax.decoding.tree import TreeConfig
from eagle3_jax.draft.config import DraftConfig
from eagle3_jax.draft.params import DraftHead, VocabMap, init_draft_params
from eagle3_jax.model.config import TargetConfig
from eagle3_jax.model.params import init_params, to_serving

SIZES = (1, 2, 4, 8, 16, 32, 64)
CHEAP_DRAFT = {w: 1e-5 for w in (1, 2, 4, 8, 16)}


def test_expected_accept_length_of_a_chain_is_the_prefix_product_sum():
    rates = [0.8, 0.5, 0.25]
    chain = TreeConfig.chain(3)
    assert expected_accept_length(chain, rates) == pytest.approx(1 + 0.8 + 0.4 + 0.1)
    # Siblings add the rank-1 share a (1 - a): 0.8 * 0.2 for the root's second child.
    wide = TreeConfig(tree_top_k=2, depth=1, total_tokens=3)
    assert expected_accept_length(wide, rates) == pytest.approx(1 + 0.8 + 0.16)
    # Perfect acceptance: every level adds one token.
    assert expected_accept_length(TreeConfig(tree_top_k=4, depth=5, total_tokens=40),
                                  [1.0] * 5) == pytest.approx(6.0)
    assert default_accept_rates(3) == pytest.approx([0.6, 0.54, 0.486])
    # The training eval's chain estimate is the same model with one child per node.
    assert chain_accept_length(rates) == pytest.approx(expected_accept_length(chain, rates))
    assert chain_accept_length([]) == 1.0


def test_measured_top_r_hit_rates_credit_each_rank_with_what_was_measured():
    """Per-depth top-r hit rates [h(1), h(2), ...]: the rank-r child is the target's token with
    h(r+1) - h(r). Checked against a simulation of the walk: the target's token at depth d has
    draft rank r with that probability (else no child has it), independently per depth, and a
    round accepts while the node of that rank is in the tree."""
    from eagle3_jax.decoding.acceptance import AcceptRatesError, rank_probabilities

    hits = [[0.5, 0.7, 0.75], [0.3, 0.4, 0.45]]
    np.testing.assert_allclose(rank_probabilities(hits[0], 2), [0.5, 0.2])
    np.testing.assert_allclose(rank_probabilities(hits[1], 5), [0.3, 0.1, 0.05, 0.0, 0.0])
    full = TreeConfig(tree_top_k=2, depth=2, total_tokens=7)  # root + 2 + 4
    tau = expected_accept_length(full, hits)
    assert tau == pytest.approx(1 + 0.7 + 0.7 * 0.4)
    rng = np.random.default_rng(0)
    probs = [rank_probabilities(h, 3) for h in hits]
    accepted = []
    for _ in range(200_000 // 10):
        n = 1
        for p in probs:
            rank = rng.choice(4, p=[*p, 1 - p.sum()])
            if rank >= 2:  # not among the tree's 2 children per node
                break
            n += 1
        accepted.append(n)
    assert tau == pytest.approx(np.mean(accepted), abs=0.02)
    # A head whose second guesses are worthless gains nothing from siblings, where the
    # geometric model (top-1 rate alone) credits rank 1 with a (1 - a).
    flat = [[0.5, 0.5], [0.3, 0.3]]
    wide = TreeConfig(tree_top_k=2, depth=1, total_tokens=3)
    assert expected_accept_length(wide, flat) == pytest.approx(1.5)
    assert expected_accept_length(wide, [0.5, 0.3]) == pytest.approx(1.75)
    with pytest.raises(AcceptRatesError, match="must not decrease"):
        expected_accept_length(wide, [[0.5, 0.4]])


def test_mean_accept_length_is_tokens_per_round():
    # 3 rounds of 1 token, 1 of 2, 2 of 4: (3 + 2 + 8) / 6 tokens per round.
    assert mean_accept_length([0, 3, 1, 0, 2]) == pytest.approx(13 / 6)
    assert mean_accept_length([0, 0, 0]) == 0.0


def test_more_tokens_never_lower_the_expected_length():
    taus = [expected_accept_length(TreeConfig(tree_top_k=4, depth=6, total_tokens=n))
            for n in range(2, 60)]
    assert all(b >= a for a, b in zip(taus, taus[1:]))
    assert taus[-1] <= 1 + 6  # at most depth drafts plus the bonus token


def test_flat_cost_curve_picks_a_big_tree():
    # Accelerator-like: memory bound, a 64-token forward costs what one token costs.
    costs = CostModel(target={t: 0.010 for t in SIZES}, draft=CHEAP_DRAFT)
    choice = select_tree(costs)
    assert choice.tree.total_tokens >= 32 and choice.tree.depth >= 5
    assert choice.predicted_speedup > 2


def test_linear_cost_curve_picks_a_small_tree():
    # CPU-like: compute bound, each extra token costs about as much as the fixed part.
    costs = CostModel(target={t: 0.010 + 0.010 * t for t in SIZES}, draft=CHEAP_DRAFT)
    choice = select_tree(costs)
    assert choice.tree.total_tokens <= 4
    assert choice.expected_accept_length == pytest.approx(
        expected_accept_length(choice.tree, default_accept_rates(choice.tree.depth)))


def test_a_tree_slower_than_plain_decoding_says_so():
    # A weak head on a steep curve: the best tree still loses to one decode step per token.
    costs = CostModel(target={t: 0.010 + 0.010 * t for t in SIZES}, draft=CHEAP_DRAFT)
    weak = select_tree(costs, [0.1])
    assert weak.predicted_speedup < 1 and not weak.pays_off
    assert "--mode vanilla is faster" in weak.describe()
    strong = select_tree(CostModel(target={t: 0.010 for t in SIZES}, draft=CHEAP_DRAFT), [0.9])
    assert strong.pays_off and "vanilla" not in strong.describe()


def test_a_small_predicted_gain_is_within_the_models_error():
    """A tree predicted a little faster than plain decoding (below MIN_PREDICTED_SPEEDUP: the
    model leaves out the round's own work) does not pay off."""
    from eagle3_jax.decoding.autotune import MIN_PREDICTED_SPEEDUP

    # Flat curve, cheap draft: the speed-up is about tau, so the acceptance rate sets it.
    for rate in (0.005, 0.01, 0.02, 0.03, 0.04, 0.05):
        choice = select_tree(CostModel(target={t: 0.010 for t in SIZES}, draft=CHEAP_DRAFT),
                             [rate])
        assert choice.pays_off == (choice.predicted_speedup >= MIN_PREDICTED_SPEEDUP)
        if 1 < choice.predicted_speedup < MIN_PREDICTED_SPEEDUP:
            assert not choice.pays_off and "margin" in choice.describe()
            break
    else:
        pytest.fail("no rate gave a speed-up between 1 and the margin")


def test_better_heads_and_cheaper_drafts_grow_the_tree():
    costs = CostModel(target={t: 0.010 + 0.0005 * t for t in SIZES}, draft=CHEAP_DRAFT)
    weak = select_tree(costs, [0.3])
    strong = select_tree(costs, [0.9])
    assert strong.tree.depth > weak.tree.depth
    expensive = CostModel(target=costs.target, draft={w: 0.004 for w in CHEAP_DRAFT})
    assert select_tree(expensive, [0.9]).tree.depth < strong.tree.depth
    # A fixed dimension is respected.
    assert select_tree(costs, [0.9], tree_top_k=1).tree.tree_top_k == 1
    assert select_tree(costs, [0.9], depth=2).tree.depth == 2


def _brute_force_best(costs, rates, scale, max_tokens=64, decay=1.0, min_tokens=2):
    """The (tree, tau) with the highest scaled tau / modelled seconds, from
    ``expected_accept_length`` of every tree (not the selection's cumulative sums); with a
    ``decay``, from its ``level_sums`` weighted scale * decay**level."""
    best = None
    for k in autotune.TOP_KS:
        for d in autotune.DEPTHS:
            n_candidates = TreeConfig(tree_top_k=k, depth=d, total_tokens=2).num_candidates
            for total in range(min_tokens, min(max_tokens, costs.max_tokens, n_candidates + 1) + 1):
                tree = TreeConfig(tree_top_k=k, depth=d, total_tokens=total)
                tau = (1 + scale * (expected_accept_length(tree, rates) - 1) if decay == 1.0
                       else 1 + scale * float(level_sums(tree, rates) @ decay ** np.arange(d)))
                speed = tau / (costs.target_cost(total) + costs.draft_cost(d, k))
                if best is None or speed > best[2] + 1e-12:
                    best = (tree, tau, speed)
    return best


def test_a_live_scale_shrinks_the_modelled_gain_and_the_tree():
    """``accept_scale`` s models a tree's tau as 1 + s (E[tau] - 1): the pick is the best tree
    under that model, found by brute force over every tree, and a measured s < 1 (the live
    calibration) picks a smaller tree where each verified token costs something."""
    # A measured curve: a 2-core AVX2-only AMD EPYC, 2026-12-05 (ms: T = 8 at 1.18x a step,
    # T = 16 at 1.6x).
    costs = CostModel(target={1: .020, 2: .0206, 4: .0214, 8: .0235, 16: .032, 32: .06,
                              64: .11}, draft={w: 0.0012 for w in CHEAP_DRAFT})
    rates = [[0.74, 0.83, 0.86, 0.88], [0.71, 0.79, 0.83, 0.85], [0.68, 0.77, 0.81, 0.84]]
    picks = {}
    for scale in (1.0, 0.55):
        choice = select_tree(costs, rates, accept_scale=scale)
        tree, tau, speed = _brute_force_best(costs, rates, scale)
        assert choice.tokens_per_s == pytest.approx(speed)
        assert choice.expected_accept_length == pytest.approx(
            1 + scale * (expected_accept_length(choice.tree, rates) - 1))
        picks[scale] = choice
    assert picks[0.55].tree.total_tokens < picks[1.0].tree.total_tokens
    assert picks[0.55].predicted_speedup < picks[1.0].predicted_speedup
    assert not select_tree(costs, rates, accept_scale=0.0).pays_off  # accepts nothing live
    for bad in (-0.5, 2.0):
        with pytest.raises(autotune.AutotuneError, match="accept_scale"):
            select_tree(costs, rates, accept_scale=bad)


def test_a_per_level_decay_credits_deep_nodes_less_and_picks_a_shallower_tree():
    """With ``accept_decay`` r a node at draft level l counts s r**l of its modelled
    acceptance: the pick is the brute-force best under exactly that weighting (the tree's
    nodes still the most probable ones), and r < 1 never picks a deeper tree than r = 1."""
    costs = CostModel(target={1: .020, 2: .0206, 4: .0214, 8: .0235, 16: .032, 32: .06,
                              64: .11}, draft={w: 0.0012 for w in CHEAP_DRAFT})
    rates = [[0.74, 0.83, 0.86, 0.88], [0.71, 0.79, 0.83, 0.85], [0.68, 0.77, 0.81, 0.84]]
    flat = select_tree(costs, rates, accept_scale=0.6)
    for decay in (0.86, 0.6):
        choice = select_tree(costs, rates, accept_scale=0.6, accept_decay=decay)
        tree, tau, speed = _brute_force_best(costs, rates, 0.6, decay=decay)
        assert choice.tokens_per_s == pytest.approx(speed)
        assert choice.expected_accept_length == pytest.approx(tau)
        assert choice.tree.depth <= flat.tree.depth
    assert select_tree(costs, rates, accept_scale=0.6, accept_decay=0.3).tree.depth < \
        flat.tree.depth
    for bad in (0.0, 1.2):
        with pytest.raises(autotune.AutotuneError, match="accept_decay"):
            select_tree(costs, rates, accept_decay=bad)


def test_finalists_add_the_models_best_trees_of_half_and_up_to_twice_the_size():
    """Where the model's best few are one size, the best tree of at most half its tokens and the
    best of more than its tokens and at most twice them are timed too (the brute-force best
    within those bounds); no duplicate when one is already there."""
    costs = CostModel(target={t: 0.010 + 0.0002 * t for t in SIZES}, draft=CHEAP_DRAFT)
    rates = [0.8, 0.75, 0.7, 0.65, 0.6]
    top = autotune.select_trees(costs, rates, 3)
    final = autotune.finalists(costs, rates, 3)
    assert final[:3] == top and len(final) == 5
    best = top[0].tree.total_tokens
    small, large = final[3:]
    assert small.tree.total_tokens <= best // 2
    assert small.tokens_per_s == pytest.approx(_brute_force_best(costs, rates, 1.0, best // 2)[2])
    assert best < large.tree.total_tokens <= 2 * best
    assert large.tokens_per_s == pytest.approx(
        _brute_force_best(costs, rates, 1.0, 2 * best, min_tokens=best + 1)[2])
    assert autotune.finalists(costs, rates, 1) == top[:1]
    # A cap the best tree already meets adds nothing twice.
    steep = CostModel(target={t: 0.010 + 0.010 * t for t in SIZES}, draft=CHEAP_DRAFT)
    trees = [c.tree for c in autotune.finalists(steep, rates, 3)]
    assert len(trees) == len(set(trees))


def _tiny_target_and_head():
    cfg = TargetConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                       num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8,
                       max_position_embeddings=256)
    params = to_serving(init_params(cfg, jax.random.key(0), scale=0.3), cfg)
    dcfg = DraftConfig.for_target(cfg, draft_vocab_size=32)
    head = DraftHead(init_draft_params(dcfg, jax.random.key(1)),
                     VocabMap.from_used_ids(np.arange(0, 64, 2), 64), dcfg)
    return cfg, params, head


def test_costs_are_measured_once_and_cached(tmp_path, monkeypatch):
    cfg, params, head = _tiny_target_and_head()
    monkeypatch.setenv("EAGLE3_JAX_HOME", str(tmp_path))
    kw = dict(repeats=1, sizes=(1, 4), widths=(1, 2))
    costs = autotune.measure_costs(params, cfg, head, 16, **kw)
    path = autotune.cache_path(cfg)
    assert path.parent == tmp_path / "autotune" and path.is_file()
    data = json.loads(path.read_text())
    assert data["key"]["device_kind"] == jax.devices()[0].device_kind
    assert set(data["target"]["16"]) == {"1", "4"}
    assert all(v > 0 for v in costs.target.values()) and set(costs.draft) == {1, 2}

    def no_timing(*args, **kwargs):
        raise AssertionError("cached costs must not be measured again")

    monkeypatch.setattr(autotune, "forward_curve", no_timing)
    monkeypatch.setattr(autotune, "measure_draft_steps", no_timing)
    assert autotune.measure_costs(params, cfg, head, 16, **kw) == costs
    choice = autotune.select_tree(costs, tree_top_k=2)
    assert choice.tree.tree_top_k == 2 and 2 <= choice.tree.total_tokens <= 4
    # Another target config is another file, and so is a change to the timed code.
    other = TargetConfig(**{**cfg.to_dict(), "num_layers": 5})
    assert autotune.cache_path(other) != path
    monkeypatch.setattr(autotune, "code_digest", lambda: "edited-forward")
    assert autotune.cache_path(cfg) != path


def test_predicted_speedup_is_tau_over_the_rounds_cost_in_decode_steps():
    costs = CostModel(target={1: 0.010, 2: 0.012, 8: 0.020, 64: 0.100},
                      draft={1: 0.001, 2: 0.0015, 4: 0.002, 8: 0.004, 16: 0.008})
    choice = select_tree(costs, [0.7] * 4, tree_top_k=4, depth=4)
    tree = choice.tree
    # Verify T tokens + 3 levels of 4 draft tokens (3 x 2 ms) + catch-up over 5 (2.5 ms).
    seconds = costs.target_cost(tree.total_tokens) + 3 * 0.002 + 0.0025
    assert choice.seconds_per_round == pytest.approx(seconds)
    assert choice.predicted_speedup == pytest.approx(choice.expected_accept_length
                                                     / (seconds / 0.010))


def test_fallback_breaks_even_at_the_measured_round_over_the_plain_step(tmp_path, monkeypatch):
    """The break-even is a whole round's measured time over a plain step's, per context bucket
    and batch, measured once per machine (cached on disk) and once per process."""
    cfg, params, head = _tiny_target_and_head()
    monkeypatch.setenv("EAGLE3_JAX_HOME", str(tmp_path))
    calls = []

    def fake_round(target_params, cfg, head, trees, context, repeats, batch=1):
        calls.append((context, batch))
        return [{"round": 0.020 + context * 1e-5 * batch, "step": 0.010 + batch * 1e-4}
                for _ in trees]

    monkeypatch.setattr(autotune, "measure_round", fake_round)
    tree = TreeConfig(tree_top_k=2, depth=3, total_tokens=8)
    fallback = autotune.fallback_for(params, cfg, head, tree, probe_rounds=5)
    short, again, long, batched = fallback(40), fallback(100), fallback(700), fallback(40, 8)
    assert calls == [(128, 1), (1024, 1), (128, 8)]
    assert short is again and short.probe_rounds == 5
    assert short.break_even == pytest.approx((0.020 + 128e-5) / 0.0101)
    # Longer contexts and more rows cost a round more than a step: the draft must accept more.
    assert long.break_even > short.break_even and batched.break_even > short.break_even
    # A new process (a new fallback_for) reads the measurements back from the cache.
    assert autotune.fallback_for(params, cfg, head, tree)(40).break_even == short.break_even
    assert len(calls) == 3


def test_a_measured_round_costs_more_than_a_plain_step():
    """The real timing on a tiny model: a round drafts, verifies 8 tokens and commits, so it
    costs more than one plain step of the same loop. Medians of 15 interleaved calls (~2 ms
    each): with 3, two slow spells of the machine (the suite's other worker) on the step's
    calls made the step look dearer than the round."""
    from eagle3_jax.decoding.costs import measure_round

    cfg, params, head = _tiny_target_and_head()
    small, big = measure_round(params, cfg, head, [TreeConfig(tree_top_k=2, depth=3,
                                                              total_tokens=8),
                                                   TreeConfig(tree_top_k=4, depth=4,
                                                              total_tokens=32)],
                               16, repeats=15)
    assert set(small) == {"round", "step"} and small["round"] > small["step"] > 0
    # One plain step, timed interleaved with both trees' rounds.
    assert big["step"] == small["step"] and big["round"] > big["step"]


def test_the_models_best_trees_are_ranked_by_measured_whole_rounds(tmp_path, monkeypatch):
    """With ``ranked`` > 1 the model's best few shapes are timed as whole rounds and the best
    measured speed-up (modelled tau x plain step / round) wins, whatever the model's order;
    the rounds are cached like the costs; a model that predicts no gain times nothing."""
    cfg, params, head = _tiny_target_and_head()
    monkeypatch.setenv("EAGLE3_JAX_HOME", str(tmp_path))
    curve = {1: 0.010, 2: 0.011, 4: 0.012, 8: 0.014, 16: 0.020, 32: 0.040, 64: 0.080}
    monkeypatch.setattr(autotune, "forward_curve",
                        lambda p, c, ctx, sizes, repeats, batch=1: {t: curve[t] for t in sizes})
    monkeypatch.setattr(autotune, "measure_draft_steps",
                        lambda h, e, ctx, widths, repeats, batch=1: {w: 0.0005 for w in widths})
    rates = [0.8, 0.7, 0.6, 0.5]
    modelled = autotune.select_trees(autotune.measure_costs(params, cfg, head, 128), rates, 3)
    assert len({(c.tree.tree_top_k, c.tree.depth) for c in modelled}) == 3
    assert modelled[0] == autotune.select_tree(autotune.measure_costs(params, cfg, head, 128),
                                               rates)
    # Measured: the model's third shape costs half a round of the others.
    third = modelled[2].tree
    timed = []

    def fake_round(target_params, cfg, head, trees, context, repeats, batch=1):
        timed.append(list(trees))
        return [{"round": 0.010 if tree == third else 0.020, "step": 0.010} for tree in trees]

    monkeypatch.setattr(autotune, "measure_round", fake_round)
    one = autotune.autotune_tree(params, cfg, head, 100, accept_rates=rates)
    assert one.tree == modelled[0].tree and not one.measured and timed == []
    best = autotune.autotune_tree(params, cfg, head, 100, accept_rates=rates, ranked=3)
    finalists = autotune.finalists(autotune.measure_costs(params, cfg, head, 128), rates, 3)
    # The finalists are timed together (interleaved), once.
    assert timed == [[c.tree for c in finalists]] and len(finalists) >= 3
    assert best.tree == third and best.measured
    assert best.seconds_per_round == 0.010 and best.plain_tokens_per_s == pytest.approx(100.0)
    assert best.predicted_speedup == pytest.approx(modelled[2].expected_accept_length)
    assert "(measured)" in best.describe()
    n_timed = len(timed)
    assert autotune.autotune_tree(params, cfg, head, 100, accept_rates=rates, ranked=3) == best
    assert len(timed) == n_timed  # read back from the cache
    # Where the model predicts no gain, nothing is timed.
    weak = autotune.autotune_tree(params, cfg, head, 100, accept_rates=[0.01], ranked=3)
    assert not weak.pays_off and not weak.measured and len(timed) == n_timed


def test_the_decoder_applies_the_heads_live_scale_to_its_own_rates_only(monkeypatch, capsys):
    """``cli.decode.autotune`` hands the head's live calibration to the chooser with the head's
    rates, not with rates the user gives (``--accept-rates``), and says so."""
    import types

    from eagle3_jax.cli import decode as cli
    from eagle3_jax.draft.load import LoadedHead

    seen = []

    def fake_autotune_tree(params, cfg, head, prompt_length, **kw):
        seen.append((kw["accept_rates"], kw["accept_scale"]))
        return autotune.TreeChoice(TreeConfig(tree_top_k=2, depth=3, total_tokens=4), 1.9,
                                   0.03, 63.0, 40.0)

    monkeypatch.setattr(autotune, "autotune_tree", fake_autotune_tree)
    target = types.SimpleNamespace(params={}, cfg=None)
    loaded = LoadedHead(head=None, description="a head", accept_rates=[0.7, 0.6],
                        accept_scale=0.5)
    cli.autotune(target, loaded, 100, None, None, None)
    assert seen[-1] == ([0.7, 0.6], 0.5) and "x0.50" in capsys.readouterr().err
    cli.autotune(target, loaded, 100, None, None, [0.9])
    assert seen[-1] == ([0.9], 1.0) and "x0." not in capsys.readouterr().err
    uncalibrated = LoadedHead(head=None, description="a head", accept_rates=[0.7])
    cli.autotune(target, uncalibrated, 100, None, None, None)
    assert seen[-1] == ([0.7], 1.0)


def test_a_forward_on_a_mesh_compiles_once_per_size():
    """Weights on a one-device mesh (as the commands load them): each timed forward compiles one
    program, its fresh KV cache put where the cache it returns lies (``replicated_like``), not
    one for the first call and another for the rest."""
    from jax.sharding import NamedSharding, PartitionSpec

    from eagle3_jax.decoding.costs import decode_loop, forward_curve, forward_step
    from eagle3_jax.sharding import make_mesh, replicated_like

    cfg, params, _ = _tiny_target_and_head()
    mesh = make_mesh(devices=jax.devices()[:1])  # the commands' mesh on one device
    on_mesh = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    host = np.ones(3, np.float32)
    assert replicated_like(host, params) is host  # weights on no mesh: left as they are
    placed = replicated_like(np.ones(3, np.float32), on_mesh)
    assert placed.sharding == NamedSharding(mesh, PartitionSpec())
    sizes = (1, 3)
    before = forward_step._cache_size(), decode_loop._cache_size()
    forward_curve(on_mesh, cfg, 8, sizes, repeats=2, loop_steps=2)
    assert forward_step._cache_size() - before[0] == len(sizes)
    assert decode_loop._cache_size() - before[1] == 1
