"""The mixture-of-experts MLP (``eagle3_jax/model/moe.py``) against independent references.

- ``route`` and ``moe_mlp`` (and its fused and all-experts forms) equal transformers'
  Qwen3MoeSparseMoeBlock (``norm_topk_prob`` on and off) and MixtralSparseMoeBlock on tiny
  random float32 configs, eval mode.
- The blocked grouped matmul equals a NumPy per-group product for empty groups, one group
  holding every row, rows past the groups, and a single row.
- Only routed experts are read: NaN in every expert no token picked leaves the output finite
  and equal to the clean one (a dense form gives NaN, since 0 * NaN = NaN; the test checks that
  ``lax.ragged_dot``, dense on CPU, and ``moe_mlp_all_experts`` do).
- The TPU lowering is a ragged dot; the CPU lowering is not.
- Expert-parallel over 4 and 8 of the 8 emulated CPU devices equals the unsharded call.

Tolerance: float32 throughout; the two sides differ only in summation order (~1e-7 on outputs
of std ~0.1 to 1), so atol 1e-5 is a fixed bound well above that.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import NamedSharding, PartitionSpec as P

from eagle3_jax.model import moe
from eagle3_jax.model.moe import (block_rows, grouped_matmul, grouped_matmul_blocked, moe_mlp,
                                  moe_mlp_all_experts, moe_mlp_fused, route)

torch.set_num_threads(1)  # small references; a second thread spins against the other worker

ATOL = 1e-5

# Tiny configs of the two families: hidden 32, expert width 24, 8 experts, top-2.
HF_BLOCKS = {
    "qwen3_moe_norm": (transformers.Qwen3MoeConfig, dict(
        hidden_size=32, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True)),
    "qwen3_moe_no_norm": (transformers.Qwen3MoeConfig, dict(
        hidden_size=32, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=False)),
    "qwen3_moe_gelu_tanh": (transformers.Qwen3MoeConfig, dict(
        hidden_size=32, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, hidden_act="gelu_pytorch_tanh")),
    "mixtral": (transformers.MixtralConfig, dict(
        hidden_size=32, intermediate_size=24, num_local_experts=8, num_experts_per_tok=2)),
}


def hf_block(name: str, seed: int = 0):
    """The family's sparse MoE block in eval mode with normal(0, 0.2) weights (router rows
    normal(0, 0.3): logits of std ~1.7 give each of the k choices a real share, and float32
    rounding cannot swap two of them). Experts run by the readable per-expert
    loop (``experts_implementation="eager"``), not torch's grouped_mm."""
    config_cls, kwargs = HF_BLOCKS[name]
    config = config_cls(**kwargs)
    config._experts_implementation = "eager"
    block = (transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock
             if config_cls is transformers.Qwen3MoeConfig
             else transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock)(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in block.named_parameters():
            std = 0.3 if pname == "gate.weight" else 0.2
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return block.eval(), config


def hf_moe_weights(block) -> dict[str, np.ndarray]:
    """Our arrays from an HF sparse MoE block (transformers 5; Qwen3-MoE and Mixtral alike).

    In memory, under ``model.layers.{i}.mlp.``:
      ``gate.weight``          [E, D]     -> router [E, D] as is (HF [out, in]).
      ``experts.gate_up_proj`` [E, 2F, D] -> w_gate = [:, :F, :] and w_up = [:, F:, :], each
                                             transposed to [E, D, F] (x @ w).
      ``experts.down_proj``    [E, D, F]  -> w_down [E, F, D] (transposed).
    ``save_pretrained`` (and the hub checkpoints) write one [out, in] tensor per expert:
    Qwen3-MoE ``mlp.experts.{e}.gate_proj.weight`` [F, D], ``up_proj`` [F, D], ``down_proj``
    [D, F] and ``mlp.gate.weight``; Mixtral ``block_sparse_moe.experts.{e}.w1.weight`` (gate),
    ``w3`` (up), ``w2`` (down) and ``block_sparse_moe.gate.weight``. So w_gate[e] =
    gate_proj(w1)[e].T, w_up[e] = up_proj(w3)[e].T, w_down[e] = down_proj(w2)[e].T.
    """
    sd = {k: v.detach().numpy() for k, v in block.state_dict().items()}
    gate_up = sd["experts.gate_up_proj"]
    f = gate_up.shape[1] // 2
    return dict(router=sd["gate.weight"],
                w_gate=gate_up[:, :f, :].transpose(0, 2, 1),
                w_up=gate_up[:, f:, :].transpose(0, 2, 1),
                w_down=sd["experts.down_proj"].transpose(0, 2, 1))


def _options(config) -> dict:
    normalize = getattr(config, "norm_topk_prob", True)  # Mixtral always normalises
    activation = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}[config.hidden_act]
    return dict(top_k=config.num_experts_per_tok, normalize=normalize, activation=activation)


