"""The CPU kernel of eagle3_jax, built by the package's install with the system C++ compiler.

Everything else is in pyproject.toml. ``eagle3_jax/kernels/cpu/*.cc`` (XLA FFI handlers: few-row
matmuls near the memory floor on x86-64 CPUs, and the attention of few new tokens over a KV
cache) become the shared library ``eagle3_jax/kernels/_cpu_kernels*.so``, loaded with ctypes (it is not a Python module). The
extension is optional: without a compiler the install still succeeds and the package uses the
XLA dot instead (``eagle3_jax.kernels.kernel_status()`` says which is in use).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "eagle3_jax.kernels._cpu_kernels",
            sources=["eagle3_jax/kernels/cpu/rows_matmul.cc", "eagle3_jax/kernels/cpu/attention.cc"],
            depends=["eagle3_jax/kernels/cpu/parallel.h"],
            # The XLA FFI headers, vendored from jaxlib 0.10.2 (Apache-2.0): the C API is
            # versioned and stable, so the library runs under other jaxlib versions too.
            include_dirs=["eagle3_jax/kernels/cpu/include"],
            extra_compile_args=["-O3", "-std=c++17", "-Wno-attributes", "-Wno-return-type",
                                "-Wno-psabi"],
            language="c++",
            optional=True,
        )
    ]
)
