"""Review 35 (test-suite audit by mutation): single-line mutants of hwkv/engine/plan.py, hwkv/engine/scheduler.py,
hwkv/engine/prefixing.py, hwkv/release.py, hwkv/loc.py, hwkv/req_to_token.py and hwkv/metadata.py that the rest of
the suite let through, each pinned here by a small deterministic CPU test that passes on the code as it is and fails
with the mutant applied (each test's docstring names its mutant as `module:line  original -> mutant`).
"""
import dataclasses

import pytest
import torch

from hwkv.allocator import SWATokenToKVPoolAllocator, same_snapshot
from hwkv.engine.pools import PoolPlan
from hwkv.engine.sampling import SamplingParams
from hwkv.engine.scheduler import Request, Scheduler
from hwkv.errors import CapacityError, ConfigError, LocError, OutOfSlotsError
from hwkv.release import release_out_of_window_batch

pytestmark = pytest.mark.usefixtures("one_thread")

I64 = torch.int64
CPU = torch.device("cpu")


def _plan(size=256, size_swa=256, page=4, context=64, chunk=8, max_running=8, swa_bytes=1):
    return PoolPlan(size=size, size_swa=size_swa, page_size=page, context=context, max_running=max_running,
                    chunk=chunk, full_bytes_per_token=1, swa_bytes_per_token=swa_bytes, memory_bytes=0)


def _req(rid, n, new=4, temperature=0.0):
    return Request(rid, [3 + rid] * n, SamplingParams(max_new_tokens=new, temperature=temperature))


# ------------------------------------------------------------------------------------------- hwkv/engine/plan.py
def test_an_all_swa_plan_below_its_fit_gives_the_full_pool_one_context_per_running_request():
    """plan.py:232  `size = running * full_need` -> `size = fit * full_need`. An all-SWA model's full pool holds locs
    only, one context per running request; with --max-running below what fits, the mutant sized it for every request
    that fits (here 1MiB fits far more than 4), so `hwkv plan` and the engine's pools (plan_pools) reported and built
    a full pool several times too large. Existing tests compared only max_running and the SWA pool."""
    from hwkv.engine.plan import plan
    from hwkv.engine.pools import plan_pools
    from hwkv.engine.presets import custom_shape

    shape = custom_shape(layers=4, pattern="ssss", window=8, heads=4, kv_heads=2, head_dim=16)
    p = plan(shape, 2**20, 64, page_size=16, max_running=4, chunk=16)
    assert p.max_running == 4 and p.full_pool_tokens == 4 * 64 and p.full_pool_bytes == 0
    assert plan(shape, 2**20, 64, page_size=16, chunk=16).max_running > 4   # (the fit is larger: the mutant shows)
    engine = plan_pools(shape, context=64, max_running=4, chunk=16, page_size=16, memory="1MiB", device="cpu")
    assert engine.size == 4 * 64


# ------------------------------------------------------------------------------------------- hwkv/engine/scheduler.py
def test_a_request_one_page_past_the_full_pool_is_refused_when_added():
    """scheduler.py:152  `req.full_pages > self.full_capacity` -> `> self.full_capacity + 1`. A request within the
    plan's context whose worst case is one page more than the whole full pool was queued; no admission could ever
    take it, so `admit` raised its "scheduler bug" error later instead of `add` refusing it up front."""
    s = Scheduler(_plan(size=32, size_swa=0, swa_bytes=0), None)   # 8 pages of 4, context 64
    s.add(_req(0, 29, new=4))   # 32 KV slots: 8 pages, exactly the pool
    with pytest.raises(OutOfSlotsError, match="needs 33 KV slots"):
        s.add(_req(1, 30, new=4))   # 33 slots: 9 pages


