"""The thin vendor backends (ROCm, XPU, NPU) on a machine without their hardware or libraries.

- Each backend class imports without its vendor library and fills in the core template.
- ROCmBackend and XPUBackend run the write/translation contract on CPU tensors, their Triton
  kernels under TRITON_INTERPRET=1 (tests/conftest.py sets it when no GPU is present).
- ROCm's AITER plumbing (decode, prefill, fp8 KV on MI300, per-layer fallback) runs against the schema
  stand-ins of hwkv.testing.vendor_schemas.aiter: a call AITER would refuse fails here.
- NPUBackend's torch path passes the whole contract suite on CPU tensors; its fused-attention path
  (page tables, host lengths, window masks, band prefill, v2 sinks, graph task groups updated before
  each replay) runs against hwkv.testing.vendor_schemas.npu (the `npu_standin` fixture of conftest.py).
- Graph adapters refuse with ConfigError when their torch module cannot capture here.
- Tests marked rocm / xpu / npu need the device and skip with the reason otherwise.
"""
import ast
import importlib.machinery
import importlib.util
import os
import sys
import types

import pytest
import torch

from hwkv.batch import ForwardMode
from hwkv.backend import AttentionBackend
from hwkv.devices import probe_torch_extension
from hwkv.errors import ConfigError
from hwkv.graph import EagerAdapter
from hwkv.testing import ContractTarget
from hwkv.testing import contract
from hwkv.testing.contract import *  # noqa: F401,F403  (the contract suite, run for the NPU torch path)
from hwkv.testing.harness import Harness, ModelGeometry, run_scenario
from hwkv.testing.vendor_schemas import aiter as aiter_standin

triton = pytest.importorskip("triton", reason="triton is not installed (pip install hwkv[cpu])")

from hwkv_cuda.backend import TritonBackend  # noqa: E402
from hwkv_npu import fia  # noqa: E402
from hwkv_npu import ops as npu_ops  # noqa: E402
from hwkv_npu.backend import NPUBackend  # noqa: E402
from hwkv_rocm import aiter_ops  # noqa: E402
from hwkv_rocm.backend import ROCmBackend  # noqa: E402
from hwkv_xpu.backend import XPUBackend  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="a GPU is present: the device runs cover the kernels")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: a 2-thread OpenMP region costs more than the work (x100 on small CI boxes)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- the classes and their import strings ----------------------------------------------------------
def test_backends_fill_the_template_and_specs_resolve():
    import hwkv_npu
    import hwkv_rocm
    import hwkv_xpu

    assert issubclass(ROCmBackend, TritonBackend) and issubclass(XPUBackend, TritonBackend)
    assert issubclass(NPUBackend, AttentionBackend) and not issubclass(NPUBackend, TritonBackend)
    for spec, cls in ((hwkv_rocm.DEVICE, ROCmBackend), (hwkv_xpu.DEVICE, XPUBackend), (hwkv_npu.DEVICE, NPUBackend)):
        assert spec.load_backend_class() is cls
        assert spec.load_graph_adapter().__name__.endswith("GraphAdapter")


@pytest.mark.parametrize("package", ["hwkv_rocm", "hwkv_xpu", "hwkv_npu"])
def test_vendor_libraries_are_imported_only_on_use(package):
    """No module-level `import aiter` / `import torch_npu`: they are imported when a backend or graph
    adapter is built on that device."""
    root = os.path.dirname(importlib.util.find_spec(package).origin)
    for name in sorted(os.listdir(root)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(root, name)) as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ("aiter", "torch_npu") for n in names), f"{package}/{name}"


def test_store_and_fill_kernels_are_registered_per_device_type():
    from hwkv import ops
    from hwkv_cuda import kernels

    assert ops._STORE["xpu"] is kernels.store_kv and ops._FILL["xpu"] is kernels.index.fill_kv_indices_prechecked
    assert ops._STORE["cuda"] is kernels.store_kv  # ROCm torch answers "cuda"
    assert ops._STORE_PRECHECKED["npu"] is npu_ops.store_kv  # (the checked entry: it behind the core's checks)
    assert ops._STORE["npu"] is not npu_ops.store_kv


