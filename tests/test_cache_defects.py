"""The prefix cache's defects found by review (issue 21), each pinned by a test that failed before its fix:
tombstones revived on insert, atomic insert/acquire, stale matches refused, evictions that free what they
report, eviction cost independent of the tree's size, nodes owning their storage, and the window / lock /
recency rules that single-line mutants got past the suite. HWKV_TEST_DEVICE=cuda runs them on a GPU (the
allocator's Triton ops, with host checks on so refusals raise where they happen)."""
import os

import pytest
import torch

import hwkv.cache

from hwkv.allocator import SWATokenToKVPoolAllocator, same_snapshot
from hwkv.release import release_out_of_window_batch
from hwkv.req_to_token import ReqToTokenPool
from hwkv.cache import HybridPrefixCache, window_start
from hwkv.errors import CacheError, LocError
from hwkv.pool import SWAKVPool


DEVICE = os.environ.get("HWKV_TEST_DEVICE", "cpu")


def t(values):
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


class Setup:
    """Allocator, rows and cache, no attention: requests are rows of allocated locs."""

    def __init__(self, page=4, window=8, size=1024, size_swa=1024, rows=8, ctx=512):
        self.p, self.w = page, window
        pool = SWAKVPool(size, size_swa, page, torch.float32, 1, 1, [0], [1], DEVICE)
        self.a = SWATokenToKVPoolAllocator(size, size_swa, page, DEVICE, pool)
        self.a.immediate = True
        self.rtt = ReqToTokenPool(rows, ctx, DEVICE)
        self.c = HybridPrefixCache(self.a, window)
        self.size, self.size_swa = size, size_swa

    def run(self, ids, release=True):
        """A request for `ids`: reuse the cache's prefix, allocate the rest, release out of window;
        returns its state (row, seq, frontier, lock)."""
        m = self.c.match_prefix(ids[:-1])
        row = self.rtt.alloc(1)[0]
        lock, f = self.c.acquire(m, self.rtt, row)
        s = m.length
        last = self.rtt.req_to_token[row, s - 1:s] if s else t([0])
        loc = self.a.alloc_extend([s], [len(ids)], last, len(ids) - s)
        self.rtt.write(row, s, loc)
        fr = t([f])
        if release:
            release_out_of_window_batch(self.a, self.rtt.req_to_token, t([row]), t([len(ids)]), fr, self.w)
        return dict(ids=ids, row=row, seq=len(ids), frontier=int(fr), lock=lock, reused=m.length)

    def recompute(self, n):
        """A request that computed its first n tokens itself (no cache match), released out of window: (row,
        frontier)."""
        row = self.rtt.alloc(1)[0]
        self.rtt.write(row, 0, self.a.alloc_extend([0], [n], t([0]), n))
        fr = t([0])
        release_out_of_window_batch(self.a, self.rtt.req_to_token, t([row]), t([n]), fr, self.w)
        return row, int(fr)

    def finish(self, r, cache=True):
        self.c.release_request(r["ids"], self.rtt, r["row"], r["seq"], r["frontier"], r["lock"], cache=cache)
        self.rtt.free(r["row"])

    def check(self):
        self.a.check_integrity()
        self.c.check_integrity()

    def snapshot(self):
        """Everything a refusal must leave alone: the allocator, the rows (and which are free), the cache's
        books and every node (range, locs, SWA, locks)."""
        c = self.c
        nodes = sorted((nd.start, nd.end, tuple(nd.key.tolist()), tuple(nd.locs.tolist()), nd.swa, nd.lock_full,
                        tuple(sorted(nd.swa_locks.items()))) for nd in c._nodes())
        return (self.a.integrity_snapshot(), self.rtt.req_to_token.clone(), c.full_tokens, c.swa_tokens,
                c.evictable_full, c.evictable_swa, c._nodes_count, list(self.rtt._free), nodes)

    def same(self, s1, s2):
        return same_snapshot(s1[0], s2[0]) and torch.equal(s1[1], s2[1]) and s1[2:] == s2[2:]

    def empty(self):
        """Everything back: evict the whole cache, every slot free."""
        self.c.evict(self.c.evictable_full)
        self.check()
        return self.a.full_available_size() == self.size and self.a.swa_available_size() == self.size_swa


