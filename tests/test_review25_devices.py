"""Review 25 (devices): vendor packages against the project's rules and the vendors' published signatures."""
import torch

from hwkv.batch import ForwardMode
from hwkv.testing.harness import Harness, ModelGeometry, run_scenario


def _meta_default():
    class _Ctx:
        def __enter__(self):
            torch.set_default_device("meta")

        def __exit__(self, *a):
            torch.set_default_device(None)
    return _Ctx()


def test_npu_fused_eager_path_names_every_device_under_a_meta_default(npu_standin):
    from hwkv_npu.backend import NPUBackend
    g = ModelGeometry(num_layers=2, swa_every=2, window=7, num_heads=4, num_kv_heads=2, head_dim=64, sinks=True)
    with _meta_default():
        h = Harness(NPUBackend, "cpu", g, size=1024, size_swa=256, page_size=128, dtype=torch.float16)
        run_scenario(h, steps=3, prompt_lens=(5, 20), chunk=16)


def test_npu_graph_path_names_every_device_under_a_meta_default(npu_standin):
    from hwkv_npu.backend import NPUBackend
    g = ModelGeometry(num_layers=2, swa_every=2, window=7, num_heads=4, num_kv_heads=2, head_dim=16)
    with _meta_default():
        h = Harness(NPUBackend, "cpu", g, size=1024, size_swa=256, page_size=16, dtype=torch.float16)
        h.enable_graphs([1, 2], npu_standin.graphs())
        rids = [h.add_request() for _ in range(2)]
        h.forward(rids, [5, 19], ForwardMode.EXTEND)
        for _ in range(2):
            h.forward(rids, [1, 1], ForwardMode.DECODE)
            h.release()


# ---- rule: device packages never translate locations (the core does, once per forward) ---------------
def test_device_packages_never_call_the_translation():
    """hwkv_cpu/backend.py overrides the core's list builders (_eager_lists/_eager_list) and calls the core's
    `_translate_window` itself, twice: the translation then happens in a device package."""
    import pathlib
    import re
    root = pathlib.Path(__file__).resolve().parents[1]
    hits = []
    for pkg in ("hwkv_cuda", "hwkv_rocm", "hwkv_xpu", "hwkv_npu", "hwkv_cpu", "hwkv_intel"):
        for path in sorted((root / pkg).rglob("*.py")):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if re.search(r"\b(_translate_window|translate_loc_from_full_to_swa)\s*\(", code) and "def " not in code:
                    hits.append(f"{path.relative_to(root)}:{i}")
    assert not hits, f"device packages translate locations: {hits}"


# ---- rule: device tests are marked per device for the CI matrix ------------------------------------------
def test_every_device_marker_has_a_test():
    """pyproject declares a `musa` marker and devices.yml runs `pytest -m musa`, but no test carries it
    (the workflow turns pytest's exit 5 into a notice): the MUSA job tests nothing."""
    import pathlib
    import re
    tests = pathlib.Path(__file__).resolve().parent
    src = "\n".join(p.read_text() for p in tests.glob("test_*.py") if p.name != pathlib.Path(__file__).name)
    missing = [m for m in ("cuda", "rocm", "xpu", "npu", "musa", "cpu", "interpret", "ipex")
               if not re.search(rf"mark\.{m}\b", src)]
    assert not missing, f"no test carries the marker(s) {missing}"


def _broken_module(tmp_path, name, exc):
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text(f"raise {exc}('driver/library mismatch (stand-in)')\n")
    return str(tmp_path)


def test_vendor_backends_module_collects_when_torch_npu_fails_to_import(tmp_path):
    """tests/test_vendor_backends.py:_npu_reason runs `import torch_npu` at collection and catches nothing: a
    torch_npu that raises OSError/RuntimeError on import (the CANN mismatch hwkv_npu.import_torch_npu documents)
    makes the whole module (ROCm, XPU and CPU tests too) a collection error instead of a skip with a reason."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_broken_module(tmp_path, "torch_npu", "OSError"), root]))
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        os.path.join(root, "tests", "test_vendor_backends.py")],
                       cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-1500:]


def test_cpu_sgl_kernel_import_failure_is_reported_not_raised(tmp_path, monkeypatch):
    """hwkv_cpu/amx.py:sgl_ops catches only ImportError/OSError from `import sgl_kernel`; hwkv_npu and hwkv_rocm
    report an installed-but-broken vendor library whatever it raises. A RuntimeError (an op registered twice, a
    torch version check) escapes from every CPU attention call that reaches the sgl-kernel branch and from
    `hwkv info`'s active_path()."""
    import sys
    import dataclasses
    from hwkv_cpu import amx
    monkeypatch.syspath_prepend(_broken_module(tmp_path, "sgl_kernel", "RuntimeError"))
    monkeypatch.delitem(sys.modules, "sgl_kernel", raising=False)
    found = dataclasses.replace(amx.features(), sgl_kernel=True)  # find_spec found it
    monkeypatch.setattr(amx, "features", lambda: found)
    amx.sgl_ops.cache_clear()
    try:
        ops, why = amx.sgl_ops()
        assert ops is None and "RuntimeError" in why
    finally:
        amx.sgl_ops.cache_clear()
