"""Device plugins: DeviceSpec, entry-point discovery, selection, probes, and a device-free core."""
from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest
import torch

from hwkv import devices
from hwkv.devices import DeviceSpec, discover, register, report, select, unregister
from hwkv.errors import ConfigError, DeviceError

REPO = Path(__file__).resolve().parents[1]
DUMMY_SRC = Path(__file__).parent / "plugins" / "hwkv_dummy.py"
ORDER = ["musa", "npu", "rocm", "cuda", "xpu", "cpu"]
VENDOR_MODULES = ["triton", "torch_npu", "torch_musa", "intel_extension_for_pytorch", "aiter",
                  "sgl_kernel", "flashinfer"]


def install_dist(root: Path, dist: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
    """Write a real installed distribution (dist-info with METADATA + entry_points.txt) under `root`."""
    info = root / f"{dist}-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{devices.ENTRY_POINT_GROUP}]\n{lines}")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(source)


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A temporary sys.path entry for plugin distributions; their modules are forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith(("hwkv_dummy", "hwkv_broken", "hwkv_misnamed", "fake_ext")):
            del sys.modules[name]


def _with(specs: dict[str, DeviceSpec], available: set[str]) -> dict[str, DeviceSpec]:
    """The specs with probes replaced: `available` names answer None, the others a reason."""
    def probe(name: str):
        return (lambda: None) if name in available else (lambda: f"no {name} here")
    return {n: dataclasses.replace(s, probe=probe(n)) for n, s in specs.items()}


def _spec(name: str, priority: int, reason: Optional[str] = None) -> DeviceSpec:
    return DeviceSpec(name, priority, lambda: reason, f"{name}_pkg.backend:B", "", "cpu", f"test {name}")


@pytest.fixture(autouse=True)
def _fresh_current_device():
    """current_device() is cached per process: no test sees another's result."""
    devices.current_device.cache_clear()
    yield
    devices.current_device.cache_clear()


@pytest.fixture(scope="module")
def in_tree() -> dict[str, DeviceSpec]:
    return {n: s for n, s in discover().items() if n in ORDER}


# -------------------------------------------------------------------- registry

def test_in_tree_table_matches_pyproject():
    eps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["hwkv.devices"]
    assert eps == devices.IN_TREE


