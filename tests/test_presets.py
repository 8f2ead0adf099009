"""Every YAML preset in configs/ loads into a valid TargetConfig of the published size; presets
and training configs are found by name through importlib.resources, from any directory."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

import pytest

from eagle3_jax.model.config import ConfigError, RopeScaling
from eagle3_jax.presets import (CONFIGS_DIR, PresetError, list_presets, list_train_configs,
                                load_preset, train_config_path)
from eagle3_jax.sharding import MeshConfig
from eagle3_jax.train.config import load_train_config

REPO_CONFIGS = Path(__file__).resolve().parents[1] / "configs"

# Published parameter counts (model cards / HF safetensors metadata), +-2%.
PUBLISHED_PARAMS = {
    "smollm2-135m": 134.5e6,
    "llama-3.1-8b-instruct": 8.03e9,
    "qwen3-8b": 8.19e9,
    "qwen2.5-7b-instruct": 7.62e9,
    "vicuna-7b-v1.3": 6.74e9,
    "llama-3.3-70b-instruct": 70.55e9,
    "qwen3-32b": 32.76e9,
    "deepseek-r1-distill-llama-8b": 8.03e9,
    "vicuna-13b-v1.3": 13.02e9,
    "gemma-3-1b-it": 999_885_952,
    "gemma-3-27b-it": 27.01e9,  # the language model (27.4B with the vision tower)
    "qwen3-30b-a3b": 30.53e9,
    "mixtral-8x7b-instruct": 46.70e9,
}


def test_every_preset_has_a_published_size():
    assert set(list_presets()) == set(PUBLISHED_PARAMS)


def test_configs_are_found_through_the_package():
    # CONFIGS_DIR is the package's configs/ (importlib.resources), and in a checkout it holds
    # exactly the repo's top-level configs/ (eagle3_jax/configs links to it).
    assert str(CONFIGS_DIR) == str(importlib.resources.files("eagle3_jax") / "configs")
    shipped = {f.name for f in CONFIGS_DIR.iterdir()}
    assert shipped == {p.name for p in REPO_CONFIGS.glob("*.yaml")}
    assert set(list_presets()) | set(list_train_configs()) == {n[:-5] for n in shipped}


def test_other_configs_are_not_presets():
    # configs/ also holds training configs (``target: <preset name>``); they are not listed.
    others = set(list_train_configs())
    large = ("llama-3.1-8b-instruct", "llama-3.3-70b-instruct", "qwen3-8b", "qwen3-32b",
             "deepseek-r1-distill-llama-8b", "vicuna-13b-v1.3", "gemma-3-1b-it", "gemma-3-27b-it",
             "qwen3-30b-a3b", "mixtral-8x7b-instruct")
    assert others == {"train-smollm2-135m"} | {f"train-{n}" for n in large}
    assert not others & set(list_presets())
    for name in large:  # each large preset's training config trains a head for it
        cfg = load_train_config(f"train-{name}")
        assert cfg.target == name and cfg.target_sharding == "training"
        assert cfg.dtype == "bfloat16" and cfg.ttt_steps == 7
    for name in others:
        with pytest.raises(PresetError, match="unknown preset"):
            load_preset(name)


def test_lookup_by_name_does_not_depend_on_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_preset("smollm2-135m").name == "smollm2-135m"
    by_name = load_train_config("train-smollm2-135m")
    assert load_train_config("train-smollm2-135m.yaml") == by_name
    assert load_train_config(REPO_CONFIGS / "train-smollm2-135m.yaml") == by_name
    assert by_name.target == "smollm2-135m"


def test_train_config_lookup():
    assert train_config_path("train-llama-3.1-8b-instruct").name == \
        "train-llama-3.1-8b-instruct.yaml"
    with pytest.raises(ConfigError, match="'train-nope' is neither an existing file nor a "
                                          "shipped config; shipped: train-deepseek"):
        load_train_config("train-nope")
    with pytest.raises(ConfigError, match="shipped: "):  # a target preset is not a train config
        load_train_config("smollm2-135m")
    with pytest.raises(ConfigError, match="neither an existing file"):  # paths are not names
        load_train_config("no/such/train-smollm2-135m.yaml")


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_preset_loads(name):
    preset = load_preset(name)
    assert preset.name == name
    assert isinstance(preset.mesh, MeshConfig)
    assert preset.notes
    want = PUBLISHED_PARAMS[name]
    assert abs(preset.target.num_params - want) / want < 0.02, preset.target.num_params
    hash(preset.target)  # usable as a static jit argument
    # load by path as well as by name
    assert load_preset(REPO_CONFIGS / f"{name}.yaml") == preset


def test_preset_details():
    smol = load_preset("smollm2-135m")
    assert smol.weights == "builtin:smollm2-135m-instruct"
    assert smol.target.dtype == "float32" and smol.target.tie_word_embeddings
    assert smol.target.eagle3_tap_layers == (2, 15, 27)

    llama = load_preset("llama-3.1-8b-instruct")
    assert llama.weights is None and llama.target.dtype == "bfloat16"
    assert llama.target.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert llama.target.eagle3_tap_layers == (2, 16, 29)
    assert not llama.target.tie_word_embeddings

    qwen3 = load_preset("qwen3-8b")
    assert qwen3.target.qk_norm and not qwen3.target.attention_bias
    assert qwen3.target.max_position_embeddings == 40960
    assert load_preset("qwen2.5-7b-instruct").target.attention_bias
    vicuna = load_preset("vicuna-7b-v1.3").target
    assert vicuna.num_kv_heads == vicuna.num_heads == 32 and vicuna.max_position_embeddings == 2048


def test_unknown_preset_lists_available():
    with pytest.raises(PresetError,
                       match="unknown preset 'llama-5'.*llama-3.1-8b-instruct.*qwen3-8b"):
        load_preset("llama-5")


@pytest.mark.parametrize("text,match", [
    ("name: x\ntarget: {arch: llama}\n", "incomplete target config"),
    ("target: {arch: gpt2}\n", "unknown target config keys|incomplete|unknown architecture"),
    ("name: x\ntarget: 3\n", "'target' must be a mapping"),
    ("name: x\nbogus: 1\ntarget: {}\n", r"unknown keys \['bogus'\]"),
    ("name: x\nweights: s3://x\ntarget: {}\n", "weights must be null"),
])
def test_malformed_preset(tmp_path, text, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(PresetError, match=match):
        load_preset(path)


def test_bad_mesh(tmp_path):
    text = (CONFIGS_DIR / "smollm2-135m.yaml").read_text().replace(
        "mesh: {data: -1, fsdp: 1, tensor: 1}", "mesh: {data: -1, fsdp: -1, tensor: 1}")
    path = tmp_path / "m.yaml"
    path.write_text(text)
    with pytest.raises(PresetError, match="at most one mesh axis may be -1"):
        load_preset(path)
