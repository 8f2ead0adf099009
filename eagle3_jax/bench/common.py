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


def measure_matmul_peak(repeats: int = 5) -> tuple[float, str]:
    """(FLOP/s, shape) of the fastest float32 matmul among large model-like shapes on the
    default device: the compute ceiling benchmarks quote their achieved rate against."""
    from eagle3_jax.decoding.costs import interleaved_medians

    shapes = [(2048, 576, 1536), (2048, 1536, 576), (1024, 1024, 1024), (512, 576, 8192)]
    fns, inputs = {}, {}
    for m, k, n in shapes:
        key = f"{m}x{k}x{n}"
        inputs[key] = (jax.random.normal(jax.random.key(0), (m, k), jax.numpy.float32),
                       jax.random.normal(jax.random.key(1), (k, n), jax.numpy.float32))
        dot = jax.jit(jax.numpy.matmul)
        fns[key] = lambda dot=dot, key=key: dot(*inputs[key])
    seconds = interleaved_medians(fns, repeats, warmup=2)
    rates = {key: 2 * m * k * n / seconds[key] for (m, k, n), key in zip(shapes, fns)}
    best = max(rates, key=rates.get)
    return rates[best], best


def run_bench_cli(parser, run, argv, load_fn) -> int:
    """Parse ``argv`` with ``parser`` and call ``run(args, load_fn)`` under
    :func:`eagle3_jax.errors.run_cli` (one-line errors); the exit status."""
    from eagle3_jax.errors import run_cli

    args = parser.parse_args(argv)

    def body() -> None:
        run(args, load_fn)
    return run_cli(body)


def draft_or_shipped(draft: str | None, target: str | None) -> str:
    """``draft``, else the path of the head shipped for ``target`` (a one-line error if none)."""
    if draft is not None:
        return draft
    from eagle3_jax.draft.shipped import shipped_head_for
    from eagle3_jax.errors import UsageError

    shipped = shipped_head_for(target)
    if shipped is None:
        raise UsageError("this target ships no draft head: pass --draft PATH")
    return str(shipped)
