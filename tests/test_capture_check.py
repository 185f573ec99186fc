"""The capture-checking graph adapter: it fails a replay whose metadata moved (what a real device graph
would read stale), and every in-tree backend's graph path passes through it on CPU: the NPU fused path with the
torch_npu stand-ins, ROCm with the AITER stand-ins, and the Triton backends interpreted (a short scenario: the
interpreter is slow). The contract suite's graph tests replay through it whatever adapter a target names
(`hwkv.testing.capture_check.capture_checked`), so every contract run (tests/test_contract_*.py, the NPU torch path
in tests/test_vendor_backends.py) checks its backend's graph path; the last tests here show the suite failing a
backend whose graph metadata moves."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hwkv.batch import ForwardMode  # noqa: E402
from hwkv.testing import ContractTarget, contract  # noqa: E402
from hwkv.testing.capture_check import CaptureCheckingAdapter, StaleCaptureError  # noqa: E402
from hwkv.testing.harness import Harness, ModelGeometry, run_scenario  # noqa: E402
from hwkv.testing.reference_backend import ReferenceBackend  # noqa: E402

GEOM = ModelGeometry(num_layers=2, swa_every=2, window=6, num_heads=4, num_kv_heads=2, head_dim=16)


class MovingMetadata(ReferenceBackend):
    """A backend bug: a fresh tensor for the window list on every refill instead of the static buffer."""

    def init_forward_metadata_graph(self, batch, max_q_len=None):
        md = super().init_forward_metadata_graph(batch, max_q_len)
        for w, lst in md.windows.items():
            lst.indices = lst.indices.clone()
        return md


def _run(backend_cls, **kw):
    h = Harness(backend_cls, "cpu", GEOM, size=256, size_swa=64, page_size=2, **kw)
    h.enable_graphs([1, 2, 4], CaptureCheckingAdapter())
    run_scenario(h, steps=4, prompt_lens=(5, 9), chunk=8)
    return h


def test_a_replay_reading_moved_metadata_fails():
    with pytest.raises(StaleCaptureError, match="its capture did not"):
        _run(MovingMetadata)


class MovingDraftMetadata(ReferenceBackend):
    """The same bug in the draft path: each step's window list copied to fresh memory on every refill."""

    def init_draft_metadata_graph(self, batch):
        steps = super().init_draft_metadata_graph(batch)
        for md in steps.metadata:
            for lst in md.windows.values():
                lst.indices = lst.indices.clone()
        return steps


def test_a_draft_replay_reading_moved_metadata_fails():
    from hwkv.testing.spec_harness import draft_graphs, draft_steps

    h = Harness(MovingDraftMetadata, "cpu", GEOM, size=256, size_swa=64, page_size=2)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [5, 9], ForwardMode.EXTEND)
    runner = draft_graphs(h, [2], CaptureCheckingAdapter(), 2)
    with pytest.raises(StaleCaptureError, match="its capture did not"):
        draft_steps(h, rids, 2, runner=runner)


class OneTableSet(ReferenceBackend):
    """A backend whose graph kernel metadata is one static table (as IPEX's, AITER's and the NPU plans are)."""

    def init_graph_state(self, *args, **kwargs):
        super().init_graph_state(*args, **kwargs)
        self.table = torch.zeros(self.static.max_bs + 1, dtype=torch.int32)

    def init_kernel_metadata(self, md, batch, graph):
        if graph:
            md.extra["plan"] = {"indptr": self.table[:md.batch_size + 1].copy_(md.full.indptr)}


def test_draft_graphs_refuse_kernel_tables_every_step_would_overwrite():
    from hwkv.errors import ConfigError
    from hwkv.testing.spec_harness import draft_graphs

    h = Harness(OneTableSet, "cpu", GEOM, size=256, size_swa=64)
    with pytest.raises(ConfigError, match=r"md.extra\['plan'\]\['indptr'\] is one set of tables"):
        draft_graphs(h, [2], CaptureCheckingAdapter(), 2)


def test_the_reference_and_cpu_backends_pass():
    from hwkv_cpu.backend import TorchCPUBackend

    for cls in (ReferenceBackend, TorchCPUBackend):
        assert _run(cls).runner.replays > 0


