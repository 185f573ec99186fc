"""Bad input to the allocators and ReqToTokenPool: a typed error naming the value and the limit, and every
pool, table, ring and request row unchanged (snapshots before and after). CPU, immediate checks unless a
test says deferred (what accelerators run: recorded on the device, raised at the next sync)."""

import pytest
import torch
from conftest import triton_page_ops_on_cpu

from hwkv.allocator import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator, same_snapshot
from hwkv.release import release_out_of_window_batch
from hwkv.req_to_token import ReqToTokenPool
from hwkv.errors import DoubleFreeError, LocError, NotAllocatedError
from hwkv.pool import SWAKVPool

P = 4
I64 = torch.int64


def T(xs, dtype=I64):
    return torch.tensor(xs, dtype=dtype)


def hybrid(size=64, size_swa=64, page=P, immediate=True):
    pool = SWAKVPool(size, size_swa, page, torch.float32, 1, 2, [0], [1], "cpu")
    a = SWATokenToKVPoolAllocator(size, size_swa, page, "cpu", pool)
    a.immediate = immediate
    return a


def plain(size=64, page=P):
    return PagedTokenToKVPoolAllocator(size, page, "cpu")


def unchanged(a, call, exc, match):
    """call() raises exc (message matching) and leaves a's whole state as it was."""
    before = a.integrity_snapshot()
    with pytest.raises(exc, match=match):
        call()
    assert same_snapshot(before, a.integrity_snapshot())
    a.check_integrity()


def continuations(a, last):
    """The two ways to continue a page with last_loc `last`: token 3 of a request (offset 2 expected for last)."""
    return (lambda: a.alloc_extend([3], [4], T([last]), 1), lambda: a.alloc_decode(T([4]), T([last])),
            lambda: a.alloc_decode(T([4]), T([last]), seq_lens_cpu=T([4])), lambda: a.alloc_decode([4], [last]))


# ---- 1. the continuation's last_loc: offset, range, a live page ------------------------------------------
@pytest.mark.parametrize("make", [hybrid, plain], ids=["hybrid", "plain"])
def test_continuation_last_loc_at_the_wrong_in_page_offset_is_refused(make):
    """prefix 3 continues its page at offset 3, so last_loc (token 2) must sit at offset 2: the page's last
    slot (offset 3) would hand out the first slot of the next page, never allocated."""
    a = make()
    loc = a.alloc_extend([0], [4], [0], 4)        # page 1 whole: locs 4..7
    for call in continuations(a, int(loc[-1])):
        unchanged(a, call, LocError, r"last_loc 7 .*offset 3.*offset 2 .*page_size 4")
    assert a.alloc_extend([3], [4], loc[2:3], 1).tolist() == [7]  # the right offset still continues


@pytest.mark.parametrize("make", [hybrid, plain], ids=["hybrid", "plain"])
@pytest.mark.parametrize("last", [10 ** 6, 68, 70, -2, -3, 2])
def test_continuation_last_loc_outside_the_pool_is_refused(make, last):
    """last_loc must name a slot of a pool page [P, size + P): not past the end (a bare IndexError before),
    not negative (numpy wrapped around and handed out a negative loc), not the padding page."""
    a = make()
    a.alloc(64)                                   # every page live
    for call in continuations(a, last):
        unchanged(a, call, LocError, rf"last_loc {last} .*outside .*\[4, 68\)")


@pytest.mark.parametrize("make", [hybrid, plain], ids=["hybrid", "plain"])
def test_continuation_of_a_freed_or_never_allocated_page_is_refused(make):
    a = make()
    loc = a.alloc_extend([0], [2], [0], 2)
    a.free(loc)                                   # page 1 free again
    for call in continuations(a, int(loc[1]) + 1):
        unchanged(a, call, NotAllocatedError, r"last_loc 6 \(request 0\) is on full page 1, which is free")
    for call in continuations(a, 4 * 9 + 2):      # page 9: never allocated
        unchanged(a, call, NotAllocatedError, r"last_loc 38 .* page 9, which is never allocated")


