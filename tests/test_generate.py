"""Plain generation: greedy equals a no-cache reference, stop rules, sampling, streaming, HF parity.

The tiny-model tests use random parameters (``init_params``) with a small vocabulary; the
reference recomputes the full forward over the growing sequence without a KV cache, so any bug in
cache writes, cache ends, positions or masks shows up as a token mismatch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
)

from eagle3_jax.decoding import (
    SamplingError, SamplingParams, adjust_logits, bucket, generate, generate_stream, pad_prompts,
    probs, sample,
)
from eagle3_jax.model.config import TargetConfig
from eagle3_jax.model.params import init_params, to_serving
from eagle3_jax.model.target import forward

CFG = TargetConfig(arch="llama", vocab_size=61, hidden_size=32, intermediate_size=64,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                   max_position_embeddings=128)
PROMPTS = [[3, 14, 15, 9, 26, 5], [7, 8], [11] * 19]
N = 12
REF_WIDTH = 48  # fixed width of the reference forward: one compilation for every length


@pytest.fixture(scope="module")
def params():
    # scale 0.3: logits spread widely enough that greedy has no near-ties.
    return to_serving(init_params(CFG, jax.random.PRNGKey(0), scale=0.3), CFG)  # decoders' layout


@jax.jit
def _last_logits(params, tokens, length):
    """No-cache forward over tokens [1, W]; logits [V] at position length - 1."""
    w = tokens.shape[1]
    mask = jnp.tril(jnp.ones((w, w), bool))[None]
    out = forward(params, CFG, tokens, jnp.arange(w)[None], mask)
    return out.logits[0, length - 1]


def reference_greedy(params, prompt, n, eos=()):
    seq = list(prompt)
    for _ in range(n):
        tokens = np.zeros((1, REF_WIDTH), np.int32)
        tokens[0, : len(seq)] = seq
        token = int(jnp.argmax(_last_logits(params, tokens, len(seq))))
        if token in eos:
            break
        seq.append(token)
    return seq[len(prompt):]


def row(out, i):
    return np.asarray(out.tokens[i, : int(out.num_generated[i])]).tolist()


@pytest.fixture(scope="module")
def greedy_batch(params):
    batch = pad_prompts(PROMPTS)
    return generate(params, CFG, batch.tokens, batch.lengths, max_new_tokens=N)


def test_greedy_batch_matches_no_cache_reference(params, greedy_batch):
    out = greedy_batch
    assert out.tokens.shape == (4, N)  # 3 prompts padded to a batch of 4
    for i, prompt in enumerate(PROMPTS):
        assert row(out, i) == reference_greedy(params, prompt, N), f"row {i}"
    # The padding row generates nothing.
    assert int(out.num_generated[3]) == 0 and (np.asarray(out.tokens[3]) == -1).all()
    # Each row alone (batch 1) gives the same tokens as in the batch.
    for i, prompt in enumerate(PROMPTS):
        single = pad_prompts([prompt], pad_batch=False)
        alone = generate(params, CFG, single.tokens, single.lengths, max_new_tokens=N)
        assert row(alone, 0) == row(out, i)


def test_eos_stops_its_row_and_others_continue(params, greedy_batch):
    rows = [row(greedy_batch, i) for i in range(3)]
    # An EOS that row 0 samples mid-way and row 1 never samples.
    eos = next(t for t in rows[0][2:] if t not in rows[1])
    batch = pad_prompts(PROMPTS)
    out = generate(params, CFG, batch.tokens, batch.lengths, max_new_tokens=N,
                   eos_token_ids=(eos, 10_000))
    for i, prompt in enumerate(PROMPTS):
        expected = rows[i][: rows[i].index(eos)] if eos in rows[i] else rows[i]
        assert row(out, i) == expected
        assert bool(out.hit_eos[i]) == (eos in rows[i])
        assert (np.asarray(out.tokens[i, len(expected):]) == -1).all()  # EOS not in the output
    assert int(out.num_generated[1]) == N
    assert int(out.num_generated[0]) < N


def test_max_new_tokens_and_full_cache(params, greedy_batch):
    batch = pad_prompts(PROMPTS)
    out = generate(params, CFG, batch.tokens, batch.lengths, max_new_tokens=3)
    assert out.tokens.shape == (4, 3)
    for i in range(3):
        assert row(out, i) == row(greedy_batch, i)[:3]
    # A 24-slot cache holds prompt + generated tokens; the last token need not be fed back,
    # so a row of length L yields 24 - L + 1 tokens before it stops.
    out = generate(params, CFG, batch.tokens, batch.lengths, max_new_tokens=N, max_len=24)
    for i, prompt in enumerate(PROMPTS):
        expected = row(greedy_batch, i)[: 24 - len(prompt) + 1]
        assert row(out, i) == expected and not bool(out.hit_eos[i])


def test_prompt_longer_than_context_is_a_clear_error(params):
    long = np.zeros((1, 130), np.int32)
    with pytest.raises(ValueError, match="130 tokens is longer than the model context of 128"):
        generate(params, CFG, long, np.array([130]), max_new_tokens=4)
    with pytest.raises(ValueError, match="model context is 128"):
        pad_prompts([[1] * 130], max_length=128)
    # Prompt + new tokens beyond the context: the cache is capped at the context.
    out = generate(params, CFG, np.ones((1, 120), np.int32), np.array([120]), max_new_tokens=50)
    assert int(out.num_generated[0]) == 128 - 120 + 1
    with pytest.raises(ValueError, match="raise max_len"):
        generate(params, CFG, np.zeros((1, 32), np.int32), np.array([20]), max_new_tokens=4,
                 max_len=16)


def test_sampling_reproducible_and_top_k_1_is_greedy(params, greedy_batch):
    batch = pad_prompts(PROMPTS)
    hot = SamplingParams(temperature=1.5, top_p=0.95)
    kwargs = dict(max_new_tokens=N, sampling=hot)
    a = generate(params, CFG, batch.tokens, batch.lengths, key=jax.random.PRNGKey(7), **kwargs)
    b = generate(params, CFG, batch.tokens, batch.lengths, key=jax.random.PRNGKey(7), **kwargs)
    c = generate(params, CFG, batch.tokens, batch.lengths, key=jax.random.PRNGKey(8), **kwargs)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert not np.array_equal(a.tokens, c.tokens)
    top1 = SamplingParams(temperature=1.0, top_k=1)
    d = generate(params, CFG, batch.tokens, batch.lengths, max_new_tokens=N, sampling=top1,
                 key=jax.random.PRNGKey(3))
    np.testing.assert_array_equal(d.tokens, greedy_batch.tokens)


def test_stream_yields_the_same_tokens_as_generate(params):
    batch = pad_prompts(PROMPTS)
    kwargs = dict(max_new_tokens=N, sampling=SamplingParams(temperature=1.0, top_k=20),
                  key=jax.random.PRNGKey(5), eos_token_ids=(4,))
    out = generate(params, CFG, batch.tokens, batch.lengths, **kwargs)
    steps = list(generate_stream(params, CFG, batch.tokens, batch.lengths, **kwargs))
    assert len(steps) == int(out.steps) + 1  # prefill + each decode step
    for i in range(4):
        streamed = [int(s[i]) for s in steps if s[i] >= 0]
        assert streamed == row(out, i)


def test_first_token_frequencies_match_adjusted_softmax(params):
    # 2048 copies of one prompt in one batch: each row draws its first token independently.
    sampling = SamplingParams(temperature=0.7, top_k=12, top_p=0.9)
    rows = 2048
    tokens = np.tile(np.array([PROMPTS[0] + [0] * 10], np.int32), (rows, 1))
    lengths = np.full((rows,), len(PROMPTS[0]), np.int32)
    out = generate(params, CFG, tokens, lengths, max_new_tokens=1, sampling=sampling,
                   key=jax.random.PRNGKey(11), max_len=16)
    first = np.asarray(out.tokens[:, 0])
    ref_tokens = np.zeros((1, REF_WIDTH), np.int32)
    ref_tokens[0, : len(PROMPTS[0])] = PROMPTS[0]
    logits = _last_logits(params, ref_tokens, len(PROMPTS[0]))
    expected = np.asarray(probs(logits[None], sampling))[0]
    kept = expected > 0
    assert 2 <= kept.sum() <= 12
    counts = np.bincount(first, minlength=CFG.vocab_size)
    assert counts[~kept].sum() == 0, "sampled a token that top-k/top-p removed"
    expected = expected.astype(np.float64)
    expected /= expected[kept].sum()  # float32 rounding: totals must match for chisquare
    stat, pvalue = scipy.stats.chisquare(counts[kept], expected[kept] * rows)
    assert pvalue > 1e-3, (counts[kept], expected[kept] * rows)


# ---------------------------------------------------------------- sampling rules against HF


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.8), (0.6, 7, 0.9), (1.3, 40, 0.5),
    (1.0, 0, 0.05),
])
def test_adjust_logits_matches_hf_warpers(temperature, top_k, top_p):
    logits = np.random.default_rng(0).normal(size=(6, 50)).astype(np.float32) * 2.0
    scores = torch.from_numpy(logits.copy())
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    expected = scores.numpy()
    got = np.asarray(adjust_logits(jnp.asarray(logits), SamplingParams(temperature, top_p, top_k)))
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-6, atol=1e-6)


def test_greedy_probs_are_one_hot_and_sample_is_argmax():
    logits = jax.random.normal(jax.random.PRNGKey(0), (3, 17))
    p = probs(logits, SamplingParams())
    np.testing.assert_array_equal(np.asarray(p), np.eye(17)[np.asarray(jnp.argmax(logits, -1))])
    np.testing.assert_array_equal(sample(jax.random.PRNGKey(1), logits, SamplingParams()),
                                  jnp.argmax(logits, -1))


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1.0), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(top_k=2.5), "top_k"),
])
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(SamplingError, match=match):
        SamplingParams(**kwargs)


def test_pad_prompts_buckets():
    assert [bucket(n) for n in (1, 16, 17, 33, 100)] == [16, 16, 32, 64, 128]
    assert bucket(90, 16, maximum=96) == bucket(200, 16, maximum=96) == 96
    batch = pad_prompts([[1, 2, 3], [4] * 20, [5]], pad_id=9)
    assert batch.tokens.shape == (4, 32) and batch.tokens.dtype == np.int32
    assert batch.lengths.tolist() == [3, 20, 1, 0] and batch.num_prompts == 3
    assert batch.tokens[0].tolist() == [1, 2, 3] + [9] * 29
    with pytest.raises(ValueError, match="empty"):
        pad_prompts([[1], []])


# ---------------------------------------------------------------- the real SmolLM2


def _fixture_or_skip(request, name):
    try:
        return request.getfixturevalue(name)
    except pytest.FixtureLookupError:
        pytest.skip(f"fixture {name!r} is not available")


# Prompts of different lengths (42, 37, 40 tokens) whose greedy answers run past 48 tokens.
CHATS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a car engine works.",
    "Explain in two sentences why the sky is blue.",
]


@pytest.mark.slow
def test_greedy_matches_transformers_on_smollm2(request):
    hf = _fixture_or_skip(request, "hf_smollm2")
    from eagle3_jax.checkpoints import load_target

    target = load_target(None, dtype="float32")
    tok = target.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    batch = pad_prompts(prompts, pad_id=tok.pad_token_id or 0,
                        max_length=target.cfg.max_position_embeddings)
    n = 48
    out = generate(target.params, target.cfg, batch.tokens, batch.lengths, max_new_tokens=n,
                   eos_token_ids=tok.eos_token_ids)
    # One torch thread: on a loaded 2-core machine two threads spin against each other and
    # generation gets ~10x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = [_hf_greedy(hf, prompt, n, tok.eos_token_ids) for prompt in prompts]
    finally:
        torch.set_num_threads(threads)
    for i in range(len(prompts)):
        assert len(expected[i]) == n
        assert row(out, i) == expected[i], f"prompt {i}: {tok.decode(row(out, i))!r}"


def _hf_greedy(hf, prompt, n, eos_token_ids):
    """transformers' greedy continuation of one prompt, EOS stripped."""
    with torch.no_grad():
        ids = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                          dtype=torch.long), do_sample=False, max_new_tokens=n,
                          eos_token_id=list(eos_token_ids), pad_token_id=0)
    expected = ids[0, len(prompt):].tolist()
    while expected and expected[-1] in eos_token_ids:
        expected.pop()
    return expected


