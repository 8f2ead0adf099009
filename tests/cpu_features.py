"""What this CPU offers, for tests whose expectations depend on it (Linux /proc/cpuinfo)."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def has_avx512() -> bool:
    """Whether the CPU has AVX-512F: the kernels then run their AVX-512 variants (unless
    ``EAGLE3_JAX_CPU_KERNEL_ISA=avx2``). False where /proc/cpuinfo cannot be read."""
    try:
        return "avx512f" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
