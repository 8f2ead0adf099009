"""The package's error base and the one place the command-line tools turn errors into messages.

Every error that a user can fix (a bad path, flag, config, data file, checkpoint) is an
:class:`Eagle3Error`; each concern has its own subclass (``ConfigError``, ``CheckpointError``,
``DataError``, ...) that also derives from the builtin it refines (``ValueError`` mostly), so
``except ValueError`` keeps working for library callers. The CLIs catch :class:`Eagle3Error`
only: it prints as one line and exits with status 2, while anything else (an internal bug, an
XLA error) keeps its traceback. ``--debug`` shows the traceback of user errors too.
"""

from __future__ import annotations

import sys
import traceback
from typing import Callable

USER_ERROR_EXIT = 2


class Eagle3Error(Exception):
    """An error the user can fix; the message names the input and what to change."""


class UsageError(Eagle3Error, ValueError):
    """A bad command-line flag, or flags that do not go together."""


def run_cli(body: Callable[[], int | None], *, debug: bool = False) -> int:
    """Run a CLI's ``body``; returns its exit status (0 when it returns None).

    An :class:`Eagle3Error` prints ``error: <message>`` on stderr and gives status 2 (with the
    traceback too when ``debug``); Ctrl-C gives 130; every other exception propagates.
    """
    try:
        status = body()
    except Eagle3Error as e:
        if debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        return 130
    return 0 if status is None else int(status)
