"""IPEX's paged-attention ops through hwkv_cpu (and the glue hwkv_xpu shares, hwkv_intel), against hwkv.reference.

The real-op tests need intel_extension_for_pytorch built for this torch (IPEX 2.8 pins torch 2.8) and skip
with the reason otherwise, so the default `make test` skips them; docs/devices.md ("IPEX") records
the command and result of the real run. The probe, the per-layer decisions and the plan run everywhere.
"""
import ast
import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hwkv import ops, reference
from hwkv.batch import ForwardMode
from hwkv.layer import AttentionLayer
from hwkv.metadata import KVIndexList
from hwkv.testing.capture_check import CaptureCheckingAdapter
from hwkv.testing.harness import Harness, ModelGeometry, run_scenario
from hwkv.graph import EagerAdapter
from hwkv.testing import ContractTarget
from hwkv.testing.contract import *  # noqa: F401,F403  (the contract suite, run by the fixture below)
from hwkv_cpu import ipex
from hwkv_cpu.backend import TorchCPUBackend
from hwkv_cpu.graph import CompileGraphAdapter
from hwkv_intel import ipex as intel

pytestmark = pytest.mark.ipex
ROOT = Path(__file__).resolve().parents[1]
WHY_NOT = ipex.installed_reason()
needs_ipex = pytest.mark.skipif(WHY_NOT is not None, reason=f"IPEX unavailable: {WHY_NOT}")


class IpexEverywhere(TorchCPUBackend):
    """The CPU backend with IPEX for extend too (`ipex_extend=True`), for the contract suite below."""

    def __init__(self, pool, req_to_token_pool, **options):
        options.setdefault("ipex_extend", True)
        super().__init__(pool, req_to_token_pool, **options)


@pytest.fixture(params=["eager-adapter", "compile"])
def hwkv_target(request):
    """The whole contract suite (imported below) over IPEX's decode and extend ops."""
    if WHY_NOT is not None:
        pytest.skip(f"IPEX unavailable: {WHY_NOT}")
    adapter = EagerAdapter if request.param == "eager-adapter" else CompileGraphAdapter
    return ContractTarget(f"cpu-ipex-{request.param}", IpexEverywhere, "cpu", adapter)
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}


# ---- probe and decisions (no IPEX needed) -----------------------------------------------------------
def test_probe_says_why_before_importing(monkeypatch):
    monkeypatch.setattr(intel.importlib.util, "find_spec", lambda name: None)
    assert "not installed" in intel.installed_reason()
    monkeypatch.setattr(intel.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(intel.importlib.metadata, "version", lambda dist: "2.8.0+cpu")
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    assert intel.installed_reason() == "IPEX 2.8.0+cpu needs torch 2.8.*, this is torch 2.13.0+cpu"
    monkeypatch.setattr(torch, "__version__", "2.8.1")
    assert intel.installed_reason() is None


def _layer(**kw):
    kw.setdefault("layer_id", 0)
    return AttentionLayer(num_heads=4, num_kv_heads=2, head_dim=16, **kw)


def _list(window=None):
    one = torch.zeros(1, dtype=torch.int64)
    return KVIndexList(torch.tensor([0, 1], dtype=torch.int32), one, one, window, 1)


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "extend"])
def test_layer_reason_names_what_ipex_lacks(decode):
    q = torch.zeros(1, 4, 16)
    buf = torch.zeros(8, 2, 16)
    ok = ipex.layer_reason

    assert ok(q, _layer(), _list(), buf, buf, decode) is None
    assert ok(q, _layer(sliding_window=8, logit_cap=30.0), _list(8), buf, buf, decode) is None
    assert "sinks" in ok(q, _layer(sinks=torch.zeros(4)), _list(), buf, buf, decode)
    assert "scale" in ok(q, _layer(k_scale=0.5), _list(), buf, buf, decode)
    fp8 = torch.zeros(8, 2, 16, dtype=torch.float8_e4m3fn)
    assert "fp32/bf16/fp16" in ok(q.bfloat16(), _layer(), _list(), fp8, fp8, decode)
    assert "head dims" in ok(q, _layer(v_head_dim=8), _list(), buf, torch.zeros(8, 2, 8), decode)
    # a windowed layer over the full list needs the op's window, which decode refuses next to softcap
    windowed_full = ok(q, _layer(sliding_window=8, logit_cap=30.0), _list(None), buf, buf, decode)
    assert ("softcap" in windowed_full) if decode else windowed_full is None
    w1 = ok(q, _layer(sliding_window=1), _list(1), buf, buf, decode)
    assert (w1 is None) if decode else "W=1" in w1


