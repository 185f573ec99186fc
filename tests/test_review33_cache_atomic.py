"""Session 33 review: the prefix cache's public calls under a Ctrl-C part way. Each test here fails on the code it was
written against and shows one defect: a KeyboardInterrupt (a real SIGINT, so an `interrupts_held` region would defer
it as it defers a user's Ctrl-C) raised at one internal call of a `HybridPrefixCache` method leaves the cache, the
allocator or req_to_token neither as they were nor as the whole call leaves them. Expected of every call: either its
whole effect lands (a Ctrl-C held to its end) or nothing changed, and `check_integrity()` of the cache and the
allocator pass.

Fixed in session 33: each call's changes run under `interrupts_held`; `lock` and `acquire` undo themselves when a
Ctrl-C came (their handle could not reach the caller), `cache_running` hands its new lock to the handle its caller
passed. Found against 839aa80: only `evict` and `evict_swa` held SIGINT (hwkv/cache.py:646, 672); `match_prefix` (its split), `lock`, `unlock`,
`insert`, `acquire`, `cache_running`, `release_requests` and `evict_node` do not, nor do the allocator's `free` and
`share` they call, nor `Engine.clear_prefix_cache` around its evictions. The engine's step calls the cache inside its
own `interrupts_held` blocks (admission, prompt caching, hand-over), so its steps are not affected; the cache's direct
callers and `clear_prefix_cache` are. Search (against 839aa80): a SIGINT at each Python-level call made during each
method (the cache's own methods and its nodes' properties, the allocator's, its rings', req_to_token's), over 20
workloads: 2,604 injections at 523 (method, call site) pairs, 229 pairs fine (every one of `evict` and `evict_swa`,
and for the others the checks before their first change); `clear_prefix_cache`: 77 pairs, 22 fine.
"""
from __future__ import annotations

import os
import signal
from typing import Callable, List, Optional, Tuple

import pytest
import torch

import hwkv.allocator as allocator_mod
import hwkv.torch_page_ops as torch_page_ops
from hwkv.allocator import same_snapshot
from hwkv.cache import _Node
from test_allocator import make
from test_cache_defects import Setup
from test_review32_injection import _inside

pytestmark = pytest.mark.usefixtures("one_thread", "python_sigint")  # conftest

H = list(range(100, 140))  # a 40-token prompt: page 4, window 8


def _sigint_at(monkeypatch, owner, name: str, nth: int = 1, inside: Optional[List[int]] = None) -> List[int]:
    """A real SIGINT at the `nth` call of `owner.name` (counting only calls made while `inside` is non-empty, if
    given): a KeyboardInterrupt there, before the call runs, after what ran before it."""
    original, calls, fired = getattr(owner, name), [], []

    def injected(*args, **kwargs):
        if not fired and (inside is None or inside):
            calls.append(1)
            if len(calls) == nth:
                fired.append(1)
                os.kill(os.getpid(), signal.SIGINT)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, injected)
    return fired


def _sigint_at_property(monkeypatch, cls, name: str, inside: List[int]) -> List[int]:
    """A real SIGINT at the first read of the property `cls.name` while `inside` is non-empty."""
    prop, fired = cls.__dict__[name], []

    def getter(obj):
        if not fired and inside:
            fired.append(1)
            os.kill(os.getpid(), signal.SIGINT)
        return prop.fget(obj)

    monkeypatch.setattr(cls, name, property(getter))
    return fired


def _state(s: Setup, handles) -> tuple:
    """The allocator, req_to_token and its free rows, the cache's books and every node (`Setup.snapshot`), and
    whether each lock handle is still active."""
    return s.snapshot() + (tuple(h.active for h in handles),)


def _same(s: Setup, x: tuple, y: tuple) -> bool:
    return s.same(x[:-1], y[:-1]) and x[-1] == y[-1]


