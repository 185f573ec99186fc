"""A verify's finished requests share the hand-over list (`Engine._finishing`) with every other finish: a release
that raises after the verify settled still hands them over with Ctrl-C held. CPU only (synthetic model)."""
from __future__ import annotations

import os
import signal

import pytest

from hwkv.engine.drafters import prompt_lookup
from test_engine_defects import _engine
from test_review30_third import PARAMS, _draft_prompts, _want

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module


def test_ctrl_c_in_the_hand_over_after_a_verifys_release_raised_strands_nothing(python_sigint):
    """The verify's release raises (a device error, say) in a step whose verify finished a request; a Ctrl-C lands
    in the hand-over its handler runs. The requests must still leave once, their Results come with the next step,
    and the pools end balanced: an unheld hand-over there dropped the Results and left the request running."""
    want = _want()
    e, _ = _engine(draft=prompt_lookup())
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
