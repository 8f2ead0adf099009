"""Kernels below the model: CPU custom calls for few-row matmuls (``rows_matmul``) and cached
attention (``cached_attention``), each with an XLA fallback; ``library.py`` loads them."""

from eagle3_jax.kernels.attention import cached_attention, uses_attention_kernel
from eagle3_jax.kernels.library import kernel_available, kernel_status, set_kernel_enabled
from eagle3_jax.kernels.matmul import rows_matmul, uses_kernel

__all__ = ["cached_attention", "kernel_available", "kernel_status", "rows_matmul",
           "set_kernel_enabled", "uses_attention_kernel", "uses_kernel"]
