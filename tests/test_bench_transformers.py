"""`benchmarks/bench_transformers.py --tiny` is a smoke run: well under a GB, every method's rows (its time is a
benchmark's figure, not asserted: about 10 s on a shared 2-core CPU, 68-77 s before --tiny sized its caches)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is in hwkv's test extra")

ROOT = Path(__file__).resolve().parents[1]
MAX_RSS = 1.5 * 2**30   # measured 0.54 GB (the imports alone 0.26 GB); 4.7-12.5 GB before --tiny sized its caches
HANG_SECONDS = 600      # only a hang is killed (a GPU machine's run compiles kernels, beside other test processes)


def _run_measured(cmd, tmp_path, timeout):
    """(return code, stdout, stderr, this child's peak RSS in bytes): the rusage of this one child (os.wait4), not
    RUSAGE_CHILDREN's maximum over every child the test process ever waited for (an earlier test's larger
    subprocess, a GPU run's multi-process tests, would count there)."""
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as fo, open(err, "w") as fe:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=fo, stderr=fe, text=True)
        timer = threading.Timer(timeout, p.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(p.pid, 0)
        finally:
            timer.cancel()
        p.returncode = os.waitstatus_to_exitcode(status)
    return p.returncode, out.read_text(), err.read_text(), usage.ru_maxrss * 1024  # Linux: KiB


def test_tiny_is_tiny(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_transformers.py"), "--tiny", "--json"]
    code, stdout, stderr, rss = _run_measured(cmd, tmp_path, HANG_SECONDS)
    assert code == 0, stderr[-2000:]
    data = json.loads(stdout)
    setup = data["setup"]
    assert (setup["prompt_len"], setup["new_tokens"], setup["batch_sizes"], setup["repeats"]) == (32, 16, "1,8", 1)
    assert not [row for row in data["rows"] if "error" in row], data["rows"]
    methods = {(row["method"], row["batch"]) for row in data["rows"]}
    assert {("hwkv", 1), ("hwkv", 8), ("hf-generate", 1), ("hf-generate", 8)} <= methods
    hwkv8 = next(row for row in data["rows"] if (row["method"], row["batch"]) == ("hwkv", 8))
    assert hwkv8["kv_held_bytes"] < hwkv8["kv_all_full_bytes"]  # W=8, page 4: the SWA layers gave slots back
    assert rss < MAX_RSS, rss
