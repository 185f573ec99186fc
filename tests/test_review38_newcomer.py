"""Review 38 (newcomer acceptance): README.md, docs/architecture.md and docs/devices.md followed step by step on a
CPU-only machine. Each test is a minimal failing reproduction of one defect; it states the correct behaviour and
passes once the defect is fixed."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PLAN = ["plan", "--model", "gpt-oss-20b", "--memory", "1GiB", "--context", "100"]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HWKV_DEVICE", "HWKV_DEBUG")}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}")
    return env


def _run_with_closed(fd: int, argv, timeout: int = 120) -> subprocess.CompletedProcess:
    """`hwkv ARGV` in a process started with file descriptor `fd` closed (as the shell's `>&-` / `2>&-`): Python
    then has sys.stdout / sys.stderr None. The other stream is captured."""
    return subprocess.run([sys.executable, "-c", "import sys; from hwkv_entry import main; sys.exit(main())", *argv],
                          cwd=REPO, env=_env(), text=True, timeout=timeout, preexec_fn=lambda: os.close(fd),
                          stdout=subprocess.PIPE if fd != 1 else None, stderr=subprocess.PIPE if fd != 2 else None)


BENCH = ["bench", "--quick", "--batch-sizes", "1", "--steps", "2", "--warmup", "1", "--configs", "once/eager",
         "--no-graph", "--threads", "1"]


@pytest.mark.parametrize("argv", [["--version"], PLAN, BENCH], ids=["--version", "plan", "bench"])
def test_cli_with_stdout_closed_ends_without_a_traceback(argv):
    """`hwkv --version >&-` / `hwkv plan ... >&-` (stdout closed by the shell) end in a traceback, AttributeError
    'NoneType' object has no attribute 'flush' from cli.main's sys.stdout.flush() (exit 1, the mismatch code).
    Expected: no traceback: the run ends quietly or with one `hwkv...: error:` line, exit 0 or 2 (never 1)."""
    run = _run_with_closed(1, argv)
    assert "Traceback" not in run.stderr, run.stderr[-600:]
    assert run.returncode in (0, 2), (run.returncode, run.stderr[-600:])


def test_cli_bad_flag_with_stderr_closed_exits_2():
    """`hwkv plan --model x 2>&-`: argparse's error goes through cli's _print_message, which writes to
    `file or sys.stderr` = None: an AttributeError (its traceback unseen) and exit 1, the code that means a
    reference mismatch. Expected: exit 2, a bad value's code, as with stderr open."""
    run = _run_with_closed(2, ["plan", "--model", "x"])
    assert run.returncode == 2


def test_verify_with_stderr_closed_reports_its_checks():
    """`hwkv verify -k ... 2>&-`: pytest's faulthandler plugin reads sys.stderr.fileno() (None), pytest ends in an
    INTERNALERROR it cannot print either, and verify exits 1 ("a check failed") with no table on stdout although
    every selected check passes. Expected: the PASS table on stdout and exit 0, as with stderr open."""
    run = _run_with_closed(2, ["verify", "-q", "-k", "test_tree_verify_accept_and_reuse and cpu-4-decode-eager"])
    assert run.returncode == 0 and "PASS" in run.stdout, (run.returncode, run.stdout[-600:])


def test_bench_serve_runs_on_the_device_its_flag_names():
    """`hwkv bench --workload serve --device cpu` builds the model on --device's tensors and titles the run with it,
    but serve.run_serve never hands the device to serve_hwkv's HybridRunner, which resolves the detected device
    instead: with HWKV_DEVICE=cuda (unavailable here) the run fails `HWKV_DEVICE='cuda' but device 'cuda' is
    unavailable`, where the decode and chat workloads, `hwkv generate` and `hwkv verify` run on the --device named.
    Expected: the runner takes --device (exit 0 here, the serve table on stdout)."""
    env = dict(_env(), HWKV_DEVICE="cuda", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "hwkv.cli", "bench", "--workload", "serve", "--device", "cpu",
                          "--serve-requests", "2", "--serve-new", "2", "--no-baseline", "--threads", "1"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "| hwkv |" in run.stdout, (run.returncode, run.stderr[-600:])