def test_tombstones_are_revived_by_a_recomputed_prompt():
    s = Setup(page=16, window=32)
    prompt = list(range(1000, 1080))                       # 80 tokens: matches end at 64 (all but one token)
    s.finish(s.run(prompt))
    lengths = []
    for _ in range(4):
        s.c.evict_swa(s.c.evictable_swa)                    # the SWA KV goes: the prompt is recomputed ...
        r = s.run(prompt)
        lengths.append(r["reused"])
        s.finish(r)                                         # ... and cached again, SWA and all
        s.check()
        assert s.c.match_prefix(prompt[:-1]).length == 64, "the recomputed prompt is not matchable again"
    assert lengths == [0, 0, 0, 0]
    r = s.run(prompt)
    assert r["reused"] == 64
    s.finish(r)
    assert s.empty()


def test_insert_with_a_frontier_a_page_early_changes_nothing():
    s = Setup(page=4, window=8)
    r = s.run(list(range(40)))                              # frontier 28: SWA of [0, 28) released
    assert r["frontier"] == 28
    before = s.snapshot()
    with pytest.raises(LocError, match="no SWA slot.*swa_start 24"):
        s.c.insert(r["ids"], s.rtt.req_to_token[r["row"], :40], 24)
    assert s.same(before, s.snapshot())
    s.finish(r, cache=False)
    assert s.empty(), "a refused insert left references behind"


def test_a_stale_match_is_refused_and_changes_nothing():
    s = Setup(page=4, window=8)
    s.finish(s.run(list(range(40))))
    m = s.c.match_prefix(list(range(39)))
    assert m.length == 36
    s.c.evict(s.c.evictable_full)                           # what the chat workload's admission did between
    row = s.rtt.alloc(1)[0]
    before = s.snapshot()
    with pytest.raises(CacheError, match="stale"):
        s.c.acquire(m, s.rtt, row)
    assert s.same(before, s.snapshot())
    # the SWA of its window evicted, or its node revived with other locs: stale as well
    s.finish(s.run(list(range(40))))
    m = s.c.match_prefix(list(range(39)))
    s.c.evict_swa(s.c.evictable_swa)
    with pytest.raises(CacheError, match="stale"):
        s.c.acquire(m, s.rtt, row)
    m = s.c.match_prefix(list(range(39)))
    assert m.length == 0
    s.finish(s.run(list(range(40))))                        # revives the tombstones with new locs
    m2 = s.c.match_prefix(list(range(39)))
    assert m2.length == 36
    s.rtt.free(row)
    assert s.empty()


def test_evictions_free_what_they_report_after_cache_running():
    """cache_running used to lock only the cut-back match (the root, over tombstones) and the window's start,
    not the frontier: evict() said 68 tokens while the pool gained 64; evict_swa() said 4 and freed 0."""
    s = Setup(page=4, window=8)
    s.finish(s.run(list(range(40))))
    s.c.evict_swa(s.c.evictable_swa)                        # [0, 40) are tombstones
    ids = list(range(40)) + list(range(500, 530))
    r = s.run(ids)                                          # reuses nothing: its window's SWA is gone
    assert r["reused"] == 0
    r["lock"] = s.c.cache_running(ids, s.rtt, r["row"], r["seq"], r["frontier"], r["lock"])
    s.check()
    full0, swa0 = s.a.full_available_size(), s.a.swa_available_size()
    n_swa = s.c.evictable_swa
    assert s.c.evict_swa(n_swa) == s.a.swa_available_size() - swa0 == n_swa
    n_full = s.c.evictable_full
    assert s.c.evict(n_full) == s.a.full_available_size() - full0 == n_full
    s.finish(r)
    assert s.empty()


def counting(monkeypatch):
    """Count window computations: the ranking does one per node it looks at."""
    calls = [0]
    real = hwkv.cache.window_start

    def ws(*a):
        calls[0] += 1
        return real(*a)
    monkeypatch.setattr(hwkv.cache, "window_start", ws)
    return calls