def test_continuation_checks_name_the_request_in_a_batch():
    a = hybrid()
    loc = a.alloc_extend([0, 0], [6, 7], [0, 0], 13)  # pages continue at offsets 2 and 3
    good, bad = int(loc[5]), int(loc[12]) + 1         # request 1's last_loc one slot too far
    unchanged(a, lambda: a.alloc_decode([7, 8], [good, bad]), LocError, rf"last_loc {bad} \(request 1\)")
    unchanged(a, lambda: a.alloc_extend([6, 7], [8, 8], [good, bad], 3), LocError, rf"last_loc {bad} \(request 1\)")
    assert a.alloc_decode([7, 8], [good, bad - 1]).tolist() == [good + 1, bad]


def deferred(ops, make=None):
    """An allocator (hybrid unless `make` builds another) with device-side checks (errors recorded) on the torch
    ops or the Triton kernels."""
    a = (make or hybrid)()
    a.immediate = False
    if ops == "triton":
        a._ops = triton_page_ops_on_cpu()
        if hasattr(a, "swa_attn_allocator"):
            a.swa_attn_allocator._ops = a._ops
    return a


def continue_and_expect_a_record(a, last, call):
    """A request of 3 tokens continues at last_loc `last` (one extend token or one decode step); the op records
    the bad continuation and the next sync raises it."""
    if call == "extend":
        a.alloc_extend([3], [4], T([last]), 1)
    else:
        a.alloc_decode(T([4]), T([last]), seq_lens_cpu=T([4]))
    with pytest.raises(NotAllocatedError, match="the slot after last_loc, on full page"):
        a.available_size()


@pytest.mark.parametrize("ops", ["torch", "triton"])
def test_deferred_continuation_at_a_wrong_offset_or_outside_the_table_is_recorded(ops):
    """Deferred mode (devices): the torch ops and the Triton kernels record a continuation whose last_loc has the
    wrong offset or lies outside the table (no bare IndexError from the table gather, no read past it on a device);
    the next sync raises it."""
    for last, call in ((7, "extend"), (7, "decode"), (-2, "extend"), (-2, "decode"), (10 ** 6, "extend"),
                       (10 ** 6, "decode")):
        a = deferred(ops)
        a.alloc(64)                               # every page live and mapped: only the offset/range is wrong
        continue_and_expect_a_record(a, last, call)
    # an extend that also opens pages runs the full op: the same record
    a = deferred(ops)
    a.alloc(32)
    a.alloc_extend([3], [9], T([7]), 6)
    with pytest.raises(NotAllocatedError, match="the slot after last_loc, on full page"):
        a.available_size()


@pytest.mark.parametrize("ops", ["torch", "triton"])
def test_deferred_continuation_of_the_plain_allocator_is_recorded(ops):
    """The plain allocator's deferred checks (accelerators) record what its immediate ones refuse: a last_loc at
    another in-page offset, on a page it does not hold (free or never allocated), or outside the pool; the next
    sync raises it. They had recorded nothing (only the hybrid allocator's table was consulted)."""
    for last, call in ((7, "extend"), (7, "decode"), (-2, "decode"), (10 ** 6, "extend"), (10 ** 6, "decode"),
                       (38, "extend"), (38, "decode")):
        a = deferred(ops, plain)
        a.alloc_extend([0], [3], T([0]), 3)             # page 1 held (tokens 0-2 at slots 4-6); page 9 never
        continue_and_expect_a_record(a, last, call)
    a = deferred(ops, plain)                              # the right last_loc records nothing
    loc = a.alloc_extend([0], [3], T([0]), 3)
    a.alloc_decode(T([4]), loc[2:3], seq_lens_cpu=T([4]))
    a.alloc_extend([4], [6], loc[2:3] + 1, 2)
    a.available_size()