def test_graph_adapters_refuse_without_their_runtime():
    from hwkv_npu.graph import NPUGraphAdapter
    from hwkv_xpu.graph import XPUGraphAdapter

    if not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        with pytest.raises(ConfigError, match="XPU graphs"):
            XPUGraphAdapter()
    if importlib.util.find_spec("torch_npu") is None:
        with pytest.raises(ConfigError, match="torch_npu is not installed"):
            NPUGraphAdapter()
        assert "has no npu_fused_infer_attention_score" in fia.load_env(types.SimpleNamespace()).fused_why


def test_options_are_validated():
    h = Harness(NPUBackend, "cpu", contract.SMALL, size=128, size_swa=32)
    with pytest.raises(ConfigError, match="unknown backend option"):
        NPUBackend(h.pool, h.rtt, sliding_window=8, aiter=False)
    assert NPUBackend(h.pool, h.rtt, sliding_window=8, fused=False).fused_reason == "disabled by fused=False"
    assert ROCmBackend(h.pool, h.rtt, sliding_window=8, aiter=False).aiter is None


# ---- Triton-based backends: the write and translation contract on CPU -----------------------------
TRITON_CONTRACT = [contract.test_swa_layer_writes_exactly_the_swa_loc_it_was_handed,
                   contract.test_swa_layer_without_swa_loc_raises_and_full_layer_ignores_it]


@needs_interpreter
@pytest.mark.interpret
@pytest.mark.parametrize("cls", [ROCmBackend, XPUBackend], ids=["rocm", "xpu"])
@pytest.mark.parametrize("check", TRITON_CONTRACT, ids=lambda f: f.__name__[5:])
def test_triton_vendor_backend_write_contract(cls, check):
    check(ContractTarget(cls.name, cls, "cpu", EagerAdapter))


@needs_interpreter
@pytest.mark.interpret
@pytest.mark.parametrize("cls", [ROCmBackend, XPUBackend], ids=["rocm", "xpu"])
def test_triton_vendor_backend_translates_once_per_forward(cls):
    """The contract's translation check on a tiny model (the suite's 7-layer one is slow interpreted)."""
    h = Harness(cls, "cpu", contract.SMALL, size=256, size_swa=64)
    counter = contract.CountingTranslate(h.pool)
    rids = [h.add_request() for _ in range(2)]
    for lens, mode in (([6, 9], ForwardMode.EXTEND), ([1, 1], ForwardMode.DECODE)):
        batch = h.make_batch(rids, lens, mode)
        h.backend.init_forward_metadata(batch)
        after_metadata = counter.calls
        h.model_step(batch, h.random_inputs(batch.num_tokens))
        assert after_metadata == 2 and counter.calls == 2, "write locs + window list once, never per layer"
        counter.calls = 0


# ---- ROCm: AITER against the schema stand-ins (hwkv.testing.vendor_schemas.aiter) --------------------
@pytest.fixture
def standin_aiter(monkeypatch):
    """The aiter stand-in on a gfx942 (MI300): its fp8 is float8_e4m3fnuz."""
    mod = aiter_standin.make_aiter("gfx942")
    monkeypatch.setitem(sys.modules, "aiter", mod)
    monkeypatch.setattr(aiter_ops, "arch_reason", lambda device: None)
    monkeypatch.setattr(aiter_ops, "gpu_arch", lambda device: "gfx942")
    return mod


AITER_GEOMETRY = ModelGeometry(num_layers=2, swa_every=2, window=6, num_heads=4, num_kv_heads=2, head_dim=64,
                               logit_cap=20.0)


