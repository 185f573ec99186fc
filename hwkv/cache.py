"""HybridPrefixCache: shared prefixes for the hybrid pool, matched and evicted window-aware.

A radix tree over token ids in whole pages. Each node holds the full-pool locs of its tokens
(one reference on their full pages, taken with `allocator.share`) and, unless it is a
tombstone, one reference on their SWA pages too. A prefix of length m is reusable when its full
KV is there (always, for a node in the tree) and the SWA KV of the tokens the next query can
see is there: positions from `window_start(m)` (page-aligned, see below) to m. A match is cut
back to the longest such prefix, so tombstones stay matchable as interior nodes.

Full and SWA memory are evicted separately, each least-recently-used first and only where no
running request holds a lock: full eviction removes unlocked leaves (their full and SWA
references), SWA eviction turns unlocked nodes into tombstones (their SWA references only).

Running requests hold their own page references (taken by `acquire`), so eviction never frees
a page in use; locks keep the nodes a request shares with the cache (`acquire`, `cache_running`)
from eviction, so an unlocked node's pages are the cache's alone and evicting it frees them.
Tree operations run on the host; the locs they hand out and take in stay on the pool's device.
"""
from __future__ import annotations

import heapq
import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from hwkv.allocator import ReqToTokenPool, SWATokenToKVPoolAllocator
from hwkv.errors import CacheError, ConfigError, LocError

TokenIds = Union[torch.Tensor, np.ndarray, Sequence[int]]


