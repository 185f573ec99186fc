"""The engine's window checked against its pools at construction, and its per-step host costs: finished requests'
frees with the prefix cache, a verify step's waits, a forward's host-to-device copies (the tokens stay the same).

The engine runs over `hwkv.engine.synthetic.SyntheticModel` (no weights) on the CPU.
"""
from __future__ import annotations

from typing import List, Tuple

import numpy as np
import pytest
import torch

import hwkv.engine.engine as engine_mod
import hwkv.engine.forward as forward_mod
from hwkv.engine.drafters import prompt_lookup
from hwkv.engine.engine import Engine
from hwkv.engine.pools import build_cache, plan_pools
from hwkv.engine.presets import ModelShape, layer_pattern
from hwkv.engine.sampling import SamplingParams
from hwkv.engine.stats import RunnerStats
from hwkv.engine.synthetic import ReferenceCheck, SyntheticModel, engine_history
from hwkv.errors import ConfigError

from test_engine_defects import CPU, FULL, VOCAB  # noqa: E402  the tiny engine shapes those tests use
from test_engine_defects import SHAPE as HYBRID  # noqa: E402
MODEL_WINDOW = object()  # the shape's window where it has SWA layers, else None

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module


def _cache(shape=HYBRID, page_size=4, prefix_cache=True, context=96, max_running=4, chunk=24):
    plan = plan_pools(shape, context=context, max_running=max_running, chunk=chunk, page_size=page_size,
                      memory=None, device=CPU, prefix_cache=prefix_cache)
    cache = build_cache(shape, plan, torch.float32, CPU, backend_device="cpu")
    model = SyntheticModel(shape, cache.backend, vocab_size=VOCAB, dtype=torch.float32, device=CPU,
                           positions=cache.rtt.max_context_len, seed=3)
    return cache, model


def _engine(shape=HYBRID, window=MODEL_WINDOW, page_size=4, prefix_cache=True, context=96, max_running=4, chunk=24,
            check=False, **kw):
    cache, model = _cache(shape, page_size, prefix_cache, context, max_running, chunk)
    if window is MODEL_WINDOW:
        window = shape.window if shape.swa_layer_ids else None
    e = Engine(cache, model, stats=RunnerStats(shape, cache.plan), vocab_size=VOCAB, window=window,
               prefix_cache=prefix_cache, **kw)
    if check:
        model.check = ReferenceCheck(model, engine_history(e), every=1)
    return e


def _prompts(n=4, system=13, user=7, seed=0, step=5):
    g = torch.Generator(device="cpu").manual_seed(seed)
    head = torch.randint(0, VOCAB, (system,), generator=g).tolist()
    return [head + torch.randint(0, VOCAB, (user + step * i,), generator=g).tolist() for i in range(n)]


def _run(e: Engine, prompts, new=10) -> List[List[int]]:
    rids = [e.add_request(p, SamplingParams(max_new_tokens=new)) for p in prompts]
    out = {}
    while e.has_work():
        out.update((r.rid, r.tokens) for r in e.step())
        e.check_integrity()
    return [out[r] for r in rids]


# ---------------------------------------------------------------------------------- item 1: the window
@pytest.mark.parametrize("shape, window, message", [
    (HYBRID, 4, r"window=4 for the hybrid pools of 'tiny': must be an integer >= 8 \(the model's sliding window 8"),
    (HYBRID, 7, r"window=7 .* >= 8"),
    (HYBRID, None, r"window=None for the hybrid pools of 'tiny': must be an integer >= 8"),
    (HYBRID, 8.0, r"window=8.0 .* must be an integer"),
    (HYBRID, True, r"window=True .* must be an integer"),
    (FULL, 8, r"window=8, but the pools of 'tiny-full' have no SWA pool .*give window=None"),
])
def test_a_window_the_pools_cannot_serve_is_refused_before_anything_changes(shape, window, message):
    """A window below the model's frees SWA slots its layers still read (wrong tokens), None over hybrid pools frees
    none (the SWA pool ran out mid-run), a window over full pools had nothing to release (a bare AttributeError after
    a forward): each a ConfigError at construction, with no request row, page or graph taken."""
    cache, model = _cache(shape)
    rows, held = cache.rtt.available_size(), cache.held_slots()
    with pytest.raises(ConfigError, match=message):
        Engine(cache, model, stats=RunnerStats(shape, cache.plan), vocab_size=VOCAB, window=window)
    assert cache.rtt.available_size() == rows and cache.held_slots() == held
    cache.check_integrity()


