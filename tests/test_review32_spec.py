"""Review 32 (the engine's speculative verify with the prefix cache, sliding windows, chunked prefill, aborts and
memory pressure).

Every test here fails on the current code and shows one defect. Each runs the engine over
`hwkv.engine.synthetic.SyntheticModel` on the CPU (review 31's window engine: `ReferenceCheck` on every forward) with
a drafter that proposes greedy decoding's own continuation (so drafts are accepted and requests finish inside a
verify), `check_integrity()` after every step and, once the prefix cache is cleared, no slot held.

What held under review (randomized differential runs, each against the same requests without a drafter and without
the prefix cache: ~1,300 runs over W 1..16, page sizes 1/2/4/8, chunks 2..40, 1-6 rows, contexts 24..64, tight full
pools, all-SWA / all-full / mixed layer patterns, an engine window wider than the model's, num_draft 1..8 with drafts
partly wrong, stop tokens, sampling requests beside greedy ones, late arrivals, aborts of queued / prefilling /
decoding requests, `clear_prefix_cache()` mid-run, overlap, the layers' graph runner, the whole-step and verify step
graphs, deferred allocator checks, the Triton page ops (interpreted), HWKV_DEBUG=1; and ~300 harness runs of random
draft trees with random accepted paths through extend-, decode- and auto-verify, eager and graph, on the CPU
backend and the Triton backend (interpreted)): tokens equal, attention equal to the reference, nothing leaked.
"""
from __future__ import annotations

import os
import random
import signal
from typing import List, Sequence

import pytest

from hwkv.engine.drafters import prompt_lookup
from hwkv.engine.engine import Engine
from hwkv.engine.sampling import SamplingParams
from test_engine_defects import _engine as _draft_engine, _run as _run_checked
from test_review30_exceptions import _drain_interrupted, _interrupt_first_call
from test_review30_third import PARAMS, _draft_prompts, _want
from test_review31_windows import VOCAB, _engine

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module


def _tokens(n: int, seed: int) -> List[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def _oracle(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]):
    """A drafter proposing greedy decoding's continuation (every draft accepted): requests finish inside a verify."""
    full = [list(p) + list(o) for p, o in zip(prompts, outputs)]

    def draft(history, k):
        seq = list(history)
        for f in full:
            if len(f) > len(seq) and f[:len(seq)] == seq:
                return f[len(seq):len(seq) + k]
        return []
    return draft


# ---- 1. a verify whose finished requests' hand-over raises strands them ------------------------------------------
def test_an_interrupted_hand_over_inside_a_verify_does_not_strand_the_finished_requests(monkeypatch):
    """`Engine._verify` hands the requests its accepted tokens finished to `_finish` inside the verify
    (hwkv/engine/engine.py:601-602: `done, self._verified = self._verified, []`, then `finished = self._finish(done)`),
    not through `_finishing` / `_finish_pending` as a read-back (engine.py:515-518, 520-534) and `abort` do since review
    31. When that hand-over raises before it changed anything (a refusal, or a KeyboardInterrupt raised as the prefix
    cache's `release_requests` starts: the interruption review 31's tests use), the handler (engine.py:606-608)
    rebinds `done` to the now
    empty `_verified` and calls `_finish([])`: the requests it had taken are in no list any more. Each stays in
    `scheduler.running` with `finish_reason == "length"`, its row, reservation, cache lock and pages; it never decodes
    again and nothing finishes it, so its Result never comes and `has_work()` stays True for ever (`generate` would
    spin).
    Expected (docs/architecture.md: "A request whose last token was read ... stays listed until its hand-over (prefix
    cache, rows) is done ...; one a Ctrl-C kept from it is finished by the next step"): the next step finishes it,
    its tokens are the uninterrupted run's and nothing stays held."""
    prompts = [_tokens(20, 1)]
    want = _run_checked(_engine(prefix_cache=False), None, prompts, new=8)
    assert _run_checked(_engine(draft=_oracle(prompts, want)), None, prompts, new=8) == want  # uninterrupted: fine
    e = _engine(draft=_oracle(prompts, want))
    fired = _interrupt_first_call(monkeypatch, e.prefix, "release_requests")
    rid = e.add_request(prompts[0], SamplingParams(max_new_tokens=8))
    got, errors = _drain_interrupted(e, [rid], limit=3, max_steps=60)
    assert fired and e.stats.verify_rows, "the hand-over inside a verify was never reached"
    assert not errors, "\n".join(errors)
    assert got == want
    e.clear_prefix_cache()
    assert e.cache.held_slots() == (0, 0)