def test_in_tree_specs_without_the_distribution(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(devices, "_entry_points", lambda: ())
    specs = discover()
    assert set(ORDER) <= set(specs)
    assert all(specs[n].name == n for n in ORDER)


def test_priority_order(in_tree: dict[str, DeviceSpec]):
    assert [s.name for s, _ in report(in_tree)] == ORDER
    assert in_tree["cpu"].is_available() and in_tree["cpu"].priority == 0


def test_in_tree_import_strings(in_tree: dict[str, DeviceSpec]):
    assert in_tree["cpu"].backend == "hwkv_cpu.backend:TorchCPUBackend"
    assert in_tree["musa"].backend == in_tree["cuda"].backend == "hwkv_cuda.backend:TritonBackend"
    assert in_tree["rocm"].graph_adapter == in_tree["cuda"].graph_adapter == "hwkv_cuda.graph:CUDAGraphAdapter"
    assert in_tree["musa"].graph_adapter == "hwkv_cuda.graph:MUSAGraphAdapter"
    assert {s.torch_device for s in in_tree.values()} == {"cpu", "cuda", "xpu", "npu", "musa"}


@pytest.mark.parametrize("available, expected", [
    ({"cpu"}, "cpu"),
    ({"cuda", "cpu"}, "cuda"),
    ({"xpu", "cpu"}, "xpu"),
    ({"rocm", "xpu", "cpu"}, "rocm"),
    ({"npu", "rocm", "cuda", "cpu"}, "npu"),
    (set(ORDER), "musa"),
])
def test_highest_priority_available_wins(in_tree, available: set[str], expected: str):
    assert select(_with(in_tree, available)).name == expected


def test_fallback_to_cpu(in_tree):
    specs = _with(in_tree, {"cpu"})
    assert select(specs).name == "cpu"
    assert [reason for _, reason in report(specs)][:-1] == [f"no {n} here" for n in ORDER[:-1]]


def test_forced_device(in_tree):
    specs = _with(in_tree, {"cuda", "cpu"})
    assert select(specs, "cpu").name == "cpu"
    assert select(specs, "cuda").name == "cuda"


def test_forced_unavailable_device_says_why_and_lists_available(in_tree):
    with pytest.raises(DeviceError) as e:
        select(_with(in_tree, {"xpu", "cpu"}), "cuda")
    msg = str(e.value)
    assert "HWKV_DEVICE='cuda'" in msg and "no cuda here" in msg and "available: xpu, cpu" in msg


def test_forced_unknown_device_lists_known_and_available(in_tree):
    with pytest.raises(DeviceError) as e:
        select(_with(in_tree, {"cpu"}), "nonexistent")
    msg = str(e.value)
    assert "'nonexistent'" in msg and "known: cpu, cuda, musa, npu, rocm, xpu" in msg and "available: cpu" in msg


def test_tie_at_the_top_is_an_error_naming_both():
    specs = {s.name: s for s in [_spec("alpha", 30), _spec("beta", 30), _spec("cpu", 0)]}
    with pytest.raises(DeviceError, match="'alpha' and 'beta'.*HWKV_DEVICE"):
        select(specs)
    assert select(specs, "beta").name == "beta"  # forcing resolves the tie
    unavailable_beta = dict(specs, beta=_spec("beta", 30, "gone"))
    assert select(unavailable_beta).name == "alpha"
    below = {s.name: s for s in [_spec("alpha", 5), _spec("beta", 5), _spec("top", 9)]}
    assert select(below).name == "top"  # a tie below the top does not matter


def test_nothing_available_is_an_error():
    with pytest.raises(DeviceError, match="no device is available"):
        select({"x": _spec("x", 1, "absent")})


def test_probe_exceptions_propagate_typed_and_a_forced_other_device_skips_them():
    def boom() -> Optional[str]:
        raise RuntimeError("probe exploded")
    spec = dataclasses.replace(_spec("x", 1), probe=boom)
    specs = {"x": spec, "cpu": _spec("cpu", 0)}
    for call in (lambda: report(specs), lambda: select(specs), lambda: select(specs, "x")):
        with pytest.raises(DeviceError, match="device 'x': its probe raised RuntimeError: probe exploded.*"
                           "HWKV_DEVICE") as err:  # never read as "unavailable": not swallowed
            call()
        assert isinstance(err.value.__cause__, RuntimeError)
    assert select(specs, "cpu").name == "cpu"  # only the forced device is probed
    specs["y"] = _spec("y", 2, "no such card")  # forced and unavailable: its own reason, the crash only listed
    with pytest.raises(DeviceError, match="HWKV_DEVICE='y' but device 'y' is unavailable: no such card; "
                                          "available: cpu$"):
        select(specs, "y")
    with pytest.raises(DeviceError, match="non-empty reason"):
        _spec("y", 1, "").is_available()


def test_register(in_tree, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(devices, "_REGISTERED", {})
    spec = _spec("extra", 99)
    register(spec)
    assert discover()["extra"] is spec
    assert devices.current_device() is spec  # the cache was cleared by register()
    with pytest.raises(DeviceError, match="already registered"):
        register(_spec("extra", 1))
    register(_spec("extra", 1), replace=True)
    unregister("extra")
    assert "extra" not in discover()


def test_current_device_is_cached_and_honours_env(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HWKV_DEVICE", "cpu")
    assert devices.current_device() is devices.current_device()
    assert devices.current_device().name == devices.resolve_current_device().name == "cpu"
    monkeypatch.setenv("HWKV_DEVICE", "nonexistent")
    with pytest.raises(DeviceError, match="nonexistent"):
        devices.resolve_current_device()
    assert devices.current_device().name == "cpu"  # still the cached answer


# -------------------------------------------------------------------- DeviceSpec

def test_loading_by_import_string():
    spec = _spec("x", 1)
    assert dataclasses.replace(spec, backend="hwkv.devices:DeviceSpec").load_backend_class() is DeviceSpec
    assert spec.load_graph_adapter() is None
    with pytest.raises(DeviceError, match="'hwkv_nope.backend:Nope'") as e:
        dataclasses.replace(spec, backend="hwkv_nope.backend:Nope").load_backend_class()
    assert isinstance(e.value.__cause__, ImportError)
    with pytest.raises(DeviceError, match="'hwkv.devices:Nope'.*no attribute"):
        dataclasses.replace(spec, graph_adapter="hwkv.devices:Nope").load_graph_adapter()


@pytest.mark.parametrize("field, value", [
    ("name", ""), ("priority", "1"), ("backend", "no_colon"), ("graph_adapter", "a:b:c"), ("probe", None),
    ("attention_path", "no_colon")])
def test_spec_validation(field: str, value: object):
    with pytest.raises(ConfigError, match=field):
        dataclasses.replace(_spec("x", 1), **{field: value})


def test_attention_path_is_asked_of_the_plugin_only_when_needed(in_tree):
    """A spec without the hook (a third party's) answers with its backend and imports nothing; a hook is
    imported on the call, and a failing or malformed one is a DeviceError naming it."""
    assert _spec("x", 1).describe_attention_path() == (
        "x_pkg.backend:B", "the x plugin reports none (DeviceSpec.attention_path is empty)")
    unimportable = dataclasses.replace(_spec("x", 1), attention_path="hwkv_nope.amx:active_path")
    with pytest.raises(DeviceError, match="attention path of device 'x'.*'hwkv_nope.amx:active_path'"):
        unimportable.describe_attention_path()
    with pytest.raises(DeviceError, match=r"os:getcwd must return \(path, why\)"):
        dataclasses.replace(_spec("x", 1), attention_path="os:getcwd").describe_attention_path()
    from hwkv_cpu.amx import active_path

    assert in_tree["cpu"].attention_path == "hwkv_cpu.amx:active_path"
    assert in_tree["cpu"].describe_attention_path() == active_path()
    assert all(not s.attention_path for n, s in in_tree.items() if n != "cpu")


# -------------------------------------------------------------------- probes

def test_rocm_build_is_rocm_not_cuda(in_tree, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.version, "hip", "6.2.0")
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "ROCm build" in in_tree["cuda"].unavailable_reason() and "use rocm" in in_tree["cuda"].unavailable_reason()
    assert in_tree["rocm"].unavailable_reason() is None
    assert select(in_tree).name == "rocm"


def test_cuda_probe(in_tree, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "is_available() is False" in in_tree["cuda"].unavailable_reason()
    assert "not a ROCm build" in in_tree["rocm"].unavailable_reason()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert in_tree["cuda"].is_available() and select(in_tree).name == "cuda"


def test_xpu_probe(in_tree, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch, "xpu", SimpleNamespace(is_available=lambda: True))
    assert in_tree["xpu"].is_available()
    monkeypatch.delattr(torch, "xpu")
    assert "no torch.xpu" in in_tree["xpu"].unavailable_reason()


def test_torch_extension_probe(site: Path, monkeypatch: pytest.MonkeyPatch):
    probe = devices.probe_torch_extension
    assert probe("fake_ext_absent", "fakedev") == "fake_ext_absent is not installed"
    (site / "fake_ext_broken.py").write_text("raise ImportError('libfake.so: cannot open')\n")
    assert "libfake.so: cannot open" in probe("fake_ext_broken", "fakedev")
    (site / "fake_ext_ok.py").write_text("")
    assert "did not register torch.fakedev" in probe("fake_ext_ok", "fakedev")
    monkeypatch.setattr(torch, "fakedev", SimpleNamespace(is_available=lambda: False), raising=False)
    assert "torch.fakedev.is_available() is False" in probe("fake_ext_ok", "fakedev")
    monkeypatch.setattr(torch, "fakedev", SimpleNamespace(is_available=lambda: True))
    assert probe("fake_ext_ok", "fakedev") is None
    (site / "fake_ext_crash.py").write_text("raise OSError('driver crashed')\n")
    with pytest.raises(OSError, match="driver crashed"):  # only ImportError is a reason
        probe("fake_ext_crash", "fakedev")
    crashing = dataclasses.replace(_spec("crashdev", 1), probe=lambda: probe("fake_ext_crash", "fakedev"))
    with pytest.raises(DeviceError, match="device 'crashdev': its probe raised OSError: driver crashed"):
        crashing.is_available()  # typed where a spec probes it (HWKV_DEVICE forced, or auto-detection)


def test_musa_and_npu_blocked_modules_are_not_installed(in_tree, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "torch_musa", None)
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    assert in_tree["musa"].unavailable_reason() == "torch_musa is not installed"
    assert in_tree["npu"].unavailable_reason() == "torch_npu is not installed"


# -------------------------------------------------------------------- third-party plugins

def test_dummy_plugin_discovered_through_entry_point(site: Path, monkeypatch: pytest.MonkeyPatch):
    install_dist(site, "hwkv_dummy_plugin", {"dummy": "hwkv_dummy:DEVICE"}, {"hwkv_dummy": DUMMY_SRC.read_text()})
    eps = importlib.metadata.entry_points(group="hwkv.devices")
    assert any(ep.name == "dummy" and ep.dist.name == "hwkv_dummy_plugin" for ep in eps)
    specs = discover()
    dummy = specs["dummy"]
    assert dummy.description == "dummy third-party plugin (tests)"
    assert dummy.load_backend_class().__name__ == "DummyBackend"
    assert dummy.load_graph_adapter().__name__ == "DummyGraphAdapter"
    without = {name: spec for name, spec in specs.items() if name != "dummy"}
    assert select(specs).name == select(without).name  # priority -10: installing it changes nothing (cpu here, a GPU's
    # plugin on a GPU machine)
    assert select(specs, "dummy") is dummy
    assert select(dict(specs, dummy=dataclasses.replace(dummy, priority=100))).name == "dummy"
    monkeypatch.setenv("HWKV_DUMMY_REASON", "dummy switched off")
    with pytest.raises(DeviceError, match="dummy switched off"):
        select(specs, "dummy")


def test_plugin_that_raises_is_an_error_naming_the_entry_point(site: Path):
    install_dist(site, "hwkv_broken_plugin", {"broken": "hwkv_broken:DEVICE"},
                 {"hwkv_broken": "raise RuntimeError('vendor SDK missing')\n"})
    with pytest.raises(DeviceError, match=r"entry point 'broken' = 'hwkv_broken:DEVICE'.*vendor SDK missing") as e:
        discover()
    assert isinstance(e.value.__cause__, RuntimeError)


def test_plugin_must_export_a_matching_devicespec(site: Path):
    install_dist(site, "hwkv_misnamed_plugin", {"misnamed": "hwkv_misnamed:DEVICE"},
                 {"hwkv_misnamed": textwrap.dedent("""\
                     from hwkv.devices import DeviceSpec
                     DEVICE = DeviceSpec("other", 1, lambda: None, "m:B", "", "cpu", "misnamed")
                     NOT_A_SPEC = object()
                 """)})
    with pytest.raises(DeviceError, match="'misnamed'.*names itself 'other'"):
        discover()
    (site / "hwkv_misnamed_plugin-0.0.dist-info" / "entry_points.txt").write_text(
        "[hwkv.devices]\nmisnamed = hwkv_misnamed:NOT_A_SPEC\n")
    with pytest.raises(DeviceError, match="not a DeviceSpec"):
        discover()


# -------------------------------------------------------------------- the core is device-free

DEVICE_FREE_SCRIPT = """
import importlib, pkgutil, sys
BLOCKED = {blocked!r}
for name in BLOCKED:
    sys.modules[name] = None  # any import of a vendor module now raises ImportError

def walk(path, prefix):
    for info in pkgutil.iter_modules(path, prefix):
        if info.name == "hwkv.testing":
            continue
        module = importlib.import_module(info.name)
        imported.append(info.name)
        if info.ispkg:
            walk(module.__path__, info.name + ".")

import hwkv, hwkv.devices
imported = []
walk(hwkv.__path__, "hwkv.")
spec = hwkv.devices.resolve_current_device()
assert all(sys.modules[name] is None for name in BLOCKED)
print(spec.name, len(imported))
"""


def cpu_only_env(**extra: str) -> dict[str, str]:
    """The environment with HWKV_DEVICE unset and accelerators hidden, so detection must pick cpu."""
    env = {k: v for k, v in os.environ.items() if k not in ("HWKV_DEVICE", "HWKV_DUMMY_REASON")}
    env.update(CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="", ASCEND_RT_VISIBLE_DEVICES="",
               MUSA_VISIBLE_DEVICES="", ZE_AFFINITY_MASK="", **extra)
    return env


# Started at collection time: the subprocess imports torch (seconds) while the other tests run.
_DEVICE_FREE = subprocess.Popen([sys.executable, "-c", DEVICE_FREE_SCRIPT.format(blocked=VENDOR_MODULES)],
                                cwd=REPO, env=cpu_only_env(), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_core_is_device_free():
    try:
        out, err = _DEVICE_FREE.communicate(timeout=120)
    finally:
        if _DEVICE_FREE.poll() is None:
            _DEVICE_FREE.kill()
    assert _DEVICE_FREE.returncode == 0, err
    name, count = out.split()
    assert name == "cpu" and int(count) >= 1
