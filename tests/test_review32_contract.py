"""Review 32: DESIGN.md's contracts probed as an outside user's test would call the public API.

Checked and found to hold (no test here): every public name of DESIGN.md's API block exists with the documented
signature; outputs of the CPU backend and the Triton backend (interpreter) match `hwkv.reference` for page sizes
1/2/4/16, W = 1, W = P, W past the context, head dims 8/20/24/72 (not powers of two), GQA ratios 1, 3, 4 and H,
v_head_dim != head_dim, sinks with soft-cap, bf16/fp16 pools, int32 rows and lengths, two windows in one model,
zero-token requests inside EXTEND/MIXED/DRAFT_EXTEND/TARGET_VERIFY batches, empty batches of every ForwardMode;
strided / expanded / fused-qkv views of q, k, v on the CPU backend (never mutated); a caller's
torch.set_default_device('meta') and default dtype fp16/fp64 around construction and steps; exactly one write-loc
translation and one per window per forward (1 and 4 SWA layers, decode and extend, the dense-table path included);
graph state tail zeroed after smaller replays, metadata holding the [:n] view; GraphRunner replays equal eager
steps (padding, a batch dropping to one request, W = 1, W past the context, odd head dims); an allocator exactly
filled (full or SWA side) refusing the next page with OutOfSlotsError and an unchanged snapshot, reuse after free;
caller tensors of alloc_extend / alloc_decode / release / free unchanged, immediate and deferred checks; the
context-parallel save on a one-rank gloo group with strided and expanded K/V.

Each test below is one defect: it fails on the current code and passes once fixed. CPU tensors, tiny shapes.
"""
from __future__ import annotations

import os
from typing import List

import pytest
import torch

import hwkv
from hwkv.allocator import SWATokenToKVPoolAllocator
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.errors import HwkvError
from hwkv.layer import AttentionLayer
from hwkv.pool import SWAKVPool

pytestmark = pytest.mark.usefixtures("one_thread")

P, H, KVH, D, W = 4, 4, 2, 16, 4
LAYERS = (AttentionLayer(0, H, KVH, D), AttentionLayer(1, H, KVH, D, sliding_window=W))


def _cpu_backend():
    from hwkv_cpu.backend import TorchCPUBackend
    return TorchCPUBackend


def _triton_backend():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":   # (conftest sets it where no GPU is present)
        pytest.skip("the Triton backend on CPU tensors needs TRITON_INTERPRET=1")
    from hwkv_cuda.backend import TritonBackend
    return TritonBackend


BACKENDS = {"cpu": _cpu_backend, "triton-interpret": _triton_backend}


def _setup(backend_cls, prompt: int):
    """One request of `prompt` tokens in a hybrid pool (full layer 0, SWA layer 1), CPU tensors."""
    pool = SWAKVPool(64, 32, P, torch.float32, KVH, D, [1], [0], "cpu")
    alloc = SWATokenToKVPoolAllocator(64, 32, P, "cpu", pool)
    r2t = hwkv.ReqToTokenPool(2, 64, "cpu")
    backend = backend_cls(pool, r2t, sliding_window=W)
    row = r2t.alloc(1)[0]
    loc = alloc.alloc_extend([0], [prompt], [0], prompt)
    r2t.write(row, 0, loc)
    return pool, alloc, r2t, backend, row, loc


def _decode_batch(alloc, r2t, row: int, seq: int) -> ForwardBatch:
    """The next decode step of the request in `row` (now `seq - 1` tokens long)."""
    last = int(r2t.req_to_token[row, seq - 2])
    loc = alloc.alloc_decode([seq], [last])
    r2t.write(row, seq - 1, loc)
    return ForwardBatch(ForwardMode.DECODE, 1, torch.tensor([row], device="cpu"),
                        torch.tensor([seq], device="cpu"), loc)


