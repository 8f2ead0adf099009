"""Each model family beyond the dense Llama / Qwen ones, end to end on a small random target of
that family: Gemma 3 (local layers with a window of 8), Qwen3-MoE and Mixtral (with a window of
8 on every layer, as Mistral v0.1's).

- Greedy decoding with the KV cache (a batch of two prompts of different lengths, both longer
  than the window of 8) equals transformers' greedy generation of each prompt, and every token
  is the argmax of transformers' forward over the whole sequence without a cache.
- An EAGLE-3 head trains on the target's own greedy answers (the loss falls; a run stopped half-way and resumed gives
  the same losses bit for bit), exports in the SGLang / SpecForge layout, loads back, and EAGLE
  decoding with it (a chain and a wide tree, batch 2) equals plain greedy decoding.

The targets come from transformers (tests/hf_reference.py: random weights at O(1) activations)
through ``hf_to_param``, as a checkpoint would.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from eagle3_jax.decoding import generate
from eagle3_jax.decoding.eagle import generate_eagle
from eagle3_jax.decoding.tree import TreeConfig
from eagle3_jax.draft.export import export_draft_head, load_draft_head
from eagle3_jax.draft.load import read_run_head
from eagle3_jax.kernels.library import kernels_in_use
from eagle3_jax.model.params import to_serving
from eagle3_jax.model.target import PREFILL_CHUNK, prefill_chunk
from eagle3_jax.train.config import OptimizerConfig, TrainConfig
from eagle3_jax.train.loop import TargetOverride, train
from hf_reference import tiny_hf_model

pytestmark = pytest.mark.slow  # end to end: training, export and EAGLE decoding, a family a test

# head_dim 16, so that on CPU the cached-attention kernel runs the decode steps and the prefill
# runs in chunks (eagle3_jax.model.target.prefill_chunk): the window masks reach both.
FAMILIES = {
    "gemma3": ("gemma3", dict(head_dim=16)),
    "qwen3_moe": ("qwen3_moe", dict(head_dim=16)),
    "mixtral_window": ("mixtral", dict(sliding_window=8, head_dim=16)),
}
LENGTHS, WIDTH, NEW = (13, 45), 64, 12
STEPS = 8


@functools.lru_cache(maxsize=None)
def family(name: str):
    """(hf_model, cfg, stacked params, serving params) of a family's small random target."""
    arch, overrides = FAMILIES[name]
    model, cfg, params = tiny_hf_model(arch, seed=11, **overrides)
    return model, cfg, params, to_serving(params, cfg)


def prompts(vocab: int):
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, vocab, (len(LENGTHS), WIDTH))
    for i, n in enumerate(LENGTHS):
        tokens[i, n:] = 0
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(LENGTHS, jnp.int32)


@functools.lru_cache(maxsize=None)
def plain_greedy(name: str):
    """Greedy decoding of :func:`prompts`, NEW tokens: the reference of the EAGLE runs."""
    _, cfg, _, serving = family(name)
    return generate(serving, cfg, *prompts(cfg.vocab_size), max_new_tokens=NEW)


@torch.no_grad()
def hf_greedy(model, prompt: np.ndarray, n: int) -> list[int]:
    """transformers' greedy generation with its KV cache (no stop token)."""
    out = model.generate(torch.as_tensor(prompt[None]), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0, use_cache=True)
    return out[0, len(prompt):].tolist()


def check_greedy_equals_transformers(name):
    model, cfg, _, _ = family(name)
    assert cfg.sliding_window is None or cfg.sliding_window < min(LENGTHS)
    assert prefill_chunk(cfg, WIDTH) == (PREFILL_CHUNK if kernels_in_use(jnp.float32, "matmul")
                                         else None)
    tokens, _ = prompts(cfg.vocab_size)
    out = plain_greedy(name)
    for i, n in enumerate(LENGTHS):
        ours = np.asarray(out.tokens[i, :int(out.num_generated[i])]).tolist()
        prompt = np.asarray(tokens[i, :n])
        assert ours == hf_greedy(model, prompt, NEW), f"row {i}"
        # Without a cache: each token is the argmax of the forward over everything before it.
        with torch.no_grad():
            logits = model(input_ids=torch.as_tensor(np.concatenate([prompt, ours])[None]),
                           use_cache=False).logits[0].float().numpy()
        assert np.argmax(logits[n - 1:-1], axis=-1).tolist() == ours, f"row {i}"


def target_records(name: str, calls: int = 24):
    """The target's own greedy continuations of random 4-token prompts (the data a head is
    trained on: answers the target regenerated), loss on the continuations. Made with the
    program of :func:`plain_greedy` (the same shapes), so nothing more is compiled."""
    _, cfg, _, serving = family(name)
    rng, records = np.random.default_rng(1), []
    for _ in range(calls):
        tokens = np.zeros((len(LENGTHS), WIDTH), np.int32)
        tokens[:, :4] = rng.integers(0, cfg.vocab_size, (len(LENGTHS), 4))
        out = generate(serving, cfg, jnp.asarray(tokens), jnp.full((len(LENGTHS),), 4, jnp.int32),
                       max_new_tokens=NEW)
        for row, new in zip(tokens, np.asarray(out.tokens)):
            ids = np.concatenate([row[:4], new]).astype(np.int32)
            records.append({"input_ids": ids, "loss_mask": np.arange(len(ids)) >= 4})
    return records


def run_config(out_dir, vocab: int):
    return TrainConfig(target="tiny", out_dir=str(out_dir), max_len=32, batch_size=8,
                       ttt_steps=3, draft_vocab_size=vocab, total_steps=STEPS,
                       save_every=STEPS // 2, keep_checkpoints=3, eval_every=1000,
                       log_every=1, eval_fraction=0.0, progress=False,
                       optimizer=OptimizerConfig(learning_rate=2e-2, warmup_steps=2))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_decoding_equals_transformers_and_a_trained_head_decodes_losslessly(name, tmp_path):
    """One test a family, so the programs its parts share are compiled once."""
    check_greedy_equals_transformers(name)
    _, cfg, params, serving = family(name)
    target, records = TargetOverride(cfg, params), target_records(name)
    run = tmp_path / "run"
    full = train(run_config(run, cfg.vocab_size), target_override=target, train_records=records)
    losses = full["losses"]
    assert len(losses) == STEPS and np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.2, losses

    # Stopped after half the steps, then resumed from that checkpoint: the same losses.
    again = tmp_path / "again"
    half = train(run_config(again, cfg.vocab_size), max_steps=STEPS // 2, target_override=target,
                 train_records=records)
    resumed = train(run_config(again, cfg.vocab_size), target_override=target,
                    train_records=records)
    assert resumed["start_step"] == STEPS // 2
    np.testing.assert_array_equal(half["losses"] + resumed["losses"], losses)

    head, _ = read_run_head(run)
    loaded = load_draft_head(export_draft_head(head, tmp_path / "head"), cfg)
    plain = plain_greedy(name)
    accepted = 0
    for tree in (TreeConfig.chain(3), TreeConfig(tree_top_k=4, depth=3, total_tokens=12)):
        out = generate_eagle(serving, cfg, loaded, *prompts(cfg.vocab_size),
                             max_new_tokens=NEW, tree=tree)
        np.testing.assert_array_equal(out.tokens, plain.tokens)
        np.testing.assert_array_equal(out.num_generated, plain.num_generated)
        accepted += int(np.sum(np.asarray(out.accept_hist)[:, 2:]))
    # Some rounds accepted drafted tokens, so the accepted paths' caches were committed and
    # read back (through the windows) too, not only the target's own token each round.
    assert accepted > 0
