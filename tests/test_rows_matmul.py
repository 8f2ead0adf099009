"""The CPU kernel for few-row matmuls (``eagle3_jax.kernels.matmul``) against the XLA dot.

Pinned at fixed tolerances to the XLA dot (and to a float64 product) for every matmul shape of
every shipped target preset and of the draft head, in each weight layout ([out, in], [in, out],
panels), at the row counts decoding uses (1 to 64, and more for the panels' prefill);
a row's result is bit-identical whatever the number of rows it is computed with; it runs inside
``jit`` and a ``while_loop``; its gradient is the dot's; and the pure-XLA fallback is what runs
when the kernel is absent, switched off, or lowered for another backend.
"""

from __future__ import annotations

import os
import platform
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.kernels import library
from eagle3_jax.kernels import matmul as rm
from eagle3_jax.presets import list_presets, load_preset
from cpu_features import has_avx512

KERNEL_EXPECTED = platform.machine() in ("x86_64", "AMD64") and shutil.which("c++") is not None
ROWS = (1, 2, 3, 5, 6, 7, 8, 13, 16, 31, 64)
# Relative to the largest |y|. [out, in]: 8/16 lane partial sums, then a fixed tree: 2e-6 for
# sums of up to 14k order-one products. [in, out]: one sequential float32 sum per output, whose
# round-off grows as sqrt(in) * eps (random walk; 4 sigma). Against the XLA dot, whose own
# sum order depends on the CPU, the bound is twice that: each is within it of the exact product
# (on a 2-core AMD EPYC without AVX-512 both reach 1.5e-6 at in = 4096..28672, in opposite
# directions: the two differ by up to 2.1e-6).
RTOL = 2e-6


def _rtol(in_out: bool, inner: int) -> float:
    return 4 * np.sqrt(inner) * np.finfo(np.float32).eps if in_out else RTOL


def _model_shapes() -> set[tuple[int, int]]:
    """(out, in) of every serving matmul of every preset (q/k/v fused, wo, gate/up fused, down,
    the tied output head), and of the draft head (fc, q/k/v apart and fused as its serving
    layout has them, o, MLP, lm_head)."""
    shapes = set()
    for name in list_presets():
        c = load_preset(name).target
        d, f, h = c.hidden_size, c.intermediate_size, c.head_dim
        shapes |= {((c.num_heads + 2 * c.num_kv_heads) * h, d), (d, c.num_heads * h),
                   (2 * f, d), (d, f), (c.vocab_size, d)}
        shapes |= {(d, 3 * d), (c.num_heads * h, 2 * d), (c.num_kv_heads * h, 2 * d),
                   ((c.num_heads + 2 * c.num_kv_heads) * h, 2 * d)}
    return shapes


def _clip(out: int) -> int:
    """Large outputs are cut to 257 rows of w (odd: the one-row tail; > one chunk): the kernel
    runs the same instructions per output row whatever `out` is, and `in` is kept whole."""
    return min(out, 257)


