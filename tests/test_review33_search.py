"""Review 33's injection search: review 32's systematic search (tests/test_review32_injection.py's docstring) rerun on
the code after session 33 put the allocator's, the release's, accept_draft_tokens' and the prefix cache's state
changes under `interrupts_held` (65f4a78). A real SIGINT before each sampled call the engine makes during its steps
(the engine's own methods, Scheduler's and Request's, EnginePrefix's, the prefix cache's, Cache's, the allocator's and
its PageRings', ReqToTokenPool's, ForwardSlots' and StepLens', ReadBack's, RowSampling's and sampling's functions,
RunnerStats', the step graphs', GraphRunner's and EagerAdapter's, the backend's and the pool's, the model, the
drafter and TokenHistory, accept_draft_tokens, the release functions), Python's own SIGINT handler installed, one
thread; then the server loop that survives the KeyboardInterrupt and keeps stepping, `check_integrity()` after every
step, the tokens against the uninterrupted run, nothing held once the prefix cache is cleared. This time injections
inside held regions were kept (the Ctrl-C is raised at the region's end: what matters is what the caller does
then). Coverage: 235 methods, 379 distinct (method, calling line) sites, all injected; 7,559 injected runs over 13
workloads (default, no prefix cache, whole-step + graphs, layers' graphs, overlap, prompt lookup, prompt lookup with
the verify graph, sampling beside greedy with and without overlap, full pools of 20 and 34 pages, prompt lookup in
the 20-page pool, prompt lookup without prefix cache), plus 4,738 injections into `generate()` (8 workloads, a second
generate() after each) and 772 into `abort()` (6 workloads, 4 abort points each, retried after a Ctrl-C). The two
defects below are the only failures (with both fixed the whole search passes): every test here fails on 65f4a78.
Fixed in session 33: `ForwardSlots.release` holds the host's frontier copy with the release, and `_decode_whole`'s
page count runs inside its try.
"""
from __future__ import annotations

import signal
from typing import List

import pytest

import hwkv.release as release_mod
from hwkv.engine.drafters import prompt_lookup
from hwkv.engine.sampling import SamplingParams
from test_review32_injection import GREEDY, _engine, _inside, _once, _prompts, _same_as_uninterrupted, _want

pytestmark = pytest.mark.usefixtures("one_thread", "python_sigint")  # conftest


def _in_decode_step_release(monkeypatch, e):
    """A real SIGINT as the host-side out-of-window release of the first plain decode step starts
    (`hwkv.release._release_on_host`, called inside `release_out_of_window_batch`'s held block, release.py:77-87, which
    holds it to the block's end at release.py:80); the engine holds nothing around a decode step's release."""
    def decode_step():
        return e.scheduler.prefill_tokens == 0 and signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    return _once(monkeypatch, release_mod, "_release_on_host", when=decode_step)


# ---- 1. a Ctrl-C during the out-of-window release is raised after it ran, before the host's frontiers move -------
def test_a_ctrl_c_during_a_decode_steps_release_leaves_the_host_frontiers_with_the_pages(monkeypatch):
    """`ForwardSlots.release` (hwkv/engine/forward.py:281-283) calls `release_out_of_window_batch` and only then moves
    the host's copy of the frontiers (`self.frontiers_cpu[moved[0]] = moved[1]`, forward.py:283), on the word of its
    docstring that "a release interrupted before it ran (Ctrl-C) is run again by the next step". Since 573ef23 the
    by-row release runs under `interrupts_held` (hwkv/release.py:77-80, and 85-88 for the host path): a Ctrl-C during it
    (here: as `_release_on_host`, release.py:87, starts, in the first decode step, where `Engine._step` holds nothing
    around the release: engine.py:466 holds prefill steps only) is no longer raised inside the release but at the end of
    the held block, after the SWA pages went back and the device frontiers moved: the KeyboardInterrupt leaves
    `ForwardSlots.release` at forward.py:281, and the host's frontiers stay one page behind the device's and the
    allocator's. `check_integrity()` after that step fails (holders are counted from the host frontier: "SWA pool: the
    allocator counts N page references, the running requests hold ... a leak"; without a prefix cache "request N lost an
    SWA slot from its frontier on"). Before 573ef23 a Ctrl-C at this call was raised there, before the pages moved (the
    next step's release ran it again). Expected: the pages, the device frontiers and the host's copy land together (e.g.
    the host copy moved inside the same hold, or the hold in `ForwardSlots.release` around both), and the run ends with
    the uninterrupted tokens, every step's integrity holding."""
    want = _want()
    e = _engine()
    fired = _in_decode_step_release(monkeypatch, e)
    _same_as_uninterrupted(e, fired, want)