def _differs(s: Setup, x: tuple, y: tuple) -> List[str]:
    names = ["allocator", "req_to_token", "full_tokens", "swa_tokens", "evictable_full", "evictable_swa",
             "node count", "free rows", "nodes", "lock handles"]
    out = [names[0]] if not same_snapshot(x[0], y[0]) else []
    out += [names[1]] if not torch.equal(x[1], y[1]) else []
    return out + [n for n, a, b in zip(names[2:], x[2:], y[2:]) if a != b]


def _integrity(s: Setup) -> List[str]:
    errors = []
    for check in (s.a.check_integrity, s.c.check_integrity):
        try:
            check()
        except AssertionError as e:
            errors.append(f"{check.__qualname__}: {e}")
    return errors


Build = Callable[[], Tuple[Setup, Callable[[], object], list]]


def _atomic(monkeypatch, build: Build, inject: Callable[[Setup], List[int]]) -> None:
    """`build()` -> (setup, the call, its lock handles). The call interrupted by `inject(setup)` must raise
    KeyboardInterrupt and leave everything as before it or as the uninterrupted call (on a twin setup) leaves it,
    the cache's and the allocator's checks passing."""
    ref, call, handles = build()
    call()
    after = _state(ref, handles)
    s, call, handles = build()
    before = _state(s, handles)
    fired = inject(s)
    with pytest.raises(KeyboardInterrupt):
        call()
    monkeypatch.undo()
    assert fired
    now = _state(s, handles)
    errors = _integrity(s)
    if _same(s, now, before) or _same(s, now, after):
        assert not errors
        return
    pytest.fail(f"interrupted part way: {', '.join(_differs(s, now, before))} changed from before, "
                f"{', '.join(_differs(s, now, after))} differ from the whole call's; checks: {errors or 'pass'}")


def _lands_then_unlocked(monkeypatch, build: Build, inject: Callable[[Setup], List[int]],
                         unlock_cut: Callable[[Setup, list], None]) -> None:
    """For `cache_running`, whose new lock cannot reach a caller that gets a KeyboardInterrupt instead: the call
    interrupted by `inject(setup)` lands whole, with the request's lock where its caller can release it (the handle it
    passed takes the new lock over; without one, the new lock is released: the nodes stay cached, unlocked). Checked:
    once that lock is released (`unlock_cut(setup, handles)`), everything is as the whole call leaves it once its
    returned lock is released."""
    ref, call, handles = build()
    ref.c.unlock(call())
    after = _state(ref, handles)
    s, call, handles = build()
    fired = inject(s)
    with pytest.raises(KeyboardInterrupt):
        call()
    monkeypatch.undo()
    assert fired
    assert not _integrity(s)
    unlock_cut(s, handles)
    now = _state(s, handles)
    assert _same(s, now, after), f"{', '.join(_differs(s, now, after))} differ from the whole call's"
    assert not _integrity(s)


def _fresh() -> Setup:
    return Setup(page=4, window=8)


def _cached_with_branch() -> Setup:
    """H cached (tombstones [0, 28), SWA [28, 40)) and a second prompt branching from it at 20."""
    s = _fresh()
    s.finish(s.run(H))
    s.finish(s.run(H[:20] + list(range(600, 640))))
    return s


# ---- 1. match_prefix: a split cut short leaves nodes out of the eviction heaps and the node count ----------------
def test_a_ctrl_c_inside_match_prefixs_split_leaves_the_tree_evictable(monkeypatch):
    """`match_prefix` (hwkv/cache.py:194-205) splits the node its match ends inside (`_node_at` -> `_split`,
    cache.py:162); `_split` (cache.py:165-180) re-links the two parts (cache.py:172-174), then counts the new node
    (cache.py:177) and queues both parts for SWA eviction (`_push_swa`, cache.py:178-179). Injection: SIGINT at the
    `lock_swa` read of `_split` (cache.py:175). Left: [28, 40) is split into [28, 36) and [36, 40) in the tree, but
    `_nodes_count` is one short and the new [28, 36) is in no eviction heap (`check_integrity`: "SWA node [28, 36) is
    missing from the SWA heap"); `evict_swa(evictable_swa)` then raises CacheError "internal: an eviction heap lost
    an evictable node". Expected: the split lands whole (or not at all)."""
    def build():
        s = _fresh()
        s.finish(s.run(H))
        return s, lambda: s.c.match_prefix(H[:37]), []     # ends at 36, inside [28, 40)

    _atomic(monkeypatch, build, lambda s: _sigint_at_property(monkeypatch, _Node, "lock_swa",
                                                               _inside(monkeypatch, s.c, "match_prefix")))