def test_full_pages_left_counts_a_partly_filled_page_as_held():
    """scheduler.py:203  `_pages(r.kv_len, P)` -> `r.kv_len // P`. The pages a running request still allocates are
    its reservation less the pages it holds, a partly filled last page included; the mutant counted that page as
    still to come, so a prefix-cache admission (`EnginePrefix.start`, need = pages left + its own) asked one page
    too many per running request mid-page and refused requests that fit."""
    s = Scheduler(_plan(), 8)
    r = _req(0, 10, new=7)   # 16 KV slots: 4 pages
    s.add(r)
    s.admit()
    r.kv_len = 5             # two pages held, the second partly filled
    assert s.full_pages_left() == 2
    r.kv_len = 8
    assert s.full_pages_left() == 2


def test_schedule_counts_only_the_prompt_tokens_it_scheduled():
    """scheduler.py:221  `self.prefill_tokens = self.plan.chunk - tokens_left` -> `= self.plan.chunk`. The step's
    prompt tokens (the stats' `prefill_tokens`, and whether the engine holds Ctrl-C around the forward) were the
    whole chunk budget every step, decode-only steps included."""
    s = Scheduler(_plan(chunk=8), 8)
    r = _req(0, 5)
    s.add(r)
    s.admit()
    s.schedule()
    assert s.prefill_tokens == 5
    r.kv_len = 5
    r.output.append(1)
    rows = s.schedule()
    assert [(row.n, row.samples) for row in rows] == [(1, True)] and s.prefill_tokens == 0 and s.decoding == 1


def test_a_finished_sampling_request_leaves_the_scheduler_greedy_again():
    """scheduler.py:240  `self.non_greedy -= not req.params.greedy` -> `pass`. Once a request sampling at a
    temperature finished, the scheduler still counted it, so every later all-greedy step built the sampling
    tensors (engine.py: `if not self.scheduler.non_greedy`) instead of taking the argmax-only path."""
    s = Scheduler(_plan(), 8)
    hot, cold = _req(0, 4, temperature=0.7), _req(1, 4)
    s.add(hot)
    s.add(cold)
    s.admit()
    assert s.non_greedy == 1
    s.finish(hot)
    assert s.non_greedy == 0
    s.finish(cold)
    assert s.non_greedy == 0


def test_a_windowed_scheduler_over_a_plan_without_an_swa_pool_reserves_no_swa_pages():
    """scheduler.py:130  `plan.size_swa > 0` -> `plan.size_swa >= 0`. A scheduler given the model's window over a
    plan with no SWA pool (size_swa 0: a full-attention cache, as the chat bench's all-full variant plans) is not
    hybrid: requests reserve no SWA pages. The mutant made it hybrid with an SWA capacity of 0 (less the chunk), so
    every request was refused as short of SWA pages."""
    s = Scheduler(_plan(size_swa=0, swa_bytes=0), 8)
    assert not s.hybrid
    r = _req(0, 10)
    s.add(r)
    assert r.swa_pages == 0 and s.admit() == [r]


# ------------------------------------------------------------------------------------------- hwkv/engine/prefixing.py
def _engine(full_slots=None, page=1):
    from hwkv.engine.engine import Engine
    from hwkv.engine.pools import build_cache, plan_pools
    from hwkv.engine.presets import ModelShape, layer_pattern
    from hwkv.engine.stats import RunnerStats
    from hwkv.engine.synthetic import SyntheticModel

    shape = ModelShape(name="t", layer_is_swa=layer_pattern(2, "sf"), window=8, num_heads=2, num_kv_heads=1,
                       head_dim=8, dtype_bytes=4)
    plan = plan_pools(shape, context=64, max_running=2, chunk=64, page_size=page, memory=None, device=CPU,
                      prefix_cache=True)
    if full_slots is not None:
        plan = dataclasses.replace(plan, size=full_slots, size_swa=max(plan.size_swa, 512))
    cache = build_cache(shape, plan, torch.float32, CPU, backend_device="cpu")
    model = SyntheticModel(shape, cache.backend, vocab_size=50, dtype=torch.float32, device=CPU,
                           positions=cache.rtt.max_context_len, seed=3)
    return Engine(cache, model, stats=RunnerStats(shape, plan), vocab_size=50, window=8, prefix_cache=True,
                  overlap=False)