@pytest.mark.interpret
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="a GPU is present: real graphs run there")
@pytest.mark.parametrize("which", ["triton", "xpu", "rocm"])
def test_triton_backends_pass(which, monkeypatch):
    pytest.importorskip("triton")
    if which == "triton":
        from hwkv_cuda.backend import TritonBackend as cls
    elif which == "xpu":
        from hwkv_xpu.backend import XPUBackend as cls
    else:
        from hwkv_rocm.backend import ROCmBackend as cls
    assert _run(cls).runner.replays > 0


@pytest.mark.interpret
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="a GPU is present: real graphs run there")
@pytest.mark.parametrize("fused", [False, True], ids=["torch-refill", "fused-refill"])
def test_triton_draft_graphs_pass(fused, monkeypatch):
    """Multi-step draft graphs of the Triton backend (interpreted) under the capture-checking adapter, with
    the torch refill and with the fused refill kernels a GPU registers (here for CPU tensors): every step
    equals the reference, a smaller bucket after a larger one, every replay reads what its capture read."""
    pytest.importorskip("triton")
    from hwkv import ops
    from hwkv.testing.spec_harness import draft_graphs, draft_steps
    from hwkv_cuda.backend import TritonBackend
    from hwkv_cuda.kernels import fill_kv_indices, refill

    if fused:
        monkeypatch.setitem(ops._REFILL, "cpu", refill.KERNELS)
        monkeypatch.setitem(ops._FILL, "cpu", fill_kv_indices)
    h = Harness(TritonBackend, "cpu", GEOM, size=256, size_swa=32, page_size=2)
    runner = draft_graphs(h, [1, 2], CaptureCheckingAdapter(), 3)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [5, 9], ForwardMode.EXTEND)
    for step in range(3):
        draft_steps(h, rids[:2 - step % 2], 3, runner=runner)
        h.release()
        h.check_integrity()
    assert runner.replays == 3 and runner.eager_runs == 0
    assert h.backend.loc_cache.translations == 1 + 2 + 3  # the extend, one refill per bucket's capture, 3 replays


@pytest.mark.parametrize("page_size, mode, tpr", [(16, ForwardMode.DECODE, 1), (128, ForwardMode.TARGET_VERIFY, 2)],
                         ids=["decode", "verify"])
def test_npu_fused_graph_path_passes(npu_standin, page_size, mode, tpr):
    """The NPU backend's fused graph path (task groups of the stand-in torch_npu, updated before every
    replay) under the capture-checking adapter: the page tables, masks and workspaces stay where captured."""
    from hwkv_npu.backend import NPUBackend

    g = ModelGeometry(num_layers=2, swa_every=2, window=6, num_heads=4, num_kv_heads=2, head_dim=64, sinks=False,
                      swa_sinks=True)
    h = Harness(NPUBackend, "cpu", g, size=1024, size_swa=16 * page_size, page_size=page_size, dtype=torch.float16)
    h.enable_graphs([1, 2, 4], npu_standin.graphs(), mode=mode, tokens_per_req=tpr)
    rids = [h.add_request() for _ in range(3)]
    h.forward(rids, [5, 9, 14], ForwardMode.EXTEND)
    for step in range(5):
        live = rids[:1 + step % 3]
        h.forward(live, [tpr] * len(live), mode)
        h.release()
        h.check_integrity()
    assert h.runner.replays == 5
    mod = npu_standin.mod
    assert mod.npu_fused_infer_attention_score.out.calls and mod.npu_fused_infer_attention_score_v2.out.calls


@pytest.mark.interpret
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="a GPU is present: real graphs run there")
def test_rocm_aiter_graph_path_passes(monkeypatch):
    """ROCm with the AITER stand-ins: decode replays read the int32 twins allocated once."""
    pytest.importorskip("triton")
    import sys

    from hwkv.testing.vendor_schemas import aiter as aiter_standin
    from hwkv_rocm import aiter_ops
    from hwkv_rocm.backend import ROCmBackend

    mod = aiter_standin.make_aiter("gfx942")
    monkeypatch.setitem(sys.modules, "aiter", mod)
    monkeypatch.setattr(aiter_ops, "arch_reason", lambda device: None)
    monkeypatch.setattr(aiter_ops, "gpu_arch", lambda device: "gfx942")
    g = ModelGeometry(num_layers=2, swa_every=2, window=6, num_heads=4, num_kv_heads=2, head_dim=64)
    h = Harness(ROCmBackend, "cpu", g, size=256, size_swa=64, page_size=2, dtype=torch.float16)
    h.enable_graphs([1, 2, 4], CaptureCheckingAdapter())
    run_scenario(h, steps=4, prompt_lens=(5, 9), chunk=8)
    assert h.runner.replays > 0 and aiter_standin.calls(mod)["paged_attention_ragged"] > 0


