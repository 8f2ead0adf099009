"""Kernels below the model: a CPU matmul for few rows (``rows_matmul``), with an XLA fallback."""

from eagle3_jax.kernels.matmul import kernel_available, kernel_status, rows_matmul, uses_kernel

__all__ = ["kernel_available", "kernel_status", "rows_matmul", "uses_kernel"]
