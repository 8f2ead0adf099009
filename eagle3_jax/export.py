"""``python -m eagle3_jax.export --checkpoint RUN_DIR [--step N] --out DIR [--dtype bfloat16]``

Writes a training run's draft head in the released EAGLE-3 format (``config.json`` +
``model.safetensors``, reference §6), loadable by ``eagle3_jax.draft.load.load_head``,
SGLang / SpecForge and vLLM.
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    args = parser.parse_args(argv)

    def body() -> None:
        from eagle3_jax.draft.export import export_draft_head
        from eagle3_jax.draft.load import HeadError, check_head_path, load_head

        if (check_head_path(args.checkpoint) / "config.json").is_file():
            raise HeadError(f"--checkpoint {args.checkpoint} is already a released-format head; "
                            "give a training run's out_dir")
        loaded = load_head(args.checkpoint, step=args.step)
        out = export_draft_head(loaded.head, args.out, dtype=args.dtype)
        print(f"wrote the step-{loaded.step} draft head of {args.checkpoint} to {out}")

    return run_cli(body, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
