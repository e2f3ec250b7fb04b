"""One error type for bad input, and the one way a command reports it.

Every CLI (`python -m ...`) runs its main() through `run_cli`: bad input (SmeltError, ValueError,
FileNotFoundError, and argument errors through `ArgumentParser`) becomes `error: <one line>` on stderr
and exit status 2, with no traceback unless SMELT_TRACEBACK=1 asks for it.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

EXIT_BAD_INPUT = 2


class SmeltError(Exception):
    """Bad input a user can fix (config key, missing file, impossible setting). Printed as one line."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises SmeltError instead of printing usage and exiting, so a bad flag is one line too."""

    def error(self, message):
        raise SmeltError(f"{self.prog}: {message}")


def one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def run_cli(main: Callable[[], object], show: bool = True) -> None:
    """Run a command's main(); bad input exits 2 with one line, an int return value is the exit status.
    `show=False` exits the same way without printing (torchrun ranks other than 0: one line in all)."""
    try:
        status = main()
    except (SmeltError, ValueError, FileNotFoundError) as e:
        if os.environ.get("SMELT_TRACEBACK") == "1":
            raise
        if show:
            print(f"error: {one_line(e)}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    if isinstance(status, int):
        sys.exit(status)
