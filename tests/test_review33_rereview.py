"""Review 33's re-review (891a4f6..d52b867): defects left by session 33's Ctrl-C holds. Every test here fails on the
code it was written against (d52b867) and shows one defect. A Ctrl-C is a real SIGINT (os.kill), so an
`interrupts_held` region defers it exactly as it defers a user's.

1-3b. The undo-on-Ctrl-C paths (`reserve`, `lock`, `cache_running`, `acquire`) decide whether to undo by reading
      `held.caught` inside the held block. A SIGINT that lands after that read and before the hold hands SIGINT back to
      Python's handler (the few bytecodes up to `_sig.signal(_SIGINT, _DEFAULT)` in `interrupts_held.__exit__`,
      hwkv/sigint.py:45-47) is still noted by the hold and raised by `__exit__` as KeyboardInterrupt: the call raises
      with its claim / lock / references taken and its handle never returned (nothing undone). The tests send the
      SIGINT as the hold restores the handler (a stand-in for `hwkv.sigint._sig` that forwards every call). Fixed
      by the undo in an `except KeyboardInterrupt` around the `with` (checked: all four pass then).
4.    `StepGraph.step` claims the step's pages (`self._reserve(pages)`, hwkv/step_graph.py:267) before the `try` whose
      handler gives a claim back (`cancel_reserve`, step_graph.py:297-300): a Ctrl-C as `reserve` returns (raised at
      `_reserve`'s `op_number` read, step_graph.py:221) leaks the claim in a serving engine.
5.    `hwkv.sigint` freezes the main thread's ident at import (`_MAIN`, hwkv/sigint.py:16): in a process forked from
      a worker thread the child's main thread has another ident, so `python_sigint_here()` says False and every hold
      is a no-op there, though Python's SIGINT handler runs (KeyboardInterrupt) in that thread. Before 573ef23
      (`threading.current_thread() is threading.main_thread()`) it held.
6.    `_untake` (hwkv/allocator.py:340-353) restores NEVER by ring position only: never-allocated pages a larger
      claim gave back (`alloc_reserved`) sit past the first pass, and a rolled-back allocation marks them FREE.
"""
from __future__ import annotations

import os
import select
import signal
import threading

import _signal
import pytest
import torch

import hwkv.sigint as sigint_mod
from hwkv.allocator import same_snapshot
from test_allocator import make
from test_cache_defects import Setup
from test_review32_injection import _engine, _same_as_uninterrupted, _want

pytestmark = pytest.mark.usefixtures("one_thread", "python_sigint")  # conftest

H = list(range(100, 140))  # a 40-token prompt: page 4, window 8


class _SigintAsTheHoldEnds:
    """`hwkv.sigint._sig` forwarding every call to `_signal`, except that once armed, the first restore of Python's
    handler (`interrupts_held.__exit__`) is preceded by a real SIGINT: one that lands after the block's last bytecode,
    before the hold hands SIGINT back (os.kill runs the hold's handler at once, as the eval loop would at __exit__'s
    entry)."""

    def __init__(self) -> None:
        self.armed, self.fired = False, []

    @staticmethod
    def getsignal(sig):
        return _signal.getsignal(sig)

    def signal(self, sig, handler):
        if self.armed and not self.fired and handler is signal.default_int_handler:
            self.fired.append(1)
            os.kill(os.getpid(), signal.SIGINT)
        return _signal.signal(sig, handler)


def _late_sigint(monkeypatch) -> _SigintAsTheHoldEnds:
    stand_in = _SigintAsTheHoldEnds()
    monkeypatch.setattr(sigint_mod, "_sig", stand_in)
    return stand_in