def test_bench_decode_loop_is_greedy_decoding(params):
    """``bench forward`` times ``decode_loop`` as plain decoding's inner loop: it must decode
    exactly what greedy decoding decodes, and leave the cache end where it started."""
    from eagle3_jax.decoding.costs import decode_loop
    from eagle3_jax.model.target import prefill

    prompt = PROMPTS[0]
    want = reference_greedy(params, prompt, N)
    p = len(prompt)
    serving = to_serving(params, CFG)
    out = prefill(serving, CFG, jnp.asarray([prompt]), jnp.array([p]), 32)
    first = jnp.argmax(out.logits[:, -1:], axis=-1).astype(jnp.int32)  # [1, 1]
    assert int(first[0, 0]) == want[0]
    last, cache = decode_loop(serving, out.cache, first, CFG, N - 1)
    assert int(last[0, 0]) == want[N - 1]
    assert int(cache.end[0]) == p


def test_chunked_prefill_matches_one_forward(params):
    """A prefill run as forwards of 16 tokens in a while_loop against one forward over the
    padded width: the same logits, final hidden state, cache (every slot below each row's
    length) and taps to float32 round-off. The loop stops after the chunk holding the longest
    row's last token: the 64-slot bucket's last chunk never runs (its taps stay zero, its cache
    slots empty), where the one forward computed them."""
    from eagle3_jax.model.target import prefill

    lengths = np.array([37, 5, 0, 20], np.int32)  # a batch-padding row of length 0
    tokens = np.array(jax.random.randint(jax.random.key(4), (4, 64), 1, CFG.vocab_size))
    tokens[np.arange(64)[None, :] >= lengths[:, None]] = 0
    taps = (0, 1)
    one = prefill(params, CFG, jnp.asarray(tokens), jnp.asarray(lengths), 80, tap_layers=taps,
                  chunk=None)
    chunked = jax.jit(lambda t, n: prefill(params, CFG, t, n, 80, tap_layers=taps, chunk=16))(
        jnp.asarray(tokens), jnp.asarray(lengths))
    close = dict(rtol=1e-5, atol=1e-5)
    real = lengths > 0
    np.testing.assert_allclose(chunked.logits[real], one.logits[real], **close)
    np.testing.assert_allclose(chunked.hidden[real], one.hidden[real], **close)
    assert chunked.logits.shape == (4, 1, CFG.vocab_size)
    assert chunked.hidden.shape == one.hidden.shape == (4, 1, CFG.hidden_size)
    np.testing.assert_array_equal(chunked.cache.end, lengths)
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(chunked.taps[i, :n], one.taps[i, :n], **close)
        for k1, kc, v1, vc in zip(one.cache.k, chunked.cache.k, one.cache.v, chunked.cache.v):
            np.testing.assert_allclose(kc[i, ..., :n], k1[i, ..., :n], **close)
            np.testing.assert_allclose(vc[i, :, :n], v1[i, :, :n], **close)
    # 37 tokens: chunks [0, 16), [16, 32), [32, 48) ran, [48, 64) did not.
    assert not np.asarray(chunked.taps[:, 48:]).any() and np.asarray(one.taps[:, 48:]).any()
    assert not np.asarray(chunked.cache.v[0][:, :, 48:]).any()
    assert np.asarray(chunked.cache.v[0][0, :, 32:48]).any()