@needs_interpreter
@pytest.mark.interpret
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_rocm_decode_and_prefill_go_through_aiter_and_match_reference(standin_aiter, graph):
    """Soft-capped full and SWA layers: decode through paged_attention_ragged, chunked prefill through
    mha_batch_prefill_func with the window as (W - 1, 0); every output checked against the reference."""
    h = Harness(ROCmBackend, "cpu", AITER_GEOMETRY, size=256, size_swa=48, page_size=2, dtype=torch.float16)
    assert h.backend.aiter is not None, h.backend.aiter_status
    if graph:
        h.enable_graphs([1, 2], EagerAdapter())
    run_scenario(h, steps=3, prompt_lens=(3, 9), chunk=4)
    calls = aiter_standin.calls(standin_aiter)
    assert calls["paged_attention_ragged"] >= 3 * 2 and calls["mha_batch_prefill_func"] >= 2 * 3


def _draft_graph_rounds(h, runner, rids, rounds=3, steps=3):
    """Draft forwards through `runner` for 1, 2, 1, ... requests (each step checked against the reference
    inside draft_steps), slots released between them."""
    from hwkv.testing.spec_harness import draft_steps
    for r in range(rounds):
        draft_steps(h, rids[:1 + r % 2], steps, runner=runner)
        h.release()
        h.check_integrity()


def _distinct_tables(tables):
    """Every draft step's kernel tables are their own memory (no storage shared between two steps)."""
    ptrs = [{t.untyped_storage().data_ptr() for t in _tensors(set_)} for set_ in tables]
    return all(not (a & b) for i, a in enumerate(ptrs) for b in ptrs[i + 1:])


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from _tensors(getattr(obj, name))


@needs_interpreter
@pytest.mark.interpret
def test_rocm_draft_graphs_run_aiter_with_a_table_set_per_step(standin_aiter):
    """Multi-step draft graphs over AITER: each step keeps its own int32 lists (alloc_graph_tables), so the
    k captured steps read k different tables, and every step matches the reference."""
    from hwkv.testing.spec_harness import draft_graphs
    h = Harness(ROCmBackend, "cpu", AITER_GEOMETRY, size=256, size_swa=48, page_size=2, dtype=torch.float16)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [5, 9], ForwardMode.EXTEND)
    h.release()
    runner = draft_graphs(h, [1, 2], EagerAdapter(), 3)
    before = aiter_standin.calls(standin_aiter)["paged_attention_ragged"]
    _draft_graph_rounds(h, runner, rids)
    assert runner.replays == 3
    assert aiter_standin.calls(standin_aiter)["paged_attention_ragged"] - before >= 3 * 3 * 2, "AITER ran each step"
    assert len(h.backend._graph_tables) == 3 and _distinct_tables(h.backend._graph_tables)


@needs_interpreter
@pytest.mark.interpret
def test_rocm_decode_like_tree_verify_runs_aiter_decode(standin_aiter):
    """tree_verify="decode", eager: AITER's paged decode takes the per-token lists (it plans from the lists
    alone), and every draft token matches the reference."""
    from hwkv.testing.spec_harness import tree_verify
    h = Harness(ROCmBackend, "cpu", AITER_GEOMETRY, size=256, size_swa=48, page_size=2, dtype=torch.float16,
                tree_verify="decode")
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [5, 9], ForwardMode.EXTEND)
    h.release()
    before = aiter_standin.calls(standin_aiter)
    tree_verify(h, rids, [[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3]], [[0, 2], [0, 1, 2, 3]])   # checked inside
    after = aiter_standin.calls(standin_aiter)
    assert after["paged_attention_ragged"] - before["paged_attention_ragged"] == len(h.layers)
    assert after["mha_batch_prefill_func"] == before["mha_batch_prefill_func"], "no extend-like call"


