"""Review 20 (B): the allocator and release entry points refuse arguments of the wrong kind with a typed error
naming the argument (not a bare TypeError / AttributeError / IndexError, not a float count truncated), every pool,
table and row unchanged; and ROCm's AITER int32 lists (XPU's opt-in IPEX plans) are built only for the lists a
layer that takes the fused path reads, none when no layer does."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from hwkv.allocator import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator, same_snapshot
from hwkv.errors import LocError
from hwkv.pool import SWAKVPool
from hwkv.release import release_out_of_window_batch
from hwkv.req_to_token import ReqToTokenPool
from conftest import triton_runs_cpu_tensors

P = 4
pytestmark = pytest.mark.usefixtures("one_thread")


def _setup(make):
    a = make()
    rtt = ReqToTokenPool(4, 64, "cpu")
    loc = a.alloc_extend([0], [20], [0], 20)
    rtt.write(0, 0, loc)
    return a, rtt, int(loc[-1])


def hybrid():
    return SWATokenToKVPoolAllocator(64, 32, P, "cpu", SWAKVPool(64, 32, P, torch.float32, 1, 2, [0], [1], "cpu"))


def plain():
    return PagedTokenToKVPoolAllocator(64, P, "cpu")


def unchanged(a, rtt, call, match):
    before = (a.integrity_snapshot(), rtt.req_to_token.clone(), list(rtt._free))
    with pytest.raises(LocError, match=match):
        call()
    assert same_snapshot(before[0], a.integrity_snapshot())
    assert torch.equal(before[1], rtt.req_to_token) and before[2] == rtt._free
    a.check_integrity()


def f64():
    return torch.zeros(1, dtype=torch.int64)


# ---- 4. allocator -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [hybrid, plain], ids=["hybrid", "plain"])
@pytest.mark.parametrize("immediate", [True, False], ids=["immediate", "deferred"])
def test_alloc_arguments_of_the_wrong_kind_are_typed_refusals(make, immediate):
    a, rtt, last = _setup(make)
    a.immediate = immediate
    T = torch.tensor
    cases = [
        (lambda: a.alloc_decode([21], last), r"last_loc must be a tensor or a sequence of integers, got int 23"),
        (lambda: a.alloc_decode(21, [last]), r"seq_lens must be a tensor or a sequence of integers, got int 21"),
        (lambda: a.alloc_decode(T([21]), None), r"last_loc must be a tensor .* got NoneType None"),
        (lambda: a.alloc_extend([20], [21], last, 1), r"last_loc must be a tensor .* got int 23"),
        (lambda: a.alloc_extend(20, [21], [last], 1), r"prefix_lens must be a tensor .* got int 20"),
        (lambda: a.alloc_extend([20], 21, [last], 1), r"seq_lens must be a tensor .* got int 21"),
        (lambda: a.alloc_extend([20], [21], [last], None), r"extend_num_tokens must be an integer, got NoneType None"),
        (lambda: a.alloc_extend([20], [21], [last], 1.9), r"extend_num_tokens must be an integer, got float 1.9"),
        (lambda: a.alloc_extend([20], [21], [last], "1"), r"extend_num_tokens must be an integer, got str '1'"),
        (lambda: a.alloc_extend([20], [21], [last], True), r"extend_num_tokens must be an integer, got bool True"),
        (lambda: a.alloc_extend([20], [21], [last], 1.0), r"extend_num_tokens must be an integer, got float 1.0"),
    ]
    for call, match in cases:
        unchanged(a, rtt, call, match)
    # integers of other kinds still count
    for n in (np.int64(1), torch.tensor(1)):
        loc = a.alloc_extend([20], [21], [last], n)
        assert loc.numel() == 1 and int(loc[0]) % P == 0  # token 20 starts a new page
        a.free(loc)
        a.check_integrity()


@pytest.mark.parametrize("make", [hybrid, plain], ids=["hybrid", "plain"])
def test_bools_in_host_lists_are_no_integers(make):
    """A Python, numpy or torch bool in a list of lengths or locs is refused (True had read as 1), as torch bool
    tensors are; integers of every kind in a list still count."""
    a, rtt, last = _setup(make)
    cases = [
        (lambda: a.alloc_decode([True], [last]), r"seq_lens must hold integers, got bool True"),
        (lambda: a.alloc_decode([21], [np.bool_(True)]), r"last_loc must hold integers, got bool"),
        (lambda: a.alloc_extend([20], [torch.tensor(True)], [last], 1), r"seq_lens must hold integers, got Tensor"),
        (lambda: a.alloc_extend([False], [21], [last], 1), r"prefix_lens must hold integers, got bool False"),
    ]
    for call, match in cases:
        unchanged(a, rtt, call, match)
    loc = a.alloc_extend([np.int64(20)], [torch.tensor(21)], [last], 1)
    assert loc.numel() == 1


# ---- 4. release ---------------------------------------------------------------------------------------------
def test_release_arguments_of_the_wrong_kind_are_typed_refusals():
    a, rtt, _ = _setup(hybrid)
    r = rtt.req_to_token
    T = torch.tensor
    cases = [
        (lambda: release_out_of_window_batch(a, r, T([0]), [20], f64(), 4),
         r"seq_lens must be a torch.Tensor, got list \[20\]"),
        (lambda: release_out_of_window_batch(a, r, [0], T([20]), f64(), 4),
         r"req_pool_indices must be a torch.Tensor, got list \[0\]"),
        (lambda: release_out_of_window_batch(a, r, [0], T([20]), f64(), 4, by_row=True),
         r"req_pool_indices must be a torch.Tensor, got list \[0\]"),
        (lambda: release_out_of_window_batch(a, r.tolist(), T([0]), T([20]), f64(), 4),
         r"req_to_token must be a torch.Tensor, got list"),
        (lambda: release_out_of_window_batch(a, r.float(), T([0]), T([20]), f64(), 4),
         r"req_to_token must hold integers, got torch.float32"),
        (lambda: release_out_of_window_batch(a, r[0], T([0]), T([20]), f64(), 4),
         r"req_to_token must be 2-D \[rows, max_context_len\], got shape \[64\]"),
        (lambda: release_out_of_window_batch(a, r[0], T([0]), T([20]), torch.zeros(4, dtype=torch.int64), 4,
                                             by_row=True),
         r"req_to_token must be 2-D"),
    ]
    for call, match in cases:
        unchanged(a, rtt, call, match)
    f = f64()
    release_out_of_window_batch(a, r, T([0]), T([20]), f, 4)  # the same call, right kinds: releases
    assert int(f[0]) > 0
    a.check_integrity()


# ---- 5. ROCm / XPU: the fused path's lists only where a layer reads them -------------------------------------
triton = pytest.importorskip("triton", reason="triton is not installed (pip install hwkv[cpu])")

from hwkv import ops  # noqa: E402
from hwkv.graph import EagerAdapter  # noqa: E402
from hwkv.testing.harness import Harness, ModelGeometry, run_scenario  # noqa: E402
from hwkv.testing.vendor_schemas import aiter as aiter_standin  # noqa: E402
from hwkv_rocm import aiter_ops  # noqa: E402
from hwkv_rocm.backend import ROCmBackend  # noqa: E402
from hwkv_xpu.backend import XPUBackend  # noqa: E402

needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="a GPU is present: the device runs cover the kernels")


@pytest.fixture
def standin_aiter(monkeypatch):
    mod = aiter_standin.make_aiter("gfx942")
    monkeypatch.setitem(__import__("sys").modules, "aiter", mod)
    monkeypatch.setattr(aiter_ops, "arch_reason", lambda device: None)
    monkeypatch.setattr(aiter_ops, "gpu_arch", lambda device: "gfx942")
    return mod


class _Lists:
    """The lists a forward's fused-path tables were built for (md.extra[key]) once its layers ran, and the int32
    fills of req_to_token (ROCm's graph refill of the full list)."""

    def __init__(self, monkeypatch, backend_cls, key):
        self.forwards, self.fills = [], 0
        orig_step = Harness.model_step
        fill = ops.fill_kv_indices

        def model_step(h, batch, inputs):
            out = orig_step(h, batch, inputs)
            lists = h.backend.forward_metadata.extra.get(key)
            self.forwards.append(sorted(lists or {}, key=lambda w: -1 if w is None else w))  # the lists built
            return out

        def counting_fill(rtt, rows, pos0, indptr, out):
            self.fills += out.dtype == torch.int32
            fill(rtt, rows, pos0, indptr, out)

        monkeypatch.setattr(Harness, "model_step", model_step)
        monkeypatch.setattr(ops, "fill_kv_indices", counting_fill)


@needs_interpreter
@pytest.mark.interpret
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_rocm_builds_no_int32_list_when_every_layer_runs_triton(standin_aiter, monkeypatch, graph):
    """GPT-OSS style, sinks on every layer: every layer decides Triton, so no forward converts its lists (the
    reviewer's stand-in run: 7 forwards built them, AITER ran 0 times)."""
    seen = _Lists(monkeypatch, ROCmBackend, "aiter_indices")
    g = ModelGeometry(num_layers=2, swa_every=2, window=6, num_heads=4, num_kv_heads=2, head_dim=64, sinks=True)
    h = Harness(ROCmBackend, "cpu", g, size=256, size_swa=64, page_size=2, dtype=torch.float16)
    assert h.backend.aiter is not None, h.backend.aiter_status
    if graph:
        h.enable_graphs([1, 2], EagerAdapter())
    run_scenario(h, steps=4, prompt_lens=(3, 9), chunk=8)
    assert sum(aiter_standin.calls(standin_aiter).values()) == 0
    assert seen.forwards and all(f == [] for f in seen.forwards), seen.forwards
    assert seen.fills == 0


@needs_interpreter
@pytest.mark.interpret
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_rocm_converts_only_the_lists_aiter_layers_read(standin_aiter, monkeypatch, graph):
    """Sinks on the SWA layer only: the full layer runs AITER and its list is converted; the window's never is."""
    seen = _Lists(monkeypatch, ROCmBackend, "aiter_indices")
    g = ModelGeometry(num_layers=2, swa_every=2, window=6, num_heads=4, num_kv_heads=2, head_dim=64, sinks=False,
                      swa_sinks=True)
    h = Harness(ROCmBackend, "cpu", g, size=256, size_swa=64, page_size=2, dtype=torch.float16)
    if graph:
        h.enable_graphs([1, 2], EagerAdapter())
    run_scenario(h, steps=4, prompt_lens=(3, 9), chunk=8)   # every output checked against the reference
    calls = aiter_standin.calls(standin_aiter)
    assert calls["paged_attention_ragged"] >= 4 and calls["mha_batch_prefill_func"] >= 2
    assert seen.forwards and all(f == [None] for f in seen.forwards), seen.forwards
    if graph:
        assert seen.fills >= 4, "each decode replay refills the full list's int32 twin"


@pytest.mark.interpret
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("fits", [None, "full"], ids=["no-layer-fits", "full-layers-fit"])
def test_xpu_builds_ipex_plans_only_for_lists_ipex_layers_read(monkeypatch, graph, fits):
    """XPUBackend(ipex=True) had planned IPEX tables for every list of every forward, whichever layer would read
    them. IPEX is stood in for (no Intel GPU here): its reason is cleared, the layer check says which layers fit,
    and the varlen call records the plan it was handed. The layers IPEX does not take run the Triton kernels over CPU
    tensors: Triton's interpreter only."""
    triton_runs_cpu_tensors()
    from hwkv_intel import ipex
    planned, ran = [], []
    plan = ipex.plan_list

    def counting_plan(kv, *a, **k):
        planned.append(kv.window)
        return plan(kv, *a, **k)

    monkeypatch.setattr(ipex, "plan_list", counting_plan)
    monkeypatch.setattr(ipex, "xpu_layer_reason",
                        lambda q, layer, k, v: None if fits and layer.window is None else "stand-in: Triton")
    monkeypatch.setattr(ipex, "xpu_caches", lambda k, v, p: (k, v))
    monkeypatch.setattr(ipex, "varlen", lambda q, k, v, lst, *a: ran.append(lst))
    seen = _Lists(monkeypatch, XPUBackend, "ipex_xpu_lists")
    h = Harness(XPUBackend, "cpu", ModelGeometry(), size=128, size_swa=64, page_size=2, ipex=True)
    h.backend.ipex_reason = None  # as on an Intel GPU with IPEX
    if graph:
        h.enable_graphs([1, 2], EagerAdapter())
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [5, 7], check=fits is None)
    h.release()
    for _ in range(3):
        h.forward(rids, [1, 1], check=fits is None)
        h.release()
    if fits is None:
        assert planned == [] and ran == [] and all(f == [] for f in seen.forwards), (planned, seen.forwards)
    else:
        assert set(planned) == {None} and ran and all(f == [None] for f in seen.forwards), (planned, seen.forwards)
        assert len(ran) == 2 * len(seen.forwards)  # both full layers of every forward ran IPEX ...
        if not graph:
            assert len(planned) == len(seen.forwards)  # ... over one plan per forward
