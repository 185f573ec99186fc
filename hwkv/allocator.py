"""Token and page allocators, the SWA allocator that owns the full->SWA table, and ReqToTokenPool.

Bookkeeping (free pages, page states) lives on the host, like an engine's scheduler; the
returned locs and the `full_to_swa_index_mapping` table live on the pool's device.
Every error is raised before any state changes.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch

from hwkv.errors import ConfigError, DoubleFreeError, LocError, NotAllocatedError, OutOfSlotsError

NEVER, LIVE, FREED = 0, 1, 2
IntsLike = Union[torch.Tensor, Sequence[int]]


def _ints(name: str, x: IntsLike) -> List[int]:
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point:
            raise LocError(f"{name} must hold integers, got {x.dtype}")
        return [int(v) for v in x.reshape(-1).tolist()]
    return [int(v) for v in x]


def _locs_cpu(name: str, loc: torch.Tensor) -> torch.Tensor:
    if not isinstance(loc, torch.Tensor) or loc.dtype != torch.int64:
        raise LocError(f"{name} must be an int64 tensor, got {getattr(loc, 'dtype', type(loc).__name__)}")
    return loc.reshape(-1).cpu()


class PagedTokenToKVPoolAllocator:
    """Slots in pages of `page_size`; page 0 (slots [0, page_size)) is the padding page."""

    def __init__(self, size: int, page_size: int, device: Union[str, torch.device]) -> None:
        if page_size < 1 or size < 0 or size % page_size:
            raise ConfigError(f"size={size} must be a non-negative multiple of page_size={page_size} >= 1")
        self.size, self.page_size, self.device = size, page_size, torch.device(device)
        self.num_pages = size // page_size
        self.clear()

    def clear(self) -> None:
        """Forget every allocation: all pages free, never allocated."""
        self._free = list(range(self.num_pages, 0, -1))  # a stack; pop() gives low pages first
        self._state = torch.zeros(self.num_pages + 1, dtype=torch.int8)

    def available_size(self) -> int:
        return len(self._free) * self.page_size

    def _take_pages(self, k: int) -> torch.Tensor:
        if k > len(self._free):
            raise OutOfSlotsError(f"need {k} pages ({k * self.page_size} slots), only {len(self._free)} "
                                  f"pages ({self.available_size()} slots) are free")
        pages = [self._free.pop() for _ in range(k)]
        t = torch.tensor(pages, dtype=torch.int64)
        self._state[t] = LIVE
        return t

    def _check_pages_live(self, pages: torch.Tensor, what: str = "slot") -> None:
        bad = pages[(pages < 1) | (pages > self.num_pages)]
        if bad.numel():
            raise LocError(f"page {int(bad[0])} of a {what} to free is outside [1, {self.num_pages}]")
        st = self._state[pages]
        if (st == NEVER).any():
            p = int(pages[st == NEVER][0])
            raise NotAllocatedError(f"{what} page {p} (slots {p * self.page_size}..) was never allocated")
        if (st == FREED).any():
            p = int(pages[st == FREED][0])
            raise DoubleFreeError(f"{what} page {p} (slots {p * self.page_size}..) is already free")

    def _release_pages(self, pages: torch.Tensor) -> None:
        self._state[pages] = FREED
        self._free.extend(pages.tolist())

    def _page_locs(self, pages: torch.Tensor) -> torch.Tensor:
        return (pages[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)

    def alloc(self, need_size: int) -> torch.Tensor:
        """`need_size` slots in whole pages (a multiple of page_size)."""
        if need_size % self.page_size:
            raise ConfigError(f"alloc({need_size}) must be a multiple of page_size={self.page_size}")
        return self._page_locs(self._take_pages(need_size // self.page_size)).to(self.device)

    def _extend_plan(self, prefix: List[int], seq: List[int]) -> Tuple[List[int], int]:
        """Per request, how many new tokens continue its partial last page; total new pages."""
        cont, pages = [], 0
        for p, s in zip(prefix, seq):
            if s < p:
                raise LocError(f"seq_len {s} is shorter than prefix_len {p}")
            c = min(s - p, (-p) % self.page_size)
            cont.append(c)
            pages += -(-(s - p - c) // self.page_size)
        return cont, pages

    def _extend_locs(self, prefix: List[int], seq: List[int], last: List[int], cont: List[int],
                     pages: torch.Tensor) -> torch.Tensor:
        """Build the new tokens' slots: continue each partial page, then fill fresh pages in order."""
        out, used = [], 0
        for p, s, l, c in zip(prefix, seq, last, cont):
            if c:
                out.append(torch.arange(l + 1, l + 1 + c, dtype=torch.int64))
            rest = s - p - c
            k = -(-rest // self.page_size)
            if k:
                out.append(self._page_locs(pages[used:used + k])[:rest])
                used += k
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)

    def alloc_extend(self, prefix_lens: IntsLike, seq_lens: IntsLike, last_loc: IntsLike,
                     extend_num_tokens: int) -> torch.Tensor:
        """Slots for tokens [prefix_len, seq_len) of each request; `last_loc` = slot of token prefix_len-1."""
        prefix, seq, last = _ints("prefix_lens", prefix_lens), _ints("seq_lens", seq_lens), _ints("last_loc", last_loc)
        _check_extend_args(prefix, seq, last, extend_num_tokens)
        cont, k = self._extend_plan(prefix, seq)
        return self._extend_locs(prefix, seq, last, cont, self._take_pages(k)).to(self.device)

    def alloc_decode(self, seq_lens: IntsLike, last_loc: IntsLike) -> torch.Tensor:
        """One slot per request for token seq_len-1 (seq_lens are lengths after this step)."""
        seq = _ints("seq_lens", seq_lens)
        return self.alloc_extend([s - 1 for s in seq], seq, last_loc, len(seq))

    def free(self, loc: torch.Tensor) -> None:
        """Free the pages holding `loc` (a request's whole slots)."""
        cpu = _locs_cpu("loc", loc)
        if cpu.numel() == 0:
            return
        pages = torch.unique(cpu // self.page_size)
        self._check_pages_live(pages)
        self._release_pages(pages)

    def check_integrity(self) -> None:
        """Free list and page states agree; no page is free twice."""
        free = torch.tensor(self._free, dtype=torch.int64)
        assert free.numel() == torch.unique(free).numel(), "a page is on the free list twice"
        assert not (self._state[free] == LIVE).any(), "a live page is on the free list"
        live = int((self._state[1:] == LIVE).sum())
        assert live + len(self._free) == self.num_pages, f"{live} live + {len(self._free)} free != {self.num_pages}"


class TokenToKVPoolAllocator(PagedTokenToKVPoolAllocator):
    """Page size 1: every slot is its own page."""

    def __init__(self, size: int, device: Union[str, torch.device]) -> None:
        super().__init__(size, 1, device)


def _check_extend_args(prefix: List[int], seq: List[int], last: List[int], n: int) -> None:
    if not len(prefix) == len(seq) == len(last):
        raise LocError(f"prefix_lens ({len(prefix)}), seq_lens ({len(seq)}) and last_loc ({len(last)}) "
                       "must have one entry per request")
    total = sum(s - p for p, s in zip(prefix, seq))
    if total != n:
        raise LocError(f"extend_num_tokens={n} but seq_lens - prefix_lens sum to {total}")


class SWATokenToKVPoolAllocator:
    """Allocates each token a full slot and an SWA slot (equal in-page offsets) and owns the table."""

    def __init__(self, size: int, size_swa: int, page_size: int, device: Union[str, torch.device],
                 kvcache: object) -> None:
        self.size, self.size_swa, self.page_size = size, size_swa, page_size
        self.device = torch.device(device)
        self.full_attn_allocator = PagedTokenToKVPoolAllocator(size, page_size, device)
        self.swa_attn_allocator = PagedTokenToKVPoolAllocator(size_swa, page_size, device)
        # one trailing -1 so that mapping[-1] == -1
        self.full_to_swa_index_mapping = torch.zeros(size + page_size + 1, dtype=torch.int64, device=self.device)
        self.full_to_swa_index_mapping[-1] = -1
        self._kvcache = kvcache
        if kvcache is not None:
            kvcache.register_mapping(self.full_to_swa_index_mapping)

    def full_available_size(self) -> int:
        return self.full_attn_allocator.available_size()

    def swa_available_size(self) -> int:
        return self.swa_attn_allocator.available_size()

    def available_size(self) -> int:
        return min(self.full_available_size(), self.swa_available_size())

    def clear(self) -> None:
        self.full_attn_allocator.clear()
        self.swa_attn_allocator.clear()
        self.full_to_swa_index_mapping[:-1].zero_()

    def translate_loc_from_full_to_swa(self, loc: torch.Tensor) -> torch.Tensor:
        return self.full_to_swa_index_mapping[loc]

    def _check_room(self, pages: int) -> None:
        for name, a in (("full", self.full_attn_allocator), ("SWA", self.swa_attn_allocator)):
            if pages > len(a._free):
                raise OutOfSlotsError(f"need {pages} pages ({pages * self.page_size} slots) in the {name} pool, "
                                      f"only {a.available_size()} slots are free")

    def alloc(self, need_size: int) -> torch.Tensor:
        """`need_size` tokens (a multiple of page_size), each with a full and an SWA slot."""
        if need_size % self.page_size:
            raise ConfigError(f"alloc({need_size}) must be a multiple of page_size={self.page_size}")
        self._check_room(need_size // self.page_size)
        loc = self.full_attn_allocator.alloc(need_size)
        self.full_to_swa_index_mapping[loc] = self.swa_attn_allocator.alloc(need_size)
        return loc

    def alloc_extend(self, prefix_lens: IntsLike, seq_lens: IntsLike, last_loc: IntsLike,
                     extend_num_tokens: int) -> torch.Tensor:
        """Like the paged allocator's, and maps every new full slot to a new SWA slot."""
        prefix, seq, last = _ints("prefix_lens", prefix_lens), _ints("seq_lens", seq_lens), _ints("last_loc", last_loc)
        _check_extend_args(prefix, seq, last, extend_num_tokens)
        full, swa = self.full_attn_allocator, self.swa_attn_allocator
        cont, k = full._extend_plan(prefix, seq)
        last_swa = self._last_swa(last, cont)
        self._check_room(k)
        loc = full._extend_locs(prefix, seq, last, cont, full._take_pages(k))
        swa_loc = swa._extend_locs(prefix, seq, last_swa, cont, swa._take_pages(k))
        loc_dev = loc.to(self.device)
        self.full_to_swa_index_mapping[loc_dev] = swa_loc.to(self.device)
        return loc_dev

    def _last_swa(self, last: List[int], cont: List[int]) -> List[int]:
        """SWA slot of each continued request's last token; it must still be live."""
        idx = [l if c else -1 for l, c in zip(last, cont)]
        vals = self.full_to_swa_index_mapping[torch.tensor(idx, dtype=torch.int64, device=self.device)].tolist()
        for l, c, v in zip(last, cont, vals):
            if c and v <= 0:
                raise NotAllocatedError(f"last_loc {l} has no SWA slot (released or never allocated); "
                                        "release must keep a page of margin behind the last page")
        return vals

    def alloc_decode(self, seq_lens: IntsLike, last_loc: IntsLike) -> torch.Tensor:
        """One token per request at position seq_len-1."""
        seq = _ints("seq_lens", seq_lens)
        return self.alloc_extend([s - 1 for s in seq], seq, last_loc, len(seq))

    def _full_page_locs(self, loc: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        pages = torch.unique(_locs_cpu("loc", loc) // self.page_size)
        return pages, self.full_attn_allocator._page_locs(pages)

    def free(self, loc: torch.Tensor) -> None:
        """Free the full pages holding `loc` and whatever SWA slots they still map to."""
        if loc.numel() == 0:
            return
        pages, locs = self._full_page_locs(loc)
        self.full_attn_allocator._check_pages_live(pages, "full")
        swa_pages = self._swa_pages_of(locs)
        self.swa_attn_allocator._check_pages_live(swa_pages, "SWA")
        self.full_attn_allocator._release_pages(pages)
        self.swa_attn_allocator._release_pages(swa_pages)
        self.full_to_swa_index_mapping[locs.to(self.device)] = 0

    def free_swa(self, loc: torch.Tensor) -> None:
        """Free only the SWA slots of the (whole) pages holding `loc`; the full slots stay."""
        if loc.numel() == 0:
            return
        pages, locs = self._full_page_locs(loc)
        self.full_attn_allocator._check_pages_live(pages, "full")
        swa_pages = self._swa_pages_of(locs)
        mapped = (self.full_to_swa_index_mapping[locs.to(self.device)].view(-1, self.page_size) > 0).any(1).cpu()
        if not mapped.all():
            p = int(pages[~mapped][0])
            raise DoubleFreeError(f"the SWA slots of full page {p} (locs {p * self.page_size}..) are already released")
        self.swa_attn_allocator._check_pages_live(swa_pages, "SWA")
        self.swa_attn_allocator._release_pages(swa_pages)
        self.full_to_swa_index_mapping[locs.to(self.device)] = 0

    def _swa_pages_of(self, locs: torch.Tensor) -> torch.Tensor:
        swa = self.full_to_swa_index_mapping[locs.to(self.device)].cpu()
        return torch.unique(swa[swa > 0] // self.page_size)

    def check_integrity(self) -> None:
        """Both free lists are sound; every mapped SWA slot is live and owned once; the table's ends hold."""
        self.full_attn_allocator.check_integrity()
        self.swa_attn_allocator.check_integrity()
        m = self.full_to_swa_index_mapping.cpu()
        assert int(m[0]) == 0 and int(m[-1]) == -1, "mapping[0] must be 0 and mapping[-1] must be -1"
        body = m[:-1]
        src = torch.nonzero(body > 0).reshape(-1)
        swa = body[src]
        assert swa.numel() == torch.unique(swa).numel(), "an SWA slot is mapped from two full slots"
        full_pages = src // self.page_size
        assert (self.full_attn_allocator._state[full_pages] == LIVE).all(), "a freed full slot still maps"
        assert (self.swa_attn_allocator._state[swa // self.page_size] == LIVE).all(), "a mapping points at a free SWA slot"
        assert ((swa % self.page_size) == (src % self.page_size)).all(), "in-page offsets differ"


def release_out_of_window(allocator: SWATokenToKVPoolAllocator, token_row: torch.Tensor, seq_len: int,
                          frontier: int, window: int) -> int:
    """Free SWA slots of a request's tokens no later query can see; return the new frontier.

    The next query sits at position >= seq_len and sees keys > seq_len - W, so tokens below
    seq_len - W + 1 are dead. The frontier is page-aligned and kept one page behind that, so
    the last page (and `alloc_decode`'s last slot) always stays mapped.
    """
    p = allocator.page_size
    if window is None or window <= 0:
        return frontier
    if frontier % p:
        raise LocError(f"frontier {frontier} is not a multiple of page_size {p}")
    dead = seq_len - window + 1
    new_frontier = max(frontier, (dead // p) * p - p, 0)
    if new_frontier > frontier:
        allocator.free_swa(token_row[frontier:new_frontier])
    return new_frontier


class ReqToTokenPool:
    """Rows of locs per request: `req_to_token[row, pos]` is the full-pool loc of token `pos`."""

    def __init__(self, size: int, max_context_len: int, device: Union[str, torch.device]) -> None:
        if size < 1 or max_context_len < 1:
            raise ConfigError(f"size={size} and max_context_len={max_context_len} must be >= 1")
        self.size, self.max_context_len, self.device = size, max_context_len, torch.device(device)
        self.req_to_token = torch.zeros(size, max_context_len, dtype=torch.int64, device=self.device)
        self._free = list(range(size - 1, -1, -1))

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, need_size: int = 1) -> List[int]:
        if need_size > len(self._free):
            raise OutOfSlotsError(f"need {need_size} request rows, only {len(self._free)} of {self.size} are free")
        return [self._free.pop() for _ in range(need_size)]

    def free(self, rows: Union[int, Sequence[int]]) -> None:
        rows = [rows] if isinstance(rows, int) else list(rows)
        for r in rows:
            if not 0 <= r < self.size:
                raise LocError(f"request row {r} is outside [0, {self.size})")
            if r in self._free:
                raise DoubleFreeError(f"request row {r} is already free")
        self._free.extend(rows)

    def write(self, row: int, start: int, locs: torch.Tensor) -> None:
        """req_to_token[row, start:start+len(locs)] = locs, bounds-checked."""
        end = start + int(locs.shape[0])
        if end > self.max_context_len:
            raise LocError(f"positions up to {end} exceed max_context_len {self.max_context_len}")
        self.req_to_token[row, start:end] = locs

    def check_integrity(self) -> None:
        assert len(set(self._free)) == len(self._free), "a request row is free twice"
