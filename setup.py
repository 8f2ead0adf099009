"""The CPU kernel of eagle3_jax, built by the package's install with the system C++ compiler.

Everything else is in pyproject.toml. ``eagle3_jax/kernels/cpu/*.cc`` (XLA FFI handlers: few-row
matmuls near the memory floor on x86-64 CPUs, and the attention of few new tokens over a KV
cache) become the shared library ``eagle3_jax/kernels/_cpu_kernels*.so``, loaded with ctypes (it
is not a Python module). The extension is optional: without a compiler the install still
succeeds and the package uses the XLA dot instead (``eagle3_jax.kernels.kernel_status()`` says
which is in use).
"""

import importlib.util
import sys
from pathlib import Path

from setuptools import Extension, setup


def xla_ffi_include_dir() -> str | None:
    """The XLA FFI headers that jaxlib ships (the folder ``jax.ffi.include_dir()`` names), found
    without importing jaxlib; None where this build environment has no jaxlib. jaxlib is a build
    requirement (pyproject.toml), and ``make setup`` builds without isolation against the venv's
    own jaxlib, so the headers are the runtime's."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return None
    include = Path(next(iter(spec.submodule_search_locations))) / "include"
    return str(include) if (include / "xla" / "ffi" / "api" / "ffi.h").is_file() else None


INCLUDE = xla_ffi_include_dir()
if INCLUDE is None:
    print("warning: no jaxlib with XLA FFI headers in the build environment: eagle3_jax is "
          "installed without its CPU kernels (pip install jaxlib, then reinstall)", file=sys.stderr)

setup(
    ext_modules=[] if INCLUDE is None else [
        Extension(
            "eagle3_jax.kernels._cpu_kernels",
            sources=["eagle3_jax/kernels/cpu/rows_matmul.cc", "eagle3_jax/kernels/cpu/attention.cc"],
            depends=["eagle3_jax/kernels/cpu/parallel.h"],
            include_dirs=[INCLUDE],
            extra_compile_args=["-O3", "-std=c++17", "-Wno-attributes", "-Wno-return-type",
                                "-Wno-psabi"],
            language="c++",
            optional=True,
        )
    ]
)
