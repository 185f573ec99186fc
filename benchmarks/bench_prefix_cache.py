"""Host time of HybridPrefixCache.match_prefix and insert: a 32K-token prompt against a cache that
holds 1,000 requests (a shared 1K system prompt, 1K tokens of their own each) and one 32K conversation.

    python benchmarks/bench_prefix_cache.py [--device cpu] [--page-sizes 1,16] [--repeats 21]

Prints median / p10 / p90 microseconds of: match of the 32K continuation (it reuses the cached
conversation), match of a miss (a 32K prompt sharing only the system prompt), insert of the 32K
continuation's new turn, insert of a fresh 32K prompt (all new nodes, references taken).

`--evict` (or --only-evict) adds eviction at scale: a tree of 100k one-page leaves, evict(16) and
evict_swa(16) per call, and one call evicting every leaf; a chain of 8,192 one-page nodes,
evict_swa(16) at W = 128 / 1024 / 4096. Eviction must cost what it frees plus a log factor.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable, Dict, List

import torch

from hwkv.allocator import SWATokenToKVPoolAllocator
from hwkv.cache import HybridPrefixCache
from hwkv.pool import SWAKVPool

W, SYS, OWN, N_REQ, LONG = 128, 1024, 1024, 1000, 32768


def timed(fn: Callable[[], object], repeats: int, setup: Callable[[], object] = lambda: None) -> Dict[str, float]:
    times = []
    for _ in range(repeats):
        setup()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
    times.sort()
    q = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else times * 2
    return dict(median_us=round(statistics.median(times), 1), p10_us=round(q[0], 1), p90_us=round(q[-1], 1))


def run(device: str, page: int, repeats: int) -> List[Dict]:
    total = N_REQ * OWN + SYS + 3 * LONG + 4 * page * N_REQ
    size = (total // page + 1) * page
    pool = SWAKVPool(size, size, page, torch.float32, 1, 1, [0], [1], device)  # tiny heads: the tree is measured
    alloc = SWATokenToKVPoolAllocator(size, size, page, device, pool)
    cache = HybridPrefixCache(alloc, W)
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(0, 50000, (SYS,), generator=gen).tolist()
    for i in range(N_REQ):
        ids = system + torch.randint(0, 50000, (OWN,), generator=gen).tolist()
        locs = alloc.alloc(len(ids))
        cache.insert(ids, locs, 0)
        alloc.free(locs)  # the request ends; the cache keeps its own references
    conv = system + torch.randint(0, 50000, (LONG - SYS,), generator=gen).tolist()
    locs = alloc.alloc(LONG)
    cache.insert(conv, locs, 0)
    alloc.free(locs)
    turn = conv + torch.randint(0, 50000, (512,), generator=gen).tolist()
    miss = system + torch.randint(0, 50000, (LONG - SYS,), generator=gen).tolist()
    fresh = torch.randint(50000, 60000, (LONG,), generator=gen).tolist()
    turn_locs = alloc.alloc(len(turn) // page * page)
    fresh_locs = alloc.alloc(LONG)
    rows = []
    hit = cache.match_prefix(turn)
    assert hit.length == LONG, hit.length
    rows.append(dict(op="match 32K continuation (hit)", page=page, tokens=hit.length, **timed(
        lambda: cache.match_prefix(turn), repeats)))
    rows.append(dict(op="match 32K miss (system prompt only)", page=page, tokens=cache.match_prefix(miss).length,
                     **timed(lambda: cache.match_prefix(miss), repeats)))

    def drop(prompt: List[int]) -> Callable[[], None]:
        def f() -> None:
            m = cache.match_prefix(prompt)
            if m.length > LONG:  # remove what the last insert added (a node below the conversation)
                cache.evict_node(m)
            elif m.length == len(prompt) // page * page and m.length:
                cache.evict_node(m)
        return f

    rows.append(dict(op="insert 32K continuation (+512 new)", page=page, tokens=len(turn), **timed(
        lambda: cache.insert(turn, turn_locs, 0), repeats, drop(turn))))
    rows.append(dict(op="insert fresh 32K", page=page, tokens=LONG, **timed(
        lambda: cache.insert(fresh, fresh_locs, 0), repeats, drop(fresh))))
    cache.check_integrity()
    alloc.check_integrity()
    return rows


def run_evict(device: str, repeats: int, leaves: int = 100_000, chain: int = 8192) -> List[Dict]:
    """Eviction cost at scale (page 16): per-call evict / evict_swa on a 100k-leaf tree, one call that
    evicts every leaf, and evict_swa on a long chain of one-page nodes at three windows."""
    page, rows = 16, []
    size = (leaves + 2) * page
    pool = SWAKVPool(size, size, page, torch.float32, 1, 1, [0], [1], device)
    alloc = SWATokenToKVPoolAllocator(size, size, page, device, pool)
    cache = HybridPrefixCache(alloc, W)
    locs = alloc.alloc(leaves * page)
    ids = torch.arange(leaves * page, dtype=torch.int64).view(leaves, page).numpy()
    for i in range(leaves):  # one-page leaves under the root, SWA and all
        cache.insert(ids[i], locs[i * page:(i + 1) * page], 0)
    alloc.free(locs)
    rows.append(dict(op=f"evict(16), {leaves:,} one-page leaves", page=page, tokens=16,
                     **timed(lambda: cache.evict(16), repeats)))
    rows.append(dict(op=f"evict_swa(16), {leaves:,} one-page leaves", page=page, tokens=16,
                     **timed(lambda: cache.evict_swa(16), repeats)))
    n = cache.evictable_full
    rows.append(dict(op=f"evict every leaf in one call ({n // page:,} nodes)", page=page, tokens=n,
                     **timed(lambda: cache.evict(n), 1)))
    cache.check_integrity()
    for window in (128, 1024, 4096):
        size = (chain + 2) * page
        pool = SWAKVPool(size, size, page, torch.float32, 1, 1, [0], [1], device)
        alloc = SWATokenToKVPoolAllocator(size, size, page, device, pool)
        cache = HybridPrefixCache(alloc, window)
        locs = alloc.alloc(chain * page)
        ids = torch.arange(chain * page, dtype=torch.int64).numpy()
        cache.insert(ids, locs, 0)
        alloc.free(locs)
        node = cache.match_prefix(ids).node
        for e in range(page, chain * page, page):  # one node per page (split directly: a chain built by
            cache._split(node, e)                  # 8,192 inserts spends minutes walking it, not evicting)
        rows.append(dict(op=f"evict_swa(16), chain of {chain:,} nodes, W={window}", page=page, tokens=16,
                         **timed(lambda: cache.evict_swa(16), repeats)))
        cache.check_integrity()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--page-sizes", default="1,16")
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--json", action="store_true")
    p.add_argument("--evict", action="store_true", help="add eviction at 100k nodes and on long chains")
    p.add_argument("--only-evict", action="store_true", help="only the eviction rows")
    a = p.parse_args()
    rows = [] if a.only_evict else [r for ps in a.page_sizes.split(",") for r in run(a.device, int(ps), a.repeats)]
    if a.evict or a.only_evict:
        rows += run_evict(a.device, a.repeats)
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"| op | page | tokens | median us | p10-p90 us |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['op']} | {r['page']} | {r['tokens']} | {r['median_us']} | {r['p10_us']}-{r['p90_us']} |")


if __name__ == "__main__":
    main()