@pytest.mark.parametrize("chunk", [None, 16])
def test_prefill_after_a_prefix_matches_a_fresh_prefill(params, chunk):
    """A cache that holds each row's first ``start`` tokens (an earlier, shorter prefill, grown
    to the new size as the decoders grow an earlier turn's cache) and a prefill of the rest: the
    same logits, final hidden state, cache below each row's length and taps from ``start`` on
    as a prefill from scratch, to float32 round-off; the taps before ``start`` are not
    computed (zeros). Starts differ per row, one at the row's last token."""
    from eagle3_jax.model.target import prefill

    lengths = np.array([37, 6, 21, 9], np.int32)
    starts = np.array([20, 5, 3, 0], np.int32)
    tokens = np.array(jax.random.randint(jax.random.key(5), (4, 64), 1, CFG.vocab_size))
    tokens[np.arange(64)[None, :] >= lengths[:, None]] = 0
    taps = (0, 1)
    fresh = prefill(params, CFG, jnp.asarray(tokens), jnp.asarray(lengths), 96, tap_layers=taps,
                    chunk=None)
    earlier = prefill(params, CFG, jnp.asarray(tokens[:, :32]), jnp.asarray(starts), 48)
    prefix = earlier.cache.resized(96)
    assert prefix.max_len == 96 and earlier.cache.resized(40).max_len == 40
    out = jax.jit(lambda t, n, c: prefill(params, CFG, t, n, 96, tap_layers=taps, chunk=chunk,
                                          prefix=c))(
        jnp.asarray(tokens), jnp.asarray(lengths), prefix)
    close = dict(rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.logits, fresh.logits, **close)
    np.testing.assert_allclose(out.hidden, fresh.hidden, **close)
    np.testing.assert_array_equal(out.cache.end, lengths)
    # The taps are residual streams (entries up to ~20 here); an entry's round-off follows the
    # size of the terms summed into it, not its own (possibly cancelled) size.
    taps_close = dict(rtol=1e-5, atol=1e-5 * float(np.abs(fresh.taps).max()))
    for i, (n, s) in enumerate(zip(lengths, starts)):
        np.testing.assert_allclose(out.taps[i, s:n], fresh.taps[i, s:n], **taps_close)
        assert not np.asarray(out.taps[i, :s]).any()
        for k1, kc, v1, vc in zip(fresh.cache.k, out.cache.k, fresh.cache.v, out.cache.v):
            np.testing.assert_allclose(kc[i, ..., :n], k1[i, ..., :n], **close)
            np.testing.assert_allclose(vc[i, :, :n], v1[i, :, :n], **close)
    with pytest.raises(ValueError, match="slots"):
        prefill(params, CFG, jnp.asarray(tokens), jnp.asarray(lengths), 96, prefix=earlier.cache)


