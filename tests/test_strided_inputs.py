"""Strided views and int32 index lists where the Triton kernels read with unit stride or in 32 bits (CPU, under
TRITON_INTERPRET=1 as the other kernel tests run).

- A write loc that is a strided 1-D view (`locs[:, 0]`) is refused (LocError naming its stride) by the shared check
  every store path takes (the public `store_kv`, the pool's `check_write_loc` / `set_kv_buffer`, `KVWriteLoc`, the
  backend's metadata step); the Triton store had written K/V into the wrong slots. Nothing changes.
- Sinks that are a strided view are refused at `AttentionLayer` construction (ConfigError), and the planned
  per-layer calls of every layer of a plan compare the sinks' layout (a strided one reassigned later takes the
  checked call: ShapeError), where only the first layer of a plan had been checked.
- Eager metadata through the fused refill kernels gives the torch path's lists for a batch whose tensors are strided
  views; the refill kernels refuse strided 1-D inputs (ShapeError) before reading anything.
- Key slots of the decode and extend kernels are 64-bit wherever the pools' element offsets do not fit int32, so an
  int32 index list never wraps (>= 2**31 pool elements); int32 and int64 lists give the same outputs.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

import hwkv  # noqa: E402
from hwkv import ops  # noqa: E402
from hwkv.batch import ForwardBatch, ForwardMode  # noqa: E402
from hwkv.errors import ConfigError, LocError, ShapeError  # noqa: E402
from hwkv.loc import KVWriteLoc  # noqa: E402
from hwkv.pool import MHATokenToKVPool  # noqa: E402
from hwkv.testing.harness import Harness, ModelGeometry  # noqa: E402
from hwkv.testing.reference_backend import ReferenceBackend  # noqa: E402
import hwkv_cuda.kernels as kernels  # noqa: E402
from hwkv_cuda.backend import TritonBackend  # noqa: E402
from hwkv_cuda.kernels import decode as triton_decode  # noqa: E402
from hwkv_cuda.kernels import extend as triton_extend  # noqa: E402
from hwkv_cuda.kernels import fill_kv_indices, refill  # noqa: E402

pytestmark = [pytest.mark.interpret, pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the Triton kernels run on CPU tensors only under the interpreter")]

H, KVH, D = 4, 2, 8
I32, I64 = torch.int32, torch.int64


def strided(t: torch.Tensor, junk: int = -99) -> torch.Tensor:
    """The same values as a stride-2 view whose gaps hold `junk` (a unit-stride read sees it)."""
    view = torch.stack([t, torch.full_like(t, junk)], 1)[:, 0]
    assert torch.equal(view, t) and (t.shape[0] < 2 or view.stride() == (2,))
    return view


@pytest.fixture
def triton_store(monkeypatch):
    """The Triton store registered for CPU tensors, as hwkv_cuda registers it for cuda."""
    monkeypatch.setitem(ops._STORE, "cpu", kernels.store_kv)
    monkeypatch.setitem(ops._STORE_PRECHECKED, "cpu", kernels.store_kv_prechecked)


# ---- 1. strided write locs -------------------------------------------------------------------------------------
def test_the_triton_store_refuses_a_strided_loc_and_writes_nothing():
    k_buf, v_buf = torch.zeros(100, KVH, D), torch.zeros(100, KVH, D)
    k, v = torch.randn(4, KVH, D), torch.randn(4, KVH, D)
    loc = strided(torch.tensor([3, 7, 11, 15]), junk=90)
    with pytest.raises(LocError, match=r"loc has stride 2; .*stride 1"):
        kernels.store_kv(k_buf, v_buf, loc, k, v)
    assert not k_buf.any() and not v_buf.any()
    kernels.store_kv(k_buf, v_buf, loc.contiguous(), k, v)         # the same slots, contiguous: written
    assert torch.equal(k_buf[[3, 7, 11, 15]], k) and torch.equal(v_buf[[3, 7, 11, 15]], v)
    kernels.store_kv(k_buf, v_buf, torch.tensor([5, 6])[::2], k[:1], v[:1])   # one entry: its stride is no matter
    assert torch.equal(k_buf[5], k[0])


def test_the_pool_refuses_a_strided_loc_before_any_write(triton_store):
    pool = MHATokenToKVPool(96, 1, torch.float32, KVH, D, 1, "cpu")
    layer = hwkv.AttentionLayer(0, H, KVH, D)
    k = torch.randn(4, KVH, D)
    loc = strided(torch.tensor([3, 7, 11, 15]), junk=90)
    before = [b.clone() for b in (*pool.k_buffer, *pool.v_buffer)]
    for call in (lambda: pool.check_write_loc(loc), lambda: pool.set_kv_buffer(layer, loc, k, k),
                 lambda: KVWriteLoc(loc)):
        with pytest.raises(LocError, match=r"loc has stride 2; .*stride 1"):
            call()
    assert all(torch.equal(a, b) for a, b in zip(before, (*pool.k_buffer, *pool.v_buffer)))
    pool.set_kv_buffer(layer, loc.contiguous(), k, k)
    assert pool.k_buffer[0].abs().sum((1, 2)).nonzero().flatten().tolist() == [3, 7, 11, 15]


def test_a_batch_with_strided_write_locs_is_refused_before_anything_changes(triton_store):
    pool = hwkv.pool.SWAKVPool(64, 32, 1, torch.float32, KVH, D, [0], [1], "cpu")
    alloc = hwkv.allocator.SWATokenToKVPoolAllocator(64, 32, 1, "cpu", pool)
    rtt = hwkv.ReqToTokenPool(size=4, max_context_len=32, device="cpu")
    backend = TritonBackend(pool, rtt, sliding_window=4)
    loc = alloc.alloc(3)
    rtt.req_to_token[:3, 0] = loc
    batch = ForwardBatch(ForwardMode.DECODE, 3, torch.arange(3), torch.ones(3, dtype=I64), strided(loc))
    before = ([b.clone() for sub in (pool.full_kv_pool, pool.swa_kv_pool) for b in (*sub.k_buffer, *sub.v_buffer)],
              pool.full_to_swa_index_mapping.clone(), rtt.req_to_token.clone(), alloc.full_available_size(),
              alloc.swa_available_size())
    with pytest.raises(LocError, match=r"loc has stride 2; .*stride 1"):
        backend.init_forward_metadata(batch)
    after = ([b for sub in (pool.full_kv_pool, pool.swa_kv_pool) for b in (*sub.k_buffer, *sub.v_buffer)],
             pool.full_to_swa_index_mapping, rtt.req_to_token, alloc.full_available_size(), alloc.swa_available_size())
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    assert torch.equal(before[1], after[1]) and torch.equal(before[2], after[2]) and before[3:] == after[3:]
    alloc.check_integrity()


# ---- 2. strided sinks ------------------------------------------------------------------------------------------
def test_strided_sinks_are_refused_at_layer_construction():
    table = torch.randn(H, 2)                                      # every layer's sinks, one column each
    with pytest.raises(ConfigError, match=r"sinks has strides \(2,\); .*contiguous"):
        hwkv.AttentionLayer(1, H, KVH, D, sinks=table[:, 0])
    assert hwkv.AttentionLayer(1, H, KVH, D, sinks=table[:, 0].contiguous()).sinks.is_contiguous()
    assert hwkv.AttentionLayer(1, 1, 1, D, sinks=table[:1, 0]).sinks.shape == (1,)   # one head: any stride


def _two_layer_run(sinks_after, mode):
    """Layer 0 (no sinks) plans the forward's launch, layer 1 (contiguous sinks, then `sinks_after` assigned) runs
    under that plan: layer 1's output."""
    g = torch.Generator().manual_seed(0)
    pool = MHATokenToKVPool(128, 1, torch.float32, KVH, D, 2, "cpu")
    rtt = hwkv.ReqToTokenPool(4, 64, "cpu")
    be = TritonBackend(pool, rtt)
    lens = (10, 7)
    rtt.req_to_token[0, :10] = torch.arange(1, 11)
    rtt.req_to_token[1, :7] = torch.arange(11, 18)
    for i in range(2):
        pool.k_buffer[i].copy_(torch.randn(pool.k_buffer[i].shape, generator=g))
        pool.v_buffer[i].copy_(torch.randn(pool.v_buffer[i].shape, generator=g))
    seq, rows = torch.tensor(lens), torch.arange(2)
    loc = rtt.req_to_token[rows, seq - 1].clone()
    if mode == "decode":
        batch = ForwardBatch(ForwardMode.DECODE, 2, rows, seq, loc, seq_lens_cpu=seq.clone())
    else:
        ones = torch.ones(2, dtype=I64)
        batch = ForwardBatch(ForwardMode.EXTEND, 2, rows, seq, loc, seq - 1, ones, seq_lens_cpu=seq.clone(),
                             extend_seq_lens_cpu=ones)
    q, k, v = (torch.randn(2, n, D, generator=g) for n in (H, KVH, KVH))
    be.init_forward_metadata(batch)
    l0 = hwkv.AttentionLayer(0, H, KVH, D)
    l1 = hwkv.AttentionLayer(1, H, KVH, D, sinks=sinks_after.contiguous())
    be.forward(q, k, v, l0, batch)
    l1.sinks = sinks_after
    return be.forward(q, k, v, l1, batch).clone()


