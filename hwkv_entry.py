"""The `hwkv` console script (and `python -m hwkv`): `hwkv.cli.main` behind a Ctrl-C guard for its imports.

Importing `hwkv` imports torch (about a second); a Ctrl-C then would end in a KeyboardInterrupt traceback
before `hwkv.cli.main`'s own handlers exist, or, landing inside a C extension's import (numpy's), in an
ImportError it was turned into. This module is outside the `hwkv` package because any module inside it runs
`hwkv/__init__.py` first, unguarded. While hwkv imports, a SIGINT is recorded: whatever the import then raises
(or if it swallowed the interrupt), the command ends as `hwkv: interrupted`, exit 130. Once main runs, its own
handlers say `hwkv <cmd>: interrupted`, also 130.
"""
import signal
import sys

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as hwkv.cli.EXIT_INTERRUPTED


def _interrupted() -> int:
    try:
        if sys.stderr is not None:   # (closed by the shell: print would fall back to stdout)
            print("hwkv: interrupted", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr itself is gone
        pass
    return EXIT_INTERRUPTED


def main() -> int:
    """Import and run `hwkv.cli.main`; a Ctrl-C while hwkv imports is one line on stderr and exit 130."""
    seen = []

    def on_sigint(signum, frame):  # Python's default handler, remembering that it ran
        seen.append(signum)
        raise KeyboardInterrupt

    # only where Ctrl-C would interrupt anyway (a job started with SIGINT ignored keeps ignoring it)
    guard = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if guard:
        signal.signal(signal.SIGINT, on_sigint)
    try:
        from hwkv.cli import main as cli_main
    except BaseException:
        if not seen:
            raise
    finally:
        if guard:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    if seen:
        return _interrupted()
    try:
        return cli_main()
    except KeyboardInterrupt:  # between the import and main's handlers
        return _interrupted()


if __name__ == "__main__":
    sys.exit(main())
