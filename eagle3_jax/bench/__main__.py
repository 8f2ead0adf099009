"""``python -m eagle3_jax.bench <forward|prefill|train|speed|startup|calibrate> [options]``."""

import importlib
import sys

COMMANDS = ("forward", "prefill", "train", "speed", "startup", "calibrate")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m eagle3_jax.bench {{{','.join(COMMANDS)}}} [options]",
              file=sys.stderr)
        return 2
    return importlib.import_module(f"eagle3_jax.bench.{argv[0]}").main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
