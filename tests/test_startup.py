"""Start-up caches: serving-layout weights under $EAGLE3_JAX_HOME/weights, the compilation cache
under $EAGLE3_JAX_HOME/xla; what a second start reads equals what the first one computed."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from eagle3_jax.checkpoints import load as load_module
from eagle3_jax.checkpoints import load_target, weights_cache
from eagle3_jax.model.config import TargetConfig
from eagle3_jax.model.params import init_params, to_serving
from eagle3_jax.sharding import MeshConfig, make_mesh, param_shardings
from eagle3_jax.model.params import serving_specs
from xla_flags import commands_env

CFG = TargetConfig(arch="llama", vocab_size=97, hidden_size=32, intermediate_size=64,
                   num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                   max_position_embeddings=64)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_JAX_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(weights_cache.ENV_SWITCH, "1")
    return tmp_path / "home"


def _serving(cfg=CFG, seed=0):
    return to_serving(init_params(cfg, jax.random.key(seed)), cfg)


def _shardings(cfg):
    return param_shardings(serving_specs(cfg), make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1]))


def _assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_is_exact(home, tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")
    params = _serving()
    path = weights_cache.cache_path(source, None)
    assert weights_cache.load(path, _shardings) is None  # nothing cached yet
    weights_cache.save(path, params, CFG)
    assert path.is_file() and path.parent == home / "weights"
    cfg, loaded = weights_cache.load(path, _shardings)
    assert cfg == CFG
    _assert_same(loaded, params)


def test_key_follows_source_identity_and_dtype(home, tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")
    first = weights_cache.cache_path(source, None)
    assert weights_cache.cache_path(source, None) == first
    assert weights_cache.cache_path(source, "bfloat16") != first
    os.utime(source, ns=(1, 1))  # the file changed: a new key, the old entry is never read
    assert weights_cache.cache_path(source, None) != first


def test_corrupt_or_stale_entries_are_rebuilt(home, tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")
    path = weights_cache.cache_path(source, None)
    weights_cache.save(path, _serving(), CFG)
    path.write_bytes(path.read_bytes()[:1000])  # truncated mid-write by a crash
    assert weights_cache.load(path, _shardings) is None and not path.exists()
    other = TargetConfig(**{**CFG.__dict__, "num_layers": 2})
    weights_cache.save(path, _serving(other), CFG)  # names no longer match the config
    assert weights_cache.load(path, _shardings) is None and not path.exists()


def test_unwritable_home_is_not_an_error(home, tmp_path):
    home.mkdir(parents=True)
    (home / "weights").write_text("a file where the folder should be")
    weights_cache.save(home / "weights" / "x.safetensors", _serving(), CFG)  # only logs


def test_second_load_target_reads_the_cache(home, smollm2_gguf_path, monkeypatch):
    first = load_target(str(smollm2_gguf_path))
    assert len(list((home / "weights").iterdir())) == 1

    def no_gguf(*args, **kwargs):
        raise AssertionError("the GGUF was read again")

    monkeypatch.setattr(load_module, "load_gguf", no_gguf)
    second = load_target(str(smollm2_gguf_path))
    assert second.cfg == first.cfg and second.source == first.source
    _assert_same(second.params, first.params)
    monkeypatch.setenv(weights_cache.ENV_SWITCH, "0")
    with pytest.raises(AssertionError, match="read again"):
        load_target(str(smollm2_gguf_path))


def test_second_decoder_start_uses_both_caches(smollm2_gguf_path, tmp_path):
    """Two decoder processes on a fresh home: the second reads the cached weights and compiled
    programs and prints the same answer. They compile as the commands do (the suite's own XLA
    flags off), so the real model's EAGLE answer is held to plain decoding's (``--compare``) on
    the programs users run."""
    home = tmp_path / "home"
    home.mkdir()
    os.symlink(smollm2_gguf_path, home / smollm2_gguf_path.name)
    env = dict(commands_env(), EAGLE3_JAX_HOME=str(home), EAGLE3_JAX_WEIGHTS_CACHE="1",
               EAGLE3_JAX_COMPILE_CACHE="1")
    # EAGLE with the shipped head on a fixed tree: the compiled programs of both models are
    # cached, and no start times the tree chooser's candidates (tests/test_autotune.py does).
    cmd = [sys.executable, "-m", "eagle3_jax.decode", "--prompt", "Hi", "--max-new-tokens", "12",
           "--tree-top-k", "2", "--depth", "3", "--total-tokens", "6", "--compare"]
    runs = [subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path)
            for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    assert runs[0].stdout == runs[1].stdout and runs[0].stdout.strip()
    assert "outputs identical" in runs[0].stderr.splitlines()[-1], runs[0].stderr[-2000:]
    assert len(list((home / "weights").glob("*.safetensors"))) == 1
    assert any((home / "xla").iterdir())
