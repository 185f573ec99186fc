"""The engine's prefix caching over hybrid pools: admission from a request's longest cached prefix, room made
before a forward's allocation, prompt pages cached as their chunks complete, finished requests' K/V handed to the
cache. The cache itself (the radix tree over full and SWA pages, locks, eviction) is `hwkv.cache`'s; this is
what the step loop asks of it, in one place.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

from hwkv.cache import HybridPrefixCache, window_start
from hwkv.engine.forward import ForwardSlots
from hwkv.engine.pools import Cache
from hwkv.sigint import interrupts_held
from hwkv.engine.scheduler import Request, Row, Scheduler
from hwkv.errors import OutOfSlotsError


class EnginePrefix:
    """The step loop's side of a `HybridPrefixCache` (`tree`) over `cache`'s pools, with the engine's scheduler
    and forward slots (each row's frontier)."""

    def __init__(self, cache: Cache, window: int, scheduler: Scheduler, slots: ForwardSlots) -> None:
        self.cache, self.scheduler, self.slots = cache, scheduler, slots
        self.tree = HybridPrefixCache(cache.allocator, window)
        self.left = 0  # requests that left the engine (their K/V came to the cache: admission may fit now)
        # tokens the cache came to hold, new or revived (inserts' counts; it only grows): a match may be longer now
        self.gained = 0
        self.refused_at: Optional[Tuple[int, int]] = None  # (left, gained) at the last refused admission

    def start(self, req: Request) -> bool:
        """Admit `req` from its longest cached prefix when its worst case fits: the running requests' pages
        still to come and its own new pages within the free full slots plus what the cache can evict (its
        match locked first, so that is not counted). Nothing the match names is evicted before the acquire (the
        room made between them comes from other nodes: the match is locked). Once started, `req.reused` is the
        length of its match and `req.stale` its `stale_bound`."""
        c, a, p = self.tree, self.cache.allocator, self.cache.plan.page_size
        # free + evictable - need grows only when a request leaves (running requests' allocations and evictions
        # move both sides alike; locks only lower it) or the cache gains K/V (new or revived: a longer match):
        # until then a refusal stands, with no device read while the queue waits
        state = (self.left, self.gained)
        if self.refused_at == state:
            return False
        m = c.match_prefix(req.prompt[:-1])
        held = c.lock(m)
        try:   # every way out unlocks the match: a refusal, an error the device read raises (a deferred check's
            # record), an eviction's or the acquire's (whose own references hold the nodes once it returns)
            need = (self.scheduler.full_pages_left() + req.full_pages) * p - m.length
            free, evictable = a.full_available_size(), c.evictable_full  # the one device read of an admission
            if need > free + evictable:
                self.refused_at = state
                return False
            # what the cache evicts now is not all free later: the prefilling requests' caching (this one's too)
            # may lock cached history as second copies, up to their `stale` bounds. Where the worst case does not
            # fit without those, make the room now (with the match locked): the free slots alone then hold it
            stale = self.stale_bound(req, m.length)
            if need > free + max(0, evictable - self.scheduler.stale - stale):
                self.evict(0, need - free)
            row = self.cache.rtt.alloc(1)[0]
            try:
                req.lock, frontier = c.acquire(m, self.cache.rtt, row)
            except BaseException:
                self.cache.rtt.free([row])
                raise
        finally:
            c.unlock(held)
        req.row, req.kv_len, req.reused, req.stale = row, m.length, m.length, stale
        self.slots.set_frontier(row, frontier)
        return True

    def stale_bound(self, req: Request, cached: int) -> int:
        """A bound on the cached full tokens that caching the rest of `req`'s prompt (its first `cached` tokens
        cached and locked) may lock as a second copy: the cache may hold the prompt's history past its match
        (the match was cut back, or another request cached it since), and `cache_running` adopts the request's
        pages for it except in SWA nodes wholly below the request's frontier, which keep their own. A frontier
        never passes the window start of the whole prompt, so those lie between `cached` and that."""
        p = self.cache.plan.page_size
        return max(0, window_start(len(req.prompt), self.tree.window, p) - cached // p * p)

    def clear(self) -> int:
        """Evict everything the cache holds that no running request uses; returns the tokens evicted."""
        n = 0
        with interrupts_held():  # all of it (a Ctrl-C raised after)
            while self.tree.evictable_full:
                n += self.tree.evict(self.tree.evictable_full)
            while self.tree.evictable_swa:
                self.tree.evict_swa(self.tree.evictable_swa)
        return n

    def evict(self, swa_tokens: int, full_tokens: int) -> None:
        """Evict cached KV (least recently used, unlocked) for this many more free tokens in each pool."""
        c = self.tree
        if full_tokens > 0:
            c.evict(min(full_tokens, c.evictable_full))
        if swa_tokens > 0:
            c.evict_swa(min(swa_tokens, c.evictable_swa))

    def make_room(self, rows: List[Row]) -> None:
        """Before a forward's allocation: evict cached KV where its new pages exceed the free pages."""
        self.make_room_for(self.scheduler.new_pages([r.prefix for r in rows], [r.n for r in rows]))

    def make_room_for(self, pages: int) -> None:
        """Evict cached KV until `pages` new pages fit in each pool (the host's bound of free pages first: the
        device is read only when that says they might not fit). OutOfSlotsError when eviction cannot make it."""
        if not pages:
            return
        p = self.cache.plan.page_size
        for ring, evictable, evict in self._rings():
            while not ring.has_room(pages):
                short = (pages - ring.free_pages()) * p
                if evictable() == 0:
                    raise OutOfSlotsError(f"a forward needs {pages} pages in the {ring.name} pool, {ring.free_pages()} "
                                          "are free and the prefix cache holds nothing evictable: admission reserved "
                                          "less than the running requests take (a bug)")
                evict(min(short, evictable()))

    def can_make_room_for(self, pages: int) -> bool:
        """Whether `pages` new pages fit in each pool once the cache evicts what it can (nothing is evicted)."""
        p = self.cache.plan.page_size
        return all(ring.has_room(pages) or ring.free_pages() + evictable() // p >= pages
                   for ring, evictable, _ in self._rings())

    def _rings(self) -> Tuple[Tuple[Any, Callable[[], int], Callable[[int], int]], ...]:
        """(page ring, its evictable tokens, its eviction) per pool."""
        a, c = self.cache.allocator, self.tree
        return ((a.pages, lambda: c.evictable_full, c.evict),
                (a.swa_attn_allocator.pages, lambda: c.evictable_swa, c.evict_swa))

    def cache_prompts(self, rows: List[Row], lock: bool) -> None:
        """Cache what each prompt chunk of this forward completed (whole pages). Before the release (`lock`
        False) with all the SWA the request still holds, so a prefix other prompts share (a system prompt
        ending inside the chunk) keeps its window until SWA eviction needs the room; after it (`lock`), the
        request's lock moves to the new end, over its SWA from its new frontier on, and its `stale` bound
        shrinks to the rest of its prompt. (The first insert holds the chunk's tokens with more SWA than the
        second, so the second gains nothing.)"""
        for r in rows:
            if r.prefix < len(r.req.prompt):
                seq, row = r.prefix + r.n, r.req.row
                if not lock:
                    self.gained += self.tree.insert(r.req.prompt[:seq], self.cache.rtt.req_to_token[row, :seq],
                                                    int(self.slots.frontiers_cpu[row]))
                else:
                    r.req.lock = self.tree.cache_running(r.req.prompt[:seq], self.cache.rtt, row, seq,
                                                         int(self.slots.frontiers_cpu[row]), r.req.lock)
                    self.scheduler.set_stale(r.req, self.stale_bound(r.req, seq))

    def release(self, done: List[Request]) -> None:
        """Finished requests' tokens go to the cache and their own references back, in two allocator calls per
        round of requests that share no page (`HybridPrefixCache.release_requests`), not two per request."""
        self.left += len(done)
        front = self.slots.frontiers_cpu
        self.gained += self.tree.release_requests(
            [((r.prompt + r.output)[:r.kv_len], r.row, r.kv_len, int(front[r.row]), r.lock) for r in done],
            self.cache.rtt)
        for r in done:
            r.lock = None

    def evictable(self) -> Tuple[int, int]:
        """(full, SWA) slots only the cache holds now (evictable): not the requests' KV."""
        return self.tree.evictable_full, self.tree.evictable_swa
