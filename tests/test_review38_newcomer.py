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


def _closed_stdout():
    os.close(1)  # in the child, before exec: Python starts with no fd 1, so sys.stdout is None (as `hwkv ... >&-`)


@pytest.mark.parametrize("argv", [["--version"], PLAN], ids=["--version", "plan"])
def test_cli_with_stdout_closed_ends_without_a_traceback(argv):
    """`hwkv --version >&-` / `hwkv plan ... >&-` (stdout closed by the shell) end in a traceback, AttributeError
    'NoneType' object has no attribute 'flush' from cli.main's sys.stdout.flush() (exit 1, the mismatch code).
    Expected: no traceback: the run ends quietly or with one `hwkv...: error:` line, exit 0 or 2 (never 1)."""
    run = subprocess.run([sys.executable, "-c", "import sys; from hwkv_entry import main; sys.exit(main())", *argv],
                         cwd=REPO, env=_env(), stdout=None, stderr=subprocess.PIPE, text=True, timeout=120,
                         preexec_fn=_closed_stdout)
    assert "Traceback" not in run.stderr, run.stderr[-600:]
    assert run.returncode in (0, 2), (run.returncode, run.stderr[-600:])
