"""The CPU kernel for few-row matmuls (``eagle3_jax.kernels.matmul``) against the XLA dot.

Pinned at fixed tolerances to the XLA dot (and to a float64 product) for every matmul shape of
every shipped target preset and of the draft head, in each weight layout ([out, in], [in, out],
panels, bfloat16 [out, in]), at the row counts decoding uses (1 to 64, and more for the panels'
prefill); a row's result is bit-identical whatever the number of rows it is computed with; it
runs inside ``jit`` and a ``while_loop``; its gradient is the dot's; and the pure-XLA fallback
is what runs when the kernel is absent, switched off, or lowered for another backend.

Inputs are made in NumPy, and every row count of a shape and layout runs in one jitted program
(one compile, not one per row count and per eager op). Each row count is still a custom call of
its own, so a row's bits are compared between calls with different numbers of rows (the XLA
dot's results, compared so, differ).
"""

from __future__ import annotations

import functools
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
needs_kernel = pytest.mark.skipif(not KERNEL_EXPECTED,
                                  reason="the kernel needs x86-64 and a C++ compiler")
ROWS = (1, 2, 3, 5, 6, 7, 8, 13, 16, 31, 64)
PANEL_ROWS = (*ROWS, 65, 150)  # and past one 64-row chunk (prefill)
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


def _panel_shapes() -> list[tuple[int, int]]:
    """Every model shape whose `out` is a multiple of 16 (those ``to_panels`` converts), with
    `out` cut to 272 (17 panels: more than one thread's chunk of 8, and a ragged last chunk)."""
    return sorted({(min(out, 272), inner) for out, inner in _model_shapes() if out % 16 == 0})


def _shape_cases() -> list[tuple[int, int, str]]:
    """(out, in, layout) of the per-shape test: every model shape as its weight is cut (`_clip`
    for the [out, in], [in, out] and bfloat16 forms, `_panel_shapes` for the panels), each cut
    shape once. Models whose shapes cut to the same one run the kernel's same instructions on
    the same sizes (the values do not choose a path); the layouts of one `in` share one weight
    and input (`_operands`), so they are listed together."""
    rows_shapes = {(_clip(out), inner) for out, inner in _model_shapes()}
    panel_shapes = set(_panel_shapes())
    cases = []
    for inner in sorted({inner for _, inner in rows_shapes | panel_shapes}):
        for out in sorted({o for o, i in rows_shapes if i == inner}):
            cases += [(out, inner, "out_in"), (out, inner, "in_out"), (out, inner, "bf16")]
        cases += [(out, inner, "panels") for out in sorted({o for o, i in panel_shapes
                                                             if i == inner})]
    return cases


def _random(shape, seed) -> np.ndarray:
    """Standard normal float32 values, made in NumPy (no XLA program to compile)."""
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


