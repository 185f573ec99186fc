"""`hwkv verify` prints a table and its exit code says whether the contract held."""
import subprocess
import sys

import torch

from hwkv.testing import ContractTarget
from hwkv.testing.reference_backend import ReferenceBackend
from hwkv.testing.verify import run_contract


def test_verify_passes_on_cpu_and_prints_a_table():
    out = subprocess.run([sys.executable, "-m", "hwkv.cli", "verify", "--device", "cpu", "-k", "write or translat"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS" in out.stdout and "contract checks passed on cpu" in out.stdout


class BrokenBackend(ReferenceBackend):
    """Attends correctly but scales the output: the reference comparison must catch it."""

    def _attend(self, q, layer, kv, md, out):
        super()._attend(q, layer, kv, md, out)
        out.mul_(1.01)

    forward_decode = _attend
    forward_extend = _attend


def test_verify_fails_for_a_wrong_backend():
    code, results = run_contract([ContractTarget("broken", BrokenBackend, "cpu")], select="p1-fp32 and eager")
    assert code != 0
    assert [o for o, _ in results.values()] == ["failed"]
    assert "reference" in next(iter(results.values()))[1]


def test_an_error_pytest_raises_while_it_handles_ctrl_c_still_reads_as_the_interrupt(monkeypatch):
    """pytest 8 can fail with a TypeError while it formats an interrupted traceback (the signal landed in a frame
    without a line number; seen once in CI): after a Ctrl-C that error is the interrupt (exit 130 in hwkv.cli),
    without one it is raised as it is, and the SIGINT handler is Python's own again afterwards."""
    import signal

    import pytest

    from hwkv.testing import verify

    def interrupted_then_broken(args, plugins):
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            raise TypeError("unsupported operand type(s) for -: 'NoneType' and 'int'")
        raise AssertionError("the interrupt did not arrive")

    def broken(args, plugins):
        raise TypeError("a bug of pytest's, no interrupt")

    # SIGINT as in a terminal (Python's handler): a test run started in the background by a non-interactive shell
    # (CI) inherits it ignored, and then nothing is noted or raised
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        monkeypatch.setattr(verify.pytest, "main", interrupted_then_broken)
        assert verify._pytest_main([], None) == int(pytest.ExitCode.INTERRUPTED)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        monkeypatch.setattr(verify.pytest, "main", broken)
        with pytest.raises(TypeError, match="no interrupt"):
            verify._pytest_main([], None)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, outer)