@needs_interpreter
@pytest.mark.interpret
def test_rocm_keeps_sink_layers_on_triton_layer_by_layer(standin_aiter):
    """Sinks only on the SWA layers (GPT-OSS style): those run Triton, the full layer still runs AITER."""
    g = ModelGeometry(num_layers=2, swa_every=2, window=6, num_heads=4, num_kv_heads=2, head_dim=64, sinks=False,
                      swa_sinks=True)
    h = Harness(ROCmBackend, "cpu", g, size=128, size_swa=32, dtype=torch.float16)
    run_scenario(h, steps=2, prompt_lens=(4,), chunk=8)
    ragged = standin_aiter.paged_attention_ragged.calls
    assert ragged and all(c["query"].shape[1] == 4 for c in ragged)
    # one full layer per step: the SWA (sink) layer never reached AITER
    assert len(ragged) == 2 and len(standin_aiter.mha_batch_prefill_func.calls) == 1


@needs_interpreter
@pytest.mark.interpret
@pytest.mark.parametrize("pool_fp8, fused", [("float8_e4m3fnuz", True), ("float8_e4m3fn", False)],
                         ids=["fnuz-aiter", "ocp-triton"])
def test_rocm_fp8_decode_on_mi300_needs_fnuz_pools(standin_aiter, pool_fp8, fused):
    """gfx942 reads fp8 as e4m3fnuz: such pools decode through AITER with their scales; an OCP e4m3fn pool
    there stays on Triton (the stand-in would decode its bytes as fnuz: wrong values)."""
    h = Harness(ROCmBackend, "cpu", AITER_GEOMETRY, size=256, size_swa=48, dtype=getattr(torch, pool_fp8),
                kv_scale=0.5)
    run_scenario(h, steps=3, prompt_lens=(3, 9), chunk=8)
    ragged = standin_aiter.paged_attention_ragged.calls
    assert bool(ragged) == fused
    if fused:
        assert {c["kv_cache_dtype"] for c in ragged} == {"fp8"}
        assert all(float(c["k_scale"]) == 0.5 for c in ragged)
    assert not standin_aiter.mha_batch_prefill_func.calls, "fp8 prefill stays on Triton"


def test_rocm_refuses_an_aiter_with_another_signature(monkeypatch):
    mod = types.ModuleType("aiter")
    mod.__spec__ = importlib.machinery.ModuleSpec("aiter", None)
    mod.paged_attention_ragged = lambda out, query, key_cache: None
    mod.mha_batch_prefill_func = lambda q, k, v: None
    monkeypatch.setitem(sys.modules, "aiter", mod)
    fn, reason = aiter_ops.load_paged_attention_ragged()
    assert fn is None and "not the verified" in reason
    fn, reason = aiter_ops.load_batch_prefill()
    assert fn is None and "not the verified" in reason
    monkeypatch.setattr(aiter_ops, "arch_reason", lambda device: None)
    h = Harness(ROCmBackend, "cpu", contract.SMALL, size=128, size_swa=32)
    assert h.backend.aiter is None and "not the verified" in h.backend.aiter_status


def test_rocm_arch_gate_on_cpu():
    assert "not on a ROCm GPU" in aiter_ops.arch_reason(torch.device("cpu"))


# ---- NPU: the torch path passes the whole contract suite on CPU ------------------------------------
@pytest.fixture
def hwkv_target():
    return ContractTarget("npu-torch", NPUBackend, "cpu", EagerAdapter)


# ---- NPU: page tables read off the index lists ---------------------------------------------------
def test_block_table_from_csr_names_the_page_of_each_span():
    p = 4
    # request 0: positions 0..9 at pages 3, 7, 2; request 1: window list from position 6 (offset 2) to 13
    slots0 = [3 * p + i for i in range(4)] + [7 * p + i for i in range(4)] + [2 * p + i for i in range(2)]
    slots1 = [5 * p + 2, 5 * p + 3] + [9 * p + i for i in range(4)] + [1 * p + i for i in range(2)]
    indices = torch.tensor(slots0 + slots1)
    indptr = torch.tensor([0, 10, 18], dtype=torch.int32)
    pos0 = torch.tensor([0, 6])
    table = npu_ops.block_table_from_csr(indptr, indices, pos0, p, 4)
    assert table.dtype == torch.int32
    assert table.tolist() == [[3, 7, 2, 0], [5, 9, 1, 0]]


