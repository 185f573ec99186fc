"""Defects of HybridPrefixCache's direct API found by review 21 (reviewer A), each pinned by a test that failed
before its fix: a release whose token ids do not cover the first page shared a free round with a request holding
the same cached page (a reference leaked); another cache's lock or match was not refused (that tree's locks and this
allocator's pages changed, then a bare error); a full-only allocator was accepted (evict_swa half-applied); numpy and
0-d tensor positions were refused with a self-contradicting message while bools passed as 0 or 1; eviction counts
and handles that are none were taken or failed untyped. Every refusal is typed and leaves the trees, the allocators
and the request rows as they were."""
import re

import numpy as np
import pytest
import torch

from hwkv.allocator import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator, same_snapshot
from hwkv.cache import HybridPrefixCache, PrefixLock, PrefixMatch
from hwkv.errors import CacheError, ConfigError, LocError
from hwkv.pool import SWAKVPool
from hwkv.req_to_token import ReqToTokenPool
from test_cache_pool_defects import Setup  # (its integrity checks and eviction-to-empty: the same three books)

P, W, SIZE = 4, 4, 64
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module


class Side:
    """A cache over its own allocator and request rows."""

    def __init__(self, page=P, window=W):
        pool = SWAKVPool(SIZE, SIZE, page, torch.float32, 1, 2, [0], [1], "cpu")
        self.a = SWATokenToKVPoolAllocator(SIZE, SIZE, page, "cpu", pool)
        self.rtt = ReqToTokenPool(4, SIZE, "cpu")
        self.c = HybridPrefixCache(self.a, window)

    def cached(self, ids):
        """`ids` cached by a request that then left (the cache alone holds them)."""
        loc = self.a.alloc(len(ids))
        self.c.insert(ids, loc, 0)
        self.a.free(loc)
        return self

    def running(self, ids):
        """A request of `ids` in its own row and pages, cached with its lock (`cache_running`)."""
        row = self.rtt.alloc(1)[0]
        self.rtt.write(row, 0, self.a.alloc(len(ids)))
        return row, self.c.cache_running(ids, self.rtt, row, len(ids), 0)

    def snapshot(self):
        c = self.c
        nodes = sorted((nd.start, nd.end, tuple(nd.key.tolist()), tuple(nd.locs.tolist()), nd.swa, nd.lock_full,
                        tuple(sorted(nd.swa_locks.items()))) for nd in c._nodes())
        return (self.a.integrity_snapshot(), self.rtt.req_to_token.clone(),
                (list(self.rtt._free), self.a.full_available_size(), self.a.swa_available_size(), c.root.lock_full,
                 c.full_tokens, c.swa_tokens, c.evictable_full, c.evictable_swa, c._nodes_count, nodes))

    # allocator, cache and rows checked; everything back once the cache evicts all it holds (nothing leaked)
    check, empty = Setup.check, Setup.empty


def unchanged(sides, call, exc, match):
    before = [s.snapshot() for s in sides]
    with pytest.raises(exc, match=match):
        call()
    for s, b in zip(sides, before):
        a = s.snapshot()
        assert same_snapshot(b[0], a[0]) and torch.equal(b[1], a[1]) and b[2] == a[2]
        s.check()


# ---- 1. a release whose ids do not cover its first page frees in a round of its own ------------------------------
@pytest.mark.parametrize("short, cache", [(2, True), (0, False), (3, False)])
def test_release_with_ids_short_of_a_page_leaks_no_shared_page(short, cache):
    """Two requests continue from one cached page; the first is released with fewer ids than a page (`[]` on an
    abort that does not cache). Keyed by its ids' first page, it went into the other's round, and the single free
    dropped one reference of the two they hold on the shared page: it stayed held after the cache emptied."""
    s = Side()
    ids = list(range(100, 108))
    s.cached(ids)
    reqs = []
    for i in range(2):
        q = ids[:P] + [200 + i] * P
        m = s.c.match_prefix(q[:-1])
        assert m.length == P
        row = s.rtt.alloc(1)[0]
        lock, f = s.c.acquire(m, s.rtt, row)
        s.rtt.write(row, P, s.a.alloc_extend([P], [2 * P], s.rtt.req_to_token[row, P - 1:P], P))
        reqs.append((q, row, f, lock))
    page = int(s.rtt.req_to_token[reqs[0][1], 0]) // P
    assert int(s.a.pages.refs[page]) == 3  # the cache's and each request's
    (q0, r0, f0, l0), (q1, r1, f1, l1) = reqs
    s.c.release_requests([(q0[:short], r0, 2 * P, f0, l0), (q1, r1, 2 * P, f1, l1)], s.rtt, cache=cache)
    s.rtt.free([r0, r1])
    assert int(s.a.pages.refs[page]) == 1  # the cache's
    s.check()
    assert s.empty()


