"""Device-resident page bookkeeping: a ring of free pages, per-page reference counts, an error record.

One `PageRing` per pool. Pages are popped from the ring's head (a host integer: allocation
sizes are always known on the host) and pushed at its tail (a device counter: how many pages
a free or a release returns is only known on the device). So an allocation never reads the
device: the host keeps a lower bound of the free count (exact after any read of the tail,
refreshed by an async copy once it runs low) and only waits for the tail when that bound says
an allocation might not fit.

Frees and releases run as batched device ops (`PageOps`: torch here, Triton kernels
registered by device packages) that skip bad pages and record a problem in `err`;
`raise_pending()` turns it into the typed error at the next call that synchronizes anyway
(`available_size`, `check_integrity`). On CPU and with HWKV_DEBUG=1 the allocators check
first and raise before any state changes (see allocator.py).

The error record is one int64 key in err[0] (err[1]: the arrivals of an allocation launch that gives claimed
pages back, 0 between launches), kept with an atomic max so every implementation records the same error whatever
order its lanes or programs run in: the earliest op since the last check wins, then the lowest code, then the lowest
page (`error_key`). 0 = none.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Union

import torch

from hwkv.errors import DoubleFreeError, HwkvError, LocError, NotAllocatedError, ShapeError

NEVER, FREE = -1, 0  # refs values: never allocated / allocated once and free again; >= 1: holders

# codes of the device-side error record
ERR_NONE, ERR_DOUBLE_FREE, ERR_NEVER, ERR_RANGE, ERR_SWA_RELEASED, ERR_CONT_RELEASED = 0, 1, 2, 3, 4, 5
ERR_ACCEPT_INDEX, ERR_ACCEPTED = 6, 7  # accept_draft_tokens: a draft named twice / out of range; applied twice
ERR_SWA_HELD = 8  # free(with_swa=False) left an SWA page as many holders as its full page
ERR_CLAIM = 9  # an allocation from reserve()'s claim needed more pages than it claimed (page: the first request short)
ERR_FRONTIER = 10  # a release's frontier negative or off the page grid (page: the request row; its release skipped)

# error key: [op: 26 bits, earlier = larger][CODE_TOP - code: 4 bits (codes 1..15)][page: 33 bits, lower = larger]
PAGE_BITS, CODE_SHIFT, OP_SHIFT = 33, 33, 37
CODE_TOP = 15                   # a lower code ranks first among one op's errors
OP_MAX = (1 << 26) - 1          # ops since the last check saturate here (then code and page decide)
PAGE_LO = -(1 << 32)            # recorded pages clamp into [PAGE_LO, -PAGE_LO)
PAGE_MASK = (1 << PAGE_BITS) - 1


def op_key(op: int) -> int:
    """The op part of an error key (host int a kernel adds the code and page parts to)."""
    return (OP_MAX - min(op, OP_MAX)) << OP_SHIFT


def code_key(code: int) -> int:
    """The code part of an error key, with the page part's constant: a key is op_key + code_key - clamped page."""
    return ((CODE_TOP - code) << CODE_SHIFT) + PAGE_MASK + PAGE_LO


def error_key(op: int, code: int, page: int) -> int:
    """Key of one error: the larger key wins the record (earliest op, lowest code, lowest page)."""
    return op_key(op) + code_key(code) - min(max(page, PAGE_LO), -PAGE_LO - 1)


def decode_key(key: int) -> "tuple[int, int]":
    """(code, page) of a non-zero error key."""
    return CODE_TOP - ((key >> CODE_SHIFT) & CODE_TOP), PAGE_MASK - (key & PAGE_MASK) + PAGE_LO


