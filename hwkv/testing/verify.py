"""`hwkv verify`: run the contract suite on a device and summarize it as a pass/fail table."""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import sys
from collections import OrderedDict
from typing import Any, List, Optional, TextIO, Tuple

try:
    import pytest
except ImportError:  # (the test extra's): `hwkv verify` alone needs it, and says so; the other commands run without it
    pytest = None  # type: ignore[assignment]

from hwkv.errors import ConfigError, DeviceError
from hwkv.sigint import python_sigint_here
from hwkv.testing import ContractTarget, available_targets

EXIT_USAGE = 2  # an unknown or unavailable device, or -k matching no check; the message goes to stderr
NO_TESTS_COLLECTED = 5  # pytest.ExitCode.NO_TESTS_COLLECTED
CONTRACT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "contract.py")


class ContractPlugin:
    """Parametrizes `hwkv_target` over the chosen targets and records each test's outcome; with `progress`
    (a text stream) it writes one line per check as it runs: its number, name, result and seconds."""

    def __init__(self, targets: List[ContractTarget], progress: Optional[TextIO] = None) -> None:
        self.targets = targets
        self.results: "OrderedDict[str, Tuple[str, str]]" = OrderedDict()
        self.progress = progress
        self.total = 0
        self.started = 0
        self._open: Optional[str] = None  # the check whose progress line awaits its result

    def pytest_generate_tests(self, metafunc: Any) -> None:
        if "hwkv_target" in metafunc.fixturenames:
            metafunc.parametrize("hwkv_target", self.targets, ids=[t.name for t in self.targets])

    def pytest_collection_finish(self, session: Any) -> None:
        self.total = len(session.items)

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        self.started += 1
        self._open = nodeid
        width = len(str(self.total))
        self._write(f"hwkv verify: [{self.started:>{width}}/{self.total}] {nodeid.split('::', 1)[-1]} ... ")

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when == "call" or report.outcome != "passed":
            msg = ""
            if report.outcome == "failed":
                msg = str(report.longrepr.reprcrash.message) if hasattr(report.longrepr, "reprcrash") else "failed"
            elif report.outcome == "skipped" and isinstance(report.longrepr, tuple):
                msg = str(report.longrepr[2])
            self.results[report.nodeid.split("::", 1)[-1]] = (report.outcome, msg.splitlines()[0] if msg else "")
            if self._open == report.nodeid:
                self._open = None
                self._write(f"{OUTCOMES.get(report.outcome, report.outcome.upper())} ({report.duration:.2f} s)\n")
            elif report.outcome == "failed":  # a teardown error after the check's own line
                self._write(f"hwkv verify:   {report.nodeid.split('::', 1)[-1]}: {report.when} FAIL\n")

    def pytest_runtest_logfinish(self, nodeid: str, location: Any) -> None:
        if self._open == nodeid:  # no report closed the line (should not happen): end it anyway
            self._open = None
            self._write("done\n")

    def interrupted(self) -> None:
        """Ctrl-C: end the open progress line, so the caller's own line starts on a fresh one."""
        if self._open is not None:
            self._open = None
            self._write("interrupted\n")

    def _write(self, text: str) -> None:
        if self.progress is not None:
            self.progress.write(text)
            self.progress.flush()


OUTCOMES = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}


def check_select(select: Optional[str]) -> None:
    """ConfigError when `select` is not a valid pytest -k expression (checked before anything runs; pytest
    itself would only say 'usage error')."""
    if not select:
        return
    try:
        from _pytest.mark.expression import Expression
    except ImportError:  # pytest moved it: pytest's own check still runs
        return
    try:
        Expression.compile(select)
    except Exception as e:  # SyntaxError (pytest >= 8.x) or ParseError (older)
        why = getattr(e, "msg", None) or str(e)
        col = getattr(e, "offset", None) or getattr(e, "column", None)
        where = f" at column {col}" if col else ""
        raise ConfigError(f"-k {select!r} is not a valid pytest -k expression{where}: {why}") from None


@contextlib.contextmanager
def _noting_interrupts() -> Any:
    """While pytest runs: a Ctrl-C is noted here, then raised as Python raises it (KeyboardInterrupt), so that an
    error pytest itself raises while it handles the interrupt still reads as the interrupt. (pytest 8 formats the
    interrupted traceback, which fails with a TypeError where the signal lands in a frame without a line number.)
    Nothing changes where SIGINT is ignored or handled by someone else, or off the main thread."""
    noted = {"interrupted": False}
    if not python_sigint_here():
        yield noted
        return

    def note(signum: int, frame: Any) -> None:
        noted["interrupted"] = True
        signal.default_int_handler(signum, frame)

    signal.signal(signal.SIGINT, note)
    try:
        yield noted
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _pytest_main(args: List[str], plugin: "ContractPlugin") -> int:
    """pytest.main's exit code; INTERRUPTED also where pytest failed while it handled a Ctrl-C. The caller's
    PYTEST_ADDOPTS (a `-m cuda` for its own suite, say) is set aside meanwhile: verify runs its own selection."""
    addopts = os.environ.pop("PYTEST_ADDOPTS", None)
    try:
        with _noting_interrupts() as noted:
            try:
                return int(pytest.main(args, plugins=[plugin]))
            except KeyboardInterrupt:
                raise
            except Exception:
                if noted["interrupted"]:
                    return int(pytest.ExitCode.INTERRUPTED)
                raise
    finally:
        if addopts is not None:
            os.environ["PYTEST_ADDOPTS"] = addopts


