"""``python -m eagle3_jax.export --checkpoint RUN_DIR [--step N] --out DIR [--dtype bfloat16]``

Writes a training run's draft head in the released EAGLE-3 format (``config.json`` +
``model.safetensors``, reference §6), loadable by ``eagle3_jax.draft.load.load_head``,
SGLang / SpecForge and vLLM. Beside them, ``acceptance.json``: the run's held-out eval at that
step (per-depth top-r hit rates, what ``--total-tokens auto`` models trees from).

``--card TITLE`` also writes ``README.md``, the head's model card (``eagle3_jax.draft.card``),
from the run's records, ``--build-info JSON`` (data counts, hardware, the rebuild command) and
any ``--results NAME=bench_speed.json`` reports.
"""

from __future__ import annotations

import argparse
import json
import sys

from eagle3_jax.errors import run_cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3_jax.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="a training run's out_dir (or its checkpoints/<step> folder)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default latest)")
    parser.add_argument("--out", required=True, help="output folder for the head")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="weight dtype (default: the run's)")
    parser.add_argument("--card", metavar="TITLE", default=None,
                        help="also write README.md, the model card, with this title")
    parser.add_argument("--build-info", metavar="JSON", default=None,
                        help="with --card: JSON of data / hardware / notes / command lines")
    parser.add_argument("--results", metavar="NAME=JSON", action="append", default=[],
                        help="with --card: a `bench speed` report to include (repeatable)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    args = parser.parse_args(argv)

    def body() -> None:
        from pathlib import Path

        from eagle3_jax.draft.export import export_draft_head
        from eagle3_jax.draft.load import (ACCEPTANCE_FILE, METRICS_FILE, HeadError,
                                           check_head_path, latest_eval, load_head)

        if (check_head_path(args.checkpoint) / "config.json").is_file():
            raise HeadError(f"--checkpoint {args.checkpoint} is already a released-format head; "
                            "give a training run's out_dir")
        results = []
        for item in args.results:
            name, _, path = item.rpartition("=")  # the name may hold "=" (T=0)
            if not path or not Path(path).is_file():
                raise HeadError(f"--results takes NAME=PATH of a bench speed JSON, got {item!r}")
            results.append((name, json.loads(Path(path).read_text())))
        loaded = load_head(args.checkpoint, step=args.step)
        out = export_draft_head(loaded.head, args.out, dtype=args.dtype)
        run_dir = loaded.run_dir
        record = latest_eval(run_dir / METRICS_FILE, loaded.step)
        acceptance = out / ACCEPTANCE_FILE
        if record is not None:
            acceptance.write_text(json.dumps({"source": str(run_dir), **record}, indent=1) + "\n")
        elif acceptance.exists():
            acceptance.unlink()  # stale: from another head
        if args.card:
            from eagle3_jax.draft.card import model_card

            build = json.loads(Path(args.build_info).read_text()) if args.build_info else None
            card = model_card(run_dir, loaded.step, loaded.head.cfg, title=args.card,
                              weights_dtype=args.dtype or loaded.head.cfg.dtype, build=build,
                              results=results)
            (out / "README.md").write_text(card)
        print(f"wrote the step-{loaded.step} draft head of {args.checkpoint} to {out}")

    return run_cli(body, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
