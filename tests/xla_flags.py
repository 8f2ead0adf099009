"""The XLA flags the suite runs with, and the environment of a child process with another
number of emulated CPU devices.

The suite emulates 8 CPU devices and compiles with LLVM's optimisations off: its programs each
run a few times, so compiling is most of its time, and at ``-O0`` without LLVM's expensive
passes XLA compiles a program in about two thirds of the time (the whole suite in about four
fifths) on a 2-core Xeon. XLA keeps IEEE semantics at every level (no fast math), so results
differ at most by where a multiply and an add fuse into one FMA, as between any two programs.
The benchmarks, ``make demo`` and every command compile at XLA's default level. A flag named in
``XLA_FLAGS`` already is kept as given: ``XLA_FLAGS=--xla_backend_optimization_level=2`` runs the
suite on optimised code.
"""

from __future__ import annotations

import os
from typing import Mapping

DEVICE_COUNT = "--xla_force_host_platform_device_count"
TEST_FLAGS = (f"{DEVICE_COUNT}=8", "--xla_backend_optimization_level=0",
              "--xla_llvm_disable_expensive_passes=true")


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