# ---- 1. reserve: a Ctrl-C after the undo check claims the pages with no heads returned -----------------------------
def test_a_ctrl_c_as_reserves_hold_ends_leaves_no_claim(monkeypatch):
    """hwkv/allocator.py:421-429 (`reserve`): every ring claims (`take`), then `if held.caught:` gives the claim back.
    A SIGINT landing after that check, before `interrupts_held.__exit__` restores Python's handler (hwkv/sigint.py:47),
    is noted by the hold and raised by `__exit__` (sigint.py:48-49): `reserve` raises KeyboardInterrupt, the caller gets
    no heads, and both rings' heads stay advanced by the claim (pages neither free nor held: `check_integrity` says "a
    page is lost"; `cancel_reserve` cannot be called, the caller does not know a claim was made). Expected, as the
    comment at allocator.py:421 says: "every ring claims, or (a Ctrl-C here) none" (e.g. the undo in an
    `except KeyboardInterrupt` around the `with`, which also covers a Ctrl-C raised by `__exit__`)."""
    _, a = make(size=64, size_swa=32, page=4)
    before = a.integrity_snapshot()
    late = _late_sigint(monkeypatch)
    late.armed = True
    with pytest.raises(KeyboardInterrupt):
        a.reserve(2)
    monkeypatch.undo()
    assert late.fired
    assert same_snapshot(a.integrity_snapshot(), before), \
        f"a claim stayed: full head {a.pages.head}, SWA head {a.swa_attn_allocator.pages.head} (were 0)"


# ---- 2. lock: a Ctrl-C after the undo check leaves a lock count with no handle -------------------------------------
def test_a_ctrl_c_as_locks_hold_ends_leaves_nothing_locked(monkeypatch):
    """hwkv/cache.py:287-291 (`HybridPrefixCache.lock`): `_lock` counts the lock on the matched path, then
    `if held.caught: self.unlock(lock)`. A SIGINT after that check, before the hold restores Python's handler, is
    raised by `interrupts_held.__exit__`: KeyboardInterrupt, no PrefixLock returned, and the path's `lock_full` and
    `evictable_full` stay counted for good (the cached prompt can never be evicted). Expected, as the comment at
    cache.py:287 says: "raised with nothing locked"."""
    s = Setup(page=4, window=8)
    s.finish(s.run(H))
    m = s.c.match_prefix(H[:39])
    evictable = s.c.evictable_full
    late = _late_sigint(monkeypatch)
    late.armed = True
    with pytest.raises(KeyboardInterrupt):
        s.c.lock(m)
    monkeypatch.undo()
    assert late.fired
    assert s.c.evictable_full == evictable, (
        f"a lock with no handle: evictable_full {s.c.evictable_full}, was {evictable}; locked nodes "
        f"{[(nd.start, nd.end, nd.lock_full) for nd in s.c._nodes() if nd.lock_full]}")


# ---- 3. cache_running: a Ctrl-C after the hand-over check releases the caller's handle and loses the new lock -------
def test_a_ctrl_c_as_cache_runnings_hold_ends_leaves_the_callers_lock_releasable(monkeypatch):
    """hwkv/cache.py:492-510 (`cache_running`): the new lock is taken, the old one released (`self.unlock(lock)`: the
    caller's handle now inactive), then `if held.caught:` moves the new lock into the caller's handle. A SIGINT after
    that check, before the hold restores Python's handler, is raised by `interrupts_held.__exit__`: the new lock is
    never returned and the caller's handle is released. The request's end then fails (`release_requests` with that
    handle: CacheError "this prefix lock was already released") and the new lock pins the request's nodes for good.
    Expected (the comment at cache.py:492): the request's lock kept, "`lock`, the handle it passed, now the new one",
    so the request ends normally and the cache can be emptied."""
    s = Setup(page=4, window=8)
    s.finish(s.run(H))
    ids = H + list(range(500, 520))
    r = s.run(ids)
    late = _late_sigint(monkeypatch)
    late.armed = True
    with pytest.raises(KeyboardInterrupt):
        s.c.cache_running(ids, s.rtt, r["row"], r["seq"], r["frontier"], r["lock"])
    monkeypatch.undo()
    assert late.fired
    assert r["lock"].active, "the caller's lock handle was released and the new lock lost"
    s.finish(r)
    assert s.empty(), "the request's nodes stay locked after it ended"


