"""EAGLE decoding: lossless greedy (equals plain greedy) across tree shapes, batch sizes and
prompt lengths; lossless sampling (exact target distribution, with a check that the test catches
a biased acceptance rule); tree invariants; KV compaction equals recomputation; an oracle draft
reaches the maximum acceptance length depth + 1."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from eagle3_jax.decoding import SamplingParams, generate, probs
from eagle3_jax.decoding import eagle as eagle_mod
from eagle3_jax.decoding import driver
from eagle3_jax.decoding.eagle import _prefill, _round, generate_eagle
from eagle3_jax.decoding.tree import (TreeConfig, TreeError,
                                      tree_from_parents)
from eagle3_jax.decoding.verify import Acceptance
from eagle3_jax.draft.config import DraftConfig
from eagle3_jax.draft.model import draft_step_cached, empty_draft_cache, fuse_taps
from eagle3_jax.draft.params import DraftHead, VocabMap, draft_param_specs
from eagle3_jax.model.config import TargetConfig
from eagle3_jax.model.params import is_spec, param_specs, to_serving
from eagle3_jax.model.target import KVCache, causal_mask, forward
from cpu_features import has_avx512

TREES = {
    "chain": TreeConfig.chain(4),
    "wide": TreeConfig(tree_top_k=4, depth=2, total_tokens=14),
    "deep": TreeConfig(tree_top_k=2, depth=6, total_tokens=12),
    "default": TreeConfig(),
}


def random_params(specs, seed, scale):
    """Random weights of the shapes ``specs`` give (a tree of ParamSpec), drawn with NumPy
    (jax.random compiles a program per shape): normal(0, scale) matrices, norm scales
    1 + normal(0, 0.1), other vectors (biases) normal(0, 0.1)."""
    rng = np.random.default_rng(seed)

    def draw(spec):
        noise = rng.standard_normal(spec.shape).astype(np.float32)
        if spec.init == "normal":
            return jnp.asarray(scale * noise)
        return jnp.asarray((1.0 if spec.init == "ones" else 0.0) + np.float32(0.1) * noise)

    return jax.tree.map(draw, specs, is_leaf=is_spec)


def make_models(vocab=96, draft_vocab=48, seed=0, scale=0.3):
    cfg = TargetConfig(arch="llama", vocab_size=vocab, hidden_size=32, intermediate_size=64,
                       num_layers=6, num_heads=4, num_kv_heads=2, head_dim=8,
                       tie_word_embeddings=True, max_position_embeddings=512)
    params = to_serving(random_params(param_specs(cfg), seed, scale), cfg)
    dcfg = DraftConfig.for_target(cfg, draft_vocab_size=draft_vocab)
    used = np.sort(np.random.default_rng(seed).choice(vocab, draft_vocab, replace=False))
    head = DraftHead(params=random_params(draft_param_specs(dcfg), seed + 1, 0.3),
                     vocab=VocabMap.from_used_ids(used, vocab), cfg=dcfg)
    return cfg, params, head


@pytest.fixture(scope="module")
def models():
    return make_models()


def _prompts(lengths, vocab, seed=3, width=None):
    """Random prompts of ``lengths``, right-padded with 0 to ``width`` (default the longest)."""
    width = width or max(lengths)
    tokens = np.random.default_rng(seed).integers(0, vocab, (len(lengths), width))
    for i, n in enumerate(lengths):
        tokens[i, n:] = 0
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32)


# The greedy end-to-end runs decode one prompt batch for one length, so plain ``generate`` of it
# compiles once per file and each tree's (each fallback's) ``generate_eagle`` once. The lengths
# mix a one-token prompt, short ones, and two that cross the 16-token chunks of a chunked
# prefill (test_greedy_after_a_chunked_prefill_equals_plain_greedy): the width, 64, is a
# multiple of the chunk. NEW is one token (the prefill's), ten full rounds of the depth-3
# oracle trees (4 tokens each) and a round cut after 2 tokens by the limit.
LENGTHS, WIDTH, NEW = [37, 5, 1, 21], 64, 43


@pytest.fixture(scope="module")
def prompts(models):
    """The greedy runs' prompts: tokens [4, WIDTH], lengths [4]."""
    return _prompts(LENGTHS, models[0].vocab_size, width=WIDTH)


@pytest.fixture(scope="module")
def plain_greedy(models, prompts):
    """Plain greedy decoding of ``prompts``, NEW tokens: the reference of the greedy runs."""
    cfg, params, _ = models
    return generate(params, cfg, *prompts, max_new_tokens=NEW)


@pytest.mark.parametrize("sixteen_bit", [False, True], ids=["float32", "bfloat16_values"])
@pytest.mark.parametrize("variant", [{}, {"fc_norm": True, "norm_output": True,
                                            "norm_before_residual": True}], ids=["3", "3.1"])
def test_serving_layout_computes_the_trained_draft_step(models, variant, sixteen_bit):
    """The serving layout (fused, [out, in]: the rows kernel) against the trained layout's
    [in, out] matmuls: the same feature, logits and cache from the taps and a cached step, to
    float32 round-off; the conversion moves data only and is idempotent. A head whose values
    are all bfloat16 (stored in 16 bits, loaded as float32: the shipped one) is served from
    bfloat16 matrices where the CPU kernel reads them, with the same results."""
    from eagle3_jax.draft.params import SERVING_MATRICES, is_serving
    from eagle3_jax.kernels.library import kernels_in_use
    cfg, _, head = models
    dcfg = dataclasses.replace(head.cfg, **variant)
    trained = random_params(draft_param_specs(dcfg), 7, 0.3)
    if sixteen_bit:
        trained = jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(a.dtype), trained)
    serving = DraftHead(params=trained, vocab=head.vocab, cfg=dcfg).serving()
    assert is_serving(serving.params) and serving.serving() is serving
    narrow = sixteen_bit and kernels_in_use(jnp.float32, "matmul")
    for name in SERVING_MATRICES:
        assert serving.params[name].dtype == (jnp.bfloat16 if narrow else jnp.float32), name
    np.testing.assert_array_equal(serving.params["lm_head_t"].astype(jnp.float32),
                                  trained["lm_head"].T)
    b, t, slots, d = 2, 3, 16, dcfg.hidden_size
    rng = np.random.default_rng(0)
    taps = jnp.asarray(rng.normal(size=(b, t, 3 * d)), jnp.float32)
    embeds = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(5, 5 + t), (b, t))
    mask = jnp.arange(slots)[None, None, :] <= positions[:, :, None]
    cache = empty_draft_cache(dcfg, b, slots)
    outs = []
    for params in (trained, serving.params):
        g = fuse_taps(params, dcfg, taps)
        outs.append((g, *draft_step_cached(params, dcfg, embeds, g, positions, mask, *cache,
                                           positions)))
    for want, got in zip(*outs):
        scale = float(jnp.max(jnp.abs(want)))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("tree", list(TREES), ids=list(TREES))
def test_greedy_equals_plain_greedy(models, prompts, plain_greedy, tree):
    cfg, params, head = models
    plain = plain_greedy
    out = generate_eagle(params, cfg, head, *prompts, max_new_tokens=NEW, tree=TREES[tree])
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    np.testing.assert_array_equal(out.num_generated, plain.num_generated)


