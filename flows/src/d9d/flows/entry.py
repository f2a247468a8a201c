"""The `d9d` console script: the command line, with Ctrl-C handled from the first instruction on.

`d9d.flows.cli` imports torch, pydantic and the stage registry, which takes seconds (tens of seconds on a loaded
machine). A Ctrl-C in that time raised `KeyboardInterrupt` out of an import, before `cli.main` could catch it: a
traceback and the exit status of a process killed by SIGINT instead of the documented 130. This module imports
nothing heavy until it is inside the handler.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as cli.EXIT_INTERRUPTED


def main(argv: Sequence[str] | None = None) -> int:
    try:
        from d9d.flows.cli import main as cli_main

        return cli_main(argv)
    except KeyboardInterrupt:
        # A Ctrl-C inside a run is answered by cli itself (it names what was kept); one that escapes came before any
        # stage started, so nothing was written.
        sys.stderr.write("d9d: interrupted (SIGINT) before any stage started; nothing was written\n")
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
