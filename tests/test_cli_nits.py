"""CLI edges: `--version`, `verify` with a bad device or a -k matching nothing, `bench` flags checked before
the run; the MUSA probe and SM count with faked vendor modules (CPU only)."""
from __future__ import annotations

import importlib.machinery
import sys
import types
from types import SimpleNamespace

import pytest
import torch

import hwkv
from hwkv.bench import bench_cli
from hwkv.cli import main
from hwkv.errors import ConfigError, DeviceError


@pytest.fixture
def no_bench_run(monkeypatch: pytest.MonkeyPatch):
    """A bench that gets as far as running the workload fails the test: the checks must come first."""
    import hwkv.bench.run as run

    def refuse(*a, **k):
        raise AssertionError("the benchmark ran before its arguments were checked")

    monkeypatch.setattr(run, "run_benchmark", refuse)


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"hwkv {hwkv.__version__}"


def test_verify_unknown_device_says_why_and_lists_the_known_ones(capsys):
    assert main(["verify", "--device", "bogus"]) == 2
    err = capsys.readouterr().err
    assert "unknown device 'bogus'" in err and "known devices:" in err
    assert "cpu" in err.split("known devices:")[1] and "cuda" in err.split("known devices:")[1]


def test_verify_unavailable_device_gives_the_probe_reason(capsys, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "torch_musa", None)
    assert main(["verify", "--device", "musa"]) == 2
    assert "device 'musa' is unavailable: torch_musa is not installed" in capsys.readouterr().err


def test_verify_k_matching_nothing_is_an_error_not_an_empty_table(capsys):
    assert main(["verify", "-k", "no_check_is_called_this"]) == 2
    out, err = capsys.readouterr()
    assert "no contract check matched -k 'no_check_is_called_this'" in err
    assert "contract checks passed" not in out and "hwkv contract suite" not in out


def test_verify_prints_no_pytest_progress_line_above_the_table(capsys):
    # --device cpu: a GPU machine detects its GPU
    assert main(["verify", "--device", "cpu", "-k", "writes_exactly_the_swa_loc"]) == 0
    out = capsys.readouterr().out
    first = next(line for line in out.splitlines() if line.strip())
    assert "[100%]" not in out and not first.strip().startswith(".")
    assert "contract checks passed on cpu" in out


@pytest.mark.parametrize("where", ["missing_dir/out.png", "a_directory"])
def test_bench_plot_to_an_unwritable_path_fails_before_the_run(tmp_path, where, capsys, no_bench_run):
    (tmp_path / "a_directory").mkdir()
    path = str(tmp_path / where)
    assert main(["bench", "--quick", "--no-graph", "--plot", path]) == 2
    err = capsys.readouterr().err
    assert "--plot" in err and repr(path) in err
    assert not (tmp_path / "missing_dir").exists()


def test_bench_plot_check_leaves_paths_as_they_were(tmp_path):
    new, old = tmp_path / "new.png", tmp_path / "old.png"
    old.write_bytes(b"keep")
    bench_cli._check_plot_path(str(new))
    bench_cli._check_plot_path(str(old))
    assert not new.exists() and old.read_bytes() == b"keep"


@pytest.mark.parametrize("text", ["1,,4", "1,4,", ",1"])
def test_batch_sizes_with_an_empty_item_are_refused(text, capsys, no_bench_run):
    with pytest.raises(ConfigError, match="empty item"):
        bench_cli._ints("--batch-sizes", text)
    assert main(["bench", "--quick", "--no-graph", "--batch-sizes", text]) == 2
    assert "--batch-sizes" in capsys.readouterr().err


def test_batch_sizes_still_parse():
    assert bench_cli._ints("--batch-sizes", " 1, 4,4 ,16") == (1, 4, 16)
    with pytest.raises(ConfigError, match="is empty"):
        bench_cli._ints("--batch-sizes", " , ")


# --------------------------------------------------------------------------------- MUSA


@pytest.fixture
def fake_musa(monkeypatch: pytest.MonkeyPatch):
    """torch_musa importable and torch.musa registered with one visible device (132 SMs)."""
    mod = types.ModuleType("torch_musa")
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_musa", None)
    monkeypatch.setitem(sys.modules, "torch_musa", mod)
    props = SimpleNamespace(multi_processor_count=132)
    monkeypatch.setattr(torch, "musa", SimpleNamespace(is_available=lambda: True,
                                                       get_device_properties=lambda device: props), raising=False)


def test_musa_probe_reports_a_missing_triton(fake_musa, monkeypatch: pytest.MonkeyPatch):
    from hwkv_cuda.musa import DEVICE

    pytest.importorskip("triton")
    assert DEVICE.unavailable_reason() is None
    monkeypatch.setitem(sys.modules, "triton", None)
    reason = DEVICE.unavailable_reason()
    assert reason is not None and reason.startswith("triton does not import") and "torch_musa" in reason


class FakeMusaDevice:
    """Stands in for torch.device("musa"), which a torch without torch_musa refuses to build."""

    type = "musa"


def test_num_sms_asks_torch_musa_at_call_time(fake_musa, monkeypatch: pytest.MonkeyPatch):
    common = pytest.importorskip("hwkv_cuda.kernels.common")
    monkeypatch.setattr(common, "interpreting", lambda: False)
    common.num_sms.cache_clear()
    assert common.num_sms(FakeMusaDevice()) == 132
    monkeypatch.delattr(torch, "musa")
    common.num_sms.cache_clear()
    with pytest.raises(DeviceError, match="torch_musa"):
        common.num_sms(FakeMusaDevice())
    common.num_sms.cache_clear()
