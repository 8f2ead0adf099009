"""The XLA flags the suite runs with, and the environment of a child process with another
number of emulated CPU devices or with the commands' own compile settings.

The suite emulates 8 CPU devices and compiles with LLVM's optimisations off and XLA's classic CPU
fusion emitters: its programs each run a few times, so compiling is most of its time, and so
set, XLA compiles them in about half the time (on a 2-core Xeon, 2026-12-07, the suite's pytest
time from a fresh clone fell by about a quarter at -O0 and by a tenth more with the classic
emitters: 16 min 27 s before, 10 min 50 s and 11 min 00 s after, with the changes of that date). XLA keeps IEEE semantics at every setting (no fast math), so
results differ at most by rounding, as between any two programs that sum in another order. The
benchmarks, ``make demo`` and every command compile with XLA's defaults, and so do the tests that
name ``AS_COMMANDS``: a decoder process started by ``tests/test_startup.py`` (EAGLE's answer
against plain decoding's) and the comparison with the PyTorch reference's float64 gradients in
``tests/test_ttt.py``. A flag named in ``XLA_FLAGS`` already is kept as given:
``XLA_FLAGS="--xla_backend_optimization_level=3 --xla_cpu_use_fusion_emitters=true"`` runs the
suite as the commands compile.
"""

from __future__ import annotations

import os
from typing import Mapping

DEVICE_COUNT = "--xla_force_host_platform_device_count"
COMPILE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                 "--xla_cpu_use_fusion_emitters=false")
TEST_FLAGS = (f"{DEVICE_COUNT}=8", *COMPILE_FLAGS)
# XLA's defaults for the flags of COMPILE_FLAGS, as ``jax.jit(..., compiler_options=...)``.
AS_COMMANDS = {"xla_backend_optimization_level": 3, "xla_llvm_disable_expensive_passes": False,
               "xla_cpu_use_fusion_emitters": True}


def _name(flag: str) -> str:
    return flag.split("=", 1)[0]


def with_test_flags(flags: str) -> str:
    """``flags`` (an ``XLA_FLAGS`` value) with each of ``TEST_FLAGS`` it does not name."""
    given = flags.split()
    named = {_name(f) for f in given}
    return " ".join(given + [f for f in TEST_FLAGS if _name(f) not in named])


def with_devices(flags: str, devices: int | None) -> str:
    """``flags`` with the emulated device count set to ``devices`` (``None``: JAX's one)."""
    kept = [f for f in flags.split() if _name(f) != DEVICE_COUNT]
    return " ".join(kept + ([] if devices is None else [f"{DEVICE_COUNT}={devices}"]))


def child_env(devices: int | None = None, environ: Mapping[str, str] = os.environ) -> dict:
    """The environment for a child process: this one's, with ``devices`` emulated CPU devices
    (``None``: one) and the suite's other compile flags."""
    return dict(environ, XLA_FLAGS=with_devices(environ.get("XLA_FLAGS", ""), devices))


def commands_env(environ: Mapping[str, str] = os.environ) -> dict:
    """The environment for a child process that compiles as the commands do: one device, none
    of the suite's flags."""
    suite = {_name(f) for f in TEST_FLAGS}
    kept = [f for f in environ.get("XLA_FLAGS", "").split() if _name(f) not in suite]
    return dict(environ, XLA_FLAGS=" ".join(kept))