def _random(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@pytest.fixture(autouse=True)
def _every_family_on():
    """Both layouts' kernels under test on every CPU (the [in, out] form is off by default
    where the CPU lacks AVX-512: ``test_the_in_out_form_is_on_where_the_cpu_prefers_it``)."""
    previous = library.set_kernel_enabled(True)
    jax.clear_caches()
    yield
    library.set_kernel_enabled(previous)
    jax.clear_caches()


def _lowered_text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


@pytest.mark.skipif(not KERNEL_EXPECTED, reason="the kernel needs x86-64 and a C++ compiler")
def test_the_kernel_is_built_and_used_here():
    assert "in use" in library.kernel_status(), library.kernel_status()
    x, w = _random((8, 64), 0), _random((32, 64), 1)
    assert rm.FFI_TARGET in _lowered_text(rm.rows_matmul, x, w)
    assert rm.FFI_TARGET not in _lowered_text(rm.rows_matmul, _random((65, 64), 2), w)
    in_out = _lowered_text(lambda x, w: rm.rows_matmul(x, w, in_out=True), x, w.T)
    assert rm.FFI_TARGET_IN_OUT in in_out


@pytest.mark.skipif(not KERNEL_EXPECTED, reason="the kernel needs x86-64 and a C++ compiler")
def test_the_in_out_form_is_on_where_the_cpu_prefers_it(monkeypatch):
    """By default the [in, out] form runs only where the library says it beats XLA (AVX-512);
    the [out, in] form runs everywhere; naming the family turns it on."""
    x, w = _random((4, 64), 0), _random((64, 32), 1)
    in_out = lambda x, w: rm.rows_matmul(x, w, in_out=True)  # noqa: E731
    library.set_kernel_enabled(None)
    monkeypatch.delenv(library.ENV_SWITCH, raising=False)
    jax.clear_caches()
    preferred = library.in_out_kernel_preferred()
    # The AVX-512 variants run where the CPU has them, unless the AVX2 ones are asked for.
    assert preferred == (has_avx512() and os.environ.get(library.ENV_ISA) != "avx2")
    assert (rm.FFI_TARGET_IN_OUT in _lowered_text(in_out, x, w)) == preferred
    assert rm.FFI_TARGET in _lowered_text(rm.rows_matmul, x, w.T)
    monkeypatch.setenv(library.ENV_SWITCH, "matmul_in_out")
    jax.clear_caches()
    assert rm.FFI_TARGET_IN_OUT in _lowered_text(in_out, x, w)
    assert rm.FFI_TARGET not in _lowered_text(rm.rows_matmul, x, w.T)


def _layout(in_out: bool, w: jax.Array):
    """(kernel, XLA dot, w as an [out, in] float64 array) for a weight in either layout."""
    if in_out:
        return (jax.jit(lambda x, w: rm.rows_matmul(x, w, in_out=True)), jax.jit(rm._xla_dot_in_out),
                np.asarray(w, np.float64).T)
    return jax.jit(rm.rows_matmul), jax.jit(rm._xla_dot), np.asarray(w, np.float64)


@pytest.mark.skipif(not KERNEL_EXPECTED, reason="the kernel needs x86-64 and a C++ compiler")
@pytest.mark.parametrize("in_out", [False, True], ids=["out_in", "in_out"])
@pytest.mark.parametrize("out,inner", sorted(_model_shapes()))
def test_kernel_matches_the_xla_dot_on_every_model_shape(out, inner, in_out):
    """Both weight layouts ([out, in]: the target's serving weights; [in, out]: the draft head
    and an untied output head) on every shape (more than the models use of each)."""
    shape = (inner, _clip(out)) if in_out else (_clip(out), inner)
    w = _random(shape, out * 7 + inner)
    x64 = _random((max(ROWS), inner), inner)
    kernel, dot, w_out_in = _layout(in_out, w)
    ref = np.asarray(x64, np.float64) @ w_out_in.T
    first_row = None
    rtol = _rtol(in_out, inner)
    for rows in ROWS:
        y = np.asarray(kernel(x64[:rows], w))
        scale = np.abs(ref[:rows]).max()
        np.testing.assert_allclose(y, ref[:rows], rtol=0, atol=rtol * scale)
        np.testing.assert_allclose(y, np.asarray(dot(x64[:rows], w)), rtol=0,
                                   atol=2 * rtol * scale)
        if first_row is None:
            first_row = y[0]
        # The same row gives the same bits whatever the number of rows computed with it.
        np.testing.assert_array_equal(y[0], first_row)


def _panel_shapes() -> list[tuple[int, int]]:
    """Every model shape whose `out` is a multiple of 16 (those ``to_panels`` converts), with
    `out` cut to 272 (17 panels: more than one thread's chunk of 8, and a ragged last chunk)."""
    return sorted({(min(out, 272), inner) for out, inner in _model_shapes() if out % 16 == 0})


@pytest.mark.skipif(not KERNEL_EXPECTED, reason="the kernel needs x86-64 and a C++ compiler")
@pytest.mark.parametrize("out,inner", _panel_shapes())
def test_panel_kernel_matches_the_xla_dot_on_every_model_shape(out, inner):
    """The panel form: against a float64 product and the XLA dot of the [out, in] weight it was
    made from, at every row count up to 64 and past one 64-row chunk (prefill); a row's result
    is bit-identical whatever the number of rows (a decode step and a verification agree)."""
    w = _random((out, inner), out * 5 + inner)
    panels = rm.to_panels(w)
    assert panels.shape == (out // 16, inner, 16)
    x = _random((150, inner), inner + 1)
    kernel = jax.jit(rm.panel_matmul)
    assert rm.FFI_TARGET_PANELS in _lowered_text(rm.panel_matmul, x[:3], panels)
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    rtol = _rtol(True, inner)  # one sequential float32 sum per output, as the [in, out] form
    first_row = None
    for rows in (*ROWS, 65, 150):
        y = np.asarray(kernel(x[:rows], panels))
        scale = np.abs(ref[:rows]).max()
        np.testing.assert_allclose(y, ref[:rows], rtol=0, atol=rtol * scale)
        np.testing.assert_allclose(y, np.asarray(rm._xla_dot(x[:rows], w)), rtol=0,
                                   atol=2 * rtol * scale)
        first_row = y[0] if first_row is None else first_row
        np.testing.assert_array_equal(y[0], first_row)


def test_panels_round_trip_and_rows_lookup():
    """``to_panels`` only moves data; ``weight_rows`` reads an [O, I] matrix's rows from either
    form (the embedding lookup of a tied output head held as panels)."""
    w = _random((48, 7), 12)
    panels = rm.to_panels(w)
    np.testing.assert_array_equal(np.asarray(panels[2, :, 5]), np.asarray(w[2 * 16 + 5]))
    np.testing.assert_array_equal(np.asarray(rm.from_panels(panels)), np.asarray(w))
    index = jnp.asarray([[0, 17, 47], [16, 15, 33]])
    np.testing.assert_array_equal(np.asarray(rm.weight_rows(panels, index)),
                                  np.asarray(w)[np.asarray(index)])
    np.testing.assert_array_equal(np.asarray(rm.weight_rows(w, index)),
                                  np.asarray(w)[np.asarray(index)])
    with pytest.raises(ValueError, match="multiple of 16"):
        rm.to_panels(w[:40])


@pytest.mark.skipif(not KERNEL_EXPECTED, reason="the kernel needs x86-64 and a C++ compiler")
@pytest.mark.parametrize("in_out", [False, True], ids=["out_in", "in_out"])
@pytest.mark.parametrize("out,inner", [(1, 1), (3, 5), (17, 9), (2, 8), (40, 15), (70, 3),
                                       (129, 7)])
def test_kernel_on_small_and_ragged_shapes(out, inner, in_out):
    """Tails in every direction: `in` not a multiple of 8, `out` not a multiple of 4 rows or of
    a 64-column panel (masked vectors), fewer rows than a block."""
    w = _random((inner, out) if in_out else (out, inner), 11)
    kernel, _, w_out_in = _layout(in_out, w)
    for rows in (1, 4, 6, 7, 12):
        x = _random((rows, inner), rows)
        ref = np.asarray(x, np.float64) @ w_out_in.T
        np.testing.assert_allclose(np.asarray(kernel(x, w)), ref, rtol=0,
                                   atol=_rtol(in_out, inner) * max(np.abs(ref).max(), 1.0))


@pytest.mark.skipif(not KERNEL_EXPECTED, reason="the kernel needs x86-64 and a C++ compiler")
def test_kernel_in_a_while_loop_with_leading_axes_and_a_gradient():
    w = _random((48, 40), 3) / np.sqrt(40)  # unit-scale outputs: round-off is not amplified
    x = _random((2, 3, 40), 4)  # leading axes are rows: 6

    def loop(x):
        return jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(rm.rows_matmul(h, w[:40])), x)

    def loop_ref(x):
        return jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(rm._xla_dot(h, w[:40])), x)

    assert rm.FFI_TARGET in _lowered_text(loop, x)
    np.testing.assert_allclose(np.asarray(jax.jit(loop)(x)), np.asarray(jax.jit(loop_ref)(x)),
                               rtol=1e-5, atol=1e-6)
    loss = lambda f: (lambda x, w: jnp.sum(jnp.sin(f(x, w))))
    got = jax.grad(loss(rm.rows_matmul), argnums=(0, 1))(x, w)
    want = jax.grad(loss(rm._xla_dot), argnums=(0, 1))(x, w)
    wt = jnp.asarray(w.T)
    got_t = jax.grad(loss(lambda x, w: rm.rows_matmul(x, w, in_out=True)), argnums=(0, 1))(x, wt)
    want_t = jax.grad(loss(rm._xla_dot_in_out), argnums=(0, 1))(x, wt)
    for g, r in zip((*got, *got_t), (*want, *want_t)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not KERNEL_EXPECTED, reason="the kernel needs x86-64 and a C++ compiler")