def test_greedy_after_a_chunked_prefill_matches_the_reference(params, monkeypatch):
    """Decoding as the decoders run it, with the prefill policy set to chunks of 16 (on CPU
    with the kernels it picks ``PREFILL_CHUNK``; this model is too small for them), equals the
    no-cache reference."""
    import eagle3_jax.model.target as target

    widths = []

    def chunks_of_16(cfg, width):
        widths.append(width)
        return 16 if width > 16 else None

    monkeypatch.setattr(target, "prefill_chunk", chunks_of_16)
    prompts = [list(range(1, 36)), [5, 6, 7], [9, 2] * 10]
    batch = pad_prompts(prompts)
    assert batch.tokens.shape[1] == 64
    out = generate(params, CFG, batch.tokens, batch.lengths, max_new_tokens=N + 1)
    assert 64 in widths  # traced with this policy, not served from an earlier compilation
    for i, prompt in enumerate(prompts):
        assert row(out, i) == reference_greedy(params, prompt, N + 1), f"row {i}"


def test_prefill_chunks_only_where_the_cpu_kernels_run():
    """The policy: chunks of ``PREFILL_CHUNK`` for float32 on CPU with the kernels, one forward
    for a width of one chunk, for bfloat16, a head size the attention kernel does not take, and
    with the kernels switched off."""
    import dataclasses

    from eagle3_jax.kernels.library import kernel_available, set_kernel_enabled
    from eagle3_jax.model.target import PREFILL_CHUNK, prefill_chunk

    if not kernel_available():
        pytest.skip("the CPU kernel library is not built here")
    cfg = dataclasses.replace(CFG, dtype="float32", num_heads=2, num_kv_heads=1, head_dim=16)
    assert prefill_chunk(cfg, 512) == PREFILL_CHUNK == 32
    assert prefill_chunk(cfg, PREFILL_CHUNK) is None
    assert prefill_chunk(dataclasses.replace(cfg, dtype="bfloat16"), 512) is None
    assert prefill_chunk(CFG, 512) is None  # head dim 8: no attention kernel
    set_kernel_enabled(False)
    try:
        assert prefill_chunk(cfg, 512) is None
    finally:
        set_kernel_enabled(None)


