"""Defects of the prefix cache's release, the engine's pool sizing and the allocators' typed refusals found by
review, each pinned by a test that failed before its fix: `release_request` checks its frontier (and, without
caching, everything else) before it unlocks or frees; the default budget and the all-SWA plan cap each request's
SWA share at its context as `plan()` does; float lengths, rows, windows and locs are refused, not truncated."""
import numpy as np
import pytest
import torch

from hwkv.allocator import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator, same_snapshot
from hwkv.release import release_out_of_window_batch
from hwkv.req_to_token import ReqToTokenPool
from hwkv.cache import HybridPrefixCache
from hwkv.engine.engine import Engine
from hwkv.engine.plan import plan
from hwkv.engine.pools import build_cache, kv_bytes_needed, plan_pools
from hwkv.engine.presets import ModelShape, get_preset, layer_pattern
from hwkv.engine.sampling import SamplingParams
from hwkv.engine.stats import RunnerStats
from hwkv.engine.synthetic import SyntheticModel
from hwkv.errors import ConfigError, LocError
from hwkv.pool import SWAKVPool

P, W = 4, 4
CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module


def T(*xs, dtype=torch.int64):
    return torch.tensor(xs, dtype=dtype)


class Setup:
    """One request of 8 tokens whose two pages the cache shares (`cache_running` at its prefill)."""

    def __init__(self, seq=8, size_swa=64):
        pool = SWAKVPool(64, size_swa, P, torch.float32, 1, 2, [0], [1], "cpu")
        self.a = SWATokenToKVPoolAllocator(64, size_swa, P, "cpu", pool)
        self.rtt = ReqToTokenPool(4, 32, "cpu")
        self.c = HybridPrefixCache(self.a, W)
        self.ids = list(range(100, 100 + seq))
        self.row = self.rtt.alloc(1)[0]
        self.rtt.write(self.row, 0, self.a.alloc_extend([0], [8], [0], 8))
        self.lock = self.c.cache_running(self.ids[:8], self.rtt, self.row, 8, 0)
        self.seq, self.frontier = 8, 0

    def grow(self, seq):
        """Decode on to `seq` tokens in one extend, then release out of the window: the frontier moves."""
        r = self.rtt.req_to_token
        self.rtt.write(self.row, self.seq, self.a.alloc_extend([self.seq], [seq], r[self.row, self.seq - 1:self.seq],
                                                               seq - self.seq))
        f = T(self.frontier)
        release_out_of_window_batch(self.a, r, T(self.row), T(seq), f, W)
        self.seq, self.frontier = seq, int(f)

    def release(self, frontier="own", cache=True, row=None):
        return self.c.release_request(self.ids, self.rtt, self.row if row is None else row, self.seq,
                                      self.frontier if frontier == "own" else frontier, self.lock, cache=cache)

    def snapshot(self):
        c = self.c
        nodes = sorted((nd.start, nd.end, tuple(nd.locs.tolist()), nd.swa, nd.lock_full,
                        tuple(sorted(nd.swa_locks.items()))) for nd in c._nodes())
        return (self.a.integrity_snapshot(), self.rtt.req_to_token.clone(), list(self.rtt._free), self.lock.active,
                (c.full_tokens, c.swa_tokens, c.evictable_full, c.evictable_swa, c._nodes_count), nodes)

    def unchanged(self, call, exc, match):
        before = self.snapshot()
        with pytest.raises(exc, match=match):
            call()
        after = self.snapshot()
        assert same_snapshot(before[0], after[0]) and torch.equal(before[1], after[1]) and before[2:] == after[2:]
        self.check()

    def check(self):
        self.a.check_integrity()
        self.c.check_integrity()
        self.rtt.check_integrity()

    def empty(self):
        self.c.evict(self.c.evictable_full)
        self.check()
        return self.a.full_available_size() == 64 and self.a.swa_available_size() == self.a.size_swa