@pytest.mark.parametrize("out,inner", [(16, 1), (16, 5), (32, 9), (48, 3)])
def test_panel_kernel_on_small_shapes_in_a_loop_with_a_gradient(out, inner):
    """Tiny `in`, a single panel, leading axes as rows, inside a ``while_loop``; the gradient
    is the XLA dot's."""
    w = _random((out, inner), 13) / np.sqrt(inner)
    panels = rm.to_panels(w)
    for rows in (1, 4, 6, 7, 12):
        x = _random((rows, inner), rows)
        ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
        np.testing.assert_allclose(np.asarray(jax.jit(rm.panel_matmul)(x, panels)), ref,
                                   rtol=0, atol=_rtol(True, inner) * max(np.abs(ref).max(), 1.0))
    square = rm.to_panels(_random((16, 16), 14) / 4.0)  # h -> tanh(h @ w.T), 3 times

    def loop(f, x):
        return jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(f(h, square)), x)

    h = _random((2, 3, 16), 15)  # leading axes are rows: 6
    assert rm.FFI_TARGET_PANELS in _lowered_text(lambda h: loop(rm.panel_matmul, h), h)
    np.testing.assert_allclose(np.asarray(jax.jit(lambda h: loop(rm.panel_matmul, h))(h)),
                               np.asarray(jax.jit(lambda h: loop(rm._xla_dot_panels, h))(h)),
                               rtol=1e-5, atol=1e-6)
    x = _random((2, 3, inner), 16)
    loss = lambda f: (lambda x, p: jnp.sum(jnp.sin(f(x, p))))  # noqa: E731
    got = jax.grad(loss(rm.panel_matmul), argnums=(0, 1))(x, panels)
    want = jax.grad(loss(rm._xla_dot_panels), argnums=(0, 1))(x, panels)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)