# ---- 3b. acquire: the same window leaves the request's references and row with no lock returned ------------------
def test_a_ctrl_c_as_acquires_hold_ends_leaves_the_row_and_the_references_as_they_were(monkeypatch):
    """hwkv/cache.py:448-461 (`acquire`): row written, the request's references taken, the nodes locked, then
    `if held.caught:` undoes all three. A SIGINT after that check, before the hold restores Python's handler, is
    raised by `interrupts_held.__exit__`: KeyboardInterrupt, no (lock, frontier) returned, the request's references
    on the matched pages taken (held by nobody once the caller frees the row, as `EnginePrefix.start` does) and the
    nodes locked for good. Expected, as the comment at cache.py:448 says: "raised with everything as before"."""
    s = Setup(page=4, window=8)
    s.finish(s.run(H))
    m = s.c.match_prefix(H[:39])
    row = s.rtt.alloc(1)[0]
    before = s.snapshot()
    late = _late_sigint(monkeypatch)
    late.armed = True
    with pytest.raises(KeyboardInterrupt):
        s.c.acquire(m, s.rtt, row)
    monkeypatch.undo()
    assert late.fired
    assert s.same(s.snapshot(), before), "acquire raised with its row, references or lock left in place"


# ---- 4. StepGraph.step: the claim is made before the try that gives it back -----------------------------------------
def test_a_ctrl_c_as_a_whole_step_decodes_reserve_returns_leaks_nothing(monkeypatch):
    """hwkv/step_graph.py:267 `heads = self._reserve(pages)` ran before the `try` (step_graph.py:268) whose handler
    calls `cancel_reserve(pages)` (step_graph.py:297-300), and `_reserve` read `self.allocator.op_number` (a property:
    a Python call, where a pending SIGINT is raised) after `reserve`'s hold ended: a Ctrl-C there raised with the pages
    claimed and nobody to give them back; the engine's handler (`_decode_whole` -> `_undo(rows, None, head)`) finds no
    replay allocation and gives nothing back, and the server loop that catches the KeyboardInterrupt and steps on runs
    with those pages lost (`check_integrity`: "a page is lost"). Now the claim is made inside the try, with nothing
    called between `reserve`'s return and `heads` being set (`_reserve` reads the ring's op count, not the property),
    so that window has no call left to inject at. This test guards the first call after the claim, where a Ctrl-C
    lands now (the step's `_set_ctl`, on the first whole-step decode that opens a page; it passed before the change
    too): the claim goes back, the run ends with the uninterrupted tokens and nothing held."""
    from hwkv.step_graph import DecodeStepGraph
    want = _want(whole_step=True, graphs=True)
    e = _engine(whole_step=True, graphs=True)
    a = e.cache.allocator
    reserve, claimed, fired = a.reserve, [], []

    def noted(pages, ops=1):
        heads = reserve(pages, ops)
        claimed[:] = [pages]
        return heads

    set_ctl = DecodeStepGraph._set_ctl

    def injected(self, *args, **kwargs):
        if claimed and claimed[0] and not fired:  # the first call after a reserve that claimed pages
            fired.append(1)
            os.kill(os.getpid(), signal.SIGINT)  # (no hold here: raised at once)
        return set_ctl(self, *args, **kwargs)

    monkeypatch.setattr(a, "reserve", noted)
    monkeypatch.setattr(DecodeStepGraph, "_set_ctl", injected)
    _same_as_uninterrupted(e, fired, want)