def test_greedy_after_a_chunked_prefill_equals_plain_greedy(models, prompts, plain_greedy,
                                                            monkeypatch):
    """The prefill run as forwards of 16 tokens (what the CPU kernels' policy does for long
    prompts; this model is too small for them): the taps past the last chunk are zeros, and
    EAGLE still decodes what plain decoding with one prefill forward decodes."""
    import eagle3_jax.model.target as target

    cfg, params, head = models
    # The reference, plain decoding of the same prompts, ran its prefill as one forward: the
    # policy gives no chunk for this model.
    assert target.prefill_chunk(cfg, WIDTH) is None
    widths = []

    def chunks_of(size):
        def policy(cfg, width):
            widths.append((size, width))
            return size
        return policy

    monkeypatch.setattr(target, "prefill_chunk", chunks_of(16))
    # Fewer tokens than the wide tree's greedy run: another program, traced with this policy;
    # greedy decoding's first tokens are those of the longer reference.
    new = NEW - 8
    out = generate_eagle(params, cfg, head, *prompts, max_new_tokens=new, tree=TREES["wide"])
    assert widths == [(16, WIDTH)]  # traced with this policy
    np.testing.assert_array_equal(out.tokens, plain_greedy.tokens[:, :new])
    np.testing.assert_array_equal(out.num_generated, np.minimum(plain_greedy.num_generated, new))


def test_a_head_of_bfloat16_values_decodes_losslessly(models, prompts, plain_greedy):
    """A head of bfloat16 values, served from bfloat16 matrices on CPU: EAGLE greedy equals
    plain greedy, and (on a CPU without AVX-512, where both are the same instructions after
    the widening) the draft accepts exactly what the float32-held head accepts."""
    cfg, params, head = models
    rounded = jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(a.dtype), head.params)
    head16 = DraftHead(params=rounded, vocab=head.vocab, cfg=head.cfg)
    out = generate_eagle(params, cfg, head16, *prompts, max_new_tokens=NEW, tree=TREES["wide"])
    np.testing.assert_array_equal(out.tokens, plain_greedy.tokens)
    if has_avx512():
        return  # float32 weights run the AVX-512 form there: other sums, near-ties may flip
    from eagle3_jax.draft.params import to_serving
    held32 = head16.replace(params=to_serving(rounded))  # serving layout, float32 matrices
    out32 = generate_eagle(params, cfg, held32, *prompts, max_new_tokens=NEW,
                           tree=TREES["wide"])
    np.testing.assert_array_equal(out.accept_hist, out32.accept_hist)


def test_eagle31_head_greedy_equals_plain_greedy(models, prompts, plain_greedy):
    """An EAGLE-3.1 head (tap norms, normed recurrent feature) through the whole decoder."""
    cfg, params, head = models
    dcfg = dataclasses.replace(head.cfg, fc_norm=True, norm_output=True)
    head = DraftHead(params=random_params(draft_param_specs(dcfg), 5, 0.3),
                     vocab=head.vocab, cfg=dcfg)
    out = generate_eagle(params, cfg, head, *prompts, max_new_tokens=NEW, tree=TREES["wide"])
    np.testing.assert_array_equal(out.tokens, plain_greedy.tokens)


@pytest.fixture(scope="module")
def eos_id(plain_greedy):
    """A token row 0 of the greedy runs produces: with it as EOS, row 0 must stop before it."""
    return int(plain_greedy.tokens[0, 5])


def test_each_row_equals_its_batch_of_one(models, prompts, eos_id):
    cfg, params, head = models
    tokens, lengths = prompts
    eos = (eos_id,)
    # The same run as test_eos_stops_a_row_and_matches_plain's (one program for both).
    batched = generate_eagle(params, cfg, head, tokens, lengths, max_new_tokens=NEW,
                             tree=TREES["default"], eos_token_ids=eos)
    for row in range(len(LENGTHS)):
        alone = generate_eagle(params, cfg, head, tokens[row:row + 1], lengths[row:row + 1],
                               max_new_tokens=NEW, tree=TREES["default"], eos_token_ids=eos)
        np.testing.assert_array_equal(batched.tokens[row], alone.tokens[0])
        assert int(batched.rounds[row]) == int(alone.rounds[0])


def test_eos_stops_a_row_and_matches_plain(models, prompts, plain_greedy, eos_id):
    """With an EOS id, each row is plain greedy decoding's tokens up to its first EOS (not
    written), and stops there: what plain decoding with that EOS gives (tests/test_generate.py,
    test_eos_stops_its_row_and_others_continue, holds it to the same reference)."""
    cfg, params, head = models
    out = generate_eagle(params, cfg, head, *prompts, max_new_tokens=NEW, tree=TREES["default"],
                         eos_token_ids=(eos_id,))
    tokens = np.asarray(out.tokens)
    for row in range(len(LENGTHS)):
        plain = np.asarray(plain_greedy.tokens[row, :int(plain_greedy.num_generated[row])])
        plain = plain.tolist()
        hit = eos_id in plain
        expected = plain[:plain.index(eos_id)] if hit else plain
        assert tokens[row, :len(expected)].tolist() == expected, row
        assert (tokens[row, len(expected):] == -1).all(), row
        assert int(out.num_generated[row]) == len(expected) and bool(out.hit_eos[row]) == hit
    assert bool(out.hit_eos[0]) and int(out.num_generated[0]) <= 5


# ---------------------------------------------------------------------------- oracle draft


def oracle_proposer(target_params, head, state, cfg, tree_cfg):
    """A 'draft' that knows the target's greedy continuation: the chain of the next ``depth``
    greedy tokens, plus wrong siblings to fill the tree."""
    depth, b = tree_cfg.depth, state.root.shape[0]

    def greedy_next(carry, i):  # a scan: one target forward in the program, not ``depth``
        cache, token = carry
        end = state.cache.end + i
        out = forward(target_params, cfg, token[:, None], end[:, None],
                      causal_mask(end, 1, cache.max_len), dataclasses.replace(cache, end=end))
        token = jnp.argmax(out.logits[:, 0], -1).astype(jnp.int32)
        return (dataclasses.replace(out.cache, end=state.cache.end), token), token

    _, chain = jax.lax.scan(greedy_next, (state.cache, state.root), jnp.arange(depth))
    chain = chain.T  # [B, depth]
    n = tree_cfg.total_tokens
    siblings = n - 1 - depth  # attached to chain nodes 0.. (root included), wrong tokens
    parents = [-1] + list(range(depth)) + [i % depth for i in range(siblings)]
    wrong = (chain[:, [i % depth for i in range(siblings)]] + 1) % cfg.vocab_size
    tokens = jnp.concatenate([state.root[:, None], chain, wrong], axis=1)
    parents = jnp.broadcast_to(jnp.asarray(parents, jnp.int32), (b, n))
    tree = tree_from_parents(tokens.astype(jnp.int32), parents, depth)
    return tree, state.draft_k, state.draft_v


@pytest.mark.parametrize("tree", [TreeConfig.chain(3), TreeConfig(tree_top_k=2, depth=3,
                                                                  total_tokens=7)])
