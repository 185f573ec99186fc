"""Re-review of review 30's exception-safety changes (fe463bb..dea5986). Each test failed on that code because
of one real defect in the new error paths (all fixed since); CPU only (the synthetic model, EagerAdapter). An interrupt
is simulated by a patched callee raising KeyboardInterrupt where a real Ctrl-C can land (a Python line of the step's
host work), or, inside the part of a verify the engine holds Ctrl-C over, by a real SIGINT."""
from __future__ import annotations

import os
import signal

import pytest

from hwkv.engine.drafters import prompt_lookup
from hwkv.engine.sampling import SamplingParams
from test_engine_defects import _engine, _prompts
from test_review30_exceptions import _drain_interrupted, _interrupt_first_call

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module


def _draft_prompts():
    return [p + p[:9] for p in _prompts()]  # repeats: prompt_lookup proposes, verify steps run


def _want(params, **kw):
    """Each request's tokens from an engine whose steps nothing interrupts."""
    w = _engine(draft=prompt_lookup(), **kw)[0]
    return _drain_interrupted(w, [w.add_request(p, params) for p in _draft_prompts()])[0]


def _recovered(e, fired, got, errors, want):
    """The interrupt fired, the engine went on to greedy decoding's tokens, and nothing is held once it ends."""
    assert fired, "the interrupt never fired (the test's setup)"
    assert not errors, errors[0]
    assert got == want
    e.clear_prefix_cache()
    assert e.cache.held_slots() == (0, 0)


def _interrupt_verify_release(e, when):
    """Ctrl-C in the out-of-window release of the first verify step for which `when(e)` holds."""
    slots, original, fired = e.slots, e.slots.release, []

    def release(*args, **kwargs):
        if not fired and e._in_verify and when(e):
            fired.append(1)
            raise KeyboardInterrupt()
        return original(*args, **kwargs)

    slots.release = release
    return fired


def _mark_verify(e):
    """Flag `e._in_verify` while Engine._commit runs (a verify's settled part: to aim the interrupt at its release)."""
    original = e._commit
    e._in_verify = False

    def accept(*args, **kwargs):
        e._in_verify = True
        try:
            return original(*args, **kwargs)
        finally:
            e._in_verify = False

    e._commit = accept


def test_ctrl_c_in_a_verifys_release_strands_the_requests_it_finished():
    """hwkv/engine/engine.py:607-613 (`_accept`): the accepted tokens are appended with `add_token` (which sets
    finish_reason on a stop or max_new_tokens) and only then `_release` runs; `_finish(done)` runs in `_verify`
    (engine.py:554) only if `_accept` returned. Ctrl-C (or any error) in the release of a verify in which a request
    reached max_new_tokens leaves that request finished (finish_reason set) but still in scheduler.running and
    self.requests: `schedule` never gives it a row again (Request.decodes is False), `_finish` never runs, so its
    Result is never returned, its row and pages stay held, and has_work() stays True for ever (a server loop and
    generate() spin). The docstring says "once that ran, the tokens are the requests' whatever the release does"."""
    params = SamplingParams(max_new_tokens=10, stop_token_ids=[76])
    want = _want(params)
    e, _ = _engine(draft=prompt_lookup())
    _mark_verify(e)
    fired = _interrupt_verify_release(e, lambda e: any(r.finish_reason for r in e.scheduler.running))
    got, errors = _drain_interrupted(e, [e.add_request(p, params) for p in _draft_prompts()])
    assert not e.has_work()
    _recovered(e, fired, got, errors, want)


def test_ctrl_c_in_a_verifys_release_leaves_its_tokens_uncounted():
    """hwkv/engine/engine.py:607-617 and 390-394: once `accept_draft_tokens` ran, `_accept` appends the accepted
    tokens to the outputs, then `_release` runs; `stats.record_drafts` (engine.py:617) and the step's
    `record_tokens(TARGET_VERIFY, tokens)` (engine.py:394) run only after it returned. Ctrl-C (or an error) in the
    release keeps the tokens in the requests' outputs (the docstring: "the tokens are the requests' whatever the
    release does") but never counts them: stats.generated_tokens (documented "tokens the requests' outputs hold")
    and the acceptance counters fall short of what the results hold, and tokens_per_second with them."""
    e, _ = _engine(draft=prompt_lookup())
    _mark_verify(e)
    fired = _interrupt_verify_release(e, lambda e: True)
    rids = [e.add_request(p, SamplingParams(max_new_tokens=10, stop_token_ids=[76])) for p in _draft_prompts()]
    got, _ = _drain_interrupted(e, rids)
    assert fired
    assert None not in got
    assert e.stats.generated_tokens == sum(len(t) for t in got), "tokens appended by the interrupted verify uncounted"


