"""`hwkv info`: exit codes through `python -m hwkv.cli`, the JSON object, plain text, the CPU probe."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from hwkv import _amx, cli, devices

REPO = Path(__file__).resolve().parents[1]
DUMMY_SRC = Path(__file__).parent / "plugins" / "hwkv_dummy.py"
IN_TREE = {"musa", "npu", "rocm", "cuda", "xpu", "cpu"}


def cpu_only_env(**extra: str) -> dict[str, str]:
    """The environment with HWKV_DEVICE unset and accelerators hidden, so detection must pick cpu."""
    env = {k: v for k, v in os.environ.items() if k not in ("HWKV_DEVICE", "HWKV_DUMMY_REASON")}
    env.update(CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="", ASCEND_RT_VISIBLE_DEVICES="",
               MUSA_VISIBLE_DEVICES="", ZE_AFFINITY_MASK="", **extra)
    return env


def write_dummy_dist(root: Path) -> Path:
    """The dummy third-party plugin as a real installed distribution under `root`."""
    info = root / "hwkv_dummy_plugin-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hwkv_dummy_plugin\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[hwkv.devices]\ndummy = hwkv_dummy:DEVICE\n")
    (root / "hwkv_dummy.py").write_text(DUMMY_SRC.read_text())
    return root


def _start_runs() -> tuple[dict[str, subprocess.Popen], Path]:
    """Start `python -m hwkv.cli info` in three environments at collection time: each imports torch
    (seconds), so they run concurrently with each other and with the in-process tests."""
    site = write_dummy_dist(Path(tempfile.mkdtemp(prefix="hwkv_site_")))
    pythonpath = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    jobs = {
        "info": (["info"], cpu_only_env()),
        "json_dummy": (["info", "--json"], cpu_only_env(HWKV_DEVICE="dummy", PYTHONPATH=pythonpath)),
        "nonexistent": (["info"], cpu_only_env(HWKV_DEVICE="nonexistent")),
    }
    procs = {k: subprocess.Popen([sys.executable, "-m", "hwkv.cli", *argv], cwd=REPO, env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for k, (argv, env) in jobs.items()}
    return procs, site


_PROCS, _SITE = _start_runs()


@pytest.fixture(scope="module")
def runs() -> dict[str, subprocess.CompletedProcess]:
    """The finished runs of `_start_runs`."""
    done = {}
    try:
        for k, p in _PROCS.items():
            out, err = p.communicate(timeout=120)
            done[k] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    finally:
        for p in _PROCS.values():
            if p.poll() is None:
                p.kill()
        shutil.rmtree(_SITE, ignore_errors=True)
    return done


# ------------------------------------------------------------------ subprocess: exit codes

def test_info_exit_code_and_device(runs):
    r = runs["info"]
    assert r.returncode == 0, r.stderr
    assert "device: cpu" in r.stdout and "HWKV_DEVICE unset" in r.stdout
    for name in IN_TREE:
        assert name in r.stdout
    assert "attention path" in r.stdout and "torch" in r.stdout


def test_info_json_finds_a_third_party_plugin_and_honours_forcing(runs):
    r = runs["json_dummy"]
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["device"] == "dummy" and data["forced"] and data["error"] is None
    by_name = {d["name"]: d for d in data["devices"]}
    assert set(by_name) == IN_TREE | {"dummy"}
    assert by_name["cpu"]["available"] and by_name["cpu"]["reason"] is None
    assert by_name["dummy"]["backend"] == "hwkv_dummy:DummyBackend"
    assert [d["priority"] for d in data["devices"]] == sorted((d["priority"] for d in data["devices"]), reverse=True)
    assert set(data["cpu"]) >= {"amx", "amx_reason", "capability", "sgl_kernel", "attention_path"}
    assert data["torch"]


def test_info_forced_nonexistent_device_exits_2(runs):
    r = runs["nonexistent"]
    assert r.returncode == 2
    assert "HWKV_DEVICE='nonexistent'" in r.stderr and "available: cpu" in r.stderr


# ------------------------------------------------------------------ in process

def test_info_json_in_process(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("HWKV_DEVICE", raising=False)
    monkeypatch.setattr(cli.devices, "select", lambda specs, forced: specs["cpu"])
    assert cli.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["device"] == "cpu" and not data["forced"]


def test_info_plain_text_without_rich(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HWKV_DEVICE", "cpu")
    monkeypatch.setattr(cli, "_use_rich", lambda: False)
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "device: cpu (forced by HWKV_DEVICE=cpu)" in out
    assert "available / why not" in out and "hwkv_cpu.backend:TorchCPUBackend" in out
    assert "AMX" in out and "attention path" in out


def test_info_forced_unavailable_in_process(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HWKV_DEVICE", "npu")
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    assert cli.main(["info", "--json"]) == 2
    captured = capsys.readouterr()
    assert "torch_npu is not installed" in captured.err
    assert json.loads(captured.out)["device"] is None


@pytest.mark.parametrize("forced", ["", "cpu"])
def test_info_lists_a_device_whose_probe_raises(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                                 forced: str):
    """An installed vendor extension that crashes on import: `hwkv info` still lists every device, the broken one
    with its error; detection fails with it (exit 2) unless another device is forced."""
    real = devices.discover

    def crash() -> None:
        raise RuntimeError("ACL init failed")

    monkeypatch.setattr(cli.devices, "discover",
                        lambda: {**real(), "npu": dataclasses.replace(real()["npu"], probe=crash)})
    monkeypatch.setenv("HWKV_DEVICE", forced)
    assert cli.main(["info", "--json"]) == (0 if forced else 2)
    data = json.loads(capsys.readouterr().out)
    rows = {d["name"]: d for d in data["devices"]}
    assert set(rows) >= IN_TREE and not rows["npu"]["available"]
    assert "its probe raised RuntimeError: ACL init failed" in rows["npu"]["reason"]
    assert data["device"] == (forced or None)


def test_broken_plugin_exits_2(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    def broken() -> dict:
        raise cli.DeviceError("device plugin entry point 'broken' failed to load")
    monkeypatch.setattr(cli.devices, "discover", broken)
    assert cli.main(["info"]) == 2
    assert "'broken'" in capsys.readouterr().err


def test_commands_registry_is_open(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    def add(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--n", type=int, default=1)
    monkeypatch.setitem(cli.COMMANDS, "echo", cli.Command("test command", add, lambda a: a.n))
    assert cli.main(["echo", "--n", "7"]) == 7
    with pytest.raises(SystemExit) as e:
        cli.main([])
    assert e.value.code == 2


# ------------------------------------------------------------------ CPU probe

@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/cpuinfo is Linux-only")
@pytest.mark.parametrize("flags, amx, present", [
    ("fpu sse avx2 amx_bf16 amx_tile amx_int8", True, ("amx_tile", "amx_bf16", "amx_int8")),
    ("fpu avx2 amx_tile", False, ("amx_tile",)),
    ("fpu avx2", False, ()),
])
def test_amx_from_cpuinfo(tmp_path: Path, flags: str, amx: bool, present: tuple[str, ...]):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    features = _amx.cpu_features(str(cpuinfo))
    assert (features.amx, features.amx_flags) == (amx, present)
    assert features.reason and features.capability


def test_amx_unreadable_or_no_flags(tmp_path: Path):
    missing = _amx.cpu_features(str(tmp_path / "absent"))
    assert not missing.amx and ("cannot read" in missing.reason or "Linux-only" in missing.reason)
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd\n")
    if sys.platform.startswith("linux"):
        assert "no 'flags' line" in _amx.cpu_features(str(arm)).reason


def test_sgl_kernel_is_found_not_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "sgl_kernel.py").write_text("raise RuntimeError('sgl_kernel must not be imported by the probe')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    features = _amx.cpu_features()
    assert features.sgl_kernel and "sgl_kernel" not in sys.modules


def test_info_asks_the_cpu_spec_for_the_attention_path(monkeypatch: pytest.MonkeyPatch):
    """The CLI imports no device package: the cpu DeviceSpec names the path, and a replacement spec without the
    hook (a third party's) still gives `hwkv info` an answer."""
    tree = ast.parse((REPO / "hwkv" / "cli.py").read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not any(m.startswith("hwkv_") for m in imported), imported
    cpu = devices.discover()["cpu"]
    assert cli.info_data()["cpu"]["attention_path"] == cpu.describe_attention_path()[0]
    devices.register(dataclasses.replace(cpu, attention_path=""), replace=True)
    try:
        data = cli.info_data()["cpu"]
    finally:
        devices.unregister("cpu")
    assert data["attention_path"] == cpu.backend and "attention_path is empty" in data["attention_path_reason"]


# ------------------------------------------------------------------ layer paths

def test_info_layer_paths_for_a_named_device(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    """`hwkv info --device rocm|npu` answers, for every layer kind, the path the backend would take there
    (from the plugin's own decision function), with what the answer assumes off that hardware."""
    monkeypatch.setenv("HWKV_DEVICE", "cpu")
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # not installed: the NPU answer states its assumption
    assert cli.main(["info", "--json", "--device", "rocm"]) == 0
    rocm = json.loads(capsys.readouterr().out)["layer_paths"]
    by_kind = {(r["layer"], r["mode"], r["feature"]): r for r in rocm["rows"]}
    assert len(by_kind) == 16
    assert by_kind[("SWA", "decode", "soft-cap")]["op"] == "aiter.paged_attention_ragged"
    assert by_kind[("SWA", "extend", "plain")]["op"] == "aiter.mha_batch_prefill_func"
    assert by_kind[("full", "decode", "fp8")]["path"] == "fused vendor op"  # gfx942 with an fnuz pool
    assert by_kind[("full", "decode", "sinks")]["path"] == "Triton" and "sink" in by_kind[("full", "decode", "sinks")]["why"]
    assert by_kind[("full", "extend", "fp8")]["path"] == "Triton"
    assert any("gfx942" in a for a in rocm["assumptions"])

    monkeypatch.setattr(cli, "_use_rich", lambda: False)
    assert cli.main(["info", "--device", "npu"]) == 0
    out = capsys.readouterr().out
    assert "layer paths on npu" in out and "assumes: torch_npu is not installed" in out
    rows = [line for line in out.splitlines() if line.startswith(("full ", "SWA "))]
    assert len(rows) == 16
    sink_rows = [r for r in rows if " sinks " in r]
    assert all("npu_fused_infer_attention_score_v2" in r for r in sink_rows)
    assert all("plain torch" in r for r in rows if " soft-cap " in r or " fp8 " in r)
    assert any("band sparse_mode 4" in r for r in rows if r.startswith("SWA") and " extend " in r)


def test_info_layer_paths_of_the_detected_device_and_bad_names(capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HWKV_DEVICE", "cpu")
    assert cli.main(["info", "--json"]) == 0
    paths = json.loads(capsys.readouterr().out)["layer_paths"]
    assert paths["device"] == "cpu"  # the CPU plugin reports no table: said, not hidden
    assert paths["rows"] or "reports no per-kind table" in paths["assumptions"][0]
    assert cli.main(["info", "--json", "--device", "cuda"]) == 0
    cuda = json.loads(capsys.readouterr().out)["layer_paths"]
    assert {r["path"] for r in cuda["rows"]} == {"Triton"}
    assert cli.main(["info", "--device", "bogus"]) == 2
    assert "names no known device" in capsys.readouterr().err