def test_oracle_draft_reaches_max_acceptance(models, prompts, plain_greedy, tree):
    cfg, params, head = models
    full = 10  # the prefill token, 10 full rounds, then a round cut after 2 tokens
    assert NEW == 1 + full * (tree.depth + 1) + 2
    out = generate_eagle(params, cfg, head, *prompts, max_new_tokens=NEW, tree=tree,
                         proposer=oracle_proposer)
    np.testing.assert_array_equal(out.tokens, plain_greedy.tokens)
    np.testing.assert_array_equal(out.rounds, [full + 1] * len(LENGTHS))
    hist = np.asarray(out.accept_hist)
    assert (hist[:, tree.depth + 1] == full).all()  # tau = depth + 1 in every full round
    assert (hist[:, 2] == 1).all() and hist.sum() == (full + 1) * len(LENGTHS)


def test_accept_hist_counts_emitted_tokens_only(models, prompts):
    """A round cut by max_new_tokens counts the tokens it emitted, not those it verified: the
    rounds' tokens add up to every generated token but the prefill's."""
    cfg, params, head = models
    tree = TreeConfig.chain(3)
    # Ten full rounds, then a round cut after 2 tokens (test_oracle_draft_reaches_max_acceptance's
    # run of this tree: one program for both).
    assert NEW == 1 + 10 * (tree.depth + 1) + 2
    out = generate_eagle(params, cfg, head, *prompts, max_new_tokens=NEW, tree=tree,
                         proposer=oracle_proposer)
    hist = np.asarray(out.accept_hist)
    np.testing.assert_array_equal(out.rounds, [11] * len(LENGTHS))
    np.testing.assert_array_equal((hist * np.arange(hist.shape[1])).sum(1),
                                  np.asarray(out.num_generated) - 1)
    assert (hist[:, 2] == 1).all() and (hist[:, tree.depth + 1] == 10).all()


# ---------------------------------------------------------------------------- tree invariants


def _python_ancestors(parents):
    n = len(parents)
    anc = np.zeros((n, n), bool)
    for i in range(n):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parents[j]
    return anc


# Jitted: run op by op, the prefill and the tree build take seconds of dispatch per call.
_jit_prefill = jax.jit(_prefill, static_argnames=("cfg", "tree_cfg", "sampling", "eos_token_ids",
                                                  "max_new_tokens", "max_len"))
_jit_forward = jax.jit(forward, static_argnums=1, static_argnames=("tap_layers",))


@functools.partial(jax.jit, static_argnames=("cfg", "tree_cfgs"))
def _first_trees(params, head, tokens, lengths, *, cfg, tree_cfgs):
    """For each tree config: the state after the prefill (16 new tokens, 64 slots) and the draft
    tree of the first round grown from it. One program for all (their target prefills are the
    same computation, compiled once)."""
    out = []
    for tree_cfg in tree_cfgs:
        state = _prefill(params, head, tokens, lengths, jax.random.key(0), cfg=cfg,
                         tree_cfg=tree_cfg, sampling=SamplingParams(), eos_token_ids=(),
                         max_new_tokens=16, max_len=64)
        out.append((state, eagle_mod.draft_proposer(params, head, state, cfg=cfg,
                                                    tree_cfg=tree_cfg)[0]))
    return out


@functools.partial(jax.jit, static_argnames=("cfg", "max_len"))
def _from_scratch(params, head, seqs, following, *, cfg, max_len):
    """Right-padded sequences seqs [B, S] run from empty caches of ``max_len`` slots: the
    target's causal forward, and the draft over the same entries, entry s pairing the taps of
    token s with the token ``following`` [B, S] s (the draft's prefill over that context).
    Returns (the target's cache, the draft's logits [B, S, V_draft], its keys and values); a
    row's entries before its length never see the padding."""
    b, s = seqs.shape
    positions = jnp.broadcast_to(jnp.arange(s), (b, s))
    mask = causal_mask(jnp.zeros((b,), jnp.int32), s, max_len)
    ref = forward(params, cfg, seqs, positions, mask, KVCache.zeros(cfg, b, max_len),
                  tap_layers=head.cfg.tap_layers)
    _, logits, dk, dv = draft_step_cached(
        head.params, head.cfg, params["embed"][following],
        fuse_taps(head.params, head.cfg, ref.taps), positions, mask,
        *empty_draft_cache(head.cfg, b, max_len), positions)
    return ref.cache, logits, dk, dv


def _right_padded(rows):
    """Token rows of different lengths as one int32 batch [B, longest], 0-padded."""
    out = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return jnp.asarray(out)


@pytest.fixture(scope="module")
def first_trees(models):
    """{tree name: (state after the prefill, the first round's draft tree)} for 3 prompts."""
    cfg, params, head = models
    tokens, lengths = _prompts([10, 3, 7], cfg.vocab_size)
    grown = _first_trees(params, head, tokens, lengths, cfg=cfg, tree_cfgs=tuple(TREES.values()))
    return dict(zip(TREES, jax.device_get(grown)))


@pytest.mark.parametrize("tree", list(TREES), ids=list(TREES))
def test_tree_invariants(models, first_trees, tree):
    cfg, params, head = models
    tree_cfg = TREES[tree]
    state, t = first_trees[tree]
    parents, depths = np.asarray(t.parents), np.asarray(t.depths)
    n = tree_cfg.total_tokens
    assert t.tokens.shape == (3, n)
    np.testing.assert_array_equal(t.tokens[:, 0], state.root)
    for b in range(3):
        assert parents[b, 0] == -1
        assert all(0 <= parents[b, i] < i for i in range(1, n)), "parent-first and connected"
        anc = _python_ancestors(parents[b])
        np.testing.assert_array_equal(t.ancestors[b], anc)
        np.testing.assert_array_equal(depths[b], anc.sum(1) - 1)  # position offset = depth
        assert depths[b].max() <= tree_cfg.depth
        for i in range(n):  # paths list the ancestors root-first
            path = np.asarray(t.paths[b, i])
            assert list(path[: depths[b, i] + 1]) == sorted(np.flatnonzero(anc[i]))
            assert (path[depths[b, i] + 1:] == -1).all()
        # No node has more than top_k children; siblings are distinct tokens.
        for i in range(n):
            kids = np.flatnonzero(parents[b] == i)
            assert len(kids) <= tree_cfg.tree_top_k
            assert len(set(np.asarray(t.tokens[b, kids]).tolist())) == len(kids)
    # Level 1 holds the draft's own top choices for the root.
    top = np.asarray(head.vocab.draft_to_target)[
        np.argsort(-np.asarray(state.root_logp), axis=1)[:, :tree_cfg.tree_top_k]]
    for b in range(3):
        level1 = set(np.asarray(t.tokens[b])[depths[b] == 1].tolist())
        assert level1 <= set(top[b].tolist()) and len(level1) >= 1
    if tree_cfg.tree_top_k == 1:
        np.testing.assert_array_equal(parents, np.broadcast_to(np.arange(n) - 1, (3, n)))


