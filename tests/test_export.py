"""The released EAGLE-3 head format: export -> load is the identity, the exported file computes
the same draft step as an independent PyTorch re-implementation of the reference layer, and
broken or mismatched heads fail with errors that name the problem."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch_eagle3_reference import Eagle3Reference

from eagle3_jax.draft.config import DraftConfig
from eagle3_jax.draft.export import (FORMATS, DraftExportError, export_draft_head,
                                     load_draft_head,
                                     read_safetensors, write_safetensors)
from eagle3_jax.draft.model import draft_step_cached, empty_draft_cache, fuse_taps
from eagle3_jax.draft.params import DraftHead, VocabMap, init_draft_params
from eagle3_jax.model.config import ConfigError, RopeScaling, TargetConfig

V, VD, D = 96, 40, 32


def target_cfg(**changes):
    fields = dict(arch="llama", vocab_size=V, hidden_size=D, intermediate_size=64, num_layers=7,
                  num_heads=4, num_kv_heads=2, head_dim=8)
    fields.update(changes)
    return TargetConfig(**fields)


VARIANTS = {
    "eagle3": {},
    "fc_norm": {"fc_norm": True},  # SpecForge's EAGLE-3.1: per-tap norms only
    "eagle3.1": {"fc_norm": True, "norm_output": True},  # vLLM's: and the normed feature back
    "norm_before_residual": {"norm_before_residual": True},
    "linear_rope_scaling": {"rope_scaling": RopeScaling(kind="linear", factor=4.0)},
    # Wavelengths below, inside and above the ramp of original 64 / factors 4 and 1.
    "llama3_rope_scaling": {"rope_scaling": RopeScaling(kind="llama3", factor=8.0,
                                                        low_freq_factor=1.0,
                                                        high_freq_factor=4.0,
                                                        original_max_position_embeddings=64)},
}


def make_head(draft_vocab=VD, seed=0, **overrides) -> DraftHead:
    cfg = DraftConfig.for_target(target_cfg(), draft_vocab_size=draft_vocab, rope_theta=500.0,
                                 **overrides)
    keys = jax.random.split(jax.random.key(seed), 3)
    params = init_draft_params(cfg, keys[0], scale=0.2)
    # Norm scales away from 1 so that a swapped norm would show.
    params = {k: v + 0.1 * jax.random.normal(jax.random.fold_in(keys[1], i), v.shape)
              for i, (k, v) in enumerate(sorted(params.items()))}
    if draft_vocab == V:
        vocab = VocabMap.identity(V)
    else:
        used = np.sort(np.random.default_rng(seed).choice(V, draft_vocab, replace=False))
        vocab = VocabMap.from_used_ids(used, V)
    return DraftHead(params=params, vocab=vocab, cfg=cfg)


def test_roundtrip_is_identity(tmp_path):
    head = make_head()
    export_draft_head(head, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == VD
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 4]
    assert config["tie_word_embeddings"] is False
    tensors = read_safetensors(tmp_path / "model.safetensors")
    assert "embed_tokens.weight" not in tensors
    assert tensors["fc.weight"].shape == (D, 3 * D)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (4 * 8, 2 * D)
    assert tensors["midlayer.self_attn.k_proj.weight"].shape == (2 * 8, 2 * D)
    assert tensors["midlayer.self_attn.o_proj.weight"].shape == (D, 4 * 8)
    assert tensors["lm_head.weight"].shape == (VD, D)
    assert tensors["d2t"].dtype == np.int64 and tensors["t2d"].dtype == np.bool_

    loaded = load_draft_head(tmp_path, target_cfg())
    assert loaded.cfg == head.cfg
    for name, value in head.params.items():
        np.testing.assert_array_equal(loaded.params[name], value, err_msg=name)
    np.testing.assert_array_equal(loaded.vocab.d2t, head.vocab.d2t)
    np.testing.assert_array_equal(loaded.vocab.t2d, head.vocab.t2d)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("variant", ["eagle3", "fc_norm", "eagle3.1", "norm_before_residual",
                                     "linear_rope_scaling", "llama3_rope_scaling",
                                     "full_vocab"])
def test_every_head_roundtrips_through_every_layout_that_describes_it(tmp_path, variant, fmt):
    """Export then load gives the same config, weights and vocabulary maps in each layout; a
    layout that cannot describe the head refuses to write it (naming what it lacks)."""
    head = make_head(**VARIANTS[variant]) if variant != "full_vocab" else make_head(draft_vocab=V)
    refused = {"reference": {"fc_norm", "eagle3.1", "norm_before_residual",
                             "llama3_rope_scaling"},
               "sglang": {"eagle3.1", "norm_before_residual"}, "speculators": set()}[fmt]
    if variant in refused:
        with pytest.raises(DraftExportError, match="--format speculators"):
            export_draft_head(head, tmp_path, format=fmt)
        return
    export_draft_head(head, tmp_path, format=fmt, verifier={"name_or_path": "t/target",
                                                            "architectures": ["LlamaForCausalLM"]})
    config = json.loads((tmp_path / "config.json").read_text())
    tensors = read_safetensors(tmp_path / "model.safetensors")
    layer = "layers.0." if fmt == "speculators" else "midlayer."
    assert f"{layer}self_attn.q_proj.weight" in tensors
    if head.cfg.fc_norm:
        assert tensors["fc_norm.1.weight"].shape == (D,)
    if fmt == "speculators":
        assert config["speculators_model_type"] == "eagle3"
        assert config["transformer_layer_config"]["hidden_size"] == D
        assert config["speculators_config"]["verifier"]["name_or_path"] == "t/target"
        assert config["norm_before_residual"] is head.cfg.norm_before_residual
        assert ("d2t" in tensors) == (variant != "full_vocab")
    else:
        assert config["architectures"] == [
            "LlamaForCausalLMEagle3" if fmt == "sglang" else "LlamaForCausalLM"]
        assert "norm_output" not in config and "norm_before_residual" not in config
    loaded = load_draft_head(tmp_path, target_cfg())
    assert loaded.cfg == head.cfg
    for name, value in head.params.items():
        np.testing.assert_array_equal(loaded.params[name], value, err_msg=name)
    np.testing.assert_array_equal(loaded.vocab.d2t, head.vocab.d2t)
    np.testing.assert_array_equal(loaded.vocab.t2d, head.vocab.t2d)


def test_bfloat16_export(tmp_path):
    head = make_head()
    export_draft_head(head, tmp_path, dtype="bfloat16")
    loaded = load_draft_head(tmp_path)
    assert loaded.cfg.dtype == "bfloat16"
    for name, value in head.params.items():
        np.testing.assert_array_equal(loaded.params[name],
                                      jnp.asarray(value, jnp.bfloat16), err_msg=name)
    # torch reads the file too.
    from safetensors.torch import load_file

    assert load_file(str(tmp_path / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# An independent reading: the draft head in plain PyTorch (tests/torch_eagle3_reference.py),
# from the exported files.


@pytest.mark.parametrize("variant,fmt", [
    ("eagle3", "sglang"), ("eagle3", "reference"), ("eagle3", "speculators"),
    ("fc_norm", "sglang"), ("eagle3.1", "speculators"), ("norm_before_residual", "speculators"),
    ("llama3_rope_scaling", "sglang"), ("llama3_rope_scaling", "speculators"),
    ("linear_rope_scaling", "reference")])
def test_exported_file_matches_torch_reference(tmp_path, variant, fmt):
    """Our cached draft steps (a 6-token prompt, then two single-token steps on the fed-back
    feature) against ``tests/torch_eagle3_reference.py`` reading the exported files with the
    safetensors library: every head variant in every layout that carries it."""
    head = make_head(**VARIANTS[variant])
    export_draft_head(head, tmp_path, format=fmt)
    config = json.loads((tmp_path / "config.json").read_text())
    from safetensors.torch import load_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    ref = Eagle3Reference({k: v for k, v in tensors.items() if v.is_floating_point()}, config)

    t, steps = 6, 2
    rng = np.random.default_rng(1)
    taps = rng.normal(size=(1, t, 3 * D)).astype(np.float32)
    embeds = rng.normal(size=(1, t + steps, D)).astype(np.float32)
    slots = t + steps
    cache = empty_draft_cache(head.cfg, 1, slots)
    mask_all = jnp.tril(jnp.ones((slots, slots), bool))[None]

    g = fuse_taps(head.params, head.cfg, jnp.asarray(taps))
    g_ref = ref.fuse(torch.from_numpy(taps))
    np.testing.assert_allclose(np.asarray(g), g_ref.numpy(), atol=1e-5)
    start, width = 0, t
    for step in range(steps + 1):
        positions = np.arange(start, start + width)[None] + 3
        feature, logits, *cache = draft_step_cached(
            head.params, head.cfg, jnp.asarray(embeds[:, start:start + width]), g,
            jnp.asarray(positions), mask_all[:, start:start + width], *cache,
            jnp.arange(start, start + width)[None])
        logits_ref, feature_ref = ref.step(torch.from_numpy(embeds[:, start:start + width]),
                                           g_ref, torch.from_numpy(positions))
        np.testing.assert_allclose(np.asarray(logits), logits_ref.numpy(), atol=1e-4,
                                   err_msg=f"step {step}")
        np.testing.assert_allclose(np.asarray(feature), feature_ref.numpy(), atol=1e-4,
                                   err_msg=f"step {step}")
        # The next step: one token on the last position's fed-back feature.
        g, g_ref = feature[:, -1:], feature_ref[:, -1:]
        start, width = start + width, 1
    # Draft ids map back to the same target ids through either reading of d2t.
    draft_ids = logits_ref[0].argmax(-1)
    target_ids = draft_ids + tensors["d2t"][draft_ids]
    np.testing.assert_array_equal(np.asarray(head.vocab.draft_to_target)[draft_ids.numpy()],
                                  target_ids.numpy())
    assert bool(tensors["t2d"][target_ids].all())


# ---------------------------------------------------------------------------------------------
# Variants and errors.


def test_identity_vocab_and_defaults(tmp_path):
    head = make_head(draft_vocab=V)
    export_draft_head(head, tmp_path)
    tensors = read_safetensors(tmp_path / "model.safetensors")
    del tensors["d2t"], tensors["t2d"]
    write_safetensors(tmp_path / "model.safetensors", tensors)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("rope_theta", "eagle_aux_hidden_state_layer_ids", "draft_vocab_size"):
        del config[key]
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_draft_head(tmp_path, target_cfg(num_layers=10))
    assert loaded.cfg.rope_theta == 10000.0
    assert loaded.cfg.tap_layers == (2, 5, 7)
    assert loaded.cfg.draft_vocab_size == V
    np.testing.assert_array_equal(loaded.vocab.t2d, np.ones(V, bool))


def test_speculators_flags_are_read_as_vllm_writes_them_or_refused(tmp_path):
    """A speculators config must say norm_before_residual (speculators and vLLM default it
    differently); norm_before_fc heads, unknown tensors and other speculator types are refused;
    a stored embed_tokens (speculators saves one) is read around: the target's is used."""
    head = make_head()
    export_draft_head(head, tmp_path, format="speculators")
    config = json.loads((tmp_path / "config.json").read_text())

    def load_with(**changes):
        (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
        return load_draft_head(tmp_path, target_cfg())

    assert load_with(norm_before_residual=True).cfg.norm_before_residual
    del config["norm_before_residual"]
    with pytest.raises(DraftExportError, match="does not say norm_before_residual"):
        load_with()
    config["norm_before_residual"] = False
    with pytest.raises(DraftExportError, match="norm_before_fc"):
        load_with(norm_before_fc=True)
    with pytest.raises(DraftExportError, match="not an EAGLE-3 head"):
        load_with(speculators_model_type="mlp")
    tensors = read_safetensors(tmp_path / "model.safetensors")
    write_safetensors(tmp_path / "model.safetensors",
                      {**tensors, "embed_tokens.weight": np.zeros((V, D), np.float32)})
    loaded = load_with()
    for name, value in head.params.items():
        np.testing.assert_array_equal(loaded.params[name], value, err_msg=name)
    write_safetensors(tmp_path / "model.safetensors",
                      {**tensors, "layers.0.self_attn.q_norm.weight": np.ones(8, np.float32)})
    with pytest.raises(DraftExportError, match="q_norm"):
        load_with()


def test_flat_config_flags_and_rope_are_read_as_specforge_writes_them(tmp_path):
    """In a flat (SGLang / SpecForge) config, norm_output true is the standard head and false
    (no final norm) is refused; taps nested under eagle_config are found; RoPE scaling in
    transformers 5's rope_parameters is applied and an unsupported kind refused."""
    head = make_head()
    export_draft_head(head, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())

    def load_with(**changes):
        (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
        return load_draft_head(tmp_path, target_cfg())

    assert load_with(norm_output=True).cfg == head.cfg
    with pytest.raises(DraftExportError, match="norm_output false"):
        load_with(norm_output=False)
    taps = config.pop("eagle_aux_hidden_state_layer_ids")
    assert load_with(eagle_config={"eagle_aux_hidden_state_layer_ids": taps}).cfg == head.cfg
    config["eagle_aux_hidden_state_layer_ids"] = taps
    theta = config.pop("rope_theta")
    scaled = load_with(rope_parameters={"rope_type": "linear", "factor": 2.0,
                                        "rope_theta": theta})
    assert scaled.cfg.rope_scaling == RopeScaling(kind="linear", factor=2.0)
    assert scaled.cfg.rope_theta == theta
    with pytest.raises(DraftExportError, match="yarn"):
        load_with(rope_scaling={"rope_type": "yarn", "factor": 4.0})


def test_missing_files(tmp_path):
    with pytest.raises(DraftExportError, match="does not exist"):
        load_draft_head(tmp_path / "nowhere")
    export_draft_head(make_head(), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(DraftExportError, match="has no model.safetensors"):
        load_draft_head(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(DraftExportError, match="has no config.json"):
        load_draft_head(tmp_path)


def test_missing_and_misshaped_tensors(tmp_path):
    export_draft_head(make_head(), tmp_path)
    tensors = read_safetensors(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00")
    with pytest.raises(DraftExportError, match="not a readable safetensors"):
        load_draft_head(tmp_path)
    partial = dict(tensors)
    del partial["midlayer.hidden_norm.weight"]
    write_safetensors(tmp_path / "model.safetensors", partial)
    with pytest.raises(DraftExportError, match=r"lacks tensors \['midlayer.hidden_norm.weight'\]"):
        load_draft_head(tmp_path)
    bad = dict(tensors, **{"fc.weight": tensors["fc.weight"].T.copy()})
    write_safetensors(tmp_path / "model.safetensors", bad)
    with pytest.raises(DraftExportError, match=r"fc.weight \(96, 32\) \(expected \(32, 96\)\)"):
        load_draft_head(tmp_path)


def test_head_that_does_not_fit_the_target(tmp_path):
    export_draft_head(make_head(), tmp_path)
    with pytest.raises(ConfigError, match="hidden size 32 != target's 64"):
        load_draft_head(tmp_path, target_cfg(hidden_size=64))
    with pytest.raises(ConfigError, match="vocabulary 96 != target's 128"):
        load_draft_head(tmp_path, target_cfg(vocab_size=128))
    with pytest.raises(ConfigError, match="tap layers"):
        load_draft_head(tmp_path, target_cfg(num_layers=4))


def train_tiny_run(run_dir, num_records=16, **overrides) -> TargetConfig:
    """Two training steps of a head for ``target_cfg()`` on random records into ``run_dir``;
    returns the target config. ``overrides``: TrainConfig fields."""
    from eagle3_jax.model.params import init_params
    from eagle3_jax.train.config import TrainConfig
    from eagle3_jax.train.loop import TargetOverride, train

    tcfg = target_cfg()
    rng = np.random.default_rng(0)
    records = [{"input_ids": rng.integers(0, V, 20).astype(np.int32),
                "loss_mask": np.ones(20, bool)} for _ in range(num_records)]
    fields = dict(target="tiny", out_dir=str(run_dir), max_len=16, batch_size=8, ttt_steps=2,
                  draft_vocab_size=VD, total_steps=2, save_every=1, eval_batches=0,
                  progress=False)
    train(TrainConfig(**{**fields, **overrides}),
          target_override=TargetOverride(tcfg, init_params(tcfg, jax.random.key(0))),
          train_records=records)
    return tcfg


def test_export_cli_from_training_run(tmp_path):
    from eagle3_jax.draft.load import read_run_head
    from eagle3_jax.export import main

    run = tmp_path / "run"
    tcfg = train_tiny_run(run)
    assert main(["--checkpoint", str(run), "--step", "1", "--out", str(tmp_path / "head")]) == 0
    head, step = read_run_head(run, 1)
    loaded = load_draft_head(tmp_path / "head", tcfg)
    assert step == 1 and loaded.cfg.draft_vocab_size == VD
    for name, value in head.params.items():
        np.testing.assert_array_equal(loaded.params[name], value, err_msg=name)
    np.testing.assert_array_equal(loaded.vocab.t2d, head.vocab.t2d)
    # vLLM's layout names the run's target as the verifier; a wrong format is a usage error.
    assert main(["--checkpoint", str(run), "--step", "1", "--out", str(tmp_path / "spec"),
                 "--format", "speculators", "--verifier", "org/target"]) == 0
    spec = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert spec["speculators_config"]["verifier"]["name_or_path"] == "org/target"
    again = load_draft_head(tmp_path / "spec", tcfg)
    for name, value in head.params.items():
        np.testing.assert_array_equal(again.params[name], value, err_msg=name)
    assert main(["--checkpoint", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2