class PageRing:
    """Free pages of one pool on its device: ring [num_pages + 1] (last entry: scatter dump),
    head (host int, pages ever popped), tail (device int64 [1], pages ever pushed), refs int64."""

    def __init__(self, num_pages: int, page_size: int, device: torch.device, name: str) -> None:
        self.num_pages, self.page_size, self.device, self.name = num_pages, page_size, device, name
        n = num_pages + 1
        # one int64 buffer, so a kernel takes one pointer per pool: ring | refs | tail | err (code, page)
        self.buf = torch.zeros(2 * n + 3, dtype=torch.int64, device=device)
        self.ring, self.refs = self.buf[:n], self.buf[n:2 * n]
        self.tail, self.err = self.buf[2 * n:2 * n + 1], self.buf[2 * n + 1:]
        # on the CPU the host reads (and the allocator's host paths write) these through numpy views of them,
        # made once: no torch dispatch per access
        cpu = device.type == "cpu"
        self.ring_np, self.refs_np = (self.ring.numpy(), self.refs.numpy()) if cpu else (None, None)
        self._tail_host = self.tail.numpy() if cpu else None
        self.who = torch.zeros(n, dtype=torch.int64, device=device)  # scratch: one batch entry per page
        self.head = 0
        self.op = 0               # ops since the error record was last read (its keys' first part)
        self.deferred = device.type != "cpu"  # errors recorded on the device (else checked before, on the host)
        self._tail_seen = 0       # tail as last read on the host: free >= _tail_seen - head
        self._snap: Optional[torch.Tensor] = None
        self._snap_event: Any = None
        self._snap_pending = False
        self.reset()

    def reset(self) -> None:
        """Every page free and never allocated, in ascending order."""
        n = self.num_pages
        self.ring[:n] = torch.arange(1, n + 1, dtype=torch.int64, device=self.device)
        self.ring[n] = 0
        self.refs.fill_(NEVER)
        self.err.zero_()
        self.tail.fill_(n)
        self.head, self._tail_seen, self.op = 0, n, 0
        self._snap_pending = False

    # ---- the free count on the host -------------------------------------------------------------
    @property
    def on_host(self) -> bool:
        return self.device.type == "cpu"

    def free_lower_bound(self) -> int:
        """Pages certainly free now, without waiting on the device (exact on CPU)."""
        if self._tail_host is not None:
            return int(self._tail_host[0]) - self.head
        if self._snap_pending and self._snap_event.query():
            self._tail_seen = max(self._tail_seen, int(self._snap[0]))
            self._snap_pending = False
        return self._tail_seen - self.head

    def free_pages(self) -> int:
        """Exact free page count: reads the device tail (a host sync on accelerators)."""
        self._tail_seen = int(self.tail[0]) if self._tail_host is None else int(self._tail_host[0])
        return self._tail_seen - self.head

    def has_room(self, k: int) -> bool:
        """Whether k pages can be popped. Reads the device only when the host's bound says maybe not;
        when the bound runs low, starts an async read of the tail so later calls need not wait."""
        lb = self.free_lower_bound()
        if k > lb:
            return k <= self.free_pages()
        if 2 * k > lb:
            self._snapshot_tail()
        return True

    def _snapshot_tail(self) -> None:
        """Start an async copy of the tail to pinned host memory (one in flight at a time)."""
        if self.on_host or self._snap_pending:
            return
        event_cls = getattr(getattr(torch, self.device.type, None), "Event", None)
        if event_cls is None:
            return
        if self._snap is None:
            self._snap = torch.zeros(1, dtype=torch.int64, device="cpu", pin_memory=True)
            self._snap_event = event_cls()
        self._snap.copy_(self.tail, non_blocking=True)
        self._snap_event.record()
        self._snap_pending = True

    def popped(self, start: int, k: int) -> torch.Tensor:
        """The k pages the ring gave from position `start` (pages ever popped before them) on, in order, on its
        device: what an allocation from that head took (the error paths' check of what a replay claimed)."""
        at = (start + torch.arange(k, dtype=torch.int64, device=self.device)) % max(self.num_pages, 1)
        return self.ring[at]

    def take(self, k: int) -> int:
        """Claim k pages from the head (the caller checked `has_room`); returns the old head mod num_pages."""
        h = self.head % max(self.num_pages, 1)
        self.head += k
        return h

    # ---- errors --------------------------------------------------------------------------------
    def next_op(self) -> int:
        """Number the next op on this ring (its errors rank after earlier ops' in the record)."""
        self.op += 1
        return self.op

    def pending(self) -> "Optional[tuple[int, int]]":
        """(code, page) of the recorded error, or None (reads the device)."""
        key = int(self.err[0])
        return None if key == 0 else decode_key(key)

    def raise_pending(self) -> None:
        """Raise (once) the error a device-side op recorded; the record and the op count start over."""
        found = self.pending()
        self.op = 0  # the read waited for every op issued so far: later ops start a new count
        if found is None:
            return
        self.err.zero_()
        raise error_for(found[0], found[1], self.page_size, self.name, self.num_pages)

    def state(self) -> Dict[str, Any]:
        """Host copy of everything (tests compare these to prove an error changed nothing): head, tail,
        the free pages in ring order (entries outside them are scratch), reference counts."""
        return dict(head=self.head, tail=int(self.tail[0]), ring=self.free_list().clone(),
                    refs=self.refs.cpu().clone())

    def free_list(self) -> torch.Tensor:
        """The free pages in ring order (host tensor; syncs)."""
        n = self.num_pages
        t = int(self.tail[0])
        idx = torch.arange(self.head, max(t, self.head), dtype=torch.int64, device="cpu") % max(n, 1)
        return self.ring.cpu()[idx]

    def check_integrity(self) -> None:
        """Ring holds exactly the non-live pages, each once; free + held = total; refs sane; no pending
        device error."""
        self.raise_pending()
        n = self.num_pages
        tail = int(self.tail[0])
        assert 0 <= tail - self.head <= n, \
            f"{self.name}: tail {tail} - head {self.head} is not a free count in [0, {n}]"
        free = self.free_list()
        refs = self.refs.cpu()
        held = int((refs[1:] >= 1).sum())
        assert free.numel() == tail - self.head, f"{self.name}: free list and free count disagree"
        assert (tail - self.head) + held == n, \
            f"{self.name}: {tail - self.head} free + {held} held != {n} pages (a page is lost or counted twice)"
        assert free.numel() == torch.unique(free).numel(), f"{self.name}: a page is on the free ring twice"
        assert free.numel() == 0 or (int(free.min()) >= 1 and int(free.max()) <= n), f"{self.name}: bad page on ring"
        assert int(refs[0]) == NEVER, f"{self.name}: the padding page 0 was allocated"
        assert not (refs[free] >= 1).any(), f"{self.name}: a live page is on the free ring"
        assert int(refs.min()) >= NEVER, f"{self.name}: a negative reference count"
        assert int(self.err[1]) == 0, f"{self.name}: an allocation launch left its arrival count (a launch cut short?)"