def test_npu_store_uses_reshape_and_cache_for_half_pools(npu_standin):
    """fp16/bf16 pools store through the ATB reshape-and-cache stand-in (schema-checked); fp32 through torch."""
    loc = torch.tensor([5, 130, 17])
    op = npu_standin.mod._npu_reshape_and_cache
    for dtype, scale in ((torch.float16, None), (torch.bfloat16, 2.0), (torch.float32, None)):
        k_buf, v_buf = torch.zeros(2 * 128, 2, 16, dtype=dtype), torch.zeros(2 * 128, 2, 8, dtype=dtype)
        k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 8)
        k_in = k.clone()
        npu_ops.store_kv(k_buf, v_buf, loc, k, v, scale, scale)
        assert torch.equal(k, k_in)
        assert torch.equal(k_buf[loc], (k / (scale or 1.0)).to(dtype))
        assert torch.equal(v_buf[loc], (v / (scale or 1.0)).to(dtype))
    assert [c["key_cache"].shape[1] for c in op.calls] == [128, 128], "fp16/bf16 through the op, fp32 through torch"


def _npu_calls(mod):
    return {"v1": len(mod.npu_fused_infer_attention_score.calls),
            "v1.out": len(mod.npu_fused_infer_attention_score.out.calls),
            "v2": len(mod.npu_fused_infer_attention_score_v2.calls),
            "v2.out": len(mod.npu_fused_infer_attention_score_v2.out.calls)}


@pytest.mark.parametrize("page_size,window", [(16, 20), (16, 7), (128, 20), (128, 5)])
def test_npu_fused_op_matches_reference(npu_standin, page_size, window):
    """Decode (page tables, window head masks) and, at page sizes of 128, chunked prefill of full layers
    (sparse_mode 3) and SWA layers (band sparse_mode 4, pre_tokens W - 1) through the schema stand-in."""
    g = ModelGeometry(num_layers=2, swa_every=2, window=window, num_heads=4, num_kv_heads=2, head_dim=16)
    h = Harness(NPUBackend, "cpu", g, size=1024, size_swa=8 * page_size, page_size=page_size, dtype=torch.float16)
    assert h.backend.fused_reason is None
    run_scenario(h, steps=6, prompt_lens=(5, 37, 23), chunk=16)
    calls = npu_standin.mod.npu_fused_infer_attention_score.calls
    decodes = [c for c in calls if c["query"].shape[1] == 1]
    extends = [c for c in calls if c["query"].shape[1] > 1]
    assert decodes and bool(extends) == (page_size == 128)
    assert {c["sparse_mode"] for c in extends} <= {3, 4}
    assert all(c["pre_tokens"] == window - 1 and c["next_tokens"] == 0 for c in extends if c["sparse_mode"] == 4)


@pytest.mark.parametrize("v2_sinks", [True, False], ids=["v2-learnable-sink", "no-v2-sink"])
def test_npu_sink_layers_take_v2_when_the_release_has_learnable_sink(npu_standin, v2_sinks):
    npu_standin.use(v2_sinks=v2_sinks)
    # head_dim 64: v2's learnable_sink takes V_D 64 or 128 only
    g = ModelGeometry(num_layers=2, swa_every=2, window=9, num_heads=4, num_kv_heads=2, head_dim=64, sinks=True)
    h = Harness(NPUBackend, "cpu", g, size=1024, size_swa=256, page_size=128, dtype=torch.float16)
    run_scenario(h, steps=3, prompt_lens=(5, 20), chunk=16)
    calls = _npu_calls(npu_standin.mod)
    assert (calls["v2"] > 0) == v2_sinks and calls["v1"] == 0
    if v2_sinks:
        assert all(c["learnable_sink"] is not None for c in npu_standin.mod.npu_fused_infer_attention_score_v2.calls)


