"""``python -m eagle3_jax.bench startup``: how long the decoder takes from process start to exit.

Each repeat makes a fresh ``$EAGLE3_JAX_HOME`` holding only the default model's GGUF (linked),
then runs ``python -m eagle3_jax.decode --prompt Hi --max-new-tokens 8 --verbose`` twice in it:
the first start builds the tokenizer folder, the serving-weights cache and the compilation
cache, the second reads them. Reported per start (medians over repeats): wall time, the load
time and the time to the first token as the decoder logs them (``--verbose``). A plot (PNG)
shows the medians.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eagle3_jax.bench.common import machine_description, markdown_table, write_json

COMMAND = ("-m", "eagle3_jax.decode", "--prompt", "Hi", "--max-new-tokens", "8", "--verbose")
_LOADED = re.compile(r"\[loaded .* in ([0-9.]+) s\]")
_FIRST = re.compile(r"first token after ([0-9.]+) s")


def _one_start(home: Path) -> dict[str, float]:
    env = dict(os.environ, EAGLE3_JAX_HOME=str(home))
    env.pop("EAGLE3_JAX_WEIGHTS_CACHE", None)
    env.pop("EAGLE3_JAX_COMPILE_CACHE", None)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *COMMAND], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"the decoder failed:\n{proc.stderr[-2000:]}")
    loaded, first = _LOADED.search(proc.stderr), _FIRST.search(proc.stderr)
    return {"wall_s": wall, "load_s": float(loaded.group(1)) if loaded else float("nan"),
            "first_token_s": float(first.group(1)) if first else float("nan")}


def measure(repeats: int, log=print) -> dict[str, dict[str, float]]:
    from eagle3_jax.checkpoints.default_model import default_model_path

    gguf = default_model_path()
    runs: dict[str, list[dict[str, float]]] = {"first": [], "second": []}
    for r in range(repeats):
        with tempfile.TemporaryDirectory(prefix="eagle3_jax_startup_") as tmp:
            home = Path(tmp)
            os.symlink(gguf, home / gguf.name)
            for name in ("first", "second"):
                runs[name].append(_one_start(home))
                log(f"[repeat {r + 1}/{repeats}, {name} start: "
                    f"{runs[name][-1]['wall_s']:.2f} s]")
    return {name: {key: statistics.median(run[key] for run in rows) for key in rows[0]}
            for name, rows in runs.items()}


def plot(path: Path, medians: dict[str, dict[str, float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    names = list(medians)
    for i, key in enumerate(("wall_s", "load_s", "first_token_s")):
        ax.bar([j + 0.27 * (i - 1) for j in range(len(names))],
               [medians[n][key] for n in names], width=0.26, label=key.replace("_s", ""))
    ax.set_xticks(range(len(names)), [f"{n} start" for n in names])
    ax.set_ylabel("seconds (median)")
    ax.set_title("decode --prompt Hi --max-new-tokens 8, process start to exit")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eagle3_jax.bench startup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench_startup.json")
    p.add_argument("--no-plot", action="store_true")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    medians = measure(args.repeats, log=lambda m: print(m, file=sys.stderr, flush=True))
    rows = [[f"{name} start", round(m["wall_s"], 2), round(m["load_s"], 2),
             round(m["first_token_s"], 2)] for name, m in medians.items()]
    table = markdown_table(["start", "wall s", "load s", "first token s"], rows)
    print(table)
    out = Path(args.out)
    write_json(out, {"medians": medians, "repeats": args.repeats, "command": list(COMMAND),
                     "machine": machine_description()})
    if not args.no_plot:
        plot(out.with_suffix(".png"), medians)
    return 0


if __name__ == "__main__":
    sys.exit(main())
