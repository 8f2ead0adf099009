"""The released EAGLE-3 head format: export -> load is the identity, the exported file computes
the same draft step as an independent PyTorch re-implementation of the reference layer, and
broken or mismatched heads fail with errors that name the problem."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from eagle3_jax.draft.config import DraftConfig
from eagle3_jax.draft.export import (DraftExportError, export_draft_head, load_draft_head,
                                     read_safetensors, write_safetensors)
from eagle3_jax.draft.model import draft_step_cached, empty_draft_cache, fuse_taps
from eagle3_jax.draft.params import DraftHead, VocabMap, init_draft_params
from eagle3_jax.model.config import ConfigError, TargetConfig

V, VD, D = 96, 40, 32


def target_cfg(**changes):
    fields = dict(arch="llama", vocab_size=V, hidden_size=D, intermediate_size=64, num_layers=7,
                  num_heads=4, num_kv_heads=2, head_dim=8)
    fields.update(changes)
    return TargetConfig(**fields)


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


def test_eagle31_head_roundtrips_with_its_flags_and_tap_norms(tmp_path):
    head = make_head(fc_norm=True, norm_output=True)
    export_draft_head(head, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True
    assert read_safetensors(tmp_path / "model.safetensors")["fc_norm.weight"].shape == (3, D)
    loaded = load_draft_head(tmp_path, target_cfg())
    assert loaded.cfg == head.cfg
    for name, value in head.params.items():
        np.testing.assert_array_equal(loaded.params[name], value, err_msg=name)
    # An EAGLE-3 head's config names neither flag, and loads as EAGLE-3.
    export_draft_head(make_head(), tmp_path / "plain")
    plain = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert "fc_norm" not in plain and "norm_output" not in plain
    assert not load_draft_head(tmp_path / "plain", target_cfg()).cfg.norm_output


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
# An independent reading: the reference draft layer in plain PyTorch, from the exported file.


def torch_draft_layer(w, config, embeds, g, positions):
    """Reference §2 in PyTorch for one sequence: embeds, g [T, D]; positions [T]."""
    eps = config["rms_norm_eps"]
    n, k, h = (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"])

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x):
        inv = 1.0 / (config["rope_theta"] ** (torch.arange(0, h, 2, dtype=torch.float64) / h))
        ang = positions[:, None].double() * inv
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
        x1, x2 = x[..., : h // 2], x[..., h // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    t = embeds.shape[0]
    p = "midlayer."
    x = torch.cat([rms(embeds, w[p + "input_layernorm.weight"]),
                   rms(g, w[p + "hidden_norm.weight"])], -1)
    q = rope((x @ w[p + "self_attn.q_proj.weight"].T).view(t, n, h))
    key = rope((x @ w[p + "self_attn.k_proj.weight"].T).view(t, k, h))
    val = (x @ w[p + "self_attn.v_proj.weight"].T).view(t, k, h)
    key, val = key.repeat_interleave(n // k, 1), val.repeat_interleave(n // k, 1)
    scores = torch.einsum("tnh,snh->nts", q, key) / h ** 0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("nts,snh->tnh", scores.softmax(-1), val).reshape(t, n * h)
    hid = g + attn @ w[p + "self_attn.o_proj.weight"].T
    y = rms(hid, w[p + "post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(y @ w[p + "mlp.gate_proj.weight"].T)
           * (y @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    hid = hid + mlp
    logits = rms(hid, w["norm.weight"]) @ w["lm_head.weight"].T
    return hid, logits


def test_exported_file_matches_torch_reference(tmp_path):
    head = make_head()
    export_draft_head(head, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    from safetensors.torch import load_file

    w = {k: v.double() if v.is_floating_point() else v
         for k, v in load_file(str(tmp_path / "model.safetensors")).items()}

    t = 6
    rng = np.random.default_rng(1)
    taps = rng.normal(size=(t, 3 * D)).astype(np.float32)
    embeds = rng.normal(size=(t, D)).astype(np.float32)
    positions = np.arange(t) + 3

    # Ours: fc then one cached draft step over an empty cache of t slots.
    g = fuse_taps(head.params, head.cfg, jnp.asarray(taps)[None])
    mask = jnp.tril(jnp.ones((t, t), bool))[None]
    hid, logits, _, _ = draft_step_cached(head.params, head.cfg, jnp.asarray(embeds)[None], g,
                                          jnp.asarray(positions)[None], mask,
                                          *empty_draft_cache(head.cfg, 1, t), jnp.arange(t)[None])

    g_ref = torch.from_numpy(taps).double() @ w["fc.weight"].T
    hid_ref, logits_ref = torch_draft_layer(w, config, torch.from_numpy(embeds).double(), g_ref,
                                            torch.from_numpy(positions))
    np.testing.assert_allclose(np.asarray(g[0]), g_ref.numpy(), atol=1e-5)
    np.testing.assert_allclose(np.asarray(hid[0]), hid_ref.numpy(), atol=1e-4)
    np.testing.assert_allclose(np.asarray(logits[0]), logits_ref.numpy(), atol=1e-4)
    # Draft ids map back to the same target ids through either reading of d2t.
    draft_ids = logits_ref.argmax(-1)
    target_ids = draft_ids + w["d2t"][draft_ids]
    np.testing.assert_array_equal(np.asarray(head.vocab.draft_to_target)[draft_ids.numpy()],
                                  target_ids.numpy())
    assert bool(w["t2d"][target_ids].all())


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


def test_speculators_layout(tmp_path):
    head = make_head()
    export_draft_head(head, tmp_path)
    tensors = read_safetensors(tmp_path / "model.safetensors")
    tensors = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
    write_safetensors(tmp_path / "model.safetensors", tensors)
    config = json.loads((tmp_path / "config.json").read_text())
    layer = {k: config.pop(k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                        "num_key_value_heads", "head_dim", "rms_norm_eps",
                                        "rope_theta", "vocab_size")}
    config["transformer_layer_config"] = layer
    config["speculators_model_type"] = "eagle3"
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_draft_head(tmp_path, target_cfg())
    for name, value in head.params.items():
        np.testing.assert_array_equal(loaded.params[name], value, err_msg=name)

    config["norm_before_residual"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(DraftExportError, match="norm_before_residual"):
        load_draft_head(tmp_path, target_cfg())


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
    assert main(["--checkpoint", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2