def error_for(code: int, page: int, page_size: int, pool: str, num_pages: Optional[int] = None) -> HwkvError:
    """The typed error of a device-side error record (`num_pages`: the pool's, named by a range error)."""
    slots = f"(slots {page * page_size}..)"
    if code == ERR_DOUBLE_FREE:
        return DoubleFreeError(f"{pool} page {page} {slots} is already free")
    if code == ERR_NEVER:
        return NotAllocatedError(f"{pool} page {page} {slots} was never allocated")
    if code == ERR_RANGE:
        return LocError(f"a loc to free lies on page {page}, outside the {pool} pool's pages "
                        f"[1, {'n' if num_pages is None else num_pages}]")
    if code == ERR_SWA_RELEASED:
        return DoubleFreeError(f"the SWA slots of full page {page} (locs {page * page_size}..) are already released")
    if code == ERR_CONT_RELEASED:
        return NotAllocatedError(f"the slot after last_loc, on full page {page} {slots}, has no SWA slot or its page "
                                 "is not held (released or never allocated; release must keep a page of margin "
                                 "behind the last page), or last_loc lies outside the pool, or it is not token "
                                 "prefix-1's slot (another in-page offset)")
    if code == ERR_ACCEPT_INDEX:
        return ShapeError(f"accept_index of request {page} names a draft token twice or one outside [0, drafts); "
                          "its accept kept the first drafts in place instead")
    if code == ERR_ACCEPTED:
        return DoubleFreeError(f"request {page}'s draft positions hold no slot: its drafts were already accepted "
                               "(accept_draft_tokens applied twice?); nothing was freed for it")
    if code == ERR_SWA_HELD:
        return LocError(f"{pool} page {page} {slots} was freed with with_swa=False while its SWA slots are still "
                        "held by as many holders (they would leak once the full page is free): free it with "
                        "with_swa=True, or free_swa first; the page was skipped (still held)")
    if code == ERR_CLAIM:
        return LocError(f"request {page} of an allocation from reserve()'s claim needed pages past the claim: "
                               "its tokens there took the padding slot 0 (their K/V are lost; the pool is intact): "
                               "reserve() the pages the step opens (the device's lengths must be the host's)")
    if code == ERR_FRONTIER:
        return LocError(f"request row {page}'s release frontier is negative or not a multiple of page_size "
                        f"{page_size}: its release was skipped (frontier unchanged)")
    return HwkvError(f"{pool} allocator recorded unknown error code {code} (page {page})")


# ---- which implementation runs the batched ops ----------------------------------------------------
_OPS: Dict[str, Any] = {}


def register_page_ops(device_type: str, ops: Any) -> None:
    """Use `ops` (alloc_extend, change_refs, release_window: see hwkv.torch_page_ops; optionally alloc_step, a whole
    decode step's allocation in one launch) for allocators on `device_type`. Ops whose alloc_extend reads the ring
    heads from a device tensor (so that a graph can capture it) set `reads_heads_on_device = True`, and ops whose
    release numbers itself from a device op word set `reads_op_word = True`."""
    _OPS[device_type] = ops


def page_ops_for(device: Union[str, torch.device]) -> Optional[Any]:
    """The registered kernels for `device`'s type, loading the device's backend package once so it
    can register them; None: the torch implementation runs."""
    dev_type = torch.device(device).type
    if dev_type == "cpu" or dev_type in _OPS:
        return _OPS.get(dev_type)
    from hwkv import devices  # late: devices imports nothing heavy, but keep allocator import light

    for spec in devices.discover().values():
        if spec.torch_device == dev_type and spec.is_available():
            spec.load_backend_class()  # importing the backend module registers its kernels
            if dev_type in _OPS:
                break
    _OPS.setdefault(dev_type, None)
    return _OPS[dev_type]
