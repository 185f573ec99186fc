"""Review 22 (devices): a torch_npu that crashes on import, make_backend's `device`, and ROCm's `hwkv info` table.

- A torch_npu whose import raises OSError or RuntimeError (a CANN/driver mismatch) is a reason in the NPU path
  table (`hwkv info --device npu` prints it, no traceback) and a ConfigError from NPUGraphAdapter, as an
  ImportError already was.
- `make_backend(device=torch.device(...))` takes the plugin serving that device type (it must be the pool's
  device); any other kind of value is a DeviceError naming it and what is accepted.
- `hwkv info --device rocm` reads the installed AITER through the backend's own loader: an AITER of another
  release (or one that does not import) shows the Triton rows the backend runs, not AITER's.
"""
from __future__ import annotations

import importlib.machinery
import json
import re
import sys
import types
from pathlib import Path

import pytest
import torch

import hwkv
from hwkv import cli, devices
from hwkv.errors import ConfigError, DeviceError
from hwkv.paths import FUSED, TORCH, TRITON
from hwkv.pool import SWAKVPool
from hwkv.testing.vendor_schemas import aiter as aiter_standin
from hwkv_rocm import aiter_ops
from hwkv_rocm import paths as rocm_paths

CRASHES = {"OSError": "libascendcl.so: driver version mismatch", "RuntimeError": "ACL init failed"}


