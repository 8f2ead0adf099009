"""The CPU kernel for cached attention (``eagle3_jax.kernels.attention``) against XLA.

The reference is the model's own XLA formulation (``layers._cached_attention_xla``: RoPE, the
two-block softmax of ``layers.attention``), itself pinned to HF transformers by the target
tests; here also against a float64 NumPy implementation written from the definition. Pinned at
fixed tolerances for the head layout of every shipped preset, at the token counts decoding uses
(1 to 64), with causal and tree masks and caches of different fill per row; inside ``jit`` and
a ``while_loop``; differentiable; and the XLA formulation is what runs when the kernel is
absent, switched off, or lowered for another backend.
"""

from __future__ import annotations

import platform
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.kernels import attention as ka
from eagle3_jax.kernels import library
from eagle3_jax.model import layers
from eagle3_jax.presets import list_presets, load_preset

KERNEL_EXPECTED = platform.machine() in ("x86_64", "AMD64") and shutil.which("c++") is not None
needs_kernel = pytest.mark.skipif(not KERNEL_EXPECTED,
                                  reason="the kernel needs x86-64 and a C++ compiler")
# Outputs are convex combinations of order-one values: absolute round-off of a few float32 eps
# (different summation orders and exp polynomials); keys are rotated by the same formula.
ATOL_OUT, ATOL_K = 4e-6, 1e-6


@pytest.fixture(autouse=True)
def _default_switch():
    previous = library.set_kernel_enabled(None)
    yield
    library.set_kernel_enabled(previous)


def _head_layouts() -> set[tuple[int, int, int]]:
    """(query heads, kv heads, head dim) of every preset whose attention the kernel runs (its
    head dims are 16..128 by 16; Gemma-3-1B's 256 runs XLA's attention: checked below)."""
    layouts = set()
    for name in list_presets():
        c = load_preset(name).target
        if ka.uses_attention_kernel((1, 1, c.num_heads, c.head_dim), c.num_kv_heads,
                                    jnp.float32) or not ka.kernel_available():
            layouts.add((c.num_heads, c.num_kv_heads, c.head_dim))
    return layouts


def _rope_cos_sin(positions: np.ndarray, h: int) -> tuple[np.ndarray, np.ndarray]:
    """RoPE (theta 10000) of ``positions`` [B, T] as ``layers.rope_cos_sin`` makes it, in
    float32 NumPy (no XLA program to compile for each shape): (cos, sin) [B, T, H/2]."""
    inv_freq = 1.0 / np.float32(10000.0) ** (np.arange(0, h, 2, dtype=np.float32) / np.float32(h))
    angles = positions.astype(np.float32)[..., None] * inv_freq
    return np.cos(angles), np.sin(angles)


def _operands(b, t, n, kv, h, slots, ends, seed, tree=True):
    """The nine operands for T new tokens after ``ends`` [B] cached tokens: a random mask over
    the committed slots (a tree verification sees a subset), a random tree (ancestors: lower
    triangle, each token sees itself) or the causal mask over the new tokens. NumPy arrays (a
    program takes them as they are; ``jnp.asarray`` compiles a copy for each new shape)."""
    rng = np.random.default_rng(seed)
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    ends = np.asarray(ends)
    positions = ends[:, None] + np.arange(t)[None]
    cos, sin = _rope_cos_sin(positions, h)
    m_past = (np.arange(slots)[None, None] < ends[:, None, None]) & (rng.random((b, t, slots)) < 0.9)
    causal = np.tril(np.ones((t, t), bool))[None]
    m_new = (causal & (rng.random((b, t, t)) < 0.6) | np.eye(t, dtype=bool)) if tree else causal
    m_new = np.broadcast_to(m_new, (b, t, t))
    return [np.ascontiguousarray(a) for a in (f32(b, t, n, h), f32(b, t, kv, h), f32(b, t, kv, h),
                                              cos, sin, f32(b, kv, h, slots), f32(b, kv, slots, h),
                                              m_past, m_new)]


