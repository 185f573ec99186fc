"""Review 26 (test-suite audit): single-line mutants of core rules that the rest of the suite let through, each
pinned by a test that passes on the code as it is and fails with the mutant (see REVIEW.md for the mutants).

1. `HybridPrefixCache._full_rank`: tombstone leaves are evicted before any leaf with SWA KV, whatever their
   recency. `(1 if node.swa else 0, node.t_full)` -> `(0, node.t_full)` (pure LRU) passed every cache test: the
   existing ordering test makes its tombstone the least recently used leaf as well.
2. `HybridPrefixCache._swa_rank`: leaves' windows (class 2) go before branch points' (class 3). Swapping the two
   classes passed every cache test.
3. `HybridPrefixCache.lock`/`unlock` count locks: two locks on one match, one unlock, the nodes stay locked. The
   mutants `lock_full = 1` / `swa_locks[s] = 1` were caught only by the hypothesis machine (after up to 140 s);
   here deterministically.
4. `SWAKVPool.translate_loc_from_full_to_swa(LocRuns, out=)` on a device without refill kernels (the torch path of
   `hwkv.ops.translate_runs`): dropping its translation (`out.copy_(mapping[out])`) passed test_loc, test_pool,
   test_allocator, test_refill and test_contract_cpu (every caller in the suite registers refill kernels first).
"""
import pytest
import torch

from hwkv import ops
from hwkv.allocator import SWATokenToKVPoolAllocator
from hwkv.errors import CacheError
from hwkv.loc import LocRuns
from hwkv.pool import SWAKVPool
from hwkv.release import release_out_of_window_batch

from test_cache_defects import Setup

pytestmark = pytest.mark.usefixtures("one_thread")

I64 = torch.int64


def _node(c, first_token, start=0):
    """The cache node whose key starts with `first_token` at position `start` (None once evicted)."""
    for nd in c._nodes():
        if nd.start == start and len(nd.key) and int(nd.key[0]) == first_token:
            return nd
    return None


# ---- 1. full eviction: a tombstone leaf before the least recently used leaf ---------------------------------------
def test_full_eviction_takes_a_recent_tombstone_leaf_before_an_older_leaf_with_swa():
    s = Setup(page=4, window=4)
    a, b, c = ([k] * 4 + list(range(k * 10, k * 10 + 8)) for k in (1, 2, 3))   # three 12-token leaves
    for ids in (a, b):                                       # a and b: SWA KV cached, least recently used
        s.finish(s.run(ids + [0], release=False))
    r = s.run(c + [0], release=False)
    s.c.insert(c, s.rtt.req_to_token[r["row"], :12], 12)    # c: a tombstone leaf, the most recent node
    s.finish(r, cache=False)
    na, nb, nc = _node(s.c, 1), _node(s.c, 2), _node(s.c, 3)
    assert na.swa and nb.swa and not nc.swa
    assert nc.t_full > max(na.t_full, nb.t_full), "the premise: the tombstone is the most recently used leaf"
    assert s.c.evict(12) == 12
    assert nc.parent is None, "the tombstone leaf must go first, though it is the most recently used"
    assert na.parent is not None and nb.parent is not None
    assert s.c.evict(12) == 12
    assert na.parent is None and nb.parent is not None      # then the least recently used (a)
    assert s.empty()


