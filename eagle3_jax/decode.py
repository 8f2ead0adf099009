"""``python -m eagle3_jax.decode``: the decoder's command line, :mod:`eagle3_jax.cli.decode`."""

from __future__ import annotations

import sys

from eagle3_jax.cli.decode import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
