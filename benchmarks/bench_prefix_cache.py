"""Host time of HybridPrefixCache.match_prefix and insert: a 32K-token prompt against a cache that
holds 1,000 requests (a shared 1K system prompt, 1K tokens of their own each) and one 32K conversation.

    python benchmarks/bench_prefix_cache.py [--device cpu] [--page-sizes 1,16] [--repeats 21]

Prints median / p10 / p90 microseconds of: match of the 32K continuation (it reuses the cached
conversation), match of a miss (a 32K prompt sharing only the system prompt), insert of the 32K
continuation's new turn, insert of a fresh 32K prompt (all new nodes, references taken).
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
    q = statistics.quantiles(times, n=10, method="inclusive")
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--page-sizes", default="1,16")
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    rows = [r for ps in a.page_sizes.split(",") for r in run(a.device, int(ps), a.repeats)]
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"| op | page | tokens | median us | p10-p90 us |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['op']} | {r['page']} | {r['tokens']} | {r['median_us']} | {r['p10_us']}-{r['p90_us']} |")


if __name__ == "__main__":
    main()