def test_impossible_tree_sizes_are_refused():
    with pytest.raises(TreeError, match="total_tokens <= 3"):
        TreeConfig(tree_top_k=1, depth=2, total_tokens=10)
    with pytest.raises(TreeError, match="positive integer"):
        TreeConfig(tree_top_k=0)
    with pytest.raises(TreeError, match="at least 2"):
        TreeConfig(total_tokens=1)


# ------------------------------------------------------------------ KV compaction vs recompute


def test_commit_equals_recomputing_the_caches(models):
    cfg, params, head = models
    tree_cfg = TreeConfig(tree_top_k=2, depth=3, total_tokens=7)
    tokens, lengths = _prompts([7, 12], cfg.vocab_size)
    kw = dict(cfg=cfg, tree_cfg=tree_cfg, sampling=SamplingParams(), eos_token_ids=())
    state = _jit_prefill(params, head, tokens, lengths, jax.random.key(0), max_new_tokens=40,
                         max_len=64, **kw)
    step = jax.jit(functools.partial(_round, proposer=oracle_proposer, **kw))
    for _ in range(3):
        state = step(params, head, state)
    state = jax.device_get(state)
    committed, following = [], []
    for b in range(2):
        n_prompt, end = int(lengths[b]), int(state.cache.end[b])
        emitted = np.asarray(state.out.tokens[b, : int(state.out.num_generated[b])])
        committed.append(np.concatenate([np.asarray(tokens[b, :n_prompt]), emitted[:-1]]))
        assert len(committed[b]) == end and emitted[-1] == int(state.root[b])
        following.append(np.append(committed[b][1:], emitted[-1]))
    # Both rows from scratch in one batch (the draft's from the target's taps there).
    ref_cache, _, dk, _ = jax.device_get(_from_scratch(
        params, head, _right_padded(committed), _right_padded(following), cfg=cfg, max_len=64))
    for b in range(2):
        end = len(committed[b])
        # Keys [B, K, H, S] and values [B, K, S, H], compared slot-major, layer by layer to
        # float32 round-off relative to the layer's scale: the tree verification and the prefill
        # sum in different orders (other row counts, other attention blocks).
        for got, want in ((state.cache.k, ref_cache.k), (state.cache.v, ref_cache.v)):
            if got is state.cache.k:
                got, want = [x.swapaxes(-1, -2) for x in got], [x.swapaxes(-1, -2) for x in want]
            for g_layer, w_layer in zip(got, want):
                w_layer = np.asarray(w_layer)[b, :, :end]
                np.testing.assert_allclose(np.asarray(g_layer)[b, :, :end], w_layer,
                                           atol=1e-5 * np.abs(w_layer).max())
        # The draft cache equals a draft prefill over the same context from scratch.
        np.testing.assert_allclose(state.draft_k[b, ..., :end], dk[b, ..., :end], atol=2e-5)


# ---------------------------------------------------------------- lossless sampling (exact)

SAMPLERS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9)]


def _exact_joint(params, cfg, prompt, sampling, k=2):
    """P(t_1, ..., t_k | prompt) [V] * k under the target with the sampling rules applied: one
    forward over every prefix t_1 .. t_{k-1} (V^(k-1) rows), whose logits at the last k
    positions give each factor P(t_j | prompt, t_<j)."""
    v, n = cfg.vocab_size, prompt.shape[0]
    prefixes = np.indices((v,) * (k - 1)).reshape(k - 1, -1).T  # [V^(k-1), k-1], row-major
    rows, width = len(prefixes), n + k - 1
    seqs = jnp.concatenate([jnp.broadcast_to(prompt, (rows, n)), jnp.asarray(prefixes, jnp.int32)],
                           axis=1)
    mask = jnp.tril(jnp.ones((width, width), bool))[None].repeat(rows, 0)
    out = _jit_forward(params, cfg, seqs, jnp.broadcast_to(jnp.arange(width), (rows, width)), mask)
    p = np.asarray(probs(out.logits[:, n - 1:], sampling), np.float64)  # [rows, k, V]
    joint = np.ones(rows)
    for j in range(k - 1):  # P(t_{j+1} | prompt, t_1 .. t_j), read on the row of the whole prefix
        joint *= p[np.arange(rows), j, prefixes[:, j]]
    return (joint[:, None] * p[:, k - 1]).reshape((v,) * k)


def _sampled(cfg, params, head, prompt, samples, new, tree, fallback, seed,
             sampling=SAMPLERS[0]):
    """``samples`` rows of ``prompt``, each sampled ``new`` tokens with ``fallback``: what the
    sampling tests compare with the exact joint."""
    width = len(prompt)
    out = generate_eagle(params, cfg, head,
                         jnp.broadcast_to(jnp.asarray(prompt, jnp.int32), (samples, width)),
                         jnp.full((samples,), width, jnp.int32), max_new_tokens=new, tree=tree,
                         sampling=sampling, key=jax.random.key(seed), fallback=fallback)
    assert (np.asarray(out.num_generated) == new).all()
    return out


# The tiny model's sampled runs: SAMPLES rows of PROMPT, three tokens each: the prefill's, round
# 1's, and (where round 1 accepted nothing) a plain step's, as the fallback gives up drafting
# after round 1 (never to resume). One program per sampler serves the tests of a round's tokens
# (the first two of each row: round 1 is the same round with or without a fallback) and of the
# plain step after it (all three).
PROMPT, SAMPLES = [1, 5, 2, 7, 3], 8000
AFTER_ROUND_1 = dict(new=3, tree=TreeConfig(tree_top_k=3, depth=2, total_tokens=6),
                     fallback=eagle_mod.Fallback(50.0, probe_rounds=1, resume_window=0), seed=1)


def _chi_square_pvalue(samples, exact):
    """samples [S, k] token tuples against the exact joint ``exact`` [V] * k."""
    cells = np.ravel_multi_index(tuple(samples.T), exact.shape)
    observed = np.bincount(cells, minlength=exact.size).astype(float)
    expected = exact.reshape(-1) * len(samples)
    big = expected >= 5  # pool the rare cells into one
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    assert observed[exact.reshape(-1) == 0].sum() == 0, "sampled a token of probability 0"
    return stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue


@pytest.fixture(scope="module")
def tiny_vocab_models():
    return make_models(vocab=8, draft_vocab=8, seed=3, scale=0.5)


@pytest.fixture(scope="module")
def tiny_samples(tiny_vocab_models):
    """``tiny_samples(sampling)``: the tiny model's sampled run (AFTER_ROUND_1) with that
    sampler, run once."""
    runs = {}

    def run(sampling):
        if sampling not in runs:
            runs[sampling] = _sampled(*tiny_vocab_models, PROMPT, SAMPLES, **AFTER_ROUND_1,
                                      sampling=sampling)
        return runs[sampling]

    return run


@pytest.mark.parametrize("sampling", SAMPLERS, ids=["t1", "t0.7-k5-p0.9"])
def test_sampling_is_lossless(tiny_vocab_models, tiny_samples, sampling):
    """The prefill's token and round 1's follow the exact joint."""
    cfg, params, head = tiny_vocab_models
    exact = _exact_joint(params, cfg, jnp.asarray(PROMPT, jnp.int32), sampling)
    pairs = np.asarray(tiny_samples(sampling).tokens)[:, :2]
    assert _chi_square_pvalue(pairs, exact) > 1e-3


