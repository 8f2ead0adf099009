"""Timing helpers shared by the benchmarks: interleaved repeats, medians, tables, plots."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

import jax


def time_call(fn: Callable[[], object]) -> float:
    """Seconds for one call, waiting for every device result."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def interleaved_medians(fns: Mapping[str, Callable[[], object]], repeats: int,
                        warmup: int = 1) -> dict[str, float]:
    """Median seconds per named function, run round-robin so machine noise hits all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            time_call(fn)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(time_call(fn))
    return {name: statistics.median(s) for name, s in samples.items()}


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def fmt(x):
        return f"{x:.4g}" if isinstance(x, float) else str(x)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str | Path, data: object) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def machine_description() -> dict[str, object]:
    import os
    import platform
    return {"platform": platform.platform(), "cpu_count": os.cpu_count(),
            "jax": jax.__version__, "backend": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()]}
