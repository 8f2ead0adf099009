"""The XLA flags the suite runs with, and the environment of a child process with another
number of emulated CPU devices or with the commands' own compile settings.

The suite emulates 8 CPU devices and compiles with LLVM's optimisations off and XLA's classic CPU
fusion emitters: its programs each run a few times, so compiling is most of its time, and so
set, XLA compiles them in about half the time. On a 2-core Xeon (2026-12-07) the suite's pytest
time from a fresh clone fell by about a quarter at -O0 and by a tenth more with the classic
emitters (16 min 27 s before, 10 min 50 s and 11 min 00 s after, with the changes of that date).
XLA keeps IEEE semantics at every setting (no fast math), so results differ at most by rounding,
as between any two programs that sum in another order. The benchmarks, ``make demo`` and every
command compile with XLA's defaults, and so do the tests that name ``AS_COMMANDS`` or
``commands_env``: a decoder process started by ``tests/test_startup.py`` (EAGLE's answer against
plain decoding's) and the comparison with the PyTorch reference's float64 gradients in
``tests/test_ttt.py``. A flag named in ``XLA_FLAGS`` already is kept as given:
``XLA_FLAGS="--xla_backend_optimization_level=3 --xla_cpu_use_fusion_emitters=true"`` runs the
suite as the commands compile.
"""

from __future__ import annotations

import os
from typing import Iterable, Mapping

DEVICE_COUNT = "--xla_force_host_platform_device_count"
# Each compile option the suite changes: (the suite's value, XLA's default).
COMPILE_OPTIONS = {"xla_backend_optimization_level": (0, 3),
                   "xla_llvm_disable_expensive_passes": (True, False),
                   "xla_cpu_use_fusion_emitters": (False, True)}
TEST_FLAGS = (f"{DEVICE_COUNT}=8", *(f"--{name}={str(test).lower()}"
                                     for name, (test, _) in COMPILE_OPTIONS.items()))
# XLA's defaults of COMPILE_OPTIONS, as ``jax.jit(..., compiler_options=AS_COMMANDS)``.
AS_COMMANDS = {name: default for name, (_, default) in COMPILE_OPTIONS.items()}


def _name(flag: str) -> str:
    return flag.split("=", 1)[0]


def _without(flags: str, names: Iterable[str]) -> list[str]:
    """The flags of ``flags`` (an ``XLA_FLAGS`` value) not named in ``names``."""
    names = set(names)
    return [f for f in flags.split() if _name(f) not in names]


def with_test_flags(flags: str) -> str:
    """``flags`` with each of ``TEST_FLAGS`` it does not name."""
    named = {_name(f) for f in flags.split()}
    return " ".join(flags.split() + [f for f in TEST_FLAGS if _name(f) not in named])


def with_devices(flags: str, devices: int | None) -> str:
    """``flags`` with the emulated device count set to ``devices`` (``None``: JAX's one)."""
    return " ".join(_without(flags, [DEVICE_COUNT])
                    + ([] if devices is None else [f"{DEVICE_COUNT}={devices}"]))


def child_env(devices: int | None = None, environ: Mapping[str, str] = os.environ) -> dict:
    """The environment for a child process: this one's, with ``devices`` emulated CPU devices
    (``None``: one) and the suite's other compile flags."""
    return dict(environ, XLA_FLAGS=with_devices(environ.get("XLA_FLAGS", ""), devices))


def commands_env(environ: Mapping[str, str] = os.environ) -> dict:
    """The environment for a child process that compiles as the commands do: one device, none
    of the suite's flags."""
    return dict(environ, XLA_FLAGS=" ".join(_without(environ.get("XLA_FLAGS", ""),
                                                     map(_name, TEST_FLAGS))))