def test_a_refused_admission_is_not_tried_again_until_a_request_leaves_or_the_cache_gains():
    """prefixing.py:40  `if self.refused_at == state:` -> `if False:`. A refused queue head stays refused until a
    request leaves or the cache gains K/V; the mutant matched its prompt again (and read the device's free count)
    every step while a decoding request held the pool, touching the matched nodes' recency each time."""
    from hwkv.engine.sampling import SamplingParams as SP

    e = _engine(full_slots=60)
    tree = e._prefixing.tree
    calls = []
    match = tree.match_prefix
    tree.match_prefix = lambda *a, **k: (calls.append(1), match(*a, **k))[1]
    e.add_request([1, 2, 3, 4], SP(max_new_tokens=40))   # 43 full slots of 60
    e.step()
    e.add_request([5, 6, 7, 8], SP(max_new_tokens=40))   # 43 more: refused while the first one runs
    for _ in range(6):
        e.step()
    assert len(e.scheduler.running) == 1 and len(e.scheduler.waiting) == 1
    assert len(calls) == 2   # the first request's admission and the second's one refusal


def test_stale_bound_rounds_the_cached_length_down_to_a_page_and_is_never_negative():
    """prefixing.py:76  `... - cached // p * p)` -> `... - cached)`, and `max(0, ...)` -> `(...)`. The bound on the
    history a prompt's caching may lock is the stretch from the page holding `cached` (whole pages are cached) to the
    prompt's window start; `cache_prompts` passes an unaligned `seq` (a chunk ending mid-page), where the first
    mutant bounded it a part-page short. The second let a short prompt's bound go negative, which lowered the
    scheduler's `stale` sum below the stretches actually pending (admission then counted them as evictable)."""
    e = _engine(page=4)
    px = e._prefixing
    assert e.cache.plan.page_size == 4 and px.tree.window == 8
    long = _req(0, 30)      # window start of 30 with W 8, P 4: (30 - 8 + 1) // 4 * 4 = 20
    assert px.stale_bound(long, 10) == 20 - 8
    assert px.stale_bound(long, 8) == 20 - 8
    short = _req(1, 6)      # window start 0
    assert px.stale_bound(short, 4) == 0


def test_make_room_evicts_only_the_shortfall():
    """prefixing.py:108  `short = (pages - ring.free_pages()) * p` -> `short = pages * p`. Room for a forward's
    pages evicts what the free pages lack; the mutant evicted as many cached tokens as the forward's pages though
    25 of the 30 were free, dropping cached history later requests would have matched."""
    e = _engine(full_slots=65)
    e.generate([[1, 2]], SamplingParams(max_new_tokens=19))
    e.generate([[3, 4]], SamplingParams(max_new_tokens=19))
    px, a = e._prefixing, e.cache.allocator
    assert a.full_available_size() == 25 and px.evictable()[0] == 40
    px.make_room_for(30)
    assert a.full_available_size() >= 30
    assert px.evictable()[0] > 40 - 30   # 5 tokens short: one leaf goes, not 30 tokens' worth
    e.check_integrity()


def test_can_make_room_when_free_and_evictable_pages_are_exactly_enough():
    """prefixing.py:118  `free_pages() + evictable() // p >= pages` -> `> pages`. A draft step whose pages the free
    and evictable pages hold exactly is allowed (`Engine._propose`); the mutant skipped drafting at the tie."""
    e = _engine(full_slots=65)
    e.generate([[1, 2]], SamplingParams(max_new_tokens=19))
    e.generate([[3, 4]], SamplingParams(max_new_tokens=19))
    px = e._prefixing
    assert e.cache.allocator.full_available_size() + px.evictable()[0] == 65
    assert px.can_make_room_for(65)
    assert not px.can_make_room_for(66)


