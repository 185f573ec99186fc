"""The runner's scheduler at exactly-sized pools: a reservation one page short over-admits and fails mid-run.

`hwkv.integrations.scheduler.Scheduler` admits a request only while every running request's worst case fits:
ceil(kv / P) full pages, min(that, the plan's SWA bound) SWA pages, the chunk reserve kept aside. These tests
drive it the way `HybridRunner.step` does, on the engine's step primitives (`hwkv.engine.forward.ForwardSlots`:
admit, schedule, one allocator call per forward, the batched out-of-window release, free on finish) with no model: pools sized by hand for a set of requests must admit them
all at once and run them to the end, and one page fewer must admit fewer at once and still finish. The
scenarios are built so the worst case is reached (every request holds its last full page, or its widest SWA
window, in the same forward), so a reservation rounded down or a page short runs out of slots mid-run.
"""
from __future__ import annotations

from typing import List, Sequence

import pytest

from hwkv.allocator import SWATokenToKVPoolAllocator
from hwkv.req_to_token import ReqToTokenPool
from hwkv.batch import ForwardMode
from hwkv.engine.forward import ForwardSlots
from hwkv.engine.plan import swa_tokens_per_request
from hwkv.integrations.hf_model import PoolPlan
from hwkv.integrations.sampling import SamplingParams
from hwkv.integrations.scheduler import Request, Scheduler

P, W = 4, 8
SWA_PAGES = 4           # swa_tokens_per_request(8, 4) = round_up(8 + 4 + 4, 4) = 16 tokens: ceil(W / P) + 2 pages
MAX_RUNNING = 8         # request rows never bind here: only pages do


def test_the_hand_computed_swa_bound_is_the_plans():
    assert swa_tokens_per_request(W, P) == SWA_PAGES * P


def _requests(prompts: Sequence[int], new: int) -> List[Request]:
    return [Request(i, [3 + i] * n, SamplingParams(max_new_tokens=new)) for i, n in enumerate(prompts)]


class _Run:
    """What one run did: requests admitted by the first admit, most running at once, peak pool use (tokens,
    after a forward's allocation, before its release), forwards."""

    def __init__(self) -> None:
        self.first = self.most = self.peak_full = self.peak_swa = self.steps = 0


def _plan(size: int, size_swa: int, chunk: int) -> PoolPlan:
    return PoolPlan(size=size, size_swa=size_swa, page_size=P, context=64, max_running=MAX_RUNNING, chunk=chunk,
                    full_bytes_per_token=1, swa_bytes_per_token=1, memory_bytes=0)


