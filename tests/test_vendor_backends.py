"""The thin vendor backends (ROCm, XPU, NPU) on a machine without their hardware or libraries.

- Each backend class imports without its vendor library and fills in the core template.
- ROCmBackend and XPUBackend run the write/translation contract on CPU tensors, their Triton
  kernels under TRITON_INTERPRET=1 (tests/conftest.py sets it when no GPU is present).
- ROCm's AITER plumbing runs against a stand-in `aiter` module that implements
  `paged_attention_ragged` as documented (int32 ragged slot lists, block_size 1, "NHD").
- NPUBackend's torch path passes the whole contract suite on CPU tensors; its fused-attention
  plans (page tables, host lengths, window masks) run against a stand-in of the fused op.
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
from hwkv.errors import ConfigError
from hwkv.graph import EagerAdapter
from hwkv.testing import ContractTarget
from hwkv.testing import contract
from hwkv.testing.contract import *  # noqa: F401,F403  (the contract suite, run for the NPU torch path)
from hwkv.testing.harness import Harness, ModelGeometry, run_scenario

triton = pytest.importorskip("triton", reason="triton is not installed (pip install hwkv[cpu])")

from hwkv_cuda.backend import TritonBackend  # noqa: E402
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

    assert ops._STORE["xpu"] is kernels.store_kv and ops._FILL["xpu"] is kernels.fill_kv_indices
    assert ops._STORE["cuda"] is kernels.store_kv  # ROCm torch answers "cuda"
    assert ops._STORE["npu"] is npu_ops.store_kv


def test_graph_adapters_refuse_without_their_runtime():
    from hwkv_npu.graph import NPUGraphAdapter
    from hwkv_xpu.graph import XPUGraphAdapter

    if not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        with pytest.raises(ConfigError, match="XPU graphs"):
            XPUGraphAdapter()
    if importlib.util.find_spec("torch_npu") is None:
        with pytest.raises(ConfigError, match="torch_npu is not installed"):
            NPUGraphAdapter()
        assert "has no npu_fused_infer_attention_score" in npu_ops.fia_schema_reason()


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


# ---- ROCm: AITER plumbing against a stand-in module ------------------------------------------------
def _fake_paged_attention_ragged(calls):
    """aiter.paged_attention_ragged as its source documents it, in torch (checks what it is handed)."""
    def paged_attention_ragged(out, workspace_buffer, query, key_cache, value_cache, scale, kv_indptr,
                               kv_page_indices, kv_last_page_lens, block_size, max_num_partitions, alibi_slopes,
                               kv_cache_dtype, kv_cache_layout, logits_soft_cap, k_scale, v_scale,
                               fp8_out_scale=None, partition_size=256, mtp=1):
        assert kv_indptr.dtype == torch.int32 and kv_page_indices.dtype == torch.int32
        assert (block_size, kv_cache_layout, kv_cache_dtype, alibi_slopes) == (1, "NHD", "auto", None)
        s, h, d = query.shape
        assert key_cache.shape[1] == 1 and key_cache.shape[3] == d and out.shape == (s, h, d)
        assert workspace_buffer.dtype == torch.uint8
        assert workspace_buffer.numel() >= s * h * max_num_partitions * (d * query.element_size() + 8)
        g = h // key_cache.shape[2]
        ptr = kv_indptr.tolist()
        for b in range(s):
            idx = kv_page_indices[ptr[b]:ptr[b + 1]].long()
            assert idx.numel() <= max_num_partitions * partition_size
            k = key_cache[idx, 0].float().repeat_interleave(g, 1) * k_scale
            v = value_cache[idx, 0].float().repeat_interleave(g, 1) * v_scale
            logits = torch.einsum("hd,nhd->hn", query[b].float(), k) * scale
            if logits_soft_cap:
                logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
            out[b] = torch.einsum("hn,nhd->hd", torch.softmax(logits, -1), v).to(out.dtype)
        calls.append(s)
    return paged_attention_ragged


@pytest.fixture
def fake_aiter(monkeypatch):
    calls = []
    mod = types.ModuleType("aiter")
    mod.__spec__ = importlib.machinery.ModuleSpec("aiter", None)
    mod.paged_attention_ragged = _fake_paged_attention_ragged(calls)
    monkeypatch.setitem(sys.modules, "aiter", mod)
    monkeypatch.setattr(aiter_ops, "arch_reason", lambda device: None)
    return mod, calls


AITER_GEOMETRY = ModelGeometry(num_layers=2, swa_every=2, window=6, num_heads=4, num_kv_heads=2, head_dim=64,
                               logit_cap=20.0)


@needs_interpreter
@pytest.mark.interpret
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_rocm_decode_goes_through_aiter_and_matches_reference(fake_aiter, graph):
    _, calls = fake_aiter
    h = Harness(ROCmBackend, "cpu", AITER_GEOMETRY, size=256, size_swa=48, page_size=2, dtype=torch.float16)
    assert h.backend.aiter is not None, h.backend.aiter_status
    if graph:
        h.enable_graphs([1, 2], EagerAdapter())
    run_scenario(h, steps=3, prompt_lens=(3, 9), chunk=8)
    assert len(calls) >= 3 * 2, "every decode layer of this geometry is one AITER supports"


@needs_interpreter
@pytest.mark.interpret
def test_rocm_keeps_unsupported_layers_on_triton(fake_aiter):
    _, calls = fake_aiter
    g = ModelGeometry(num_layers=2, swa_every=2, window=6, num_heads=4, num_kv_heads=2, head_dim=16, sinks=True)
    h = Harness(ROCmBackend, "cpu", g, size=128, size_swa=32, dtype=torch.float16)
    run_scenario(h, steps=2, prompt_lens=(4,), chunk=8)
    assert calls == []


def test_rocm_refuses_an_aiter_with_another_signature(monkeypatch):
    mod = types.ModuleType("aiter")
    mod.__spec__ = importlib.machinery.ModuleSpec("aiter", None)
    mod.paged_attention_ragged = lambda out, query, key_cache: None
    monkeypatch.setitem(sys.modules, "aiter", mod)
    fn, reason = aiter_ops.load_paged_attention_ragged()
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


def test_npu_store_uses_reshape_and_cache_for_half_pools(monkeypatch):
    """Against a stand-in torch_npu whose op writes key_cache[slot // block, slot % block] = key."""
    seen = []

    def reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
        assert slot_indices.dtype == torch.int32 and key_cache.dim() == 4 and key.dtype == key_cache.dtype
        block = key_cache.shape[1]
        for i, s in enumerate(slot_indices.tolist()):
            key_cache[s // block, s % block] = key[i]
            value_cache[s // block, s % block] = value[i]
        seen.append(block)

    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(_npu_reshape_and_cache=reshape_and_cache))
    loc = torch.tensor([5, 130, 17])
    for dtype, scale in ((torch.float16, None), (torch.bfloat16, 2.0), (torch.float32, None)):
        k_buf, v_buf = torch.zeros(2 * 128, 2, 16, dtype=dtype), torch.zeros(2 * 128, 2, 8, dtype=dtype)
        k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 8)
        k_in = k.clone()
        npu_ops.store_kv(k_buf, v_buf, loc, k, v, scale, scale)
        assert torch.equal(k, k_in)
        assert torch.equal(k_buf[loc], (k / (scale or 1.0)).to(dtype))
        assert torch.equal(v_buf[loc], (v / (scale or 1.0)).to(dtype))
    assert seen == [128, 128], "fp16/bf16 pools go through the op, fp32 through hwkv's torch store"


def _pages_to_slots(plan, b, n):
    p = plan.block_size
    return (plan.block_table[b].long()[:, None] * p + torch.arange(p)).reshape(-1)[:n]


def _fake_fia_decode(calls):
    """npu_fused_infer_attention_score with Q_S = 1 as documented: pages of block_table, the first
    kv_lens[b] tokens, atten_mask True = masked."""
    def fia_decode(q, k_buf, v_buf, plan, scaling, out):
        g = q.shape[1] // k_buf.shape[1]
        for b in range(q.shape[0]):
            n = plan.kv_lens[b]
            slots = _pages_to_slots(plan, b, n)
            if plan.mask is not None:
                assert plan.mask.shape[-1] >= plan.block_table.shape[1] * plan.block_size
                slots = slots[~plan.mask[b, 0, 0, :n]]
            k = k_buf[slots].float().repeat_interleave(g, 1)
            v = v_buf[slots].float().repeat_interleave(g, 1)
            logits = torch.einsum("hd,nhd->hn", q[b].float(), k) * scaling
            out[b] = torch.einsum("hn,nhd->hd", torch.softmax(logits, -1), v).to(out.dtype)
        calls.append(("decode", q.shape[0]))
    return fia_decode


def _fake_fia_extend(calls):
    """Q_S > 1 with sparse_mode 3: query i of q_len sees keys j <= kv_len - q_len + i."""
    def fia_extend(q, k_buf, v_buf, plan, scaling, rows, causal_mask, out):
        assert causal_mask.shape == (2048, 2048) and bool(causal_mask[0, 1]) and not bool(causal_mask[1, 0])
        g = q.shape[1] // k_buf.shape[1]
        t0 = 0
        for b, (ql, n) in enumerate(zip(plan.q_lens, plan.kv_lens)):
            assert rows.req[t0:t0 + ql].eq(b).all() and rows.row[t0:t0 + ql].tolist() == list(range(ql))
            slots = _pages_to_slots(plan, b, n)
            k = k_buf[slots].float().repeat_interleave(g, 1)
            v = v_buf[slots].float().repeat_interleave(g, 1)
            logits = torch.einsum("qhd,nhd->hqn", q[t0:t0 + ql].float(), k) * scaling
            hide = torch.arange(n)[None, :] > (n - ql + torch.arange(ql))[:, None]
            probs = torch.softmax(logits.masked_fill(hide, float("-inf")), -1)
            out[t0:t0 + ql] = torch.einsum("hqn,nhd->qhd", probs, v).to(out.dtype)
            t0 += ql
        calls.append(("extend", q.shape[0]))
    return fia_extend


@pytest.fixture
def fake_fia(monkeypatch):
    calls = []
    monkeypatch.setattr(NPUBackend, "_fused_reason", lambda self: None)
    monkeypatch.setattr(npu_ops, "fia_decode", _fake_fia_decode(calls))
    monkeypatch.setattr(npu_ops, "fia_extend", _fake_fia_extend(calls))
    return calls


@pytest.mark.parametrize("page_size,window", [(16, 20), (16, 7), (128, 20)])
def test_npu_fused_plans_match_reference(fake_fia, page_size, window):
    g = ModelGeometry(num_layers=2, swa_every=2, window=window, num_heads=4, num_kv_heads=2, head_dim=16)
    h = Harness(NPUBackend, "cpu", g, size=1024, size_swa=8 * page_size, page_size=page_size,
                dtype=torch.float16)
    run_scenario(h, steps=6, prompt_lens=(5, 37, 23), chunk=16)
    kinds = {k for k, _ in fake_fia}
    assert "decode" in kinds and ("extend" in kinds) == (page_size == 128)


def test_npu_fused_op_skips_what_it_cannot_compute(fake_fia):
    g = ModelGeometry(num_layers=2, swa_every=2, window=9, num_heads=4, num_kv_heads=2, head_dim=16, sinks=True)
    h = Harness(NPUBackend, "cpu", g, size=512, size_swa=128, page_size=16, dtype=torch.float16)
    run_scenario(h, steps=3, prompt_lens=(5, 20), chunk=16)
    assert fake_fia == []  # sinks: every layer ran the torch kernel (and matched the reference)
    h = Harness(NPUBackend, "cpu", contract.SMALL, size=512, size_swa=128, page_size=16)  # fp32 pool
    run_scenario(h, steps=2, prompt_lens=(5,), chunk=16)
    assert fake_fia == []


# ---- on the devices ---------------------------------------------------------------------------------
def _rocm_reason():
    if not (torch.version.hip and torch.cuda.is_available()):
        return "needs a ROCm build of torch and an AMD GPU"
    return None


def _xpu_reason():
    if not (hasattr(torch, "xpu") and torch.xpu.is_available()):
        return "needs torch.xpu with a visible Intel GPU"
    return None


def _npu_reason():
    if importlib.util.find_spec("torch_npu") is None:
        return "needs torch_npu and an Ascend NPU"
    import torch_npu  # noqa: F401

    return None if torch.npu.is_available() else "torch.npu.is_available() is False"


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


@needs_interpreter
@pytest.mark.interpret
def test_rocm_int32_lists_are_allocated_once_and_filled_live_only(fake_aiter, monkeypatch):
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
    ptrs = {w: t.data_ptr() for w, t in h.backend._indices_i32.items()}
    h.enable_graphs([1], EagerAdapter(), mode=ForwardMode.TARGET_VERIFY, tokens_per_req=2)
    assert {w: t.data_ptr() for w, t in h.backend._indices_i32.items()} == ptrs, "int32 lists reallocated"
    full = h.backend._indices_i32[None]
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