# ---- 1. release_request checks its frontier (and, without caching, the rest) before any change -----------------
@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("frontier", [2, 12, 100, -4, 4.0, None, True])
def test_release_request_refuses_a_frontier_off_the_page_grid_or_past_seq_len(cache, frontier):
    """frontier 2 freed the page holding it twice (once per free call); past seq_len it leaked the request's SWA."""
    s = Setup()
    s.unchanged(lambda: s.release(frontier, cache=cache), LocError,
                rf"frontier {frontier!r} .*multiple of page_size 4 in \[0, seq_len 8\]")
    assert s.release(cache=cache) == 0 and not s.lock.active
    assert s.empty()


def test_release_request_without_caching_checks_the_row_before_unlocking():
    """A row the request does not hold was refused only by the free, after the lock was released."""
    s = Setup()
    s.unchanged(lambda: s.release(cache=False, row=s.row + 1), LocError, r"page 0 of a slot .* outside \[1, 16\]")
    assert s.lock.active
    s.release(cache=False)
    assert s.empty()


@pytest.mark.parametrize("cache", [False, True])
def test_release_request_refuses_a_frontier_behind_the_requests(cache):
    """Without caching, a frontier behind the request's dropped SWA references it no longer held: the cache's."""
    s = Setup()
    s.grow(20)
    assert s.frontier == 12
    s.unchanged(lambda: s.release(0, cache=cache), LocError, r"has no SWA slot .*pass the request's release frontier")
    s.release(cache=cache)
    assert s.empty()


@pytest.mark.parametrize("cache", [False, True])
def test_release_request_at_the_frontier_frees_everything(cache):
    s = Setup()
    s.grow(18)
    s.release(cache=cache)
    s.check()
    assert s.empty()


def _second_request(s):
    """A second request of 8 tokens (other ids) in its own row and pages, its prompt cached with its own lock."""
    row = s.rtt.alloc(1)[0]
    s.rtt.write(row, 0, s.a.alloc_extend([0], [8], [0], 8))
    ids = list(range(200, 208))
    return ids, row, s.c.cache_running(ids, s.rtt, row, 8, 0)


@pytest.mark.parametrize("bad", ["float ids", "row twice"])
def test_release_requests_checks_every_request_before_any_changes(bad):
    """release_requests had checked the token ids only in the insert, after earlier requests were inserted and
    unlocked (their pages then leaked: the retry found the lock released), and took a row named twice."""
    s = Setup()
    ids2, row2, lock2 = _second_request(s)
    first = (s.ids, s.row, 8, 0, s.lock)
    second = ([1.5] * 8, row2, 8, 0, lock2) if bad == "float ids" else (s.ids, s.row, 8, 0, None)
    before = s.snapshot()
    with pytest.raises(LocError, match="integers" if bad == "float ids" else f"row {s.row} is named twice"):
        s.c.release_requests([first, second], s.rtt)
    after = s.snapshot()
    assert same_snapshot(before[0], after[0]) and torch.equal(before[1], after[1]) and before[2:] == after[2:]
    assert s.lock.active and lock2.active
    s.c.release_requests([first, (ids2, row2, 8, 0, lock2)], s.rtt)
    assert s.empty()


# ---- 2. the default budget and the all-SWA plan cap each request's SWA share at its context --------------------
W4096 = ModelShape(name="w4096", layer_is_swa=layer_pattern(6, "sssssf"), window=4096, num_heads=8, num_kv_heads=4,
                   head_dim=64, dtype_bytes=2)
ALL_SWA = ModelShape(name="allswa", layer_is_swa=layer_pattern(4, "s"), window=4096, num_heads=8, num_kv_heads=4,
                     head_dim=64, dtype_bytes=2)


@pytest.mark.parametrize("shape, ctx, running, chunk, page", [(W4096, 512, 8, 512, 16), ("gemma-2-27b", 2048, 16, 2048, 16),
                                                              ("gemma-2-27b", 8192, 4, 2048, 16), (W4096, 100, 3, 7, 4)])
@pytest.mark.parametrize("prefix_cache", [False, True])
def test_default_budget_is_exactly_what_plan_needs(shape, ctx, running, chunk, page, prefix_cache):
    """kv_bytes_needed sized SWA for the whole window where plan() caps it at the context (6.3x, 1.49x too much)."""
    shape = get_preset(shape) if isinstance(shape, str) else shape
    need = kv_bytes_needed(shape, ctx, page, running, chunk, prefix_cache)
    kw = dict(page_size=page, chunk=chunk, max_running=running, prefix_cache=prefix_cache)
    assert plan(shape, need, ctx, **kw).max_running == running
    with pytest.raises(ConfigError, match=f"at most {running - 1} fit"):
        plan(shape, need - 1, ctx, **kw)


