"""The CPU kernels' AVX2/FMA variants, on a CPU with AVX-512.

The library picks its variants when it loads: AVX-512 where the CPU has it, else AVX2/FMA
(``kernels/cpu/parallel.h``), so on an AVX-512 machine the rest of the suite tests only the
AVX-512 ones. Here the kernel tests run again, a file per test, in a process with
``EAGLE3_JAX_CPU_KERNEL_ISA=avx2`` (the variants every AVX2-only CPU runs). On an AVX2-only CPU
the suite covers them already.

The AVX2 variants are other machine code in the same C++ kernels, chosen per entry point when
the library loads; within a variant the shape picks the path only through loop bounds and
tails. So each file's tests all run again except its per-shape list, of which the cases below
reach every AVX2 path (`AVX2_CASES`); the other cases of that list run the same instructions
on other sizes.

``test_rows_matmul.py`` (``kernels/cpu/rows_matmul.cc``). Every test but the per-shape one runs
whole: the kernel's lowering and the [in, out] form's default (off under the AVX2 variants),
every small and ragged shape (`in` tails of 1-7 floats past the 8-lane vectors, `out` tails
past the 3-row blocks of the [out, in] and bfloat16 forms and past the 32-column blocks of the
[in, out] form), the panels' tiny shapes, the while-loop and gradient tests, the fallbacks,
``bfloat16_weights``. Of the per-shape test, each layout (out_in, in_out, bf16, panels) at
in = 576 (the smallest), 28672 (the largest: the longest sums, 3584 products in each of 8
lanes) and 1152 with out = 192 (3-row blocks and no tail, two chunks; 12 panels), each at every
row count: 1 to 64 rows (1- to 4-row blocks, made even, one to 16 of them), for the panels also
65 and 150 (chunks of 64 rows). At out = 257 the [out, in] forms run chunks of 96 outputs and a
last one of 65 (3-row blocks and a 2-row tail), the [in, out] form 8 blocks of 32 columns and a
scalar one. The bfloat16 form reads its weights directly up to 4 rows and widens them once for
more, and under the AVX2 variants its results must equal the float32 kernel's bit for bit. (The
bfloat16 and panel forms have AVX2 code only: they are here for completeness.)

``test_cached_attention.py`` (``kernels/cpu/attention.cc``, its ``Narrow`` blocking of 8
lanes). Every test but the per-preset one runs whole: the float64 checks (head dim 32, causal
and tree masks), long caches of up to 1024 slots (several 64-slot chunks, a partial last chunk
copied, a full and an empty cache), a row that sees nothing, the while loop and gradient (head
dim 16: 2 vectors of the head dim per pass over the values, where 32-128 use 4), the fallbacks.
Of the per-preset test, the layouts 9/3 heads of 64 (the only head dim 64: tasks of 4 rows with
3 used, and of 12 rows with 6, 7, 11 and 12 used), 32/32 of 128 (tasks of 4 rows with 1 and 2
used, of 12 with 8, 9 and 11) and 32/8 of 128 (a full task of 4 rows; 4, 8, 10, 11, 12 of 12),
each at every token count: every pair of (head dim 64 or 128, 4- or 12-row task) the presets
have, with rows left over from the 4-row score blocks and 2-row value passes of every count.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_jax.kernels.library import ENV_ISA
from cpu_features import has_avx512

ROOT = Path(__file__).resolve().parents[1]
# file -> (its per-shape test, the parameter ids of that test's cases run under AVX2; a case
# runs when its id contains one of them). Every other test of the file runs.
AVX2_CASES = {
    "tests/test_cached_attention.py": ("test_matches_xla_for_every_preset_layout",
                                       ("heads9-kv3-dim64", "heads32-kv32-dim128",
                                        "heads32-kv8-dim128")),
    "tests/test_rows_matmul.py": ("test_kernel_matches_the_xla_dot_on_every_model_shape",
                                  ("x576-", "192x1152-", "x28672-")),
}


@pytest.mark.skipif(not (platform.machine() in ("x86_64", "AMD64") and shutil.which("c++")
                         and has_avx512()),
                    reason="needs an x86-64 CPU with AVX-512 and the built kernels")
@pytest.mark.slow  # a second run of the kernel tests, left out of make test-fast
@pytest.mark.parametrize("tests", sorted(AVX2_CASES))
def test_the_avx2_variants_pass_the_kernel_tests(tests):
    env = dict(os.environ, **{ENV_ISA: "avx2"})
    status = subprocess.run(
        [sys.executable, "-c", "import eagle3_jax.kernels as k; print(k.kernel_status())"],
        env=env, capture_output=True, text=True, timeout=300)
    assert "AVX2/FMA variants" in status.stdout, status.stdout + status.stderr
    test, cases = AVX2_CASES[tests]
    # The run's compilation cache (tests/conftest.py) serves the programs the in-process kernel
    # tests compiled: the custom calls resolve to this process's AVX2/FMA variants at run time.
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-n", "0", tests,
         "-k", f"not {test} or " + " or ".join(cases)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    report = done.stdout[-4000:] + done.stderr[-2000:]
    assert done.returncode == 0, report
    # Nothing skipped, and each chosen case of the per-shape test ran and passed.
    assert not re.search(r"\d+ skipped", done.stdout), report
    passed = re.findall(rf"::{test}\[([^\]]*)\] PASSED", done.stdout)
    for case in cases:
        assert any(case in ids for ids in passed), (case, report)