def test_greedy_argmax_is_the_first_index_of_the_maximum():
    """The two-reduction argmax used for greedy decoding against numpy's, with ties (the lowest
    index wins), -inf entries and several leading axes."""
    from eagle3_jax.decoding.sampling import greedy_argmax

    rng = np.random.default_rng(5)
    logits = rng.integers(-3, 4, size=(3, 5, 200)).astype(np.float32)  # many ties
    logits[0, 0, :] = -np.inf
    logits[0, 0, 7] = 2.0
    logits[1, 2, :] = -np.inf  # all -inf: index 0, as argmax
    got = np.asarray(jax.jit(greedy_argmax)(jnp.asarray(logits)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))
    wide = rng.standard_normal((4, 49152)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(greedy_argmax(jnp.asarray(wide))),
                                  np.argmax(wide, axis=-1))
    # Read in chunks of 256 (49152) or 8 (200 above), or whole (199: no chunk divides it); ties
    # across chunks and within the first chunk holding the top.
    for vocab in (49152, 199):
        ties = rng.integers(-40, 3, size=(2, 3, vocab)).astype(np.float32)
        ties[1, 1, vocab - 1] = 9.0  # the top in the last chunk only
        got = np.asarray(jax.jit(greedy_argmax)(jnp.asarray(ties)))
        np.testing.assert_array_equal(got, np.argmax(ties, axis=-1))
