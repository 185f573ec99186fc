"""A hypothesis state machine over the prefix cache and the allocator under it: requests start from
matched prefixes, extend, decode, release out of window, finish into the cache; the cache evicts
full and SWA KV; bad operations are refused and change nothing.

After every step: both `check_integrity()`s, the exact reference count of every page (one per
running request holding it, one for the cache), and release safety (every token a later query
of a running request can see still maps to a live SWA slot).
"""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hwkv.allocator import SWATokenToKVPoolAllocator, same_snapshot
from hwkv.release import release_out_of_window_batch
from hwkv.req_to_token import ReqToTokenPool
from hwkv.cache import HybridPrefixCache
from hwkv.errors import CacheError, LocError, OutOfSlotsError
from hwkv.pool import SWAKVPool

SIZE, SIZE_SWA, ROWS, CTX = 256, 64, 5, 128
PREFIXES = [list(range(100, 100 + 40)), list(range(100, 100 + 23)) + list(range(300, 320)), list(range(500, 530))]


class CacheMachine(RuleBasedStateMachine):
    @initialize(page=st.sampled_from([1, 2, 4]), window=st.integers(1, 10))
    def setup(self, page, window):
        self.page, self.window = page, window
        pool = SWAKVPool(SIZE, SIZE_SWA, page, torch.float32, 1, 2, [0], [1], "cpu")
        self.a = SWATokenToKVPoolAllocator(SIZE, SIZE_SWA, page, "cpu", pool)
        self.rtt = ReqToTokenPool(ROWS, CTX, "cpu")
        self.cache = HybridPrefixCache(self.a, window)
        self.reqs = {}  # row -> dict(ids, seq, frontier, lock)
        self.finished = []  # token ids of finished requests (a later turn continues one)

    # ---- running requests ---------------------------------------------------------------------
    def _alloc(self, row, n):
        r = self.reqs[row]
        s = r["seq"]
        last = self.rtt.req_to_token[row, s - 1:s] if s else torch.zeros(1, dtype=torch.int64)
        try:
            loc = self.a.alloc_extend([s], [s + n], last, n)
        except OutOfSlotsError:
            return False
        self.rtt.write(row, s, loc)
        r["seq"] = s + n
        return True

    @precondition(lambda self: self.rtt.available_size() > 0)
    @rule(which=st.integers(0, 2), cut=st.integers(0, 40), extra=st.integers(1, 12))
    def start(self, which, cut, extra):
        self._start(PREFIXES[which][:cut] + list(range(900 + extra, 900 + 2 * extra)))

    @precondition(lambda self: self.rtt.available_size() > 0 and self.finished)
    @rule(pick=st.integers(0, 9), extra=st.integers(1, 8))
    def next_turn(self, pick, extra):
        """Multi-turn chat: the whole earlier conversation is the prefix."""
        prev = self.finished[pick % len(self.finished)]
        if len(prev) + extra < CTX - 2:
            self._start(prev + list(range(2000 + extra, 2000 + 2 * extra)))

    def _start(self, ids):
        match = self.cache.match_prefix(ids[:-1])
        assert match.length % self.page == 0 and match.length <= len(ids) - 1
        assert match.locs.numel() == match.length
        row = self.rtt.alloc(1)[0]
        lock, frontier = self.cache.acquire(match, self.rtt, row)
        self.reqs[row] = dict(ids=ids, seq=match.length, frontier=frontier, lock=lock)
        if not self._alloc(row, len(ids) - match.length):
            self._finish(row, cache=False)

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 9))
    def decode(self, pick):
        rows = sorted(self.reqs)
        row = rows[pick % len(rows)]
        r = self.reqs[row]
        if r["seq"] < CTX - 1 and self._alloc(row, 1):
            r["ids"] = r["ids"] + [1000 + r["seq"]]

    @precondition(lambda self: self.reqs)
    @rule()
    def release(self):
        rows = sorted(self.reqs)
        f = torch.tensor([self.reqs[r]["frontier"] for r in rows])
        release_out_of_window_batch(self.a, self.rtt.req_to_token, torch.tensor(rows),
                                    torch.tensor([self.reqs[r]["seq"] for r in rows]), f, self.window)
        for r, v in zip(rows, f.tolist()):
            self.reqs[r]["frontier"] = v

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 9))
    def cache_running(self, pick):
        """Cache a running request's tokens (e.g. after its prefill), SWA window included."""
        row = sorted(self.reqs)[pick % len(self.reqs)]
        r = self.reqs[row]
        r["lock"] = self.cache.cache_running(r["ids"], self.rtt, row, r["seq"], r["frontier"], r["lock"])

    def _finish(self, row, cache=True):
        r = self.reqs[row]
        if cache:
            self.finished.append(r["ids"][:r["seq"]])
        del self.reqs[row]
        self.cache.release_request(r["ids"], self.rtt, row, r["seq"], r["frontier"], r["lock"], cache=cache)
        self.rtt.free(row)

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 9), cache=st.booleans())
    def finish(self, pick, cache):
        self._finish(sorted(self.reqs)[pick % len(self.reqs)], cache)

    # ---- the cache on its own -------------------------------------------------------------------
    @rule(frac=st.floats(0, 1))
    def evict(self, frac):
        n = int(self.cache.evictable_full * frac)
        before = self.a.full_available_size()
        freed = self.cache.evict(n)
        # unlocked nodes are the cache's alone: the pool gains exactly what eviction reports
        assert freed >= n and self.a.full_available_size() - before == freed

    @rule(frac=st.floats(0, 1))
    def evict_swa(self, frac):
        n = int(self.cache.evictable_swa * frac)
        before = self.a.swa_available_size()
        freed = self.cache.evict_swa(n)
        assert freed >= n and self.a.swa_available_size() - before == freed

    @precondition(lambda self: self.rtt.available_size() > 0 and self.finished)
    @rule(pick=st.integers(0, 9), frac=st.floats(0, 1), swa=st.booleans())
    def stale_match(self, pick, frac, swa):
        """Evicting between match and acquire (an admission making room) makes the match stale: acquire
        refuses it with nothing changed, and a new match starts the request."""
        ids = self.finished[pick % len(self.finished)] + [4242]
        match = self.cache.match_prefix(ids[:-1])
        if swa:
            self.cache.evict_swa(int(self.cache.evictable_swa * frac))
        else:
            self.cache.evict(int(self.cache.evictable_full * frac))
        row = self.rtt.alloc(1)[0]
        snap = (self.a.integrity_snapshot(), self.rtt.req_to_token.clone())
        try:
            lock, frontier = self.cache.acquire(match, self.rtt, row)
        except CacheError:
            assert same_snapshot(snap[0], self.a.integrity_snapshot())
            assert torch.equal(snap[1], self.rtt.req_to_token)
            match = self.cache.match_prefix(ids[:-1])
            lock, frontier = self.cache.acquire(match, self.rtt, row)
        self.reqs[row] = dict(ids=ids, seq=match.length, frontier=frontier, lock=lock)
        if not self._alloc(row, len(ids) - match.length):
            self._finish(row, cache=False)

    @rule()
    def refused(self):
        """Evicting more than is evictable, a wrong dtype, a dead insert: typed errors, nothing changes."""
        snap = (self.a.integrity_snapshot(), self.cache.full_tokens, self.cache.swa_tokens,
                self.cache.evictable_full, self.cache.evictable_swa)
        with pytest.raises(CacheError):
            self.cache.evict(self.cache.evictable_full + 1)
        with pytest.raises(CacheError):
            self.cache.evict_swa(self.cache.evictable_swa + 1)
        with pytest.raises(LocError):
            self.cache.match_prefix(torch.tensor([1.0, 2.0]))
        dead = torch.tensor([SIZE + self.page - 1] * self.page)  # the last page: not live unless in use
        if int(self.a.pages.refs[-1]) < 1:
            with pytest.raises(Exception) as e:
                self.cache.insert(list(range(7000, 7000 + self.page)), dead, 0)
            assert "free" in str(e.value) or "never" in str(e.value)
        after = (self.a.integrity_snapshot(), self.cache.full_tokens, self.cache.swa_tokens,
                 self.cache.evictable_full, self.cache.evictable_swa)
        assert after[1:] == snap[1:]
        assert same_snapshot(snap[0], after[0])

    @rule(which=st.integers(0, 2), cut=st.integers(1, 40))
    def lock_match(self, which, cut):
        """An outside holder (a scheduler reserving a prefix) locks a match; eviction must skip it."""
        self.held = getattr(self, "held", [])
        m = self.cache.match_prefix(PREFIXES[which][:cut])
        self.held.append(self.cache.lock(m))

    @precondition(lambda self: getattr(self, "held", None))
    @rule(pick=st.integers(0, 9))
    def unlock_one(self, pick):
        lock = self.held.pop(pick % len(self.held))
        self.cache.unlock(lock)
        with pytest.raises(CacheError, match="already released"):
            self.cache.unlock(lock)

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 9))
    def locked_node_refused(self, pick):
        r = self.reqs[sorted(self.reqs)[pick % len(self.reqs)]]
        if r["lock"].node is not self.cache.root:
            from hwkv.cache import PrefixMatch
            with pytest.raises(CacheError, match="locked"):
                self.cache.evict_node(PrefixMatch(0, None, 0, r["lock"].node))

    # ---- invariants -----------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        if not hasattr(self, "a"):
            return
        a, p, c = self.a, self.page, self.cache
        a.check_integrity()
        c.check_integrity()
        full_refs = np.zeros(SIZE // p + 1, dtype=np.int64)
        swa_refs = np.zeros(SIZE // p + 1, dtype=np.int64)  # indexed by full page
        for row, r in self.reqs.items():
            s, f = r["seq"], r["frontier"]
            locs = self.rtt.req_to_token[row, :s].numpy()
            pages = np.unique(locs // p)
            full_refs[pages] += 1
            swa_refs[np.unique(locs[f:] // p)] += 1
            m = a.full_to_swa_index_mapping
            assert f <= max(s - self.window + 1, 0) or f == 0
            assert bool((m[self.rtt.req_to_token[row, f:s]] > 0).all()), "a visible token lost its SWA slot"
        for nd in c._nodes():
            pages = np.unique(nd.locs.numpy() // p)
            full_refs[pages] += 1
            if nd.swa:
                swa_refs[pages] += 1
        refs = a.pages.refs.numpy()
        live = full_refs > 0
        assert np.array_equal(refs[live], full_refs[live]), "full page references != holders"
        assert (refs[1:][~live[1:]] <= 0).all(), "a page nobody holds is live"
        m = a.full_to_swa_index_mapping.numpy()
        sp = m[np.arange(SIZE // p + 1) * p] // p
        srefs = a.swa_attn_allocator.pages.refs.numpy()
        held = swa_refs > 0
        assert (sp[held] > 0).all(), "a held SWA page is unmapped"
        assert np.array_equal(srefs[sp[held]], swa_refs[held]), "SWA page references != holders"


CacheTest = CacheMachine.TestCase
CacheTest.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
