"""Sharded forward equals the single-device forward on 8 emulated CPU devices; rules are kept.

The suite runs on 8 emulated devices (``tests/xla_flags.py``; an ``XLA_FLAGS`` naming another
count overrides it); without 8 devices the mesh tests are skipped. The expected PartitionSpecs
below are written out by hand from the rules tables in ``eagle3_jax/sharding/mesh.py``, not
recomputed with the code under test.

Tolerance: sharding changes only how float32 sums are split across devices (~1e-6 on logits of
std ~1); atol 1e-5 is a fixed bound ten times above that.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from eagle3_jax.model.config import TargetConfig
from eagle3_jax.model.params import (init_params, is_spec, param_specs, serving_specs,
                                     to_serving)
from eagle3_jax.model.target import KVCache, causal_mask, forward, forward_stacked
from eagle3_jax.sharding import (
    KV_CACHE_K_AXES, KV_CACHE_V_AXES, MeshConfig, MeshError, describe_fallbacks, make_mesh,
    named_sharding, param_shardings,
)

ATOL = 1e-5
SCALE = 0.15  # ~1/sqrt(D): logits of std ~1, so ATOL is meaningful in absolute terms
B, T, MAX_LEN = 8, 8, 16

needs_8 = pytest.mark.skipif(
    jax.device_count() < 8,
    reason="needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8",
)

# Every sharded dimension divides its mesh axes; q/k/v biases so they are placed too.
QWEN2 = TargetConfig(arch="qwen2", vocab_size=128, hidden_size=64, intermediate_size=96,
                     num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8, attention_bias=True)
# SmolLM2-like: 9 query / 3 kv heads do not divide tensor=4 (replicated); tied embeddings.
SMOL = TargetConfig(arch="llama", vocab_size=128, hidden_size=72, intermediate_size=96,
                    num_layers=2, num_heads=9, num_kv_heads=3, head_dim=8,
                    tie_word_embeddings=True)
# Qwen3-MoE-like: 8 experts (2 a token) split over tensor=4, the upper layer windowed.
MOE = TargetConfig(arch="qwen3_moe", vocab_size=128, hidden_size=64, intermediate_size=32,
                   num_layers=2, num_heads=8, num_kv_heads=4, head_dim=8, qk_norm=True,
                   num_experts=8, experts_per_token=2, sliding_window=4, layer_pattern="gl")
CONFIGS = {"qwen2": QWEN2, "smol": SMOL, "moe": MOE}

# (config, mesh (data, fsdp, tensor), mode) -> expected specs of the sharded leaves; every other
# leaf (norms, unlisted biases) must be fully replicated.
_QKV_FSDP = P(None, "fsdp", None, None)
EXPECTED = {
    ("qwen2", (1, 8, 1), "training"): {
        "embed": P(None, "fsdp"), "lm_head": P("fsdp", None),
        "wq": _QKV_FSDP, "wk": _QKV_FSDP, "wv": _QKV_FSDP, "wo": P(None, None, None, "fsdp"),
        "w_gate": P(None, "fsdp", None), "w_up": P(None, "fsdp", None),
        "w_down": P(None, None, "fsdp"),
    },
    ("qwen2", (1, 2, 4), "training"): {
        "embed": P("tensor", "fsdp"), "lm_head": P("fsdp", "tensor"),
        "wq": P(None, "fsdp", "tensor", None), "wk": P(None, "fsdp", "tensor", None),
        "wv": P(None, "fsdp", "tensor", None), "wo": P(None, "tensor", None, "fsdp"),
        "bq": P(None, "tensor", None), "bk": P(None, "tensor", None),
        "bv": P(None, "tensor", None),
        "w_gate": P(None, "fsdp", "tensor"), "w_up": P(None, "fsdp", "tensor"),
        "w_down": P(None, "tensor", "fsdp"),
    },
    ("qwen2", (1, 2, 4), "serving"): {
        "embed": P("tensor", None), "lm_head": P(None, "tensor"),
        "wq": P(None, None, "tensor", None), "wk": P(None, None, "tensor", None),
        "wv": P(None, None, "tensor", None), "wo": P(None, "tensor", None, None),
        "bq": P(None, "tensor", None), "bk": P(None, "tensor", None),
        "bv": P(None, "tensor", None),
        "w_gate": P(None, None, "tensor"), "w_up": P(None, None, "tensor"),
        "w_down": P(None, "tensor", None),
    },
    ("qwen2", (2, 1, 4), "serving"): {
        "embed": P("tensor", None), "lm_head": P(None, "tensor"),
        "wq": P(None, None, "tensor", None), "wk": P(None, None, "tensor", None),
        "wv": P(None, None, "tensor", None), "wo": P(None, "tensor", None, None),
        "bq": P(None, "tensor", None), "bk": P(None, "tensor", None),
        "bv": P(None, "tensor", None),
        "w_gate": P(None, None, "tensor"), "w_up": P(None, None, "tensor"),
        "w_down": P(None, "tensor", None),
    },
    ("smol", (1, 2, 4), "training"): {  # heads replicated over tensor, still fsdp on embed
        "embed": P("tensor", "fsdp"),
        "wq": _QKV_FSDP, "wk": _QKV_FSDP, "wv": _QKV_FSDP, "wo": P(None, None, None, "fsdp"),
        "w_gate": P(None, "fsdp", "tensor"), "w_up": P(None, "fsdp", "tensor"),
        "w_down": P(None, "tensor", "fsdp"),
    },
    # Expert parallelism: whole experts over tensor (their "mlp" axis then left whole), embed
    # over fsdp in training; the router is replicated but for its embed axis.
    ("moe", (1, 2, 4), "training"): {
        "embed": P("tensor", "fsdp"), "lm_head": P("fsdp", "tensor"),
        "wq": P(None, "fsdp", "tensor", None), "wk": P(None, "fsdp", "tensor", None),
        "wv": P(None, "fsdp", "tensor", None), "wo": P(None, "tensor", None, "fsdp"),
        "router": P(None, None, "fsdp"), "expert_gate": P(None, "tensor", "fsdp", None),
        "expert_up": P(None, "tensor", "fsdp", None), "expert_down": P(None, "tensor", None, "fsdp"),
    },
    ("moe", (2, 1, 4), "serving"): {
        "embed": P("tensor", None), "lm_head": P(None, "tensor"),
        "wq": P(None, None, "tensor", None), "wk": P(None, None, "tensor", None),
        "wv": P(None, None, "tensor", None), "wo": P(None, "tensor", None, None),
        "expert_gate": P(None, "tensor", None, None), "expert_up": P(None, "tensor", None, None),
        "expert_down": P(None, "tensor", None, None),
    },
    ("smol", (2, 1, 4), "serving"): {  # attention fully replicated, MLP and vocab tensor-split
        "embed": P("tensor", None),
        "w_gate": P(None, None, "tensor"), "w_up": P(None, None, "tensor"),
        "w_down": P(None, "tensor", None),
    },
}

jit_forward = jax.jit(forward, static_argnums=1)
jit_stacked = jax.jit(forward_stacked, static_argnums=1)


def _host_params(cfg: TargetConfig) -> dict:
    """Random numpy params of ``param_specs(cfg)``.

    Built on the host rather than with ``init_params``: compiling the random-number code is the
    slowest step on CPU; ``test_params_created_sharded_by_jit_init`` covers that path once.
    """
    rng = np.random.default_rng(0)

    def one(spec):
        noise = rng.standard_normal(spec.shape).astype(np.float32)
        return {"normal": SCALE * noise, "ones": 1 + 0.1 * noise, "zeros": 0.1 * noise}[spec.init]

    return jax.tree.map(one, param_specs(cfg), is_leaf=is_spec)


@functools.lru_cache(maxsize=None)
def _reference(name: str):
    """Single-device params, inputs and outputs for config ``name``."""
    cfg = CONFIGS[name]
    params = jax.tree.map(jnp.asarray, _host_params(cfg))
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    out = jit_stacked(params, cfg, tokens, positions, mask)
    assert 0.3 < float(out.logits.std()) < 3, "params not at the intended O(1) scale"
    return params, (tokens, positions, mask), out


def _mesh(shape):
    data, fsdp, tensor = shape
    return make_mesh(MeshConfig(data=data, fsdp=fsdp, tensor=tensor))


def _put(x, axes, mesh, mode):
    return jax.device_put(x, named_sharding(axes, x.shape, mesh, mode))


def _assert_follows_rules(shardings, cfg, mesh, expected):
    """Each leaf of the NamedSharding tree ``shardings`` is ``expected[name]`` or replicated."""
    specs = param_specs(cfg)
    for path, sharding in jax.tree_util.tree_leaves_with_path(shardings):
        want = expected.get(path[-1].key, P())
        ndim = len(_leaf_at(specs, path).shape)
        assert sharding.is_equivalent_to(NamedSharding(mesh, want), ndim), (
            f"{jax.tree_util.keystr(path)}: got {sharding.spec}, rules say {want}")


def _leaf_at(tree, path):
    for entry in path:
        tree = tree[entry.key]
    return tree


def _sharded_forward(params, name, mesh, mode):
    """Forward of the reference inputs of config ``name``, inputs placed by the rules."""
    cfg = CONFIGS[name]
    tokens, positions, mask = _reference(name)[1]
    return jit_stacked(params, cfg, _put(tokens, ("batch", "seq"), mesh, mode),
                       _put(positions, ("batch", "seq"), mesh, mode),
                       _put(mask, ("batch", "seq", "cache_seq"), mesh, mode))


@needs_8
@pytest.mark.parametrize("name,shape,mode", list(EXPECTED), ids=lambda v: str(v))
def test_param_shardings_follow_rules(name, shape, mode):
    cfg, mesh = CONFIGS[name], _mesh(shape)
    shardings = param_shardings(param_specs(cfg), mesh, mode)
    assert jax.tree.structure(shardings) == jax.tree.structure(_host_params(cfg))
    _assert_follows_rules(shardings, cfg, mesh, EXPECTED[(name, shape, mode)])


@needs_8
@pytest.mark.parametrize("name,shape,mode", list(EXPECTED), ids=lambda v: str(v))
def test_sharded_forward_matches_single_device(name, shape, mode):
    cfg, mesh = CONFIGS[name], _mesh(shape)
    ref_params, _, ref = _reference(name)
    params = jax.device_put(ref_params, param_shardings(param_specs(cfg), mesh, mode))
    out = _sharded_forward(params, name, mesh, mode)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(out.hidden), np.asarray(ref.hidden), atol=ATOL, rtol=0)


@needs_8
@pytest.mark.parametrize("shape,mode", [((1, 2, 4), "training"), ((2, 1, 4), "serving")])
def test_moe_forward_under_a_set_mesh_runs_each_devices_own_experts(shape, mode):
    """Under ``jax.set_mesh`` (training, the TPU plans) the MoE layers run expert-parallel: a
    ``shard_map`` over tensor in which each device multiplies only its two experts' rows and a
    psum adds the parts. The same logits as one device."""
    cfg, mesh = MOE, _mesh(shape)
    ref_params, _, ref = _reference("moe")
    params = jax.device_put(ref_params, param_shardings(param_specs(cfg), mesh, mode))
    with jax.set_mesh(mesh):
        out = _sharded_forward(params, "moe", mesh, mode)
        tokens, positions, mask = _reference("moe")[1]
        text = jit_stacked.lower(params, cfg, tokens, positions, mask).as_text()
    assert "manual_computation" in text or "shard_map" in text
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), atol=ATOL, rtol=0)


@needs_8
def test_params_created_sharded_by_jit_init():
    """``jit(init_params, out_shardings=...)`` places each leaf by the rules; forward agrees."""
    name, shape, mode = "smol", (1, 2, 4), "training"
    cfg, mesh = CONFIGS[name], _mesh(shape)
    shardings = param_shardings(param_specs(cfg), mesh, mode)
    params = jax.jit(functools.partial(init_params, cfg, scale=SCALE),
                     out_shardings=shardings)(jax.random.key(0))
    _assert_follows_rules(jax.tree.map(lambda x: x.sharding, params), cfg, mesh,
                          EXPECTED[(name, shape, mode)])
    out = _sharded_forward(params, name, mesh, mode)
    tokens, positions, mask = _reference(name)[1]
    gathered = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), params)  # one device
    ref = jit_stacked(gathered, cfg, tokens, positions, mask)
    assert 0.3 < float(ref.logits.std()) < 3
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), atol=ATOL, rtol=0)


@needs_8
@pytest.mark.parametrize("name,shape", [("qwen2", (2, 1, 4)), ("smol", (2, 1, 4))])
def test_sharded_kv_cache_prefill_and_decode_match_single_device(name, shape):
    cfg = CONFIGS[name]
    mesh = _mesh(shape)
    ref_params, (tokens, positions, _), _ = _reference(name)

    def prefill_and_step(params, cache, tokens, positions):
        next_token = tokens[:, :1]
        pre = jit_forward(params, cfg, tokens, positions, causal_mask(cache.end, T, MAX_LEN), cache)
        cache = pre.cache.replace(end=pre.cache.end + T)
        step = jit_forward(params, cfg, next_token, cache.end[:, None],
                           causal_mask(cache.end, 1, MAX_LEN), cache)
        return pre, step

    ref_pre, ref_step = prefill_and_step(to_serving(ref_params, cfg),
                                         KVCache.zeros(cfg, B, MAX_LEN), tokens, positions)

    # The serving layout (what load_target gives): converted from sharded stacked params and
    # placed by the serving rules (fused q/k/v keeps the kv-head split).
    stacked = jax.device_put(ref_params, param_shardings(param_specs(cfg), mesh, "serving"))
    want = param_shardings(serving_specs(cfg), mesh, "serving")
    params = to_serving(stacked, cfg, shardings=want)
    for got, spec in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
        assert got.sharding.is_equivalent_to(spec, got.ndim)
    if cfg.num_kv_heads % 4 == 0:
        assert params["layers"][0]["wqkv"].sharding.spec[0] == "tensor"
    cache = KVCache.zeros(cfg, B, MAX_LEN)
    cache = KVCache(k=tuple(_put(x, KV_CACHE_K_AXES, mesh, "serving") for x in cache.k),
                    v=tuple(_put(x, KV_CACHE_V_AXES, mesh, "serving") for x in cache.v),
                    end=_put(cache.end, ("batch",), mesh, "serving"))
    kv_spec = P("data", "tensor" if cfg.num_kv_heads % 4 == 0 else None, None, None)
    assert cache.k[0].sharding.is_equivalent_to(NamedSharding(mesh, kv_spec), 4)
    assert cache.v[0].sharding.is_equivalent_to(NamedSharding(mesh, kv_spec), 4)
    pre, step = prefill_and_step(params, cache, _put(tokens, ("batch", "seq"), mesh, "serving"),
                                 _put(positions, ("batch", "seq"), mesh, "serving"))
    # The updated cache keeps its placement, so a decode loop never reshards it.
    for got in step.cache.k + step.cache.v:
        assert got.sharding.is_equivalent_to(cache.k[0].sharding, 4)

    for got, want in ((pre, ref_pre), (step, ref_step)):
        np.testing.assert_allclose(np.asarray(got.logits), np.asarray(want.logits), atol=ATOL,
                                   rtol=0)
        np.testing.assert_allclose(np.stack(got.cache.k), np.stack(want.cache.k), atol=ATOL,
                                   rtol=0)


@needs_8
def test_fallbacks_name_the_replicated_head_axes():
    notes = describe_fallbacks(param_specs(SMOL), _mesh((1, 2, 4)), "training")
    assert any(n.startswith("q_heads (9)") for n in notes), notes
    assert any(n.startswith("kv_heads (3)") for n in notes), notes
    assert describe_fallbacks(param_specs(QWEN2), _mesh((1, 2, 4)), "training") == []


def test_mesh_config_errors_are_clear():
    with pytest.raises(MeshError, match="at most one mesh axis may be -1"):
        MeshConfig(data=-1, fsdp=-1)
    with pytest.raises(MeshError, match="positive or -1"):
        MeshConfig(data=0)
    with pytest.raises(MeshError, match="needs 4 devices but 8 are present"):
        MeshConfig(data=1, fsdp=2, tensor=2).resolve(8)
    with pytest.raises(MeshError, match="8 is not a multiple of 3"):
        MeshConfig(data=3, fsdp=-1).resolve(8)
    assert MeshConfig(data=2, fsdp=-1, tensor=2).resolve(8) == (2, 2, 2)
    assert MeshConfig().resolve(1) == (1, 1, 1)


def test_make_mesh_on_an_explicit_device_list():
    mesh = make_mesh(MeshConfig(fsdp=-1), devices=jax.devices()[:1])
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
    with pytest.raises(MeshError, match="needs 2 devices but 1"):
        make_mesh(MeshConfig(data=2, fsdp=1), devices=jax.devices()[:1])
