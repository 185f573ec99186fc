"""HybridPrefixCache: shared prefixes for the hybrid pool, matched and evicted window-aware.

A radix tree over token ids in whole pages. Each node holds the full-pool locs of its tokens
(one reference on their full pages, taken with `allocator.share`) and, unless it is a
tombstone, one reference on their SWA pages too. A prefix of length m is reusable when its full
KV is there (always, for a node in the tree) and the SWA KV of the tokens the next query can
see is there: positions from `window_start(m)` (page-aligned, see below) to m. A match is cut
back to the longest such prefix, so tombstones stay matchable as interior nodes; inserting a
prefix again with its SWA KV revives the tombstones it covers.

Full and SWA memory are evicted separately, each from its own lazily updated priority heap and
only where no running request holds a lock: full eviction removes unlocked leaves (tombstone
leaves first, then least recently used), SWA eviction turns unlocked nodes into tombstones
(SWA no window needs first, then by the best window a node serves). An eviction costs what it
frees plus a log factor, whatever the size of the tree.

Running requests hold their own page references (taken by `acquire`), so eviction never frees
a page in use; locks keep the nodes a request shares with the cache (`acquire`, `cache_running`)
from eviction, so an unlocked node's pages are the cache's alone and evicting it frees them.
A match stays valid until the nodes it names change; `acquire` refuses a stale one.
Tree operations run on the host; the locs they hand out and take in stay on the pool's device.
"""
from __future__ import annotations

import array
import heapq
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from hwkv.allocator import SWATokenToKVPoolAllocator
from hwkv.req_to_token import ReqToTokenPool
from hwkv.checks import as_int, check_flag
from hwkv.errors import CacheError, ConfigError, LocError, NotAllocatedError
from hwkv.sigint import held_or_undone, interrupts_held

TokenIds = Union[torch.Tensor, np.ndarray, Sequence[int]]
Rank = Tuple[int, int]


