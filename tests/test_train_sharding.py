"""The training step sharded over a (data, fsdp, tensor) = (2, 2, 2) mesh of 8 CPU devices, with
the loop's own parameter / optimiser / batch shardings, equals the same step on one device.

The two runs differ only in the order float32 partial sums are added (the mesh splits every
reduction over the batch and the hidden axes), so what is determined, and compared tightly, is
what depends smoothly on those sums: loss, gradients, and parameters after plain SGD steps.
AdamW is compared with an element-wise bound derived from its update (see
``adamw_tolerance``): its first step maps a gradient near zero to anything in [-lr, lr], so a
fixed atol would be either unsound or too loose to mean anything.
"""

import functools

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from eagle3_jax.data import make_train_iterator
from eagle3_jax.draft import DraftConfig, VocabMap
from eagle3_jax.model.params import param_specs
from eagle3_jax.sharding import MeshConfig, make_mesh, param_shardings
from eagle3_jax.train.inputs import TargetInputs
from eagle3_jax.train.loop import BATCH_AXES, _create_state, abstract_train_state
from eagle3_jax.train.step import train_step
from test_train import synthetic_records, tiny_target

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (emulated) devices")

# Gradient entries are sums of per-token contributions over the batch's 2 x 8 x 32 = 512 tokens
# (and over hidden axes the mesh splits). Summing in another order moves a float32 sum by about
# sqrt(n) ulps of the summed magnitude typically and n ulps at worst (n = 512: 512 * 2^-24 =
# 3e-5). 1e-5 of each tensor's largest entry lies between the two; measured: <= 1.3e-6.
GRAD_RTOL_OF_MAX = 1e-5
SGD_LR = 1.0  # the update equals the gradient, so a wrong gradient moves the params visibly
ADAM_LR, ADAM_EPS = 1e-2, 1e-8


@pytest.fixture(scope="module")
def setup():
    target = tiny_target()
    tcfg = target.cfg
    dcfg = DraftConfig.for_target(tcfg, draft_vocab_size=48, ttt_steps=3)
    vocab = VocabMap.from_used_ids(np.arange(0, tcfg.vocab_size, 2), tcfg.vocab_size)
    host = next(make_train_iterator(synthetic_records(), batch_size=16, max_len=32, seed=0,
                                    shard_index=0, shard_count=1))
    batch = {k: np.asarray(v).reshape(2, 8, *v.shape[1:]) for k, v in host.items()}  # [A, B, T]
    return target, dcfg, vocab, batch


def run_both(setup, optimizer, steps):
    """(single-device, sharded) runs of ``steps`` train_steps from the same initial state.

    Each run is (initial state, [state after each step], [metrics of each step]), on the host.
    """
    target, dcfg, vocab, batch = setup
    tcfg = target.cfg
    step = functools.partial(train_step, make_inputs=TargetInputs(tcfg, dcfg), draft_cfg=dcfg,
                             optimizer=optimizer)
    state = _create_state(dcfg, optimizer, jax.random.key(0))

    def run(fn, state, params, vocab, batch):
        states, metrics = [], []
        for _ in range(steps):
            state, m = fn(state, params, vocab, batch)
            states.append(jax.device_get(state))
            metrics.append(jax.device_get(m))
        return states, metrics

    single = run(jax.jit(step), state, target.params, vocab, batch)

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    _, state_sh = abstract_train_state(dcfg, optimizer, mesh)
    assert any(not s.is_fully_replicated for s in jax.tree.leaves(state_sh.params))
    target_sh = param_shardings(param_specs(tcfg), mesh, "training")
    batch_sh = {k: NamedSharding(mesh, P(None, BATCH_AXES)) for k in batch}
    replicated = NamedSharding(mesh, P())
    sharded_step = jax.jit(step, in_shardings=(state_sh, target_sh, replicated, batch_sh),
                           out_shardings=(state_sh, replicated))
    put = jax.device_put
    with jax.set_mesh(mesh):  # as the loop runs it: activations keep the batch split
        sharded = run(sharded_step, put(state, state_sh), put(target.params, target_sh),
                      put(vocab, replicated), put(batch, batch_sh))
    return jax.device_get(state), single, sharded


