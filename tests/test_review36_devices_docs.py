"""Review 36 (device plug-ins, packaging, docs): defects found, each a failing test."""
from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest
import torch

from hwkv import cli, devices
from hwkv.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_review27_contract import cpu_forced_beside_a_broken_plugin  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


# ---- hwkv verify --device cpu beside a third-party plugin that fails to import (docs/bad-inputs.md row 212) -------

def test_verify_device_cpu_runs_beside_a_plugin_that_fails_to_import(tmp_path, monkeypatch, capsys):
    """Row 212 says `hwkv verify --device cpu` runs beside a broken plugin; available_targets loads every plugin."""
    with cpu_forced_beside_a_broken_plugin(tmp_path, monkeypatch, "broken36v"):
        code = cli.main(["verify", "--device", "cpu", "-q", "-k", "test_bad_speculative_input_raises_and_changes"])
    err = capsys.readouterr().err
    assert "failed to load" not in err, err
    assert code == 0, err


# ---- IPEX installed for this torch but its import raises (not ImportError/OSError) -------------------------------

def _broken_ipex(root: Path) -> None:
    """intel_extension_for_pytorch installed for this torch's major.minor, its import raising a RuntimeError."""
    major_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    pkg = root / "intel_extension_for_pytorch"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('oneCCL/oneDNN library mismatch (stand-in)')\n")
    info = root / f"intel_extension_for_pytorch-{major_minor}.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: intel-extension-for-pytorch\n"
                                   f"Version: {major_minor}.0\n")


def test_ipex_whose_import_raises_is_reported_not_raised(tmp_path, monkeypatch):
    """hwkv_intel.ipex._load catches only ImportError/OSError/AttributeError: a RuntimeError escapes `hwkv info`
    (traceback), make_backend on CPU and every CPU K/V store (even with ipex=False)."""
    importlib.import_module("hwkv_cpu.backend")  # its import-time IPEX check runs before the stand-in is installed
    from hwkv_cpu import amx
    from hwkv_cpu import ipex as cpu_ipex
    from hwkv_intel import ipex

    _broken_ipex(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    monkeypatch.setattr(ipex, "_LOADED", None)
    assert ipex.installed_reason() is None  # installed for this torch: the import is what fails
    try:
        ops, why = ipex.load()   # expected: (None, why), as sgl_kernel, aiter and torch_npu are reported
        assert ops is None and "RuntimeError" in why, why
        path, reason = amx.active_path()   # `hwkv info`'s CPU row
        assert "RuntimeError" in reason
        k_buf, v_buf = torch.zeros(8, 1, 4), torch.zeros(8, 1, 4)
        k, v = torch.ones(2, 1, 4), torch.ones(2, 1, 4)
        cpu_ipex.store_kv_prechecked(k_buf, v_buf, torch.tensor([1, 2]), k, v)  # the store registered for CPU
        assert k_buf[1:3].eq(1).all() and v_buf[1:3].eq(1).all()
    finally:
        sys.modules.pop("intel_extension_for_pytorch", None)


# ---- hwkv info --device NAME of a plugin whose layer_paths hook does not answer a PathTable ------------------------

def not_a_path_table() -> dict:
    """A third-party plugin's layer_paths hook answering something other than a hwkv.paths.PathTable."""
    return {"rows": []}


def test_info_device_whose_layer_paths_hook_answers_no_table_is_one_line_exit_2(capsys):
    """hwkv/cli.py layer_paths_data calls `fn().as_dict()` unchecked: an AttributeError traceback at the CLI
    (describe_attention_path checks its hook's answer and raises a DeviceError naming the device)."""
    spec = devices.DeviceSpec("lp36", -5, lambda: None, "hwkv_cpu.backend:TorchCPUBackend", "", "cpu",
                              "review 36 plugin", layer_paths=f"{__name__}:not_a_path_table")
    devices.register(spec)
    try:
        try:
            code = cli.main(["info", "--device", "lp36"])
        except AttributeError as e:  # the defect: a traceback
            pytest.fail(f"hwkv info --device lp36 raised {type(e).__name__}: {e}")
    finally:
        devices.unregister("lp36")
    err = capsys.readouterr().err
    assert code == 2 and "lp36" in err and "Traceback" not in err, err


# ---- CI: device jobs queued on changes to every in-repo package their backend runs -------------------------------

def _packages_reached(pkg: str) -> set:
    """The in-repo hwkv_* packages `pkg` imports, transitively (itself included)."""
    seen, todo = set(), [pkg]
    while todo:
        cur = todo.pop()
        if cur in seen:
            continue
        seen.add(cur)
        for path in (ROOT / cur).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                for name in names:
                    top = name.split(".")[0]
                    if top.startswith("hwkv_") and (ROOT / top).is_dir():
                        todo.append(top)
    return seen


@pytest.mark.parametrize("device", ["cuda", "rocm", "xpu", "npu", "musa"])
def test_device_job_path_filter_covers_every_package_its_backend_runs(device):
    """devices.yml (and the README's CI section): rocm and xpu run hwkv_cuda's TritonBackend, kernels and graph
    adapter, but a change to hwkv_cuda/** does not queue their jobs."""
    yaml = pytest.importorskip("yaml")
    wf = yaml.safe_load((ROOT / ".github" / "workflows" / "devices.yml").read_text())
    (flt,) = [s for s in wf["jobs"]["changes"]["steps"] if s.get("uses", "").startswith("dorny/paths-filter@")]
    globs = yaml.safe_load(flt["with"]["filters"])[device]
    spec = devices.IN_TREE[device]
    entry = devices.by_name(device)
    roots = {t.split(":")[0].split(".")[0] for t in (spec, entry.backend, entry.graph_adapter) if t}
    needed = set().union(*(_packages_reached(r) for r in roots))
    missing = sorted(p for p in needed if f"{p}/**" not in globs)
    assert not missing, f"{device}: a change to {missing} queues no {device} job (filters: {globs})"


# ---- CUDAGraphAdapter without a CUDA device ---------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA device")
def test_cuda_graph_adapter_without_cuda_is_a_config_error():
    """hwkv/graph.py TorchDeviceGraphAdapter.__init__ calls torch.cuda.Stream() unchecked: a bare RuntimeError
    ('torch.cuda.Stream requires CUDA support'); XPU/NPU/MUSA adapters refuse with a ConfigError."""
    from hwkv_cuda.graph import CUDAGraphAdapter
    with pytest.raises(ConfigError):
        CUDAGraphAdapter()