def _biased_accept(key, tree, logits, sampling, top_k):
    """A classic bug: on rejection the target distribution is not adjusted (no p(x) = 0)."""
    b = tree.tokens.shape[0]
    rows = jnp.arange(b)
    target_p = probs(logits, sampling)
    node, alive = jnp.zeros((b,), jnp.int32), jnp.ones((b,), bool)
    path, count = [node], jnp.zeros((b,), jnp.int32)
    keys = jax.random.split(key, 64)
    depth = tree.paths.shape[-1] - 1
    for level in range(depth):
        order = jnp.argsort(~(tree.parents == node[:, None]), axis=1, stable=True)[:, :top_k]
        valid = jnp.take_along_axis(tree.parents == node[:, None], order, axis=1)
        chosen = jnp.full((b,), -1, jnp.int32)
        for j in range(top_k):
            child = order[:, j]
            u = jax.random.uniform(keys[level * top_k + j], (b,))
            ok = valid[:, j] & alive & (chosen < 0) & (u < target_p[rows, node,
                                                                    tree.tokens[rows, child]])
            chosen = jnp.where(ok, child, chosen)
        moved = alive & (chosen >= 0)
        node = jnp.where(moved, chosen, node)
        path.append(jnp.where(moved, chosen, -1))
        count, alive = count + moved, moved
    bonus = jax.random.categorical(keys[-1], jnp.log(target_p[rows, node]), axis=-1)
    return Acceptance(path=jnp.stack(path, 1), num_accepted=count, bonus=bonus.astype(jnp.int32))


def test_greedy_acceptance_is_the_rejection_walk_with_one_hot_targets():
    """The greedy walk (argmax tokens only) against the general walk with p one-hot at the
    argmax (top_k = 1 sampling): same paths, counts and bonus tokens, on random trees whose
    tokens are often the argmax of their parent, so paths of every length occur."""
    from eagle3_jax.decoding.verify import accept
    b, n, vocab, depth, top_k = 64, 9, 11, 4, 3
    rng = np.random.default_rng(0)
    parents = np.full((b, n), -1)
    for i in range(1, n):
        parents[:, i] = rng.integers(0, i, b)
    depths = np.zeros((b, n), int)
    for i in range(1, n):
        depths[:, i] = depths[np.arange(b), parents[:, i]] + 1
    parents = np.where(depths > depth, 0, parents)  # keep the tree within depth levels
    logits = rng.normal(size=(b, n, vocab)).astype(np.float32)
    best = logits.argmax(-1)
    tokens = rng.integers(0, vocab, (b, n))
    hits = rng.random((b, n)) < 0.7
    tokens = np.where(hits, best[np.arange(b)[:, None], np.maximum(parents, 0)], tokens)
    tree = tree_from_parents(jnp.asarray(tokens, jnp.int32), jnp.asarray(parents, jnp.int32),
                             depth)
    key = jax.random.PRNGKey(3)

    @jax.jit  # both walks in one program (op by op, the general walk compiles each of its ops)
    def walks(key, tree, logits):
        return (accept(key, tree, logits, SamplingParams(), top_k),
                accept(key, tree, logits, SamplingParams(1.0, top_k=1), top_k))

    greedy, walk = walks(key, tree, jnp.asarray(logits))
    for field in ("path", "num_accepted", "bonus"):
        np.testing.assert_array_equal(getattr(greedy, field), getattr(walk, field), field)
    assert len(set(np.asarray(greedy.num_accepted).tolist())) >= 4


# ---------------------------------------------------------------------------- fallback


def test_fallback_checks_at_probe_round_then_powers_of_two():
    fallback = eagle_mod.Fallback(break_even=2.0, probe_rounds=6)
    rounds = jnp.asarray([3, 3])
    low = jnp.asarray([[0, 3, 0, 0], [0, 2, 1, 0]])  # 7 tokens in 6 rounds: below 2.0
    high = jnp.asarray([[0, 0, 0, 3], [0, 0, 0, 3]])  # 18 tokens in 6 rounds
    checked = [s for s in range(1, 70) if bool(fallback.gives_up(jnp.int32(s), rounds, low))]
    assert checked == [8, 16, 32, 64]
    assert not any(bool(fallback.gives_up(jnp.int32(s), rounds, high)) for s in range(1, 70))
    with pytest.raises(ValueError, match="probe_rounds"):
        eagle_mod.Fallback(break_even=2.0, probe_rounds=0)


def test_fallback_gives_a_noisy_probe_the_benefit_of_one_standard_error():
    """1.2 tokens a round (8 rounds of 1, 2 of 2: standard deviation 0.4) against a break-even
    of 1.29: over 10 rounds the standard error (0.126) covers the gap and drafting goes on; the
    same rates over 80 rounds (0.045) do not, and it gives up; a variance-free rate just below
    break-even gives up at once."""
    fallback = eagle_mod.Fallback(break_even=1.29, probe_rounds=8)
    step = jnp.int32(8)
    assert eagle_mod.FALLBACK_STANDARD_ERRORS == 1.0
    assert not bool(fallback.gives_up(step, jnp.asarray([10]), jnp.asarray([[0, 8, 2]])))
    assert bool(fallback.gives_up(step, jnp.asarray([80]), jnp.asarray([[0, 64, 16]])))
    assert bool(fallback.gives_up(step, jnp.asarray([10]), jnp.asarray([[0, 10, 0]])))
    # Per row counts add up: two rows of 5 rounds are one run of 10.
    assert not bool(fallback.gives_up(step, jnp.asarray([5, 5]),
                                      jnp.asarray([[0, 4, 1], [0, 4, 1]])))


# A fallback a random head never pays for: it gives up after the probe rounds.
GIVES_UP = dict(tree=TREES["wide"], fallback=eagle_mod.Fallback(50.0, probe_rounds=4))


def test_fallback_gives_up_a_weak_draft_and_stays_lossless(models, prompts, plain_greedy):
    """A random head cannot reach an unreachable break-even: after the probe rounds every step
    is a plain decode step, and the output is still plain greedy decoding's, token for token."""
    cfg, params, head = models
    plain = plain_greedy
    out = generate_eagle(params, cfg, head, *prompts, max_new_tokens=NEW, **GIVES_UP)
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    np.testing.assert_array_equal(out.num_generated, plain.num_generated)
    live = np.asarray(plain.num_generated) == NEW  # rows that did not stop early
    np.testing.assert_array_equal(np.asarray(out.rounds)[live], 4)
    hist = np.asarray(out.accept_hist)
    emitted = (hist * np.arange(hist.shape[1])).sum(1)
    # Every token but the prefill's came from a round or a plain step (one token each).
    np.testing.assert_array_equal(emitted + np.asarray(out.plain_steps),
                                  np.asarray(out.num_generated) - 1)
    assert (np.asarray(out.plain_steps)[live] > 0).all()


