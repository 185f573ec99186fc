"""benchmarks/bench_cuda_step.py off a GPU: without --device it says at once that it needs one (exit 2, one
line) instead of running GPU-sized sections on the CPU for minutes."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_cuda_step.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_without_a_gpu_it_says_so_at_once():
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "GPU" in lines[0] and "--device cpu" in lines[0]



def test_verify_step_section_runs_the_three_paths_on_the_cpu():
    """The verify-step section's code (VerifyStepGraph, the engine's host path, the layers alone) at a smoke size:
    every path takes its slots and releases, and the allocator is consistent after (checked inside)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_cuda_step as bench
    finally:
        sys.path.remove(str(SCRIPT.parent))
    from hwkv_cpu.backend import TorchCPUBackend
    (row,) = bench.verify_step_rows("cpu", [2], 64, 16, TorchCPUBackend, iters=1, rounds=1, modes=("decode",))
    assert row["bench"] == "verify-step" and row["bs"] == 2 and row["drafts"] == 4 and row["tree_verify"] == "decode"
    assert all(row[k] > 0 for k in ("graph_step_us", "host_path_us", "layers_replay_us"))


def test_draft_step_section_runs_the_three_paths_on_the_cpu():
    """The draft-step section's code (DraftStepGraph, the host path before it, the DraftGraphRunner's replay alone)
    at a smoke size: every path takes its slots and releases, and the allocator is consistent after (checked
    inside)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import bench_cuda_step as bench
    finally:
        sys.path.remove(str(SCRIPT.parent))
    from hwkv_cpu.backend import TorchCPUBackend
    (row,) = bench.draft_step_rows("cpu", [2], 64, 16, TorchCPUBackend, iters=1, rounds=1)
    assert row["bench"] == "draft-step" and row["bs"] == 2 and row["steps"] == 3 and row["draft_layers"] == 2
    assert all(row[k] > 0 for k in ("graph_step_us", "host_path_us", "runner_replay_us"))