# ---- 2. lock: a lock cut short keeps a count with no handle to release it -----------------------------------------
def test_a_ctrl_c_inside_lock_leaves_no_lock_count_without_a_handle(monkeypatch):
    """`lock` -> `_lock` (hwkv/cache.py:287-303) walks from the matched node to the root raising `lock_full`
    (cache.py:295-297) and then the node's SWA lock (cache.py:298-301), and returns the PrefixLock at the end.
    Injection: SIGINT at the `lock_swa` read of the matched node [28, 36) (cache.py:299). Left: that node's
    `lock_full` is 1 and `evictable_full` 8 lower, with no SWA lock and no PrefixLock returned: nothing can ever
    release it (the node is pinned for good, `check_integrity`: "a lock does not cover its path"). Expected: the lock
    lands whole (the handle returned, or a Ctrl-C held to the end) or nothing is locked."""
    def build():
        s = _cached_with_branch()
        m = s.c.match_prefix(H[:39])
        return s, lambda: s.c.lock(m), []

    _atomic(monkeypatch, build, lambda s: _sigint_at_property(monkeypatch, _Node, "lock_swa",
                                                               _inside(monkeypatch, s.c, "lock")))


# ---- 3. unlock: a release cut short marks the handle released and keeps the rest of the path locked --------------
def test_a_ctrl_c_inside_unlock_leaves_no_node_locked_for_good(monkeypatch):
    """`unlock` (hwkv/cache.py:305-324) marks the handle released first (`lock.active = False`, cache.py:310), then
    walks the path lowering each node's counts. Injection: SIGINT at the first `_push_full` (cache.py:316, the matched
    node [28, 36)). Left: the handle is inactive (a second `unlock` raises "already released"), [28, 36) keeps its SWA
    lock and its parents [20, 28) and [0, 20) their full locks: pinned for good, never evictable. Expected: the
    handle stays active with every count as before, or the whole path is released."""
    def build():
        s = _cached_with_branch()
        lk = s.c.lock(s.c.match_prefix(H[:39]))
        return s, lambda: s.c.unlock(lk), [lk]

    def inject(s):
        return _sigint_at(monkeypatch, s.c, "_push_full")

    _atomic(monkeypatch, build, inject)


# ---- 4. insert: references taken for nodes that never come ------------------------------------------------------
@pytest.mark.parametrize("case", ["new", "revive"])
def test_a_ctrl_c_inside_insert_leaves_no_reference_held_by_nobody(monkeypatch, case):
    """`insert` (hwkv/cache.py:327-390) takes the cache's references in two allocator calls (`share`, cache.py:370 and
    371), drops revived tombstones' old pages (`free`, cache.py:374), then updates the revived nodes and adds the new
    ones (cache.py:375-388). new: an empty cache, H inserted with frontier 28; injection SIGINT at the second `share`
    (cache.py:371): the cache's full references on the 7 pages of [0, 28) are taken and no node holds them (held by
    nobody, never freed), the tree still empty. revive: H cached as tombstones, H and 6 more tokens recomputed
    (frontier 32); injection SIGINT at `free(old)` (cache.py:374): both shares landed (the cache's full and SWA
    references on the request's 3 pages of [32, 44)), the tombstone [32, 40) keeps its old pages and no node was added:
    those references are held by nobody. Expected: the insert lands whole or takes nothing."""
    def build():
        s = _fresh()
        if case == "revive":
            s.finish(s.run(H))
            s.c.evict_swa(s.c.evictable_swa)                # [0, 40) tombstones
        ids = H + list(range(500, 506)) if case == "revive" else H   # revive: frontier 32, inside [0, 40)
        r = s.run(ids)
        return s, lambda: s.c.insert(ids, s.rtt.req_to_token[r["row"], :len(ids)], r["frontier"]), [r["lock"]]

    def inject(s):
        inserting = _inside(monkeypatch, s.c, "insert")
        if case == "new":
            return _sigint_at(monkeypatch, s.a, "share", nth=2, inside=inserting)
        return _sigint_at(monkeypatch, s.a, "free", inside=inserting)

    _atomic(monkeypatch, build, inject)