# ------------------------------------------------------------------------------------------- hwkv/release.py
def _alloc(size=256, size_swa=64, page=4):
    return SWATokenToKVPoolAllocator(size, size_swa, page, "cpu", None)


def test_batched_release_refuses_a_length_one_past_req_to_token():
    """release.py:128  `s.max() > rtt.shape[1]` -> `> rtt.shape[1] + 1`. A seq_len one past req_to_token's width
    (no such position) was taken and released pages by it; it is refused with nothing changed."""
    a = _alloc()
    rtt = torch.zeros(1, 16, dtype=I64)
    rtt[0] = a.alloc_extend([0], [16], [0], 16)
    snap, f = a.integrity_snapshot(), torch.zeros(1, dtype=I64)
    with pytest.raises(LocError, match="length 17 is beyond req_to_token's 16"):
        release_out_of_window_batch(a, rtt, torch.tensor([0]), torch.tensor([17]), f, 4)
    assert same_snapshot(snap, a.integrity_snapshot()) and int(f[0]) == 0
    release_out_of_window_batch(a, rtt, torch.tensor([0]), torch.tensor([16]), f, 4)
    assert int(f[0]) == 8   # 16 - 4 + 1 = 13 -> page 12, one page behind: 8


def test_batched_release_refuses_a_frontier_of_minus_one_at_page_size_one():
    """release.py:132  `f.min() < 0` -> `f.min() < -1`. At page size 1 a frontier of -1 passes the page-grid check;
    the mutant let it through, and the release read req_to_token[row, -1] (the row's last column) as the first
    page to free. It is refused as negative with nothing changed."""
    a = _alloc(64, 32, 1)
    rtt = torch.zeros(1, 32, dtype=I64)
    rtt[0, :20] = a.alloc_extend([0], [20], [0], 20)
    snap, f = a.integrity_snapshot(), torch.tensor([-1])
    with pytest.raises(LocError, match="frontier -1 is negative"):
        release_out_of_window_batch(a, rtt, torch.tensor([0]), torch.tensor([20]), f, 4)
    assert same_snapshot(snap, a.integrity_snapshot()) and int(f[0]) == -1


def test_a_by_row_release_is_host_checked_even_where_the_device_releases_by_row():
    """release.py:75  `if by_row and (checks or not releases_by_row)` -> `if by_row and (not releases_by_row)`. In
    debug mode (immediate checks) a by_row release goes through the host checks even on a device whose page ops
    release by row (CUDA's); the mutant handed it to the device op unchecked. Here a page-op set that releases by row
    (a stand-in for the device's) records its calls: the bad frontier must be refused by the host checks, and a good
    release reaches the op per request, without by_row."""
    from hwkv.torch_page_ops import TORCH_OPS

    calls = []

    class ByRowOps(type(TORCH_OPS)):
        releases_by_row = True

        def release_window(self, *args, **kwargs):
            calls.append(kwargs)
            return super().release_window(*args, **kwargs)

    a = _alloc()
    rtt = torch.zeros(2, 32, dtype=I64)
    rtt[1, :30] = a.alloc_extend([0], [30], [0], 30)
    a._ops = ByRowOps()
    table = torch.tensor([0, 2])   # row 1's frontier is off the page grid
    with pytest.raises(LocError, match="not a multiple of page_size"):
        release_out_of_window_batch(a, rtt, torch.tensor([1]), torch.tensor([30]), table, 4, by_row=True)
    assert calls == [] and table.tolist() == [0, 2]
    table[1] = 0
    release_out_of_window_batch(a, rtt, torch.tensor([1]), torch.tensor([30]), table, 4, by_row=True)
    assert table.tolist() == [0, 20] and calls and all("by_row" not in kw for kw in calls)