# ---- 2. another cache's lock or match is refused before any change ------------------------------------------------
def _two_caches():
    one, two = Side(), Side()
    ids = list(range(8))
    one.cached(ids)
    two.cached(ids)
    return one, two, ids


FOREIGN = "another HybridPrefixCache"


@pytest.mark.parametrize("op", ["unlock", "cache_running", "release_request", "release_request no cache"])
def test_a_lock_of_another_cache_is_refused(op):
    """unlock had walked the other tree (its lock counts dropped, its nodes on this cache's heaps) and raised a
    bare AttributeError; cache_running and release_request got there after inserting and freeing."""
    one, two, ids = _two_caches()
    lock2 = two.c.lock(two.c.match_prefix(ids))
    row, lock1 = one.running(list(range(50, 58)))
    calls = {
        "unlock": lambda: one.c.unlock(lock2),
        "cache_running": lambda: one.c.cache_running(list(range(50, 58)), one.rtt, row, 8, 0, lock2),
        "release_request": lambda: one.c.release_request(list(range(50, 58)), one.rtt, row, 8, 0, lock2),
        "release_request no cache": lambda: one.c.release_requests(
            [(list(range(50, 58)), row, 8, 0, lock1), (ids, row + 1, 0, 0, lock2)], one.rtt, cache=False),
    }
    name = "release_requests" if op.startswith("release") else op
    unchanged([one, two], calls[op], CacheError, f"{name}: a PrefixLock of {FOREIGN}")
    assert lock2.active and lock1.active
    two.c.unlock(lock2)
    one.c.release_request(list(range(50, 58)), one.rtt, row, 8, 0, lock1)
    one.rtt.free(row)
    assert one.empty() and two.empty()


@pytest.mark.parametrize("op", ["evict_node", "acquire", "lock", "acquire empty", "lock empty"])
def test_a_match_of_another_cache_is_refused(op):
    """evict_node had detached the other tree's node and freed its locs in THIS allocator (dropping references on
    this cache's own pages); acquire of another cache's empty match locked that tree's root, then raised
    AttributeError. lock and acquire of a longer one were refused, but as a stale match of this cache."""
    one, two, ids = _two_caches()
    m2 = two.c.match_prefix(list(range(100, 109)) if op.endswith("empty") else ids)
    assert (m2.length == 0) == op.endswith("empty")
    row = one.rtt.alloc(1)[0]
    name = op.split()[0]
    call = {"evict_node": lambda: one.c.evict_node(m2), "acquire": lambda: one.c.acquire(m2, one.rtt, row),
            "lock": lambda: one.c.lock(m2)}[name]
    unchanged([one, two], call, CacheError, f"{name}: a PrefixMatch of {FOREIGN}")
    one.rtt.free(row)
    assert one.empty() and two.empty()


@pytest.mark.parametrize("op", ["lock", "evict_node"])
def test_a_match_made_by_hand_over_another_tree_is_refused(op):
    """A match built by hand (no owner: stamp 0 skips the staleness check) of another tree's node: lock walked that
    tree's path and raised AttributeError at its root; evict_node freed its locs here."""
    one, two, ids = _two_caches()
    node = two.c.match_prefix(ids).node
    m = PrefixMatch(0, None, 0, node)
    unchanged([one, two], lambda: getattr(one.c, op)(m), CacheError, "not in this cache's tree")
    assert one.empty() and two.empty()


# ---- 3. a full-only allocator is refused at construction ----------------------------------------------------------
def test_a_full_only_allocator_is_refused():
    """It was accepted, and evict_swa tombstoned a node before a bare AttributeError (free_swa)."""
    a = PagedTokenToKVPoolAllocator(SIZE, P, "cpu")
    with pytest.raises(ConfigError, match="allocator must be an SWATokenToKVPoolAllocator .*got "
                                          "PagedTokenToKVPoolAllocator"):
        HybridPrefixCache(a, W)