# ---- 5. acquire: the row written and references taken with no lock ------------------------------------------------
def test_a_ctrl_c_inside_acquire_leaves_the_row_and_the_references_as_they_were(monkeypatch):
    """`acquire` (hwkv/cache.py:423-437) writes the match into the request's row (cache.py:434), takes the request's
    references in two allocator calls (`share`, cache.py:435 full below the window, 436 full and SWA from it) and locks
    last (`_lock`, cache.py:437). Injection: SIGINT at the second `share` (cache.py:436). Left: the request's full
    references on the 7 pages of [0, 28) are taken and nothing is locked, no PrefixLock returned: the caller cannot
    tell how far it got (the engine's `EnginePrefix.start` is safe only because admission holds SIGINT), and those
    references are held by nobody. Expected: the allocator (and the row) as before, or the whole acquire."""
    def build():
        s = _fresh()
        s.finish(s.run(H))
        m = s.c.match_prefix(H[:39])
        row = s.rtt.alloc(1)[0]
        return s, lambda: s.c.acquire(m, s.rtt, row), []

    _atomic(monkeypatch, build,
            lambda s: _sigint_at(monkeypatch, s.a, "share", nth=2, inside=_inside(monkeypatch, s.c, "acquire")))


# ---- 6. cache_running: the new lock taken and lost, the old one kept -----------------------------------------------
def test_a_ctrl_c_inside_cache_running_leaves_no_second_lock(monkeypatch):
    """`cache_running` (hwkv/cache.py:439-481) inserts, adopts, takes the new lock (`_lock`, cache.py:478) and only
    then releases the request's old one (`self.unlock(lock)`, cache.py:480). Injection: SIGINT at that `unlock`.
    Left: the new lock's counts are on the request's whole path but its PrefixLock is never returned, while the old
    lock stays active: the caller keeps the old one, and the new one can never be released (the request's cached
    prompt pinned for good once it ends). Expected: the old lock moved to the new end whole, or nothing changed."""
    def build():
        s = _fresh()
        s.finish(s.run(H))
        ids = H + list(range(500, 520))
        r = s.run(ids)
        return s, lambda: s.c.cache_running(ids, s.rtt, r["row"], r["seq"], r["frontier"], r["lock"]), [r["lock"]]

    _lands_then_unlocked(monkeypatch, build, lambda s: _sigint_at(monkeypatch, s.c, "unlock"),
                         lambda s, handles: s.c.unlock(handles[0]))


# ---- 7. cache_running's adopt: nodes re-pointed, the old copies' references never dropped -------------------------
def test_a_ctrl_c_inside_cache_runnings_adopt_leaves_no_old_copy_held_by_nobody(monkeypatch):
    """`cache_running` -> `_adopt` (hwkv/cache.py:483-501) points the cached nodes from the request's frontier on at
    the request's pages (cache.py:495), takes references on them (`share`, cache.py:500) and then drops the old copies'
    (`free`, cache.py:501), full pages first, then the SWA nodes' (the same two calls with SWA). Injection: SIGINT at
    the first `free` (the tombstone [0, 28)'s old pages). Left: [0, 28) and [32, 40) name the request's pages, but
    the SWA share for [32, 40) never ran, so the cache holds no reference on the pages it lists there (once the request
    frees them, `check_integrity`: "a cached full page is not live"); the old copies' references (the 7 pages of
    [0, 28), full and SWA of [32, 40)) are held by nobody; nothing is locked (insert's new [40, 44) sits unlocked under
    a running request). Expected: the adopt lands whole; with no handle to carry the new lock (none was passed), it is
released, the nodes cached and unlocked."""
    def build():
        s = _fresh()
        s.finish(s.run(H))                                  # [0, 28) tombstones, [28, 40) SWA
        ids = H + list(range(500, 506))
        n = len(ids)
        row, fr = s.recompute(n)   # the same 40 tokens recomputed, and 6 more
        return s, lambda: s.c.cache_running(ids, s.rtt, row, n, fr, None), []

    _lands_then_unlocked(monkeypatch, build,   # (the first free of this cache_running is _adopt's: its insert
                         lambda s: _sigint_at(monkeypatch, s.a, "free",  # revives nothing)
                                              inside=_inside(monkeypatch, s.c, "cache_running")),
                         lambda s, handles: None)