def _write_module(root: Path, name: str, source: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An installed module `name` (a file on a fresh sys.path entry), never imported before."""
    (root / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delitem(sys.modules, name, raising=False)


# ---- 1. a torch_npu that crashes on import ---------------------------------------------------------
@pytest.fixture(params=sorted(CRASHES))
def crashing_torch_npu(request, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """torch_npu installed, its import raising something other than ImportError; torch.npu not registered."""
    kind = request.param
    _write_module(tmp_path, "torch_npu", f"raise {kind}({CRASHES[kind]!r})\n", monkeypatch)
    monkeypatch.delattr(torch, "npu", raising=False)
    monkeypatch.setenv("HWKV_DEVICE", "cpu")
    return f"{kind}: {CRASHES[kind]}"


def test_npu_path_table_reports_a_crashing_torch_npu(crashing_torch_npu: str):
    from hwkv_npu import paths as npu_paths

    table = npu_paths.layer_paths()
    assert len(table.rows) == 16 and {p.path for _, p in table.rows} == {TORCH}
    assert all(f"torch_npu is installed but does not import: {crashing_torch_npu}" in p.why for _, p in table.rows)


def test_info_device_npu_prints_the_crash_as_a_reason(crashing_torch_npu: str, capsys: pytest.CaptureFixture[str]):
    assert cli.main(["info", "--json", "--device", "npu"]) == 0
    rows = json.loads(capsys.readouterr().out)["layer_paths"]["rows"]
    assert rows and all(crashing_torch_npu in r["why"] for r in rows)


def test_npu_graph_adapter_refuses_a_crashing_torch_npu(crashing_torch_npu: str):
    from hwkv_npu.graph import NPUGraphAdapter

    with pytest.raises(ConfigError, match=f"does not import: {crashing_torch_npu}: NPU graphs") as e:
        NPUGraphAdapter()
    assert isinstance(e.value.__cause__.__cause__, (OSError, RuntimeError))  # the vendor's own error kept


def test_import_torch_npu_names_what_went_wrong(crashing_torch_npu: str, monkeypatch: pytest.MonkeyPatch):
    import hwkv_npu

    with pytest.raises(ConfigError, match=f"torch_npu is installed but does not import: {crashing_torch_npu}"):
        hwkv_npu.import_torch_npu()
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(ConfigError, match="torch_npu is not installed"):
        hwkv_npu.import_torch_npu()
    mod = types.ModuleType("torch_npu")
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    assert hwkv_npu.import_torch_npu() is mod


# ---- 2. make_backend's device -----------------------------------------------------------------------
def _pool_and_rtt(device: str = "cpu"):
    pool = SWAKVPool(size=64, size_swa=32, page_size=1, dtype=torch.float32, head_num=2, head_dim=8,
                     swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device=device)
    return pool, hwkv.ReqToTokenPool(size=2, max_context_len=32, device=device)


def test_make_backend_takes_a_torch_device_as_the_plugin_for_its_type():
    pool, rtt = _pool_and_rtt()
    cpu_backend = devices.discover()["cpu"].load_backend_class()
    for dev in (torch.device("cpu"), torch.device("cpu", 0)):
        backend = hwkv.make_backend(pool, rtt, device=dev, sliding_window=4)
        assert type(backend) is cpu_backend
        assert type(backend) is type(hwkv.make_backend(pool, rtt, device="cpu", sliding_window=4))


@pytest.mark.parametrize("device", [0, 1.5, True, object(), ["cpu"]], ids=["int", "float", "bool", "object", "list"])
def test_make_backend_refuses_other_kinds_of_device(device):
    pool, rtt = _pool_and_rtt()
    with pytest.raises(DeviceError, match=re.escape(f"device={device!r} ({type(device).__name__}) is not a device: "
                                                    "pass a device plugin name (one of [") + r".*'cpu'.*"
                                          + re.escape("]), a DeviceSpec, a torch.device or None")):
        hwkv.make_backend(pool, rtt, device=device, sliding_window=4)


def test_make_backend_refuses_a_torch_device_that_is_not_the_pools():
    pool, rtt = _pool_and_rtt()
    for dev in (torch.device("meta"), torch.device("cuda")):
        with pytest.raises(DeviceError, match=re.escape(f"device={dev!r} is not the pool's device cpu: build the "
                                                        f"pool on {dev.type!r} or pass device=None")):
            hwkv.make_backend(pool, rtt, device=dev, sliding_window=4)
    gpu_pool = types.SimpleNamespace(device=torch.device("cuda", 0))  # checked before any plugin is asked
    with pytest.raises(DeviceError, match=re.escape("device=device(type='cuda', index=1) is not the pool's device "
                                                    "cuda:0")):
        hwkv.make_backend(gpu_pool, rtt, device=torch.device("cuda", 1))


# ---- 3. ROCm: `hwkv info` reads AITER through the backend's loader ----------------------------------
def _aiter(decode_ok: bool, prefill_ok: bool) -> types.ModuleType:
    """An installed aiter whose ops have the verified signatures (the stand-ins) or another release's."""
    mod = aiter_standin.make_aiter("gfx942")
    if not decode_ok:
        mod.paged_attention_ragged = lambda out, query, key_cache: None
    if not prefill_ok:
        mod.mha_batch_prefill_func = lambda q, k, v: None
    return mod


def _fused_ops(table) -> set:
    return {p.op for _, p in table.rows if p.path == FUSED}


@pytest.fixture
def off_rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HWKV_DEVICE", "cpu")
    monkeypatch.setattr(torch.version, "hip", None)


@pytest.mark.parametrize("decode_ok,prefill_ok", [(True, True), (False, False), (True, False), (False, True)],
                         ids=["verified", "other-release", "decode-only", "prefill-only"])
def test_rocm_table_takes_only_the_aiter_ops_the_backend_takes(off_rocm, monkeypatch, decode_ok, prefill_ok):
    monkeypatch.setitem(sys.modules, "aiter", _aiter(decode_ok, prefill_ok))
    table = rocm_paths.layer_paths()
    want = {op for op, ok in ((aiter_ops.DECODE_OP, decode_ok), (aiter_ops.PREFILL_OP, prefill_ok)) if ok}
    assert _fused_ops(table) == want
    for kind, path in table.rows:
        if kind.feature != "sinks" and not (decode_ok if kind.mode == "decode" else prefill_ok):
            assert path.path == TRITON and "not the verified" in path.why, (kind.label, path)
    assert not any("not installed" in a for a in table.assumptions)
    if decode_ok:
        assert any(f"max_context_len <= {aiter_ops.MAX_CONTEXT}" in a for a in table.assumptions)


def test_rocm_table_agrees_with_the_backend(off_rocm, monkeypatch):
    """What the table calls fused is what a ROCmBackend built here would run on AITER, for each release."""
    pytest.importorskip("triton", reason="triton is not installed (pip install hwkv[cpu])")
    from hwkv.testing import contract
    from hwkv.testing.harness import Harness
    from hwkv_rocm.backend import ROCmBackend

    monkeypatch.setattr(aiter_ops, "arch_reason", lambda device: None)
    monkeypatch.setattr(aiter_ops, "gpu_arch", lambda device: "gfx942")
    for decode_ok, prefill_ok in ((True, True), (False, False), (True, False)):
        monkeypatch.setitem(sys.modules, "aiter", _aiter(decode_ok, prefill_ok))
        backend = Harness(ROCmBackend, "cpu", contract.SMALL, size=128, size_swa=32).backend
        env = backend.aiter_env
        took = set() if backend.aiter is None else {op for op, ok in ((aiter_ops.DECODE_OP, env.decode),
                                                                      (aiter_ops.PREFILL_OP, env.prefill)) if ok}
        assert _fused_ops(rocm_paths.layer_paths()) == took, backend.aiter_status


@pytest.mark.parametrize("raises", ["ImportError", "OSError"])
def test_rocm_table_and_backend_on_an_aiter_that_does_not_import(off_rocm, tmp_path, monkeypatch, raises,
                                                                  capsys: pytest.CaptureFixture[str]):
    _write_module(tmp_path, "aiter", f"raise {raises}('libhip: symbol not found')\n", monkeypatch)
    table = rocm_paths.layer_paths()
    assert {p.path for _, p in table.rows} == {TRITON}
    assert any("the ROCm backend refuses to build here unless aiter=False" in a and "libhip: symbol not found" in a
               for a in table.assumptions), table.assumptions
    assert cli.main(["info", "--json", "--device", "rocm"]) == 0  # one table, no traceback
    assert json.loads(capsys.readouterr().out)["layer_paths"]["assumptions"] == list(table.assumptions)
    with pytest.raises(ConfigError, match="aiter is installed but does not import.*libhip: symbol not found.*"
                                          "pass aiter=False"):
        aiter_ops.load_aiter()


def test_rocm_backend_refuses_an_aiter_that_crashes_on_import(tmp_path, monkeypatch):
    """An OSError from importing aiter is a ConfigError naming it (it had been the bare OSError)."""
    pytest.importorskip("triton", reason="triton is not installed (pip install hwkv[cpu])")
    from hwkv.testing import contract
    from hwkv.testing.harness import Harness
    from hwkv_rocm.backend import ROCmBackend

    _write_module(tmp_path, "aiter", "raise OSError('libamdhip64.so: cannot open shared object file')\n", monkeypatch)
    monkeypatch.setattr(aiter_ops, "arch_reason", lambda device: None)
    with pytest.raises(ConfigError, match=r"aiter is installed but does not import \(OSError: libamdhip64.so: "
                                          r"cannot open shared object file\); pass aiter=False") as e:
        Harness(ROCmBackend, "cpu", contract.SMALL, size=128, size_swa=32)
    assert isinstance(e.value.__cause__, OSError)
    assert Harness(ROCmBackend, "cpu", contract.SMALL, size=128, size_swa=32, aiter=False).backend.aiter is None