def test_npu_falls_back_per_layer_for_what_the_op_cannot_compute(npu_standin):
    """Soft-cap on the SWA layers only (the full layer keeps the fused op), then an fp32 pool (no layer)."""
    g = ModelGeometry(num_layers=2, swa_every=2, window=9, num_heads=4, num_kv_heads=2, head_dim=16)
    h = Harness(NPUBackend, "cpu", g, size=512, size_swa=128, page_size=16, dtype=torch.float16)
    for layer in h.layers:
        if layer.window is not None:
            layer.logit_cap = 5.0
    run_scenario(h, steps=3, prompt_lens=(5, 20), chunk=16)
    calls = npu_standin.mod.npu_fused_infer_attention_score.calls
    assert calls and all(c["query"].shape[2] == 4 and c["atten_mask"] is None for c in calls), "full layers only"
    n = len(calls)
    h = Harness(NPUBackend, "cpu", contract.SMALL, size=512, size_swa=128, page_size=16)  # fp32 pool
    run_scenario(h, steps=2, prompt_lens=(5,), chunk=16)
    assert len(calls) == n


@pytest.mark.parametrize("page_size,mode,tpr", [(16, ForwardMode.DECODE, 1), (128, ForwardMode.TARGET_VERIFY, 3)],
                         ids=["decode", "verify"])
def test_npu_graph_replays_run_the_fused_op_with_updated_lengths(npu_standin, page_size, mode, tpr):
    """Graph replays take the fused op's `.out` in task groups; pre_replay updates every group with this
    forward's lengths (the stand-in replays the groups' updated arguments, as a device graph would)."""
    g = ModelGeometry(num_layers=2, swa_every=2, window=7, num_heads=4, num_kv_heads=2, head_dim=16)
    h = Harness(NPUBackend, "cpu", g, size=1024, size_swa=16 * page_size, page_size=page_size, dtype=torch.float16)
    h.enable_graphs([1, 2, 4], npu_standin.graphs(), mode=mode, tokens_per_req=tpr)
    rids = [h.add_request() for _ in range(3)]
    h.forward(rids, [5, 19, 9], ForwardMode.EXTEND)
    for step in range(4):
        h.forward(rids[:2 + step % 2], [tpr] * (2 + step % 2), mode)  # checked against the reference inside
        h.release()
    assert h.runner.replays == 4
    out_calls = npu_standin.mod.npu_fused_infer_attention_score.out.calls
    assert out_calls and all(c["workspace"] is not None for c in out_calls)


@pytest.mark.parametrize("page_size", [16, 128])
def test_npu_draft_graphs_update_each_steps_own_plan(npu_standin, page_size):
    """Multi-step draft graphs through the fused op: each step has its own persistent plans and tables, so
    pre_replay updates every step's task groups with that step's host lengths (seq + i, from the batch's
    host copy: no device read), and every step matches the reference."""
    from hwkv.testing.spec_harness import draft_graphs
    g = ModelGeometry(num_layers=2, swa_every=2, window=7, num_heads=4, num_kv_heads=2, head_dim=16)
    h = Harness(NPUBackend, "cpu", g, size=1024, size_swa=16 * page_size, page_size=page_size, dtype=torch.float16)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [5, 19], ForwardMode.EXTEND)
    h.release()
    runner = draft_graphs(h, [1, 2], npu_standin.graphs(), 3)
    out = npu_standin.mod.npu_fused_infer_attention_score.out
    before = len(out.calls)
    _draft_graph_rounds(h, runner, rids)
    assert runner.replays == 3 and len(out.calls) > before
    plans = [{w: gl.plan for w, gl in t.items()} for t in h.backend._graph_tables]
    assert len(plans) == 3 and len({id(p[None]) for p in plans}) == 3
    assert _distinct_tables([{w: gl.table for w, gl in t.items()} for t in h.backend._graph_tables])