# ---- 8. release_requests: a request cached and unlocked, its references kept, no way to retry ----------------------
def test_a_ctrl_c_inside_release_requests_leaves_every_request_releasable(monkeypatch):
    """`release_requests` (hwkv/cache.py:513-563) caches and unlocks the requests one by one (`insert`, cache.py:543;
    `unlock`, cache.py:545) and drops their own references only at the end (`free` rounds, cache.py:558-562).
    Injection: SIGINT at the second request's `unlock` (cache.py:545). Left: the first two requests' tokens are cached
    ([40, 52) and [40, 56)), the first one's lock released and the other two still held, and no request's own
    references dropped; a retry is refused (CacheError "this prefix lock was already released"), and without one the
    three requests' pages are held by nobody. Expected: every request released whole, or nothing changed (the call
    can be made again)."""
    def build():
        s = _fresh()
        s.finish(s.run(H))
        rs = [s.run(H + list(range(500, 512))), s.run(H + list(range(700, 716))), s.run(list(range(900, 930)))]
        reqs = [(r["ids"], r["row"], r["seq"], r["frontier"], r["lock"]) for r in rs]
        return s, lambda: s.c.release_requests(reqs, s.rtt), [r["lock"] for r in rs]

    _atomic(monkeypatch, build, lambda s: _sigint_at(monkeypatch, s.c, "unlock", nth=2))


# ---- 9. evict_node: nodes out of the tree whose pages were never freed --------------------------------------------
def test_a_ctrl_c_inside_evict_node_leaves_no_node_out_of_the_tree_with_its_pages(monkeypatch):
    """`evict_node` (hwkv/cache.py:691-711) detaches the subtree leaves first (`_detach`, cache.py:708) and frees their
    pages after the loop (`_free`, cache.py:710), with no `interrupts_held` (unlike `evict`, cache.py:646). Injection:
    SIGINT at the second `_detach`. Left: the leaf [36, 40) is out of the tree and out of the books, but its page's full
    and SWA references were never dropped: held by nobody for good. Expected: the subtree and its pages go together,
    or nothing changed."""
    def build():
        s = _cached_with_branch()
        m = s.c.match_prefix(H[:37])                        # the node [28, 36) and its child [36, 40)
        return s, lambda: s.c.evict_node(m), []

    _atomic(monkeypatch, build, lambda s: _sigint_at(monkeypatch, s.c, "_detach", nth=2))


