"""The package's CPU kernels: one shared library, built by the install, loaded once.

``setup.py`` compiles ``kernels/cpu/*.cc`` (XLA FFI handlers) into ``_cpu_kernels*.so`` next to
this file with the system C++ compiler; it is loaded with ctypes (it is not a Python module) and
its handlers are registered as XLA custom-call targets for the CPU platform. The build is
optional: without a compiler, on a CPU without AVX2/FMA, or with ``EAGLE3_JAX_CPU_KERNEL=0``, the
callers (``matmul.py``, ``attention.py``) trace XLA ops instead. ``kernel_status()`` says which.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import os
from pathlib import Path

import jax
import jax.numpy as jnp

# "0" turns the kernels off (XLA ops everywhere); a comma list of FAMILIES keeps only those;
# "1" (the default) keeps those this CPU runs faster than XLA: all but "matmul_in_out" (the
# matmul kernel's form for [in, out] weights: the draft head, an untied output head) on a CPU
# without AVX-512 (``in_out_kernel_preferred``).
ENV_SWITCH = "EAGLE3_JAX_CPU_KERNEL"
# "avx2" runs the kernels' AVX2/FMA variants on a CPU with AVX-512 too (read when the library
# loads: to test and time them there; ``kernels/cpu/parallel.h``).
ENV_ISA = "EAGLE3_JAX_CPU_KERNEL_ISA"
FAMILIES = ("matmul", "matmul_in_out", "attention")
_LIBRARY_STEM = "_cpu_kernels"
# XLA custom-call target -> the handler symbol in the library.
TARGETS = {
    "eagle3_rows_matmul": "Eagle3RowsMatmul",  # kernels/cpu/rows_matmul.cc, w [out, in]
    "eagle3_rows_matmul_in_out": "Eagle3RowsMatmulInOut",  # the same, w [in, out]
    "eagle3_panel_matmul": "Eagle3PanelMatmul",  # the same, w as panels [out / 16, in, 16]
    "eagle3_rows_matmul_bf16": "Eagle3RowsMatmulBf16",  # w [out, in] in bfloat16
    "eagle3_cached_attention": "Eagle3CachedAttention",  # kernels/cpu/attention.cc
}
# What the kernels are built from (package-relative), for caches keyed on the timed code.
SOURCES = ("kernels/cpu/rows_matmul.cc", "kernels/cpu/attention.cc", "kernels/cpu/parallel.h")

_enabled_override: bool | tuple[str, ...] | None = None


def _library_path() -> Path | None:
    """The built library next to this file (any extension suffix), or None."""
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"{_LIBRARY_STEM}{suffix}"
        if path.is_file():
            return path
    return None


_LIBRARY: list[ctypes.CDLL] = []  # the loaded library, once _load has loaded it


@functools.cache
def _load() -> tuple[bool, str]:
    """Load the library and register its targets once: (available, why not / where from)."""
    path = _library_path()
    if path is None:
        return False, ("not built (no C++ compiler at install time?); "
                       "reinstall with `pip install -e .` to build it")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return False, f"cannot load {path.name}: {e}"
    if not lib.eagle3_rows_matmul_supported():
        return False, "this CPU lacks AVX2/FMA (or is not x86-64)"
    _LIBRARY.append(lib)
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")
    return True, str(path)


@functools.cache
def in_out_kernel_preferred() -> bool:
    """Whether the matmul kernel's [in, out] form is on by default here: it beats XLA's dot
    on CPUs with AVX-512, not on AVX2-only ones (``kernels/cpu/rows_matmul.cc``); also whether
    the kernels run their AVX-512 variants (``ENV_ISA``)."""
    if not kernel_available():
        return False
    return bool(_LIBRARY[0].eagle3_rows_matmul_in_out_preferred())


def set_kernel_enabled(enabled: bool | tuple[str, ...] | None):
    """Force the kernels on/off for code traced from now on: True (every family, whatever the
    CPU prefers), False, a tuple of FAMILIES to keep, or None (back to
    ``EAGLE3_JAX_CPU_KERNEL``, default: those this CPU prefers). Returns the previous
    setting. Already-compiled functions keep what they were traced with
    (``jax.clear_caches()`` drops them)."""
    global _enabled_override
    previous, _enabled_override = _enabled_override, enabled
    return previous


def _env_families() -> tuple[str, ...]:
    value = os.environ.get(ENV_SWITCH, "1").strip()
    if value == "0":
        return ()
    if value in ("", "1"):
        return tuple(f for f in FAMILIES if f != "matmul_in_out" or in_out_kernel_preferred())
    return tuple(f for f in FAMILIES if f in value.split(","))


def kernels_enabled(family: str | None = None) -> bool:
    """The switch (``set_kernel_enabled``, else ``EAGLE3_JAX_CPU_KERNEL``) for ``family`` (one
    of FAMILIES; None: any), availability aside."""
    if _enabled_override is None:
        families = _env_families()
    elif isinstance(_enabled_override, tuple):
        families = _enabled_override
    else:
        families = FAMILIES if _enabled_override else ()
    return bool(families) if family is None else family in families


def kernel_available() -> bool:
    """Whether the library is built, loaded and runnable on this CPU (switch aside)."""
    return _load()[0]


def kernels_in_use(dtype, family: str) -> bool:
    """Whether code of ``dtype`` traced now on CPU may use ``family``'s kernel (each caller adds
    its own shape limits): float32, its switch on, the CPU backend, the library available."""
    return (jnp.dtype(dtype) == jnp.float32 and kernels_enabled(family)
            and jax.default_backend() == "cpu" and kernel_available())


def kernel_status() -> str:
    """One line: whether the CPU kernels are in use here, and if not why."""
    available, detail = _load()
    if not available:
        return f"CPU kernels unavailable: {detail}; XLA ops are used instead"
    if not kernels_enabled():
        return f"CPU kernels off ({ENV_SWITCH}=0): XLA ops are used instead"
    families = [f for f in FAMILIES if kernels_enabled(f)]
    what = {"matmul": "matmuls", "matmul_in_out": "[in, out] matmuls",
            "attention": "cached attention"}
    isa = "AVX-512" if in_out_kernel_preferred() else "AVX2/FMA"
    return (f"CPU kernels in use for float32 {' and '.join(what[f] for f in families)} of few "
            f"rows, {isa} variants ({detail})")