def grad_atol(grads):
    """Per-tensor absolute gradient tolerance (GRAD_RTOL_OF_MAX of its largest entry)."""
    return {name: GRAD_RTOL_OF_MAX * float(np.max(np.abs(g))) for name, g in grads.items()}


@pytest.fixture(scope="module")
def sgd_runs(setup):
    # momentum=0.0 (not None) keeps optax's trace state, which then holds exactly the step's
    # mean gradient: trace = g + 0 * trace.
    return run_both(setup, optax.sgd(SGD_LR, momentum=0.0), steps=2)


def test_sharded_sgd_steps_equal_single_device(sgd_runs):
    _, (single_states, single_metrics), (sharded_states, sharded_metrics) = sgd_runs
    for m_single, m_sharded in zip(single_metrics, sharded_metrics):
        np.testing.assert_allclose(m_sharded["loss"], m_single["loss"], rtol=1e-5)
        np.testing.assert_allclose(m_sharded["grad_norm"], m_single["grad_norm"], rtol=1e-5)
        np.testing.assert_allclose(m_sharded["acc_per_step"], m_single["acc_per_step"],
                                   atol=1e-6)
    for s_single, s_sharded in zip(single_states, sharded_states):
        grads, sharded_grads = s_single.opt_state[0].trace, s_sharded.opt_state[0].trace
        atol = grad_atol(grads)
        for name in grads:
            np.testing.assert_allclose(sharded_grads[name], grads[name], rtol=0,
                                       atol=atol[name], err_msg=name)
            # SGD with lr 1 adds the gradient error, plus one rounding at the params' scale.
            spacing = np.spacing(np.abs(s_single.params[name]).max())
            np.testing.assert_allclose(s_sharded.params[name], s_single.params[name], rtol=0,
                                       atol=2 * atol[name] + 2 * spacing, err_msg=name)


def adamw_tolerance(grads, atol, params):
    """Element-wise bound on |sharded - single| params after one AdamW step from equal params.

    The first AdamW step (bias-corrected mu = g, nu = g^2, no weight decay) updates each entry
    by u(g) = -lr * g / (|g| + eps). So |u| < lr, and |u'(g)| = lr * eps / (|g| + eps)^2, largest
    at g = 0 (lr / eps = 1e6 here: why a fixed atol fails). With the two runs' gradients at most
    d = atol apart (asserted by the SGD test), the mean value theorem bounds the update gap by
    lr * eps * d / (max(|g| - d, 0) + eps)^2, and by 2 lr in any case. Add the rounding of the
    ratio (a few float32 ulps of lr) and of p + u (one ulp of the params each side).
    """
    f32_eps = np.finfo(np.float32).eps
    out = {}
    for name, g in grads.items():
        d = atol[name]
        slope_bound = ADAM_LR * ADAM_EPS * d / (np.maximum(np.abs(g) - d, 0.0) + ADAM_EPS) ** 2
        out[name] = (np.minimum(slope_bound, 2 * ADAM_LR) + 4 * f32_eps * ADAM_LR
                     + 2 * np.spacing(np.abs(params[name]).astype(np.float32)))
    return out


