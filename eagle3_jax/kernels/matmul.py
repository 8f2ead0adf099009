"""``rows_matmul(x, w)``: x [..., I] times an [out, in] weight w [O, I] -> [..., O]
(``in_out=True``: times an [in, out] weight w [I, O], the draft head's trained layout; a
bfloat16 w with float32 x: the widened weight, read from half the bytes, ``bfloat16_weights``);
``panel_matmul(x, p)``: the same product with the weight regrouped as panels
p [O/16, I, 16] (``to_panels``), the form the CPU kernel streams fastest (the target's serving
weights on CPU: ``eagle3_jax.model.params.to_panels``).

On CPU, for float32 and at most ``KERNEL_MAX_ROWS`` rows (a decode step, a draft step, a tree
verification), this runs the package's C++ kernel (``kernels/cpu/rows_matmul.cc``, an XLA FFI
custom call built by the install; ``library.py``): each weight row is read from memory once and used for every
row of x while it is in L1, on all of XLA's intra-op threads. XLA CPU instead runs such a dot
as a general matmul that repacks the whole weight on every call (``bench forward`` shows both).
Everywhere else, and wherever the kernel is missing (no compiler at install, a CPU without
AVX2/FMA, ``EAGLE3_JAX_CPU_KERNEL=0``), it is the XLA dot ``einsum("...I,OI->...O")``. The
[in, out] form is a family of its own ("matmul_in_out"), on by default only where the CPU has
AVX-512: on AVX2-only CPUs XLA's dot was faster for the draft head's matrices (``library.py``).

The choice is made at trace time from the shape and dtype and, inside the program, per backend
(``lax.platform_dependent``): a program lowered for an accelerator holds only the XLA dot. The
kernel is a custom call, so it stays inside ``jit``, ``while_loop`` and ``scan`` with no host
round trip. Each output element is computed by the same instructions whatever the number of
rows, so a row's result does not depend on the batch it is computed in. Differentiable: the
JVP (and so the gradient) is the XLA dot's.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from eagle3_jax.kernels.library import kernels_in_use

# Up to this many rows the kernel wins: a SmolLM2 forward of 64 tokens takes 75.6 ms with it and
# 79.5 with the XLA dot (``python -m eagle3_jax.bench forward``, both timed). Beyond, the matmul
# is compute-bound and XLA's packed GEMM uses the peak better (the kernel's dot-product form
# reaches about 55% of it).
KERNEL_MAX_ROWS = 64
FFI_TARGET = "eagle3_rows_matmul"  # w [out, in]
FFI_TARGET_IN_OUT = "eagle3_rows_matmul_in_out"  # w [in, out]
FFI_TARGET_PANELS = "eagle3_panel_matmul"  # w as panels [out / 16, in, 16]
FFI_TARGET_BF16 = "eagle3_rows_matmul_bf16"  # w [out, in] in bfloat16, x and y float32
PANEL = 16  # outputs per panel


def uses_kernel(rows: int, dtype, in_out: bool = False) -> bool:
    """Whether a matmul of ``rows`` rows of ``dtype`` (an [in, out] weight with ``in_out``)
    traced now on CPU would use the kernel."""
    return 0 < rows <= KERNEL_MAX_ROWS and kernels_in_use(
        dtype, "matmul_in_out" if in_out else "matmul")


def _xla_dot(x: jax.Array, w: jax.Array, preferred_element_type=None) -> jax.Array:
    return jnp.einsum("...I,OI->...O", x, w, preferred_element_type=preferred_element_type)


def _xla_dot_in_out(x: jax.Array, w: jax.Array, preferred_element_type=None) -> jax.Array:
    return jnp.einsum("...I,IO->...O", x, w, preferred_element_type=preferred_element_type)


def _xla_dot_bf16(x: jax.Array, w: jax.Array, preferred_element_type=None) -> jax.Array:
    """x (float32) times bfloat16 w [O, I] widened to float32 (exact): the kernel's product."""
    return _xla_dot(x, w.astype(x.dtype), preferred_element_type=preferred_element_type)