def test_fallback_when_switched_off_absent_or_not_float32(monkeypatch):
    """The XLA dot, and the same numbers, when the kernel is switched off or missing, for
    bfloat16, for more rows than the kernel takes, and when lowered for a TPU."""
    x, w = _random((4, 24), 5), _random((16, 24), 6)
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    panels = rm.to_panels(w)
    library.set_kernel_enabled(False)
    jax.clear_caches()  # traces are cached per function: re-trace under each switch
    assert rm.FFI_TARGET not in _lowered_text(rm.rows_matmul, x, w)
    assert rm.FFI_TARGET_PANELS not in _lowered_text(rm.panel_matmul, x, panels)
    assert "off" in library.kernel_status()
    np.testing.assert_allclose(np.asarray(jax.jit(rm.rows_matmul)(x, w)), ref, rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(jax.jit(rm.panel_matmul)(x, panels)), ref, rtol=1e-5,
                               atol=1e-5)
    library.set_kernel_enabled(None)
    monkeypatch.setattr(library, "_load", lambda: (False, "not built (test)"))
    jax.clear_caches()
    assert rm.FFI_TARGET not in _lowered_text(rm.rows_matmul, x, w)
    assert "unavailable: not built (test)" in library.kernel_status()
    monkeypatch.undo()
    jax.clear_caches()
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    assert rm.FFI_TARGET not in _lowered_text(rm.rows_matmul, xb, wb)
    assert rm.FFI_TARGET_PANELS not in _lowered_text(rm.panel_matmul, xb, panels.astype(xb.dtype))
    if library.kernel_available():
        tpu = jax.jit(rm.rows_matmul).trace(x, w).lower(lowering_platforms=("tpu",)).as_text()
        assert rm.FFI_TARGET not in tpu
        tpu = jax.jit(rm.panel_matmul).trace(x, panels).lower(
            lowering_platforms=("tpu",)).as_text()
        assert rm.FFI_TARGET_PANELS not in tpu


