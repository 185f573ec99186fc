"""Allocators: equal in-page offsets, long decode in a small SWA pool with release, reuse, errors."""
import pytest
import torch

from hwkv.allocator import (PagedTokenToKVPoolAllocator, ReqToTokenPool, SWATokenToKVPoolAllocator,
                            TokenToKVPoolAllocator, release_out_of_window)
from hwkv.errors import ConfigError, DoubleFreeError, LocError, NotAllocatedError, OutOfSlotsError
from hwkv.pool import SWAKVPool


def make(size=256, size_swa=32, page=4):
    pool = SWAKVPool(size, size_swa, page, torch.float32, 1, 4, [0], [1], "cpu")
    return pool, SWATokenToKVPoolAllocator(size, size_swa, page, "cpu", pool)


def state(a):
    return (a.full_available_size(), a.swa_available_size(), a.full_to_swa_index_mapping.clone(),
            a.integrity_snapshot())


def same_state(s1, s2):
    same_rings = all(s1[3][k]["head"] == s2[3][k]["head"] and s1[3][k]["tail"] == s2[3][k]["tail"]
                     and torch.equal(s1[3][k]["ring"], s2[3][k]["ring"]) and torch.equal(s1[3][k]["refs"], s2[3][k]["refs"])
                     for k in s1[3])
    return s1[0] == s2[0] and s1[1] == s2[1] and torch.equal(s1[2], s2[2]) and same_rings


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
