"""Review 20 (prefix caching): admission against the cached history a running prompt's caching locks later.

A request whose match was cut back (its window reached a tombstone) recomputes the cached history past its match;
caching its prompt (`HybridPrefixCache.cache_running`) locks that history's SWA nodes wholly below its frontier as a
second copy. Admission counted another prefilling request's such stretch as evictable, so a request admitted beside
it over-committed the full pool and a later step raised make_room_for's "(a bug)" OutOfSlotsError, every step after
too. Each running request now carries a bound on that stretch (`Request.stale`, summed in `Scheduler.stale`), which
admission does not count as evictable. Also: a refused queue head is tried again once the cache gains K/V that may
lengthen its match (a running prompt reviving tombstones adds no new tokens), not only when a request leaves.

The engine runs over `hwkv.engine.synthetic.SyntheticModel` on the CPU: one SWA and one full layer, page 1, W 8.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import pytest
import torch

from hwkv.engine.engine import Engine
from hwkv.engine.pools import build_cache, plan_pools
from hwkv.engine.presets import ModelShape, layer_pattern
from hwkv.engine.sampling import SamplingParams
from hwkv.engine.stats import RunnerStats
from hwkv.engine.synthetic import SyntheticModel

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module

CPU = torch.device("cpu")
W, VOCAB = 8, 50
SHAPE = ModelShape(name="t", layer_is_swa=layer_pattern(2, "sf"), window=W, num_heads=2, num_kv_heads=1,
                   head_dim=8, dtype_bytes=4)
Added = Dict[int, List[Tuple[List[int], int]]]  # step -> (prompt, max_new_tokens) queued before it


def _engine(chunk: int, full_slots: Optional[int] = None, prefix_cache: bool = True, context: int = 64,
            max_running: int = 2) -> Engine:
    """Pools as `plan_pools` sizes them for 2 requests of 64 tokens (a full pool of 128), or `full_slots`."""
    plan = plan_pools(SHAPE, context=context, max_running=max_running, chunk=chunk, page_size=1, memory=None,
                      device=CPU, prefix_cache=prefix_cache)
    if full_slots is not None:
        plan = dataclasses.replace(plan, size=full_slots, size_swa=max(plan.size_swa, 512))
    cache = build_cache(SHAPE, plan, torch.float32, CPU, backend_device="cpu")
    model = SyntheticModel(SHAPE, cache.backend, vocab_size=VOCAB, dtype=torch.float32, device=CPU,
                           positions=cache.rtt.max_context_len, seed=3)
    return Engine(cache, model, stats=RunnerStats(SHAPE, plan), vocab_size=VOCAB, window=W,
                  prefix_cache=prefix_cache, overlap=False)


def _history(e: Engine) -> List[int]:
    """A first turn, a short prompt and a long answer: its 20 tokens are cached as [0,2) SWA, [2,12) a tombstone
    (decoded tokens below its final frontier) and [12,20) SWA."""
    r = e.generate([[1, 2]], SamplingParams(max_new_tokens=19))[0]
    return ([1, 2] + r.tokens)[:20]


def _trimmed(history: List[int]) -> List[int]:
    """The history cut 2 tokens before its end, and a new user part: its match is cut back to 2, and the history's
    [12,18) is a stale SWA stretch that caching this prompt locks as a second copy."""
    return history[:18] + list(range(7, 17))


def _drive(e: Engine, added: Added, steps: int = 200) -> Dict[int, List[int]]:
    """Queue `added` at their steps and run to the end, checking integrity after every step; the tokens by rid
    (of every request that waits, runs or is added)."""
    out, rids = {}, list(e.requests)
    for s in range(steps):
        for prompt, new in added.get(s, []):
            rids.append(e.add_request(prompt, SamplingParams(max_new_tokens=new)))
        for r in e.step():
            out[r.rid] = r.tokens
        e.check_integrity()
        if not e.has_work() and s >= max(added, default=0):
            break
    assert sorted(out) == sorted(rids), "not every request finished"
    return out


def _plain(requests: List[Tuple[List[int], int]]) -> List[List[int]]:
    """The same requests' tokens without the prefix cache."""
    e = _engine(64, prefix_cache=False, context=256)
    return [r.tokens for r in e.generate([p for p, _ in requests],
                                         [SamplingParams(max_new_tokens=n) for _, n in requests])]


def _idle(e: Engine) -> None:
    """Nothing runs or waits, nothing is locked or counted as a pending stretch, and once the cache is cleared
    every pool and request row is free."""
    c, a, plan = e.prefix, e.cache.allocator, e.cache.plan
    assert not e.has_work() and e.scheduler.stale == 0 and e.scheduler.reserved_full == 0
    assert (c.evictable_full, c.evictable_swa) == (c.full_tokens, c.swa_tokens), "a lock outlived its request"
    e.clear_prefix_cache()
    e.check_integrity()
    assert (c.full_tokens, c.swa_tokens, c.evictable_full, c.evictable_swa) == (0, 0, 0, 0)
    assert (a.full_available_size(), a.swa_available_size()) == (plan.size, plan.size_swa)
    assert e.cache.rtt.available_size() == e.cache.rtt.size - 1  # all but the padding row


