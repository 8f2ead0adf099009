"""The large targets (the 1B to 70B presets): every preset's full size by ``jax.eval_shape``
(nothing allocated), a random checkpoint of its real configuration with one layer matched to HF
transformers, and TPU mesh plans.

The one-layer checkpoints keep each preset's attention as it is (hidden size, query and key/value
heads, head size, RoPE and its scaling, QK-norm, biases) and cut two widths no code path depends
on: the vocabulary to 512 rows and the MLP to 256, the experts of an MoE to 16 at most (a SwiGLU of
any width is the same code; every
preset's full-size matmul shapes run through the CPU kernels in tests/test_rows_matmul.py). The
70B's real layer alone would be 3.4 GB of float32 in each framework."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.model.config import TargetConfig
from eagle3_jax.model.params import init_params
from eagle3_jax.model.target import forward_stacked
from eagle3_jax.presets import load_preset
from eagle3_jax.sharding import MeshError
from eagle3_jax.sharding.tpu import mesh_plan, parse_topology
from hf_reference import build_hf_model, checkpoint_state, hf_forward, params_from_hf

# Published parameter counts (HF safetensors metadata), +-1%.
LARGE = {
    "llama-3.1-8b-instruct": 8.03e9,
    "llama-3.3-70b-instruct": 70.55e9,
    "qwen3-8b": 8.19e9,
    "qwen3-32b": 32.76e9,
    "deepseek-r1-distill-llama-8b": 8.03e9,
    "vicuna-13b-v1.3": 13.02e9,
    "gemma-3-1b-it": 999_885_952,
    "gemma-3-27b-it": 27.01e9,  # the language model (27.4B with the vision tower)
    "qwen3-30b-a3b": 30.53e9,
    "mixtral-8x7b-instruct": 46.70e9,
}
# Parameters a token reads (the routed experts only), for the mixtures of experts.
ACTIVE = {"qwen3-30b-a3b": 3.3e9, "mixtral-8x7b-instruct": 12.9e9}


@pytest.mark.parametrize("name", sorted(LARGE))
def test_full_size_by_eval_shape(name):
    cfg = load_preset(name).target
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    leaves = jax.tree.leaves(shapes)
    total = sum(int(np.prod(x.shape)) for x in leaves)
    assert total == cfg.num_params
    assert abs(total - LARGE[name]) / LARGE[name] < 0.01, total
    if name in ACTIVE:
        assert abs(cfg.num_active_params - ACTIVE[name]) / ACTIVE[name] < 0.02
    assert all(x.dtype == jnp.bfloat16 for x in leaves)
    assert len(set(cfg.eagle3_tap_layers)) == 3 and max(cfg.eagle3_tap_layers) < cfg.num_layers


def _hf_config(cfg, layers: int, vocab: int, intermediate: int, experts: int):
    """The HF config of ``cfg`` cut to ``layers`` layers (Gemma's local then global: both
    kinds), ``vocab`` rows, MLPs of width ``intermediate`` and at most ``experts`` experts."""
    import transformers

    classes = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config,
               "gemma3": transformers.Gemma3TextConfig, "qwen3_moe": transformers.Qwen3MoeConfig,
               "mixtral": transformers.MixtralConfig}
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope = {"rope_type": s.kind, "factor": s.factor, "rope_theta": cfg.rope_theta}
        if s.kind == "llama3":
            rope.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                        original_max_position_embeddings=s.original_max_position_embeddings)
    extra = {}
    if cfg.arch == "gemma3":
        rope = {"full_attention": rope, "sliding_attention": {
            "rope_type": "default", "rope_theta": cfg.local_rope_theta}}
        extra = dict(sliding_window=cfg.sliding_window,
                     layer_types=["sliding_attention", "full_attention"][-layers:],
                     query_pre_attn_scalar=int(cfg.query_pre_attn_scalar))
    elif cfg.arch == "qwen3_moe":
        extra = dict(num_experts=experts, num_experts_per_tok=cfg.experts_per_token,
                     moe_intermediate_size=intermediate, norm_topk_prob=cfg.norm_topk_prob)
    elif cfg.arch == "mixtral":
        extra = dict(num_local_experts=experts, num_experts_per_tok=cfg.experts_per_token)
    return classes[cfg.arch](
        vocab_size=vocab, hidden_size=cfg.hidden_size, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps, rope_parameters=rope,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=cfg.attention_bias, **extra)


def _distinct_configurations() -> list[str]:
    """One preset name per distinct target configuration (deepseek-r1-distill-llama-8b has
    llama-3.1-8b-instruct's: the same layer twice would prove nothing more)."""
    first = {}
    for name in sorted(LARGE):
        first.setdefault(repr(load_preset(name).target.to_dict()), name)
    return sorted(first.values())


@pytest.mark.slow  # full-size attention weights in both frameworks
@pytest.mark.parametrize("name", _distinct_configurations())
def test_one_layer_of_the_real_configuration_matches_hf(name):
    full = load_preset(name).target
    # Gemma: a local and a global layer of the 1B; the 27B's global layer only (linear RoPE
    # scaling; a layer of width 5,376 is 0.3 GB in each framework).
    layers = 2 if full.arch == "gemma3" and full.hidden_size < 2048 else 1
    experts = min(full.num_experts, 16)
    hf = build_hf_model(_hf_config(full, layers, vocab=512, intermediate=256, experts=experts),
                        seed=1)
    cfg = TargetConfig.from_hf_config(hf.config.to_dict())
    pattern = "lg"[-layers:] if full.layer_pattern else ""
    assert cfg == full.replace(num_layers=layers, vocab_size=512, intermediate_size=256,
                               num_experts=experts, dtype="float32",
                               layer_pattern=pattern if "l" in pattern else "",
                               sliding_window=full.sliding_window if "l" in pattern else None,
                               max_position_embeddings=cfg.max_position_embeddings)
    params = params_from_hf(checkpoint_state(hf, cfg), cfg)
    tokens = np.random.default_rng(0).integers(0, 512, (1, 6))
    positions = np.arange(6)[None] + 5000  # past the llama3 scaling's original context
    want, _ = hf_forward(hf, tokens, positions)
    mask = jnp.tril(jnp.ones((6, 6), bool))[None]
    out = jax.jit(forward_stacked, static_argnums=1)(params, cfg, jnp.asarray(tokens),
                                                     jnp.asarray(positions), mask)
    del hf, params
    np.testing.assert_allclose(np.asarray(out.logits), want, atol=2e-3, rtol=0)


def test_topology_names():
    assert parse_topology("v5p-16").chips == 8          # v4 / v5p count TensorCores
    assert parse_topology("v4-32").chips == 16
    assert parse_topology("v5litepod-8").chips == parse_topology("v5e-8").chips == 8
    assert parse_topology("v6e-4").chips == 4
    for bad in ("v5p-3", "tpu-8", "v7x-8"):
        with pytest.raises(MeshError, match="topology"):
            parse_topology(bad)


def test_plans_fit_where_they_should_and_refuse_where_they_cannot():
    llama8, llama70 = (load_preset(n).target for n in ("llama-3.1-8b-instruct",
                                                       "llama-3.3-70b-instruct"))
    train = mesh_plan(llama8, "v5p-16", "train", batch_size=64, max_len=2048)
    assert train.fits and train.mesh.fsdp == 8 and train.mesh.data * train.mesh.tensor == 1
    # 141 GB of bfloat16 weights cannot fit 8 x 16 GiB, for decoding or training.
    assert not mesh_plan(llama70, "v5e-8", "decode").fits
    assert not mesh_plan(llama70, "v5e-8", "train", batch_size=64).fits
    decode = mesh_plan(llama70, "v6e-8", "decode")
    assert decode.fits and decode.mesh.tensor == 8 and decode.mesh.data == 1
    # Decoding shards over the fewest chips that hold the weights and replicates over the rest.
    small = mesh_plan(llama8, "v5p-16", "decode")
    assert small.mesh.tensor == 1 and small.mesh.data == 8
    for plan in (train, decode, small):
        m = plan.mesh
        assert m.data * m.fsdp * m.tensor == plan.topology.chips
        assert plan.total == sum(plan.bytes_per_chip.values())
        assert ("fits" in plan.describe()) and plan.topology.name in plan.describe()