# ---- the contract suite itself: every graph replay checked, whatever adapter the target names ----------------
SUITE_GRAPH_CHECKS = {
    "translate-once": lambda t: contract.test_one_translation_per_forward_with_many_swa_layers(t, graph=True),
    "tail-zeroed": contract.test_graph_replay_with_fewer_tokens_zeroes_the_tail_and_keeps_live_slots,
    "verify": contract.test_speculative_verify_through_graphs_reads_swa_slots,
}


@pytest.mark.parametrize("check", sorted(SUITE_GRAPH_CHECKS))
@pytest.mark.parametrize("adapter", ["default", "eager"])
def test_the_contract_suite_fails_a_backend_whose_graph_metadata_moves(adapter, check):
    """A third party's target as documented (`ContractTarget(name, cls, device[, EagerAdapter])`): the suite's
    graph tests replay through the capture check, so metadata that moves between replays fails them (a plain
    EagerAdapter replay re-runs the step's Python and would pass, where a device graph reads stale memory)."""
    from hwkv.graph import EagerAdapter

    target = (ContractTarget("moving", MovingMetadata, "cpu") if adapter == "default"
              else ContractTarget("moving", MovingMetadata, "cpu", EagerAdapter))
    with pytest.raises(StaleCaptureError, match="its capture did not"):
        SUITE_GRAPH_CHECKS[check](target)


def test_the_check_wraps_replays_that_run_python_and_leaves_device_graphs_as_they_are():
    """A device graph (`records_device_work`: CUDA/HIP/MUSA/XPU/NPU) replays no Python and is not wrapped, so a
    GPU's contract run uses its real graphs; an adapter that already checks is not wrapped twice."""
    from hwkv.graph import EagerAdapter, TorchDeviceGraphAdapter
    from hwkv.testing.capture_check import CaptureChecked, capture_checked
    from hwkv_cpu.graph import CompileGraphAdapter

    class DeviceGraphs(TorchDeviceGraphAdapter):
        def __init__(self):  # no device here: only the class's declaration matters
            pass

    device, checking = DeviceGraphs(), CaptureCheckingAdapter()
    assert capture_checked(device) is device and capture_checked(checking) is checking
    assert ContractTarget("gpu", ReferenceBackend, "cuda", DeviceGraphs).graph_adapter().__class__ is DeviceGraphs
    for inner in (EagerAdapter, CompileGraphAdapter):
        wrapped = ContractTarget("cpu", ReferenceBackend, "cpu", inner).graph_adapter()
        assert isinstance(wrapped, CaptureChecked) and isinstance(wrapped.inner, inner)
        assert capture_checked(wrapped) is wrapped and not getattr(wrapped, "records_device_work", False)


def test_a_compiled_step_stays_compiled_under_the_check_and_is_checked():
    """The CPU target's torch.compile adapter under the check: its steps still compile (the recorder asks torch.compile
    to keep compiling while it records) and a backend whose metadata moves still fails."""
    from torch._dynamo.utils import counters
    from torch.utils._python_dispatch import TorchDispatchMode

    from hwkv_cpu.backend import TorchCPUBackend
    from hwkv_cpu.graph import CompileGraphAdapter

    if not hasattr(TorchDispatchMode, "ignore_compile_internals"):
        pytest.skip("this torch runs a compiled step eagerly under any dispatch mode")

    class MovingCPU(TorchCPUBackend):
        def init_forward_metadata_graph(self, batch, max_q_len=None):
            md = super().init_forward_metadata_graph(batch, max_q_len)
            for lst in md.windows.values():
                lst.indices = lst.indices.clone()
            return md

    check = contract.test_graph_replay_with_fewer_tokens_zeroes_the_tail_and_keeps_live_slots
    compiled = counters["frames"]["ok"]
    check(ContractTarget("cpu", TorchCPUBackend, "cpu", CompileGraphAdapter))
    assert counters["frames"]["ok"] > compiled, "the step ran eagerly under the capture check"
    with pytest.raises(StaleCaptureError, match="its capture did not"):
        check(ContractTarget("cpu", MovingCPU, "cpu", CompileGraphAdapter))
