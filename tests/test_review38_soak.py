"""Review 38 (soak): leaks and state drift over long, interleaved sequences of the engine-facing API.

Each test is a minimal reproduction of one defect found by seeded random interleavings (engine steps with the prefix
cache on and off, chunked prefill, requests added and aborted at every phase, generate, refused calls, verify steps,
whole-step and layer graphs, out-of-window releases, evictions, clear_prefix_cache; and the same at the component
level: allocator, HybridPrefixCache, ReqToTokenPool, release and accept_draft_tokens). Every test fails on the code it
was written against and passes once the defect is fixed.
"""
from __future__ import annotations

import pytest
import torch

from hwkv.allocator import SWATokenToKVPoolAllocator, same_snapshot
from hwkv.cache import HybridPrefixCache
from hwkv.errors import DoubleFreeError, LocError, NotAllocatedError
from hwkv.pool import SWAKVPool
from hwkv.req_to_token import ReqToTokenPool

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module

P = 4  # page size


def _cache_world(window: int = 8):
    pool = SWAKVPool(64, 32, P, torch.float32, 1, 2, [0], [1], "cpu")
    a = SWATokenToKVPoolAllocator(64, 32, P, "cpu", pool)
    rtt = ReqToTokenPool(4, 32, "cpu")
    return a, rtt, HybridPrefixCache(a, window)


def _cache_snapshot(a, rtt, c):
    nodes = sorted((nd.start, nd.end, nd.swa, nd.lock_full, nd.locs.tolist()) for nd in c._nodes())
    return (a.integrity_snapshot(), rtt.req_to_token.clone(),
            (c.full_tokens, c.swa_tokens, c.evictable_full, c.evictable_swa), nodes)


# ---- 1. a request released twice (no lock) frees the pages the cache took from it ---------------------------------
@pytest.mark.parametrize("cache_again, row_freed", [(True, False), (False, False), (True, True)])
def test_a_request_released_twice_is_refused_and_leaves_the_cached_pages_live(cache_again, row_freed):
    """A second release_request of one request (lock=None) frees the cache's pages instead of raising a typed error."""
    # `HybridPrefixCache.release_requests` (hwkv/cache.py:558) checks only that the row's pages are live (`_precheck`,
    # cache.py:585), and after the first release they are: the cache holds them. So releasing the same request again
    # (lock=None, the default; e.g. an abort racing a finish in the caller) drops the cache's own references: the
    # cached pages go free while the tree still names them (`check_integrity`: "a cached full page is not live"), and
    # the next allocation hands them to another request while a later match still reads them. `accept_draft_tokens`
    # guards the same mistake (its cleared positions make a second accept a DoubleFreeError), one release naming a row
    # twice is refused (bad-inputs row 185), and bad-inputs row 99 says `cache=False` with a row the request does not
    # hold is a LocError. Also after the row went back to the ReqToTokenPool (a release naming a free row).
    # Expected: the second release is a typed error (DoubleFreeError / NotAllocatedError / LocError), nothing changed.
    a, rtt, c = _cache_world()
    ids = list(range(100, 108))
    row = rtt.alloc(1)[0]
    rtt.write(row, 0, a.alloc_extend([0], [8], [0], 8))
    assert c.release_request(ids, rtt, row, 8, 0, None, cache=True) == 8   # the cache now holds both pages alone
    if row_freed:  # as the engine does after a release: the row goes back (a second release names a free row)
        rtt.free(row)
    c.check_integrity()
    before = _cache_snapshot(a, rtt, c)
    with pytest.raises((DoubleFreeError, NotAllocatedError, LocError)):
        c.release_request(ids, rtt, row, 8, 0, None, cache=cache_again)
    after = _cache_snapshot(a, rtt, c)
    assert same_snapshot(before[0], after[0]) and before[2:] == after[2:], "the refused release changed the state"
    c.check_integrity()
    a.check_integrity()