def test_decode_needs_a_window_only_over_an_untrimmed_list():
    assert ipex.decode_window(_layer(), _list()) == -1
    assert ipex.decode_window(_layer(sliding_window=8), _list(8)) == -1
    assert ipex.decode_window(_layer(sliding_window=8), _list(None)) == 8


@pytest.mark.parametrize("block", [1, 4])
def test_plan_reads_the_index_list_without_translating(block):
    # two requests: keys at positions 5..10 (slots 25..30) and 0..2 (slots 40..42); allocations keep a
    # token's in-page offset equal to its position's, as the allocators do
    indptr = torch.tensor([0, 6, 9], dtype=torch.int32)
    indices = torch.tensor([25, 26, 27, 28, 29, 30, 40, 41, 42])
    pos0 = torch.tensor([5, 0])
    lst = KVIndexList(indptr, indices, pos0, 8, 6)
    width = -(-(6 + block - 1) // block)
    plan = intel.plan_list(lst, width, block)
    if block == 1:
        assert plan.table.tolist() == [[25, 26, 27, 28, 29, 30], [40, 41, 42, 0, 0, 0]]
        assert plan.kv_lens.tolist() == [6, 3] and plan.cu_kv.tolist() == [0, 6, 9]
    else:  # from the page of the first listed key: pages 6 (slots 24..27) and 7; 10
        assert plan.table.tolist() == [[6, 7, 0], [10, 0, 0]]
        assert plan.kv_lens.tolist() == [7, 3] and plan.cu_kv.tolist() == [0, 7, 10]
    assert plan.table.dtype == plan.kv_lens.dtype == plan.cu_kv.dtype == torch.int32
    assert plan.max_kv >= int(plan.kv_lens.max())
    graph = intel.GraphTables.alloc(4, 8, 16, (8,), torch.device("cpu"), block)
    planned = intel.plan_list(lst, graph.width(8), block, out=graph)
    assert planned.table.data_ptr() == graph.tables[8].data_ptr()
    assert torch.equal(planned.table[:, :width], plan.table) and torch.equal(planned.kv_lens, plan.kv_lens)


def test_backend_says_why_ipex_is_off():
    h = Harness(TorchCPUBackend, "cpu", ModelGeometry(), size=64, size_swa=32, ipex=False)
    assert h.backend.ipex_reason == "disabled by ipex=False"
    if WHY_NOT is not None:
        assert Harness(TorchCPUBackend, "cpu", ModelGeometry(), size=64, size_swa=32).backend.ipex_reason == WHY_NOT


# ---- the wrappers against the real ops ------------------------------------------------------------------
def _requests(seq_lens, ext_lens, window, slots_total, gen):
    """Index lists over random distinct slots: request b's keys from the first visible one of its first
    query (window) or 0, to seq_len. Returns the list and each request's (slots, positions)."""
    perm = torch.randperm(slots_total - 1, generator=gen) + 1
    indptr, chunks, pos0, per_req, at = [0], [], [], [], 0
    for s, e in zip(seq_lens, ext_lens):
        p0 = max(0, s - e - window + 1) if window else 0
        slots = perm[at:at + s - p0]
        at += s - p0
        chunks.append(slots)
        pos0.append(p0)
        indptr.append(indptr[-1] + s - p0)
        per_req.append((slots, torch.arange(p0, s)))
    lst = KVIndexList(torch.tensor(indptr, dtype=torch.int32), torch.cat(chunks), torch.tensor(pos0), window,
                      max(indptr[i + 1] - indptr[i] for i in range(len(seq_lens))))
    return lst, per_req


def _expected(q, k_buf, v_buf, per_req, ext_lens, seq_lens, scaling, window, cap):
    outs, start = [], 0
    for (slots, kpos), e, s in zip(per_req, ext_lens, seq_lens):
        outs.append(reference.attention(q[start:start + e], k_buf[slots], v_buf[slots], torch.arange(s - e, s), kpos,
                                        scaling, window, cap))
        start += e
    return torch.cat(outs)


CASES = list(itertools.product([torch.float32, torch.bfloat16, torch.float16], [None, 5], [0.0, 3.0]))


@needs_ipex
@pytest.mark.parametrize("dtype, window, cap", CASES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("trimmed", [True, False], ids=["window-list", "full-list"])
def test_decode_wrapper_matches_reference(dtype, window, cap, trimmed):
    gen = torch.Generator().manual_seed(1)
    seq, ext = [9, 3, 1, 40], [1, 1, 1, 1]
    h, kvh, d = 8, 2, 32
    k_buf = torch.randn(256, kvh, d, generator=gen).to(dtype)
    v_buf = torch.randn(256, kvh, d, generator=gen).to(dtype)
    lst, per_req = _requests(seq, ext, window if trimmed else None, 256, gen)
    layer = AttentionLayer(0, h, kvh, d, sliding_window=window, logit_cap=cap)
    q = torch.randn(len(seq), h, d, generator=gen).to(dtype)
    reason = ipex.layer_reason(q, layer, lst, k_buf, v_buf, decode=True)
    if reason is not None:  # the op's TORCH_CHECK: such a layer never reaches it (it falls back)
        assert window and cap and not trimmed and "softcap" in reason
        return
    out = torch.zeros(len(seq), h, d, dtype=dtype)
    ipex.decode(q, k_buf, v_buf, ipex.plan_list(lst, lst.max_len), ipex.head_mapping(h, kvh, q.device), out,
                layer.scaling, ipex.decode_window(layer, lst), cap)
    want = _expected(q, k_buf, v_buf, per_req, ext, seq, layer.scaling, window, cap)
    assert (out.float() - want).abs().max().item() < TOL[dtype] * 10


@needs_ipex
@pytest.mark.parametrize("dtype, window, cap", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_extend_wrapper_matches_reference(dtype, window, cap):
    gen = torch.Generator().manual_seed(2)
    seq, ext = [13, 7, 30, 2], [5, 7, 1, 2]  # with and without prefix, a decode-like row
    h, kvh, d = 4, 2, 16
    k_buf = torch.randn(256, kvh, d, generator=gen).to(dtype)
    v_buf = torch.randn(256, kvh, d, generator=gen).to(dtype)
    lst, per_req = _requests(seq, ext, window, 256, gen)
    layer = AttentionLayer(0, h, kvh, d, sliding_window=window, logit_cap=cap)
    q = torch.randn(sum(ext), h, d, generator=gen).to(dtype)
    assert ipex.layer_reason(q, layer, lst, k_buf, v_buf, decode=False) is None
    qo = torch.tensor([0] + list(itertools.accumulate(ext)), dtype=torch.int32)
    out = torch.zeros(sum(ext), h, d, dtype=dtype)
    ipex.extend(q, k_buf, v_buf, ipex.plan_list(lst, lst.max_len), qo, max(ext), out, layer.scaling, window, cap)
    want = _expected(q, k_buf, v_buf, per_req, ext, seq, layer.scaling, window, cap)
    assert (out.float() - want).abs().max().item() < TOL[dtype] * 10


@needs_ipex
def test_xpu_varlen_call_matches_reference_on_the_cpu_op():
    """hwkv_xpu's call (decode as one-query varlen, window, soft-cap, the plan's tables) on the CPU op, with
    the caches in the CPU layout: only `xpu_caches`' view differs on an Intel GPU."""
    gen = torch.Generator().manual_seed(3)
    seq, ext = [13, 7, 30], [1, 1, 1]
    k_buf, v_buf = torch.randn(128, 2, 16, generator=gen), torch.randn(128, 2, 16, generator=gen)
    lst, per_req = _requests(seq, ext, 6, 128, gen)
    q = torch.randn(3, 4, 16, generator=gen)
    out = torch.zeros(3, 4, 16)
    intel.varlen(q, k_buf.unsqueeze(2), v_buf.unsqueeze(2), intel.plan_list(lst, lst.max_len),
                torch.arange(4, dtype=torch.int32), 1, out, 0.25, 6, 2.0)
    k_cache, v_cache = intel.xpu_caches(k_buf, v_buf, 4)
    assert k_cache.shape == (32, 4, 2, 16) and k_cache.data_ptr() == k_buf.data_ptr()
    want = _expected(q, k_buf, v_buf, per_req, ext, seq, 0.25, 6, 2.0)
    assert (out - want).abs().max().item() < 1e-4


@needs_ipex
def test_store_runs_reshape_and_cache_exactly_and_leaves_inputs_alone():
    k_buf, v_buf = torch.zeros(64, 2, 16, dtype=torch.bfloat16), torch.zeros(64, 2, 16, dtype=torch.bfloat16)
    k = torch.randn(3, 2, 48).bfloat16()[:, :, :16]  # a strided slice, as of a fused qkv projection
    v = torch.randn(3, 2, 16).bfloat16()
    loc = torch.tensor([5, 9, 17])
    before = (k.clone(), v.clone())
    assert ops._STORE_PRECHECKED["cpu"] is ipex.store_kv_prechecked
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ops.store_kv_prechecked(k_buf, v_buf, loc, k, v)
    assert any("ipex_store_kv" in e.key for e in prof.key_averages())
    assert torch.equal(k_buf[loc], k) and torch.equal(v_buf[loc], v)
    assert int((k_buf != 0).any(-1).any(-1).sum()) == 3
    assert torch.equal(before[0], k) and torch.equal(before[1], v)
    fp8 = torch.zeros(64, 2, 16, dtype=torch.float8_e4m3fn)  # not IPEX's: the torch store, same result
    ops.store_kv_prechecked(fp8, fp8.clone(), loc, k, v, 0.5, 0.5)
    assert torch.equal(fp8.view(torch.uint8)[loc], ops.quantize(k, fp8.dtype, 0.5).view(torch.uint8))


# ---- the backend: which layers IPEX runs, which fall back ----------------------------------------------
def _route(h, monkeypatch):
    """Record (layer_id, mode, took IPEX) for each layer call, and count the real op calls."""
    seen, real = [], {"decode": 0, "extend": 0}
    inner = h.backend._ipex_list

    def spy(q, layer, kv, md, decode):
        lst = inner(q, layer, kv, md, decode)
        seen.append((layer.layer_id, "decode" if decode else "extend", lst is not None))
        return lst

    monkeypatch.setattr(h.backend, "_ipex_list", spy)
    for name in real:
        fn = getattr(ipex, name)

        def counted(*a, __fn=fn, __name=name, **k):
            real[__name] += 1
            return __fn(*a, **k)

        monkeypatch.setattr(ipex, name, counted)
    return seen, real


@needs_ipex
@pytest.mark.parametrize("page_size, dtype", [(1, torch.float32), (4, torch.bfloat16), (16, torch.float16)])
def test_gemma2_like_model_runs_every_layer_on_ipex(page_size, dtype, monkeypatch):
    """SWA + full layers, soft-cap everywhere, GQA: every layer and mode on IPEX, outputs checked against
    the reference after every step (the harness raises past its tolerance), SWA slots released and reused."""
    geom = ModelGeometry(num_layers=4, swa_every=2, window=6, num_heads=8, num_kv_heads=2, head_dim=32,
                         logit_cap=30.0)
    h = Harness(TorchCPUBackend, "cpu", geom, size=1024, size_swa=128 if page_size < 16 else 256,
                page_size=page_size, dtype=dtype, ipex_extend=True)
    assert h.backend.ipex_reason is None
    seen, real = _route(h, monkeypatch)
    run_scenario(h, steps=8, prompt_lens=(5, 9, 14), chunk=4)
    assert seen and all(took for _, _, took in seen)
    assert real["decode"] and real["extend"] and sum(real.values()) == len(seen)


@needs_ipex
def test_layers_with_what_ipex_lacks_fall_back_per_layer(monkeypatch):
    """GPT-OSS-like: sinks on the SWA layers only. Full layers run IPEX, SWA layers the torch kernels,
    in the same forward; W=1 extends fall back too; the reference check covers both paths."""
    geom = ModelGeometry(num_layers=4, swa_every=2, window=6, sinks=False, swa_sinks=True)
    h = Harness(TorchCPUBackend, "cpu", geom, size=512, size_swa=64, ipex_extend=True)
    seen, real = _route(h, monkeypatch)
    run_scenario(h, steps=6, prompt_lens=(5, 11), chunk=4)
    swa = set(geom.swa_layer_ids)
    assert {took for lid, _, took in seen if lid in swa} == {False}
    assert {took for lid, _, took in seen if lid not in swa} == {True}
    assert sum(real.values()) == sum(took for _, _, took in seen)

    h1 = Harness(TorchCPUBackend, "cpu", ModelGeometry(window=1), size=512, size_swa=64, ipex_extend=True)
    seen1, _ = _route(h1, monkeypatch)
    run_scenario(h1, steps=4, prompt_lens=(5, 3), chunk=2)
    swa1 = set(h1.g.swa_layer_ids)
    assert {took for lid, mode, took in seen1 if lid in swa1 and mode == "extend"} == {False}
    assert {took for lid, mode, took in seen1 if lid in swa1 and mode == "decode"} == {True}


@needs_ipex
def test_graph_replays_read_only_the_static_ipex_tables(monkeypatch):
    """Graph mode: the tables are refilled into buffers init_graph_state allocated once; the
    capture-checking adapter fails any replay that reads elsewhere, and IPEX runs inside the replays."""
    geom = ModelGeometry(num_layers=2, swa_every=2, window=6, num_heads=4, num_kv_heads=2, head_dim=16)
    h = Harness(TorchCPUBackend, "cpu", geom, size=256, size_swa=64, page_size=2)
    h.enable_graphs([1, 2, 4], CaptureCheckingAdapter())
    tables = {w: t.data_ptr() for w, t in h.backend._graph_tables[0].tables.items()}
    _, real = _route(h, monkeypatch)
    run_scenario(h, steps=5, prompt_lens=(5, 9), chunk=8)
    assert h.runner.replays > 0 and real["decode"] >= h.runner.replays * len(h.layers)
    assert {w: t.data_ptr() for w, t in h.backend._graph_tables[0].tables.items()} == tables
    h.backend.init_graph_state(2, 2)  # a second runner shares them
    assert {w: t.data_ptr() for w, t in h.backend._graph_tables[0].tables.items()} == tables


@needs_ipex
def test_draft_graphs_keep_ipex_tables_per_step(monkeypatch):
    """Multi-step draft graphs: every step has its own IPEX tables (alloc_graph_tables per static buffer
    set), IPEX runs every step of every replay, and each step matches the reference."""
    from hwkv.testing.spec_harness import draft_graphs, draft_steps
    geom = ModelGeometry(num_layers=2, swa_every=2, window=6, num_heads=4, num_kv_heads=2, head_dim=16)
    h = Harness(TorchCPUBackend, "cpu", geom, size=256, size_swa=64, page_size=2)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [5, 9], ForwardMode.EXTEND)
    h.release()
    runner = draft_graphs(h, [1, 2], CaptureCheckingAdapter(), 3)
    _, real = _route(h, monkeypatch)
    for r in range(3):
        draft_steps(h, rids[:1 + r % 2], 3, runner=runner)   # checked against the reference inside
        h.release()
    assert runner.replays == 3 and real["decode"] >= 3 * 3 * len(h.layers)
    ptrs = [{t.data_ptr() for t in g.tables.values()} for g in h.backend._graph_tables]
    assert len(ptrs) == 3 and all(not (a & b) for i, a in enumerate(ptrs) for b in ptrs[i + 1:])


@needs_ipex
def test_decode_like_tree_verify_runs_ipex_decode(monkeypatch):
    """tree_verify="decode", eager: IPEX's paged decode takes the per-token lists (window lists trimmed to
    each token's window), and every draft token matches the reference."""
    from hwkv.testing.spec_harness import tree_verify
    geom = ModelGeometry(num_layers=2, swa_every=2, window=4, num_heads=4, num_kv_heads=2, head_dim=16)
    h = Harness(TorchCPUBackend, "cpu", geom, size=256, size_swa=64, tree_verify="decode")
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [5, 9], ForwardMode.EXTEND)
    seen, real = _route(h, monkeypatch)
    tree_verify(h, rids, [[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3]], [[0, 2], [0, 1, 2, 3]])   # checked inside
    assert real["decode"] == len(h.layers) and real["extend"] == 0, (real, seen)


@needs_ipex
def test_ipex_false_keeps_the_torch_kernels(monkeypatch):
    h = Harness(TorchCPUBackend, "cpu", ModelGeometry(), size=256, size_swa=64, ipex=False)
    _, real = _route(h, monkeypatch)
    rid = h.add_request()
    h.forward([rid], [6], ForwardMode.EXTEND)
    h.forward([rid], [1], ForwardMode.DECODE)
    assert real == {"decode": 0, "extend": 0}


@needs_ipex
def test_extend_stays_on_the_torch_kernels_by_default(monkeypatch):
    """The varlen op is slower than the torch extend over this pool's layout (block_size 1): opt-in only."""
    h = Harness(TorchCPUBackend, "cpu", ModelGeometry(), size=256, size_swa=64)
    _, real = _route(h, monkeypatch)
    rid = h.add_request()
    h.forward([rid], [6], ForwardMode.EXTEND)
    assert real == {"decode": 0, "extend": 0} and "ipex_lists" not in h.backend.forward_metadata.extra
    h.forward([rid], [1], ForwardMode.DECODE)
    assert real == {"decode": len(h.layers), "extend": 0}


# ---- hwkv_intel: the glue both Intel packages share (no IPEX needed) --------------------------------------
def test_cpu_module_re_exports_the_shared_glue_and_xpu_imports_it_from_hwkv_intel():
    for name in ("installed_reason", "load", "IpexOps", "IpexList", "plan_list", "GraphTables"):
        assert getattr(ipex, name) is getattr(intel, name), name
    imports = {n.module for n in ast.walk(ast.parse((ROOT / "hwkv_xpu" / "backend.py").read_text()))
               if isinstance(n, ast.ImportFrom)}
    assert "hwkv_intel" in imports and not any(m.startswith("hwkv_cpu") for m in imports)


def test_core_never_names_ipex_or_hwkv_intel():
    for path in (ROOT / "hwkv").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.startswith(("hwkv_intel", "intel_extension_for_pytorch")) for n in names), path