@pytest.mark.parametrize("margin, gives_up", [(-0.5, False), (0.5, True)])
def test_fallback_keeps_a_draft_that_pays(models, prompts, margin, gives_up):
    """The oracle draft emits depth + 1 tokens a round: a break-even just below keeps it
    drafting to the end (the same rounds as without a fallback), just above gives up."""
    cfg, params, head = models
    tree = TreeConfig.chain(3)
    # The base run is test_oracle_draft_reaches_max_acceptance's (one program for both). The
    # fallbacks never resume (resume_window 0): giving up is for good, a smaller program.
    kw = dict(max_new_tokens=NEW, tree=tree, proposer=oracle_proposer)
    base = generate_eagle(params, cfg, head, *prompts, **kw)
    out = generate_eagle(params, cfg, head, *prompts, **kw,
                         fallback=eagle_mod.Fallback(tree.depth + 1 + margin, probe_rounds=8,
                                                     resume_window=0))
    np.testing.assert_array_equal(out.tokens, base.tokens)
    if gives_up:  # 8 rounds, then a plain step for each token left
        np.testing.assert_array_equal(out.rounds, [8] * len(LENGTHS))
        assert (np.asarray(out.plain_steps) == NEW - 1 - 8 * (tree.depth + 1)).all()
    else:
        np.testing.assert_array_equal(out.rounds, base.rounds)
        np.testing.assert_array_equal(out.accept_hist, base.accept_hist)
        assert not np.asarray(out.plain_steps).any()


def test_fallback_resumes_where_the_drafts_top1_would_pay():
    """:meth:`Fallback.resumes` from the plain steps' depth-1 hits: the hit rate less one
    standard error, as a chain of depth + 1 tokens a round, against break-even; no hits seen
    never resumes."""
    fallback = eagle_mod.Fallback(break_even=1.7, probe_rounds=8)
    depth = 3

    def resumes(hits, seen):
        return bool(fallback.resumes(jnp.asarray(hits), jnp.asarray(seen), depth))

    def chain(h, n):  # written out: the rate less its standard error, then 1 + h + h^2 + h^3
        low = h - np.sqrt(h * (1 - h) / n)
        return 1 + low + low ** 2 + low ** 3

    assert chain(20 / 31, 31) >= 1.7 and resumes([20], [31])
    assert chain(14 / 31, 31) < 1.7 and not resumes([14], [31])
    # Rows pool: 2 x 31 positions at 0.5 is surer than 31 (and passes where 31 does not).
    assert chain(0.5, 62) >= 1.7 > chain(16 / 31, 31)
    assert resumes([15, 16], [31, 31]) and not resumes([16], [31])
    assert not resumes([0, 0], [0, 0])
    with pytest.raises(ValueError, match="resume_window"):
        eagle_mod.Fallback(break_even=1.7, resume_window=1)


@dataclasses.dataclass(frozen=True)
class _Flapping(eagle_mod.Fallback):
    """Gives up at every probe (break-even 50) and resumes at every catch-up."""

    def resumes(self, hits, seen, depth):
        return jnp.bool_(True)


# Rounds, plain steps, the draft's catch-up and rounds again, over and over.
FLAPS = dict(tree=TREES["wide"], fallback=_Flapping(50.0, probe_rounds=2, resume_window=5))


@pytest.fixture(scope="module")
def flapping_run(models, prompts):
    """``prompts`` decoded with FLAPS in one jitted call that also returns the caches:
    (the decoding, its tokens and lengths, the output, the caches)."""
    cfg, params, head = models
    spec, tokens, lengths = eagle_mod.eagle_decoding(
        cfg, head.serving(), *prompts, max_new_tokens=NEW, **FLAPS)
    run = driver.compile_run(spec, (params, head.serving()), tokens, lengths, keep=True)
    out, caches = run((params, head.serving()), tokens, lengths, jax.random.PRNGKey(0))
    return spec, tokens, lengths, out, caches


