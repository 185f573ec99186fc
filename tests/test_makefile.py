"""The quick start's install step picks torch's build by device: the CPU wheel index without an NVIDIA GPU."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _dry_run(tmp_path: Path, nvidia: bool, *overrides: str) -> str:
    """`make -n` of the install recipe (printed, not run), with or without an nvidia-smi on PATH."""
    bin_dir = tmp_path / ("gpu" if nvidia else "cpu")
    bin_dir.mkdir()
    if nvidia:
        smi = bin_dir / "nvidia-smi"
        smi.write_text("#!/bin/sh\nexit 0\n")
        smi.chmod(0o755)
    # PATH keeps what make and the shell need, without any real nvidia-smi
    path = os.pathsep.join([str(bin_dir)] + [p for p in os.environ["PATH"].split(os.pathsep)
                                              if p and not (Path(p) / "nvidia-smi").exists()])
    env = {**os.environ, "PATH": path}
    venv = tmp_path / "venv"
    # make by its own path: where nvidia-smi sits beside it (/usr/bin on a GPU machine) its folder is off PATH
    r = subprocess.run([shutil.which("make"), "-n", "-B", f"VENV={venv}", *overrides, f"{venv}/bin/hwkv"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.skipif(Path("/proc/driver/nvidia/version").exists(), reason="this machine has an NVIDIA driver")
def test_cpu_machines_take_the_cpu_wheel_index(tmp_path):
    out = _dry_run(tmp_path, nvidia=False)
    assert '"torch==2.13.0" ' + CPU_INDEX in out
    assert "--dry-run --no-index --no-deps" in out  # a local wheel of that version wins (this machine's case)
    assert out.index("torch==2.13.0") < out.index('-e ".[cpu,test,bench,interpret]"')  # torch before the extras


def test_nvidia_machines_take_pypi_and_overrides_win(tmp_path):
    out = _dry_run(tmp_path, nvidia=True)
    assert "whl/cpu" not in out and '"torch==2.13.0"' in out
    (tmp_path / "rocm").mkdir()
    out = _dry_run(tmp_path / "rocm", False, "TORCH_INDEX=https://download.pytorch.org/whl/rocm6.3",
                   "TORCH_VERSION=2.8.0")
    assert '"torch==2.8.0" --index-url https://download.pytorch.org/whl/rocm6.3' in out
