"""Review 28: hwkv as a user gets it from `pip install hwkv[...]`, not from the source tree.

`make install` installs the checkout editable, so nothing in the suite looked at what a built wheel or sdist holds,
nor at how the extras resolve next to a vendor's torch. These tests build the sdist and the wheel from the tracked
files (about 2 s, no network: setuptools from this environment) and read pyproject.toml / devices.yml.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
import types
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _dist_names(reqs: list[str]) -> set[str]:
    """The normalized distribution names of PEP 508 requirement strings."""
    return {re.sub(r"[-_.]+", "-", re.match(r"\s*([A-Za-z0-9._-]+)", r).group(1)).lower() for r in reqs}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """The sdist and the wheel built from the git-tracked files (as a clean checkout has them)."""
    pytest.importorskip("setuptools")
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout")
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], check=True, capture_output=True).stdout
    src = tmp_path_factory.mktemp("src")
    for rel in filter(None, tracked.decode().split("\0")):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    out = tmp_path_factory.mktemp("dist")
    names = {}
    for kind in ("sdist", "wheel"):  # one process each (a wheel built after an sdist in one process goes missing)
        code = f"import sys; from setuptools import build_meta as b; print('@@', b.build_{kind}(sys.argv[1]))"
        res = subprocess.run([sys.executable, "-c", code, str(out)], cwd=src, capture_output=True, text=True,
                             timeout=120)
        if res.returncode != 0:
            pytest.skip(f"cannot build the {kind} here: {res.stderr.strip().splitlines()[-1:]}")
        names[kind] = [ln for ln in res.stdout.splitlines() if ln.startswith("@@ ")][-1].split()[1]
    sdist, wheel = names["sdist"], names["wheel"]
    with tarfile.open(out / sdist) as t:
        sdist_names = [n.split("/", 1)[1] for n in t.getnames() if "/" in n]
    with zipfile.ZipFile(out / wheel) as z:
        wheel_names = z.namelist()
    return {"sdist": sdist_names, "wheel": wheel_names}


# --- 1. the sdist ships the tests without what they need ------------------------------------------------------------

def test_sdist_that_ships_tests_ships_their_conftest_and_fixtures(built):
    """setuptools puts tests/test*.py into the sdist by default but not tests/conftest.py (the `one_thread`,
    `npu_standin`, `load_benchmark` fixtures, TRITON_INTERPRET=1 off a GPU) nor tests/plugins/: `pytest` in the
    unpacked sdist errors with "fixture 'one_thread' not found" (37 test modules use conftest fixtures). Either
    ship what the tests need (MANIFEST.in) or leave the tests out."""
    names = set(built["sdist"])
    shipped = sorted(n for n in names if re.fullmatch(r"tests/test_[^/]+\.py", n))
    if not shipped:
        return
    missing = [n for n in ("tests/conftest.py", "tests/plugins/hwkv_dummy.py") if n not in names]
    assert not missing, f"the sdist ships {len(shipped)} test modules but not {missing}"


# --- 2. license text ----------------------------------------------------------------------------------------------

def test_the_wheel_carries_the_license_text_it_declares(built):
    """pyproject declares `license = "Apache-2.0"`, but the repository has no LICENSE file, so neither the wheel
    (no *.dist-info/licenses/) nor the sdist carries the license text Apache-2.0 section 4(a) requires be given
    to recipients."""
    assert _pyproject()["project"]["license"] == "Apache-2.0"
    licenses = [n for n in built["wheel"] if re.search(r"\.dist-info/licenses/.+", n)]
    assert licenses, "the wheel has no license file (*.dist-info/licenses/ is empty)"


# --- 3. PEP 561 -----------------------------------------------------------------------------------------------------

def test_the_wheel_marks_hwkv_as_typed(built):
    """hwkv is annotated throughout and meant to be called from engines, but ships no `py.typed`: mypy/pyright in an
    engine that imports hwkv treat it as untyped ("missing library stubs or py.typed marker")."""
    assert "hwkv/py.typed" in built["wheel"]


# --- 4. the ROCm / XPU extras install PyPI's triton over the vendor's --------------------------------------------

def test_rocm_extra_does_not_pull_pypi_triton_over_pytorch_triton_rocm():
    """ROCm torch brings its Triton as the `pytorch-triton-rocm` distribution (the pyproject comment says so), which
    does not satisfy a requirement on the distribution `triton`: `pip install hwkv[rocm]` after the README's ROCm torch
    installs PyPI's latest `triton` into the same site-packages/triton/, over the build torch pins (the shadowing the
    musa extra's comment avoids for torch_musa's Triton)."""
    rocm = _pyproject()["project"]["optional-dependencies"]["rocm"]
    assert "triton" not in _dist_names(rocm), f"rocm extra {rocm} requires PyPI's triton distribution"


@pytest.mark.parametrize("device", ["rocm", "xpu"])
def test_device_ci_install_does_not_pull_pypi_triton_over_the_vendor_triton(device):
    """devices.yml installs `.[DEVICE,test]` after the vendor torch (README, CI section); the test extra's
    `triton>=3.0` is PyPI's triton, which on ROCm (pytorch-triton-rocm) and XPU (pytorch-triton-xpu) is not the
    installed Triton distribution, so pip writes PyPI's triton over it (PyPI's has no XPU backend at all)."""
    wf = (ROOT / ".github" / "workflows" / "devices.yml").read_text()
    m = re.search(rf'pip install "\.\[({device}(?:,[a-z]+)*)\]"', wf)
    assert m, f"devices.yml has no `pip install \".[{device},...]\"`"
    extras = _pyproject()["project"]["optional-dependencies"]
    reqs = [r for e in m.group(1).split(",") for r in extras[e]]
    assert "triton" not in _dist_names(reqs), f".[{m.group(1)}] requires PyPI's triton: {sorted(_dist_names(reqs))}"


# --- 5. the transformers extra's floor vs the serve workload's baseline ---------------------------------------------

def test_serve_baseline_on_a_transformers_without_continuous_batching_config_says_which_version_it_needs(monkeypatch):
    """`hwkv[transformers]` allows transformers>=4.56 (pyproject: tested with 4.56.2, 4.57.6, 5.0.0), but the serve
    workload's baseline imports `transformers.ContinuousBatchingConfig`, absent before 5.4/5.5 (not in 5.3.0, in
    5.5.4). With 4.57.6 `hwkv bench --workload serve` exits 0 with the row
    `failed: ImportError: cannot import name 'ContinuousBatchingConfig' from 'transformers' (/.../__init__.py)`:
    nothing says the comparison needs a newer transformers than the extra installs."""
    from hwkv.bench import serve

    stub = types.ModuleType("transformers")          # a transformers of the extra's range: no ContinuousBatchingConfig
    stub.GenerationConfig = object
    monkeypatch.setitem(sys.modules, "transformers", stub)
    monkeypatch.setattr(serve, "check_trace_fits", lambda w: None)
    monkeypatch.setattr(serve, "check_pools_fit", lambda model, w: None)
    monkeypatch.setattr(serve, "make_trace", lambda w, vocab: [])
    monkeypatch.setattr(serve, "serve_hwkv", lambda model, trace, w, prefix_cache=True, **kw: serve.ServeRow("hwkv", 0))
    model = types.SimpleNamespace(config=types.SimpleNamespace(
        get_text_config=lambda: types.SimpleNamespace(vocab_size=16)))
    res = serve.run_serve(model, serve.ServeWorkload(requests=1), "cpu", "stub")
    err = res.rows[-1].error
    assert err is not None  # the baseline cannot run on this transformers
    assert re.search(r"transformers\s*>=?\s*\d", err), f"the row does not say which transformers it needs: {err!r}"


# --- 6. the caller's PYTEST_ADDOPTS -------------------------------------------------------------------------------

def test_verify_runs_its_own_selection_whatever_pytest_addopts_says(capsys, monkeypatch):
    """An engine's CI exports PYTEST_ADDOPTS for its own suite (`-m cuda`, say); `hwkv verify` ran pytest in-process
    and took it: every contract check deselected, and a misleading "no contract check matched -k". Verify sets it
    aside for its run and puts it back."""
    from hwkv.cli import main

    monkeypatch.setenv("PYTEST_ADDOPTS", "-m cuda")
    code = main(["verify", "--device", "cpu", "-q", "-k", "writes_exactly_the_swa_loc"])
    out = capsys.readouterr().out
    assert code == 0 and "1/1 contract checks passed on cpu" in out
    import os
    assert os.environ["PYTEST_ADDOPTS"] == "-m cuda"