def test_sharded_adamw_step_within_derived_bound(setup, sgd_runs):
    initial, (sgd_states, _), _ = sgd_runs
    grads = sgd_states[0].opt_state[0].trace  # the gradient at the initial params
    optimizer = optax.adamw(ADAM_LR, b1=0.9, b2=0.95, eps=ADAM_EPS, weight_decay=0.0)
    start, (single_states, single_metrics), (sharded_states, sharded_metrics) = run_both(
        setup, optimizer, steps=1)
    for name in initial.params:  # both optimisers start from the same draft params
        np.testing.assert_array_equal(start.params[name], initial.params[name])
    np.testing.assert_allclose(sharded_metrics[0]["loss"], single_metrics[0]["loss"], rtol=1e-5)
    single, sharded = single_states[0].params, sharded_states[0].params
    tol = adamw_tolerance(grads, grad_atol(grads), single)
    for name in single:
        gap = np.abs(sharded[name] - single[name])
        assert np.all(gap <= tol[name]), (name, float(np.max(gap - tol[name])))
        # The step moved the params by about lr: the bound is not vacuous where |g| >> eps.
        moved = np.abs(single[name] - initial.params[name])
        assert np.median(moved) > 0.5 * ADAM_LR, name


# A global batch of 24 sequences (3 a device on fsdp = 8): no dimension of the tiny target or
# draft is 24, 24 x 32 = 768 (batch x tokens, flattened) or 24 x 37 (the TTT's padded tokens).
FSDP_BATCH, FSDP_LEN = 24, 32


def test_fsdp_step_keeps_each_devices_own_sequences():
    """Under FSDP every device runs its own sequences: no array of the compiled step holds the
    global batch. Without activation constraints XLA split the activations along the features
    the weights are split on and gathered the batch, so every device ran the target, the labels
    and the draft on all 24 sequences (the TPU plans' temporaries showed [64, 2048, ...] on every
    chip)."""
    import re

    target = tiny_target()
    tcfg = target.cfg
    dcfg = DraftConfig.for_target(tcfg, draft_vocab_size=48, ttt_steps=3)
    optimizer = optax.adamw(1e-3)
    mesh = make_mesh(MeshConfig(data=1, fsdp=8, tensor=1))
    shapes, state_sh = abstract_train_state(dcfg, optimizer, mesh)
    target_sh = param_shardings(param_specs(tcfg), mesh, "training")
    replicated = NamedSharding(mesh, P())
    abstract = lambda tree, sh: jax.tree.map(  # noqa: E731
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh)
    vocab = VocabMap.from_used_ids(np.arange(48), tcfg.vocab_size)
    batch = {k: jax.ShapeDtypeStruct((1, FSDP_BATCH, FSDP_LEN),
                                     bool if k == "loss_mask" else np.int32,
                                     sharding=NamedSharding(mesh, P(None, BATCH_AXES)))
             for k in ("tokens", "loss_mask", "segment_ids", "positions")}
    step = jax.jit(functools.partial(train_step, make_inputs=TargetInputs(tcfg, dcfg),
                                     draft_cfg=dcfg, optimizer=optimizer),
                   out_shardings=(state_sh, replicated))
    with jax.set_mesh(mesh):
        hlo = step.lower(abstract(shapes, state_sh), abstract(target.params, target_sh),
                         abstract(vocab, jax.tree.map(lambda _: replicated, vocab)),
                         batch).compile().as_text()
    # Floating-point arrays only: the token ids are all-gathered, which is cheap and right.
    dims = [[int(d) for d in m.split(",")]
            for m in re.findall(r"(?:f32|bf16)\[(\d+(?:,\d+)*)\]", hlo)]
    local, feature_shard = FSDP_BATCH // 8, tcfg.hidden_size // 8
    assert any(d[:2] == [local, FSDP_LEN] for d in dims)  # the per-device [B/8, T, ...] arrays
    global_sizes = {FSDP_BATCH, FSDP_BATCH * FSDP_LEN, FSDP_BATCH * (FSDP_LEN + 5)}
    # The draft's embedding lookup reads the table where it lies (split over its features):
    # every sequence's token, D/8 of its features, as many bytes as this device's own rows.
    offending = sorted({str(d) for d in dims if global_sizes & set(d) and d[-1] != feature_shard})
    assert not offending, f"arrays with the global batch on a device: {offending[:8]}"