@pytest.mark.parametrize("name", ["qwen3_moe_norm", "qwen3_moe_no_norm", "mixtral"])
def test_route_matches_hf(name):
    block, config = hf_block(name)
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, hf_weights, hf_experts = block.gate(x)
    w = hf_moe_weights(block)
    opts = _options(config)
    weights, experts = route(jnp.asarray(x.numpy()), jnp.asarray(w["router"]), opts["top_k"],
                             opts["normalize"])
    assert weights.dtype == jnp.float32 and experts.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(experts), hf_experts.numpy())
    np.testing.assert_allclose(np.asarray(weights), hf_weights.numpy(), atol=1e-6)
    if opts["normalize"]:
        np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, atol=1e-6)
    else:
        assert np.all(np.asarray(weights).sum(-1) < 1.0 - 1e-3)  # the other 6 keep a share


@pytest.mark.parametrize("name", list(HF_BLOCKS))
def test_moe_mlp_matches_hf(name):
    block, config = hf_block(name)
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = block(x).numpy().reshape(14, 32)
    w = {k: jnp.asarray(v) for k, v in hf_moe_weights(block).items()}
    xj = jnp.asarray(x.numpy().reshape(14, 32))
    opts = _options(config)
    got = jax.jit(functools.partial(moe_mlp, **opts))(
        xj, w["router"], w["w_gate"], w["w_up"], w["w_down"])
    assert got.shape == (14, 32) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), expected, atol=ATOL)
    dense = jax.jit(functools.partial(moe_mlp_all_experts, **opts))(
        xj, w["router"], w["w_gate"], w["w_up"], w["w_down"])
    np.testing.assert_allclose(np.asarray(dense), expected, atol=ATOL)
    if name == "qwen3_moe_norm":  # the fused gate/up layout gives the same products
        fused = jax.jit(functools.partial(moe_mlp_fused, **opts))(
            xj, w["router"], jnp.concatenate([w["w_gate"], w["w_up"]], axis=-1), w["w_down"])
        np.testing.assert_allclose(np.asarray(fused), expected, atol=ATOL)


def _grouped_reference(x, w, sizes):
    """NumPy float64: row r of group g is x[r] @ w[g]; rows past sum(sizes) are zero."""
    out = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for g, size in enumerate(sizes):
        out[start:start + size] = x[start:start + size].astype(np.float64) @ w[g]
        start += size
    return out


@pytest.mark.parametrize("rows,sizes", [
    (8, [3, 0, 5, 0]),          # empty groups between and after
    (12, [0, 12, 0]),           # one group holds every row
    (9, [2, 0, 3]),             # sum < M: the last 4 rows are zero
    (1, [0, 1, 0, 0]),          # a single row (decode, top-1)
    (4, [0, 0, 0]),             # no rows at all
    (300, [130, 0, 169, 1]),    # m = 128: groups spanning several blocks, a partial last one
])
@pytest.mark.parametrize("form", ["loop", "gathered"])
def test_grouped_matmul_off_tpu_matches_numpy(rows, sizes, form):
    """Both forms off TPU: the loop over row blocks and (few rows) the gathered weights."""
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 16)).astype(np.float32)
    w = rng.standard_normal((len(sizes), 16, 12)).astype(np.float32)
    fn = moe.grouped_matmul_loop if form == "loop" else moe.grouped_matmul_gathered
    got = np.asarray(jax.jit(fn)(x, w, jnp.asarray(sizes, jnp.int32)))
    expected = _grouped_reference(x, w, sizes)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-5)
    assert np.all(got[sum(sizes):] == 0)


def test_block_rows():
    assert block_rows(1, 128) == 8          # decode: one token, many experts
    assert block_rows(8 * 2048, 128) == 128  # prefill: capped at a full tile
    assert block_rows(300, 4) == 128
    assert block_rows(40, 4) == 16


