"""The training step sharded over a (data, fsdp, tensor) = (2, 2, 2) mesh of 8 CPU devices, with
the loop's own parameter / optimiser / batch shardings, equals the same step on one device."""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from eagle3_jax.data import make_train_iterator
from eagle3_jax.draft import DraftConfig, VocabMap
from eagle3_jax.model.params import param_specs
from eagle3_jax.sharding import MeshConfig, make_mesh, param_shardings
from eagle3_jax.train.loop import BATCH_AXES, _create_state, abstract_train_state
from eagle3_jax.train.step import OptimizerConfig, TargetInputs, train_step
from test_train import synthetic_records, tiny_target

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (emulated) devices")


def test_sharded_train_step_equals_single_device():
    target = tiny_target()
    tcfg = target.cfg
    dcfg = DraftConfig.for_target(tcfg, draft_vocab_size=48, ttt_steps=3)
    vocab = VocabMap.from_used_ids(np.arange(0, tcfg.vocab_size, 2), tcfg.vocab_size)
    optimizer = OptimizerConfig(learning_rate=1e-2, warmup_steps=1, total_steps=10).build()
    host = next(make_train_iterator(synthetic_records(), batch_size=16, max_len=32, seed=0,
                                    shard_index=0, shard_count=1))
    batch = {k: np.asarray(v).reshape(2, 8, *v.shape[1:]) for k, v in host.items()}  # [A, B, T]
    step = functools.partial(train_step, make_inputs=TargetInputs(tcfg, dcfg), draft_cfg=dcfg,
                             optimizer=optimizer)
    state = _create_state(dcfg, optimizer, jax.random.key(0))

    def run_twice(fn, state, params, vocab, batch):
        metrics = []
        for _ in range(2):
            state, m = fn(state, params, vocab, batch)
            metrics.append(jax.device_get(m))
        return jax.device_get(state.params), metrics

    single = run_twice(jax.jit(step), state, target.params, vocab, batch)

    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    _, state_sh = abstract_train_state(dcfg, optimizer, mesh)
    target_sh = param_shardings(param_specs(tcfg), mesh, "training")
    batch_sh = {k: NamedSharding(mesh, P(None, BATCH_AXES)) for k in batch}
    replicated = NamedSharding(mesh, P())
    sharded_step = jax.jit(step, in_shardings=(state_sh, target_sh, replicated, batch_sh),
                           out_shardings=(state_sh, replicated))
    put = lambda tree, sh: jax.device_put(tree, sh)  # noqa: E731
    sharded = run_twice(sharded_step, put(state, state_sh), put(target.params, target_sh),
                        put(vocab, replicated), put(batch, batch_sh))
    assert any(not s.is_fully_replicated for s in jax.tree.leaves(state_sh.params))

    for m_single, m_sharded in zip(single[1], sharded[1]):
        np.testing.assert_allclose(m_sharded["loss"], m_single["loss"], rtol=1e-5)
        np.testing.assert_allclose(m_sharded["acc_per_step"], m_single["acc_per_step"],
                                   atol=1e-6)
    for name in single[0]:
        np.testing.assert_allclose(sharded[0][name], single[0][name], atol=1e-5, err_msg=name)
