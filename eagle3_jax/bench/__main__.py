"""``python -m eagle3_jax.bench <forward|train|speed> [options]``."""

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ("forward", "speed")
    if not argv or argv[0] not in commands:
        print(f"usage: python -m eagle3_jax.bench {{{','.join(commands)}}} [options]",
              file=sys.stderr)
        return 2
    if argv[0] == "forward":
        from eagle3_jax.bench.forward import main as run
    else:
        from eagle3_jax.bench.speed import main as run
    return run(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
