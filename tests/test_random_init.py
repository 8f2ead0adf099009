"""``normal_values``: the random weights of ``init_params`` / ``init_draft_params``, drawn from a
few compiled programs, equal the plain ``jax.random.normal`` draw value for value."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.model.random_init import normal_values


@pytest.mark.parametrize("shape", [(), (1,), (3,), (5, 7), (64,), (6, 32, 64), (0, 4)])
@pytest.mark.parametrize("scale,offset,dtype", [(0.3, None, "float32"), (0.1, 1.0, "float32"),
                                                (0.02, None, "bfloat16"),
                                                (0.1, 1.0, "bfloat16")])
def test_equals_the_plain_draw(shape, scale, offset, dtype):
    key = jax.random.key(7)
    noise = jax.random.normal(key, shape, jnp.float32)
    want = (noise * scale if offset is None else offset + scale * noise).astype(dtype)
    got = normal_values(key, shape, scale, offset, dtype)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_under_jit_it_is_the_plain_draw():
    key = jax.random.key(3)
    got = jax.jit(lambda k: normal_values(k, (4, 6), 0.5, 1.0))(key)
    want = jax.jit(lambda k: 1.0 + 0.5 * jax.random.normal(k, (4, 6)))(key)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