def test_default_budget_plan_pools():
    pp = plan_pools(W4096, context=512, max_running=8, chunk=512, page_size=16, memory=None, device=CPU)
    assert pp.memory_bytes == kv_bytes_needed(W4096, 512, 16, 8, 512) == 27885568  # was 175996928
    assert (pp.max_running, pp.size, pp.size_swa) == (8, 8 * 512, 8 * 512 + 512)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_all_swa_plan_caps_each_request_at_its_context(prefix_cache):
    """64 MiB for requests of context 512 under a window of 4096: 30 fit (plan()'s rule), 3 were admitted."""
    pp = plan_pools(ALL_SWA, context=512, max_running=64, chunk=512, page_size=16, memory=64 << 20, device=CPU,
                    prefix_cache=prefix_cache)
    per, b = 512 * (2 if prefix_cache else 1), ALL_SWA.bytes_per_token_swa_group
    assert pp.max_running == ((64 << 20) - (512 + 16) * b) // (per * b) == (30 if per == 512 else 15)
    assert (pp.size, pp.size_swa) == (pp.max_running * 512, pp.max_running * per + 512)


TINY = ModelShape(name="tiny-w64", layer_is_swa=layer_pattern(4, "sf"), window=64, num_heads=4, num_kv_heads=2,
                  head_dim=16, dtype_bytes=4)
TINY_ALL_SWA = ModelShape(name="tiny-all-swa", layer_is_swa=layer_pattern(2, "s"), window=64, num_heads=4,
                          num_kv_heads=2, head_dim=16, dtype_bytes=4)


@pytest.mark.parametrize("shape", [TINY, TINY_ALL_SWA], ids=["hybrid", "all-swa"])
@pytest.mark.parametrize("prefix_cache", [False, True])
def test_engine_runs_full_context_requests_in_the_smaller_pools(shape, prefix_cache):
    """Pools sized with the context cap (window 64 > context 24) still hold every admitted request's worst case:
    all four run at once to their full context, with no allocation failing mid-run."""
    ctx, running = 24, 4
    pp = plan_pools(shape, context=ctx, max_running=running, chunk=16, page_size=4, memory=None, device=CPU,
                    prefix_cache=prefix_cache)
    assert pp.max_running == running and pp.size_swa == running * ctx * (2 if prefix_cache else 1) + 16
    cache = build_cache(shape, pp, torch.float32, CPU, backend_device="cpu")
    model = SyntheticModel(shape, cache.backend, vocab_size=97, dtype=torch.float32, device=CPU,
                           positions=cache.rtt.max_context_len, seed=3)
    e = Engine(cache, model, stats=RunnerStats(shape, pp), vocab_size=97, window=shape.window,
               prefix_cache=prefix_cache)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 97, (15,), generator=g).tolist() for _ in range(running)]
    for p in prompts + prompts:  # the second round reuses the cached prompts
        e.add_request(p, SamplingParams(max_new_tokens=ctx - 15 + 1))
    most, done = 0, 0
    while e.has_work():
        done += len(e.step())
        most = max(most, len(e.scheduler.running))
        e.check_integrity()
    assert done == 2 * running and most == running


# ---- 3. typed refusals: floats are not truncated, an allocator without an SWA ring is named ---------------------
def hybrid():
    pool = SWAKVPool(64, 32, P, torch.float32, 1, 2, [0], [1], "cpu")
    a = SWATokenToKVPoolAllocator(64, 32, P, "cpu", pool)
    rtt = ReqToTokenPool(4, 32, "cpu")
    row = rtt.alloc(1)[0]
    rtt.write(row, 0, a.alloc_extend([0], [20], [0], 20))
    return a, rtt, row


