"""Allocators: equal in-page offsets, long decode in a small SWA pool with release, reuse, errors."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hwkv.allocator import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator, TokenToKVPoolAllocator, same_snapshot
from hwkv.release import release_out_of_window, release_out_of_window_batch
from hwkv.req_to_token import ReqToTokenPool
from hwkv.errors import ConfigError, DoubleFreeError, LocError, NotAllocatedError, OutOfSlotsError
from hwkv.pool import SWAKVPool


def make(size=256, size_swa=32, page=4):
    pool = SWAKVPool(size, size_swa, page, torch.float32, 1, 4, [0], [1], "cpu")
    return pool, SWATokenToKVPoolAllocator(size, size_swa, page, "cpu", pool)


def state(a):
    return (a.full_available_size(), a.swa_available_size(), a.full_to_swa_index_mapping.clone(),
            a.integrity_snapshot())


def same_state(s1, s2):
    return s1[0] == s2[0] and s1[1] == s2[1] and torch.equal(s1[2], s2[2]) and same_snapshot(s1[3], s2[3])


def test_mapping_shape_and_trailing_minus_one():
    _, a = make()
    m = a.full_to_swa_index_mapping
    assert m.shape == (256 + 4 + 1,) and m.dtype == torch.int64 and int(m[-1]) == -1 and int(m[0]) == 0


@pytest.mark.parametrize("page", [1, 4, 16])
def test_equal_in_page_offsets_and_continuation(page):
    _, a = make(512, 128, page)
    loc = a.alloc_extend([0, 0], [5, page + 3], [0, 0], 5 + page + 3)
    swa = a.full_to_swa_index_mapping[loc]
    assert (loc % page == swa % page).all() and (swa > 0).all()
    last = [int(loc[4]), int(loc[-1])]
    more = a.alloc_extend([5, page + 3], [9, page + 4], last, 5)
    assert int(more[0]) == (last[0] + 1 if 5 % page else int(more[0]))
    assert (more % page == a.full_to_swa_index_mapping[more] % page).all()
    a.check_integrity()


@pytest.mark.parametrize("page", [1, 4, 16])
def test_long_decode_in_an_eighth_sized_swa_pool(page):
    """4 requests decode for many windows; SWA never runs out, the full pool keeps every token."""
    size, window, n_req, steps = 2048, 16, 4, 400
    _, a = make(size, size // 8, page)
    rtt = ReqToTokenPool(n_req, 1024, "cpu")
    rows = rtt.alloc(n_req)
    seq = [0] * n_req
    frontier = [0] * n_req
    loc = a.alloc_extend([0] * n_req, [8] * n_req, [0] * n_req, 8 * n_req)
    for i, r in enumerate(rows):
        rtt.write(r, 0, loc[8 * i:8 * i + 8])
        seq[i] = 8
    for _ in range(steps):
        last = [int(rtt.req_to_token[r, s - 1]) for r, s in zip(rows, seq)]
        seq = [s + 1 for s in seq]
        new = a.alloc_decode(seq, last)
        for i, r in enumerate(rows):
            rtt.write(r, seq[i] - 1, new[i:i + 1])
            frontier[i] = release_out_of_window(a, rtt.req_to_token[r], seq[i], frontier[i], window)
        a.check_integrity()
    total = sum(seq)
    assert a.full_available_size() <= size - total  # every token still owns its full slot
    m = a.full_to_swa_index_mapping
    for r, s, f in zip(rows, seq, frontier):
        row = rtt.req_to_token[r, :s]
        assert (m[row[:f]] == 0).all() and (m[row[f:]] > 0).all()
        assert s - f <= window + 2 * page  # only the window plus the margin stays mapped
        assert f >= s - window - 2 * page


def test_reused_swa_slots_map_to_the_new_tokens():
    _, a = make(64, 8, 1)
    first = a.alloc(8)
    old_swa = a.full_to_swa_index_mapping[first].clone()
    a.free_swa(first[:4])
    assert (a.full_to_swa_index_mapping[first[:4]] == 0).all()
    second = a.alloc(4)
    new_swa = a.full_to_swa_index_mapping[second]
    assert sorted(new_swa.tolist()) == sorted(old_swa[:4].tolist())
    assert torch.equal(a.full_to_swa_index_mapping[first[4:]], old_swa[4:])
    a.check_integrity()


def test_release_frontier_is_page_aligned_with_a_page_of_margin():
    _, a = make(256, 64, 4)
    loc = a.alloc_extend([0], [30], [0], 30)
    f = release_out_of_window(a, loc, 30, 0, 8)
    # dead below 30 - 8 + 1 = 23 -> page floor 20, one page margin -> 16
    assert f == 16
    assert (a.full_to_swa_index_mapping[loc[:16]] == 0).all() and (a.full_to_swa_index_mapping[loc[16:]] > 0).all()
    assert release_out_of_window(a, loc, 30, f, 8) == 16  # idempotent
    with pytest.raises(LocError, match="not a multiple"):
        release_out_of_window(a, loc, 30, 3, 8)


def test_out_of_slots_names_need_and_leaves_state():
    _, a = make(64, 8, 4)
    a.alloc(8)
    before = state(a)
    with pytest.raises(OutOfSlotsError, match=r"need 1 pages .* SWA pool, only 0 slots"):
        a.alloc_extend([0], [3], [0], 3)
    assert same_state(before, state(a))


def test_double_free_and_never_allocated_leave_state():
    _, a = make(64, 16, 4)
    loc = a.alloc(8)
    a.free(loc[:4])
    before = state(a)
    with pytest.raises(DoubleFreeError, match="already free"):
        a.free(loc[:4])
    with pytest.raises(NotAllocatedError, match="never allocated"):
        a.free(torch.tensor([40]))
    with pytest.raises(DoubleFreeError, match="already released"):
        a.free_swa(loc[4:8]) or a.free_swa(loc[4:8])
    a.check_integrity()
    assert before[0] == a.full_available_size()


def test_free_swa_error_leaves_state():
    _, a = make(64, 16, 4)
    loc = a.alloc(8)
    a.free_swa(loc[:4])
    before = state(a)
    with pytest.raises(DoubleFreeError):
        a.free_swa(loc)  # first page already released: nothing at all is freed
    assert same_state(before, state(a))


@pytest.mark.parametrize("bad, exc", [(torch.tensor([1.0]), LocError), (torch.tensor([1], dtype=torch.int32), LocError),
                                      (torch.tensor([999]), LocError)])
def test_bad_loc_types_and_ranges(bad, exc):
    _, a = make(64, 16, 4)
    a.alloc(4)
    before = state(a)
    with pytest.raises(exc):
        a.free(bad)
    assert same_state(before, state(a))


def test_extend_arguments_are_checked():
    _, a = make()
    with pytest.raises(LocError, match="extend_num_tokens=5 but"):
        a.alloc_extend([0], [3], [0], 5)
    with pytest.raises(LocError, match="one entry per request"):
        a.alloc_extend([0, 0], [3], [0], 3)
    with pytest.raises(ConfigError, match="multiple of page_size"):
        a.alloc(3)


def test_plain_allocators_and_req_pool():
    t = TokenToKVPoolAllocator(8, "cpu")
    loc = t.alloc(8)
    assert sorted(loc.tolist()) == list(range(1, 9))
    with pytest.raises(OutOfSlotsError):
        t.alloc(1)
    t.free(loc)
    t.check_integrity()
    p = PagedTokenToKVPoolAllocator(16, 4, "cpu")
    d = p.alloc_decode([1, 1], [0, 0])
    assert (d % 4 == 0).all()
    rtt = ReqToTokenPool(2, 8, "cpu")
    assert rtt.req_to_token.dtype == torch.int64 and rtt.req_to_token.shape == (2, 8)
    rows = rtt.alloc(2)
    with pytest.raises(OutOfSlotsError):
        rtt.alloc(1)
    rtt.free(rows[0])
    with pytest.raises(DoubleFreeError):
        rtt.free(rows[0])
    with pytest.raises(LocError, match="max_context_len 8"):
        rtt.write(rows[1], 6, torch.tensor([1, 2, 3]))


@pytest.mark.parametrize("page", [1, 4])
def test_shared_pages_return_only_when_every_holder_let_go(page):
    """A prefix held by a cache and a request: the request's release and free drop only its own
    references; the pages go back when the last holder frees them."""
    _, a = make(256, 64, page)
    loc = a.alloc_extend([0], [4 * page], [0], 4 * page)
    full0, swa0 = a.full_available_size(), a.swa_available_size()
    a.share(loc)                       # the cache takes the same pages (full and SWA)
    a.free_swa(loc[:page])             # the request's release of its first page: the cache still holds it
    assert (a.full_to_swa_index_mapping[loc] > 0).all() and a.swa_available_size() == swa0
    a.free(loc[:page], with_swa=False)  # the request finishes: no SWA reference left on its first page
    a.free(loc[page:])
    a.check_integrity()
    assert (a.full_available_size(), a.swa_available_size()) == (full0, swa0)
    a.free(loc)                         # the cache evicts: now they go back
    a.check_integrity()
    assert a.full_available_size() == 256 and a.swa_available_size() == 64
    with pytest.raises(DoubleFreeError):
        a.share(loc)                    # sharing freed pages is refused, nothing changes
    a.check_integrity()


# ---- issue 21: deferred checks, release over released pages, integrity counts, pool size, frontier, cost ----
def deferred(size=64, size_swa=32, page=4):
    pool, a = make(size, size_swa, page)
    a.immediate = False  # what accelerators run: errors recorded on the device, raised at the next sync
    return pool, a


def test_deferred_mode_on_cpu_records_a_continuation_of_a_released_page():
    """Continuing a partial page whose SWA slots were released: immediate mode raises before any change;
    deferred mode on CPU tensors records it like a device does, and the next sync raises it."""
    for immediate in (True, False):
        _, a = make(64, 32, 4)
        a.immediate = immediate
        loc = a.alloc_extend([0], [6], [0], 6)           # page 2 holds tokens 4, 5
        a.free_swa(loc[4:6])                             # its SWA slots go back: the page cannot be continued
        before = state(a)
        if immediate:
            with pytest.raises(NotAllocatedError, match="no SWA slot"):
                a.alloc_decode([7], [int(loc[5])])
            assert same_state(before, state(a))
        else:
            a.alloc_decode([7], [int(loc[5])])
            with pytest.raises(NotAllocatedError, match=f"full page {int(loc[5]) // 4} .*no SWA slot"):
                a.available_size()
            a.available_size()  # raised once


@pytest.mark.parametrize("immediate", [True, False])
def test_release_over_already_released_pages_is_an_error(immediate):
    """Two rows naming the same pages (one SWA holder) released in one batch: the second drop has no holder.
    Immediate mode raises the typed error before any change; deferred mode records it."""
    _, a = make(256, 64, 4)
    a.immediate = immediate
    loc = a.alloc_extend([0], [32], [0], 32)
    rtt = torch.zeros(2, 64, dtype=torch.int64)
    rtt[0, :32] = rtt[1, :32] = loc
    f = torch.zeros(2, dtype=torch.int64)
    before, f_before = state(a), f.clone()
    if immediate:
        with pytest.raises(DoubleFreeError, match=r"full page \d+ .* 2 times; they have 1 holder"):
            release_out_of_window_batch(a, rtt, torch.tensor([0, 1]), torch.tensor([32, 32]), f, 1)
        assert same_state(before, state(a)) and torch.equal(f, f_before)
    else:
        release_out_of_window_batch(a, rtt, torch.tensor([0, 1]), torch.tensor([32, 32]), f, 1)
        with pytest.raises(DoubleFreeError, match=f"full page {int(loc[0]) // 4} .*already released"):
            a.available_size()
    # a frontier set back over pages its own request released: the same error
    _, b = make(256, 64, 4)
    b.immediate = immediate
    loc = b.alloc_extend([0], [32], [0], 32)
    assert release_out_of_window(b, loc, 32, 0, 1) == 28
    before = state(b)
    with pytest.raises(DoubleFreeError, match="already released"):
        release_out_of_window(b, loc, 32, 0, 1)
        b.available_size()
    if immediate:
        assert same_state(before, state(b))


def test_shared_pages_released_once_per_holder_is_not_an_error():
    _, a = make(256, 64, 4)
    loc = a.alloc_extend([0], [32], [0], 32)
    a.share(loc)                                          # two holders of every page, full and SWA
    rtt = torch.zeros(2, 64, dtype=torch.int64)
    rtt[0, :32] = rtt[1, :32] = loc
    f = torch.zeros(2, dtype=torch.int64)
    swa0 = a.swa_available_size()
    release_out_of_window_batch(a, rtt, torch.tensor([0, 1]), torch.tensor([32, 32]), f, 1)
    assert f.tolist() == [28, 28] and a.swa_available_size() == swa0 + 28
    a.check_integrity()


def test_check_integrity_counts_free_plus_held():
    """A ring whose free count (tail - head) disagrees with the held pages fails the check, in both pools."""
    for ring in ("full", "swa"):
        _, a = make(64, 16, 4)
        a.alloc(16)                                       # every SWA page held, 4 of 16 full pages
        r = a.pages if ring == "full" else a.swa_attn_allocator.pages
        r.tail -= 1                                       # a page lost: neither free nor held
        with pytest.raises(AssertionError, match="free count|free \\+ .* held"):
            a.check_integrity()


def test_allocator_larger_than_its_pool_is_a_config_error():
    pool = SWAKVPool(64, 16, 4, torch.float32, 1, 4, [0], [1], "cpu")
    for size, size_swa, page, what in ((128, 16, 4, "size=128 .*size=64"), (64, 32, 4, "size_swa=32 .*size_swa=16"),
                                      (64, 16, 2, "page_size=2 .*page_size=4")):
        with pytest.raises(ConfigError, match=what):
            SWATokenToKVPoolAllocator(size, size_swa, page, "cpu", pool)
    assert pool.full_to_swa_index_mapping is None        # nothing registered with the pool
    SWATokenToKVPoolAllocator(64, 16, 4, "cpu", pool)     # the same sizes fit
    SWATokenToKVPoolAllocator(32, 8, 4, "cpu", None)      # no pool: nothing to check


# (page, window, seq_len) -> frontier, by hand: tokens below dead = seq - W + 1 are invisible to every later
# query; the frontier is the start of dead's page, one page back, at least 0.
FRONTIERS = [
    (1, 1, 1, 0), (1, 1, 2, 1), (1, 1, 10, 9), (1, 4, 4, 0), (1, 4, 5, 1), (1, 4, 10, 6), (1, 8, 8, 0),
    (1, 8, 9, 1), (1, 8, 20, 12), (1, 3, 2, 0),
    (2, 1, 3, 0), (2, 1, 4, 2), (2, 1, 5, 2), (2, 1, 10, 8), (2, 3, 5, 0), (2, 3, 6, 2), (2, 3, 7, 2),
    (2, 3, 8, 4), (2, 8, 9, 0), (2, 8, 11, 2), (2, 8, 20, 10), (2, 6, 7, 0), (2, 2, 7, 4),
    (4, 1, 7, 0), (4, 1, 8, 4), (4, 1, 11, 4), (4, 1, 12, 8), (4, 1, 30, 24), (4, 2, 8, 0), (4, 2, 9, 4),
    (4, 5, 11, 0), (4, 5, 12, 4), (4, 5, 30, 20), (4, 8, 14, 0), (4, 8, 15, 4), (4, 8, 30, 16),
    (4, 6, 100, 88), (4, 7, 3, 0), (4, 3, 13, 4), (4, 4, 16, 8),
]


@pytest.mark.parametrize("page, window, seq, expect", FRONTIERS)
def test_release_frontier_formula_by_hand(page, window, seq, expect):
    """Pins max(frontier, floor((seq - W + 1) / P) * P - P) clamped at 0: off by a token or a page fails
    some case. The pages below the frontier lose their SWA slots, the rest keep them."""
    _, a = make(256, 256, page)
    loc = a.alloc_extend([0], [seq], [0], seq)
    rows = torch.zeros(1, 128, dtype=torch.int64)
    rows[0, :seq] = loc
    f = torch.zeros(1, dtype=torch.int64)
    release_out_of_window_batch(a, rows, torch.tensor([0]), torch.tensor([seq]), f, window)
    assert int(f[0]) == expect
    m = a.full_to_swa_index_mapping
    assert (m[loc[:expect]] == 0).all() and (m[loc[expect:]] > 0).all()
    ahead = torch.tensor([expect + page])                 # a frontier already past the formula stays
    if expect + page > seq:   # ... where it is still within the length: past it, it is refused (it would leak)
        with pytest.raises(LocError, match="must be in"):
            release_out_of_window_batch(a, rows, torch.tensor([0]), torch.tensor([seq]), ahead, window)
        return
    release_out_of_window_batch(a, rows, torch.tensor([0]), torch.tensor([seq]), ahead, window)
    assert int(ahead[0]) == expect + page


class _CountElements(TorchDispatchMode):
    """Elements of every tensor an op creates (in-place ops and views create none)."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func._schema.is_mutable and not func.is_view:
            self.elements += sum(t.numel() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


@pytest.mark.parametrize("immediate", [True, False])
def test_free_work_is_linear_in_the_locs_not_locs_times_page_size(immediate):
    """Freeing n locs (n / P pages, with their SWA pages) creates O(n) elements, not n x P (the table rows
    of each distinct page are cleared once): counted, not timed, for the same n at P = 16 and P = 256
    (the old cost grew 16x; now the page size barely matters)."""
    n, counts = 2048, {}
    for page in (16, 256):
        _, a = make(n, n, page)
        a.immediate = immediate
        a.host_ops = False  # the torch ops: the CPU's host path (numpy, the same O(n) rows) creates no tensors
        loc = a.alloc(n)
        with _CountElements() as count:
            a.free(loc)
        assert a.full_available_size() == a.swa_available_size() == n
        counts[page] = count.elements
    assert counts[256] < 1.25 * counts[16] and counts[256] < 128 * n, counts


def test_decode_where_every_token_continues_its_page_moves_no_ring_and_still_checks():
    """alloc_decode's fast path (no request starts a page): last + 1, no ring op; a continuation of a page
    whose SWA slots were released is still refused (immediate) or recorded (deferred)."""
    from hwkv.allocator import SWATokenToKVPoolAllocator
    from hwkv.errors import NotAllocatedError
    from hwkv.pool import SWAKVPool
    for immediate in (True, False):
        pool = SWAKVPool(64, 64, 4, torch.float32, 1, 2, [0], [1], "cpu")
        a = SWATokenToKVPoolAllocator(64, 64, 4, "cpu", pool)
        a.immediate = immediate
        loc = a.alloc_extend([0, 0], [6, 9], [0, 0], 15)           # two requests: pages continue at 6 and 9
        before = a.integrity_snapshot()
        out = a.alloc_decode(torch.tensor([7, 10]), torch.tensor([int(loc[5]), int(loc[14])]),
                             seq_lens_cpu=torch.tensor([7, 10]))
        assert out.tolist() == [int(loc[5]) + 1, int(loc[14]) + 1]
        assert same_snapshot(before, a.integrity_snapshot())        # no page moved
        a.free_swa(loc[14:15])                                      # the second request's last page loses its SWA
        before = a.integrity_snapshot()
        last = torch.tensor([int(loc[14]) + 1])
        if immediate:
            with pytest.raises(NotAllocatedError, match="has no SWA slot"):
                a.alloc_decode(torch.tensor([11]), last, seq_lens_cpu=torch.tensor([11]))
            assert same_snapshot(before, a.integrity_snapshot())
        else:
            a.alloc_decode(torch.tensor([11]), last, seq_lens_cpu=torch.tensor([11]))
            with pytest.raises(NotAllocatedError, match="no SWA slot"):
                a.available_size()


def test_sharing_the_swa_of_a_released_page_says_so_and_changes_nothing():
    """share(with_swa) of a page whose SWA slots are gone is refused as what it is (no SWA slot), not as a
    double free; check_share raises the same before anything changes."""
    from hwkv.allocator import SWATokenToKVPoolAllocator
    from hwkv.errors import NotAllocatedError
    from hwkv.pool import SWAKVPool
    pool = SWAKVPool(64, 64, 4, torch.float32, 1, 2, [0], [1], "cpu")
    a = SWATokenToKVPoolAllocator(64, 64, 4, "cpu", pool)
    loc = a.alloc(8)
    a.free_swa(loc[:4])
    before = a.integrity_snapshot()
    for call in (lambda: a.check_share(loc), lambda: a.share(loc)):
        with pytest.raises(NotAllocatedError, match=rf"loc {int(loc[0])} .* has no SWA slot \(released\)"):
            call()
        assert same_snapshot(before, a.integrity_snapshot())
    a.check_share(loc, with_swa=False)  # the full pages are live


@pytest.mark.parametrize("immediate", [True, False])
def test_release_by_row_moves_the_rows_frontiers_where_they_are_kept(immediate):
    """`by_row`: the frontiers of every req_to_token row in one table, the batch's rows' entries moved in place
    (rows named out of order, others untouched), the same release as gathering them; a table of the wrong size
    is refused with everything unchanged."""
    runs = []
    for by_row in (False, True):
        _, a = make(256, 64, 4)
        a.immediate = immediate
        rtt = torch.zeros(4, 64, dtype=torch.int64)
        for r, n in ((1, 30), (3, 22)):
            rtt[r, :n] = a.alloc_extend([0], [n], [0], n)
        table = torch.tensor([7, 0, 7, 0])  # rows 0 and 2 hold no request: their entries stay
        rows, seq = torch.tensor([3, 1]), torch.tensor([22, 30])
        if by_row:
            before = (state(a), table.clone())
            with pytest.raises(LocError, match=r"one per req_to_token row \(4\), got \[3\]"):
                release_out_of_window_batch(a, rtt, rows, seq, table[:3], 4, by_row=True)
            assert same_state(before[0], state(a)) and torch.equal(table, before[1])
            assert release_out_of_window_batch(a, rtt, rows, seq, table, 4, by_row=True) is table
        else:
            f = table[rows]
            release_out_of_window_batch(a, rtt, rows, seq, f, 4)
            table[rows] = f
        a.check_integrity()
        runs.append((state(a), table))
    assert runs[1][1].tolist() == [7, 20, 7, 12]  # 30 - 4 + 1 = 27 -> 24 - 4; 22 -> 19 -> 16 - 4
    assert torch.equal(runs[0][1], runs[1][1])
    assert same_state(runs[0][0], runs[1][0])


def test_moved_names_still_import_from_hwkv_allocator():
    """The page ops, the release and ReqToTokenPool moved to modules of their own; their old home keeps them."""
    import hwkv.allocator as old
    import hwkv.release
    import hwkv.req_to_token
    import hwkv.torch_page_ops
    assert old.release_out_of_window is hwkv.release.release_out_of_window
    assert old.release_out_of_window_batch is hwkv.release.release_out_of_window_batch
    assert old.ReqToTokenPool is hwkv.req_to_token.ReqToTokenPool
    assert old.TorchPageOps is hwkv.torch_page_ops.TorchPageOps and old.TORCH_OPS is hwkv.torch_page_ops.TORCH_OPS
    with pytest.raises(AttributeError):
        old.no_such_name