def test_eviction_cost_does_not_grow_with_the_tree(monkeypatch):
    """Ranking nodes looks at what it evicts (and the windows near it), not the whole tree; one allocator
    call per eviction, however many nodes it drops."""
    visits = []
    for n_leaves in (64, 1024):
        s = Setup(page=1, window=4, size=4 * n_leaves + 64, size_swa=4 * n_leaves + 64, rows=2)
        for i in range(n_leaves):                           # leaves [i, 0..3] under one shared first token
            s.finish(s.run([7, 10_000 + i, 3, 4, 5], release=False))
        s.check()
        calls = counting(monkeypatch)
        s.c.evict_swa(4)
        visits.append(calls[0])
        monkeypatch.undo()
        frees = []
        real = s.a.free
        s.a.free = lambda loc, with_swa=True: (frees.append(loc.numel()), real(loc, with_swa))
        s.c.evict(s.c.evictable_full)
        s.a.free = real
        assert len(frees) <= 2, f"{len(frees)} allocator calls for one eviction"
        assert s.empty()
    assert visits[1] <= visits[0] + 4, f"nodes ranked per evict_swa grew with the tree: {visits}"


def test_chain_eviction_ranks_a_bounded_number_of_nodes(monkeypatch):
    s = Setup(page=4, window=64, size=8192, size_swa=8192, rows=2, ctx=8192)
    ids = list(range(4096))
    r = s.run(ids, release=False)
    for e in range(4, 4097, 4):                             # one node per page: a chain of 1,024 nodes
        s.c.insert(ids[:e], s.rtt.req_to_token[r["row"], :e], 0)
    s.finish(r)
    calls = counting(monkeypatch)
    s.c.evict_swa(4)
    assert calls[0] <= 4 * (64 // 4 + 2), f"one evict_swa looked at {calls[0]} nodes of a 1,024-node chain"
    s.check()


def test_split_nodes_own_their_storage():
    s = Setup(page=4, window=8, size=2048, size_swa=2048, ctx=1024)
    s.finish(s.run(list(range(1024)), release=False))
    assert s.c.match_prefix(list(range(8)) + [9999]).length == 8  # splits the 1024-token node at 8
    head = s.c.match_prefix(list(range(8)) + [9999]).node
    assert head.locs.untyped_storage().nbytes() == 8 * 8, "the head pins the whole insertion's locs"
    s.check()


@pytest.mark.parametrize("page", [1, 2, 4])
@pytest.mark.parametrize("window", [2, 3, 5, 8])
def test_every_key_the_next_query_sees_stays_mapped_through_swa_eviction(page, window):
    s = Setup(page=page, window=window, size=512, size_swa=512)
    ids = list(range(100, 160))
    s.finish(s.run(ids))
    for m_end in range(window, 60, 3):
        m = s.c.match_prefix(ids[:m_end])
        if not m.length:
            continue
        row = s.rtt.alloc(1)[0]
        lock, f = s.c.acquire(m, s.rtt, row)
        assert f == window_start(m.length, window, page)
        s.c.evict_swa(s.c.evictable_swa)                    # all the cache can spare
        first = max(0, m.length - window + 1)               # the next query (position m) sees keys > m - W
        seen = s.rtt.req_to_token[row, first:m.length]
        assert (s.a.full_to_swa_index_mapping[seen] > 0).all(), f"m={m.length}: a visible key lost its SWA"
        s.c.release_request(ids[:m.length], s.rtt, row, m.length, f, lock)
        s.rtt.free(row)
        s.check()
    assert s.empty()


def test_a_lock_leaves_the_swa_below_its_window_evictable():
    s = Setup(page=4, window=8)
    ids = list(range(64))
    r = s.run(ids, release=False)                           # SWA of all 64 tokens held
    s.c.insert(ids, s.rtt.req_to_token[r["row"], :64], 0)   # the cache holds SWA of all 64 as well
    s.finish(r)
    m = s.c.match_prefix(ids)
    lock = s.c.lock(m)                                       # window start 60 - 4 = 56
    assert m.swa_start == window_start(64, 8, 4) == 56
    assert s.c.evictable_swa == 56
    swa0 = s.a.swa_available_size()
    assert s.c.evict_swa(56) == 56 == s.a.swa_available_size() - swa0
    mp = s.a.full_to_swa_index_mapping[m.locs]
    assert (mp[:56] == 0).all() and (mp[56:] > 0).all()
    s.c.unlock(lock)
    assert s.c.match_prefix(ids).length == 64
    assert s.empty()


def test_full_eviction_takes_tombstone_leaves_then_the_least_recently_used():
    s = Setup(page=4, window=4)
    a, b, c = ([k] * 4 + list(range(k * 10, k * 10 + 8)) for k in (1, 2, 3))  # three 12-token leaves
    for ids in (a, b):
        s.finish(s.run(ids + [0], release=False))
    r = s.run(c + [0], release=False)
    s.c.insert(c, s.rtt.req_to_token[r["row"], :12], 12)   # c: a tombstone leaf, the most recent insert
    s.finish(r, cache=False)
    leaves = [s.c.match_prefix(ids).node for ids in (b, c, a)]  # a used after b: b is the least recent
    order = []
    for _ in range(3):
        s.c.evict(12)
        order.append([nd.parent is not None for nd in leaves])
    # the tombstone leaf first (c), then b (least recently used), then a
    assert order == [[True, False, True], [False, False, True], [False, False, False]]
    assert s.empty()


def test_swa_eviction_takes_heads_then_the_least_recently_used_window_of_a_class():
    s = Setup(page=4, window=4)
    a, b = [1] * 4 + list(range(10, 18)), [2] * 4 + list(range(20, 28))
    s.finish(s.run(a + [0], release=False))                 # SWA of all 12 tokens each; their windows are
    s.finish(s.run(b + [0], release=False))                 # [8, 12): [0, 8) of each is SWA no window needs
    assert s.c.evict_swa(16) == 16                          # the heads go first, every window stays
    assert s.c.match_prefix(a).length == 12 and s.c.match_prefix(b).length == 12
    for first, second in ((a, b), (b, a)):
        s.c.match_prefix(second)                             # `first`'s window is now the least recent
        assert s.c.evict_swa(1) == 4
        assert s.c.match_prefix(first).length == 0 and s.c.match_prefix(second).length == 12
        r = s.run(first + [0], release=False)                # recompute it; caching it again revives it
        s.c.insert(first, s.rtt.req_to_token[r["row"], :12], 8)
        s.finish(r, cache=False)
        assert s.c.match_prefix(first).length == 12
        s.check()
    assert s.empty()


def test_a_recomputed_history_is_cached_with_the_running_requests_pages():
    """A turn whose history lost its window recomputes it; caching it while it runs must not lock the old
    copy beside the request's own (found by the chat workload at tight pools)."""
    s = Setup(page=4, window=8, size=256, size_swa=256)
    s.finish(s.run(list(range(40))))
    s.c.evict_swa(s.c.evictable_swa)                        # the history's window is gone: no reuse
    ids = list(range(40)) + list(range(500, 530))
    r = s.run(ids)
    assert r["reused"] == 0
    r["lock"] = s.c.cache_running(ids, s.rtt, r["row"], r["seq"], r["frontier"], r["lock"])
    s.check()
    row = s.rtt.req_to_token[r["row"], :68]
    nd = s.c.match_prefix(ids[:68]).node
    while nd is not s.c.root:
        assert torch.equal(nd.locs, row[nd.start:nd.end]), f"node [{nd.start}, {nd.end}) holds another copy"
        nd = nd.parent
    held = (len(ids) + 3) // 4 * 4                          # the request's pages, and nothing else
    assert s.a.full_available_size() == s.size - held
    s.finish(r)
    assert s.empty()


def test_a_node_the_frontier_falls_in_is_adopted_from_the_frontier_on():
    """cache_running splits at the request's frontier before adopting, so the part the SWA lock covers holds
    the running request's pages, not a second copy (found by review)."""
    s = Setup(page=4, window=8)
    s.finish(s.run(list(range(100, 140))))                  # cached: [0, 28) tombstones, [28, 40) with SWA
    ids = list(range(100, 140)) + list(range(500, 506))
    n = len(ids)
    row = s.rtt.alloc(1)[0]
    loc = s.a.alloc_extend([0], [n], t([0]), n)             # the same 40 tokens recomputed, and 6 more
    s.rtt.write(row, 0, loc)
    fr = t([0])
    release_out_of_window_batch(s.a, s.rtt.req_to_token, t([row]), t([n]), fr, s.w)
    assert int(fr) == 32                                    # inside the cached node [28, 40)
    lock = s.c.cache_running(ids, s.rtt, row, n, int(fr), None)
    s.check()
    nd = lock.node
    while nd is not s.c.root:
        if nd.end > 32:
            assert nd.start >= 32 and torch.equal(nd.locs, s.rtt.req_to_token[row, nd.start:nd.end]), \
                f"locked node [{nd.start}, {nd.end}) holds another copy"
        nd = nd.parent
    s.c.release_request(ids, s.rtt, row, n, int(fr), lock)
    s.rtt.free(row)
    assert s.empty()


def test_cache_running_with_a_frontier_below_the_requests_changes_nothing():
    """cache_running refuses a frontier below the request's (SWA it has released) before insert changes the tree:
    it had split a node, added one and swapped the cached node's pages for the request's before the adopt's share
    failed, after which evicting double-freed and 24 slots of each pool were lost (found by review)."""
    s = Setup(page=4, window=8, size=256, size_swa=256)
    ids = list(range(100, 116))
    s.finish(s.run(ids, release=False))                     # [0, 16) cached with its SWA
    ids2 = ids + list(range(500, 508))
    n = len(ids2)
    row, fr = s.recompute(n)   # the same 16 tokens recomputed, and 8 more
    assert fr == 12
    before = s.snapshot()
    with pytest.raises(LocError, match="no SWA slot.*swa_start 0"):
        s.c.cache_running(ids2, s.rtt, row, n, 0, None)
    assert s.same(before, s.snapshot())
    s.check()
    lock = s.c.cache_running(ids2, s.rtt, row, n, fr, None)   # the real frontier is taken
    s.check()
    s.c.release_request(ids2, s.rtt, row, n, fr, lock)
    s.rtt.free(row)
    assert s.empty()


@pytest.mark.parametrize("bad_row", [8, 10 ** 6, -1])
def test_a_row_outside_the_request_rows_is_refused_and_changes_nothing(bad_row):
    """acquire, cache_running and release_request check the row (and the length) before any share: acquire had
    shared the match's pages and then failed with a bare IndexError (a negative row wrote another request's row)."""
    s = Setup(page=4, window=8)
    ids = list(range(100, 120))
    s.finish(s.run(ids))
    m = s.c.match_prefix(ids[:-1])
    assert m.length == 16
    r = s.run(list(range(300, 340)))
    before = s.snapshot()
    with pytest.raises(LocError, match=f"row {bad_row} "):
        s.c.acquire(m, s.rtt, bad_row)
    with pytest.raises(LocError, match=f"row {bad_row} "):
        s.c.cache_running(r["ids"], s.rtt, bad_row, r["seq"], r["frontier"], r["lock"])
    with pytest.raises(LocError, match=f"row {bad_row} "):
        s.c.release_request(r["ids"], s.rtt, bad_row, r["seq"], r["frontier"], r["lock"])
    with pytest.raises(LocError, match="seq_len 513 "):
        s.c.cache_running(r["ids"], s.rtt, r["row"], 513, r["frontier"], r["lock"])
    assert s.same(before, s.snapshot())
    s.finish(r)
    assert s.empty()


@pytest.mark.parametrize("ids", [[1, 2.7, 3, 4, 5], [1, "x", 3, 4], [1, None, 3, 4], [1, 2 ** 70, 3, 4],
                                 (1, 2, 3.0, 4)])
def test_token_ids_are_checked_element_by_element(ids):
    """Every element of a token-id list must be an int below 2**63: a float after the first was truncated (2.7 read
    as 2, so the match was of other tokens), a string, None or a huge int a bare ValueError / TypeError /
    OverflowError (found by review)."""
    s = Setup(page=4, window=8)
    before = s.snapshot()
    for call in (lambda: s.c.match_prefix(ids), lambda: s.c.insert(ids, t([0] * len(ids)), 0)):
        with pytest.raises(LocError, match="token ids must be integers"):
            call()
    assert s.same(before, s.snapshot())
    assert s.c.match_prefix([1, 2, 3, 4, 5]).length == 0       # ints (and numpy ints) still pass
    import numpy as np
    assert s.c.match_prefix([np.int64(1), np.int32(2)]).length == 0