def test_npu_graph_without_updates_is_caught(npu_standin, monkeypatch):
    """A replay whose task groups were not updated: the stand-in runtime refuses it (the device would wait
    forever on the group's event); updates that keep the captured lengths fail the reference check."""
    from hwkv.errors import ReferenceMismatchError
    from hwkv.testing.vendor_schemas import VendorCallError
    from hwkv_npu import graph as npu_graph

    g = ModelGeometry(num_layers=2, swa_every=2, window=7, num_heads=4, num_kv_heads=2, head_dim=16)

    def run():
        h = Harness(NPUBackend, "cpu", g, size=1024, size_swa=256, page_size=16, dtype=torch.float16)
        h.enable_graphs([2], npu_standin.graphs())
        rids = [h.add_request() for _ in range(2)]
        h.forward(rids, [5, 19], ForwardMode.EXTEND)
        h.forward(rids, [1, 1], ForwardMode.DECODE)

    with monkeypatch.context() as m:
        m.setattr(npu_graph, "update_tasks", lambda tasks, stream: None)
        with pytest.raises(VendorCallError, match="not updated since the last replay"):
            run()
    with monkeypatch.context() as m:
        frozen = {}

        def stale_kwargs(self):
            kw = fia.kwargs_for(self.plan, self.layer, self.decode, self.env, self.mask2048, self.bs, self.sinks)
            # the lengths of the first issue (capture), forever; the entry holds the call object so its id
            # cannot be reused by a later call after it is collected (which made this test flaky)
            return frozen.setdefault(id(self), (self, kw))[1]

        m.setattr(fia.FIACall, "kwargs", stale_kwargs)
        with pytest.raises(ReferenceMismatchError):
            run()


def test_npu_env_reads_the_installed_schemas(npu_standin):
    env = fia.load_env(npu_standin.mod)
    assert env.fused and env.sinks and env.graph and env.scale_kw == "scale"
    env = fia.load_env(npu_standin.use(v2_sinks=False).mod)
    assert env.fused and not env.sinks and "learnable_sink" in env.sinks_why


# ---- on the devices ---------------------------------------------------------------------------------
def _rocm_reason():
    if not (torch.version.hip and torch.cuda.is_available()):
        return "needs a ROCm build of torch and an AMD GPU"
    return None


def _xpu_reason():
    if not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        return "needs torch.xpu with a visible Intel GPU"
    return None


def _extension_reason(module, attr, what):
    """Why the on-device test of a torch-extension device skips (None: it runs): not installed, no device, or an
    installation that fails to import whatever it raises (a CANN / driver mismatch raises OSError or RuntimeError),
    so that such a machine still collects this module's other tests."""
    if importlib.util.find_spec(module) is None:
        return f"needs {module} and {what}"
    try:
        return probe_torch_extension(module, attr)
    except Exception as e:  # noqa: BLE001 - the reason shown in the skip
        return f"{module} fails to import: {type(e).__name__}: {e}"


_NPU_REASON = _extension_reason("torch_npu", "npu", "an Ascend NPU")
_MUSA_REASON = _extension_reason("torch_musa", "musa", "a Moore Threads GPU")


def _npu_reason():
    return _NPU_REASON


DEVICE_GEOMETRY = ModelGeometry(num_layers=4, swa_every=2, window=24, num_heads=8, num_kv_heads=2, head_dim=128)


def _device_run(cls, device, adapter_cls, page_size, dtype=torch.bfloat16, **options):
    h = Harness(cls, device, DEVICE_GEOMETRY, size=8192, size_swa=1024, page_size=page_size, dtype=dtype, **options)
    run_scenario(h, steps=8, prompt_lens=(7, 150, 40), chunk=64)
    g = Harness(cls, device, DEVICE_GEOMETRY, size=8192, size_swa=1024, page_size=page_size, dtype=dtype, **options)
    g.enable_graphs([1, 2, 4], adapter_cls())
    run_scenario(g, steps=8, prompt_lens=(7, 150, 40), chunk=64)
    return h