def _kernel_call(*args):
    return ka.cached_attention(*args, xla=layers._cached_attention_xla)


def _numpy_reference(q, k_new, v_new, cos, sin, k_past, v_past, m_past, m_new):
    """Float64, from the definition: rotate-half RoPE, then per query head n (kv head n // G)
    softmax over the visible cache slots and new tokens of q.k / sqrt(H), times the values."""
    q, k_new, v_new, cos, sin, k_past, v_past = (np.asarray(a, np.float64) for a in
                                                (q, k_new, v_new, cos, sin, k_past, v_past))
    m_past, m_new = np.asarray(m_past), np.asarray(m_new)

    def rot(x):
        half = x.shape[-1] // 2
        c, s = cos[:, :, None], sin[:, :, None]
        return np.concatenate([x[..., :half] * c - x[..., half:] * s,
                               x[..., half:] * c + x[..., :half] * s], -1)

    q, k_rot = rot(q), rot(k_new)
    b, t, n, h = q.shape
    g = n // k_new.shape[2]
    out = np.zeros_like(q)
    for bi in range(b):
        for ti in range(t):
            for ni in range(n):
                kh = ni // g
                keys = np.concatenate([k_past[bi, kh].T, k_rot[bi, :, kh]])  # [S + T, H]
                vals = np.concatenate([v_past[bi, kh], v_new[bi, :, kh]])
                seen = np.concatenate([m_past[bi, ti], m_new[bi, ti]])
                if not seen.any():
                    continue
                scores = keys[seen] @ q[bi, ti, ni] / np.sqrt(h)
                p = np.exp(scores - scores.max())
                out[bi, ti, ni] = (p / p.sum()) @ vals[seen]
    return out, k_rot


@needs_kernel
def test_the_kernel_is_built_and_lowered_here():
    assert "in use" in library.kernel_status(), library.kernel_status()
    args = _operands(1, 4, 4, 2, 16, 24, [10], 0)
    assert ka.FFI_TARGET in jax.jit(_kernel_call).lower(*args).as_text()
    assert ka.uses_attention_kernel((1, 4, 4, 16), 2, jnp.float32)
    assert not ka.uses_attention_kernel((1, 65, 4, 16), 2, jnp.float32)  # more tokens than taken
    assert not ka.uses_attention_kernel((1, 4, 4, 24), 2, jnp.float32)  # head dim not by 16
    assert not ka.uses_attention_kernel((1, 4, 4, 16), 2, jnp.bfloat16)
    assert not ka.uses_attention_kernel((1, 4, 4, 256), 1, jnp.float32)  # Gemma-3-1B's heads


@needs_kernel
@pytest.mark.parametrize("layout", sorted(_head_layouts()),
                         ids=[f"heads{n}-kv{kv}-dim{h}" for n, kv, h in sorted(_head_layouts())])
@pytest.mark.parametrize("t", (1, 2, 8, 17, 64))
def test_matches_xla_for_every_preset_layout(layout, t):
    """Each preset's (heads, kv heads, head dim); two rows whose caches hold different counts
    (one past a 32-slot block boundary, one not); a tree mask over the new tokens."""
    n, kv, h = layout
    slots = 80
    args = _operands(2, t, n, kv, h, slots, [37, 80 - t if t < 40 else 3], seed=t + n + h)
    got_out, got_k = jax.jit(_kernel_call)(*args)
    want_out, want_k = jax.jit(layers._cached_attention_xla)(*args)
    np.testing.assert_allclose(np.asarray(got_out), np.asarray(want_out), rtol=0, atol=ATOL_OUT)
    np.testing.assert_allclose(np.asarray(got_k), np.asarray(want_k), rtol=0, atol=ATOL_K)


