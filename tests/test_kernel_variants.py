"""The CPU kernels' AVX2/FMA variants, on a CPU with AVX-512.

The library picks its variants when it loads: AVX-512 where the CPU has it, else AVX2/FMA
(``kernels/cpu/parallel.h``), so on an AVX-512 machine the rest of the suite tests only the
AVX-512 ones. Here the kernel tests run again, a file per test, in a process with
``EAGLE3_JAX_CPU_KERNEL_ISA=avx2``
(the variants every AVX2-only CPU runs). On an AVX2-only CPU the suite covers them already.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_jax.kernels.library import ENV_ISA
from cpu_features import has_avx512

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not (platform.machine() in ("x86_64", "AMD64") and shutil.which("c++")
                         and has_avx512()),
                    reason="needs an x86-64 CPU with AVX-512 and the built kernels")
@pytest.mark.slow  # a second run of the kernel tests, left out of make test-fast
@pytest.mark.parametrize("tests", ["tests/test_cached_attention.py", "tests/test_rows_matmul.py"])
def test_the_avx2_variants_pass_the_kernel_tests(tests):
    env = dict(os.environ, **{ENV_ISA: "avx2"})
    status = subprocess.run(
        [sys.executable, "-c", "import eagle3_jax.kernels as k; print(k.kernel_status())"],
        env=env, capture_output=True, text=True, timeout=300)
    assert "AVX2/FMA variants" in status.stdout, status.stdout + status.stderr
    # The run's compilation cache (tests/conftest.py) serves the programs the in-process kernel
    # tests compiled: the custom calls resolve to this process's AVX2/FMA variants at run time.
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", tests],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