@pytest.mark.parametrize("window", [0, None])
def test_a_batched_release_without_a_window_releases_nothing(window):
    """release.py:38  `if not window:` -> `if window is None:`. Window 0 means no window (check_window: None or <= 0);
    the mutant released with W = 0, as if no later query saw any key, and freed every page but the last."""
    a = _alloc()
    rtt = torch.zeros(1, 32, dtype=I64)
    rtt[0, :30] = a.alloc_extend([0], [30], [0], 30)
    snap, f = a.integrity_snapshot(), torch.zeros(1, dtype=I64)
    assert release_out_of_window_batch(a, rtt, torch.tensor([0]), torch.tensor([30]), f, window) is f
    assert int(f[0]) == 0 and same_snapshot(snap, a.integrity_snapshot())


# ------------------------------------------------------------------------------------------- hwkv/loc.py
def test_a_swa_loc_one_longer_than_loc_is_trimmed_to_it():
    """loc.py:24  `if m > n:` -> `if m > n + 1:`. A graph buffer one entry longer than the forward's locs was kept
    whole, so the write would have gone one slot past the live prefix."""
    from hwkv.loc import KVWriteLoc

    w = KVWriteLoc(torch.tensor([5, 6, 7]), torch.tensor([1, 2, 3, 9]))
    assert w.swa_loc.tolist() == [1, 2, 3]


def test_translations_of_reads_a_list_refill_passed_by_position():
    """loc.py:81  `args[2] if len(args) > 2` -> `args[1] if len(args) > 1`. `translate_loc_from_full_to_swa(loc, out,
    lists)` passes the ListRefill third; the mutant read `out` there and counted one translation, not 1 + windows."""
    from hwkv.loc import ListRefill, translations_of

    z = torch.zeros(1, dtype=I64)
    lists = ListRefill(*([z] * 11), torch.zeros(2, 4, dtype=I64))
    loc, out = torch.tensor([1, 2]), torch.zeros(2, dtype=I64)
    assert translations_of(loc, out, lists) == 3 == translations_of(loc, out=out, lists=lists)
    assert translations_of(loc, out) == 1


def test_a_graph_refill_before_its_buffer_is_a_capacity_error():
    """loc.py:128  `if self.buffer is None:` -> `if False:`. A refill before `alloc_graph_buffer` is refused as a
    CapacityError naming the missing call; the mutant failed with an AttributeError on None."""
    from hwkv.loc import SWALocCache

    class Pool:
        def translate_loc_from_full_to_swa(self, loc, out=None, lists=None):
            raise AssertionError("not reached")

    with pytest.raises(CapacityError, match="before alloc_graph_buffer"):
        SWALocCache(Pool()).refill(torch.tensor([1, 2]))


# ------------------------------------------------------------------------------------------- hwkv/req_to_token.py
def test_a_req_to_token_pool_of_no_rows_is_refused():
    """req_to_token.py:23  `n < 1` -> `n < 0`. A pool of size 0 was built (a table of no rows: every alloc an
    OutOfSlotsError); it is a ConfigError naming the size, as the message says (integers >= 1)."""
    from hwkv.req_to_token import ReqToTokenPool

    with pytest.raises(ConfigError, match="size=0"):
        ReqToTokenPool(0, 8, "cpu")
    assert ReqToTokenPool(1, 8, "cpu").available_size() == 1


# ------------------------------------------------------------------------------------------- hwkv/metadata.py
def test_kept_range_grows_by_doubling():
    """metadata.py:183  `self._make(max(n, 2 * t.shape[0]))` -> `self._make(n)`. A KeptRange grows by doubling (its
    docstring), so a forward one token longer than the last does not reallocate the constant; the mutant grew it to
    exactly n, a new tensor (and a host allocation) every time the batch grew by a token."""
    from hwkv.metadata import KeptRange

    r = KeptRange(I64, CPU, start=4)
    v5 = r(5)
    assert v5.tolist() == [0, 1, 2, 3, 4]
    v7 = r(7)
    assert v7.tolist() == list(range(7)) and v7.data_ptr() == v5.data_ptr()   # grown once, to 8