def window_start(m: int, window: int, page_size: int) -> int:
    """First position whose SWA KV a request continuing at position m still needs: the next query
    (position m) sees keys > m - W; rounded down to a page (pages are held whole)."""
    return max(0, (m - window + 1) // page_size * page_size)


class _Node:
    __slots__ = ("key", "locs", "children", "parent", "swa", "lock_full", "swa_locks", "t_full", "t_swa", "start")

    def __init__(self, key: np.ndarray, locs: torch.Tensor, parent: Optional["_Node"], start: int, swa: bool) -> None:
        self.key, self.locs, self.parent, self.start, self.swa = key, locs, parent, start, swa
        self.children: Dict[tuple, _Node] = {}
        self.lock_full = 0
        self.swa_locks: Counter = Counter()  # window start of each SWA lock on this node -> count
        self.t_full = self.t_swa = 0

    @property
    def end(self) -> int:
        return self.start + len(self.key)

    @property
    def lock_swa(self) -> int:
        return sum(self.swa_locks.values())


@dataclass
class PrefixMatch:
    """The longest reusable cached prefix of a prompt: `length` tokens (a multiple of the page size)
    whose full-pool locs are `locs` (on the pool's device); SWA KV is there from `swa_start` on."""

    length: int
    locs: torch.Tensor
    swa_start: int
    node: "_Node"


@dataclass
class PrefixLock:
    """What `lock` took: released by `unlock`, exactly once."""

    node: "_Node"
    swa_start: int
    active: bool = True


class HybridPrefixCache:
    """Radix tree of cached prefixes over an `SWATokenToKVPoolAllocator`'s pools (see module doc)."""

    def __init__(self, allocator: SWATokenToKVPoolAllocator, window: int) -> None:
        if not isinstance(window, int) or window < 1:
            raise ConfigError(f"window={window!r} must be an int >= 1 (the model's sliding_window W)")
        self.allocator, self.window, self.page_size = allocator, window, allocator.page_size
        self.device = allocator.device
        self.root = _Node(np.zeros(0, dtype=np.int64), torch.zeros(0, dtype=torch.int64, device=self.device),
                          None, 0, True)
        self.root.lock_full = 1  # never evicted
        self._clock = itertools.count(1)
        self._full_heap: List[Tuple[int, int, _Node]] = []  # (t_full, tie, node): leaves, lazily invalidated
        self._tie = itertools.count()
        self.full_tokens = 0       # tokens whose full pages the cache references
        self.swa_tokens = 0        # ... whose SWA pages it references
        self.evictable_full = 0    # tokens of nodes no lock covers (full)
        self.evictable_swa = 0     # tokens of SWA-holding nodes no SWA lock covers
        self._nodes_count = 0

    # ---- walking ------------------------------------------------------------------------------
    def _ids(self, token_ids: TokenIds) -> np.ndarray:
        if isinstance(token_ids, torch.Tensor):
            if token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
                raise LocError(f"token ids must be an integer tensor, got {token_ids.dtype}")
            return token_ids.reshape(-1).to("cpu", torch.int64).numpy()
        if isinstance(token_ids, (list, tuple)):
            bad = next((t for t in token_ids[:1] if not isinstance(t, (int, np.integer))), None)
            if bad is not None:
                raise LocError(f"token ids must be integers, got {type(bad).__name__}")
            return np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))  # the fastest list -> array
        arr = np.asarray(token_ids)
        if arr.size and arr.dtype.kind not in "iu":
            raise LocError(f"token ids must be integers, got dtype {arr.dtype}")
        return arr.reshape(-1).astype(np.int64, copy=False)

    def _walk(self, ids: np.ndarray) -> Tuple[List[_Node], int]:
        """Nodes matched from the root (the last possibly partly, page-aligned) and the matched length."""
        p, n = self.page_size, len(ids) // self.page_size * self.page_size
        node, pos, path = self.root, 0, []
        while pos + p <= n:
            child = node.children.get(tuple(ids[pos:pos + p].tolist()))
            if child is None:
                break
            k = min(len(child.key), n - pos)
            diff = np.flatnonzero(child.key[:k] != ids[pos:pos + k])
            same = (int(diff[0]) if diff.size else k) // p * p
            path.append(child)
            pos += same
            if same < len(child.key):
                break
            node = child
        return path, pos

    def _split(self, node: _Node, at: int) -> _Node:
        """Split `node` at absolute position `at` (page-aligned, strictly inside); returns the upper part."""
        k = at - node.start
        up = _Node(node.key[:k], node.locs[:k], node.parent, node.start, node.swa)
        up.lock_full, up.t_full, up.t_swa = node.lock_full, node.t_full, node.t_swa
        up.swa_locks = Counter({s: c for s, c in node.swa_locks.items() if s < at})
        node.parent.children[tuple(node.key[:self.page_size].tolist())] = up
        node.key, node.locs, node.start, node.parent = node.key[k:], node.locs[k:], at, up
        up.children[tuple(node.key[:self.page_size].tolist())] = node
        if up.swa and node.lock_swa and not up.lock_swa:  # no lock's window reaches the upper part
            self.evictable_swa += k
        self._nodes_count += 1
        return up

    # ---- match --------------------------------------------------------------------------------
    def match_prefix(self, token_ids: TokenIds) -> PrefixMatch:
        """The longest cached prefix of `token_ids` that a request can continue from (see module doc).

        Engines usually match all but the last prompt token, so at least one token is computed.
        """
        ids = self._ids(token_ids)
        path, m = self._walk(ids)
        m = self._reusable(path, m)
        node = self.root
        for nd in path:
            if nd.start >= m:
                break
            if nd.end > m:
                nd = self._split(nd, m)
            node = nd
        t = next(self._clock)
        s0 = window_start(m, self.window, self.page_size)
        nd = node
        while nd is not self.root:
            nd.t_full = t
            if nd.end > s0 and nd.swa:
                nd.t_swa = t
            if not nd.children:
                self._push_full(nd)
            nd = nd.parent
        return PrefixMatch(m, self._locs(node), s0, node)

    def _reusable(self, path: List[_Node], m: int) -> int:
        """Cut m back to the longest page-aligned prefix whose window's SWA pages are all cached."""
        p = self.page_size
        if m == 0:
            return 0
        pages = np.array([(min(nd.end, m) - nd.start) // p for nd in path], dtype=np.int64)
        has = np.repeat(np.array([nd.swa for nd in path], dtype=bool), pages)
        e = np.arange(1, len(has) + 1)  # candidate lengths, in pages
        i = np.arange(len(has))
        last_gap = np.maximum.accumulate(np.where(has, -1, i))
        run = i - last_gap  # SWA pages in a row ending at page i
        need = e - np.maximum(0, (e * p - self.window + 1) // p)  # pages from window_start(e*p) to e*p
        ok = need <= run
        ok |= need == 0
        good = np.flatnonzero(ok)
        return int(good[-1] + 1) * p if good.size else 0

    def _locs(self, node: _Node) -> torch.Tensor:
        parts = []
        while node is not self.root:
            parts.append(node.locs)
            node = node.parent
        if not parts:
            return self.root.locs
        return parts[0] if len(parts) == 1 else torch.cat(parts[::-1])

    # ---- locks --------------------------------------------------------------------------------
    def lock(self, match: PrefixMatch) -> PrefixLock:
        """Keep the matched nodes (and the SWA of its window) from eviction while a request uses them."""
        node = match.node
        while node is not self.root and node.start > match.swa_start:
            node = node.parent
        if node is not self.root and node.start < match.swa_start < node.end:
            self._split(node, match.swa_start)  # the SWA lock covers the window only, not the node's head
        node = match.node
        while node is not self.root:
            if node.lock_full == 0:
                self.evictable_full -= len(node.key)
            node.lock_full += 1
            if node.end > match.swa_start:
                if node.swa and node.lock_swa == 0:
                    self.evictable_swa -= len(node.key)
                node.swa_locks[match.swa_start] += 1
            node = node.parent
        return PrefixLock(match.node, match.swa_start)

    def unlock(self, lock: PrefixLock) -> None:
        """Release a lock taken by `lock` (once)."""
        if not lock.active:
            raise CacheError("this prefix lock was already released")
        lock.active = False
        node = lock.node
        while node is not self.root:
            node.lock_full -= 1
            if node.lock_full == 0:
                self.evictable_full += len(node.key)
                if not node.children:
                    self._push_full(node)
            if lock.swa_start in node.swa_locks:
                node.swa_locks[lock.swa_start] -= 1
                if node.swa_locks[lock.swa_start] == 0:
                    del node.swa_locks[lock.swa_start]
                if node.swa and node.lock_swa == 0:
                    self.evictable_swa += len(node.key)
            node = node.parent

    # ---- insert -------------------------------------------------------------------------------
    def insert(self, token_ids: TokenIds, locs: torch.Tensor, swa_start: int) -> int:
        """Cache a request's tokens (whole pages only): `locs` are their full-pool locs, SWA KV is still
        held from position `swa_start` on (the request's release frontier). The cache takes its own
        references on the pages it did not hold yet; returns how many tokens it newly caches."""
        ids = self._ids(token_ids)
        p = self.page_size
        n = len(ids) // p * p
        if not isinstance(locs, torch.Tensor) or locs.dtype != torch.int64 or locs.numel() < n:
            raise LocError(f"locs must be an int64 tensor of >= {n} entries, got "
                           f"{getattr(locs, 'dtype', type(locs).__name__)} of {getattr(locs, 'numel', lambda: '?')()}")
        if swa_start % p or swa_start < 0:
            raise LocError(f"swa_start {swa_start} must be a non-negative multiple of page_size {p}")
        path, m = self._walk(ids[:n])
        if m >= n:
            self.match_prefix(ids[:n])  # refresh the access stamps
            return 0
        cut = min(max(swa_start, m), n)
        locs = locs.reshape(-1)
        # references first: the allocator checks the pages and raises before anything changes
        self.allocator.share(locs[m:cut], with_swa=False)
        self.allocator.share(locs[cut:n], with_swa=True)
        parent = self.root
        for nd in path:
            if nd.start >= m:
                break
            parent = self._split(nd, m) if nd.end > m else nd
        t = next(self._clock)
        for lo, hi, swa in ((m, cut, False), (cut, n, True)):
            if hi > lo:
                child = _Node(ids[lo:hi].copy(), locs[lo:hi].clone(), parent, lo, swa)
                child.t_full = child.t_swa = t
                parent.children[tuple(ids[lo:lo + p].tolist())] = child
                self._nodes_count += 1
                self.full_tokens += hi - lo
                self.evictable_full += hi - lo
                if swa:
                    self.swa_tokens += hi - lo
                    self.evictable_swa += hi - lo
                parent = child
        self._push_full(parent)
        return n - m

    # ---- engine wiring ------------------------------------------------------------------------
    def acquire(self, match: PrefixMatch, req_to_token_pool: ReqToTokenPool, row: int) -> Tuple[PrefixLock, int]:
        """Start a request from a match: copy its locs into the request's row, take the request's own
        references (full pages, and SWA pages from the window start on), lock the nodes. Returns the
        lock and the request's SWA frontier (for `release_out_of_window_batch`)."""
        m, s0 = match.length, match.swa_start
        if m:
            req_to_token_pool.write(row, 0, match.locs)
            self.allocator.share(match.locs[:s0], with_swa=False)
            self.allocator.share(match.locs[s0:m], with_swa=True)
        return self.lock(match), s0

    def cache_running(self, token_ids: TokenIds, req_to_token_pool: ReqToTokenPool, row: int, seq_len: int,
                      frontier: int, lock: Optional[PrefixLock] = None) -> PrefixLock:
        """Cache a running request's tokens so far (e.g. after its prefill) and move its lock to the
        deepest node: the nodes it shares with the cache stay locked while it runs (so unlocked nodes are
        the cache's alone and evicting them frees memory). Returns the new lock (the old one is released)."""
        self.insert(token_ids[:seq_len], req_to_token_pool.req_to_token[row, :seq_len], frontier)
        # the lock covers the whole path (full) and the last window (SWA): the request's frontier moves on,
        # and the SWA it leaves behind becomes the cache's alone, so it must stay evictable
        new = self.lock(self.match_prefix(token_ids[:seq_len // self.page_size * self.page_size]))
        if lock is not None:
            self.unlock(lock)
        return new

    def release_request(self, token_ids: TokenIds, req_to_token_pool: ReqToTokenPool, row: int, seq_len: int,
                        frontier: int, lock: Optional[PrefixLock] = None, cache: bool = True) -> int:
        """A request ends: optionally cache its tokens, drop its lock and its own page references
        (full pages of [0, seq_len), SWA pages from its frontier on). Returns tokens newly cached."""
        locs = req_to_token_pool.req_to_token[row, :seq_len]
        added = self.insert(token_ids[:seq_len], locs, frontier) if cache else 0
        if lock is not None:
            self.unlock(lock)
        self.allocator.free(locs[:frontier], with_swa=False)
        self.allocator.free(locs[frontier:])
        return added

    # ---- eviction -----------------------------------------------------------------------------
    def _push_full(self, node: _Node) -> None:
        """Lazy LRU of evictable leaves: stale entries are skipped when popped; the heap is rebuilt from
        the tree when they outnumber the nodes. (The SWA order is derived from the tree at eviction.)"""
        if node is self.root or node.children or node.lock_full:
            return
        heap = self._full_heap
        heapq.heappush(heap, (node.t_full, next(self._tie), node))
        if len(heap) > 4 * self._nodes_count + 64:
            heap[:] = [(nd.t_full, next(self._tie), nd) for nd in self._nodes()
                       if not nd.children and nd.lock_full == 0]
            heapq.heapify(heap)

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` of full-pool KV (whole unlocked leaves with their SWA KV): first
        tombstone leaves (no match can use them), then least recently used leaves; returns tokens freed.
        More than is evictable raises CacheError."""
        if num_tokens > self.evictable_full:
            raise CacheError(f"asked to evict {num_tokens} tokens of full KV, only {self.evictable_full} are "
                             f"unlocked ({self.full_tokens} cached)")
        freed = 0
        # tombstone leaves first: no window is left in them, so no match can end inside them
        dead = sorted((nd for nd in self._nodes() if not nd.swa and not nd.children and nd.lock_full == 0),
                      key=lambda nd: nd.t_full)
        while dead and freed < num_tokens:
            nd = dead.pop(0)
            parent = nd.parent
            self.allocator.free(nd.locs, with_swa=False)
            self._detach(nd)
            freed += len(nd.key)
            if parent is not self.root and not parent.swa and not parent.children and parent.lock_full == 0:
                dead.insert(0, parent)
        while freed < num_tokens:
            t, _, node = heapq.heappop(self._full_heap)
            if node.children or node.lock_full or node.parent is None or t != node.t_full or not self._in_tree(node):
                continue
            self.allocator.free(node.locs, with_swa=node.swa)
            self._detach(node)
            freed += len(node.key)
        return freed

    def evict_swa(self, num_tokens: int) -> int:
        """Free at least `num_tokens` of SWA KV by turning unlocked nodes (or their heads) into tombstones;
        their full KV stays. A node's SWA is worth what the windows it lies in are worth: the window of a
        node end E is [window_start(E), E), and may span several nodes. First the SWA no window needs
        (heads), then by the best window each node serves, lowest first: ends one conversation went past
        (one child), then leaves (where a next turn continues), then branch points (shared prefixes);
        least recently used first within each. Returns tokens freed. More than is evictable raises
        CacheError."""
        if num_tokens > self.evictable_swa:
            raise CacheError(f"asked to evict {num_tokens} tokens of SWA KV, only {self.evictable_swa} are "
                             f"unlocked ({self.swa_tokens} cached)")
        plan = self._swa_plan()
        freed = 0
        for nd, keep_from, _ in sorted(plan, key=lambda e: e[0].t_swa):  # 1. heads no window needs
            if freed >= num_tokens:
                return freed
            if keep_from >= nd.end:
                freed += self._tombstone(nd)
            elif keep_from > nd.start:
                freed += self._tombstone(self._split(nd, keep_from))
        for nd, _, rank in sorted(plan, key=lambda e: e[2]):  # 2. windows, least valuable first
            if freed >= num_tokens:
                break
            if nd.swa:
                freed += self._tombstone(nd)
        return freed

    def _swa_plan(self) -> List[Tuple[_Node, int, Tuple[int, int]]]:
        """For each unlocked SWA node: the first position some window still needs, and the rank (class,
        last use) of the best window it serves."""
        p, w = self.page_size, self.window
        plan = []
        for nd in self._nodes():
            if not nd.swa or nd.lock_swa:
                continue
            keep_from, best = nd.end, (0, 0)
            stack = [nd]
            while stack:  # nd itself and the descendants whose window reaches back into nd
                d = stack.pop()
                ws = window_start(d.end, w, p)
                if ws < nd.end:
                    cls = 2 if not d.children else (3 if len(d.children) > 1 else 1)
                    best = max(best, (cls, d.t_swa))
                    keep_from = min(keep_from, max(ws, nd.start))
                    stack.extend(d.children.values())
            plan.append((nd, keep_from, best))
        return plan

    def _tombstone(self, node: _Node) -> int:
        """Drop the cache's SWA references of an unlocked node; its full KV stays matchable."""
        self.allocator.free_swa(node.locs)
        node.swa = False
        self.swa_tokens -= len(node.key)
        self.evictable_swa -= len(node.key)
        return len(node.key)

    def evict_node(self, match: PrefixMatch) -> int:
        """Drop a matched node and everything below it now; a locked one raises CacheError."""
        node = match.node
        if node is self.root:
            return 0
        subtree = list(self._nodes(node))
        locked = [nd for nd in subtree if nd.lock_full]
        if locked:
            raise CacheError(f"node at positions [{locked[0].start}, {locked[0].end}) is locked by "
                             f"{locked[0].lock_full} running request(s)")
        freed = 0
        for nd in reversed(subtree):  # leaves first
            self.allocator.free(nd.locs, with_swa=nd.swa)
            self._detach(nd)
            freed += len(nd.key)
        return freed

    def _detach(self, node: _Node) -> None:
        parent = node.parent
        del parent.children[tuple(node.key[:self.page_size].tolist())]
        node.parent = None
        self._nodes_count -= 1
        n = len(node.key)
        self.full_tokens -= n
        self.evictable_full -= n
        if node.swa:
            self.swa_tokens -= n
            self.evictable_swa -= n if node.lock_swa == 0 else 0
        self._push_full(parent)

    def _in_tree(self, node: _Node) -> bool:
        return node.parent is not None

    def _nodes(self, top: Optional[_Node] = None) -> Iterator[_Node]:
        stack = [top or self.root]
        while stack:
            nd = stack.pop()
            if nd is not self.root:
                yield nd
            stack.extend(nd.children.values())

    # ---- integrity ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Rebuild counts and the full LRU from the tree and compare (the SWA order is derived from the tree
        at eviction); check keys, locks and that every
        cached page is live on the device (and mapped where the node holds SWA)."""
        p = self.page_size
        full = swa = ev_full = ev_swa = 0
        full_locs, swa_locs = [], []
        in_full = {(id(e[2]), e[0]) for e in self._full_heap}
        for nd in self._nodes():
            n = len(nd.key)
            assert n and n % p == 0 and nd.locs.numel() == n, f"node [{nd.start}, {nd.end}) is not whole pages"
            assert nd.parent.children.get(tuple(nd.key[:p].tolist())) is nd, "a node is not under its first page"
            assert nd.start == nd.parent.end, f"node at {nd.start} does not continue its parent ({nd.parent.end})"
            assert nd.lock_full <= nd.parent.lock_full or nd.parent is self.root, "a lock does not cover its path"
            assert all(c > 0 for c in nd.swa_locks.values()), "an SWA lock count is not positive"
            full += n
            ev_full += n if nd.lock_full == 0 else 0
            full_locs.append(nd.locs)
            if nd.swa:
                swa += n
                ev_swa += n if nd.lock_swa == 0 else 0
                swa_locs.append(nd.locs)
            if not nd.children and nd.lock_full == 0:
                assert (id(nd), nd.t_full) in in_full, "an evictable leaf left the LRU"
        assert len(list(self._nodes())) == self._nodes_count, "node count"
        assert (full, swa, ev_full, ev_swa) == (self.full_tokens, self.swa_tokens, self.evictable_full,
                                                self.evictable_swa), \
            f"counts {(self.full_tokens, self.swa_tokens, self.evictable_full, self.evictable_swa)} != tree's " \
            f"{(full, swa, ev_full, ev_swa)}"
        a = self.allocator
        if full_locs:
            pages = torch.cat(full_locs).cpu() // p
            assert (a.pages.refs.cpu()[pages] >= 1).all(), "a cached full page is not live"
        if swa_locs:
            locs = torch.cat(swa_locs).cpu()
            assert (a.full_to_swa_index_mapping.cpu()[locs] > 0).all(), "a cached SWA token lost its SWA slot"