# ---- 4. positions and the window: integers of any kind, never bools ----------------------------------------------
@pytest.mark.parametrize("kind", [np.int64, torch.tensor])
def test_numpy_and_tensor_positions_are_taken_as_ints(kind):
    """insert and cache_running refused np.int64(4) / torch.tensor(4) with 'swa_start 4 must be a non-negative
    multiple of page_size 4'; release_request (hwkv.checks.as_int) took them. The window too."""
    ids = list(range(16))
    results = []
    for wrap in (int, kind):
        s = Side()
        loc = s.a.alloc(16)
        added = s.c.insert(ids, loc, wrap(4))
        s.a.free(loc)
        row = s.rtt.alloc(1)[0]
        s.rtt.write(row, 0, s.a.alloc(16))
        lock = s.c.cache_running(list(range(50, 66)), s.rtt, row, 16, wrap(0))
        results.append((added, s.snapshot()[2][3:]))
        s.c.release_request(list(range(50, 66)), s.rtt, row, 16, wrap(0), lock)
        s.rtt.free(row)
        assert s.c.evict(wrap(4)) >= 4 and s.c.evict_swa(wrap(0)) == 0
        assert s.empty()
        w = HybridPrefixCache(s.a, wrap(W)).window
        assert type(w) is int and w == W
    assert results[0] == results[1]


@pytest.mark.parametrize("where", ["insert", "cache_running"])
@pytest.mark.parametrize("value", [False, True])
def test_a_bool_position_is_refused(where, value):
    """A bool swa_start / frontier was taken as 0 (or, at page size 1, as 1)."""
    s = Side(page=1)
    row = s.rtt.alloc(1)[0]
    loc = s.a.alloc(8)
    s.rtt.write(row, 0, loc)
    name = "swa_start" if where == "insert" else "frontier"
    call = (lambda: s.c.insert(list(range(8)), loc, value)) if where == "insert" else \
        (lambda: s.c.cache_running(list(range(8)), s.rtt, row, 8, value))
    msg = "a non-negative integer multiple of page_size 1" if where == "insert" else \
        r"an integer multiple of page_size 1 in \[0, seq_len 8\]"
    unchanged([s], call, LocError, rf"{name} {value!r} must be {msg}")


def test_a_bool_window_is_refused():
    """window=True was taken as W=1."""
    with pytest.raises(ConfigError, match=r"window=True must be an integer >= 1"):
        HybridPrefixCache(Side().a, True)


# ---- 5. eviction counts and handles are checked -------------------------------------------------------------------
@pytest.mark.parametrize("op", ["evict", "evict_swa"])
@pytest.mark.parametrize("n", [None, "2", 1.5, -1, True, torch.tensor([1.0])])
def test_an_eviction_count_that_is_no_integer_is_refused(op, n):
    """None and '2' raised a bare TypeError; 1.5, True and a float tensor evicted; -1 was taken as nothing."""
    s = Side().cached(list(range(8)))
    unchanged([s], lambda: getattr(s.c, op)(n), CacheError,
              re.escape(f"{op}({n!r}): the number of tokens to evict must be an integer >= 0"))


@pytest.mark.parametrize("op, handle", [(op, h) for op in ("lock", "unlock", "acquire", "evict_node", "cache_running",
                                                             "release_request") for h in (None, "x", 3)
                                        if h is not None or op not in ("cache_running", "release_request")])
def test_a_handle_that_is_none_is_refused(op, handle):
    """None (or any non-handle) raised AttributeError, in cache_running and release_request after changes."""
    s = Side().cached(list(range(8)))
    row = s.rtt.alloc(1)[0]
    s.rtt.write(row, 0, s.a.alloc(8))
    kind = "PrefixLock" if op in ("unlock", "cache_running", "release_request") else "PrefixMatch"
    calls = {"lock": lambda: s.c.lock(handle), "unlock": lambda: s.c.unlock(handle),
             "acquire": lambda: s.c.acquire(handle, s.rtt, row), "evict_node": lambda: s.c.evict_node(handle),
             "cache_running": lambda: s.c.cache_running(list(range(50, 58)), s.rtt, row, 8, 0, handle),
             "release_request": lambda: s.c.release_request(list(range(50, 58)), s.rtt, row, 8, 0, handle)}
    name = "release_requests" if op == "release_request" else op
    unchanged([s], calls[op], CacheError, rf"{name}: expected a {kind} of this cache, got {type(handle).__name__}")
    s.c.release_request(list(range(50, 58)), s.rtt, row, 8, 0, None, cache=False)
    s.rtt.free(row)
    assert s.empty()


def test_own_handles_keep_working():
    """This cache's matches and locks (and a match built by hand over its own node) go through as before."""
    s = Side().cached(list(range(8)))
    m = s.c.match_prefix(list(range(8)))
    assert m.cache is s.c
    lock = s.c.lock(m)
    assert isinstance(lock, PrefixLock) and lock.cache is s.c
    with pytest.raises(CacheError, match="locked"):
        s.c.evict_node(PrefixMatch(0, None, 0, m.node))
    s.c.unlock(lock)
    assert s.c.evict_node(PrefixMatch(0, None, 0, m.node)) == 4  # (the lock split the node at its window)
    assert s.empty()