def test_a_ctrl_c_during_a_release_in_generate_does_not_leave_the_prefix_cache_wrong_k_v(monkeypatch):
    """The same window (hwkv/release.py:87 inside the hold of release.py:77-80, raised out of `ForwardSlots.release` at
    hwkv/engine/forward.py:281 before forward.py:283 moves `frontiers_cpu`), reached from `Engine.generate()`: its
    handler (engine.py:349-357) aborts the run's requests at once, and `abort` -> `_finish` -> `EnginePrefix.release`
    (hwkv/engine/prefixing.py:145-152) hands each request's K/V to the prefix cache with `int(front[r.row])`, the stale
    host frontier: the cache's nodes claim SWA K/V for a page of tokens whose SWA slots the release already gave back
    ("a cached SWA token lost its SWA slot" from `check_integrity()`). The damage outlives the interrupted call, until
    `clear_prefix_cache()`: a later `generate()` whose prompts extend those (a prefix-cache hit over that page) is
    refused at admission (`HybridPrefixCache.acquire`, hwkv/cache.py:426-431: LocError "loc 44 (full page 11) has no SWA
    slot (released): its SWA cannot be shared ...: pass the request's release frontier"; a retry raises that or
    DoubleFreeError "the SWA slots of full page 20 (locs 80..) are already released", each time). (The step loop's own
    catch-up, `_release_owed`, runs only when the next step schedules rows: a finish read back by a step that schedules
    none, `return self._read_back()` at engine.py:414-415, hands over the stale frontier the same way.) Expected: the
    interrupted generate() leaves the engine consistent (integrity holds) and the next generate() gives the
    uninterrupted tokens."""
    prompts = _prompts()
    ref = _engine()
    first = [r.tokens for r in ref.generate(prompts, list(GREEDY))]
    extended = [p + t for p, t in zip(prompts, first)]
    again = [SamplingParams(max_new_tokens=6)] * len(prompts)
    want = [r.tokens for r in ref.generate(extended, again)]
    e = _engine()
    fired = _in_decode_step_release(monkeypatch, e)
    with pytest.raises(KeyboardInterrupt):
        e.generate(prompts, list(GREEDY))
    assert fired
    errors: List[str] = []
    try:
        e.check_integrity()
    except AssertionError as err:
        errors.append(f"after the interrupted generate(): {err}")
    try:
        got = [r.tokens for r in e.generate(extended, again)]
        if got != want:
            errors.append(f"the next generate() over prompts the cache holds: {got}, uninterrupted {want}")
    except Exception as err:  # noqa: BLE001 - reported
        errors.append(f"the next generate() over prompts the cache holds raised {err!r}")
    assert not errors, "\n".join(errors)


# ---- 2. a Ctrl-C after a whole-step decode's replay and before its send-back loses the forward -------------------
@pytest.mark.parametrize("draft", [False, True])
def test_a_ctrl_c_after_a_whole_step_replay_does_not_lose_the_forward(monkeypatch, draft):
    """`Engine._decode_whole` (hwkv/engine/engine.py:843-862) replays the whole-step graph inside a try whose handler
    undoes the allocation (engine.py:848-856), but after that try, with Ctrl-C live, it calls
    `self.scheduler.new_pages(prefix, 1)` (engine.py:860, where the replay released nothing) before returning; and
    `_forward_step` calls `_decode_whole` outside the try whose handler `_resend`s (engine.py:442-447). A Ctrl-C there
    (here: as the first such `new_pages` starts) leaves a replay that ran, its pages allocated and written into
    req_to_token, with no request's `kv_len` moved and no record in flight: the next step replays the same positions
    again, the first replay's pages are held by nobody (`check_integrity`: "full pool: the allocator counts N page
    references, the running requests hold ... a leak"), and slots stay held after every request finished and the cache
    was cleared; a request can be left running for ever. Expected: the undo or the send-back covers everything after the
    replay (the bookkeeping inside the try, or `_decode_whole` called inside `_forward_step`'s try), and the run ends
    with the uninterrupted tokens, nothing held. Whole-step graphs (eager adapter), with and without the prompt-lookup
    drafter and the verify graph."""
    kw = dict(whole_step=True, graphs=True)
    want = _want(**kw, **(dict(draft=prompt_lookup()) if draft else {}))
    e = _engine(**kw, **(dict(draft=prompt_lookup()) if draft else {}))
    whole = _inside(monkeypatch, e, "_decode_whole")
    fired = _once(monkeypatch, e.scheduler, "new_pages", when=lambda: bool(whole))
    _same_as_uninterrupted(e, fired, want)
