"""Review 32's final re-review (30a32fe, ecc711c: `_send`/`_sent`, `_recorded`, `_read_one`'s resumable read,
`read_oldest` no longer popping, `can_admit`, eviction under `interrupts_held`).

Every test here failed on ecc711c and shows one defect; the whole-step send-back, the read's counters and the
cut-short release are fixed; the bytecode windows of `_send` and `_read_one` were fixed in session 33 (held, now that a
hold costs ~0.7 us). As in
test_review32_injection.py a Ctrl-C is a real SIGINT (`_once`: raised at the call, before it runs), the server loop
(`_drain_interrupted`) catches it and keeps stepping with `check_integrity()` after every step, and the tokens are
compared with the uninterrupted run. Where no call sits in the window (the bookkeeping right after a call returned),
the SIGINT is sent as the call returns: a Ctrl-C that arrives during the call's last bytecodes is raised at the next
eval-breaker check, which is no earlier than that.
"""
from __future__ import annotations

import os
import signal
import sys
from typing import List

import pytest

import hwkv.engine.scheduler as scheduler_mod
from test_review32_injection import DeviceError, _engine, _once, _same_as_uninterrupted, _want

pytestmark = pytest.mark.usefixtures("one_thread", "python_sigint")  # conftest


def _sigint() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def _as_it_returns(monkeypatch, owner, name, when=lambda out: True) -> List[int]:
    """At `owner.name`'s first call whose return value satisfies `when`: the call runs whole, then a real SIGINT."""
    original, fired = getattr(owner, name), []

    def injected(*args, **kwargs):
        out = original(*args, **kwargs)
        if not fired and when(out):
            fired.append(1)
            _sigint()
        return out

    monkeypatch.setattr(owner, name, injected)
    return fired


def _nth(monkeypatch, owner, name, n: int) -> List[int]:
    """A real SIGINT at `owner.name`'s n-th call, before it runs."""
    original, calls, fired = getattr(owner, name), [], []

    def injected(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            fired.append(1)
            _sigint()
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, injected)
    return fired


def _tokens_in(got) -> int:
    return sum(len(t) for t in got if isinstance(t, list))


# ---- 1. the whole-step graph's `_send` has no handler: a failure there leaks the replay's pages -----------------
@pytest.mark.parametrize("exc", [KeyboardInterrupt, DeviceError])
def test_a_failure_as_a_whole_step_decodes_tokens_are_sent_back_leaks_nothing(monkeypatch, exc):
    """30a32fe moved the eager path's `_send` into the step's try (its handler sends once more when the record is not
    listed: `_sent`), but the whole-step branch calls `self._send(rows, sampled, where, mode, tokens)` right after
    `_decode_whole` (hwkv/engine/engine.py:425-426) with no handler at all. The replay has already allocated the
    step's slots, written req_to_token and (with a window) released and moved the frontiers; a Ctrl-C or a device
    error in `_send` before `ReadBack.send` appended the record (here: as `readback.send` starts, on the 2nd
    whole-step decode; `_held`'s `free_counts_async`, `_block` and `_event` are the same window) leaves no record
    and no `kv_len` moved: the next step replays the same positions and allocates them again ("a leak" in
    `check_integrity`) and the forward's tokens are lost (outputs differ). Expected: as on the eager path (the
    `_send` inside a handler that sends once more), the run ends with the uninterrupted tokens, nothing held."""
    want = _want(whole_step=True, graphs=True)
    e = _engine(whole_step=True, graphs=True)
    replays, decode_whole = [], e._decode_whole

    def noted(*args, **kwargs):
        replays.append(1)
        return decode_whole(*args, **kwargs)

    monkeypatch.setattr(e, "_decode_whole", noted)
    fired = _once(monkeypatch, e.readback, "send", when=lambda: len(replays) >= 2, exc=exc)
    _same_as_uninterrupted(e, fired, want)


# ---- 2. a Ctrl-C once the record is listed, before the lengths moved: `_sent` says sent, nothing sends -----------
def test_a_ctrl_c_after_a_forwards_record_is_listed_still_moves_its_lengths(monkeypatch):
    """`Engine._send` (hwkv/engine/engine.py:481-494) appends the forward's `Inflight` (`ReadBack.send`) and only
    then moves each row's `kv_len` and each sampling row's `pending` in two host loops. The step's handler
    (engine.py:451-454) sends again (`_resend`) only when the record is not listed; a Ctrl-C
    that lands after the append (arriving as `send` finishes, it is raised at the first loop's backward jump at the
    latest) leaves the record listed and some or all `kv_len`/`pending` unmoved, and nothing moves them: the next
    step allocates the forward's positions again ("a leak" in `check_integrity`), its token's `pending -= 1`
    drives `pending` negative, the outputs go wrong. Expected: the record and the host counts land together (e.g.
    counts moved before the append and rolled back by the handler when the append did not happen, a flag on the
    record, or the tail under `interrupts_held`), and the run ends with the uninterrupted tokens, nothing held.
    Here: the SIGINT as the first `ReadBack.send` returns."""
    want = _want()
    e = _engine()
    fired = _as_it_returns(monkeypatch, e.readback, "send")
    _same_as_uninterrupted(e, fired, want)


