"""The engine's integrity check for tests: every page reference the allocator counts has its holder (a running
request or the prefix cache). It reads the whole pools back to the host: never on a step's path."""
from __future__ import annotations

from typing import Iterable, Optional

import numpy as np
import torch

from hwkv.cache import HybridPrefixCache
from hwkv.engine.pools import Cache
from hwkv.engine.scheduler import Request


def check_holders(cache: Cache, running: Iterable[Request], frontiers_cpu: np.ndarray,
                  prefix: Optional[HybridPrefixCache]) -> None:
    """The references the allocator counts are the holders': each running request one on every full page of
    its first kv_len tokens and (hybrid pools) one on the SWA page of each of them from its frontier on; the
    prefix cache one per page of the tokens it caches (`full_tokens`, `swa_tokens`). A page a step kept after
    raising, or any other leak, makes the counts differ (AssertionError naming the pool)."""
    a, p = cache.allocator, cache.plan.page_size
    rtt = cache.rtt.req_to_token.cpu()
    full_refs = a.pages.refs.cpu()
    mapping = a.full_to_swa_index_mapping.cpu() if cache.hybrid else None
    want_full = want_swa = 0
    for req in running:
        locs = rtt[req.row, :req.kv_len]
        pages = torch.unique(locs // p)
        assert bool((full_refs[pages] >= 1).all()), f"request {req.rid} holds a full page that is not live"
        want_full += pages.numel()
        if mapping is not None:
            swa_pages = torch.unique(mapping[locs[int(frontiers_cpu[req.row]):]] // p)
            assert bool((swa_pages > 0).all()), f"request {req.rid} lost an SWA slot from its frontier on"
            want_swa += swa_pages.numel()
    pools = [("full", full_refs, want_full, prefix.full_tokens if prefix is not None else 0)]
    if mapping is not None:
        pools.append(("SWA", a.swa_attn_allocator.pages.refs.cpu(), want_swa,
                      prefix.swa_tokens if prefix is not None else 0))
    for name, refs, held_by_requests, cached in pools:
        held = int(refs[refs >= 1].sum())
        assert held == held_by_requests + cached // p, \
            f"{name} pool: the allocator counts {held} page references, the running requests hold " \
            f"{held_by_requests} and the prefix cache {cached // p}: a leak (or a holder lost its pages)"