def test_fallback_that_resumes_stays_lossless_and_its_draft_caught_up(models, plain_greedy,
                                                                     flapping_run):
    """Rounds, plain steps, the draft's catch-up, rounds again, many times over: the output is
    plain greedy decoding's; each probe gives up after its own ``probe_rounds`` rounds; and the
    draft's cache at the end holds, entry for entry, what a fresh prefill of the whole sequence
    gives it (the catch-ups read the right taps at the right slots)."""
    cfg, params, head = models
    spec, tokens, lengths, out, caches = flapping_run
    np.testing.assert_array_equal(out.tokens, plain_greedy.tokens)
    rounds, resumes = np.asarray(out.rounds), np.asarray(out.resumes)
    assert (resumes >= 4).all() and (np.asarray(out.plain_steps) > 0).all()
    assert ((2 * resumes + 1 <= rounds) & (rounds <= 2 * resumes + 2)).all()
    hist = np.asarray(out.accept_hist)
    emitted = (hist * np.arange(hist.shape[1])).sum(1)
    np.testing.assert_array_equal(emitted + np.asarray(out.plain_steps),
                                  np.asarray(out.num_generated) - 1)
    # A fresh prefill of prompt + answer (but its last token) pairs tap f_s with x_{s+1}: every
    # row's in one batch, right-padded (a row's entries never see the padding after it).
    seqs = [np.concatenate([np.asarray(tokens[row, :int(lengths[row])]),
                            np.asarray(out.tokens[row, :int(out.num_generated[row]) - 1])])
            for row in range(tokens.shape[0])]
    fresh = driver.start(spec, (params, head.serving()), _right_padded(seqs),
                         jnp.asarray(list(map(len, seqs)), jnp.int32), jax.random.PRNGKey(0))
    draft_end = np.asarray(caches.draft_end)
    window = FLAPS["fallback"].resume_window  # entries the draft may not have read yet
    for row, seq in enumerate(seqs):
        n = len(seq) - 1  # entries whose next token the sequence holds
        assert n - window <= draft_end[row] <= n + 1
        n = min(n, int(draft_end[row]))
        np.testing.assert_allclose(caches.draft_k[row, :, :, :n], fresh.draft_k[row, :, :, :n],
                                   rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(caches.draft_v[row, :, :n], fresh.draft_v[row, :, :n],
                                   rtol=1e-4, atol=1e-4)


def test_fallback_streams_the_same_tokens(models, flapping_run):
    """Streamed, a decoding with a fallback (rounds; plain steps once it gives up drafting; the
    draft's catch-up; rounds again where it resumes) yields the tokens of the one jitted call,
    step by step."""
    cfg, params, head = models
    _, tokens, lengths, out, _ = flapping_run  # driver.run's loop, which also kept the caches
    assert (np.asarray(out.plain_steps) > 0).all() and (np.asarray(out.resumes) > 0).all()
    steps = list(eagle_mod.generate_eagle_stream(params, cfg, head, tokens, lengths,
                                                 max_new_tokens=NEW, **FLAPS))
    for row in range(len(LENGTHS)):
        streamed = np.concatenate([step[row] for step in steps])
        np.testing.assert_array_equal(streamed, np.asarray(out.tokens[row, :len(streamed)]))
        assert len(streamed) == int(out.num_generated[row])


def test_catch_up_counts_the_drafts_top1_hits_on_the_plain_steps_tokens(tiny_vocab_models):
    """The hits each catch-up hands :meth:`Fallback.resumes` are, over the last
    ``RESUME_SCORED`` of the plain steps' entries (tap f_s, token x_{s+1}) but the very last,
    those where the draft's top-1 is x_{s+2}: what a draft run fresh over the whole sequence
    predicts at those entries (its output at every entry). Small vocabularies, so a random draft
    hits often and a misaligned count would show."""
    cfg, params, head = tiny_vocab_models
    head = head.serving()
    tokens, lengths = _prompts([13, 6], cfg.vocab_size, seed=2)
    window = eagle_mod.RESUME_SCORED + 4  # entries before the scored ones, which are not
    spec, tokens, lengths = eagle_mod.eagle_decoding(
        cfg, head, tokens, lengths, max_new_tokens=130, tree=TREES["wide"],
        fallback=_Flapping(50.0, probe_rounds=2, resume_window=window))
    handed = []

    @dataclasses.dataclass(frozen=True)
    class Recording(eagle_mod.Fallback):
        def resumes(self, hits, seen, depth):  # notes what it was handed, as the jit runs
            jax.debug.callback(lambda h, s: handed.append((np.asarray(h), np.asarray(s))),
                               hits, seen, ordered=True)
            return jnp.bool_(True)

    recording = Recording(50.0)
    catch_up = jax.jit(eagle_mod._catch_up, static_argnums=(3, 4))
    catch_up_due = spec.phases[2][1]
    state = driver.start(spec, (params, head), tokens, lengths, jax.random.PRNGKey(0))
    windows = []  # (cache end, stale) at each catch-up
    while not bool(jnp.all(state.out.done)):
        if bool(catch_up_due(state)):
            windows.append((np.asarray(state.cache.end), np.asarray(state.stale)))
            state = catch_up(params, head, state, recording, spec.tree.depth)
        else:
            state = driver.advance(spec, (params, head), state)
    # What the last plain steps left (fewer entries than the scored ones) is read the same way.
    windows.append((np.asarray(state.cache.end), np.asarray(state.stale)))
    catch_up(params, head, state, recording, spec.tree.depth)
    jax.effects_barrier()  # every catch-up has handed over its counts
    assert len(handed) == len(windows)
    assert len(windows) >= 4 and 1 < windows[-1][1].min() <= eagle_mod.RESUME_SCORED
    seqs = [np.concatenate([np.asarray(tokens[row, :int(lengths[row])]),
                            np.asarray(state.out.tokens[row, :int(state.out.num_generated[row])])])
            for row in range(2)]
    # The draft fresh over each sequence but its last token, entry s reading token s + 1: both
    # rows in one batch, right-padded, with caches of just that many slots.
    inputs = _right_padded([seq[:-1] for seq in seqs])
    _, logits, _, _ = _from_scratch(params, head, inputs, _right_padded([seq[1:] for seq in seqs]),
                                    cfg=cfg, max_len=inputs.shape[1])
    top1s = np.asarray(head.vocab.draft_to_target)[np.argmax(np.asarray(logits), -1)]
    for row, seq in enumerate(seqs):
        top1 = top1s[row, :len(seq) - 1]
        for (end, stale), (hits, seen) in zip(windows, handed):
            first, last = end[row] - stale[row], end[row]  # entries first .. last - 1
            scored = range(max(first, last - 1 - eagle_mod.RESUME_SCORED), last - 1)
            want = sum(int(top1[e] == seq[e + 2]) for e in scored)
            assert (hits[row], seen[row]) == (want, len(scored)), (row, end, stale)
    total = sum(int(h.sum()) for h, _ in handed)
    assert 0 < total < sum(int(s.sum()) for _, s in handed)


def test_sampling_after_a_fallback_is_lossless(tiny_vocab_models, tiny_samples):
    """Round 1 drafts, then every step is plain: three sampled tokens (the prefill's, the
    round's, and a plain step's where the round accepted nothing) follow the exact joint."""
    cfg, params, head = tiny_vocab_models
    out = tiny_samples(SAMPLERS[0])
    assert np.asarray(out.plain_steps).sum() > SAMPLES // 4  # the plain step made many t3
    exact = _exact_joint(params, cfg, jnp.asarray(PROMPT, jnp.int32), SAMPLERS[0], k=3)
    assert _chi_square_pvalue(np.asarray(out.tokens), exact) > 1e-3


def test_sampling_after_a_resume_is_lossless():
    """Round 1 gives up, two plain steps, the draft's catch-up, and drafting resumes: where
    round 1 accepted nothing, the fifth token is the resumed round's. Five sampled tokens
    follow the exact joint (vocabulary 4: 1,024 cells)."""
    cfg, params, head = make_models(vocab=4, draft_vocab=4, seed=3, scale=0.5)
    prompt, samples = [1, 3, 2, 0, 3], 16000
    out = _sampled(cfg, params, head, prompt, samples, 5,
                   TreeConfig(tree_top_k=2, depth=2, total_tokens=5),
                   _Flapping(50.0, probe_rounds=1, resume_window=2), seed=2)
    resumed = (np.asarray(out.resumes) > 0) & (np.asarray(out.rounds) == 2)
    assert resumed.sum() > samples // 4, resumed.sum()  # many fifth tokens came from a resume
    exact = _exact_joint(params, cfg, jnp.asarray(prompt, jnp.int32), SAMPLERS[0], k=5)
    assert _chi_square_pvalue(np.asarray(out.tokens), exact) > 1e-3


def _target(cfg, params):
    """What the decoders read of a loaded target: config, weights, and the tokenizer's ids."""
    from types import SimpleNamespace

    return SimpleNamespace(cfg=cfg, params=params,
                           tokenizer=SimpleNamespace(eos_token_ids=(), pad_token_id=0))


@pytest.fixture(scope="module")
def compile_cache():
    """One cache of compiled generate functions for the decoders of the tests below: its keys
    hold everything static about a call (the decoding, shapes, keep, prefix), so a decoder of
    the same settings in another test reuses what an earlier one compiled."""
    from eagle3_jax.decoding.decoders import CompileCache

    return CompileCache()


@pytest.mark.parametrize("gives_up", [False, True], ids=["drafting", "after a fallback"])
def test_a_later_turn_starts_from_the_earlier_turns_caches(models, compile_cache, gives_up):
    """A chat's next prompt starts with the last prompt and (most of) its answer. Decoded from
    the caches the last call kept, plain and EAGLE decoding give exactly plain decoding's tokens
    from scratch, and EAGLE's draft sees what it sees from scratch (the same rounds and
    acceptance). The prefills skip the shared tokens: plain all of them, EAGLE one fewer (the
    draft entry before the new tokens pairs a tap with the next token, so it is redone), and
    after a fallback gave up drafting only what the draft had seen. The prompts diverge inside
    the answer, so the caches hold stale tokens past the shared ones."""
    from eagle3_jax.decoding.decoders import EagleDecoder, PlainDecoder
    from eagle3_jax.decoding.driver import GenerationError

    cfg, params, head = models
    target = _target(cfg, params)
    fallback = (lambda width, batch: eagle_mod.Fallback(50.0, probe_rounds=4)) if gives_up \
        else None
    plain = PlainDecoder(target, SamplingParams(), 20, 0, compile_cache=compile_cache)
    eagle = EagleDecoder(target, SamplingParams(), 20, 0, head=head, tree=TREES["wide"],
                         fallback=fallback, compile_cache=compile_cache)
    rng = np.random.default_rng(1)
    # Both turns pad to 64 prompt slots, and every call without a prefix keeps its caches (as
    # a chat's turns before the last do): those calls run one program per decoder, the calls
    # from a prefix (the chat's last turn, which keeps nothing) another.
    first = [rng.integers(1, cfg.vocab_size, n).tolist() for n in (13, 40)]
    turn1 = {d.name: d.generate_batch(first, keep=True) for d in (plain, eagle)}
    assert [g.token_ids for g in turn1["eagle"]] == [g.token_ids for g in turn1["vanilla"]]
    kept = 17  # answer tokens the next prompt keeps; then it goes its own way
    second = [p + g.token_ids[:kept] + rng.integers(1, cfg.vocab_size, 7).tolist()
              for p, g in zip(first, turn1["vanilla"])]
    want = plain.generate_batch(second, keep=True)
    fresh = eagle.generate_batch(second, keep=True)
    for d in (plain, eagle):
        got = d.generate_batch(second, prefixes=[g.prefix for g in turn1[d.name]])
        assert [g.token_ids for g in got] == [g.token_ids for g in want], d.name
        for p, g1, g2, g0 in zip(first, turn1[d.name], got, fresh):
            shared = len(p) + kept
            if d is plain:
                assert g2.reused == shared
                continue
            assert (g2.rounds, g2.accept_hist, g2.plain_steps) == \
                (g0.rounds, g0.accept_hist, g0.plain_steps)
            if not gives_up:
                assert g2.reused == shared - 1
            else:  # 4 rounds drafted before it gave up, then plain steps the draft never saw
                assert g1.plain_steps > 0
                assert len(p) + 4 <= g2.reused == len(g1.prefix.token_ids) - 1 < shared - 1
    # Rows whose prefix is another decoder's, or absent, start afresh; the count must match.
    mixed = eagle.generate_batch(second, prefixes=[turn1["vanilla"][0].prefix, None],
                                 keep=True)
    assert [g.token_ids for g in mixed] == [g.token_ids for g in want]
    assert [g.reused for g in mixed] == [0, 0]
    with pytest.raises(GenerationError, match="one \\(or None\\) per prompt"):
        plain.generate_batch(second, prefixes=[None])


def test_eagle_prefill_after_a_prefix_matches_a_fresh_prefill(models):
    """EAGLE's prefill from the caches an earlier prefill left (each row shares ``common``
    leading tokens with it, one row all of them) against one from scratch: the first token's
    draft state (root feature and log-probs) and both caches over the prompt agree to float32
    round-off. Only :meth:`EagleDecoding.reuse_start`'s tokens are reused: the draft entry
    before the first new token pairs a tap with that token, so it must be redone."""
    from eagle3_jax.decoding.eagle import eagle_decoding

    cfg, params, head = models
    head = head.serving()
    rng = np.random.default_rng(4)
    lengths1, common = [20, 26], [12, 26]
    # Both calls' prompts padded to 48 slots: one decoding, whose prefill (jitted) makes the
    # first call's caches and the reference from scratch.
    first = rng.integers(1, cfg.vocab_size, (2, 48))
    second = rng.integers(1, cfg.vocab_size, (2, 48))
    for i, n in enumerate(common):
        second[i, :n] = first[i, :n]
    lengths2 = np.array([30, 33])
    key = jax.random.key(0)
    spec1, tok1, len1 = eagle_decoding(cfg, head, first, np.array(lengths1), max_new_tokens=8,
                                       tree=TREES["wide"])
    caches = spec1.reusable(driver.start(spec1, (params, head), tok1, len1, key))
    spec2, tok2, len2 = eagle_decoding(cfg, head, second, lengths2, max_new_tokens=8,
                                       tree=TREES["wide"])
    starts = [spec2.reuse_start(n, int(m)) for n, m in zip(common, lengths2)]
    assert starts == [11, 25]
    prefix = driver.Prefix(caches, jnp.asarray(starts, jnp.int32))
    got = driver.start(spec2, (params, head), tok2, len2, key, prefix)
    want = driver.start(spec2, (params, head), tok2, len2, key)

    def close(a, b):  # float32 round-off follows the size of the terms summed into an entry
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))

    close(got.root_logp, want.root_logp)
    close(got.root_h, want.root_h)
    np.testing.assert_array_equal(got.root, want.root)
    for i, n in enumerate(lengths2):
        close(got.draft_k[i, ..., :n], want.draft_k[i, ..., :n])
        close(got.draft_v[i, :, :n], want.draft_v[i, :, :n])
        close(got.cache.v[-1][i, :, :n], want.cache.v[-1][i, :, :n])