# ---- 10. the allocator's free, under every cache call that gives pages back: a page lost ----------------------------
@pytest.mark.parametrize("host", [True, False], ids=["host-path", "torch-ops"])
def test_a_ctrl_c_inside_the_allocators_free_loses_no_page(monkeypatch, host):
    """`SWATokenToKVPoolAllocator.free` -> `_change` (hwkv/allocator.py:567-582) is not held either: on the host path
    `_change_on_host` writes the new reference counts (allocator.py:595-597) and then pushes the pages that reached 0
    back on the ring (`_push_on_host`, allocator.py:599); the torch ops' `change_refs` likewise scatters the counts
    (hwkv/torch_page_ops.py:153) before `_push` (torch_page_ops.py:155). The prefix cache frees through it from
    `release_requests` (cache.py:562), `insert` (374), `_adopt` (501) and `evict_node` (`_free`, 659); only `evict` /
    `evict_swa` hold SIGINT around it. Injection: SIGINT at that push, freeing two pages of one request. Left: the pages
    have no holder and are not on the free ring (`check_integrity`: "a page is lost or counted twice"), their SWA pages
    still mapped. Expected: the free lands whole or not at all (as `alloc` since session 33, allocator.py:336-347)."""
    _, a = make(size=64, size_swa=32, page=4)
    a.immediate, a.host_ops = True, host
    loc = a.alloc_extend([0], [8], [-1], 8)
    _, twin = make(size=64, size_swa=32, page=4)
    twin.immediate, twin.host_ops = True, host
    twin.free(twin.alloc_extend([0], [8], [-1], 8))
    before, after = a.integrity_snapshot(), twin.integrity_snapshot()
    fired = (_sigint_at(monkeypatch, allocator_mod, "_push_on_host") if host
             else _sigint_at(monkeypatch, torch_page_ops, "_push"))
    with pytest.raises(KeyboardInterrupt):
        a.free(loc)
    monkeypatch.undo()
    assert fired
    now = a.integrity_snapshot()
    if not (same_snapshot(now, before) or same_snapshot(now, after)):
        try:
            a.check_integrity()
            checks = "pass"
        except AssertionError as e:
            checks = str(e)
        pytest.fail(f"an interrupted free changed the allocator part way (full refs {now['full']['refs'][1:3].tolist()}"
                    f", free {now['full']['tail'] - now['full']['head']} pages); check_integrity: {checks}")


# ---- 11. Engine.clear_prefix_cache: the full eviction lands, the SWA one never runs ---------------------------------
def test_a_ctrl_c_inside_clear_prefix_cache_clears_all_or_nothing(monkeypatch):
    """`Engine.clear_prefix_cache` (hwkv/engine/engine.py:732-738) -> `EnginePrefix.clear` (hwkv/engine/prefixing.py:
    77-84) calls `evict` until nothing full is evictable, then `evict_swa`; each holds SIGINT for itself only, so a
    Ctrl-C during the full eviction is raised at its end and the SWA eviction never runs. Injection: SIGINT at the
    cache's `allocator.free` inside `evict` (`_free`, hwkv/cache.py:659; held, raised at cache.py:646), with two
    requests running (their nodes locked). Left: every unlocked node evicted, the SWA of the locked nodes below the
    requests' windows still cached. Low severity: the books are consistent (`check_integrity` passes) and a second call
    finishes the job; but the call is neither whole nor undone. Expected: the whole clear lands (one held region)."""
    from test_review20_prefix import _engine
    from hwkv.engine.sampling import SamplingParams

    class View:  # what `Setup.snapshot` reads
        def __init__(self, e):
            self.e, self.a, self.c, self.rtt = e, e.cache.allocator, e.prefix, e.cache.rtt

    def build():
        e = _engine(chunk=8)
        e.generate([list(range(1, 12)), [1, 2, 3, 4, 5, 6, 20, 21, 22]], SamplingParams(max_new_tokens=12))
        e.add_request(list(range(1, 12)) + [40, 41, 42, 43], SamplingParams(max_new_tokens=12))
        e.add_request(list(range(30, 50)), SamplingParams(max_new_tokens=12))
        while e.has_work():   # (a clear is refused while requests run: review 37)
            e.step()
        return View(e), e.clear_prefix_cache, []

    ref, call, _ = build()
    call()
    after = Setup.snapshot(ref)
    s, call, _ = build()
    before = Setup.snapshot(s)
    fired = _sigint_at(monkeypatch, s.a, "free", inside=_inside(monkeypatch, s.c, "evict"))
    with pytest.raises(KeyboardInterrupt):
        call()
    monkeypatch.undo()
    assert fired
    now = Setup.snapshot(s)
    if not (Setup.same(s, now, before) or Setup.same(s, now, after)):
        pytest.fail(f"cleared part way: cached (full, SWA) {s.c.full_tokens, s.c.swa_tokens}, evictable "
                    f"{s.c.evictable_full, s.c.evictable_swa}; before {before[2:6]}, the whole clear "
                    f"{after[2:6]}; checks: {_integrity(s) or 'pass'}")
