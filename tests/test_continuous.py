"""Continuous batching: every answer equals plain greedy decoding of its prompt alone, whatever
the slot it ran in, the prompts decoded beside it and when it was refilled; prompts added while
running (the next turn) are served; bad prompts are refused."""

import collections

import jax
import numpy as np
import pytest

from eagle3_jax.decoding import generate
from eagle3_jax.decoding.continuous import ContinuousDecoder
from eagle3_jax.decoding.driver import GenerationError
from eagle3_jax.model.config import TargetConfig
from eagle3_jax.model.params import init_params, to_serving

CFG = TargetConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                   num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                   max_position_embeddings=256)
N = 24


@pytest.fixture(scope="module")
def params():
    return to_serving(init_params(CFG, jax.random.key(0), scale=0.3), CFG)


def _prompts(count=9, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, CFG.vocab_size, int(rng.integers(1, 40))).tolist()
            for _ in range(count)]


def _alone(params, prompt, eos):
    """Plain greedy decoding of ``prompt`` as a batch of one (padded to 48: one compilation)."""
    tokens = np.zeros((1, 48), np.int32)
    tokens[0, :len(prompt)] = prompt
    out = generate(params, CFG, tokens, np.asarray([len(prompt)]), max_new_tokens=N,
                   eos_token_ids=eos)
    return np.asarray(out.tokens[0, :int(out.num_generated[0])]).tolist(), bool(out.hit_eos[0])


def _an_eos(params, prompts):
    """A token that plain decoding emits mid-answer for some prompts: rows end unevenly."""
    counts = collections.Counter()
    for p in prompts:
        counts.update(set(_alone(params, p, ())[0][2:N - 4]))
    return counts.most_common(1)[0][0]


def test_every_answer_equals_its_prompt_decoded_alone(params):
    prompts = _prompts()
    prompts = [min(prompts, key=len)] + prompts  # the cache grows while rows are live
    eos = (_an_eos(params, prompts),)
    decoder = ContinuousDecoder(params, CFG, slots=3, max_new_tokens=N, max_prompt_len=48,
                                eos_token_ids=eos, steps_per_call=5)
    first_cache = decoder._cache_len(len(prompts[0]))
    got = {f.job: f for f in decoder.run(enumerate(prompts))}
    assert decoder.spec.max_len > first_cache
    assert sorted(got) == list(range(len(prompts)))
    lengths = set()
    for i, p in enumerate(prompts):
        want, hit = _alone(params, p, eos)
        assert got[i].tokens == want, i
        assert got[i].hit_eos == hit
        lengths.add(len(want))
    assert len(lengths) > 2  # answers of different lengths: slots were refilled mid-run


def test_prompts_added_while_running_are_served(params):
    """A second turn built from the first answer goes into the same queue."""
    prompts = _prompts(4, seed=1)
    decoder = ContinuousDecoder(params, CFG, slots=2, max_new_tokens=8, max_prompt_len=64,
                                steps_per_call=3)
    queue = collections.deque(((i, 0), p) for i, p in enumerate(prompts))
    answers = {}
    for f in decoder.run(queue):
        answers[f.job] = f.tokens
        i, turn = f.job
        if turn == 0:
            queue.append(((i, 1), prompts[i] + f.tokens + [5, 6]))
    assert sorted(answers) == sorted((i, t) for i in range(4) for t in (0, 1))
    for i, p in enumerate(prompts):
        second = p + answers[i, 0] + [5, 6]
        tokens = np.zeros((1, 64), np.int32)
        tokens[0, :len(second)] = second
        out = generate(params, CFG, tokens, np.asarray([len(second)]), max_new_tokens=8)
        assert answers[i, 1] == np.asarray(out.tokens[0]).tolist()


def test_bad_prompts_and_settings_are_refused(params):
    decoder = ContinuousDecoder(params, CFG, slots=2, max_new_tokens=4, max_prompt_len=8)
    with pytest.raises(GenerationError, match="max_prompt_len=8"):
        list(decoder.run([("long", list(range(1, 10)))]))
    with pytest.raises(GenerationError, match="1 to"):
        list(decoder.run([("empty", [])]))
    with pytest.raises(GenerationError, match="must be positive"):
        ContinuousDecoder(params, CFG, slots=0, max_new_tokens=4, max_prompt_len=8)