def _bfloat16_top(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The top 16 bits of each float32 value of ``w``: a bfloat16 weight, and its exact
    widening to float32 (how it was rounded does not matter to the kernel)."""
    top = np.ascontiguousarray(w).view(np.uint32) >> 16
    return top.astype(np.uint16).view(jnp.bfloat16), (top << 16).view(np.float32)


@functools.lru_cache(maxsize=1)
def _operands(inner: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [150, in] and w [272, in] (float32) and x @ w.T in float64: the layouts of a shape cut
    their weight from this one (its first 257 or 192 rows, their transpose, their panels, their
    top 16 bits as bfloat16), so the float64 product is made once for them."""
    x, w = _random((max(PANEL_ROWS), inner), inner), _random((272, inner), 7 * inner + 1)
    return x, w, x.astype(np.float64) @ w.astype(np.float64).T


def _rows_matmul_in_out(x, w):
    return rm.rows_matmul(x, w, in_out=True)


@functools.partial(jax.jit, static_argnums=0)
def _products(fns, xs, ws):
    """[[fns[k](x, ws[k]) for x in xs] for each k], as one program."""
    return [[fn(x, w) for x in xs] for fn, w in zip(fns, ws)]


def _run(fns, xs, ws, target: str | None = None) -> list[list[np.ndarray]]:
    """``_products`` compiled for these shapes and run; with ``target``, first checks that the
    program holds that custom call once for each x (the kernel is what runs, at every x)."""
    xs, ws = tuple(xs), tuple(ws)
    lowered = _products.lower(fns, xs, ws)
    if target is not None:
        assert lowered.as_text().count(f"@{target}(") == len(xs), target
    return [[np.asarray(y) for y in ys] for ys in lowered.compile()(xs, ws)]


@pytest.fixture(autouse=True)
def _every_family_on():
    """Both layouts' kernels under test on every CPU (the [in, out] form is off by default
    where the CPU lacks AVX-512: ``test_the_in_out_form_is_on_where_the_cpu_prefers_it``).
    JAX caches a trace per function with the choice made when it was traced, so its caches are
    dropped where the switch was something else before the test, or after it."""
    previous = library.set_kernel_enabled(True)
    if previous is not True:
        jax.clear_caches()
    yield
    if library.set_kernel_enabled(previous) is not True or previous is not True:
        jax.clear_caches()


def _lowered_text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


@needs_kernel
def test_the_kernel_is_built_and_used_here():
    assert "in use" in library.kernel_status(), library.kernel_status()
    x, w = _random((8, 64), 0), _random((32, 64), 1)
    assert rm.FFI_TARGET in _lowered_text(rm.rows_matmul, x, w)
    assert rm.FFI_TARGET not in _lowered_text(rm.rows_matmul, _random((65, 64), 2), w)
    in_out = _lowered_text(lambda x, w: rm.rows_matmul(x, w, in_out=True), x, w.T)
    assert rm.FFI_TARGET_IN_OUT in in_out


@needs_kernel
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


# Whether the float32 [out, in] kernel runs its AVX2/FMA form here: on a CPU without AVX-512,
# or where the AVX2 variants are asked for (tests/test_kernel_variants.py).
FLOAT32_KERNEL_IS_AVX2 = not has_avx512() or os.environ.get(library.ENV_ISA) == "avx2"


@needs_kernel
@pytest.mark.parametrize("out,inner,layout", _shape_cases(),
                         ids=[f"{out}x{inner}-{layout}" for out, inner, layout in _shape_cases()])
def test_kernel_matches_the_xla_dot_on_every_model_shape(out, inner, layout):
    """Each layout on every shape (more than the models use of each), at every row count,
    against a float64 product and the XLA dot of the same weight; a row's result is
    bit-identical whatever the number of rows it is computed with (a decode step and a
    verification agree).

    out_in: the target's serving weights [out, in]. in_out: the draft head and an untied output
    head, [in, out]. panels: ``to_panels`` of the [out, in] weight, against the dot of that
    weight, also past one 64-row chunk (prefill). bf16: float32 rows times a bfloat16 [out, in]
    weight (the draft head held in 16 bits): the exact product of the widened weight to the
    float32 kernel's tolerance and, where that float32 kernel runs its AVX2 form (the same
    instructions after the widening), bit for bit its result on the widened weight."""
    x, w_all, ref_all = _operands(inner)
    w = w_all[:out]
    counts = PANEL_ROWS if layout == "panels" else ROWS
    ref = ref_all[:, :out]
    rtol = _rtol(layout != "out_in", inner)  # panels: one sequential sum per output, as in_out
    if layout == "out_in":
        fns, ws, target = (rm.rows_matmul, rm._xla_dot), (w, w), rm.FFI_TARGET
    elif layout == "in_out":
        w_t = np.ascontiguousarray(w.T)
        fns, ws = (_rows_matmul_in_out, rm._xla_dot_in_out), (w_t, w_t)
        target = rm.FFI_TARGET_IN_OUT
    elif layout == "panels":
        panels = rm.to_panels(w)
        assert panels.shape == (out // 16, inner, 16)
        fns, ws, target = (rm.panel_matmul, rm._xla_dot), (panels, w), rm.FFI_TARGET_PANELS
    else:
        w16, w32 = _bfloat16_top(w)
        ref = x[:max(counts)].astype(np.float64) @ w32.astype(np.float64).T
        rtol = RTOL
        # The float32 kernel on the widened weight: its bits, to compare where it is AVX2's.
        fns, ws, target = (rm.rows_matmul, rm.rows_matmul), (w16, w32), rm.FFI_TARGET_BF16
    ys, others = _run(fns, [x[:n] for n in counts], ws, target)
    for y, other, n in zip(ys, others, counts):
        assert y.dtype == np.float32
        scale = np.abs(ref[:n]).max()
        np.testing.assert_allclose(y, ref[:n], rtol=0, atol=rtol * scale)
        if layout != "bf16":
            np.testing.assert_allclose(y, other, rtol=0, atol=2 * rtol * scale)
        elif FLOAT32_KERNEL_IS_AVX2:
            np.testing.assert_array_equal(y, other)
        # The same row gives the same bits whatever the number of rows computed with it.
        np.testing.assert_array_equal(y[0], ys[0][0])


def test_panels_round_trip_and_rows_lookup():
    """``to_panels`` only moves data; ``weight_rows`` reads an [O, I] matrix's rows from either
    form (the embedding lookup of a tied output head held as panels)."""
    w = _random((48, 7), 12)
    index = np.asarray([[0, 17, 47], [16, 15, 33]])

    def program(w, index):
        panels = rm.to_panels(w)
        return (panels, rm.from_panels(panels), rm.weight_rows(panels, index),
                rm.weight_rows(w, index))

    panels, back, rows_of_panels, rows = (np.asarray(a) for a in jax.jit(program)(w, index))
    np.testing.assert_array_equal(panels[2, :, 5], w[2 * 16 + 5])
    np.testing.assert_array_equal(back, w)
    np.testing.assert_array_equal(rows_of_panels, w[index])
    np.testing.assert_array_equal(rows, w[index])
    with pytest.raises(ValueError, match="multiple of 16"):
        rm.to_panels(jnp.asarray(w[:40]))


@needs_kernel
@pytest.mark.parametrize("layout", ["out_in", "in_out", "bf16"])
@pytest.mark.parametrize("out,inner", [(1, 1), (3, 5), (17, 9), (2, 8), (40, 15), (70, 3),
                                       (129, 7)])
def test_kernel_on_small_and_ragged_shapes(out, inner, layout):
    """Tails in every direction: `in` not a multiple of 8, `out` not a multiple of 4 rows or of
    a 64-column panel (masked vectors), fewer rows than a block; bfloat16 weights (read
    directly up to 4 rows, widened once for more) with the same tails."""
    in_out = layout == "in_out"
    w = _random((inner, out) if in_out else (out, inner), 11)
    if layout == "bf16":
        w, w_out_in = _bfloat16_top(w)
    else:
        w_out_in = w.T if in_out else w
    xs = [_random((rows, inner), rows) for rows in (1, 4, 6, 7, 12)]
    kernel, target = {"out_in": (rm.rows_matmul, rm.FFI_TARGET),
                      "in_out": (_rows_matmul_in_out, rm.FFI_TARGET_IN_OUT),
                      "bf16": (rm.rows_matmul, rm.FFI_TARGET_BF16)}[layout]
    for x, y in zip(xs, _run((kernel,), xs, (w,), target)[0]):
        ref = x.astype(np.float64) @ w_out_in.astype(np.float64).T
        np.testing.assert_allclose(y, ref, rtol=0,
                                   atol=_rtol(in_out, inner) * max(np.abs(ref).max(), 1.0))


def _sin_sum_grad(fn):
    """The gradient in (x, w) of sum(sin(fn(x, w)))."""
    return jax.grad(lambda x, w: jnp.sum(jnp.sin(fn(x, w))), argnums=(0, 1))


@needs_kernel
def test_kernel_in_a_while_loop_with_leading_axes_and_a_gradient():
    """Inside a ``fori_loop``, with leading axes as rows, the kernel gives the XLA dot's results;
    the gradients of both weight layouts' kernels are the XLA dot's (all in one program, which
    holds the kernel in the loop and in each gradient)."""
    w = _random((48, 40), 3) / np.sqrt(40)  # unit-scale outputs: round-off is not amplified
    x = _random((2, 3, 40), 4)  # leading axes are rows: 6

    def loop(dot, x, w):
        return jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(dot(h, w[:40])), x)

    def program(x, w, wt):
        return ((loop(rm.rows_matmul, x, w), loop(rm._xla_dot, x, w)),
                (_sin_sum_grad(rm.rows_matmul)(x, w), _sin_sum_grad(rm._xla_dot)(x, w)),
                (_sin_sum_grad(_rows_matmul_in_out)(x, wt),
                 _sin_sum_grad(rm._xla_dot_in_out)(x, wt)))

    wt = np.ascontiguousarray(w.T)
    lowered = jax.jit(program).lower(x, w, wt)
    text = lowered.as_text()
    assert text.count(f"@{rm.FFI_TARGET}(") == 2 and text.count(f"@{rm.FFI_TARGET_IN_OUT}(") == 1
    (looped, looped_ref), (got, want), (got_t, want_t) = lowered.compile()(x, w, wt)
    np.testing.assert_allclose(np.asarray(looped), np.asarray(looped_ref), rtol=1e-5, atol=1e-6)
    for g, r in zip((*got, *got_t), (*want, *want_t)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("out,inner", [(16, 1), (16, 5), (32, 9), (48, 3)])
def test_panel_kernel_on_small_shapes_in_a_loop_with_a_gradient(out, inner):
    """Tiny `in`, a single panel, leading axes as rows, inside a ``while_loop``; the gradient
    is the XLA dot's."""
    w = _random((out, inner), 13) / np.sqrt(inner)
    panels = rm.to_panels(w)
    xs = [_random((rows, inner), rows) for rows in (1, 4, 6, 7, 12)]
    for x, y in zip(xs, _run((rm.panel_matmul,), xs, (panels,), rm.FFI_TARGET_PANELS)[0]):
        ref = x.astype(np.float64) @ w.astype(np.float64).T
        np.testing.assert_allclose(y, ref, rtol=0,
                                   atol=_rtol(True, inner) * max(np.abs(ref).max(), 1.0))
    square = rm.to_panels(_random((16, 16), 14) / 4.0)  # h -> tanh(h @ w.T), 3 times

    def program(h, x, p):
        def loop(dot):
            return jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(dot(h, square)), h)

        return ((loop(rm.panel_matmul), loop(rm._xla_dot_panels)),
                (_sin_sum_grad(rm.panel_matmul)(x, p), _sin_sum_grad(rm._xla_dot_panels)(x, p)))

    h = _random((2, 3, 16), 15)  # leading axes are rows: 6
    x = _random((2, 3, inner), 16)
    lowered = jax.jit(program).lower(h, x, panels)
    assert lowered.as_text().count(f"@{rm.FFI_TARGET_PANELS}(") == 2  # the loop, the gradient
    (looped, looped_ref), (got, want) = lowered.compile()(h, x, panels)
    np.testing.assert_allclose(np.asarray(looped), np.asarray(looped_ref), rtol=1e-5, atol=1e-6)
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
    # Read (and cached) while the library was missing: the [in, out] default of later tests.
    library.in_out_kernel_preferred.cache_clear()
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


@needs_kernel
def test_bfloat16_weights_where_exact_and_the_kernel_reads_them():
    """``bfloat16_weights`` narrows a float32 weight only when every value is a bfloat16 and the
    kernel runs; the kernel form is lowered for up to 64 rows, the widened XLA dot beyond, when
    switched off and for a TPU, all with the same numbers; it runs in a while_loop."""
    w = jnp.asarray(_random((40, 24), 9).astype(jnp.bfloat16).astype(np.float32))
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