def _extend_batch(alloc, r2t, row: int, prefix: int, new: int) -> ForwardBatch:
    last = int(r2t.req_to_token[row, prefix - 1])
    loc = alloc.alloc_extend([prefix], [prefix + new], [last], new)
    r2t.write(row, prefix, loc)
    return ForwardBatch(ForwardMode.EXTEND, 1, torch.tensor([row], device="cpu"),
                        torch.tensor([prefix + new], device="cpu"), loc,
                        extend_seq_lens=torch.tensor([new], device="cpu"))


def _buffers(pool) -> List[torch.Tensor]:
    return [t.clone() for g in (pool.full_kv_pool, pool.swa_kv_pool) for t in (*g.k_buffer, *g.v_buffer)]


def _unchanged(before: List[torch.Tensor], pool) -> bool:
    after = [t for g in (pool.full_kv_pool, pool.swa_kv_pool) for t in (*g.k_buffer, *g.v_buffer)]
    return all(torch.equal(a, b) for a, b in zip(before, after))


def _debug_graph(backend_name: str, window: int, buckets: List[int]):
    """A hybrid pool (page 1) with one SWA layer of `window`, its backend in debug mode and a GraphRunner over the
    layer captured for `buckets` (EagerAdapter: CPU tensors): (allocator, rows, backend, the layer's fn, runner)."""
    from hwkv.graph import EagerAdapter, GraphRunner

    pool = SWAKVPool(64, 32, 1, torch.float32, KVH, D, [1], [0], "cpu")
    alloc = SWATokenToKVPoolAllocator(64, 32, 1, "cpu", pool)
    r2t = hwkv.ReqToTokenPool(3, 64, "cpu")
    backend = BACKENDS[backend_name]()(pool, r2t, sliding_window=window, debug=True)
    layer = AttentionLayer(1, H, KVH, D, sliding_window=window)

    def fn(batch, inputs):
        x = inputs["x"]
        return backend.forward(x, x[:, :KVH], x[:, :KVH], layer, batch)

    runner = GraphRunner(backend, fn, buckets, {"x": ((H, D), torch.float32)}, EagerAdapter())
    runner.capture()
    return alloc, r2t, backend, fn, runner


# ---- D1: the Triton backend refuses a strided q after it stored the layer's K/V ----------------------------------
@pytest.mark.parametrize("mode", ["decode", "extend"])
@pytest.mark.parametrize("layer", LAYERS, ids=["full-layer", "swa-layer"])
def test_triton_backend_refuses_a_strided_query_before_it_stores_k_and_v(mode, layer):
    """Wrong: `TritonBackend.forward(q, k, v, layer, batch)` with a q whose last dim is strided (q[..., ::2] of a
    wider tensor, e.g. a rotary output sliced from an interleaved buffer) raises the kernel check's ShapeError
    ("q must have a contiguous last dimension") only after `AttentionBackend.forward` wrote k/v into the pool, so a
    refused layer has overwritten this forward's slots. (tests/test_eager_path.py checks the refusal only with
    save_kv_cache=False, where nothing is stored.)
    Expected: the refusal comes before the store (or the strided q is read, as the CPU backend does): the pool's
    buffers are bit-identical after the typed error.
    DESIGN.md, Contracts: "Bad input raises a typed error from hwkv.errors and leaves pool, allocator and prefix
    cache unchanged"; hwkv/backend.py forward's docstring: "every refusal comes before the store"."""
    pool, alloc, r2t, backend, row, _ = _setup(BACKENDS["triton-interpret"](), 6)
    batch = _decode_batch(alloc, r2t, row, 7) if mode == "decode" else _extend_batch(alloc, r2t, row, 6, 3)
    backend.init_forward_metadata(batch)
    t = batch.num_tokens
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(t, H, 2 * D, generator=g, device="cpu")[..., ::2]   # last-dim stride 2
    k = torch.randn(t, KVH, D, generator=g, device="cpu")
    v = torch.randn(t, KVH, D, generator=g, device="cpu")
    before = _buffers(pool)
    try:
        backend.forward(q, k, v, layer, batch)
    except HwkvError:
        assert _unchanged(before, pool), "the refused forward wrote its K/V into the pool before refusing q"
    # (a backend that reads the strided q, as the CPU backend does, passes too)


