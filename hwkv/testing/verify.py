"""`hwkv verify`: run the contract suite on a device and summarize it as a pass/fail table."""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import pytest

from hwkv.errors import DeviceError
from hwkv.testing import ContractTarget, available_targets

EXIT_USAGE = 2  # an unknown or unavailable device, or -k matching no check; the message goes to stderr
NO_TESTS_COLLECTED = int(pytest.ExitCode.NO_TESTS_COLLECTED)
CONTRACT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "contract.py")


class ContractPlugin:
    """Parametrizes `hwkv_target` over the chosen targets and records each test's outcome."""

    def __init__(self, targets: List[ContractTarget]) -> None:
        self.targets = targets
        self.results: "OrderedDict[str, Tuple[str, str]]" = OrderedDict()

    def pytest_generate_tests(self, metafunc: Any) -> None:
        if "hwkv_target" in metafunc.fixturenames:
            metafunc.parametrize("hwkv_target", self.targets, ids=[t.name for t in self.targets])

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when == "call" or report.outcome != "passed":
            msg = ""
            if report.outcome == "failed":
                msg = str(report.longrepr.reprcrash.message) if hasattr(report.longrepr, "reprcrash") else "failed"
            elif report.outcome == "skipped" and isinstance(report.longrepr, tuple):
                msg = str(report.longrepr[2])
            self.results[report.nodeid.split("::", 1)[-1]] = (report.outcome, msg.splitlines()[0] if msg else "")


def run_contract(targets: List[ContractTarget], select: Optional[str] = None,
                 verbose: bool = False) -> Tuple[int, "OrderedDict[str, Tuple[str, str]]"]:
    """Run the contract tests over `targets`; return pytest's exit code and per-test outcomes."""
    plugin = ContractPlugin(targets)
    args = [CONTRACT, "-p", "no:cacheprovider", "--rootdir", os.path.dirname(CONTRACT), "-c", os.devnull,
            "-q" if verbose else "-qq", "--no-header", "-W", "ignore::pytest.PytestAssertRewriteWarning"]
    if not verbose:
        args += ["--tb=no"]
    if select:
        args += ["-k", select]
    if verbose:
        return int(pytest.main(args, plugins=[plugin])), plugin.results
    # quiet: pytest's progress line would sit above our table, so its output is kept aside and shown
    # (on stderr) only when pytest itself failed: a usage error, a collection error, an internal error
    with contextlib.redirect_stdout(io.StringIO()) as captured:
        code = int(pytest.main(args, plugins=[plugin]))
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED, pytest.ExitCode.NO_TESTS_COLLECTED):
        sys.stderr.write(captured.getvalue())
    return code, plugin.results


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="device plugin to verify (default: the detected one)")
    parser.add_argument("-k", dest="select", default=None, help="only tests matching this pytest -k expression")
    parser.add_argument("-v", "--verbose", action="store_true", help="show pytest's own output")


def _device_name(name: Optional[str]) -> str:
    """The device to verify: `name` when known and available (else a DeviceError saying why), or the detected one."""
    from hwkv import devices

    if name is None:
        return devices.current_device().name
    specs = devices.discover()
    spec = specs.get(name)
    if spec is None:
        raise DeviceError(f"unknown device {name!r}; known devices: {', '.join(sorted(specs))}")
    reason = spec.unavailable_reason()
    if reason is not None:
        raise DeviceError(f"device {name!r} is unavailable: {reason}")
    return name


def run_verify(args: argparse.Namespace) -> int:
    """Print one row per contract test: PASS / FAIL / SKIP; exit 0 only when nothing failed, 2 on a bad argument."""
    try:
        name = _device_name(args.device)
    except DeviceError as e:
        print(f"hwkv verify: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    targets = available_targets(only=name)
    if not targets:
        print(f"hwkv verify: error: device {name!r} is not available here", file=sys.stderr)
        return EXIT_USAGE
    code, results = run_contract(targets, args.select, args.verbose)
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
    print(f"{len(rows) - failed}/{len(rows)} contract checks passed on {name}")
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