def test_the_models_window_or_a_larger_one_runs_and_matches_the_reference():
    """The model's window (numpy integers too) and a larger one (releasing later: the chat bench's mirrored pools)
    give the reference's attention at every forward, and the same tokens."""
    prompts = _prompts(system=21, user=9)
    want = _run(_engine(check=True), prompts)
    assert _run(_engine(window=np.int64(8), check=True), prompts) == want
    assert _run(_engine(window=40, check=True), prompts) == want


def test_a_window_below_the_models_is_accepted_only_where_nothing_ever_slides_out():
    """Rows of context 24 and page 4: under window 21 (= 24 - 4 + 1) no request ever releases anything, so the
    layers read all they need whatever the model's window; window 20 would release a page and is refused."""
    shape = ModelShape(name="wide", layer_is_swa=layer_pattern(2, "sf"), window=32, num_heads=2, num_kv_heads=1,
                       head_dim=8, dtype_bytes=4)
    prompts = [p[:14] for p in _prompts(system=5)]
    want = _run(_engine(shape, context=24, check=True), prompts, new=10)
    assert _run(_engine(shape, window=21, context=24, check=True), prompts, new=10) == want
    with pytest.raises(ConfigError, match=r"window=20 .* >= 21 .*context 24 - page_size 4 \+ 1"):
        _engine(shape, window=20, context=24)


# ---------------------------------------------------------------------------------- item 2: frees at finish
def _count_frees(e: Engine, monkeypatch) -> List[int]:
    calls: List[int] = []
    free = type(e.cache.allocator).free

    def counting(self, loc, with_swa=True):
        calls.append(int(loc.numel()))
        return free(self, loc, with_swa)

    monkeypatch.setattr(type(e.cache.allocator), "free", counting)
    return calls


def _finish_together(e: Engine, prompts, calls: List[int], new=3) -> List[Tuple[int, int]]:
    """Run prompts admitted together to the end; returns (requests finished, allocator frees) of each step that
    finished some."""
    for p in prompts:
        e.add_request(p, SamplingParams(max_new_tokens=new))
    finished = []
    while e.has_work():
        before = len(calls)
        done = e.step()
        e.check_integrity()
        if done:
            finished.append((len(done), len(calls) - before))
    return finished


def test_requests_finishing_together_free_in_two_allocator_calls_with_the_prefix_cache(monkeypatch):
    """Eight requests with different first pages finish in one step: their own references go back in two allocator
    calls (below and from their frontiers), not two per request."""
    e = _engine(max_running=8, chunk=256)
    calls = _count_frees(e, monkeypatch)
    prompts = [[(7 * i + j) % VOCAB for j in range(20)] for i in range(8)]
    assert _finish_together(e, prompts, calls) == [(8, 2)]
    e.clear_prefix_cache()
    assert e.cache.held_slots() == (0, 0)


def test_requests_sharing_cached_pages_finishing_together_leak_nothing(monkeypatch):
    """Requests that took the same cached pages each hold a reference to them; a free drops one reference per
    distinct page, so they must not be freed in one call: after they finish together every reference is
    accounted for (`check_integrity` after each step) and clearing the cache frees every page. One round of two
    frees per request sharing the system prompt, the others in the first."""
    e = _engine(max_running=8, chunk=256)
    calls = _count_frees(e, monkeypatch)
    system = _prompts(1, system=16, user=0)[0]
    _finish_together(e, [system + [1, 2, 3]], calls)  # the system prompt's pages are cached now
    prompts = [system + [(5 * i + j) % VOCAB for j in range(6)] for i in range(4)] + \
        [[(7 * i + j) % VOCAB for j in range(22)] for i in range(1, 4)]
    for p in prompts:
        e.add_request(p, SamplingParams(max_new_tokens=3))
    e.step()
    assert sorted(r.reused for r in e.scheduler.running) == [0, 0, 0, 16, 16, 16, 16]
    assert _finish_together(e, [], calls) == [(7, 8)]
    e.clear_prefix_cache()
    assert e.cache.held_slots() == (0, 0)


# ---------------------------------------------------------------------------------- item 3: a verify step's waits
def test_a_verify_step_waits_on_the_device_once_and_its_memory_statistics_are_complete(monkeypatch):
    """The rings' tails after a verify's release are copied to the host without a wait (read with the next
    read-back), never read on the spot; every free count taken is recorded by the end of `generate`, with the
    values a synchronous read gave at that moment."""
    e = _engine(draft=prompt_lookup())
    tails_seen, expected, recorded, early = [], [], [], []
    counts = e.cache.free_counts_async

    def free_counts():
        tails, heads = counts()
        tails_seen.append(tails)
        full, swa = e.cache.held_slots()  # the test's own synchronous read
        cached = (e.prefix.evictable_full, e.prefix.evictable_swa) if e.prefix is not None else (0, 0)
        expected.append((full - cached[0], swa - cached[1]))
        return tails, heads

    monkeypatch.setattr(e.cache, "free_counts_async", free_counts)
    record = e.stats.record_memory
    monkeypatch.setattr(e.stats, "record_memory", lambda held: (recorded.append(tuple(held)), record(held)))
    tolist = torch.Tensor.tolist

    def watched(self):
        if any(self is t for t in tails_seen):
            early.append(self)
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", watched)
    prompts = [p + p[:9] for p in _prompts(2)]
    e.generate(prompts, SamplingParams(max_new_tokens=40))
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    assert e.stats.draft_tokens > 100 and len(tails_seen) > 20  # verify steps ran
    assert not early, f"{len(early)} verify steps waited for the free counts on the spot"
    assert recorded == expected and not e.readback.inflight


