"""Third re-review of review 30 (dea5986..3febbc2: Engine._verify as _acceptance / _keep_drafts / _commit under
interrupts_held, `_carry`). Each test failed on that code because of a real defect (fixed since); CPU only (synthetic
model)."""
from __future__ import annotations

import os
import signal

import pytest

from hwkv.engine.drafters import prompt_lookup
from hwkv.engine.sampling import SamplingParams
from test_engine_defects import _engine, _prompts
from test_review30_exceptions import _drain_interrupted

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module

PARAMS = SamplingParams(max_new_tokens=10, stop_token_ids=[76])


def _draft_prompts(n=3):
    return [p + p[:9] for p in _prompts(n)]  # repeats: prompt_lookup proposes, verify steps run


def _want(**kw):
    e, _ = _engine(draft=prompt_lookup(), **kw)
    rids = [e.add_request(p, PARAMS) for p in _draft_prompts()]
    out = {}
    while e.has_work():
        out.update((r.rid, r.tokens) for r in e.step())
    return [out[r] for r in rids]


def _sigint_after_commit_that_finished(e):
    """A real Ctrl-C while a verify that finished a request settles (inside interrupts_held: raised as it ends)."""
    original, fired = e._commit, []

    def commit(*args, **kwargs):
        out = original(*args, **kwargs)
        if not fired and e._finishing:
            fired.append([r.rid for r in e._finishing])
            os.kill(os.getpid(), signal.SIGINT)
        return out

    e._commit = commit
    return fired


def test_generate_interrupted_in_a_verify_leaks_its_finished_results_into_later_calls(python_sigint):
    """hwkv/engine/engine.py:597 (`_verify` handler: `self._carry += earlier + self._finish(self._verified)`) with
    engine.py:367-374 (`generate`'s abort of what it queued). Ctrl-C during a generate() lands (held) in a verify that
    finished one of generate's requests: the handler finishes it into `_carry`, generate aborts its other requests
    (no Result anywhere: "their ids never reached the caller") and re-raises. The finished one's Result stays in
    `_carry`: has_work() is True with nothing queued, a server loop's next step() returns a Result for an id it never
    got (a rid->client map raises KeyError), and the next generate() files it in `unclaimed`, documented as results
    of add_request requests to pop (nobody knows the id: it stays for ever)."""
    e, _ = _engine(draft=prompt_lookup())
    fired = _sigint_after_commit_that_finished(e)
    with pytest.raises(KeyboardInterrupt):
        e.generate(_draft_prompts(), PARAMS)
    assert fired, "no verify finished a request (the test's setup)"
    del e._commit
    assert not e.requests
    leaked = [r.rid for r in e._carry]
    assert not leaked, f"results of the interrupted generate()'s ids {leaked} pending"
    assert e.step() == [] and not e.has_work()   # (what was still in flight, the verify's free counts, read)
    e.generate([_prompts(1)[0]], SamplingParams(max_new_tokens=3))
    assert not e.unclaimed, f"the interrupted generate()'s results {sorted(e.unclaimed)} filed in unclaimed"


def test_ctrl_c_in_a_verifys_finish_finishes_its_requests_twice(python_sigint):
    """hwkv/engine/engine.py:591 and 597: `return earlier + self._finish(self._verified)` now runs inside the try
    whose handler runs `self._finish(self._verified)` again. `_finish` is plain host code after interrupts_held has
    ended (prefix-cache release, slots.free, scheduler.finish, `del self.requests[rid]`, the Results), so a Ctrl-C
    landing in it (every verify step that finishes a request) makes the handler finish the same requests a second
    time (here the prefix cache's release of the same slots again: NotAllocatedError, which replaces the
    KeyboardInterrupt; the requests' rows stay held, check_integrity fails), and the read-back's `earlier` results
    and the finished requests' Results are lost.
    Here a real SIGINT on the return of `scheduler.finish` in a verify that finished a request (the engine holds it
    until the verify, its finished requests included, has landed)."""
    want = _want()
    e, _ = _engine(draft=prompt_lookup())
    original_commit, original_finish, armed, fired = e._commit, e.scheduler.finish, [], []

    def commit(*args, **kwargs):
        out = original_commit(*args, **kwargs)
        if e._finishing and not fired:
            armed.append(1)   # this verify finishes a request: its `_finish` follows
        return out

    def finish(req):
        out = original_finish(req)
        if armed and not fired:
            fired.append(req.rid)
            os.kill(os.getpid(), signal.SIGINT)
        return out

    e._commit, e.scheduler.finish = commit, finish
    got, errors = _drain_interrupted(e, [e.add_request(p, PARAMS) for p in _draft_prompts()])
    assert fired, "no verify finished a request (the test's setup)"
    assert not errors, errors[0]
    assert got == want
    e.clear_prefix_cache()
    assert e.cache.held_slots() == (0, 0)
