"""``python -m eagle3_jax.train --config configs/<preset>.yaml [key=value ...]``

Trains (or resumes, when ``out_dir`` already holds checkpoints) an EAGLE-3 draft head.
Overrides use dotted keys for nested sections: ``optimizer.learning_rate=3e-4 mesh.data=2``.
A bad config or a path in it that does not exist is reported in one line (exit status 2)
before anything loads; ``--debug`` adds the traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from eagle3_jax.errors import run_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eagle3_jax.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="train config YAML (configs/train-*.yaml)")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="stop (with a checkpoint) once this global step is reached")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config and exit")
    parser.add_argument("--distributed", choices=("off", "auto", "explicit"), default="off",
                        help="multi-host: 'auto' on Cloud TPU VMs (JAX finds the coordinator), "
                             "'explicit' with --coordinator/--num-processes/--process-id")
    parser.add_argument("--coordinator", default=None, help="HOST:PORT of process 0")
    parser.add_argument("--num-processes", type=int, default=None)
    parser.add_argument("--process-id", type=int, default=None)
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of user errors (config, paths, checkpoints) too")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run_cli(lambda: _run(args), debug=args.debug)


def _run(args: argparse.Namespace) -> int:
    from eagle3_jax.train.config import load_train_config

    cfg = load_train_config(args.config, args.overrides)
    if args.print_config:
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    from eagle3_jax.train.distributed import initialize
    from eagle3_jax.train.loop import check_inputs, train

    # Before the multi-host start-up, which waits for every process: a typo fails at once.
    check_inputs(cfg)
    initialize(args.distributed, args.coordinator, args.num_processes, args.process_id)
    from eagle3_jax.compile_cache import enable_compile_cache

    enable_compile_cache()  # a resumed run skips recompiling its step
    summary = train(cfg, max_steps=args.max_steps)
    summary.pop("draft_config", None)
    summary["losses"] = summary["losses"][-5:]
    print(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