# ---- 3. `_read_one`'s resumable read: a row counts as read only after its token was appended and listed ---------
@pytest.mark.parametrize("where", ["inside add_token", "finishing.append"])
def test_a_ctrl_c_inside_a_rows_read_neither_duplicates_its_token_nor_strands_its_request(monkeypatch, where):
    """ecc711c's `_read_one` (hwkv/engine/engine.py:535-546) resumes an interrupted read from `rec.done`, the rows
    whose whole body ran (`i += 1` and `req.pending -= 1` come last), but a row's body is not one step: a Ctrl-C
    after `req.add_token(tok)` appended the token (`self.output.append`, scheduler.py:99) and before `i += 1` makes
    the next step read that row again:
    - "inside add_token": at add_token's `len(self.output)` call (scheduler.py:102), after the append: the token
      is appended twice (outputs differ from the uninterrupted run, and the request stops one token early);
    - "finishing.append": at `self._finishing.append(req)` (engine.py:542) for a request add_token just finished:
      on the re-read `req.finish_reason` is set, so its token is counted as dropped (though it is in the output)
      and the request is never listed for hand-over: it stays running with nothing to schedule, `has_work()`
      True for ever (row, reservation and pages held).
    Expected: a row's token is appended, its finish listed and its `done`/`pending` moved as one (e.g. the row
    body under `interrupts_held`, or `done` advanced before the append and the append made idempotent), and the
    run ends with the uninterrupted tokens."""
    want = _want()
    e = _engine()
    fired: List[int] = []
    if where == "inside add_token":
        def injected_len(obj):
            if not fired and sys._getframe(1).f_code.co_name == "add_token":
                fired.append(1)
                _sigint()
            return len(obj)
        monkeypatch.setattr(scheduler_mod, "len", injected_len, raising=False)
    else:
        class Finishing(list):
            def append(self, item):
                if not fired:
                    fired.append(1)
                    _sigint()
                super().append(item)
        e._finishing = Finishing()
    _same_as_uninterrupted(e, fired, want)


# ---- 4. the read's statistics are recorded after the record left the list: a Ctrl-C there loses them ------------
def test_a_ctrl_c_as_a_read_records_its_tokens_keeps_the_counters_equal_to_the_outputs(monkeypatch):
    """`_read_one` pops the record (`self.readback.inflight.pop(0)`, hwkv/engine/engine.py:547) and only then calls
    `self.stats.record_tokens(rec.mode, n - rec.dropped, rec.dropped)` (engine.py:548), outside any
    `interrupts_held`. A Ctrl-C at that call (here: the first one) leaves the tokens appended to the outputs but
    never counted: `stats.generated_tokens` (and `decode_tokens`, `dropped_tokens`) end short of what the Results
    hold, which the engine promises they equal ("counted as read: what the outputs hold"; `generate`'s docstring:
    "the statistics then count exactly the tokens the results hold"). Any later `record_tokens` of that read is
    lost the same way, in every mode (overlap, whole step, with a drafter). Expected: the counting lands with the
    record leaving the list (both under `interrupts_held`, or counted first with a flag on the record so a retry
    does not count twice), and the run's counters equal its outputs."""
    want = _want()
    e = _engine()
    fired = _once(monkeypatch, e.stats, "record_tokens")
    _same_as_uninterrupted(e, fired, want)
    assert e.stats.generated_tokens == _tokens_in(want), "generated_tokens misses tokens the outputs hold"


# ---- 6. without the prefix cache, an interrupted out-of-window release wedges the engine -------------------------
def test_an_interrupted_out_of_window_release_is_caught_up_before_the_next_allocation(monkeypatch):
    """`_step`'s handler (hwkv/engine/engine.py:451-454) lets a Ctrl-C in the out-of-window release
    (`self._release(...)`, engine.py:440) propagate with the forward's lengths moved, on the word that "what was not
    cached or released is caught up by the next step's caching and release". But the next step allocates its
    forward (`_allocate`, engine.py:430) before its release runs, and the scheduler reserved each request's SWA
    pages assuming every step's release ran: without the prefix cache (nothing to evict), a skipped release that
    would have freed SWA pages leaves the next allocation short (`OutOfSlotsError: need 8 pages (32 slots) in the
    SWA pool, only 24 slots are free`), and nothing ever runs the release, so every later step raises the same
    error (96 of 96 steps in a 100-step loop): the engine is wedged with `has_work()` True. Here: a Ctrl-C as the
    4th `_release` call starts (rows 1-4 at lengths 25, 28, 32, 12; the third request's frontier would move from 8
    to 24). Expected: the skipped release runs before the next allocation (e.g. the rows with a pending release
    noted and released first, or the release counted in what the allocation may take), and the run ends with the
    uninterrupted tokens."""
    want = _want(prefix_cache=False)
    e = _engine(prefix_cache=False)
    fired = _nth(monkeypatch, e, "_release", 4)
    _same_as_uninterrupted(e, fired, want)
