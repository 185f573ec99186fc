"""`hwkv bench`: its JSON schema, the step's phases, measured translation counts, the loud reference failure,
the plot, exit codes; the graph runner's prepare/replay halves; the sampled reference check."""
from __future__ import annotations

import json
import sys
import types

import pytest

from hwkv import devices
from hwkv.bench.baseline import per_layer_backend
from hwkv.bench.run import CONFIGS, PHASES, Target, Workload, run_benchmark
from hwkv.cli import main
from hwkv.devices import DeviceSpec
from hwkv.engine.presets import custom_shape
from hwkv.errors import ReferenceMismatchError
from hwkv.graph import EagerAdapter
from hwkv.testing.harness import Harness, ModelGeometry, run_scenario
from hwkv_cpu.backend import TorchCPUBackend

# 5 layers, 4 of them SWA (pattern ssssf), tiny heads: a whole bench run takes about a second
TINY = ["--layers", "5", "--pattern", "ssssf", "--window", "4", "--heads", "4", "--kv-heads", "2",
        "--head-dim", "8", "--batch-sizes", "1,3", "--prompt-len", "12", "--chunk", "8", "--steps", "3",
        "--warmup", "1", "--check-every", "2", "--page-size", "2", "--device", "cpu"]
SHAPE = custom_shape(layers=5, pattern="ssssf", window=4, heads=4, kv_heads=2, head_dim=8)
WORKLOAD = Workload(batch_sizes=(1, 3), prompt_len=12, chunk=8, steps=3, warmup=1, check_every=2, page_size=2)


def bench_json(capsys, *extra: str) -> dict:
    code = main(["bench", *TINY, "--json", *extra])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def test_json_schema(capsys):
    data = bench_json(capsys, "--no-graph")
    assert data["schema"] == "hwkv-bench/2"
    assert set(data) >= {"schema", "device", "model", "workload", "configs", "timing", "rows", "memory", "notes",
                         "wall_s"}
    assert list(data["timing"]["phases"]) == ["alloc_release", "metadata", "forward"] and data["timing"]["step"]
    assert data["device"]["name"] == "cpu" and data["device"]["torch_device"] == "cpu"
    assert data["model"]["num_layers"] == 5 and data["model"]["run_layers"] == 5
    assert data["configs"] == ["per-layer/eager", "once/eager"]
    assert data["workload"]["batch_sizes"] == [1, 3] and data["workload"]["dtype"] == "fp32"
    assert [(r["config"], r["batch_size"]) for r in data["rows"]] == [
        ("per-layer/eager", 1), ("per-layer/eager", 3), ("once/eager", 1), ("once/eager", 3)]
    for r in data["rows"]:
        assert r["forwards"] == 3 and r["checked_forwards"] >= 2
        assert 0 < r["p10_ms"] <= r["median_ms"] <= r["p90_ms"]
        assert r["tokens_per_s"] == pytest.approx(r["batch_size"] / (r["median_ms"] / 1e3))
        assert_phases(r)
        assert isinstance(r["max_abs_err"], float) and r["max_abs_err"] < 1e-4
    for m in data["memory"]:
        assert {"batch_size", "live_tokens", "full_slots", "swa_slots", "hybrid_bytes", "all_full_bytes",
                "saving"} <= set(m)
        assert m["full_slots"] >= m["live_tokens"] > 0 and m["swa_slots"] < m["full_slots"]
        assert m["all_full_bytes"] == m["full_slots"] * SHAPE.bytes_per_token_all_full * 2  # fp32: 2x bf16
        assert m["saving"] == pytest.approx(m["all_full_bytes"] / m["hybrid_bytes"]) and m["saving"] > 1


def assert_phases(r: dict) -> None:
    """Every phase is timed, non-negative, and the step is their sum (means add up exactly)."""
    assert list(r["phases"]) == list(PHASES)
    for p in r["phases"].values():
        assert set(p) == {"median_ms", "p10_ms", "p90_ms", "mean_ms"}
        assert 0 <= p["p10_ms"] <= p["median_ms"] <= p["p90_ms"] and p["mean_ms"] >= 0
    assert r["phases"]["alloc_release"]["median_ms"] > 0 and r["phases"]["forward"]["median_ms"] > 0
    assert sum(p["mean_ms"] for p in r["phases"].values()) == pytest.approx(r["mean_ms"])
    for p in r["phases"].values():  # each step's total bounds each of its phases, so every quantile does
        assert p["p10_ms"] <= r["p10_ms"] and p["median_ms"] <= r["median_ms"] and p["p90_ms"] <= r["p90_ms"]


