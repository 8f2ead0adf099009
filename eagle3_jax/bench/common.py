"""Helpers shared by the benchmarks: tables, JSON, the machine description (timing itself is
:mod:`eagle3_jax.decoding.costs`, shared with the tree chooser)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import jax


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