# ---- 5. a process forked from a worker thread holds nothing ----------------------------------------------------------
def test_holds_hold_in_a_process_forked_from_a_worker_thread():
    """hwkv/sigint.py:16 `_MAIN = threading.main_thread().ident` is read once, at import; sigint.py:23 and :40 compare
    the running thread's ident with it. A process forked from a worker thread (a server that starts engine workers
    from a thread with multiprocessing's fork start method) has that worker as its main thread: Python runs SIGINT's
    handler there (KeyboardInterrupt), `threading.main_thread()` is it, but its ident is not `_MAIN`, so
    `python_sigint_here()` is False and every `interrupts_held` block runs unheld (a Ctrl-C lands part way through
    the allocator's, the cache's and the engine's changes again). Before 573ef23 (`threading.current_thread() is
    threading.main_thread()`) it held. Expected: True in that child (e.g. `threading.main_thread().ident` read per
    call, or `_MAIN` refreshed by `os.register_at_fork(after_in_child=...)`)."""
    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    r, w = os.pipe()
    pid = []

    def worker():
        child = os.fork()
        if child == 0:  # the child: report and leave at once (no interpreter shutdown, no pytest)
            try:
                signal.signal(signal.SIGINT, signal.default_int_handler)
                main = threading.current_thread() is threading.main_thread()
                with sigint_mod.interrupts_held() as held:
                    pass
                os.write(w, f"{int(main)}{int(sigint_mod.python_sigint_here())}{int(held.held)}".encode())
            finally:
                os._exit(0)
        pid.append(child)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    os.close(w)
    ready, _, _ = select.select([r], [], [], 30)  # (a child that hangs fails the test instead of stalling it)
    got = os.read(r, 16).decode() if ready else ""
    os.close(r)
    if not ready:
        os.kill(pid[0], signal.SIGKILL)
    os.waitpid(pid[0], 0)
    assert got[:1] == "1", f"setup: the child's thread is not its main thread ({got!r})"
    assert got == "111", (f"in the child's main thread python_sigint_here()={got[1:2] == '1'}, the hold held="
                          f"{got[2:3] == '1'}: Ctrl-C is not held there")


# ---- 6. _untake's NEVER/FREE rule by ring position: a first-pass page a claim gave back is marked freed -------------
def test_a_rolled_back_allocation_restores_a_given_back_claims_never_allocated_pages(monkeypatch):
    """hwkv/allocator.py:340-353 (`_untake`) marks each page it puts back NEVER when the ring gave it from its first
    pass (position < num_pages), else FREE. A claim larger than its allocation's need (`reserve` then `alloc_reserved`,
    which gives the unopened pages back at the ring's tail: torch_page_ops.py:102, "claimed pages the step does not
    open go back") puts never-allocated pages (refs NEVER) at positions >= num_pages. An allocation that pops them and
    is interrupted (here: a SIGINT at its `_next_op`, after the host path popped and counted them) is rolled back with
    those pages marked FREE (0): the allocator is not as before (a later wrong free of such a page is reported as a
    DoubleFreeError, "already free", instead of NotAllocatedError, "never allocated"), which is what session 33's
    position rule was added to avoid (tests/test_review33_alloc_atomic.py::
    test_a_rolled_back_allocation_leaves_never_allocated_pages_never_allocated). Expected: every popped page back at
    the count it had before the allocation."""
    from hwkv.allocator import PagedTokenToKVPoolAllocator
    a = PagedTokenToKVPoolAllocator(64, 4, "cpu")  # 16 pages
    heads = a.reserve(3)
    z = torch.zeros(1, dtype=torch.int64)
    a.alloc_reserved(z, torch.tensor([4]), z.clone(), torch.zeros(4, dtype=torch.int64), heads, 3)  # opens 1 of 3
    a.check_integrity()
    held = a.alloc(13 * 4)  # the rest of the first pass: the ring now holds the 2 given-back pages, never allocated
    assert held.numel() == 52 and a.pages.head == 16
    before = a.integrity_snapshot()
    never = (a.pages.refs == -1).nonzero().reshape(-1).tolist()
    original, fired = a._next_op, []

    def next_op():
        if not fired:
            fired.append(1)
            os.kill(os.getpid(), signal.SIGINT)
        return original()

    monkeypatch.setattr(a, "_next_op", next_op)
    with pytest.raises(KeyboardInterrupt):
        a.alloc(8)
    monkeypatch.undo()
    assert fired
    a.check_integrity()
    after = (a.pages.refs == -1).nonzero().reshape(-1).tolist()
    assert same_snapshot(a.integrity_snapshot(), before), \
        f"never-allocated pages {sorted(set(never) - set(after))} came back marked FREE (refs 0)"
