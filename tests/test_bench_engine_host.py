"""benchmarks/bench_engine_host.py: the engine's host work per decode step over a zero model, as a smoke run."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_engine_host.py"


def test_engine_host_bench_reports_a_row_per_batch(tmp_path):
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--batch-sizes", "1,3", "--steps", "2", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [row["batch"] for row in rows] == [1, 3] and all(row["step_us"] > 0 for row in rows)
    assert "| 3 |" in r.stdout