def run_contract(targets: List[ContractTarget], select: Optional[str] = None, verbose: bool = False,
                 progress: Optional[TextIO] = None) -> Tuple[int, "OrderedDict[str, Tuple[str, str]]"]:
    """Run the contract tests over `targets`; return pytest's exit code and per-test outcomes. `progress`:
    where to write a line per check as it runs (None: nowhere). Ctrl-C raises KeyboardInterrupt (pytest
    would turn it into its exit code)."""
    plugin = ContractPlugin(targets, None if verbose else progress)
    args = [CONTRACT, "-p", "no:cacheprovider", "--rootdir", os.path.dirname(CONTRACT), "-c", os.devnull,
            "-q" if verbose else "-qq", "--no-header", "-W", "ignore::pytest.PytestAssertRewriteWarning"]
    if not verbose:
        args += ["--tb=no"]
    if select:
        args += ["-k", select]
    if verbose:
        code = _pytest_main(args, plugin)
        if code == pytest.ExitCode.INTERRUPTED:
            raise KeyboardInterrupt  # pytest printed its own summary
        return code, plugin.results
    # quiet: pytest's progress line would sit above our table, so its output is kept aside and shown
    # (on stderr) only when pytest itself failed: a usage error, a collection error, an internal error
    with contextlib.redirect_stdout(io.StringIO()) as captured:
        code = _pytest_main(args, plugin)
    if code == pytest.ExitCode.INTERRUPTED:  # Ctrl-C: pytest's summary of it stays aside; hwkv.cli says it
        plugin.interrupted()
        raise KeyboardInterrupt
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED, pytest.ExitCode.NO_TESTS_COLLECTED):
        sys.stderr.write(captured.getvalue())
    return code, plugin.results


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="device plugin to verify (default: the detected one)")
    parser.add_argument("-k", dest="select", default=None, help="only tests matching this pytest -k expression")
    parser.add_argument("-v", "--verbose", action="store_true", help="show pytest's own output")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress line per check on stderr (the table still prints)")


def _device_name(name: Optional[str]) -> str:
    """The device to verify: `name` when known and available (else a DeviceError saying why), or the detected one."""
    from hwkv.integrations.device_choice import available_spec

    return available_spec(name).name


def run_verify(args: argparse.Namespace) -> int:
    """Print one row per contract test: PASS / FAIL / SKIP; exit 0 only when nothing failed, 2 on a bad argument."""
    try:
        if pytest is None:
            raise ConfigError("verify runs the contract suite under pytest, which is not installed here: pip install "
                              "pytest (or 'hwkv[test]')")
        check_select(args.select)
        name = _device_name(args.device)
    except (ConfigError, DeviceError) as e:
        print(f"hwkv verify: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    targets = available_targets(only=name)
    if not targets:
        print(f"hwkv verify: error: device {name!r} is not available here", file=sys.stderr)
        return EXIT_USAGE
    code, results = run_contract(targets, args.select, args.verbose,
                                 progress=None if getattr(args, "quiet", False) else sys.stderr)
    if not results:  # nothing ran: -k matched no check, or collection failed
        if code == NO_TESTS_COLLECTED and args.select:
            print(f"hwkv verify: error: no contract check matched -k {args.select!r}", file=sys.stderr)
            return EXIT_USAGE
        print(f"hwkv verify: error: no contract check ran (pytest exit code {code})",
              file=sys.stderr)
        return EXIT_USAGE if code == pytest.ExitCode.USAGE_ERROR else 1
    rows = [(test, outcome.upper().replace("PASSED", "PASS").replace("FAILED", "FAIL").replace("SKIPPED", "SKIP"), msg)
            for test, (outcome, msg) in results.items()]
    _print_table(name, rows)
    failed = sum(r[1] == "FAIL" for r in rows)
    passed, skipped = sum(r[1] == "PASS" for r in rows), sum(r[1] == "SKIP" for r in rows)
    print(f"{passed}/{len(rows)} contract checks passed on {name}" + (f", {skipped} skipped" if skipped else ""))
    return 0 if failed == 0 and code == 0 else 1


def _print_table(device: str, rows: List[Tuple[str, str, str]]) -> None:
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
    except ImportError:
        width = max((len(r[0]) for r in rows), default=10)
        for test, outcome, msg in rows:
            print(f"{test:<{width}}  {outcome:<4}  {msg}")
        return
    table = Table(title=f"hwkv contract suite on {device}")
    table.add_column("check", overflow="fold")
    table.add_column("result", no_wrap=True)
    table.add_column("detail", overflow="fold")
    colors = {"PASS": "green", "FAIL": "red", "SKIP": "yellow"}
    for test, outcome, msg in rows:
        table.add_row(escape(test), f"[{colors.get(outcome, 'white')}]{outcome}[/]", escape(msg))
    Console().print(table)