# ---- 2. Ctrl-C in admission after an earlier request of the same step was admitted: it runs without its sampling --
def test_ctrl_c_in_admission_does_not_leave_an_admitted_request_without_its_sampling_constants(monkeypatch):
    """With the prefix cache, `Scheduler.admit(start)` (hwkv/engine/scheduler.py:161-180) moves each waiting request to
    `running` as `EnginePrefix.start` admits it (its match, lock, row and frontier; hwkv/engine/prefixing.py:29-66,
    with a device read of the free slots per request). `Engine._step` writes the admitted requests' sampling
    constants (`self.sampling.admit`, hwkv/engine/engine.py:410) and counts their prompts (engine.py:409) only after
    `admit` returned. A Ctrl-C (or an error that device read raises) in `start` for the second request of a step
    propagates out of `admit` after the first is already running: its row never gets its temperature, top_p, seed and
    draw count. The first request then samples with whatever its row held: a fresh row's temperature 0 (it decodes
    greedily although it asked to sample), or the constants and draw count of the request that used the row before
    (a greedy request may then sample). Nothing later writes them: `sampling.admit` runs only for requests a step
    admits. (Also `stats.prompt_tokens` never counts it.) Here the Ctrl-C lands in the second request's device read
    of the free slots (`full_available_size`, prefixing.py:46), the first one already admitted.
    Expected: an interrupted step leaves the engine able to go on with the tokens of an uninterrupted run (the
    admission's bookkeeping lands with the admission, or is caught up). Actual: request A (temperature 1.0, seed 7)
    returns greedy decoding's tokens instead of its seeded samples."""
    a, b = _tokens(12, 3), _tokens(9, 4)
    params = [SamplingParams(max_new_tokens=8, temperature=1.0, seed=7), SamplingParams(max_new_tokens=4)]

    def run(e: Engine, interrupt: bool):
        fired = (_interrupt_first_call(monkeypatch, e.cache.allocator, "full_available_size", nth=2) if interrupt
                 else [1])
        rids = [e.add_request(p, s) for p, s in zip((a, b), params)]
        got, errors = _drain_interrupted(e, rids, limit=3, max_steps=60)
        assert fired and not errors, "\n".join(errors)
        e.clear_prefix_cache()
        assert e.cache.held_slots() == (0, 0)
        return got

    want = run(_engine(), interrupt=False)
    assert run(_engine(), interrupt=True) == want


# ---- 3. a release that raises in a verify that finished a request, a Ctrl-C in the hand-over that follows -------
def test_ctrl_c_in_the_hand_over_after_a_verifys_release_raised_strands_nothing(python_sigint):
    """The verify's release raises (a device error, say) in a step whose verify finished a request; a Ctrl-C lands
    in the hand-over its handler runs. The requests must still leave once, their Results come with the next step,
    and the pools end balanced: an unheld hand-over there dropped the Results and left the request running."""
    want = _want()
    e, _ = _draft_engine(draft=prompt_lookup())
    release, finish, commit = e._release, e.scheduler.finish, e._commit
    state = {"raised": False, "fired": False, "committing": False}

    def committing(*args, **kwargs):
        state["committing"] = True
        try:
            return commit(*args, **kwargs)
        finally:
            state["committing"] = False

    def failing_release(*args, **kwargs):
        finished = any(r.finish_reason is not None for r in e.requests.values())
        if finished and state["committing"] and not state["raised"]:  # a verify finished one: its release raises
            state["raised"] = True
            raise RuntimeError("release failed")
        return release(*args, **kwargs)

    def interrupted_finish(req):
        out = finish(req)
        if state["raised"] and not state["fired"]:
            state["fired"] = True
            os.kill(os.getpid(), signal.SIGINT)
        return out

    e._release, e.scheduler.finish, e._commit = failing_release, interrupted_finish, committing
    rids = [e.add_request(p, PARAMS) for p in _draft_prompts()]
    out, raised, steps = {}, [], 0
    while e.has_work() and steps < 500:
        steps += 1
        try:
            out.update((r.rid, r.tokens) for r in e.step())
        except (KeyboardInterrupt, RuntimeError) as err:
            raised.append(type(err).__name__)
        e.check_integrity()
    assert state["raised"] and state["fired"], "no verify finished a request (the test's setup)"
    assert raised == ["KeyboardInterrupt"], raised   # the Ctrl-C, raised once the hand-over was done
    assert not e.has_work(), [(r.rid, r.finish_reason) for r in e.scheduler.running]
    assert [out.get(r) for r in rids] == want
    e.clear_prefix_cache()
    assert e.cache.held_slots() == (0, 0)
