"""`hwkv verify`: run the contract suite on a device and summarize it as a pass/fail table."""
from __future__ import annotations

import argparse
import os
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import pytest

from hwkv.testing import ContractTarget, available_targets

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
    code = pytest.main(args, plugins=[plugin])
    return int(code), plugin.results


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="device plugin to verify (default: the detected one)")
    parser.add_argument("-k", dest="select", default=None, help="only tests matching this pytest -k expression")
    parser.add_argument("-v", "--verbose", action="store_true", help="show pytest's own output")


def run_verify(args: argparse.Namespace) -> int:
    """Print one row per contract test: PASS / FAIL / SKIP; exit 0 only when nothing failed."""
    from hwkv import devices

    name = args.device or devices.current_device().name
    targets = available_targets(only=name)
    if not targets:
        print(f"hwkv verify: device {name!r} is not available here")
        return 2
    code, results = run_contract(targets, args.select, args.verbose)
    rows = [(test, outcome.upper().replace("PASSED", "PASS").replace("FAILED", "FAIL").replace("SKIPPED", "SKIP"), msg)
            for test, (outcome, msg) in results.items()]
    _print_table(name, rows)
    failed = sum(r[1] == "FAIL" for r in rows)
    print(f"{len(rows) - failed}/{len(rows)} contract checks passed on {name}")
    if code == 5 or not rows:  # nothing collected
        return 1
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
