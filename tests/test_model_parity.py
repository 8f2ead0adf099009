"""The JAX target reproduces HF transformers (torch, float32, eval) on tiny random models.

Covers Llama (MHA / GQA / MQA, tied and untied head, llama3 RoPE scaling), Qwen2 (q/k/v bias),
Qwen3 (q/k RMSNorm, head_dim != hidden / heads), Mistral, sliding windows (every layer, Qwen2's
upper layers), Gemma 3 (interleaved local and global layers, two RoPE bases, norms of 1 + w
around attention and MLP, GeGLU, scaled embeddings, query scalar, logit soft-capping) and the
mixtures of experts Qwen3-MoE (normalised top-k or not) and Mixtral. Every config goes
through ``TargetConfig.from_hf_config(hf_model.config.to_dict())`` and every weight through
``hf_names.hf_to_param``, so the config and checkpoint mappings are tested with the forward.

Tolerance: all weights are scaled for O(1) activations (tests/hf_reference.py), so logits have
std ~1 and hidden states std ~1-2. Both sides compute in float32 with different reduction orders;
over 7 layers that gives differences of ~1e-5, so atol 1e-4 with rtol 0 is a fixed bound ten times
above float32 noise, and far below any real bug (a wrong rope scale or bias moves logits by ~0.1).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.model.config import RopeScaling, TargetConfig
from eagle3_jax.model.params import (has_panels, is_spec, serving_specs, to_panels, to_serving,
                                     to_stacked)
from eagle3_jax.model.target import forward, forward_stacked
from hf_reference import hf_forward, tiny_hf_model

ATOL = 1e-4

jit_forward = jax.jit(forward, static_argnums=1, static_argnames=("tap_layers",))
jit_stacked = jax.jit(forward_stacked, static_argnums=1, static_argnames=("tap_layers",))

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small so that positions up to ~100 see the scaled (and, with head_dim 16, the smoothed
    # mid-band) frequencies: wavelengths 6.3 (kept), 19.9 (smoothed), 63+ (divided by 8).
    "original_max_position_embeddings": 32,
    "rope_theta": 10000.0,
}

# Two cases have a vocabulary of 96 (a multiple of 16), so the panel layout holds their output
# head as panels too (untied lm_head, tied embedding); the others' 97 keep it as it is.
CASES = {
    "llama_mha": ("llama", dict(num_key_value_heads=4, vocab_size=96)),
    "llama_gqa": ("llama", dict(num_key_value_heads=2)),
    "llama_mqa": ("llama", dict(num_key_value_heads=1)),
    "llama_tied": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=True, vocab_size=96)),
    "llama3_rope": ("llama", dict(hidden_size=64, num_key_value_heads=2,
                                  rope_parameters=LLAMA3_ROPE)),
    "qwen2_bias": ("qwen2", dict(num_key_value_heads=2)),
    "qwen2_tied": ("qwen2", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen3_qk_norm": ("qwen3", dict(num_key_value_heads=2)),
    "mistral": ("mistral", dict(num_key_value_heads=2)),
    # Sliding windows of 8 over prompts of 24: every layer local (Mistral v0.1), layers 3.. local
    # (Qwen2's max_window_layers).
    "mistral_window": ("mistral", dict(num_key_value_heads=2, sliding_window=8)),
    "qwen2_window": ("qwen2", dict(num_key_value_heads=2, use_sliding_window=True,
                                   sliding_window=8, max_window_layers=3)),
    "gemma3": ("gemma3", dict(num_key_value_heads=2, vocab_size=96)),
    "gemma3_softcap": ("gemma3", dict(num_key_value_heads=1, final_logit_softcapping=3.0,
                                      query_pre_attn_scalar=8)),
    "qwen3_moe": ("qwen3_moe", dict(num_key_value_heads=2)),
    "qwen3_moe_unnormed": ("qwen3_moe", dict(num_key_value_heads=2, norm_topk_prob=False)),
    "mixtral": ("mixtral", dict(num_key_value_heads=2, vocab_size=96)),
    "mixtral_window": ("mixtral", dict(num_key_value_heads=2, sliding_window=8)),
}


@functools.lru_cache(maxsize=None)
def _model(case: str):
    arch, overrides = CASES[case]
    return tiny_hf_model(arch, seed=sorted(CASES).index(case), **overrides)


def _causal(batch: int, length: int) -> jax.Array:
    return jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), (batch, length, length))


def _run_both(case: str, tokens: np.ndarray, positions: np.ndarray, layout: str = "stacked"):
    hf_model, cfg, params = _model(case)
    hf_logits, hf_hidden = hf_forward(hf_model, tokens, positions)
    run = jit_stacked
    if layout in ("serving", "panels"):
        params, run = to_serving(params, cfg), jit_forward
    if layout == "panels":
        params = to_panels(params, cfg)
        assert has_panels(params)
    b, t = tokens.shape
    out = run(params, cfg, jnp.asarray(tokens), jnp.asarray(positions), _causal(b, t),
                      tap_layers=cfg.eagle3_tap_layers)
    return cfg, params, out, hf_logits, hf_hidden


# Variants of a family's option (a second MoE normalisation, soft-capping, a window on an MoE)
# run in the serving layout only: the layouts' code is the same as their family's. The windows
# and the MoEs skip the panels (the same attention code as their family's; experts have none).
VARIANTS = ("gemma3_softcap", "qwen3_moe_unnormed", "mixtral_window")
NO_PANELS = ("mistral_window", "qwen2_window", "qwen3_moe", "mixtral")


@pytest.mark.parametrize("case,layout", [
    (case, layout) for case in sorted(CASES) for layout in ("stacked", "serving", "panels")
    if (case not in VARIANTS or layout == "serving")
    and (case not in NO_PANELS or layout != "panels")])
def test_logits_taps_and_hidden_match_hf(case, layout):
    """Every layout: stacked (scanned, training), serving (fused, looped, decoding) and serving
    with its matrices as panels (decoding on CPU: the panel kernel, or XLA's dot over the
    panels where the kernel is not built)."""
    hf_model, cfg, _ = _model(case)
    rng = np.random.default_rng(0)
    length = 100 if case == "llama3_rope" else 24
    tokens = rng.integers(0, cfg.vocab_size, (2, length))
    positions = np.broadcast_to(np.arange(length), (2, length))
    cfg, _, out, hf_logits, hf_hidden = _run_both(case, tokens, positions, layout)

    assert out.logits.dtype == jnp.float32
    assert 0.3 < hf_logits.std() < 3, "weights not at the intended O(1) scale"
    np.testing.assert_allclose(np.asarray(out.logits), hf_logits, atol=ATOL, rtol=0)
    # HF hidden_states[i] is the input of layer i; the last entry is after the final norm.
    taps = np.split(np.asarray(out.taps), len(cfg.eagle3_tap_layers), axis=-1)
    for layer, tap in zip(cfg.eagle3_tap_layers, taps):
        np.testing.assert_allclose(tap, hf_hidden[layer], atol=ATOL, rtol=0,
                                   err_msg=f"tap entering layer {layer}")
    np.testing.assert_allclose(np.asarray(out.hidden), hf_hidden[cfg.num_layers], atol=ATOL,
                               rtol=0)


@pytest.mark.parametrize("case", ["llama_gqa", "qwen2_bias", "qwen3_qk_norm", "llama_mqa"])
def test_serving_layout_round_trips_exactly(case):
    """to_stacked(to_serving(p)) == p bit for bit, and the serving tree matches serving_specs."""
    _, cfg, params = _model(case)
    serving = to_serving(params, cfg)
    specs = serving_specs(cfg)
    assert jax.tree.structure(serving) == jax.tree.structure(
        jax.tree.map(lambda s: 0, specs, is_leaf=is_spec))
    for got, spec in zip(jax.tree.leaves(serving), jax.tree.leaves(specs, is_leaf=is_spec)):
        assert got.shape == spec.shape
    back = to_stacked(serving, cfg)
    for (path, want), got in zip(jax.tree.leaves_with_path(params), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(path))
    panels = to_panels(serving, cfg)
    assert has_panels(panels) and not has_panels(serving)
    back = to_stacked(panels, cfg)  # through from_panels
    for (path, want), got in zip(jax.tree.leaves_with_path(params), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(path))


def test_config_features_were_exercised():
    """Guard against a case silently testing less than its name says."""
    cfgs = {case: _model(case)[1] for case in CASES}
    assert cfgs["llama_mha"].num_kv_heads == cfgs["llama_mha"].num_heads
    assert 1 < cfgs["llama_gqa"].num_kv_heads < cfgs["llama_gqa"].num_heads
    assert cfgs["llama_mqa"].num_kv_heads == 1
    assert cfgs["llama_tied"].tie_word_embeddings and cfgs["qwen2_tied"].tie_word_embeddings
    assert "lm_head" not in _model("llama_tied")[2]
    # The panel layout's output heads: untied and tied as panels, and one left as it is.
    assert "lm_head_panels" in to_panels(to_serving(_model("llama_mha")[2], cfgs["llama_mha"]),
                                         cfgs["llama_mha"])
    assert to_panels(to_serving(_model("llama_tied")[2], cfgs["llama_tied"]),
                     cfgs["llama_tied"])["embed"].ndim == 3
    assert to_panels(to_serving(_model("llama_gqa")[2], cfgs["llama_gqa"]),
                     cfgs["llama_gqa"])["embed"].ndim == 2
    assert cfgs["llama3_rope"].rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 32)
    assert cfgs["qwen2_bias"].attention_bias and not cfgs["qwen2_bias"].qk_norm
    assert cfgs["qwen3_qk_norm"].qk_norm and not cfgs["qwen3_qk_norm"].attention_bias
    assert cfgs["mistral"].sliding_window is None
    assert cfgs["mistral_window"].local_layers == tuple(range(7))
    assert cfgs["qwen2_window"].local_layers == (3, 4, 5, 6)
    gemma = cfgs["gemma3"]
    assert gemma.local_layers == (0, 1, 2, 3, 4, 6) and gemma.sliding_window == 8
    assert gemma.local_rope_theta == 10000.0 and gemma.rope_theta == 100000.0
    assert gemma.rope_scaling == RopeScaling("linear", 2.0)
    assert gemma.query_pre_attn_scalar == 12 and gemma.tie_word_embeddings
    assert gemma.norm_plus_one and gemma.sandwich_norms and gemma.scale_embeddings
    assert cfgs["gemma3_softcap"].final_logit_softcap == 3.0
    assert (cfgs["qwen3_moe"].num_experts, cfgs["qwen3_moe"].experts_per_token) == (8, 2)
    assert cfgs["qwen3_moe"].norm_topk_prob and not cfgs["qwen3_moe_unnormed"].norm_topk_prob
    assert (cfgs["mixtral"].num_experts, cfgs["mixtral"].experts_per_token) == (4, 2)
    assert cfgs["mixtral_window"].local_layers == tuple(range(7))
    q3 = cfgs["qwen3_qk_norm"]
    assert q3.head_dim * q3.num_heads != q3.hidden_size
    assert cfgs["mistral"].arch == "mistral"
    assert len(set(cfgs["llama_gqa"].eagle3_tap_layers)) == 3


def test_llama3_rope_scaling_matters_and_offset_positions_match_hf():
    """Positions 60..99 only (no 0): explicit positions reach RoPE; the scaling changes logits."""
    hf_model, cfg, params = _model("llama3_rope")
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg.vocab_size, (2, 40))
    positions = np.stack([np.arange(60, 100), np.arange(55, 95)])
    _, _, out, hf_logits, _ = _run_both("llama3_rope", tokens, positions)
    np.testing.assert_allclose(np.asarray(out.logits), hf_logits, atol=ATOL, rtol=0)

    unscaled = jit_stacked(params, cfg.replace(rope_scaling=None), jnp.asarray(tokens),
                           jnp.asarray(positions), _causal(2, 40))
    assert np.abs(np.asarray(unscaled.logits) - hf_logits).max() > 100 * ATOL


def _old_style(hf: dict) -> dict:
    """A transformers-4 style config.json: top-level rope_theta, rope_scaling dict."""
    old = {k: v for k, v in hf.items() if k != "rope_parameters"}
    rope = dict(hf["rope_parameters"])
    old["rope_theta"] = rope.pop("rope_theta")
    old["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    return old


@pytest.mark.parametrize("case", ["llama_gqa", "llama3_rope", "qwen2_bias", "qwen3_qk_norm"])
def test_old_and_new_hf_config_styles_give_same_config(case):
    hf_model, cfg, _ = _model(case)
    new = hf_model.config.to_dict()
    assert "rope_parameters" in new  # transformers 5 naming
    old = _old_style(new)
    assert TargetConfig.from_hf_config(old) == cfg
    if old["rope_scaling"] is not None:
        # Older still: the scaling kind under "type" instead of "rope_type".
        legacy = dict(old, rope_scaling={("type" if k == "rope_type" else k): v
                                         for k, v in old["rope_scaling"].items()})
        assert TargetConfig.from_hf_config(legacy) == cfg


def test_non_default_rope_theta_is_read_from_both_styles():
    hf_model, cfg, _ = _model("llama_gqa")
    new = hf_model.config.to_dict()
    new["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    assert TargetConfig.from_hf_config(new).rope_theta == 500000.0
    assert TargetConfig.from_hf_config(_old_style(new)).rope_theta == 500000.0


def test_gemma3_config_as_the_hub_files_write_it():
    """gemma-3-1b-it's config.json (transformers 4 keys: sliding_window_pattern,
    rope_local_base_freq, rope_scaling) and the multimodal 27B's nested text_config give the
    configs transformers 5 reads from them."""
    hub_1b = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
              "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
              "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
              "query_pre_attn_scalar": 256, "rope_theta": 1000000, "rope_local_base_freq": 10000,
              "rope_scaling": None, "sliding_window": 512, "sliding_window_pattern": 6,
              "vocab_size": 262144, "max_position_embeddings": 32768, "rms_norm_eps": 1e-06,
              "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
              "attn_logit_softcapping": None}
    cfg = TargetConfig.from_hf_config(hub_1b)
    assert cfg.layer_pattern == ("lllllg" * 5)[:26] and cfg.sliding_window == 512
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling) == (1e6, 1e4, None)
    assert cfg.num_params == 999_885_952  # google/gemma-3-1b-it
    hub_27b = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
               "text_config": {"model_type": "gemma3_text", "hidden_size": 5376,
                               "intermediate_size": 21504, "num_hidden_layers": 62,
                               "num_attention_heads": 32, "num_key_value_heads": 16,
                               "head_dim": 128, "query_pre_attn_scalar": 168,
                               "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                               "sliding_window": 1024},
               "vision_config": {"model_type": "siglip_vision_model"}}
    cfg = TargetConfig.from_hf_config(hub_27b)
    assert cfg.rope_scaling == RopeScaling("linear", 8.0) and cfg.local_rope_theta == 10000.0
    assert cfg.vocab_size == 262208 and cfg.layer_pattern.count("g") == 10


@pytest.mark.parametrize("case,change,message", [
    ("llama_gqa", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     "RoPE scaling type 'yarn'"),
    ("llama_gqa", {"attention_sinks": True}, "attention sinks"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "soft-capping"),
    ("gemma3", {"layer_types": ["chunked_attention"] * 7}, "chunked_attention"),
    ("qwen3_moe", {"mlp_only_layers": [0]}, "mlp_only_layers"),
    ("qwen3_moe", {"num_experts_per_tok": 9}, "experts_per_token"),
    ("mixtral", {"hidden_act": "gelu"}, "activation 'gelu'"),
])
def test_unsupported_options_are_refused_by_name(case, change, message):
    """An option the forward would otherwise ignore is refused before any weight is read."""
    from eagle3_jax.model.config import ConfigError

    hf = dict(_model(case)[0].config.to_dict(), **change)
    with pytest.raises(ConfigError, match=message):
        TargetConfig.from_hf_config(hf)