def test_graph_phases_time_prepare_and_replay(capsys):
    data = bench_json(capsys, "--configs", "once/graph,once/eager", "--batch-sizes", "2")
    for r in data["rows"]:
        assert_phases(r)
        assert r["phases"]["metadata"]["median_ms"] > 0


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_translations_are_measured_once_vs_per_layer(graph):
    target = Target("cpu", TorchCPUBackend, "cpu", EagerAdapter)
    names = ["per-layer/graph", "once/graph"] if graph else ["per-layer/eager", "once/eager"]
    res = run_benchmark(target, SHAPE, names, WORKLOAD)
    per = {(r.config, r.batch_size): r.translations_per_forward for r in res.rows}
    for bs in WORKLOAD.batch_sizes:
        assert per[(names[1], bs)] == 2                      # the write locs + the one window list
        assert per[(names[0], bs)] == 2 * len(SHAPE.swa_layer_ids) == 8   # both, in each of 4 SWA layers


def test_the_whole_step_graph_config_is_checked_against_the_reference_beside_the_others():
    """once/step-graph decodes through hwkv.step_graph.DecodeStepGraph (the host's run of the same body under
    EagerAdapter, the torch page ops): its outputs are checked against the reference every other step, taking
    turns with once/graph on the same requests; its phases put the whole step in forward."""
    target = Target("cpu", TorchCPUBackend, "cpu", EagerAdapter)
    res = run_benchmark(target, SHAPE, ["once/graph", "once/step-graph"], WORKLOAD)
    rows = {(r.config, r.batch_size): r for r in res.rows}
    for bs in WORKLOAD.batch_sizes:
        r = rows[("once/step-graph", bs)]
        assert r.checked_forwards > 0 and r.max_abs_err is not None and r.translations_per_forward == 2
        assert r.phases["alloc_release"].median_ms == r.phases["metadata"].median_ms == 0
        assert r.phases["forward"].median_ms > 0 and rows[("once/graph", bs)].checked_forwards > 0


def test_the_step_graph_config_needs_device_page_ops(capsys):
    """The CPU registers no page-op kernels: once/step-graph is left out by default and refused when asked."""
    data = bench_json(capsys, "--batch-sizes", "2")
    assert "once/step-graph" not in {r["config"] for r in data["rows"]}
    assert main(["bench", *TINY, "--configs", "once/step-graph"]) == 2
    assert "page-op kernels" in capsys.readouterr().err


def test_graph_configs_through_the_cpu_graph_adapter(capsys):
    data = bench_json(capsys, "--configs", "once/graph,per-layer/graph", "--batch-sizes", "2")
    assert {r["config"]: r["translations_per_forward"] for r in data["rows"]} == {
        "once/graph": 2, "per-layer/graph": 8}


def test_run_layers_keeps_memory_for_the_whole_model(capsys):
    data = bench_json(capsys, "--no-graph", "--run-layers", "2", "--batch-sizes", "2")
    assert data["model"]["run_layers"] == 2 and data["model"]["run_swa_layers"] == 2
    assert {r["translations_per_forward"] for r in data["rows"]} == {2, 4}
    m = data["memory"][0]
    assert m["all_full_bytes"] == m["full_slots"] * SHAPE.bytes_per_token_all_full * 2


def test_per_layer_baseline_is_correct_in_a_churning_scenario():
    g = ModelGeometry(num_layers=4, swa_every=2, window=6, num_heads=4, num_kv_heads=2, head_dim=16, sinks=True)
    for graph in (False, True):
        h = Harness(per_layer_backend(TorchCPUBackend), "cpu", g, size=512, size_swa=96, page_size=2)
        if graph:
            h.enable_graphs([1, 2, 4], EagerAdapter())
        assert run_scenario(h, steps=14, prompt_lens=(5, 13, 9), chunk=4) < 1e-4


class BrokenBackend(TorchCPUBackend):
    """Right everywhere except decode, whose output it scales by 1.01."""

    def forward_decode(self, q, layer, kv, md, out):
        super().forward_decode(q, layer, kv, md, out)
        out.mul_(1.01)


@pytest.fixture
def broken_device(monkeypatch):
    module = types.ModuleType("hwkv_broken_plugin")
    module.BrokenBackend = BrokenBackend
    monkeypatch.setitem(sys.modules, "hwkv_broken_plugin", module)
    spec = DeviceSpec(name="broken", priority=-20, probe=lambda: None, backend="hwkv_broken_plugin:BrokenBackend",
                      graph_adapter="", torch_device="cpu", description="a wrong backend (tests)")
    devices.register(spec)
    yield spec
    devices.unregister("broken")


def test_wrong_backend_fails_loudly(capsys, broken_device):
    code = main(["bench", *TINY, "--device", "broken"])
    out = capsys.readouterr()
    assert code == 1
    assert "FAILED" in out.err and "hwkv.reference" in out.err
    assert "layer 0 (SWA W=4)" in out.err and "max |out - reference|" in out.err and "decode step" in out.err
    assert out.out == ""  # no table: the run is invalid, nothing is averaged away