# ---- 2. SWA eviction: a leaf's window before a branch point's window ------------------------------------------------
def test_swa_eviction_takes_leaf_windows_before_a_branch_points_window():
    s = Setup(page=4, window=4)
    prefix = [7] * 4 + list(range(100, 108))                # 12 shared tokens: window of end 12 is [8, 12)
    x = prefix + list(range(200, 212))                      # two 24-token requests branching at 12; their
    y = prefix + list(range(300, 312))                      # windows [20, 24) do not reach back into the prefix
    s.finish(s.run(x + [0], release=False))
    s.finish(s.run(y + [0], release=False))
    s.c.match_prefix(x)                                     # x's leaf: more recent than the branch point
    s.c.match_prefix(y)                                     # (so recency alone would not save the branch point)
    s.check()
    # the heads no window needs: [0, 8) of the prefix, [12, 20) of each leaf
    assert s.c.evict_swa(24) == 24
    branch = [nd for nd in s.c._nodes() if nd.start == 8 and nd.end == 12]
    assert len(branch) == 1 and branch[0].swa and len(branch[0].children) == 2
    leaves = [nd for nd in s.c._nodes() if nd.end == 24]
    assert len(leaves) == 2 and all(nd.swa for nd in leaves)
    assert s.c.evict_swa(4) == 4
    assert branch[0].swa, "the branch point's window (class 3) went before a leaf's window (class 2)"
    assert sum(nd.swa for nd in s.c._nodes() if nd.end == 24) == 1
    assert s.c.evict_swa(4) == 4
    assert branch[0].swa, "the branch point's window went before the second leaf's window"
    assert not any(nd.swa for nd in s.c._nodes() if nd.end == 24)
    assert s.empty()


# ---- 3. lock counting, deterministically ------------------------------------------------------------------------
def test_two_locks_on_one_match_keep_it_locked_until_both_are_released():
    s = Setup(page=4, window=8)
    ids = list(range(1, 33))
    s.finish(s.run(ids + [0], release=False))
    assert s.c.evictable_full == s.c.full_tokens == 32 and s.c.evictable_swa == s.c.swa_tokens > 0
    m = s.c.match_prefix(ids)
    l1, l2 = s.c.lock(m), s.c.lock(m)
    assert s.c.evictable_full == 0
    locked_swa = s.c.evictable_swa
    s.c.unlock(l1)
    assert s.c.evictable_full == 0, "one of two locks released: the matched nodes must stay locked (full)"
    assert s.c.evictable_swa == locked_swa, "one of two locks released: the window must stay locked (SWA)"
    with pytest.raises(CacheError, match=r"only 0 are unlocked"):
        s.c.evict(4)
    s.check()
    s.c.unlock(l2)
    assert s.c.evictable_full == s.c.full_tokens == 32 and s.c.evictable_swa == s.c.swa_tokens
    assert s.empty()


# ---- 4. LocRuns translated by the torch path ----------------------------------------------------------------------
def test_locruns_translation_without_refill_kernels_gathers_and_translates(monkeypatch):
    monkeypatch.setattr(ops, "_REFILL", {})                 # the torch path: no device refill kernels
    p, size, size_swa = 4, 128, 32                         # 8 SWA pages: row 2 reuses released ones
    pool = SWAKVPool(size, size_swa, p, torch.float32, 1, 4, [0], [1], "cpu")
    a = SWATokenToKVPoolAllocator(size, size_swa, p, "cpu", pool)
    a.immediate = True
    rtt = torch.zeros(3, 64, dtype=I64)
    rtt[0, :24] = a.alloc_extend([0], [24], [0], 24)
    f = torch.zeros(1, dtype=I64)
    release_out_of_window_batch(a, rtt, torch.tensor([0]), torch.tensor([24]), f, 4)   # SWA pages of row 0 go
    assert int(f[0]) > 0
    rtt[2, :20] = a.alloc_extend([0], [20], [0], 20)        # new full pages on reused SWA pages
    mapping = pool.full_to_swa_index_mapping
    locs = rtt[2, :20]
    assert (mapping[locs] != locs).any(), "the premise: SWA slots differ from the full locs"
    rows, pos0 = torch.tensor([2, 0]), torch.tensor([3, int(f[0])], dtype=I64)
    lens = [20 - 3, 24 - int(f[0])]
    indptr = torch.tensor([0, lens[0], lens[0] + lens[1]], dtype=torch.int32)
    out = torch.full((sum(lens),), -7, dtype=I64)
    got = pool.translate_loc_from_full_to_swa(LocRuns(rtt, rows, pos0, indptr), out=out)
    want = torch.cat([mapping[rtt[2, 3:20]], mapping[rtt[0, int(f[0]):24]]])
    assert torch.equal(got, want)
    assert (got > 0).all()
