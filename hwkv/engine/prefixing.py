"""The engine's prefix caching over hybrid pools: admission from a request's longest cached prefix, room made
before a forward's allocation, prompt pages cached as their chunks complete, finished requests' K/V handed to the
cache. The cache itself (the radix tree over full and SWA pages, locks, eviction) is `hwkv.cache`'s; this is
what the step loop asks of it, in one place.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

from hwkv.cache import HybridPrefixCache
from hwkv.engine.forward import ForwardSlots
from hwkv.engine.pools import Cache
from hwkv.engine.scheduler import Request, Row, Scheduler
from hwkv.errors import OutOfSlotsError


class EnginePrefix:
    """The step loop's side of a `HybridPrefixCache` (`tree`) over `cache`'s pools, with the engine's scheduler
    and forward slots (each row's frontier)."""

    def __init__(self, cache: Cache, window: int, scheduler: Scheduler, slots: ForwardSlots) -> None:
        self.cache, self.scheduler, self.slots = cache, scheduler, slots
        self.tree = HybridPrefixCache(cache.allocator, window)
        self.left = 0  # requests that left the engine (their K/V came to the cache: admission may fit now)
        self.refused_at: Optional[Tuple[int, int]] = None  # (left, cached tokens) at the last refused admission

    def start(self, req: Request) -> bool:
        """Admit `req` from its longest cached prefix when its worst case fits: the running requests' pages
        still to come and its own new pages within the free full slots plus what the cache can evict (its
        match locked first, so that is not counted). Nothing is evicted between the match and the acquire. Once
        started, `req.reused` is the length of its match."""
        c, a, p = self.tree, self.cache.allocator, self.cache.plan.page_size
        # free + evictable - need grows only when a request leaves (running requests' allocations and evictions
        # move both sides alike) or the cache holds more (a longer match): until then a refusal stands, with no
        # device read while the queue waits
        state = (self.left, c.full_tokens)
        if self.refused_at == state:
            return False
        m = c.match_prefix(req.prompt[:-1])
        held = c.lock(m)
        need = (self.scheduler.full_pages_left() + req.full_pages) * p - m.length
        free, evictable = a.full_available_size(), c.evictable_full  # the one device read of an admission
        if need > free + evictable:
            c.unlock(held)
            self.refused_at = state
            return False
        # the cache may hold this prompt's history past the match (its window evicted, so the match was cut
        # back): caching the recomputed prompt locks those nodes too, so make the room now, with the match locked
        stale = max(0, len(req.prompt) // p * p - m.length)
        if need + min(stale, evictable) > free + evictable:
            self.evict(0, need - free)
        row = self.cache.rtt.alloc(1)[0]
        try:
            req.lock, frontier = c.acquire(m, self.cache.rtt, row)
        except BaseException:
            self.cache.rtt.free([row])
            raise
        finally:
            c.unlock(held)
        req.row, req.kv_len, req.reused = row, m.length, m.length
        self.slots.set_frontier(row, frontier)
        return True

    def clear(self) -> int:
        """Evict everything the cache holds that no running request uses; returns the tokens evicted."""
        n = 0
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
        request's lock moves to the new end, over its SWA from its new frontier on."""
        for r in rows:
            if r.prefix < len(r.req.prompt):
                seq, row = r.prefix + r.n, r.req.row
                if not lock:
                    self.tree.insert(r.req.prompt[:seq], self.cache.rtt.req_to_token[row, :seq],
                                     int(self.slots.frontiers_cpu[row]))
                else:
                    r.req.lock = self.tree.cache_running(r.req.prompt[:seq], self.cache.rtt, row, seq,
                                                         int(self.slots.frontiers_cpu[row]), r.req.lock)

    def release(self, done: List[Request]) -> None:
        """Finished requests' tokens go to the cache and their own references back, in two allocator calls per
        round of requests that share no page (`HybridPrefixCache.release_requests`), not two per request."""
        self.left += len(done)
        front = self.slots.frontiers_cpu
        self.tree.release_requests([((r.prompt + r.output)[:r.kv_len], r.row, r.kv_len, int(front[r.row]), r.lock)
                                    for r in done], self.cache.rtt)
        for r in done:
            r.lock = None

    def evictable(self) -> Tuple[int, int]:
        """(full, SWA) slots only the cache holds now (evictable): not the requests' KV."""
        return self.tree.evictable_full, self.tree.evictable_swa