@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_every_layer_of_a_plan_refuses_strided_sinks(mode):
    """Only a plan's first layer had been checked: a later layer's strided sinks were read as contiguous."""
    table = torch.tensor([[0.5, -3.0], [2.0, 9.0], [-1.0, 4.0], [3.0, -2.0]])
    want = _two_layer_run(table[:, 0].contiguous(), mode)
    assert want.isfinite().all()
    with pytest.raises(ShapeError, match=r"layer 1: sinks have strides \(2,\); they must be contiguous"):
        _two_layer_run(table[:, 0], mode)


@pytest.mark.parametrize("mode", ["decode", "extend"])
@pytest.mark.parametrize("bad", ["strided", "short", "square"])
def test_sinks_reassigned_after_construction_are_refused_before_the_store(mode, bad):
    """A layer's sinks replaced after construction (strided, or of the wrong shape: the dense CPU path had raised a
    bare view error for [5] and run with [2, 2]) are refused by the template before the layer's K/V write."""
    g = torch.Generator().manual_seed(1)
    pool = MHATokenToKVPool(128, 1, torch.float32, KVH, D, 1, "cpu")
    rtt = hwkv.ReqToTokenPool(4, 64, "cpu")
    be = TritonBackend(pool, rtt)
    seq, rows = torch.tensor([5, 3]), torch.arange(2)
    rtt.req_to_token[0, :5] = torch.arange(1, 6)
    rtt.req_to_token[1, :3] = torch.arange(6, 9)
    loc = rtt.req_to_token[rows, seq - 1].clone()
    ones = torch.ones(2, dtype=I64)
    batch = (ForwardBatch(ForwardMode.DECODE, 2, rows, seq, loc, seq_lens_cpu=seq.clone()) if mode == "decode" else
             ForwardBatch(ForwardMode.EXTEND, 2, rows, seq, loc, seq - 1, ones, seq_lens_cpu=seq.clone(),
                          extend_seq_lens_cpu=ones))
    layer = hwkv.AttentionLayer(0, H, KVH, D, sinks=torch.zeros(H))
    layer.sinks = {"strided": torch.randn(H, 2, generator=g)[:, 0], "short": torch.zeros(H + 1),
                   "square": torch.zeros(2, H // 2)}[bad]
    before = [b.clone() for b in pool.k_buffer + pool.v_buffer]
    q, k, v = (torch.randn(2, n, D, generator=g) for n in (H, KVH, KVH))
    be.init_forward_metadata(batch)
    with pytest.raises(ShapeError, match="layer 0: sinks have " + ("strides" if bad == "strided" else "shape")):
        be.forward(q, k, v, layer, batch)
    assert all(torch.equal(a, b) for a, b in zip(before, pool.k_buffer + pool.v_buffer))


# ---- 3. strided batch tensors through the fused refill -----------------------------------------------------------
W = 8


def _harness():
    h = Harness(ReferenceBackend, geometry=ModelGeometry(num_layers=2, swa_every=2, window=W), size=1024,
                size_swa=128, page_size=1, max_reqs=12, max_context_len=128)
    h.backend = ReferenceBackend(h.pool, h.rtt, sliding_window=[W, 3])
    return h


def _strided_batch(b: ForwardBatch) -> ForwardBatch:
    ext = None if b.extend_seq_lens is None else strided(b.extend_seq_lens, junk=5)
    pre = None if b.extend_prefix_lens is None else strided(b.extend_prefix_lens, junk=5)
    return ForwardBatch(b.forward_mode, b.batch_size, strided(b.req_pool_indices, junk=0),
                        strided(b.seq_lens, junk=50), b.out_cache_loc, pre, ext,
                        seq_lens_cpu=b.seq_lens_cpu, extend_seq_lens_cpu=b.extend_seq_lens_cpu)


def _lists(md):
    out = [md.q_pos0, md.qo_indptr, md.swa_out_cache_loc]
    for kv in [md.full] + [md.windows[w] for w in sorted(md.windows)]:
        n = int(kv.indptr[-1])
        out += [kv.indptr, kv.pos0, kv.indices[:n]]
    return [t.tolist() for t in out]


@pytest.mark.parametrize("kernels_", [refill.KERNELS, ops.GraphRefillKernels(refill.translate_into,
                                                                               refill.translate_runs,
                                                                               refill.fill_lists)],
                         ids=["fill_translated", "separate"])
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND], ids=["decode", "extend"])
def test_eager_fused_metadata_of_strided_batch_tensors_equals_the_torch_paths(mode, kernels_, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    h = _harness()
    lens = torch.randint(1, 30, (5,), generator=gen).tolist()
    rids = [h.add_request() for _ in lens]
    for rid, n in zip(rids, lens):   # prefilled in chunks of W and released, so SWA slots are reused
        while n:
            h.make_batch([rid], [min(n, W)], ForwardMode.EXTEND)
            h.release()
            n -= min(n, W)
    new = [1] * 5 if mode == ForwardMode.DECODE else torch.randint(1, 7, (5,), generator=gen).tolist()
    batch = h.make_batch(rids, new, mode)
    want = _lists(h.backend.init_forward_metadata(batch))          # the torch path (no kernels for cpu)
    monkeypatch.setitem(ops._REFILL, "cpu", kernels_)
    monkeypatch.setitem(ops._FILL, "cpu", fill_kv_indices)
    assert _lists(h.backend.init_forward_metadata(batch)) == want  # contiguous, fused
    assert _lists(h.backend.init_forward_metadata(_strided_batch(batch))) == want


def test_the_refill_kernels_refuse_strided_inputs_before_reading():
    rtt = torch.arange(40, dtype=I64).view(4, 10)
    rows, seq = torch.tensor([0, 2]), torch.tensor([5, 3])
    outs = dict(lens=torch.full((2,), -7), q_pos0=torch.full((2,), -7), qo_indptr=torch.full((3,), -7, dtype=I32),
                list_indptr=torch.full((1, 3), -7, dtype=I32), list_pos0=torch.full((1, 2), -7),
                full_indices=torch.full((8,), -7))
    before = {k: t.clone() for k, t in outs.items()}
    windows = torch.zeros(1, dtype=I64)
    for name, args in (("req_pool_indices", (strided(rows), seq)), ("seq_lens", (rows, strided(seq)))):
        with pytest.raises(ShapeError, match=f"{name} has stride 2; .*stride 1"):
            refill.fill_lists(rtt, *args, None, windows, *outs.values())
    with pytest.raises(ShapeError, match=r"extend_lens has stride 2"):
        refill.fill_lists(rtt, rows, seq, strided(torch.tensor([1, 1])), windows, *outs.values())
    assert all(torch.equal(before[k], outs[k]) for k in outs)
    mapping, out = torch.arange(40, dtype=I64), torch.full((8,), -7)
    for name, args in (("req_pool_indices", (strided(rows), torch.tensor([0, 0]), torch.tensor([0, 5, 8], dtype=I32))),
                       ("pos0", (rows, strided(torch.tensor([0, 0])), torch.tensor([0, 5, 8], dtype=I32))),
                       ("indptr", (rows, torch.tensor([0, 0]), strided(torch.tensor([0, 5, 8], dtype=I32))))):
        with pytest.raises(ShapeError, match=f"{name} has stride 2"):
            refill.translate_runs(mapping, rtt, *args, out)
    assert (out == -7).all()


# ---- 4. 64-bit key slots ------------------------------------------------------------------------------------------
@triton.jit
def _decode_offsets(idx, out, stride, n, OFF32: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    slot = triton_decode._tile_slots(idx, offs, n, OFF32)
    tl.store(out + offs, slot * stride)


@triton.jit
def _extend_offsets(idx, out, stride, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    slot = triton_extend._key_slots(idx, 0, offs, offs < n, True)
    tl.store(out + offs, slot * stride, mask=offs < n)


@pytest.mark.parametrize("kernel", ["decode", "extend"])
def test_key_slot_offsets_of_an_int32_list_do_not_wrap_past_2_31(kernel):
    """A pool of >= 2**31 elements (OFF32 off) with an int32 list: slot * row stride in 64 bits (it had wrapped)."""
    idx = torch.tensor([3, 2 ** 20, 2 ** 21 + 5, 7], dtype=I32)
    out = torch.zeros(4, dtype=I64)
    if kernel == "decode":
        _decode_offsets[(1,)](idx, out, 4096, 4, OFF32=False, BLOCK=4)
    else:
        _extend_offsets[(1,)](idx, out, 4096, 4, BLOCK=4)
    assert out.tolist() == [int(i) * 4096 for i in idx]


@pytest.mark.parametrize("kernel", ["decode", "extend"])
def test_int32_and_int64_index_lists_give_the_same_output(kernel):
    g = torch.Generator().manual_seed(1)
    k_buf, v_buf = torch.randn(64, KVH, D, generator=g), torch.randn(64, KVH, D, generator=g)
    idx = torch.randperm(63, generator=g)[:30] + 1
    indptr, pos0 = torch.tensor([0, 18, 30], dtype=I32), torch.tensor([0, 0])
    outs = []
    for dtype in (I64, I32):
        if kernel == "decode":
            q, out = torch.randn(2, H, D, generator=torch.Generator().manual_seed(2)), torch.empty(2, H, D)
            kernels.decode_attention(q, k_buf, v_buf, indptr, idx.to(dtype), pos0, torch.tensor([17, 11]), out,
                                     D ** -0.5, sinks=torch.ones(H))
        else:
            q, out = torch.randn(5, H, D, generator=torch.Generator().manual_seed(2)), torch.empty(5, H, D)
            kernels.extend_attention(q, k_buf, v_buf, indptr, idx.to(dtype), pos0, torch.tensor([0, 3, 5], dtype=I32),
                                     torch.tensor([15, 10]), out, 3, D ** -0.5, window=6)
        outs.append(out)
    assert outs[0].isfinite().all() and torch.equal(outs[0], outs[1])