def test_plot_writes_a_png_with_the_phases_stacked(tmp_path, capsys, monkeypatch):
    from hwkv.bench import report

    original, bars = report._plot_phases, []

    def counting(fig, res):
        original(fig, res)
        bars.append(sum(len(ax.patches) for ax in fig.axes))

    monkeypatch.setattr(report, "_plot_phases", counting)
    path = tmp_path / "bench.png"
    data = bench_json(capsys, "--no-graph", "--plot", str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert bars == [len(data["rows"]) * len(PHASES)]  # one stacked bar per configuration and batch size


def test_table_output(capsys):
    assert main(["bench", *TINY, "--no-graph", "--batch-sizes", "2"]) == 0
    out = capsys.readouterr().out
    assert "hwkv bench on cpu" in out and "all 5 layers" in out
    assert "per-layer/eager" in out and "once/eager" in out and "saving" in out
    assert "ms/step" in out and "alloc+release ms" in out and "metadata ms" in out and "forward/replay ms" in out


@pytest.mark.parametrize("extra, message", [
    (["--batch-sizes", "1,x"], "--batch-sizes"),
    (["--batch-sizes", "0"], "--batch-sizes must be integers >= 1, got '0'"),
    (["--configs", "twice/eager"], "twice/eager"),
    (["--configs", "once/graph", "--no-graph"], "no configuration"),
    (["--device", "nosuchdevice"], "nosuchdevice"),
    (["--dtype", "fp16", "--kv-dtype", "bf16"], "disagree"),
    (["--run-layers", "9"], "run_layers"),
    (["--steps", "0"], "steps"),
])
def test_bad_values_exit_2_naming_them(capsys, extra, message):
    assert main(["bench", *TINY, *extra]) == 2
    assert message in capsys.readouterr().err


def test_default_model_is_a_preset_prefix_on_cpu():
    from hwkv.engine.presets import PRESETS
    from hwkv.bench.run import default_run_layers

    assert default_run_layers(PRESETS["gpt-oss-20b"], "cpu") == 4
    assert default_run_layers(PRESETS["gemma-3-27b"], "cpu") == 6    # its first full layer is layer 5
    assert default_run_layers(PRESETS["gpt-oss-120b"], "cuda") == 36
    assert set(CONFIGS) == {"per-layer/eager", "once/eager", "per-layer/graph", "once/graph", "once/step-graph"}


def test_harness_releases_a_batch_in_one_call(monkeypatch):
    """The harness releases through the engine's step primitives: one call per batch, only in the steps where
    some request's frontier moves."""
    import hwkv.engine.forward as forward

    calls = []
    real = forward.release_out_of_window_batch
    monkeypatch.setattr(forward, "release_out_of_window_batch",
                        lambda *a, **k: calls.append(a[2].numel()) or real(*a, **k))
    g = ModelGeometry(num_layers=2, swa_every=2, window=4, num_heads=2, num_kv_heads=1, head_dim=8)
    h = Harness(TorchCPUBackend, "cpu", g, size=256, size_swa=64, page_size=2)
    rids = [h.add_request() for _ in range(3)]
    h.forward(rids, [9, 5, 7])
    for _ in range(4):
        batch, inputs = h.prepare(rids, [1, 1, 1])
        h.complete(rids, [1, 1, 1], inputs, h.step(batch, inputs))
        h.release(batch)
        h.check_integrity()
    assert calls == [3] * 3  # seq 12, 8, 10 (the third step) moves no frontier: no call
    assert h.frontiers[rids].tolist() == [8, 4, 6]  # seq 13, 9, 11: a page behind the first live token, aligned


def test_sampled_reference_check_shadows_few_requests_and_still_catches_a_wrong_kernel():
    g = ModelGeometry(num_layers=2, swa_every=2, window=4, num_heads=2, num_kv_heads=1, head_dim=8)
    for backend, ok in ((TorchCPUBackend, True), (BrokenBackend, False)):
        h = Harness(backend, "cpu", g, size=256, size_swa=64, page_size=2, shadow_requests=1, check_queries=2)
        rids = [h.add_request() for _ in range(3)]
        assert [h.requests[r].shadowed for r in rids] == [True, False, False]
        h.forward(rids, [9, 5, 7])  # extend: the last 2 queries of request 0 are checked
        assert len(h.requests[rids[0]].k[0]) == 1 and not h.requests[rids[1]].k[0]
        if ok:
            h.forward(rids, [1, 1, 1])
        else:
            with pytest.raises(ReferenceMismatchError):
                h.forward(rids, [1, 1, 1])


def test_accelerators_default_to_long_prompts_and_a_sampled_check():
    import argparse

    from hwkv.bench.bench_cli import _workload, add_bench_arguments

    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    cpu, gpu = (_workload(p.parse_args([]), "bf16", d) for d in ("cpu", "cuda"))
    assert cpu.prompt_len == 256 and cpu.check_requests == 0 and cpu.batch_sizes == (1, 4, 16)
    assert gpu.prompt_len >= 4096 and gpu.chunk >= 4096 and gpu.check_requests == 2 and gpu.check_queries == 16
    assert _workload(p.parse_args(["--prompt-len", "512"]), "bf16", "cuda").prompt_len == 512
    assert "8192" in p.format_help()