# ---------------------------------------------------------------------------------- item 4: a forward's host work
def test_a_forward_sends_its_host_values_in_one_copy_even_when_some_rows_do_not_sample(monkeypatch):
    """A step with a decoding request beside a prompt chunk that does not sample yet: positions, ids, the kept
    tokens and their request rows travel in the one host-to-device copy of the forward (there were three)."""
    e = _engine(prefix_cache=False, chunk=8)
    copies: List[int] = []
    to_device = forward_mod.to_device

    def counting(t, device):
        copies.append(t.numel())
        return to_device(t, device)

    monkeypatch.setattr(forward_mod, "to_device", counting)
    monkeypatch.setattr(engine_mod, "to_device", counting, raising=False)
    e.add_request(list(range(1, 7)), SamplingParams(max_new_tokens=20))
    e.add_request(list(range(10, 50)), SamplingParams(max_new_tokens=2))
    e.step()  # admission (the new rows' frontiers take a copy of their own) and the first chunks
    kinds, per_step = [], []
    while e.has_work():
        rows = e.scheduler.schedule()  # the rows the step schedules too
        kinds.append((e.scheduler.decoding, sum(1 for r in rows if not r.samples)))
        copies.clear()
        e.step()
        per_step.append(len(copies))
        e.check_integrity()
    assert any(d and skip for d, skip in kinds), "no step had a decoding row beside a chunk that does not sample"
    assert all(n == 1 for n in per_step), per_step


def test_positions_and_rows_of_an_extend_are_numpys_and_match_the_per_token_rule():
    """plan_extend's positions and request rows per token, for ragged chunks after ragged prefixes (and none)."""
    from hwkv.allocator import SWATokenToKVPoolAllocator
    from hwkv.req_to_token import ReqToTokenPool
    from hwkv.batch import ForwardMode
    s = forward_mod.ForwardSlots(SWATokenToKVPoolAllocator(512, 256, 4, "cpu", None), ReqToTokenPool(6, 96, "cpu"), 8)
    rows = s.new_rows(4)
    prefix, new = [0, 7, 3, 12], [5, 1, 9, 0]
    ids = np.arange(15, dtype=np.int64) * 3
    lens = s.plan_extend(ForwardMode.MIXED, rows, prefix, new, ids)
    assert lens.pos_dev.tolist() == [p + i for p, n in zip(prefix, new) for i in range(n)]
    assert lens.row_of_dev.tolist() == [r for r, n in zip(rows, new) for _ in range(n)]
    assert lens.ids_dev.tolist() == ids.tolist() and lens.keep_dev is None and lens.where_dev is None
    keep = (np.array([4, 14]), np.array([rows[0], rows[2]]))
    lens = s.plan_extend(ForwardMode.MIXED, rows, prefix, new, ids, keep)
    assert lens.keep_dev.tolist() == [4, 14] and lens.where_dev.tolist() == [rows[0], rows[2]]
    assert all(v.data_ptr() % 16 == 0 for v in (lens.keep_dev, lens.where_dev, lens.pos_dev))
    dec = s.plan_decode(rows, [3, 8, 12, 13], keep=(np.array([1]), np.array([rows[1]])))
    assert dec.keep_dev.tolist() == [1] and dec.where_dev.tolist() == [rows[1]]


@pytest.mark.parametrize("kw", [dict(), dict(prefix_cache=False), dict(overlap=True), dict(chunk=5),
                                dict(chunk=5, overlap=True, prefix_cache=False), dict(draft=prompt_lookup())])
def test_chunked_prefill_beside_decoding_gives_the_references_tokens(kw):
    """Chunks that do not sample beside decoding requests (the kept tokens and their rows from the one copy): every
    forward matches the dense reference."""
    prompts = [p + p[:9] for p in _prompts(system=17)]
    assert len(_run(_engine(check=True, **kw), prompts, new=8)) == len(prompts)