@pytest.mark.parametrize("graphs", [None, "whole-step"])
def test_ctrl_c_late_in_accept_draft_tokens_undoes_a_verify_whose_drafts_were_already_settled(graphs, monkeypatch,
                                                                                              python_sigint):
    """hwkv/engine/engine.py:600-605 (`_accept`): any exception out of `accept_draft_tokens` is handled by undoing
    the whole verify (`_undo(rows, batch.out_cache_loc or None, head, k + 1)`), as if nothing of it ran. But
    accept_draft_tokens (hwkv/spec.py:275) is not atomic: it clears the rejected draft positions in req_to_token
    and then frees their pages (spec.py:345-346 page size 1, 366-368 otherwise); Ctrl-C landing after that (in
    `allocator.free`'s last lines or the final `prefix_lens + accept_lens`) reaches the handler with the rejected
    drafts already given back, and the undo gives back the verify's whole allocation again (a double free, or a
    page read as 0 in req_to_token and never freed). Here a real SIGINT once accept_draft_tokens ran (the engine now
    holds it until the verify landed): the engine must go on to give greedy decoding's tokens and leave nothing held
    or freed twice."""
    from hwkv.graph import EagerAdapter
    import hwkv.engine.engine as engine_mod
    kw = dict(graphs=EagerAdapter(), whole_step=True) if graphs else {}
    params = SamplingParams(max_new_tokens=10)
    want = _want(params, **kw)
    e, _ = _engine(draft=prompt_lookup(), **kw)
    original, fired = engine_mod.accept_draft_tokens, []

    def ran_then_interrupted(*args, **kwargs):
        out = original(*args, **kwargs)
        if not fired:   # a real Ctrl-C once the drafts are settled (the engine holds it until the verify landed)
            fired.append(1)
            os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(engine_mod, "accept_draft_tokens", ran_then_interrupted)
    got, errors = _drain_interrupted(e, [e.add_request(p, params) for p in _draft_prompts()])
    _recovered(e, fired, got, errors, want)


@pytest.mark.parametrize("where", ["tokens_to_finish", "pack"])
def test_ctrl_c_in_a_verifys_acceptance_before_accept_draft_tokens_leaks_its_drafts_pages(where, monkeypatch):
    """hwkv/engine/engine.py:585-599 (`_accept`): after the verify's argmax was read (engine.py:542, the end of
    `_verify`'s undoing try), `_accept` runs a Python loop per row (`Request.tokens_to_finish`), one host-to-device
    copy (`pack`) and an arange before the try that undoes the verify (engine.py:600-605). Ctrl-C there (host work
    of every verify step, as likely a landing place as accept_draft_tokens) leaves the verify's k + 1 slots per row
    allocated and written into req_to_token with kv_len unmoved: the next step allocates the same positions again
    and those pages are held by nobody (check_integrity: a leak). The step's docstring (engine.py:354-355) says "A
    verify interrupted before its drafts' slots are settled is undone whole"."""
    import hwkv.engine.engine as engine_mod
    from hwkv.engine.scheduler import Request
    params = SamplingParams(max_new_tokens=10)
    want = _want(params)
    e, _ = _engine(draft=prompt_lookup())
    target, name = (engine_mod, "pack") if where == "pack" else (Request, "tokens_to_finish")
    fired = _interrupt_first_call(monkeypatch, target, name)
    got, errors = _drain_interrupted(e, [e.add_request(p, params) for p in _draft_prompts()])
    _recovered(e, fired, got, errors, want)


def test_ctrl_c_while_generate_queues_its_prompts_leaves_the_queued_ones_running():
    """hwkv/engine/engine.py:308-313 (`generate`): the prompts are queued with `_add` (a Python check of every prompt
    token against the vocabulary, engine.py:231) before the new `try` that aborts what this run queued on any
    exception (engine.py:314-339). Ctrl-C while a large batch is being queued (the per-token check is the slow part
    of queueing long prompts) leaves the prompts queued so far in the engine, although their ids never reached the
    caller: the next generate() runs them beside its own prompts and returns while they still hold rows and pages.
    The docstring (engine.py:282-283) promises that a run that raises, Ctrl-C included, aborts what it queued."""
    e, _ = _engine()
    original, calls = e._add, [0]

    def add(ids, params):
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt()
        return original(ids, params)

    e._add = add
    with pytest.raises(KeyboardInterrupt):
        e.generate(_prompts(4), SamplingParams(max_new_tokens=5))
    del e._add
    assert not e.requests, f"{len(e.requests)} requests of the interrupted generate() are still queued"