def refused(a, rtt, call, exc, match):
    before = (a.integrity_snapshot(), rtt.req_to_token.clone(), list(rtt._free))
    with pytest.raises(exc, match=match):
        call()
    assert same_snapshot(before[0], a.integrity_snapshot())
    assert torch.equal(before[1], rtt.req_to_token) and before[2] == rtt._free
    a.check_integrity()
    rtt.check_integrity()


def test_release_out_of_window_batch_refuses_floats():
    a, rtt, row = hybrid()
    r = rtt.req_to_token
    f = T(0)
    refused(a, rtt, lambda: release_out_of_window_batch(a, r, T(row), T(20.9, dtype=torch.float32), f, W), LocError,
            r"seq_lens must hold integers, got torch.float32")
    refused(a, rtt, lambda: release_out_of_window_batch(a, r, T(float(row), dtype=torch.float64), T(20), f, W),
            LocError, r"req_pool_indices must hold integers, got torch.float64")
    for window in (2.5, 4.0, "4", True):
        refused(a, rtt, lambda: release_out_of_window_batch(a, r, T(row), T(20), f, window), ConfigError,
                rf"window={window!r} must be an integer")
    assert f.tolist() == [0]
    release_out_of_window_batch(a, r, T(row), T(20), f, np.int64(W))
    assert f.tolist() == [12]
    a.check_integrity()


@pytest.mark.parametrize("immediate", [True, False])
def test_release_out_of_window_batch_refuses_an_allocator_without_swa(immediate):
    a = PagedTokenToKVPoolAllocator(64, P, "cpu")
    a.immediate = immediate
    rtt = ReqToTokenPool(4, 32, "cpu")
    rtt.write(0, 0, a.alloc_extend([0], [20], [0], 20))
    refused(a, rtt, lambda: release_out_of_window_batch(a, rtt.req_to_token, T(0), T(20), T(0), W), ConfigError,
            r"PagedTokenToKVPoolAllocator has no SWA pool")
    assert release_out_of_window_batch(a, rtt.req_to_token, T(0), T(20), T(0), None).tolist() == [0]  # no window


def test_req_to_token_pool_refuses_what_it_truncated_or_crashed_on():
    a, rtt, row = hybrid()
    refused(a, rtt, lambda: rtt.write(row, 20, T(4.7, dtype=torch.float32)), LocError,
            r"locs must hold integers, got torch.float32")
    refused(a, rtt, lambda: rtt.write(row, 20, torch.zeros(2, 2, dtype=torch.int64)), LocError,
            r"locs must be a 1-D tensor, got shape \[2, 2\]")
    refused(a, rtt, lambda: rtt.write(row, 20, [4, 5]), LocError, r"locs must be a 1-D tensor, got list")
    refused(a, rtt, lambda: rtt.write(row, 1.5, T(4)), LocError, r"start 1.5 .* must be an integer")
    refused(a, rtt, lambda: rtt.row_locs(row, 4.5), LocError, r"seq_len 4.5 must be an integer")
    for n in (-1, 1.5, None, True):
        refused(a, rtt, lambda: rtt.alloc(n), ConfigError, rf"alloc\({n!r}\): need_size must be an integer >= 0")
    refused(a, rtt, lambda: rtt.free(1.5), LocError, r"request rows must be an integer or a sequence of integers")
    assert rtt.alloc(0) == [] and rtt.alloc(np.int64(1)) == [1]
    rtt.free(np.int64(1))
    rtt.free(torch.tensor(row))
    assert rtt.available_size() == 4
    rtt.check_integrity()


@pytest.mark.parametrize("loc", [[1000], [68], [-2], [5, 1000]])
def test_allocator_translate_refuses_a_loc_outside_the_table(loc):
    a, rtt, row = hybrid()
    refused(a, rtt, lambda: a.translate_loc_from_full_to_swa(T(*loc)), LocError,
            r"loc holds values in .*allowed range is \[-1, 68\)")
    refused(a, rtt, lambda: a.translate_loc_from_full_to_swa(T(4.0, dtype=torch.float32)), LocError,
            r"loc must be int64, got torch.float32")
    assert a.translate_loc_from_full_to_swa(T(-1, 4, 67)).tolist()[::2] == [-1, 0]
