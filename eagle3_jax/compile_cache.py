"""JAX's persistent compilation cache under ``$EAGLE3_JAX_HOME/xla``, for the command-line tools.

A second start of the decoder finds its compiled prefill, decode step and generate loop on disk
instead of compiling them again (seconds each on a CPU). JAX keys every entry by the program,
the backend, the devices and the JAX/XLA versions, so a stale entry is never used. Turn it off
with ``EAGLE3_JAX_COMPILE_CACHE=0`` (or the decoder's ``--no-cache``); set it to a directory to
keep the entries there instead (the test suite keeps it off unless given a directory).

Compiled programs in memory: ``memory_mappings`` / ``near_mapping_limit`` say how close this
process is to Linux's limit on memory mappings (each compiled program holds some), and
``drop_compiled_programs`` frees them (the decoders' compile cache does so near the limit).
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_SWITCH = "EAGLE3_JAX_COMPILE_CACHE"
ENV_MIN_SECONDS = "EAGLE3_JAX_COMPILE_CACHE_MIN_SECONDS"
DEFAULT_MIN_SECONDS = 0.2


def enable_compile_cache(directory: str | Path | None = None) -> Path | None:
    """Point JAX's persistent cache at ``directory`` (default: the directory that
    ``EAGLE3_JAX_COMPILE_CACHE`` names, else ``$EAGLE3_JAX_HOME/xla``); returns it, or None
    when the switch is off."""
    switch = os.environ.get(ENV_SWITCH, "1").strip()
    if switch.lower() in ("0", "false", "off", "no"):
        return None
    import jax

    from eagle3_jax.checkpoints.default_model import cache_dir

    if directory is None and switch.lower() not in ("1", "true", "on", "yes", ""):
        directory = switch
    path = Path(directory) if directory is not None else cache_dir() / "xla"
    jax.config.update("jax_compilation_cache_dir", str(path))
    # Cache every program that took noticeable time to compile (``ENV_MIN_SECONDS``, default
    # 0.2 s; the test suite caches every program), whatever its size.
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(os.environ.get(ENV_MIN_SECONDS, DEFAULT_MIN_SECONDS)))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


# Each compiled CPU program keeps its machine code in memory mappings of its own, and Linux
# lets a process hold at most vm.max_map_count of them (65530 by default). A process that
# compiles program after program (a long benchmark, a server seeing many batch shapes) reaches
# it, the next compilation cannot map its code, and XLA crashes raising that failure (a
# segmentation fault while unwinding; an xdist worker of the test suite did on 2026-12-06).
# Long-lived compiling code checks ``near_mapping_limit()`` before compiling and drops compiled
# programs.
MAPPINGS_HIGH_WATER = 0.8  # of vm.max_map_count


def memory_mappings() -> tuple[int, int] | None:
    """(memory mappings this process holds, the most Linux lets it hold), or None where /proc
    does not say (not Linux)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            count = sum(1 for _ in maps)
        with open("/proc/sys/vm/max_map_count") as limit_file:
            limit = int(limit_file.read())
    except (OSError, ValueError):
        return None
    return count, limit


def near_mapping_limit(high_water: float = MAPPINGS_HIGH_WATER) -> tuple[int, int] | None:
    """:func:`memory_mappings` where the count is above ``high_water`` of the limit, else None."""
    mappings = memory_mappings()
    if mappings is None or mappings[0] <= high_water * mappings[1]:
        return None
    return mappings


def drop_compiled_programs() -> None:
    """Drop JAX's caches of traced and compiled programs and collect what only they held (their
    memory mappings with them); the next call of each function compiles again."""
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
