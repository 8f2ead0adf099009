"""``python -m eagle3_jax.export --checkpoint RUN_DIR [--step N] --out DIR [--dtype bfloat16]``

Writes a training run's draft head in the released EAGLE-3 format (``config.json`` +
``model.safetensors``, reference §6), loadable by ``eagle3_jax.draft.export.load_draft_head``,
SGLang / SpecForge and vLLM.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3_jax.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a training run's out_dir")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default latest)")
    parser.add_argument("--out", required=True, help="output folder for the head")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="weight dtype (default: the run's)")
    args = parser.parse_args(argv)

    from eagle3_jax.draft.export import DraftExportError, export_draft_head
    from eagle3_jax.train.checkpointing import TrainCheckpointError
    from eagle3_jax.train.loop import load_trained_head

    try:
        head, step = load_trained_head(args.checkpoint, args.step)
        out = export_draft_head(head, args.out, dtype=args.dtype)
    except (TrainCheckpointError, DraftExportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote the step-{step} draft head of {args.checkpoint} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