def test_requests_admitted_in_one_round_beside_a_stale_stretch_finish():
    """A (its match cut back, a stale stretch of 6) and B (a cached prompt) queued together, pools as the planner
    sizes them: B's admission must not count A's stretch as evictable. Before the fix step 34 raised
    OutOfSlotsError "(a bug)", and every step after it."""
    e = _engine(64)
    a_prompt = _trimmed(_history(e))
    common = [3] * 28
    e.generate([common], SamplingParams(max_new_tokens=1))  # a common prompt, cached whole with its SWA
    requests = [(a_prompt, 37), (common, 36)]
    out = _drive(e, {0: requests})
    assert [out[rid] for rid in sorted(out)] == _plain(requests)
    _idle(e)


def test_a_request_admitted_between_the_chunks_of_a_stale_stretch_finishes():
    """B queued while A is between its prompt chunks (chunk 10), before A's stretch is locked. Before the fix step
    21 raised OutOfSlotsError "(a bug)"."""
    e = _engine(10, full_slots=68)
    a_prompt = _trimmed(_history(e))
    requests = [(a_prompt, 20), ([5], 20)]
    out = _drive(e, {0: requests[:1], 1: requests[1:]})
    assert [out[rid] for rid in sorted(out)] == _plain(requests)
    _idle(e)


def test_history_released_onto_a_queued_prompts_path_after_its_admission_is_not_counted_as_evictable():
    """The cache may gain the history past a request's match after its admission: A (admitted from an empty
    cache) continues B's conversation, B's release caches B's last window on A's path while A waits for D's long
    prompt, and C, admitted then, must not count that window as evictable, since caching A's prompt locks it as a
    second copy. So a bound measured on the tree at A's admission is not enough: A's is the rest of its prompt up
    to its last window start. Measured at admission (0 here), step 29 raised OutOfSlotsError "(a bug)"; so did
    the code before the fix."""
    b_prompt = [4, 5]
    b_out = _plain([(b_prompt, 12)])[0]
    a_prompt = b_prompt + b_out[:11] + list(range(10, 30))
    requests = [(b_prompt, 12), ([7] * 200, 18), (a_prompt, 16), ([9, 9, 9], 16)]
    e = _engine(16, full_slots=288, context=256, max_running=4)
    out = _drive(e, {0: requests})
    assert [out[rid] for rid in sorted(out)] == _plain(requests)
    _idle(e)


def test_an_abort_while_the_stale_stretch_is_pending_takes_its_bound_back():
    """A's bound is counted from its admission and shrinks with each chunk it caches; aborting A while it is
    pending takes it back (the sum returns to 0). B, admitted beside A, runs on to the plain tokens, and once
    everything ended the cache and the pools are idle."""
    e = _engine(10, full_slots=68)
    a_prompt = _trimmed(_history(e))
    a_rid = e.add_request(a_prompt, SamplingParams(max_new_tokens=20))
    b_rid = e.add_request([5, 6], SamplingParams(max_new_tokens=20))
    e.step()  # both admitted, A from its match of 2; A's first chunk [2, 12) cached
    e.check_integrity()
    a, b = e.requests[a_rid], e.requests[b_rid]
    assert a.reused == 2 and a.kv_len == 12 and b.row >= 0
    # what its frontier can still pass: its last window start (28 - 8 + 1) less what it has cached
    assert a.stale == e.scheduler.stale == 21 - 12
    assert e.abort(a_rid).finish_reason == "abort"
    assert e.scheduler.stale == 0
    e.check_integrity()
    out = _drive(e, {})
    assert out[b_rid] == _plain([([5, 6], 20)])[0]
    _idle(e)


def test_a_refused_head_is_tried_again_once_a_running_prompt_revives_its_history():
    """R recomputes the trimmed history (its match cut back to 2): caching its prompt revives the tombstone
    [2,12) with its SWA and adds no new token. Q, the whole history and more, was refused beside R; after the
    revival its match is 20 and it fits, so it is admitted at the next step. Before the fix the refusal stood,
    keyed on (requests that left, cached tokens), until R finished."""
    e = _engine(64, full_slots=52)
    history = _history(e)
    full_before = e.prefix.full_tokens
    r_prompt, q_prompt = history[:18], history + [9, 8, 7, 6, 5]
    r = e.add_request(r_prompt, SamplingParams(max_new_tokens=10))
    q = e.add_request(q_prompt, SamplingParams(max_new_tokens=10))
    e.step()
    e.check_integrity()
    assert e.requests[r].reused == 2 and e.requests[q].row < 0  # refused beside R
    assert e.prefix.full_tokens == full_before  # R's prompt revived the tombstone: no new token
    e.step()
    e.check_integrity()
    assert e.requests[q].row >= 0 and e.requests[q].reused == 20
    out = _drive(e, {})
    assert [out[r], out[q]] == _plain([(r_prompt, 10), (q_prompt, 10)])
    _idle(e)