def test_a_streamed_turn_keeps_its_caches_for_the_next(models, compile_cache):
    """The chat path streams: a reader that stops after a few steps (a stop string) still gets
    the caches as far as they ran (``stream_prefix``), and the next turn streamed from them is
    plain decoding's answer from scratch, with the shared tokens skipped."""
    from eagle3_jax.decoding.decoders import EagleDecoder, PlainDecoder

    cfg, params, head = models
    target = _target(cfg, params)
    plain = PlainDecoder(target, SamplingParams(), 20, 0, compile_cache=compile_cache)
    eagle = EagleDecoder(target, SamplingParams(), 20, 0, head=head, tree=TREES["wide"],
                         compile_cache=compile_cache)
    # 17 tokens: this prompt and the next turn's (at most 32) pad to the same 32 slots, so
    # each decoder's steps run one program for both turns.
    first = np.random.default_rng(2).integers(1, cfg.vocab_size, 17).tolist()
    for d in (plain, eagle):
        seen = []
        for i, tokens in enumerate(d.stream(first)):
            seen += tokens
            if i == 3:
                break
        prefix = d.stream_prefix()
        held = prefix.token_ids
        assert held == (first + seen)[:len(held)] and len(held) >= len(first) + len(seen) - 1
        second = first + seen + [5, 6, 7]
        want = [t for step in plain.stream(second) for t in step]  # plain, from scratch
        assert [t for step in d.stream(second, prefix) for t in step] == want, d.name
        shared = len(first) + len(seen) - 1  # the last token seen was never fed
        assert d.stream_reused == [shared if d is plain else shared - 1]


# Last in the file: it clears the compiled decoders, which the tests before it share.
def test_chi_square_catches_a_biased_acceptance_rule(tiny_vocab_models, monkeypatch):
    """test_sampling_is_lossless's run and check, with a biased acceptance rule: it fails."""
    cfg, params, head = tiny_vocab_models
    sampling = SAMPLERS[0]
    monkeypatch.setattr(eagle_mod, "accept", _biased_accept)
    driver._loop_jit.clear_cache()
    try:
        out = _sampled(cfg, params, head, PROMPT, SAMPLES, **AFTER_ROUND_1, sampling=sampling)
    finally:
        driver._loop_jit.clear_cache()
    pairs = np.asarray(out.tokens)[:, :2]
    exact = _exact_joint(params, cfg, jnp.asarray(PROMPT, jnp.int32), sampling)
    assert _chi_square_pvalue(pairs, exact) < 1e-6