def window_start(m: int, window: int, page_size: int) -> int:
    """First position whose SWA KV a request continuing at position m still needs: the next query
    (position m) sees keys > m - W; rounded down to a page (pages are held whole)."""
    return max(0, (m - window + 1) // page_size * page_size)


class _Node:
    __slots__ = ("key", "locs", "children", "parent", "swa", "lock_full", "swa_locks", "t_full", "t_swa", "start",
                 "changed")

    def __init__(self, key: np.ndarray, locs: torch.Tensor, parent: Optional["_Node"], start: int, swa: bool) -> None:
        self.key, self.locs, self.parent, self.start, self.swa = key, locs, parent, start, swa
        self.children: Dict[tuple, _Node] = {}
        self.lock_full = 0
        self.swa_locks: Counter = Counter()  # window start of each SWA lock on this node -> count
        self.t_full = self.t_swa = 0
        self.changed = 0  # clock when its locs were last set: a match taken before is stale

    @property
    def end(self) -> int:
        return self.start + len(self.key)

    @property
    def lock_swa(self) -> int:
        return sum(self.swa_locks.values())


@dataclass(eq=False)   # (matches compare by identity: a field-wise compare would read the locs tensor's truth)
class PrefixMatch:
    """The longest reusable cached prefix of a prompt: `length` tokens (a multiple of the page size)
    whose full-pool locs are `locs` (on the pool's device); SWA KV is there from `swa_start` on.
    `stamp`: the cache's clock when it was matched (`acquire` checks nothing it names changed since);
    `cache`: the cache that matched it (another cache refuses it)."""

    length: int
    locs: torch.Tensor
    swa_start: int
    node: "_Node"
    stamp: int = 0
    cache: Optional["HybridPrefixCache"] = field(default=None, repr=False, compare=False)


@dataclass
class PrefixLock:
    """What `lock` took: released by `unlock` of the cache that took it (`cache`), exactly once."""

    node: "_Node"
    swa_start: int
    active: bool = True
    cache: Optional["HybridPrefixCache"] = field(default=None, repr=False, compare=False)


def _one_dim(shape: Sequence[int]) -> None:
    """One sequence's token ids are 1-D: a [B, L] batch is not one prefix (LocError naming the shape)."""
    if len(shape) != 1:
        raise LocError(f"token ids must be 1-D (one sequence), got shape {list(shape)}")


class HybridPrefixCache:
    """Radix tree of cached prefixes over an `SWATokenToKVPoolAllocator`'s pools (see module doc)."""

    def __init__(self, allocator: SWATokenToKVPoolAllocator, window: int) -> None:
        if not isinstance(allocator, SWATokenToKVPoolAllocator):  # full-only pools run without the cache
            raise ConfigError(f"allocator must be an SWATokenToKVPoolAllocator (hybrid pools), got "
                              f"{type(allocator).__name__}: the prefix cache evicts SWA KV apart from full KV")
        w = as_int(window)
        if w is None or not 1 <= w < 2 ** 63:   # (int64 position math: as the engine refuses it)
            raise ConfigError(f"window={window!r} must be an integer >= 1 and below 2**63 (the model's sliding_window "
                              "W)")
        self.allocator, self.window, self.page_size = allocator, w, allocator.page_size
        self.device = allocator.device
        self.root = _Node(np.zeros(0, dtype=np.int64), torch.zeros(0, dtype=torch.int64, device=self.device),
                          None, 0, True)
        self.root.lock_full = 1  # never evicted
        self._clock = itertools.count(1)
        self._tie = itertools.count()
        self._full_heap: List[Tuple[Rank, int, _Node]] = []  # evictable leaves, keys <= their current rank
        self._swa_heap: List[Tuple[Rank, int, _Node]] = []   # unlocked SWA nodes, keys <= their current rank
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
            _one_dim(token_ids.shape)
            return token_ids.to("cpu", torch.int64).numpy()
        if isinstance(token_ids, (list, tuple)):
            try:   # a C loop that takes ints only (a float, None or str element, or one past int64, raises)
                return np.frombuffer(array.array("q", token_ids), dtype=np.int64)
            except (TypeError, OverflowError) as e:
                raise LocError(f"token ids must be integers below 2**63: {e}") from None
        arr = np.asarray(token_ids)
        if arr.size and (arr.dtype.kind not in "iu" or (arr.dtype == np.uint64 and int(arr.max()) >= 2 ** 63)):
            raise LocError(f"token ids must be integers below 2**63, got dtype {arr.dtype}")
        _one_dim(arr.shape)
        return arr.astype(np.int64, copy=False)

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

    def _node_at(self, path: List[_Node], m: int) -> _Node:
        """The node of `path` ending exactly at m (splitting the one m falls inside); the root for m == 0."""
        node = self.root
        for nd in path:
            if nd.start >= m:
                break
            node = self._split(nd, m) if nd.end > m else nd
        return node

    def _edge(self, key: np.ndarray) -> tuple:
        """The child key a node with token key `key` sits under in its parent: its first page's ids."""
        return tuple(key[:self.page_size].tolist())

    def _split(self, node: _Node, at: int) -> _Node:
        """Split `node` at absolute position `at` (page-aligned, strictly inside); returns the upper part.
        Both parts own copies of their keys and locs, so neither pins the other's storage."""
        k = at - node.start
        up = _Node(node.key[:k].copy(), node.locs[:k].clone(), node.parent, node.start, node.swa)
        up.lock_full, up.t_full, up.t_swa, up.changed = node.lock_full, node.t_full, node.t_swa, node.changed
        up.swa_locks = Counter({s: c for s, c in node.swa_locks.items() if s < at})
        key, locs = node.key[k:].copy(), node.locs[k:].clone()
        with interrupts_held():  # linked, counted and in the heaps together
            node.parent.children[self._edge(node.key)] = up
            node.key, node.locs, node.start, node.parent = key, locs, at, up
            up.children[self._edge(key)] = node
            if up.swa and node.lock_swa and not up.lock_swa:  # no lock's window reaches the upper part
                self.evictable_swa += k
            self._nodes_count += 1
            self._push_swa(up)
            self._push_swa(node)
        return up

    def _touch(self, node: _Node, swa_from: int) -> int:
        """Stamp the path to `node` as used now (full), and its SWA from `swa_from` on; returns the stamp."""
        t = next(self._clock)
        nd = node
        while nd is not self.root:
            nd.t_full = t
            if nd.end > swa_from and nd.swa:
                nd.t_swa = t
            nd = nd.parent
        return t

    # ---- match --------------------------------------------------------------------------------
    def match_prefix(self, token_ids: TokenIds) -> PrefixMatch:
        """The longest cached prefix of `token_ids` that a request can continue from (see module doc).

        Engines usually match all but the last prompt token, so at least one token is computed.
        """
        ids = self._ids(token_ids)
        path, m = self._walk(ids)
        m = self._reusable(path, m)
        node = self._node_at(path, m)
        s0 = window_start(m, self.window, self.page_size)
        t = self._touch(node, s0)
        return PrefixMatch(m, self._locs(node), s0, node, t, cache=self)

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

    def _check_current(self, match: PrefixMatch) -> None:
        """Refuse a match whose nodes left the tree, lost the SWA of its window or changed their locs."""
        nd = match.node
        while nd is not self.root:
            if nd.parent is None:
                raise CacheError(f"the match of {match.length} tokens is stale: its node at [{nd.start}, {nd.end}) "
                                 "was evicted since match_prefix; match again")
            if nd.changed >= match.stamp:
                raise CacheError(f"the match of {match.length} tokens is stale: the locs of [{nd.start}, {nd.end}) "
                                 "changed since match_prefix; match again")
            if nd.end > match.swa_start and not nd.swa:
                raise CacheError(f"the match of {match.length} tokens is stale: the SWA KV of [{nd.start}, "
                                 f"{nd.end}) in its window was evicted since match_prefix; match again")
            nd = nd.parent

    def _own(self, handle: Any, kind: type, what: str) -> None:
        """Refuse, before any change, anything but a `kind` (PrefixMatch or PrefixLock) this cache made: another
        cache's would change that tree's locks and this cache's books, or free its pages in this allocator. A
        handle made by hand (no `cache`) must name a node of this tree."""
        if not isinstance(handle, kind) or not isinstance(handle.node, _Node):
            text = repr(handle)
            raise CacheError(f"{what}: expected a {kind.__name__} of this cache, got {type(handle).__name__} "
                             f"{text if len(text) <= 60 else text[:57] + '...'}")
        owner = handle.cache
        if owner is self:
            return
        if owner is None:
            top = handle.node
            while top.parent is not None:
                top = top.parent
            if top is self.root:
                return
            raise CacheError(f"{what}: a {kind.__name__} of a node at [{handle.node.start}, {handle.node.end}) that "
                             "is not in this cache's tree (evicted since, or another cache's)")
        raise CacheError(f"{what}: a {kind.__name__} of another HybridPrefixCache (at {id(owner):#x}: window "
                         f"{owner.window}, page_size {owner.page_size}) given to this one (at {id(self):#x}: window "
                         f"{self.window}, page_size {self.page_size}); pass it to the cache that made it")

    @staticmethod
    def _count(num_tokens: Any, what: str) -> int:
        """How many tokens `evict` / `evict_swa` is asked for, as an int (numpy and 0-d tensor integers too)."""
        n = as_int(num_tokens)
        if n is None or n < 0:
            raise CacheError(f"{what}({num_tokens!r}): the number of tokens to evict must be an integer >= 0")
        return n

    # ---- locks --------------------------------------------------------------------------------
    def lock(self, match: PrefixMatch) -> PrefixLock:
        """Keep the matched nodes (and the SWA of its window) from eviction while a request uses them."""
        self._own(match, PrefixMatch, "lock")
        if match.node is not self.root and match.stamp:
            self._check_current(match)
        # a Ctrl-C here is raised with nothing locked (a split may stay)
        return held_or_undone(lambda: self._lock(match.node, match.swa_start), self.unlock)

    def _lock(self, target: _Node, swa_start: int) -> PrefixLock:
        node = target
        while node is not self.root and node.start > swa_start:
            node = node.parent
        if node is not self.root and node.start < swa_start < node.end:
            self._split(node, swa_start)  # the SWA lock covers the window only, not the node's head
        node = target
        while node is not self.root:
            if node.lock_full == 0:
                self.evictable_full -= len(node.key)
            node.lock_full += 1
            if node.end > swa_start:
                if node.swa and node.lock_swa == 0:
                    self.evictable_swa -= len(node.key)
                node.swa_locks[swa_start] += 1
            node = node.parent
        return PrefixLock(target, swa_start, cache=self)

    def unlock(self, lock: PrefixLock) -> None:
        """Release a lock taken by `lock` (once)."""
        self._own(lock, PrefixLock, "unlock")
        if not lock.active:
            raise CacheError("this prefix lock was already released")
        with interrupts_held():  # the handle and its whole path released together
            lock.active = False
            node = lock.node
            while node is not self.root:
                node.lock_full -= 1
                if node.lock_full == 0:
                    self.evictable_full += len(node.key)
                    self._push_full(node)
                if lock.swa_start in node.swa_locks:
                    node.swa_locks[lock.swa_start] -= 1
                    if node.swa_locks[lock.swa_start] == 0:
                        del node.swa_locks[lock.swa_start]
                    if node.swa and node.lock_swa == 0:
                        self.evictable_swa += len(node.key)
                        self._push_swa(node)
                node = node.parent

    # ---- insert -------------------------------------------------------------------------------
    def insert(self, token_ids: TokenIds, locs: torch.Tensor, swa_start: int) -> int:
        """Cache a request's tokens (whole pages only): `locs` are their full-pool locs, SWA KV is still
        held from position `swa_start` on (the request's release frontier). The cache takes its own
        references on what it did not hold yet: new nodes, and tombstones it now has SWA KV for (revived
        with the request's locs; their old full pages are dropped). Returns how many tokens it newly
        holds KV of. A refusal (pages not live, SWA released below the frontier) changes nothing.

        The new nodes are unlocked: inserting a still-running request's pages directly leaves pages the
        request holds in unlocked nodes, where an eviction would count them freed while the request keeps
        them (the pool gains less than `evict` says). Cache a running request with `cache_running`, which
        moves its lock over them, or lock them before the next eviction, as the engine does (`cache_running`
        follows its `insert` in the same step, with no eviction between)."""
        ids = self._ids(token_ids)
        p = self.page_size
        n = len(ids) // p * p
        if not isinstance(locs, torch.Tensor) or locs.dtype != torch.int64 or locs.numel() < n:
            raise LocError(f"locs must be an int64 tensor of >= {n} entries, got "
                           f"{getattr(locs, 'dtype', type(locs).__name__)} of {getattr(locs, 'numel', lambda: '?')()}")
        s = as_int(swa_start)  # (bools are no positions)
        if s is None or s % p or s < 0:
            raise LocError(f"swa_start {swa_start!r} must be a non-negative integer multiple of page_size {p}")
        swa_start = s
        locs = locs.reshape(-1)[:n]
        path, m = self._walk(ids[:n])
        cut = min(swa_start, n)
        revive = [nd for nd in path if nd.start < m and not nd.swa and min(nd.end, m) > cut]
        new_cut = min(max(cut, m), n)
        # every check before any change: the allocator's share would raise only after a first share
        self._precheck(locs[m:n], locs[min(cut, m) if revive else new_cut:n], cut)
        if m == n and not revive:
            self._touch(self._node_at(path, n), window_start(n, self.window, p))
            return 0
        with interrupts_held():  # the references and the nodes that hold them land together
            return self._insert_checked(ids, locs, n, path, m, cut, revive, new_cut)

    def _insert_checked(self, ids: np.ndarray, locs: torch.Tensor, n: int, path: List[_Node], m: int, cut: int,
                        revive: List[_Node], new_cut: int) -> int:
        """`insert` once every check passed: the references taken, tombstones revived, new nodes added."""
        p = self.page_size
        t = next(self._clock)
        old, revived = [], []
        for nd in revive:  # the parts of tombstones in [cut, m): take the request's locs (with SWA) instead
            if nd.start < cut:
                self._split(nd, cut)      # nd keeps [cut, end)
            if nd.end > m:
                nd = self._split(nd, m)   # the part before m
            old.append(nd.locs)
            revived.append(nd)
        swa_ranges = [locs[nd.start:nd.end] for nd in revived] + [locs[new_cut:n]]
        # both within what _precheck passed (the pages of [m, n), the SWA of the revived parts and [new_cut, n))
        self.allocator.share(locs[m:new_cut], with_swa=False, checked=True)
        self.allocator.share(torch.cat(swa_ranges) if len(swa_ranges) > 1 else swa_ranges[0], with_swa=True,
                             checked=True)
        if old:
            self.allocator.free(torch.cat(old), with_swa=False)  # after the share: a page in both keeps a holder
        for nd in revived:
            nd.locs, nd.swa, nd.changed = locs[nd.start:nd.end].clone(), True, t
            self.swa_tokens += len(nd.key)
            if nd.lock_swa == 0:
                self.evictable_swa += len(nd.key)
            self._push_swa(nd)
        if revived:
            path, m = self._walk(ids[:n])  # the splits above put new nodes on the path
        parent = self._node_at(path, m)
        added = sum(len(nd.key) for nd in revived)
        for lo, hi, swa in ((m, new_cut, False), (new_cut, n, True)):
            if hi > lo:
                parent = self._add_child(parent, ids[lo:hi].copy(), locs[lo:hi].clone(), lo, swa, t)
                added += hi - lo
        self._touch(parent, window_start(n, self.window, p))
        return added

    def _add_child(self, parent: _Node, key: np.ndarray, locs: torch.Tensor, start: int, swa: bool, t: int) -> _Node:
        child = _Node(key, locs, parent, start, swa)
        child.t_full = child.t_swa = child.changed = t
        parent.children[self._edge(key)] = child
        self._nodes_count += 1
        n = len(key)
        self.full_tokens += n
        self.evictable_full += n
        if swa:
            self.swa_tokens += n
            self.evictable_swa += n
        self._push_full(child)
        self._push_swa_around(child, child)
        return child

    def _precheck(self, full: torch.Tensor, swa: torch.Tensor, swa_start: int) -> None:
        """The allocator's checks of the pages an insert or acquire will share, all before the first share
        (`check_share`: CPU, deferred checks included, since the tree must not keep what a share refused; debug
        mode; on accelerators with deferred checks the device op records a problem instead: a host check would
        wait for the device)."""
        a = self.allocator
        if not a.shares_checkable:
            return
        a.check_share(torch.cat([full.reshape(-1), swa.reshape(-1)]), with_swa=False, host_too=True)  # all live
        try:
            a.check_share(swa, with_swa=True, host_too=True)
        except NotAllocatedError as e:  # live, so its SWA is what is missing: the caller's frontier is wrong
            raise LocError(f"{e}; it lies at or after swa_start {swa_start}: pass the request's release "
                           "frontier") from None

    # ---- engine wiring ------------------------------------------------------------------------
    def acquire(self, match: PrefixMatch, req_to_token_pool: ReqToTokenPool, row: int) -> Tuple[PrefixLock, int]:
        """Start a request from a match: copy its locs into the request's row, take the request's own
        references (full pages, and SWA pages from the window start on), lock the nodes. Returns the
        lock and the request's SWA frontier (for `release_out_of_window_batch`). A match whose nodes were
        evicted or changed since `match_prefix` raises CacheError; a refusal changes nothing."""
        self._own(match, PrefixMatch, "acquire")
        m, s0 = match.length, match.swa_start
        req_to_token_pool.row_locs(row, m)   # the row and the match's length fit the rows
        if m:
            self._check_current(match)
            self._precheck(match.locs, match.locs[s0:m], s0)
        was = req_to_token_pool.req_to_token[row, :m].clone() if m else None

        def start() -> PrefixLock:
            if m:
                req_to_token_pool.write(row, 0, match.locs)
                self.allocator.share(match.locs[:s0], with_swa=False, checked=True)
                self.allocator.share(match.locs[s0:m], with_swa=True, checked=True)
            return self._lock(match.node, s0)

        def undo(lock: PrefixLock) -> None:
            self.unlock(lock)
            if m:
                self.allocator.free(match.locs[:s0], with_swa=False)
                self.allocator.free(match.locs[s0:m], with_swa=True)
                req_to_token_pool.req_to_token[row, :m] = was
        return held_or_undone(start, undo), s0  # a Ctrl-C here is raised with everything as before

    def cache_running(self, token_ids: TokenIds, req_to_token_pool: ReqToTokenPool, row: int, seq_len: int,
                      frontier: int, lock: Optional[PrefixLock] = None) -> PrefixLock:
        """Cache a running request's tokens so far (e.g. after its prefill) and move its lock to the
        deepest node: the whole path (full) and the SWA from its frontier on, exactly what the request
        still holds, so unlocked nodes are the cache's alone and evicting them frees what it says. Nodes
        of the path that hold other copies of the same tokens (a history the request recomputed) take the
        request's pages instead, tombstones and the SWA nodes from the frontier on; an SWA node wholly below
        the frontier keeps its own copy (its SWA still serves matches ending past it, and telling whether it
        is the request's own would wait for the device), so the lock pins at most that stretch of a second
        copy until the request ends (admission counts it: the recomputed history is locked). Returns the new
        lock (the old one is released). A refusal (a bad row or length, another cache's lock, or a frontier below
        the request's: SWA it no longer holds) changes nothing."""
        if lock is not None:
            self._own(lock, PrefixLock, "cache_running")
            if not lock.active:
                raise CacheError("this prefix lock was already released")
        locs = req_to_token_pool.row_locs(row, seq_len)
        ids = self._ids(token_ids)[:seq_len]
        p = self.page_size
        n = len(ids) // p * p
        f = as_int(frontier)  # (bools are no positions)
        if f is None or f % p or not 0 <= f <= locs.numel():
            raise LocError(f"frontier {frontier!r} must be an integer multiple of page_size {p} in [0, seq_len "
                           f"{locs.numel()}] (the request's release frontier)")
        frontier = f
        # what the request must hold, full pages and SWA from its frontier on: _adopt shares both after insert has
        # changed the tree, so a wrong frontier has to be refused here
        self._precheck(locs[:n], locs[min(frontier, n):n], frontier)
        before = next(self._clock)

        def cache() -> PrefixLock:
            self.insert(ids, locs, frontier)
            path, m = self._walk(ids[:n])
            node = self._node_at(path, m)
            f = min(frontier, m)
            nd = node
            while nd is not self.root and nd.start >= f:  # the node the frontier falls in: split there first, so
                nd = nd.parent                            # the part from the frontier on is adopted (with its SWA)
            if nd is not self.root and nd.start < f < nd.end:
                self._split(nd, f)
            self._adopt(node, locs, frontier, before)
            new = self._lock(node, f)
            if lock is not None:
                self.unlock(lock)
            return new

        def keep(new: PrefixLock) -> None:  # the caller never gets `new`: its own handle takes it over, or without
            if lock is None:                # one the new nodes stay cached, unlocked
                self.unlock(new)
            else:
                lock.node, lock.swa_start, lock.active = new.node, new.swa_start, True
        return held_or_undone(cache, keep)  # cached and locked whole, a Ctrl-C raised after

    def _adopt(self, node: _Node, locs: torch.Tensor, frontier: int, since: int) -> None:
        """The nodes up to `node` that this insert did not make take the running request's locs: the full
        pages of tombstones, full and SWA pages of SWA nodes from its frontier on (where it holds SWA). Pages
        the node already shares with the request come out even (a reference taken, one dropped); older
        copies go back to the pool (or stay with other requests holding them)."""
        full, swa, old_full, old_swa = [], [], [], []
        t = next(self._clock)
        nd = node
        while nd is not self.root:
            if nd.changed <= since and (not nd.swa or nd.start >= frontier):
                (swa if nd.swa else full).append(locs[nd.start:nd.end])
                (old_swa if nd.swa else old_full).append(nd.locs)
                nd.locs, nd.changed = locs[nd.start:nd.end].clone(), t
            nd = nd.parent
        cat = lambda parts: torch.cat(parts) if len(parts) > 1 else parts[0]  # noqa: E731
        for new, old, with_swa in ((full, old_full, False), (swa, old_swa, True)):
            if new:
                self.allocator.share(cat(new), with_swa=with_swa)  # first: a page in both keeps a holder
                self.allocator.free(cat(old), with_swa=with_swa)

    def release_request(self, token_ids: TokenIds, req_to_token_pool: ReqToTokenPool, row: int, seq_len: int,
                        frontier: int, lock: Optional[PrefixLock] = None, cache: bool = True) -> int:
        """A request ends: optionally cache its tokens, drop its lock and its own page references
        (full pages of [0, seq_len), SWA pages from its frontier on). `token_ids`: the request's tokens from
        position 0 (those of [0, seq_len) are cached; fewer cache fewer), cached or not: their first page keys the
        release's free rounds, so wrong ones can drop too few references. Returns tokens newly cached; the row's
        entries [0, seq_len) are cleared to 0 (the padding page), so releasing it again is refused where the allocator
        checks shares (the CPU, debug mode) rather than dropping the references the cache took. A refusal (a bad row
        or length, a frontier off the page grid, past seq_len or below the request's, another cache's lock) changes
        nothing."""
        return self.release_requests([(token_ids, row, seq_len, frontier, lock)], req_to_token_pool, cache)

    def release_requests(self, requests: Sequence[Tuple[TokenIds, int, int, int, Optional[PrefixLock]]],
                         req_to_token_pool: ReqToTokenPool, cache: bool = True) -> int:
        """Requests that end together, each (token_ids, row, seq_len, frontier, lock) as `release_request`
        takes them: every one checked before anything changes, then cached and unlocked one by one, and their own
        references dropped in two allocator calls per round rather than two per request. `free` drops one
        reference per distinct page, so requests that may hold the same page (taken from the cache: the same
        tokens from position 0, so the same first page) go to different rounds, and one whose ids do not cover
        its first page to a round of its own. Returns tokens newly cached."""
        check_flag("cache", cache)   # ("no" would read as on), before anything changes
        p, checked, locks, rows = self.page_size, [], set(), set()
        for token_ids, row, seq_len, frontier, lock in requests:
            if lock is not None:
                self._own(lock, PrefixLock, "release_requests")
                if not lock.active or id(lock) in locks:
                    raise CacheError("this prefix lock was already released")
            locks.add(id(lock))
            locs = req_to_token_pool.row_locs(row, seq_len)
            key = as_int(row)  # (row_locs took it: an integer, or an integer tensor, which hashes by identity)
            if key in rows:  # its references would be dropped twice
                raise LocError(f"request row {key} is named twice in one release")
            rows.add(key)
            ids = self._ids(token_ids)[:locs.numel()]  # refused here, not after other requests' inserts
            f = as_int(frontier)
            if f is None or f % p or not 0 <= f <= locs.numel():
                raise LocError(f"frontier {frontier!r} must be an integer multiple of page_size {p} in [0, seq_len "
                               f"{locs.numel()}] (the request's release frontier)")
            # every page it holds, with SWA from its frontier on: the frees below would drop references it lacks
            try:
                self._precheck(locs, locs[f:], f)
            except (LocError, NotAllocatedError) as e:  # (raised only where shares are checked: reading is fine)
                if locs.numel() and not bool(locs.any()):
                    raise LocError(f"{e}: request row {key} holds no slot in [0, {locs.numel()}), so it is no running "
                                   "request's (a release clears its row: released already?)") from None
                raise e
            checked.append((ids, locs, f, lock))
        with interrupts_held():  # every request cached, unlocked and its references dropped together
            return self._release_checked(checked, cache)

    def _release_checked(self, checked: List[Tuple[np.ndarray, torch.Tensor, int, Optional[PrefixLock]]],
                         cache: bool) -> int:
        """`release_requests` once every request passed its checks."""
        p = self.page_size
        added, rounds, alone, seen = 0, [], [], {}
        for ids, locs, f, lock in checked:
            added += self.insert(ids, locs, f) if cache else 0
            if lock is not None:
                self.unlock(lock)
            if len(ids) < p <= locs.numel():  # its first page's tokens not given (fewer ids than a page): it may
                alone.append(([locs[:f]], [locs[f:]]))  # share a page with any other, so a round of its own
                continue
            # requests holding a page in common hold the same tokens from position 0 (a tombstone's revival can give
            # them different first pages, so the tokens, not the locs, are the key)
            key = ids[:p].tobytes() if locs.numel() >= p else None  # under a page: none shared
            at = seen.get(key, 0) if key is not None else 0
            seen[key] = at + 1
            if at == len(rounds):
                rounds.append(([], []))
            rounds[at][0].append(locs[:f])
            rounds[at][1].append(locs[f:])
        for below, above in rounds + alone:
            for parts, with_swa in ((below, False), (above, True)):
                parts = [t for t in parts if t.numel()]
                if parts:
                    self.allocator.free(torch.cat(parts) if len(parts) > 1 else parts[0], with_swa=with_swa)
        for _, locs, _, _ in checked:  # the rows name no page now (0: the padding page), so a second release of one
            locs.zero_()               # is refused where the allocator checks shares, not a drop of the cache's own
        return added

    # ---- eviction order -----------------------------------------------------------------------
    @staticmethod
    def _full_rank(node: _Node) -> Rank:
        """Tombstone leaves first (no match can end inside them), then least recently used."""
        return (1 if node.swa else 0, node.t_full)

    def _push_full(self, node: _Node) -> None:
        if node is self.root or node.children or node.lock_full or node.parent is None:
            return
        heapq.heappush(self._full_heap, (self._full_rank(node), next(self._tie), node))
        if len(self._full_heap) > 4 * self._nodes_count + 64:
            self._full_heap = [(self._full_rank(nd), next(self._tie), nd) for nd in self._nodes()
                               if not nd.children and nd.lock_full == 0]
            heapq.heapify(self._full_heap)

    def _swa_rank(self, nd: _Node) -> Tuple[Rank, int]:
        """(rank, keep_from) of an SWA node. The window of an end E is [window_start(E), E) and may span
        several nodes; nd's SWA is worth the best window it lies in. SWA no window needs (a head below
        keep_from) ranks first (class 0); then ends one conversation went past (1: one child), leaves
        (2: a next turn continues there), branch points (3: shared prefixes); least recent first."""
        p, w = self.page_size, self.window
        keep_from, best = nd.end, (0, 0)
        stack = [nd]
        while stack:  # nd and the descendants whose window reaches back into nd
            d = stack.pop()
            ws = window_start(d.end, w, p)
            if ws < nd.end:
                cls = 2 if not d.children else (3 if len(d.children) > 1 else 1)
                best = max(best, (cls, d.t_swa))
                keep_from = min(keep_from, max(ws, nd.start))
                stack.extend(d.children.values())
        if keep_from > nd.start:
            return (0, nd.t_swa), keep_from
        return best, keep_from

    def _push_swa(self, node: _Node) -> None:
        if node is self.root or not node.swa or node.lock_swa or node.parent is None:
            return
        heapq.heappush(self._swa_heap, (self._swa_rank(node)[0], next(self._tie), node))
        if len(self._swa_heap) > 4 * self._nodes_count + 64:
            self._swa_heap = [(self._swa_rank(nd)[0], next(self._tie), nd) for nd in self._nodes()
                              if nd.swa and not nd.lock_swa]
            heapq.heapify(self._swa_heap)

    def _push_swa_around(self, node: _Node, first: _Node) -> None:
        """The end before `node` (node.start) changed class, as `node` came or goes: the ranks of the nodes
        from `first` up that its window reaches may drop (a rank that rises is caught when popped), so they
        are queued anew. A few nodes: those within a window of node.start."""
        reach = window_start(node.start, self.window, self.page_size)
        nd = first
        while nd is not self.root and nd is not None and (nd is node or nd.end > reach):
            self._push_swa(nd)
            nd = nd.parent

    def _pop(self, heap: List[Tuple[Rank, int, _Node]], ok: Callable[[_Node], bool],
             rank: Callable[[_Node], Tuple[Rank, int]]) -> Tuple[_Node, Rank, int]:
        """The valid node of least current rank: keys never exceed current ranks, so a popped key equal to
        its node's current rank is a true minimum; a stale key goes back in at the node's current rank."""
        while heap:
            key, _, node = heapq.heappop(heap)
            if not ok(node):
                continue
            cur, extra = rank(node)
            if cur != key:
                heapq.heappush(heap, (cur, next(self._tie), node))
                continue
            return node, cur, extra
        raise CacheError("internal: an eviction heap lost an evictable node (check_integrity would say which)")

    # ---- eviction -----------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` of full-pool KV (whole unlocked leaves with their SWA KV): first
        tombstone leaves (no match can use them), then least recently used leaves; returns tokens freed.
        More than is evictable raises CacheError."""
        num_tokens = self._count(num_tokens, "evict")
        if num_tokens > self.evictable_full:
            raise CacheError(f"asked to evict {num_tokens} tokens of full KV, only {self.evictable_full} are "
                             f"unlocked ({self.full_tokens} cached)")
        freed = 0
        gone: Dict[bool, List[torch.Tensor]] = {True: [], False: []}
        ok = lambda nd: nd.parent is not None and not nd.children and nd.lock_full == 0  # noqa: E731
        with interrupts_held():  # the nodes leave the tree and their pages go back together (a Ctrl-C after)
            try:
                while freed < num_tokens:
                    node, _, _ = self._pop(self._full_heap, ok, lambda nd: (self._full_rank(nd), 0))
                    gone[node.swa].append(node.locs)
                    self._detach(node)
                    freed += len(node.key)
            finally:  # (a heap found broken part way: what left the tree is freed all the same)
                self._free(gone)
        return freed

    def _free(self, gone: Dict[bool, List[torch.Tensor]]) -> None:
        """One allocator call per kind (with / without SWA) for everything an eviction dropped."""
        for with_swa, parts in gone.items():
            if parts:
                self.allocator.free(torch.cat(parts) if len(parts) > 1 else parts[0], with_swa=with_swa)

    def evict_swa(self, num_tokens: int) -> int:
        """Free at least `num_tokens` of SWA KV by turning unlocked nodes (or their heads) into tombstones;
        their full KV stays. Order: see `_swa_rank`. Returns tokens freed. More than is evictable raises
        CacheError."""
        num_tokens = self._count(num_tokens, "evict_swa")
        if num_tokens > self.evictable_swa:
            raise CacheError(f"asked to evict {num_tokens} tokens of SWA KV, only {self.evictable_swa} are "
                             f"unlocked ({self.swa_tokens} cached)")
        freed = 0
        drop: List[torch.Tensor] = []
        ok = lambda nd: nd.parent is not None and nd.swa and nd.lock_swa == 0  # noqa: E731
        with interrupts_held():  # the tombstones and the SWA pages' release land together (a Ctrl-C after)
            try:
                while freed < num_tokens:
                    node, rank, keep_from = self._pop(self._swa_heap, ok, self._swa_rank)
                    if rank[0] == 0 and keep_from < node.end:  # only the head: the rest still serves a window
                        node = self._split(node, keep_from)
                    drop.append(node.locs)
                    freed += self._tombstone(node)
            finally:  # (a heap found broken part way: the tombstones made so far release their SWA all the same)
                if drop:
                    self.allocator.free_swa(torch.cat(drop) if len(drop) > 1 else drop[0])
        return freed

    def _tombstone(self, node: _Node) -> int:
        """Drop the node's SWA from the books (the caller frees the cache's SWA references)."""
        node.swa = False
        self.swa_tokens -= len(node.key)
        self.evictable_swa -= len(node.key)
        self._push_full(node)  # a tombstone leaf goes first
        return len(node.key)

    def evict_node(self, match: PrefixMatch) -> int:
        """Drop a matched node and everything below it now; a locked one raises CacheError."""
        self._own(match, PrefixMatch, "evict_node")
        node = match.node
        if node is self.root:
            return 0
        if node.parent is None:
            raise CacheError(f"node at positions [{node.start}, {node.end}) is no longer cached")
        subtree = list(self._nodes(node))
        locked = [nd for nd in subtree if nd.lock_full]
        if locked:
            raise CacheError(f"node at positions [{locked[0].start}, {locked[0].end}) is locked by "
                             f"{locked[0].lock_full} running request(s)")
        freed = 0
        gone: Dict[bool, List[torch.Tensor]] = {True: [], False: []}
        with interrupts_held():  # the nodes leave the tree and their pages go back together
            for nd in reversed(subtree):  # leaves first
                gone[nd.swa].append(nd.locs)
                self._detach(nd)
                freed += len(nd.key)
            self._free(gone)
        return freed

    def _detach(self, node: _Node) -> None:
        parent = node.parent
        del parent.children[self._edge(node.key)]
        n = len(node.key)
        self._nodes_count -= 1
        self.full_tokens -= n
        self.evictable_full -= n
        if node.swa:
            self.swa_tokens -= n
            self.evictable_swa -= n if node.lock_swa == 0 else 0
        node.parent = None
        self._push_full(parent)
        self._push_swa_around(node, parent)

    def _nodes(self, top: Optional[_Node] = None) -> Iterator[_Node]:
        stack = [top or self.root]
        while stack:
            nd = stack.pop()
            if nd is not self.root:
                yield nd
            stack.extend(nd.children.values())

    # ---- integrity ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Rebuild counts from the tree and compare; check keys, locks, that each heap ranks every candidate
        no later than it should, that nodes own their storage, and that every cached page is live on the
        device (and mapped where the node holds SWA)."""
        p = self.page_size
        full = swa = ev_full = ev_swa = 0
        full_locs, swa_locs = [], []
        full_keys: Dict[int, Rank] = {}
        swa_keys: Dict[int, Rank] = {}
        for key, _, nd in self._full_heap:
            full_keys[id(nd)] = min(full_keys.get(id(nd), key), key)
        for key, _, nd in self._swa_heap:
            swa_keys[id(nd)] = min(swa_keys.get(id(nd), key), key)
        for nd in self._nodes():
            n = len(nd.key)
            assert n and n % p == 0 and nd.locs.numel() == n, f"node [{nd.start}, {nd.end}) is not whole pages"
            assert nd.locs.untyped_storage().nbytes() == 8 * n, f"node [{nd.start}, {nd.end}) pins a larger storage"
            assert nd.parent.children.get(self._edge(nd.key)) is nd, "a node is not under its first page"
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
                if nd.lock_swa == 0:
                    assert swa_keys.get(id(nd), (9, 0)) <= self._swa_rank(nd)[0], \
                        f"SWA node [{nd.start}, {nd.end}) is missing from the SWA heap or ranked too late"
            if not nd.children and nd.lock_full == 0:
                assert full_keys.get(id(nd), (9, 0)) <= self._full_rank(nd), "an evictable leaf left the LRU"
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