def _xla_dot_panels(x: jax.Array, p: jax.Array, preferred_element_type=None) -> jax.Array:
    y = jnp.einsum("...I,PIC->...PC", x, p, preferred_element_type=preferred_element_type)
    return y.reshape(x.shape[:-1] + (p.shape[0] * PANEL,))


def to_panels(w: jax.Array) -> jax.Array:
    """An [out, in] weight [O, I] -> its panels [O/16, I, 16]: ``p[q, i, c] = w[16 q + c, i]``
    (O a multiple of 16). Exact; only moves data."""
    o, i = w.shape
    if o % PANEL:
        raise ValueError(f"to_panels: out = {o} is not a multiple of {PANEL}")
    return w.reshape(o // PANEL, PANEL, i).transpose(0, 2, 1)


def from_panels(p: jax.Array) -> jax.Array:
    """Inverse of :func:`to_panels`: panels [O/16, I, 16] -> [O, I]."""
    q, i, c = p.shape
    return p.transpose(0, 2, 1).reshape(q * c, i)


def weight_rows(w: jax.Array, index: jax.Array) -> jax.Array:
    """Rows ``index`` [...] of an [O, I] matrix held as [O, I] or as its panels [O/16, I, 16]
    (an embedding lookup): [..., I]."""
    if w.ndim == 2:
        return jnp.take(w, index, axis=0)
    return w[index // PANEL, :, index % PANEL]


def _xla_single_row(x: jax.Array, w: jax.Array, blocks: int) -> jax.Array:
    """One row through XLA CPU as ``blocks`` row blocks of ``w`` in one batched dot: XLA runs
    a matrix-vector dot as small as SmolLM2's attention output projection (1.3 MB) on one
    core, and a batched one on every core (27.5 -> 25.0 ms per decode step on 2 cores; more
    blocks, other projections or 2+ rows gain nothing)."""
    o, i = w.shape
    xb = jnp.broadcast_to(x.reshape(1, i), (blocks, 1, i))
    return jnp.einsum("PMI,POI->MPO", xb, w.reshape(blocks, o // blocks, i)).reshape(x.shape[:-1] + (o,))


def _ffi(target: str, x: jax.Array, out: int) -> callable:
    out_type = jax.ShapeDtypeStruct(x.shape[:-1] + (out,), x.dtype)
    return jax.ffi.ffi_call(target, out_type, vmap_method="sequential")


def _kernel(target: str, out_width, xla_dot):
    """The custom call ``target`` as a differentiable function of (x, w): its JVP (and so its
    gradient) is ``xla_dot``'s; ``out_width(w)`` is the output width."""

    @jax.custom_jvp
    def dot(x: jax.Array, w: jax.Array) -> jax.Array:
        return _ffi(target, x, out_width(w))(x, w)

    @dot.defjvp
    def _jvp(primals, tangents):
        x, w = primals
        dx, dw = tangents
        return dot(x, w), xla_dot(dx, w) + xla_dot(x, dw)

    return dot


_kernel_dot = _kernel(FFI_TARGET, lambda w: w.shape[0], _xla_dot)  # w [out, in]
_kernel_dot_in_out = _kernel(FFI_TARGET_IN_OUT, lambda w: w.shape[1], _xla_dot_in_out)
_kernel_dot_panels = _kernel(FFI_TARGET_PANELS, lambda p: p.shape[0] * PANEL, _xla_dot_panels)
_kernel_dot_bf16 = _kernel(FFI_TARGET_BF16, lambda w: w.shape[0], _xla_dot_bf16)  # w [out, in]


def panel_matmul(x: jax.Array, p: jax.Array, *, preferred_element_type=None) -> jax.Array:
    """x [..., I] @ the weight whose panels are p [O/16, I, 16] (``to_panels``) -> [..., O].

    On CPU, float32, the kernel (``kernels/cpu/rows_matmul.cc``, ``PanelRange``) at any number
    of rows: it streams each panel once per 64 rows and keeps the FMA units near their peak
    (a SmolLM2 forward's matrices at 64 rows: 173 GFLOP/s on a 2-core AVX2 CPU whose measured
    peak is ~179). Elsewhere the XLA dot over the panels (accelerators never hold panels: they
    are made at load on CPU only, ``eagle3_jax.model.params.to_panels``).
    """
    out_type = jnp.dtype(preferred_element_type or x.dtype)
    if (x.dtype == p.dtype == out_type and math.prod(x.shape[:-1]) > 0
            and kernels_in_use(x.dtype, "matmul")):
        return jax.lax.platform_dependent(x, p, cpu=_kernel_dot_panels, default=_xla_dot_panels)
    return _xla_dot_panels(x, p, preferred_element_type=preferred_element_type)


def bfloat16_weights(w: jax.Array) -> jax.Array:
    """An [out, in] float32 weight held as bfloat16 where that is exact and the kernel reads
    it (float32 on CPU with the matmul kernel): a weight that is memory-bound at few rows
    (the draft head) is then read from half the bytes with the same products. Otherwise (a
    value bfloat16 would round, accelerators, the kernel off) ``w`` itself."""
    if (isinstance(w, jax.core.Tracer) or w.dtype != jnp.float32 or w.ndim != 2
            or not kernels_in_use(w.dtype, "matmul")):
        return w
    narrow = w.astype(jnp.bfloat16)
    exact = bool(jnp.array_equal(narrow.astype(jnp.float32), w))
    return narrow if exact else w


def panels_in_use(dtype) -> bool:
    """Whether float32 weights traced now on CPU would run the panel kernel, i.e. whether a
    serving model should hold its matrices as panels (``eagle3_jax.model.params.to_panels``)."""
    return kernels_in_use(dtype, "matmul")


def rows_matmul(x: jax.Array, w: jax.Array, *, in_out: bool = False,
                preferred_element_type=None, xla_single_row_blocks: int = 1) -> jax.Array:
    """x [..., I] @ w -> [..., O]: w is [O, I] (the ``[out, in]`` layout of ``to_serving``), or
    [I, O] with ``in_out`` (the draft head's layout).

    ``preferred_element_type``: the XLA dot's accumulation/result type (e.g. float32 logits
    from bfloat16 weights); the kernel, float32 only, already gives it.
    float32 x with a bfloat16 [out, in] w (``bfloat16_weights``): float32 products of the
    widened weights (exact), on CPU by the kernel's bfloat16 form (half the bytes read).
    ``xla_single_row_blocks`` > 1: where the XLA dot runs on CPU for a single row of an
    [out, in] weight, split ``w`` into that many row blocks (``_xla_single_row``).
    """
    rows = math.prod(x.shape[:-1])
    out_type = jnp.dtype(preferred_element_type or x.dtype)
    if w.dtype == jnp.bfloat16 and x.dtype == jnp.float32 and not in_out:
        # float32 rows times bfloat16 weights (``bfloat16_weights``), float32 results.
        if out_type == jnp.float32 and uses_kernel(rows, x.dtype):
            return jax.lax.platform_dependent(x, w, cpu=_kernel_dot_bf16, default=_xla_dot_bf16)
        return _xla_dot_bf16(x, w, preferred_element_type=preferred_element_type)
    kernel, xla = (_kernel_dot_in_out, _xla_dot_in_out) if in_out else (_kernel_dot, _xla_dot)
    if x.dtype == w.dtype == out_type and uses_kernel(rows, x.dtype, in_out):
        return jax.lax.platform_dependent(x, w, cpu=kernel, default=xla)
    blocks = xla_single_row_blocks
    if (not in_out and rows == 1 and blocks > 1 and w.shape[0] % blocks == 0
            and preferred_element_type is None and jax.default_backend() == "cpu"):
        return _xla_single_row(x, w, blocks)
    return xla(x, w, preferred_element_type=preferred_element_type)