@needs_kernel
@pytest.mark.parametrize("tree", (False, True))
def test_matches_a_float64_implementation_of_the_definition(tree):
    args = _operands(2, 6, 6, 2, 32, 40, [0, 33], seed=3, tree=tree)
    got_out, got_k = jax.jit(_kernel_call)(*args)
    want_out, want_k = _numpy_reference(*args)
    np.testing.assert_allclose(np.asarray(got_out), want_out, rtol=0, atol=ATOL_OUT)
    np.testing.assert_allclose(np.asarray(got_k), want_k, rtol=0, atol=ATOL_K)


@needs_kernel
@pytest.mark.parametrize("t, slots, ends", [(8, 300, [290, 7]), (1, 256, [256, 131]),
                                            (16, 512, [200, 64]), (3, 1024, [700, 0])])
def test_long_caches_read_in_chunks_match_float64(t, slots, ends):
    """SmolLM2's 9/3 heads of 64 over caches of several 64-slot chunks (the kernel reads keys and
    values a chunk at a time, copying keys at power-of-two slot counts): full and partial last
    chunks, a full cache, an empty one; 3 to 48 query rows per kv head (one task, or several
    of up to 12 rows)."""
    args = _operands(2, t, 9, 3, 64, slots, ends, seed=slots + t)
    got_out, got_k = jax.jit(_kernel_call)(*args)
    want_out, want_k = _numpy_reference(*args)
    np.testing.assert_allclose(np.asarray(got_out), want_out, rtol=0, atol=ATOL_OUT)
    np.testing.assert_allclose(np.asarray(got_k), want_k, rtol=0, atol=ATOL_K)


@needs_kernel
@pytest.mark.parametrize("t, ends, window", [(1, [700, 300], 128), (16, [900, 250], 100)])
def test_sliding_windows_match_float64_and_skip_nothing_they_see(t, ends, window):
    """Sliding-window masks (a token sees the last W positions; rows of different fill): the
    kernel starts reading at the first 64-slot chunk any row of a task sees. Float64 reference,
    and exactly the result of the same mask with the slots before the window poisoned
    (NaN keys and values there would reach the output if they were read)."""
    args = _operands(2, t, 9, 3, 64, 1024, ends, seed=window + t, tree=False)
    ends = np.asarray(ends)
    positions = ends[:, None] + np.arange(t)[None]
    slots = np.arange(1024)[None, None]
    args[7] = np.ascontiguousarray((slots < ends[:, None, None])
                                   & (slots > positions[:, :, None] - window))
    args[8] = np.ascontiguousarray(args[8] & (positions[:, None, :] > positions[:, :, None] - window))
    got_out, _ = jax.jit(_kernel_call)(*args)
    want_out, _ = _numpy_reference(*args)
    np.testing.assert_allclose(np.asarray(got_out), want_out, rtol=0, atol=ATOL_OUT)
    poisoned = list(args)
    before = slots[0, 0] < ends.min() - t - window - 64  # whole chunks no row sees
    assert before.sum() >= 64
    for i in (5, 6):  # k_past [B, K, H, S], v_past [B, K, S, H]
        a = np.array(args[i])
        if i == 5:
            a[..., before] = np.nan
        else:
            a[:, :, before] = np.nan
        poisoned[i] = a
    np.testing.assert_array_equal(np.asarray(jax.jit(_kernel_call)(*poisoned)[0]),
                                  np.asarray(got_out))


@needs_kernel
def test_a_row_that_sees_nothing_gets_zeros_and_others_are_unaffected():
    args = _operands(1, 3, 4, 2, 16, 20, [12], seed=4)
    m_past, m_new = np.array(args[7]), np.array(args[8])
    m_past[0, 1], m_new[0, 1] = False, False  # token 1 sees no slot at all
    args[7], args[8] = m_past, m_new
    out, _ = jax.jit(_kernel_call)(*args)
    assert np.all(np.asarray(out[0, 1]) == 0)
    want, _ = _numpy_reference(*args)
    np.testing.assert_allclose(np.asarray(out), want, rtol=0, atol=ATOL_OUT)


