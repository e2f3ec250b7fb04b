"""One error type for bad input, and the CLI wrapper that turns it into a one-line message."""
from __future__ import annotations

import sys
from collections.abc import Callable


class SmeltError(Exception):
    """Bad input a user can fix (config key, missing file, impossible setting). Printed as one line."""


def run_cli(main: Callable[[], object]) -> None:
    """Run a command's main(); SmeltError/ValueError/FileNotFoundError become `error: ...` + exit 2."""
    try:
        main()
    except (SmeltError, ValueError, FileNotFoundError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(2)