def test_importing_the_glue_never_imports_ipex():
    """With IPEX blocked, the shared and CPU modules import and the probe answers why (IPEX loads on first use)."""
    code = ("import sys; sys.modules['intel_extension_for_pytorch'] = None\n"
            "import hwkv_intel, hwkv_intel.ipex, hwkv_cpu.ipex, hwkv_cpu.backend\n"
            "print(hwkv_intel.ipex.load()[1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert "intel_extension_for_pytorch is not installed" in out


# ---- hwkv_xpu's opt-in path and the CI job (no IPEX needed) --------------------------------------------
def test_xpu_backend_keeps_triton_unless_asked_and_on_an_intel_gpu():
    pytest.importorskip("triton")
    from hwkv_xpu.backend import XPUBackend

    h = Harness(XPUBackend, "cpu", ModelGeometry(), size=64, size_swa=32)
    assert h.backend.ipex_reason.startswith("off")
    h = Harness(XPUBackend, "cpu", ModelGeometry(), size=64, size_swa=32, ipex=True)
    assert h.backend.ipex_reason == "the pool lives on cpu, not on an Intel GPU"


def test_xpu_layer_reason_keeps_per_call_copies_on_triton():
    q, buf = torch.zeros(1, 4, 64, dtype=torch.bfloat16), torch.zeros(8, 2, 64, dtype=torch.bfloat16)
    layer = AttentionLayer(0, 4, 2, 64, sliding_window=8, logit_cap=30.0)
    assert intel.xpu_layer_reason(q, layer, buf, buf) is None
    assert "fp16/bf16" in intel.xpu_layer_reason(q.float(), layer, buf.float(), buf.float())
    small = torch.zeros(8, 2, 16, dtype=torch.bfloat16)
    assert "64" in intel.xpu_layer_reason(q[..., :16], AttentionLayer(0, 4, 2, 16), small, small)
    assert "sinks" in intel.xpu_layer_reason(q, AttentionLayer(0, 4, 2, 64, sinks=torch.zeros(4)), buf, buf)
    assert "W=1" in intel.xpu_layer_reason(q, AttentionLayer(0, 4, 2, 64, sliding_window=1), buf, buf)


def test_ci_has_a_non_blocking_ipex_job_running_these_tests():
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (pip install pyyaml)")
    job = yaml.safe_load((ROOT / ".github/workflows/ci.yml").read_text())["jobs"]["ipex"]
    runs = "\n".join(str(s.get("run", "")) for s in job["steps"])
    assert '"torch==2.8.*" --index-url https://download.pytorch.org/whl/cpu' in runs
    assert '"intel-extension-for-pytorch==2.8.*"' in runs and ".[cpu,ipex,test]" in runs
    assert "ipex.load()" in runs  # fails the job when IPEX does not load, rather than skipping every test
    assert "pytest -q tests/test_contract_cpu.py tests/test_ipex.py" in runs
    assert job["continue-on-error"] is True
