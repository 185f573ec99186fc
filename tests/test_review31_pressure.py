"""Review 31 (the engine's admission, prefix caching and eviction under memory pressure, and `Engine.abort`).

The failing tests are defects; the `test_pinned_*` tests at the end pin behaviour verified while reviewing. Every run
is the engine over `hwkv.engine.synthetic.SyntheticModel` on the CPU with `check_integrity()` after every step and,
once every request finished and the prefix cache was cleared, no slot held.

What held under review (a random search of ~4,000 runs, each against the same prompts with the prefix cache off: W
1..16, page sizes 1/2/4/8, chunks 3..24, 1-4 rows, full pools from one context up, SWA pools at the scheduler's
minimum, shared system prompts and prompts that are prefixes of others, overlap, aborts of queued / prefilling /
decoding requests with the same prompt queued again, `clear_prefix_cache()` mid-run; plus, after every step, that no
unlocked cache node shares a page with a running request): tokens equal, nothing leaked, no deadlock, admission
never over-committed. The defects found are on the paths the engine promises to survive a Ctrl-C on
(docs/architecture.md, "The overlapped loop": "a forward that ran keeps its lengths even when its prompt caching or
release raises (the next step's catch up ...)"; "A request whose last token was read stays listed until its hand-over
... is done, with Ctrl-C held; one a Ctrl-C kept from it is finished by the next step"; `abort` "takes the same
path").
"""
from __future__ import annotations

import random
import signal
from typing import Dict, List, Sequence, Tuple

import pytest

import hwkv.engine.forward as forward_mod
from hwkv.engine.engine import Engine
from hwkv.engine.sampling import SamplingParams
from hwkv.errors import ConfigError
from test_engine_defects import _run as _run_checked
from test_review30_exceptions import _drain_interrupted, _interrupt_first_call
from test_review31_windows import VOCAB, _engine as _window_engine

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module



def _engine(**kw) -> Engine:
    """review 31's window engine over the synthetic model without its reference check (`full_pages`: a full pool of
    that many pages, memory pressure)."""
    return _window_engine(check=False, **kw)