def _skewed_moe(tokens: int, experts: int, seed: int):
    """x [tokens, 32] and weights of ``experts`` experts (width 16) where every token's
    coordinate 0 is ~3 and the router rows of the odd experts have -4 there: those experts'
    logits sit ~20 below the others, so no token routes to them (checked by the caller)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, 32)).astype(np.float32)
    x[:, 0] = 3.0 + 0.1 * rng.standard_normal(tokens)
    router = rng.standard_normal((experts, 32)).astype(np.float32)
    router[1::2, 0] = -4.0
    router[0::2, 0] = 1.0
    w_gate = 0.2 * rng.standard_normal((experts, 32, 16)).astype(np.float32)
    w_up = 0.2 * rng.standard_normal((experts, 32, 16)).astype(np.float32)
    w_down = 0.2 * rng.standard_normal((experts, 16, 32)).astype(np.float32)
    return x, router, w_gate, w_up, w_down


def _poison_unrouted(router, x, top_k, *weights):
    """Each expert array with NaN in every expert no token routes to; also returns their ids."""
    _, chosen = route(jnp.asarray(x), jnp.asarray(router), top_k, True)
    unrouted = np.setdiff1d(np.arange(router.shape[0]), np.asarray(chosen))
    poisoned = []
    for w in weights:
        w = w.copy()
        w[unrouted] = np.nan
        poisoned.append(w)
    return unrouted, poisoned


def test_few_rows_are_gathered_and_many_looped():
    shape = jax.ShapeDtypeStruct
    w = shape((64, 512, 256), jnp.float32)  # the bench's experts (bench/families.py)
    sizes = shape((64,), jnp.int32)
    decode = jax.jit(grouped_matmul_blocked).lower(shape((8, 512), jnp.float32), w, sizes)
    assert "while" not in decode.as_text()  # a decode step's 8 rows: one gathered product
    more = jax.jit(grouped_matmul_blocked).lower(shape((32, 512), jnp.float32), w, sizes)
    assert "while" in more.as_text()


@pytest.mark.parametrize("form", ["loop", "gathered"])
@pytest.mark.parametrize("tokens,experts", [(3, 16), (96, 16)], ids=["decode", "prefill"])
def test_only_routed_experts_are_read(tokens, experts, form, monkeypatch):
    monkeypatch.setattr(moe, "GATHER_BYTES", 0 if form == "loop" else 2**40)
    x, router, *weights = _skewed_moe(tokens, experts, seed=tokens)
    top_k = 2
    unrouted, poisoned = _poison_unrouted(router, x, top_k, *weights)
    # Decode routes 3 tokens to at most 6 of the 16 experts; prefill to the 8 even ones at
    # most, so each case poisons at least half the experts.
    assert len(unrouted) >= 8
    mlp = functools.partial(moe_mlp, top_k=top_k, normalize=True)
    clean = np.asarray(jax.jit(mlp)(x, router, *weights))
    got = np.asarray(jax.jit(mlp)(x, router, *poisoned))
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, clean, atol=ATOL)
    if tokens <= 4 and form == "loop":
        # The test can fail: ragged_dot, which XLA lowers densely on CPU, reads every expert
        # for every row and gives NaN everywhere (checked with jax 0.10.2).
        # (A new partial: jit would reuse the trace cached for ``mlp``.)
        monkeypatch.setattr(moe, "grouped_matmul", moe._grouped_matmul_ragged)
        dense_mlp = functools.partial(moe_mlp, top_k=top_k, normalize=True)
        dense = np.asarray(jax.jit(dense_mlp)(x, router, *poisoned))
        assert np.all(np.isnan(dense))
        assert np.all(np.isnan(jax.jit(functools.partial(moe_mlp_all_experts, top_k=top_k,
                                                         normalize=True))(x, router, *poisoned)))


def test_tpu_lowering_is_a_ragged_dot():
    x = jax.ShapeDtypeStruct((64, 32), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((8, 32, 16), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((8,), jnp.int32)
    traced = jax.jit(grouped_matmul).trace(x, w, sizes)
    try:
        tpu = traced.lower(lowering_platforms=("tpu",)).as_text()
    except Exception as e:  # lowering for TPU needs no TPU in jax 0.10, but say so if it does
        pytest.skip(f"cannot lower for tpu on this host: {e}")
    cpu = traced.lower(lowering_platforms=("cpu",)).as_text()
    assert "ragged_dot" in tpu
    assert "ragged_dot" not in cpu


def _expert_mesh(shape, names):
    if len(jax.devices()) < 8:
        pytest.skip("needs the 8 emulated CPU devices of tests/xla_flags.py")
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names),
                         devices=jax.devices()[:int(np.prod(shape))])


@pytest.mark.parametrize("shape,names,experts", [
    ((4,), ("expert",), 8),                   # two experts a device
    ((2, 4), ("data", "expert"), 8),          # tokens sharded over data, experts over expert
    ((8,), ("expert",), 8),                   # one expert a device
    ((4,), ("expert",), 6),                   # 4 does not divide 6: the unsharded call
])
def test_expert_parallel_equals_unsharded(shape, names, experts):
    mesh = _expert_mesh(shape, names)
    rng = np.random.default_rng(experts)
    x = rng.standard_normal((24, 32)).astype(np.float32)
    router = rng.standard_normal((experts, 32)).astype(np.float32)
    w_gate, w_up = (0.2 * rng.standard_normal((2, experts, 32, 16))).astype(np.float32)
    w_down = (0.2 * rng.standard_normal((experts, 16, 32))).astype(np.float32)
    opts = dict(top_k=2, normalize=True)
    expected = np.asarray(jax.jit(functools.partial(moe_mlp, **opts))(
        x, router, w_gate, w_up, w_down))

    def put(a, spec):
        return jax.device_put(a, NamedSharding(mesh, spec))

    divides = experts % mesh.shape["expert"] == 0
    expert_spec = P("expert") if divides else P()
    args = (put(x, P("data") if "data" in names else P()), put(router, P()),
            put(w_gate, expert_spec), put(w_up, expert_spec), put(w_down, expert_spec))
    sharded = jax.jit(functools.partial(moe_mlp, mesh=mesh, expert_axis="expert", **opts))
    got = sharded(*args)
    np.testing.assert_allclose(np.asarray(got), expected, atol=ATOL)
    if divides:  # each device multiplies only its own experts: the program sums over devices
        assert "all-reduce" in sharded.lower(*args).compile().as_text()