@pytest.mark.rocm
@pytest.mark.skipif(_rocm_reason() is not None, reason=str(_rocm_reason()))
@pytest.mark.parametrize("aiter", [True, False], ids=["aiter", "triton"])
def test_rocm_on_device(aiter):
    from hwkv_cuda.graph import CUDAGraphAdapter

    h = _device_run(ROCmBackend, "cuda", CUDAGraphAdapter, 16, aiter=aiter)
    assert (h.backend.aiter is not None) == (aiter and aiter_ops.arch_reason(h.device) is None
                                             and importlib.util.find_spec("aiter") is not None)


@pytest.mark.xpu
@pytest.mark.skipif(_xpu_reason() is not None, reason=str(_xpu_reason()))
def test_xpu_on_device():
    from hwkv_xpu.graph import XPUGraphAdapter

    _device_run(XPUBackend, "xpu", XPUGraphAdapter, 16)


@pytest.mark.npu
@pytest.mark.skipif(_npu_reason() is not None, reason=str(_npu_reason()))
@pytest.mark.parametrize("page_size", [16, 128])
def test_npu_on_device(page_size):
    from hwkv_npu.graph import NPUGraphAdapter

    h = _device_run(NPUBackend, "npu", NPUGraphAdapter, page_size)
    assert h.backend.fused_reason is None


@pytest.mark.musa
@pytest.mark.skipif(_MUSA_REASON is not None, reason=str(_MUSA_REASON))
def test_musa_on_device():
    """The Triton kernels and MUSA graphs on a Moore Threads GPU (hwkv_cuda's backend, torch_musa's device)."""
    from hwkv_cuda.backend import TritonBackend
    from hwkv_cuda.graph import MUSAGraphAdapter

    _device_run(TritonBackend, "musa", MUSAGraphAdapter, 16)


@needs_interpreter
@pytest.mark.interpret
def test_rocm_int32_lists_are_allocated_once_and_filled_live_only(standin_aiter, monkeypatch):
    """A second runner must not reallocate the int32 lists a captured decode graph reads, and a refill
    writes the live entries of the full list only (never max_bs x context of copy per replay)."""
    from hwkv import ops
    from hwkv_cuda import kernels

    filled = []

    def fill(rtt, rows, pos0, indptr, out):  # the device kernel (interpreted here): writes live entries only
        filled.append(out)
        kernels.fill_kv_indices(rtt, rows, pos0, indptr, out)

    monkeypatch.setattr(ops, "fill_kv_indices", fill)
    h = Harness(ROCmBackend, "cpu", AITER_GEOMETRY, size=256, size_swa=48, page_size=2, dtype=torch.float16)
    h.enable_graphs([1, 2], EagerAdapter())
    ptrs = {w: t.data_ptr() for w, t in h.backend._graph_tables[0].items()}
    h.enable_graphs([1], EagerAdapter(), mode=ForwardMode.TARGET_VERIFY, tokens_per_req=2)
    assert {w: t.data_ptr() for w, t in h.backend._graph_tables[0].items()} == ptrs, "int32 lists reallocated"
    full = h.backend._graph_tables[0][None]
    full.fill_(-7)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [3, 5], ForwardMode.EXTEND)
    h.enable_graphs([2], EagerAdapter())
    full.fill_(-7)
    h.forward(rids, [1, 1], ForwardMode.DECODE)
    live = int(h.backend.static.full_indptr[2])
    assert filled and filled[-1] is full
    assert torch.equal(full[:live].long(), h.backend.static.full_indices[:live])
    assert (full[live:] == -7).all(), "the refill wrote past the live entries"