def _tokens(n: int, seed: int) -> List[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def _run(e: Engine, prompts: Sequence[Sequence[int]], new: int = 10) -> List[List[int]]:
    """Every prompt to the end, integrity checked after every step; nothing held once the cache is cleared."""
    return _run_checked(e, None, prompts, new=new)


def _drain(e: Engine) -> Tuple[Dict[int, List[int]], List[str]]:
    """review 30's interrupted run over every request the engine holds: (each one's tokens by id, the errors)."""
    rids = sorted(e.requests)
    got, errors = _drain_interrupted(e, rids, limit=3, max_steps=60)
    return dict(zip(rids, got)), errors


# ---- 1. Ctrl-C inside the last prompt chunk's release: its cache nodes stay unlocked, admission over-commits -------
def test_ctrl_c_in_the_last_prompt_chunks_release_does_not_over_commit_the_full_pool(monkeypatch):
    """After a prompt chunk's forward, `Engine._step` caches the chunk unlocked (`cache_prompts(rows, lock=False)`,
    hwkv/engine/engine.py:432), runs the out-of-window release (engine.py:433) and only then moves the request's lock
    over those nodes (`cache_prompts(rows, lock=True)` -> `cache_running`, engine.py:435). A Ctrl-C in the release of
    a prompt's LAST chunk skips the lock, and no later step catches it up: `cache_prompts` only visits rows still in
    their prompt (hwkv/engine/prefixing.py:133), and the request now decodes. Its prompt's pages then sit in unlocked
    nodes (counted in `evictable_full`) while the request still holds them, so an eviction of those nodes frees
    nothing. Admission (`EnginePrefix.start`, prefixing.py:45-55) counts them as room: request B is admitted (and the
    nodes "evicted" for it, freeing no page) although A's and B's worst cases exceed the pool.
    Expected (the engine's contract: "a forward that ran keeps its lengths even when its prompt caching or release
    raises (the next step's catch up)"): the run goes on to the tokens of the run without the prefix cache.
    Actual: once both decode, every step raises OutOfSlotsError "a forward needs 1 pages in the full pool, 0 are free
    and the prefix cache holds nothing evictable: admission reserved less than the running requests take (a bug)"
    and neither request can ever progress. Pool of 26 full pages (page 4); A and B: 40-token prompts, 20 new tokens
    (15 pages each); the whole prompt is one chunk."""
    a, b = _tokens(40, 5), _tokens(40, 6)
    want = _run(_engine(chunk=48, full_pages=26, max_running=2, prefix_cache=False), [a, b], new=20)
    assert _run(_engine(chunk=48, full_pages=26, max_running=2), [a, b], new=20) == want  # uninterrupted: fine
    e = _engine(chunk=48, full_pages=26, max_running=2)
    fired = _interrupt_first_call(monkeypatch, forward_mod, "release_out_of_window_batch")
    rids = [e.add_request(p, SamplingParams(max_new_tokens=20)) for p in (a, b)]
    out, errors = _drain(e)
    assert fired, "the release was never reached"
    assert not errors, "\n".join(errors)
    assert [out.get(r) for r in rids] == want
    e.clear_prefix_cache()
    assert e.cache.held_slots() == (0, 0)


# ---- 2. Ctrl-C in abort's hand-over: the aborted request never leaves -------------------------------------------
@pytest.mark.parametrize("when", ["prefilling", "decoding"])
def test_ctrl_c_in_aborts_hand_over_does_not_strand_the_request(monkeypatch, when):
    """`Engine.abort` marks a running request finished ("abort") and hands it over with a bare `self._finish([req])`
    (hwkv/engine/engine.py:276): not through `_finishing` and not under `interrupts_held`, as the step's hand-over of
    a finished request is since review 31 (`_finish_pending`, engine.py:503-511). A Ctrl-C in that hand-over (here: as
    the prefix cache's `release_requests` starts, before anything changed) leaves the request in
    `scheduler.running` with `finish_reason == "abort"`, its row, reservation, lock and pages, and nothing ever
    finishes it: a decoding one is never scheduled again (`decodes` is False), a prefilling one goes on being
    prefilled (`prefilling` ignores `finish_reason`), samples a token that is dropped, and then stays too.
    `has_work()` stays True for ever (a server loop `while e.has_work(): e.step()` spins).
    Expected ("A request whose last token was read stays listed until its hand-over ... is done ...; one a Ctrl-C
    kept from it is finished by the next step", and abort "takes the same path"): the next steps finish it and the
    engine runs dry with nothing held. Actual: still running after 60 steps."""
    e = _engine(chunk=8)
    rid = e.add_request(_tokens(30, 1), SamplingParams(max_new_tokens=6))
    for _ in range(1 if when == "prefilling" else 5):
        e.step()
        e.check_integrity()
    req = e.requests[rid]
    assert req.prefilling == (when == "prefilling") and req.finish_reason is None
    assert not _interrupt_first_call(monkeypatch, e.prefix, "release_requests")  # (armed)
    with pytest.raises(KeyboardInterrupt):
        e.abort(rid)
    out, errors = _drain(e)
    assert not errors, "\n".join(errors)
    assert rid not in e.requests and not e.has_work()
    e.clear_prefix_cache()
    assert e.cache.held_slots() == (0, 0)


def test_a_real_ctrl_c_inside_aborts_hand_over_leaves_a_request_that_can_neither_leave_nor_be_aborted_again(
        python_sigint):
    """The same hand-over (`Engine.abort` -> `_finish`, hwkv/engine/engine.py:276) runs with Ctrl-C live: a SIGINT
    arriving after `HybridPrefixCache.release_requests` unlocked the request's lock and dropped some of its references
    (here: right after the hand-over's first allocator free, hwkv/cache.py:561) raises there. The request stays in
    `scheduler.running` with an inactive lock and only part of its references: `check_integrity()` reports a leak, a
    second `abort(rid)` raises CacheError "this prefix lock was already released" (its released lock is refused,
    hwkv/cache.py:524-525), and no step finishes it. The step's own hand-over holds Ctrl-C for exactly this
    (`interrupts_held` in `_finish_pending`, engine.py:508).
    Expected: the hand-over lands whole (Ctrl-C raised after it, or the request finished by a later step/abort) and
    nothing leaks. Actual: CacheError on the second abort, a leak, has_work() True for ever."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("Python's own SIGINT handler is not installed here")
    e = _engine(chunk=8)
    rid = e.add_request(_tokens(30, 2), SamplingParams(max_new_tokens=8))
    for _ in range(6):
        e.step()
    allocator = e.cache.allocator
    free, fired = allocator.free, []

    def free_then_sigint(*args, **kwargs):
        out = free(*args, **kwargs)
        if not fired:
            fired.append(1)
            signal.raise_signal(signal.SIGINT)
        return out

    allocator.free = free_then_sigint
    try:
        try:
            e.abort(rid)
        except KeyboardInterrupt:
            pass
    finally:
        allocator.free = free
    assert fired
    if rid in e.requests:  # interrupted: aborting it again must finish it
        e.abort(rid)
    e.check_integrity()
    out, errors = _drain(e)
    assert not errors, "\n".join(errors)
    assert rid not in e.requests and not e.has_work()
    e.clear_prefix_cache()
    assert e.cache.held_slots() == (0, 0)


# ---- 3. a Ctrl-C held through a finished request's hand-over discards its Result --------------------------------
def test_a_ctrl_c_held_through_the_hand_over_does_not_lose_the_finished_requests_result(python_sigint):
    """`_finish_pending` (hwkv/engine/engine.py:503-511) runs the finished requests' hand-over under
    `interrupts_held`: a Ctrl-C arriving then is raised when the block ends, i.e. after `_finish` removed the requests
    from `self.requests` and `_finishing` was cleared, and the `return results` it raises over is lost. `step`'s
    handler (engine.py:385-387) puts back only the results it carried in, not these. So the request has left the
    engine, its Result never comes from any step, it is not in `unclaimed`, and `abort(rid)` returns None ("already
    finished: its Result came from step"). A server loop never answers that client.
    Expected: the Result comes with the next step (as results a failed verify finished do: `_carry`). Actual: lost.
    One request, 3 new tokens; a real SIGINT delivered inside the prefix cache's hand-over."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("Python's own SIGINT handler is not installed here")
    prompt = _tokens(30, 3)
    want = _run(_engine(chunk=8, prefix_cache=False), [prompt], new=3)
    e = _engine(chunk=8)
    rid = e.add_request(prompt, SamplingParams(max_new_tokens=3))
    original, fired = e.prefix.release_requests, []

    def sigint_inside(*args, **kwargs):
        out = original(*args, **kwargs)
        if not fired:
            fired.append(1)
            signal.raise_signal(signal.SIGINT)  # held by interrupts_held, raised as the block ends
        return out

    e.prefix.release_requests = sigint_inside
    out, errors = _drain(e)
    assert fired
    assert not errors, "\n".join(errors)
    got = out.get(rid) or (e.unclaimed[rid].tokens if rid in e.unclaimed else None)
    assert [got] == want, "the finished request's Result never came"


# ---- pinned: behaviour verified while reviewing -------------------------------------------------------------------
def test_pinned_queueing_with_tiny_pools_aborts_and_clears_match_the_run_without_the_prefix_cache():
    """Prompts sharing a system prompt (and one a prefix of another) that cannot all fit at once in a full pool of
    one context plus a little: queued, admitted from the cache under eviction; one request aborted while
    prefilling, one while decoding and one while queued, each queued again; the prefix cache clear refused mid-run. The
    tokens equal the run without the prefix cache, integrity holds after every step, nothing stays held."""
    head = _tokens(19, 7)
    prompts = [head + _tokens(5 + 6 * i, 10 + i) for i in range(5)]
    prompts.append(prompts[2][:27])
    want = _run(_engine(prefix_cache=False, full_pages=30, max_running=3, chunk=8, context=64), prompts, new=9)
    e = _engine(full_pages=30, max_running=3, chunk=8, context=64)
    rid_of = {e.add_request(p, SamplingParams(max_new_tokens=9)): i for i, p in enumerate(prompts)}
    out: Dict[int, List[int]] = {}
    aborted = set()
    steps = 0
    while e.has_work():
        steps += 1
        assert steps < 400
        for rid, i in list(rid_of.items()):
            req = e.requests.get(rid)
            if req is None or i in aborted:
                continue
            if (i == 0 and req.row >= 0 and req.prefilling and req.kv_len > 0) or \
                    (i == 1 and req.row >= 0 and len(req.output) >= 3) or (i == 5 and req.row < 0 and steps > 2):
                res = e.abort(rid)
                assert res is not None and res.finish_reason == "abort"
                e.check_integrity()
                aborted.add(i)
                del rid_of[rid]
                rid_of[e.add_request(prompts[i], SamplingParams(max_new_tokens=9))] = i
        if steps == 12:   # refused while requests run (they would cache their K/V again: review 37), nothing evicted
            cached = (e.prefix.full_tokens, e.prefix.swa_tokens)
            with pytest.raises(ConfigError, match="while .* request"):
                e.clear_prefix_cache()
            assert (e.prefix.full_tokens, e.prefix.swa_tokens) == cached
            e.check_integrity()
        for r in e.step():
            if r.rid in rid_of:
                out[rid_of[r.rid]] = r.tokens
        e.check_integrity()
    assert aborted == {0, 1, 5}
    e.clear_prefix_cache()
    assert e.cache.held_slots() == (0, 0)
    assert [out[i] for i in range(len(prompts))] == want