# ---- 2. a batched release naming one row twice ------------------------------------------------------------
def test_release_naming_a_row_twice_is_refused_even_when_another_holder_keeps_the_pages():
    """Pages also held by a second holder (a prefix cache): dropping them twice for one row stayed within the
    holders and silently took the other holder's SWA reference."""
    a = hybrid(128, 128)
    loc = a.alloc_extend([0], [24], [0], 24)
    a.share(loc)                                  # the cache's reference, SWA included
    rtt = torch.zeros(2, 32, dtype=I64)
    rtt[0, :24] = loc
    f = T([0, 0])
    before = a.integrity_snapshot()
    with pytest.raises(LocError, match=r"request row 0 .*twice"):
        release_out_of_window_batch(a, rtt, T([0, 0]), T([24, 24]), f, 4)
    assert same_snapshot(before, a.integrity_snapshot()) and f.tolist() == [0, 0]
    table = T([0, 0])
    with pytest.raises(LocError, match=r"request row 0 .*twice"):
        release_out_of_window_batch(a, rtt, T([0, 0]), T([24, 24]), table, 4, by_row=True)
    assert same_snapshot(before, a.integrity_snapshot()) and table.tolist() == [0, 0]
    # a row repeated where it releases nothing (a graph bucket's padding) is fine
    release_out_of_window_batch(a, rtt, T([0, 1, 1]), T([24, 1, 1]), T([0, 0, 0]), 4)
    a.check_integrity()


# ---- 3. ReqToTokenPool ------------------------------------------------------------------------------------
def rtt_state(rtt):
    return rtt.req_to_token.clone(), list(rtt._free)


def same_rtt(s1, s2):
    return torch.equal(s1[0], s2[0]) and s1[1] == s2[1]


def test_req_to_token_pool_free_of_one_row_twice_in_a_call_is_a_double_free():
    rtt = ReqToTokenPool(4, 16, "cpu")
    rows = rtt.alloc(2)
    before = rtt_state(rtt)
    with pytest.raises(DoubleFreeError, match=rf"request row {rows[0]} .*twice"):
        rtt.free([rows[0], rows[1], rows[0]])
    assert same_rtt(before, rtt_state(rtt))
    rtt.free(rows)
    rtt.check_integrity()
    assert sorted(rtt.alloc(4)) == [0, 1, 2, 3]


@pytest.mark.parametrize("row", [4, 10 ** 6, -1, -4])
def test_req_to_token_pool_write_checks_the_row(row):
    """A row outside [0, size) is refused before anything is written (-1 must not wrap to the last row)."""
    rtt = ReqToTokenPool(4, 16, "cpu")
    rtt.alloc(4)
    before = rtt_state(rtt)
    with pytest.raises(LocError, match=rf"request row {row} is outside \[0, 4\)"):
        rtt.write(row, 0, T([5, 6]))
    assert same_rtt(before, rtt_state(rtt))
    with pytest.raises(LocError, match=r"start -1"):
        rtt.write(0, -1, T([5]))
    assert same_rtt(before, rtt_state(rtt))
    rtt.write(3, 14, T([5, 6]))
    assert rtt.req_to_token[3, 14:].tolist() == [5, 6]


# ---- 4. float inputs ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("page", [1, 4])
def test_alloc_decode_refuses_float_tensors(page):
    """Float seq_lens / last_loc were cast silently (a last_loc of 6.9 became 6); alloc_extend refuses them."""
    a = hybrid(page=page)
    x = a.alloc_extend([0], [3], [0], 3)
    last = int(x[-1])
    cases = [(T([4.0], torch.float32), T([last]), {}), (T([4]), T([last + 0.9], torch.float64), {}),
             (T([4]), T([last], torch.float16), {"seq_lens_cpu": T([4])}),
             (T([4]), T([last]), {"seq_lens_cpu": T([4.5], torch.float32)}),  # a host copy may not truncate
             ([4], [last + 0.9], {}), ([4.0], [last], {})]
    for seq, lst, kw in cases:
        unchanged(a, lambda: a.alloc_decode(seq, lst, **kw), LocError, r"must hold integers, got")
    unchanged(a, lambda: a.alloc_extend([3], [4], [last + 0.5], 1), LocError, r"must hold integers, got")
    out = a.alloc_decode(T([4]), T([last]))
    assert out.tolist() == [last + 1] or page == 1
    a.check_integrity()