def test_single_row_blocks_fallback_equals_the_dot():
    """The XLA fallback's row-block form of a one-row product (used for the attention output
    projection when the kernel is not) computes the same product."""
    library.set_kernel_enabled(False)
    x, w = _random((1, 1, 24), 7), _random((40, 24), 8)
    y = jax.jit(lambda x, w: rm.rows_matmul(x, w, xla_single_row_blocks=8))(x, w)
    np.testing.assert_allclose(np.asarray(y), np.einsum("bti,oi->bto", np.asarray(x, np.float64),
                                                        np.asarray(w)), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not KERNEL_EXPECTED, reason="the kernel needs x86-64 and a C++ compiler")
@pytest.mark.parametrize("out,inner", sorted(_model_shapes()))
def test_bfloat16_weight_kernel_on_every_model_shape(out, inner):
    """float32 rows times a bfloat16 [out, in] weight (the draft head held in 16 bits): the
    exact product of the widened weight to the same tolerance as the float32 kernel, a row's
    bits independent of the number of rows, and (the same instructions after the widening) bit
    for bit the float32 kernel's on a CPU without AVX-512, whose float32 form is that one."""
    w16 = _random((_clip(out), inner), out * 5 + inner).astype(jnp.bfloat16)
    w32 = w16.astype(jnp.float32)
    x64 = _random((max(ROWS), inner), inner + 1)
    ref = np.asarray(x64, np.float64) @ np.asarray(w32, np.float64).T
    kernel = jax.jit(rm.rows_matmul)
    avx2_only = not has_avx512()
    first_row = None
    for rows in ROWS:
        y = np.asarray(kernel(x64[:rows], w16))
        assert y.dtype == np.float32
        np.testing.assert_allclose(y, ref[:rows], rtol=0, atol=RTOL * np.abs(ref[:rows]).max())
        if avx2_only:
            np.testing.assert_array_equal(y, np.asarray(kernel(x64[:rows], w32)))
        if first_row is None:
            first_row = y[0]
        np.testing.assert_array_equal(y[0], first_row)


@pytest.mark.skipif(not KERNEL_EXPECTED, reason="the kernel needs x86-64 and a C++ compiler")
def test_bfloat16_weights_where_exact_and_the_kernel_reads_them():
    """``bfloat16_weights`` narrows a float32 weight only when every value is a bfloat16 and the
    kernel runs; the kernel form is lowered for up to 64 rows, the widened XLA dot beyond, when
    switched off and for a TPU, all with the same numbers; it runs in a while_loop."""
    w = _random((40, 24), 9).astype(jnp.bfloat16).astype(jnp.float32)
    narrow = rm.bfloat16_weights(w)
    assert narrow.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(narrow.astype(jnp.float32)), np.asarray(w))
    rounded = w.at[3, 5].add(1e-4)  # one value bfloat16 would round
    assert rm.bfloat16_weights(rounded) is rounded
    assert jax.jit(lambda w: rm.bfloat16_weights(w).dtype == jnp.float32)(w)  # traced: as is
    x = _random((5, 24), 10)
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    assert rm.FFI_TARGET_BF16 in _lowered_text(rm.rows_matmul, x, narrow)
    assert rm.FFI_TARGET_BF16 not in _lowered_text(rm.rows_matmul, _random((65, 24), 2), narrow)
    tpu = jax.jit(rm.rows_matmul).trace(x, narrow).lower(lowering_platforms=("tpu",)).as_text()
    assert rm.FFI_TARGET_BF16 not in tpu

    def loop(x, w):
        return jax.lax.fori_loop(0, 3, lambda i, y: y + rm.rows_matmul(x, w), jnp.zeros((5, 40)))

    np.testing.assert_allclose(np.asarray(jax.jit(loop)(x, narrow)), 3 * ref, rtol=1e-5,
                               atol=1e-5)
    for rows in (5, 65):
        xr = _random((rows, 24), 11)
        want = np.asarray(xr, np.float64) @ np.asarray(w, np.float64).T
        np.testing.assert_allclose(np.asarray(jax.jit(rm.rows_matmul)(xr, narrow)), want,
                                   rtol=1e-5, atol=1e-5)
    library.set_kernel_enabled(False)
    jax.clear_caches()
    assert rm.bfloat16_weights(w) is w
    assert rm.FFI_TARGET_BF16 not in _lowered_text(rm.rows_matmul, x, narrow)
    np.testing.assert_allclose(np.asarray(jax.jit(rm.rows_matmul)(x, narrow)), ref, rtol=1e-5,
                               atol=1e-5)