# ---- D2: req_to_token slots outside the pool reach the kernels, after the store ----------------------------------
@pytest.mark.parametrize("bad", [-1, 10 ** 6], ids=["minus-one", "past-the-pool"])
@pytest.mark.parametrize("backend_name", sorted(BACKENDS))
def test_a_history_slot_outside_the_pool_is_refused_typed_before_any_layer_stores(backend_name, bad):
    """Wrong: a request row whose history holds a slot outside the pool (-1, the table's "no loc" value that
    `translate_loc_from_full_to_swa` accepts, or a slot past it) passes `init_forward_metadata`: only the window
    lists are value-checked there (by their translation), the full list never. The full-attention layer then stores
    its K/V and its kernel meets the slot: the CPU backend raises a bare IndexError ("index out of range in self",
    hwkv_cpu/kernels_dense.py index_select), the Triton backend a LocError from its CSR check; both after the store,
    so the pool has changed.
    Expected: on CPU tensors (values checkable without a device read) the metadata step refuses the list with a
    typed hwkv error (LocError naming the slot and the pool's range) before any layer writes; the pool unchanged.
    DESIGN.md, Contracts: "Bad input raises a typed error from hwkv.errors and leaves pool, allocator and prefix cache
    unchanged"; docs/architecture.md: checks read "tensor values on CPU tensors (no device read)"."""
    pool, alloc, r2t, backend, row, _ = _setup(BACKENDS[backend_name](), 20)
    r2t.write(row, 0, torch.tensor([bad], device="cpu"))   # position 0: outside every window of the next step
    batch = _decode_batch(alloc, r2t, row, 21)
    before = _buffers(pool)
    q = torch.randn(1, H, D, device="cpu")
    k = torch.randn(1, KVH, D, device="cpu")
    with pytest.raises(HwkvError):
        backend.init_forward_metadata(batch)
        for layer in LAYERS:
            backend.forward(q, k, k, layer, batch)
    assert _unchanged(before, pool), "a layer stored its K/V before the bad history slot was refused"


# ---- D3: debug mode's EvictedSlotError is eager-only: graph refills alias the padding slot silently --------------
@pytest.mark.parametrize("backend_name", sorted(BACKENDS))
def test_debug_mode_refuses_an_evicted_in_window_token_in_graph_mode_too(backend_name):
    """Wrong: with debug on (`debug=True`, as HWKV_DEBUG=1 sets it), an in-window token whose SWA slot was released
    is an EvictedSlotError in the eager metadata step only (`_check_not_evicted` in backend.py's `_csr_list` /
    `_table_list(s)`); the graph refill (`init_forward_metadata_graph` -> `_refill_torch` / `_refill_fused`, what
    `GraphRunner.run` calls before each replay) translates the same list to SWA slot 0 and the SWA layer reads the
    padding slot's K/V in the key's place, silently. The refill here runs on the host (CPU tensors, EagerAdapter),
    where reading the list costs no device sync.
    Expected: the same EvictedSlotError naming the window, before the layers run (graph refills outside a capture
    can read the list in debug mode, as `values_checkable` allows).
    DESIGN.md, Lessons: "An evicted token translates to 0 and silently aliases the padding slot. hwkv's debug mode
    (`HWKV_DEBUG=1`) makes that an error"; Contracts: translation "for every forward mode, eager and graph"."""
    from hwkv.errors import EvictedSlotError

    alloc, r2t, backend, _, runner = _debug_graph(backend_name, 8, [1])
    row = r2t.alloc(1)[0]
    loc = alloc.alloc_extend([0], [6], [0], 6)
    r2t.write(row, 0, loc)
    alloc.free_swa(loc[4:5].clone())          # wrongly release an in-window token (the next query sees keys 0..6)
    batch = _decode_batch(alloc, r2t, row, 7)
    x = torch.randn(1, H, D, device="cpu")
    with pytest.raises(EvictedSlotError, match=r"W=8"):
        backend.init_forward_metadata(batch)   # eager: refused (holds today)
    with pytest.raises(EvictedSlotError, match=r"W=8"):
        runner.run(batch, {"x": x})
