"""Review 34 (pools and page operations): defects found in `hwkv/pool.py`, `hwkv/torch_page_ops.py`, `hwkv/release.py`,
`hwkv/pages.py` and the allocator entry points they serve, each shown by a test that fails on the code as reviewed.

The Triton page-op kernels run on CPU tensors under TRITON_INTERPRET=1 (conftest's `triton_page_ops_on_cpu`), as the
other differential tests run them.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import hwkv.pages  # noqa: E402
from conftest import triton_page_ops_on_cpu  # noqa: E402
from hwkv.allocator import SWATokenToKVPoolAllocator, same_snapshot  # noqa: E402
from hwkv.errors import HwkvError, LocError  # noqa: E402
from hwkv.pool import SWAKVPool  # noqa: E402
from hwkv.release import release_out_of_window_batch  # noqa: E402
from hwkv.torch_page_ops import TORCH_OPS, TorchPageOps  # noqa: E402

I64 = torch.int64
P = 4


def hybrid(pages=8, swa_pages=8, page=P):
    """An SWAKVPool (layer 0 full, layer 1 SWA; K/V [*, 1, 2]) and its allocator on the CPU."""
    pool = SWAKVPool(pages * page, swa_pages * page, page, torch.float32, 1, 2, [1], [0], "cpu")
    return pool, SWATokenToKVPoolAllocator(pages * page, swa_pages * page, page, "cpu", pool)


def two_requests(ops, rtt_dtype=I64):
    """A deferred-check allocator (what accelerators run) on `ops` (None: the torch page ops), with requests of 20
    and 12 tokens in rows 0 and 1 of a [3, 32] req_to_token of `rtt_dtype`."""
    a = SWATokenToKVPoolAllocator(64, 64, P, "cpu", None)
    if ops is not None:
        a._ops = a.swa_attn_allocator._ops = ops
    a.immediate = False
    rtt = torch.zeros(3, 32, dtype=I64)
    for row, n in ((0, 20), (1, 12)):
        rtt[row, :n] = a.alloc_extend([0], [n], [0], n)
    return a, rtt.to(rtt_dtype)


def ring_state(a):
    """What a release changes, comparable across implementations (free pages as a multiset: ring order is
    unspecified between torch and Triton), plus the error record."""
    return [(r.head, int(r.tail[0]), sorted(r.free_list().tolist()), r.refs.tolist(), r.pending())
            for r in a._rings()] + [a.full_to_swa_index_mapping.tolist()]


# ---- 1. translate into out= of a -1 loc -----------------------------------------------------------------------------
@pytest.mark.parametrize("cap", [2, 4], ids=["out-exact", "out-longer"])
def test_translate_into_out_maps_minus_one_as_the_gather_and_the_refill_kernel_do(cap):
    """`SWAKVPool.translate_loc_from_full_to_swa` admits -1 ("no loc": `check_loc(..., low=-1)`, mapping[-1] == -1)
    and without out= returns -1 for it. With out= the torch path (`torch.index_select` / `ops.translate_into`, every
    device without refill kernels, the CPU included) raises a bare IndexError instead, after writing out[:1]; the
    Triton `refill.translate_into` maps it to -1. Right: out[:2] = [swa(loc0), -1], out[2:] zeroed, as the gather
    and the kernel give."""
    pool, a = hybrid()
    loc = a.alloc_extend([0], [6], [0], 6)
    q = torch.tensor([int(loc[0]), -1])
    want = pool.translate_loc_from_full_to_swa(q)
    assert want.tolist() == [int(pool.full_to_swa_index_mapping[loc[0]]), -1]
    out = torch.full((cap,), 7, dtype=I64)
    got = pool.translate_loc_from_full_to_swa(q, out=out)
    assert got.tolist() == want.tolist()
    assert out.tolist() == want.tolist() + [0] * (cap - 2)


# ---- 2. the torch release over an int32 req_to_token ----------------------------------------------------------------
def test_torch_release_reads_an_int32_req_to_token_as_the_triton_kernel_does():
    """`release_out_of_window_batch` takes any integer req_to_token (`check_int_dtype`; SGLang's is int32). The Triton
    kernel and the host path release from an int32 table; the torch page ops in deferred mode (devices without page
    kernels, e.g. NPU) raise a bare RuntimeError ("value cannot be converted to type int without overflow"):
    `TorchPageOps.release_window` keeps the gathered locs int32 and `_record` subtracts them from int64 keys clamped
    to PAGE_LO = -2**32. Right: the same release as the Triton kernel (frontiers, rings, table)."""
    tri_a, tri_rtt = two_requests(triton_page_ops_on_cpu(), torch.int32)
    ref_a, ref_rtt = two_requests(None, torch.int32)
    results = []
    for a, rtt in ((tri_a, tri_rtt), (ref_a, ref_rtt)):
        f = torch.zeros(2, dtype=I64)
        release_out_of_window_batch(a, rtt, torch.tensor([0, 1]), torch.tensor([20, 12]), f, 4)
        results.append((f.tolist(), ring_state(a)))
    assert results[0][0] == [12, 4]
    assert results[1] == results[0]


# ---- 3. rows / lengths of shape [bs, 1] -----------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["seq_lens", "req_pool_indices"])
def test_release_with_column_shaped_rows_or_lengths_is_refused_or_released_alike(which):
    """The release checks only the entry count of req_pool_indices and seq_lens, so a [bs, 1] column passes. The
    Triton kernel and the CPU host path read it flat and release; the torch page ops crash with a bare IndexError
    (`_owners` / `index_select` get a 2-D index). Right: one behaviour for every implementation: a typed refusal
    naming the shape before anything changes, or the release the kernel makes. The fix refuses it (LocError)."""
    kw = dict(req_pool_indices=torch.tensor([0, 1]), seq_lens=torch.tensor([20, 12]))
    kw[which] = kw[which].view(2, 1)
    for ops in (triton_page_ops_on_cpu(), None):   # the Triton kernels and the torch ops: refused alike
        a, rtt = two_requests(ops)
        before, f = a.integrity_snapshot(), torch.zeros(2, dtype=I64)
        with pytest.raises(LocError, match=rf"{which} must be 1-D \[bs\], got shape \[2, 1\]"):
            release_out_of_window_batch(a, rtt, frontiers=f, window=4, **kw)
        assert same_snapshot(before, a.integrity_snapshot()) and f.tolist() == [0, 0]


# ---- 4. alloc_decode at page size 1 ---------------------------------------------------------------------------------
@pytest.mark.parametrize("seq", [0, -3])
def test_alloc_decode_at_page_size_one_refuses_lengths_below_one_on_the_cpu(seq):
    """`alloc_decode` refuses a decode length < 1 ("decode seq_lens must be >= 1", LocError) at page size > 1, but at
    page size 1 with a tensor seq_lens and no host copy it skips reading the lengths even on the CPU, where reading
    them costs nothing (the allocator's rule: checks run first on CPU), and allocates a page for token -1 / -4.
    Right: the same LocError at every page size on the CPU, nothing allocated."""
    pool, a = hybrid(page=1)
    before = a.integrity_snapshot()
    with pytest.raises(LocError, match="seq_lens must be >= 1"):
        a.alloc_decode(torch.tensor([seq]), torch.tensor([0]))
    assert same_snapshot(before, a.integrity_snapshot())


# ---- 5. move_kv ---------------------------------------------------------------------------------------------------------
def test_move_kv_from_a_slot_whose_swa_page_was_released_is_refused():
    """`SWAKVPool.move_kv` translates src and dst to SWA slots and moves whatever they map to: a src whose SWA page the
    out-of-window release returned maps to 0, so the SWA layers' K/V at dst silently become the padding slot's
    (the full layers get the right K/V). The docstring only assumes "both ends are mapped". Right: a typed refusal
    (LocError / EvictedSlotError naming the loc) before either group moves, as every other bad loc is refused."""
    pool, a = hybrid(pages=8, swa_pages=4)
    loc = a.alloc_extend([0], [12], [0], 12)
    rtt = torch.zeros(1, 16, dtype=I64)
    rtt[0, :12] = loc
    f = torch.zeros(1, dtype=I64)
    release_out_of_window_batch(a, rtt, torch.tensor([0]), torch.tensor([12]), f, 3)
    assert int(f[0]) == P and int(pool.translate_loc_from_full_to_swa(loc[:1])[0]) == 0  # loc[0]'s SWA released
    for layer in (0, 1):
        for buf in pool.get_kv_buffer(layer):
            buf.copy_(torch.randn_like(buf))
    kv = [b.clone() for layer in (0, 1) for b in pool.get_kv_buffer(layer)]
    with pytest.raises(HwkvError):
        pool.move_kv(loc[:1].clone(), loc[8:9].clone())
    assert all(torch.equal(b, k) for b, k in zip([b for layer in (0, 1) for b in pool.get_kv_buffer(layer)], kv)), \
        "a refused move changed K/V"


def test_move_kv_refuses_a_destination_named_twice():
    """`move_kv(src, dst)` with one dst slot named twice is taken: `index_copy_` with repeated indices keeps one of the
    sources, which one unspecified (torch: nondeterministic on accelerators), so the slot's K/V depend on the
    device. Right: a LocError naming the repeated slot before anything moves (dst are the final positions of
    distinct tokens)."""
    pool, a = hybrid()
    loc = a.alloc_extend([0], [8], [0], 8)
    for layer in (0, 1):
        for buf in pool.get_kv_buffer(layer):
            buf.copy_(torch.randn_like(buf))
    kv = [b.clone() for layer in (0, 1) for b in pool.get_kv_buffer(layer)]
    with pytest.raises(LocError):
        pool.move_kv(loc[:2].clone(), torch.stack([loc[5], loc[5]]))
    assert all(torch.equal(b, k) for b, k in zip([b for layer in (0, 1) for b in pool.get_kv_buffer(layer)], kv))


# ---- 6. refusals that do not name the value or the limit ------------------------------------------------------------
def test_a_deferred_out_of_range_free_names_the_pools_page_limit():
    """A deferred free of a loc outside the pool is raised by the next `available_size()` as "outside the full pool's
    pages [1, n]": a literal n, where the immediate check says "[1, 4]" (`error_for` is not given the page count,
    though `PageRing.raise_pending` has it). Right: the recorded error names the limit, [1, 4]."""
    pool, a = hybrid(pages=4)
    a.alloc_extend([0], [4], [0], 4)
    a.immediate = False
    a.free(torch.tensor([400]))
    with pytest.raises(LocError, match=r"\[1, 4\]"):
        a.available_size()


@pytest.mark.parametrize("what, rows, seq, value", [
    ("length", [0], [40], "40"),
    ("row", [5], [4], "5"),
])
def test_a_refused_release_names_the_bad_value(what, rows, seq, value):
    """`release_out_of_window_batch` refuses a row outside req_to_token or a length past its columns with one message,
    "a request row is outside [0, 2), a length beyond 8 or a frontier negative": it names neither which argument is
    wrong nor the value. Right: the message names the bad value (and its limit), as `check_rows` and the
    frontier checks do."""
    pool, a = hybrid()
    rtt = torch.zeros(2, 8, dtype=I64)
    rtt[0, :4] = a.alloc_extend([0], [4], [0], 4)
    with pytest.raises(LocError) as e:
        release_out_of_window_batch(a, rtt, torch.tensor(rows), torch.tensor(seq), torch.zeros(1, dtype=I64), 2)
    assert value in str(e.value).replace("[0, 2)", "").replace("beyond 8", ""), str(e.value)


# ---- 7. docstring -----------------------------------------------------------------------------------------------------
def test_register_page_ops_docstring_names_the_ops_the_allocator_calls():
    """`hwkv.pages.register_page_ops` tells a device package to supply "alloc_extend, free_pages, release_window"; the
    allocator calls `change_refs` for free/share/free_swa and there is no `free_pages` op (TorchPageOps, TritonPageOps):
    a package following the docstring fails with AttributeError at the first free. Right: the docstring names
    change_refs (and the optional alloc_step)."""
    doc = hwkv.pages.register_page_ops.__doc__
    assert "free_pages" not in doc or hasattr(TorchPageOps, "free_pages"), doc
    assert "change_refs" in doc, doc
    assert TORCH_OPS.change_refs is not None
