"""JAX's persistent compilation cache under ``$EAGLE3_JAX_HOME/xla``, for the command-line tools.

A second start of the decoder finds its compiled prefill, decode step and generate loop on disk
instead of compiling them again (seconds each on a CPU). JAX keys every entry by the program,
the backend, the devices and the JAX/XLA versions, so a stale entry is never used. Turn it off
with ``EAGLE3_JAX_COMPILE_CACHE=0`` (or the decoder's ``--no-cache``); set it to a directory to
keep the entries there instead (the test suite shares one such directory across its processes).
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_SWITCH = "EAGLE3_JAX_COMPILE_CACHE"


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
    # Cache every program that took noticeable time to compile, whatever its size.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