@needs_kernel
def test_runs_inside_a_while_loop_and_differentiates_as_xla():
    args = _operands(1, 5, 4, 2, 16, 24, [9], seed=5)

    def loop(fn):
        def body(_, q):
            return jnp.tanh(fn(q, *args[1:])[0])
        return jax.jit(lambda q: jax.lax.fori_loop(0, 3, body, q))

    np.testing.assert_allclose(np.asarray(loop(_kernel_call)(args[0])),
                               np.asarray(loop(layers._cached_attention_xla)(args[0])),
                               rtol=0, atol=ATOL_OUT)
    loss = lambda fn: (lambda q, kn, vn: jnp.sum(jnp.sin(fn(q, kn, vn, *args[3:])[0])))
    # Both gradients, in one program.
    got, want = jax.jit(lambda *new: (
        jax.grad(loss(_kernel_call), argnums=(0, 1, 2))(*new),
        jax.grad(loss(layers._cached_attention_xla), argnums=(0, 1, 2))(*new)))(*args[:3])
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_xla_runs_when_switched_off_absent_or_lowered_for_tpu(monkeypatch):
    """The model's attention traces no custom call when the kernel is off or missing, and a
    program lowered for a TPU holds only XLA ops; results are the same."""
    q, k, v, cos, sin, kp, vp, mp, mn = _operands(1, 4, 4, 2, 16, 24, [10], 6)

    def model_attention(q, k, v):
        return layers.attention_with_cache(q, k, v, (cos, sin), (kp, vp, mp), mn)

    want = _numpy_reference(q, k, v, cos, sin, kp, vp, mp, mn)[0]
    library.set_kernel_enabled(False)
    jax.clear_caches()  # traces are cached per function: re-trace under each switch
    assert ka.FFI_TARGET not in jax.jit(model_attention).lower(q, k, v).as_text()
    assert "off" in library.kernel_status()
    np.testing.assert_allclose(np.asarray(jax.jit(model_attention)(q, k, v)[0]), want, rtol=0,
                               atol=ATOL_OUT)
    library.set_kernel_enabled(None)
    monkeypatch.setattr(library, "_load", lambda: (False, "not built (test)"))
    jax.clear_caches()
    assert ka.FFI_TARGET not in jax.jit(model_attention).lower(q, k, v).as_text()
    assert ka.FFI_TARGET not in jax.jit(_kernel_call).lower(q, k, v, cos, sin, kp, vp, mp,
                                                            mn).as_text()
    monkeypatch.undo()
    # Possibly read (and cached) while the library was missing: the [in, out] matmul default.
    library.in_out_kernel_preferred.cache_clear()
    jax.clear_caches()
    if library.kernel_available():
        tpu = jax.jit(model_attention).trace(q, k, v).lower(lowering_platforms=("tpu",)).as_text()
        assert ka.FFI_TARGET not in tpu and "dot_general" in tpu
        cpu = jax.jit(model_attention).lower(q, k, v).as_text()
        assert ka.FFI_TARGET in cpu


def test_the_switch_keeps_one_family(monkeypatch):
    """``EAGLE3_JAX_CPU_KERNEL=matmul`` keeps the matmul kernel and turns this one off (how
    ``bench forward`` shows each kernel's share); "0" turns both off."""
    from eagle3_jax.kernels import matmul as rm

    monkeypatch.setenv(library.ENV_SWITCH, "matmul")
    assert library.kernels_enabled("matmul") and not library.kernels_enabled("attention")
    if library.kernel_available():
        assert rm.uses_kernel(8, jnp.float32)
        assert not ka.uses_attention_kernel((1, 8, 4, 16), 2, jnp.float32)
        assert "matmuls of few rows" in library.kernel_status()
    monkeypatch.setenv(library.ENV_SWITCH, "0")
    assert not library.kernels_enabled("matmul") and not library.kernels_enabled("attention")
    monkeypatch.setenv(library.ENV_SWITCH, "1")
    assert library.kernels_enabled("matmul") and library.kernels_enabled("attention")
    assert library.kernels_enabled("matmul_in_out") == library.in_out_kernel_preferred()