def drive(size: int, size_swa: int, chunk: int, reqs: List[Request]) -> _Run:
    """Every request to the end, as HybridRunner.step runs them (no model: each sample is token 1)."""
    plan = _plan(size, size_swa, chunk)
    sched = Scheduler(plan, W)
    alloc = SWATokenToKVPoolAllocator(size, size_swa, P, "cpu", None)
    slots = ForwardSlots(alloc, ReqToTokenPool(MAX_RUNNING, 64 + P, "cpu"), W)
    for r in reqs:
        sched.add(r)
    run = _Run()
    while sched.has_work():
        admitted = sched.admit()
        if run.steps == 0:
            run.first = len(admitted)
        for r, row in zip(admitted, slots.new_rows(len(admitted))):
            r.row = row
        run.most = max(run.most, len(sched.running))
        rows = sched.schedule()
        assert rows, "running requests but nothing scheduled: the run would hang"
        new_pages = sum(-(-(r.prefix + r.n) // P) - -(-r.prefix // P) for r in rows if r.req.prefilling)
        assert new_pages <= plan.chunk_reserve // P, f"a forward's prompt chunks take {new_pages} new pages, " \
                                                     f"more than the chunk reserve's {plan.chunk_reserve // P}"
        rws, prefix = [r.req.row for r in rows], [r.prefix for r in rows]
        if all(r.n == 1 and r.prefix > 0 for r in rows):
            lens = slots.plan_decode(rws, prefix)
        else:
            lens = slots.plan_extend(ForwardMode.EXTEND, rws, prefix, [r.n for r in rows])
        slots.allocate(lens)
        run.peak_full = max(run.peak_full, size - alloc.full_available_size())
        run.peak_swa = max(run.peak_swa, size_swa - alloc.swa_available_size())
        slots.release(lens.rows, lens.seq, lens.rows_dev, lens.seq_dev)
        done = []
        for r in rows:
            r.req.kv_len += r.n
            if r.samples and r.req.add_token(1):
                done.append(r.req)
        if done:
            slots.free([r.row for r in done], [r.kv_len for r in done])
            for r in done:
                sched.finish(r)
        sched.check_integrity(MAX_RUNNING - slots.rtt.available_size())
        run.steps += 1
    alloc.check_integrity()
    assert alloc.full_available_size() == size and alloc.swa_available_size() == size_swa, "slots leaked"
    assert all(len(r.output) == r.params.max_new_tokens for r in reqs)
    return run


# Full pool, in lockstep: 3 requests of prompt 12 + 10 new tokens store kv = 21 tokens each: ceil(21 / 4) = 6 full
# pages (rounded down: 5). A chunk of 36 prefills all three prompts in the first forward, so they decode side by
# side and each holds its 6th page in the same (last) forward: the full pool's worst case, 3 x 6 pages, is reached.
# SWA: min(6, 4) = 4 pages each beside the chunk reserve of 36 tokens (9 pages): 3 x 16 + 36 = 84 tokens.
FULL_CASE = dict(prompts=(12, 12, 12), new=10, chunk=36, size=3 * 6 * P, size_swa=3 * SWA_PAGES * P + 36)


def test_exact_full_pool_admits_every_request_at_once_and_fills_up():
    c = FULL_CASE
    run = drive(c["size"], c["size_swa"], c["chunk"], _requests(c["prompts"], c["new"]))
    assert run.first == run.most == 3
    assert run.peak_full == c["size"]  # the worst case is reached: a page less reserved would overflow


def test_full_pool_one_page_short_admits_fewer_and_finishes():
    c = FULL_CASE
    run = drive(c["size"] - P, c["size_swa"], c["chunk"], _requests(c["prompts"], c["new"]))
    assert run.first == run.most == 2


# SWA pool, windows in phase: 5 requests of prompts 1, 2, 3, 4, 1 with a chunk of 4 tokens (one page of reserve):
# request i < 4 is prefilled in forward i and writes position t in every later forward t; request 4 (prefilled in
# forward 4) writes t - 4. All start a new page in the same forwards, so past position 16 each holds its widest
# window, ceil(W / P) + 2 = 4 SWA pages, at once: 5 x 4 pages beside the 1-page chunk reserve = 21 pages.
# Full: kv = prompt + 24 - 1 = 24, 25, 26, 27, 24 tokens -> 6 + 7 + 7 + 7 + 6 = 33 pages (never binding here).
SWA_CASE = dict(prompts=(1, 2, 3, 4, 1), new=24, chunk=4, size=33 * P, size_swa=(5 * SWA_PAGES + 1) * P)


def test_exact_swa_pool_admits_every_request_at_once_and_reaches_the_window_bound():
    c = SWA_CASE
    run = drive(c["size"], c["size_swa"], c["chunk"], _requests(c["prompts"], c["new"]))
    assert run.first == run.most == 5
    assert run.peak_swa == 5 * SWA_PAGES * P  # every window at its bound in one forward


@pytest.mark.parametrize("short_pages", [1, SWA_PAGES], ids=["one-page", "one-request"])
def test_swa_pool_short_admits_fewer_and_finishes(short_pages):
    """One page fewer (or a whole request's bound fewer): four at once; the fifth waits for a finished one. A
    bound a page short would admit all five, whose windows (5 x 4 pages) overflow the pool mid-run."""
    c = SWA_CASE
    run = drive(c["size"], c["size_swa"] - short_pages * P, c["chunk"], _requests(c["prompts"], c["new"]))
    assert run.first == run.most == 4


def test_chunk_reserve_is_kept_and_bounds_each_forwards_new_pages():
    """The chunk reserve is set aside from the SWA pool (one page less and a request no longer fits beside
    it) and a forward's prompt chunks never take more new pages than it holds (checked in `drive`): a chunk
    of 8 tokens is 2 pages of reserve, and prompts of 10 tokens need 3 forwards' chunks each."""
    reqs = _requests((10, 10, 10), 4)  # kv 13: 4 full pages, SWA min(4, 4) = 4 pages each
    size, size_swa = 3 * 4 * P, (3 * SWA_PAGES + 2) * P
    run = drive(size, size_swa, 8, reqs)
    assert run.first == run.most == 3
    run = drive(size, size_swa - P, 8, _requests((10, 10, 10), 4))
    assert run.first == run.most == 2
    sched = Scheduler(_plan(size, size_swa, 8), W)
    for r in _requests((10, 10, 10), 4):
        sched.add(r)
    assert len(sched.admit()) == 3
    rows = sched.schedule()  # 8 tokens of budget, 2 pages: request 0 takes both
    assert [(r.req.rid, r.prefix, r.n) for r in rows] == [(0, 0, 8)]
    sched.running[0].kv_len = 8
    rows = sched.schedule()  # request 0's last 2 tokens (1 page), then request 1's first page (4 tokens)
    assert [(r.req.rid, r.prefix, r.n) for r in rows] == [(0, 8, 2), (1, 0, 4)]
