"""Token and page allocators and the SWA allocator that owns the full->SWA table.

Their torch page ops are in `hwkv.torch_page_ops`, the out-of-window release in `hwkv.release` and
`ReqToTokenPool` in `hwkv.req_to_token` (all still importable from here).

Free pages, reference counts and the table live on the pool's device (`hwkv.pages`): a whole
batch is allocated, freed or released in a constant number of device ops (one Triton launch
on GPUs), with no per-request Python and no host sync. Sizes come from host values: the
arguments, or the `*_cpu` copies an engine keeps. Checks that need device values (double
free, never allocated) run first and raise before any change on CPU and with HWKV_DEBUG=1;
otherwise (`immediate = False`) the device op skips the bad pages, records one (`hwkv.pages`:
the same one whichever implementation runs) and the next call that synchronizes anyway
(`available_size`, `check_integrity`) raises it.

A full page and its SWA page are paired whole: `full_to_swa_index_mapping[F*P + o] = S*P + o`
for every offset o of a live pair, so continuing a partial page needs no lookup.
"""
from __future__ import annotations

import operator
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from hwkv.checks import (as_int, check_device, check_flag, check_host_copy, check_int_dtype, check_loc, check_on_device,
                         first_repeat, is_bool, is_int, normal_tensors)
from hwkv.env import HWKV_DEBUG
from hwkv.errors import ConfigError, LocError, NotAllocatedError, OutOfSlotsError
from hwkv.sigint import held_or_undone, interrupts_held
from hwkv.pages import (ERR_CONT_RELEASED, ERR_DOUBLE_FREE, ERR_NEVER, ERR_SWA_RELEASED, FREE, NEVER, PageRing,
                        page_ops_for)
from hwkv.torch_page_ops import I64, TORCH_OPS, TorchPageOps, _bad_continuation, _record, _unmap

IntsLike = Union[torch.Tensor, Sequence[int]]
_REEXPORTED = (TorchPageOps,)  # its old home: `hwkv.allocator.TorchPageOps` keeps working


def _count(name: str, x: object) -> int:
    """Entries of a tensor or sequence argument (a host attribute, no device read); anything else (an int, None) is
    a LocError naming it."""
    if isinstance(x, torch.Tensor):
        return x.numel()
    try:
        return len(x)  # type: ignore[arg-type]
    except TypeError:
        raise LocError(f"{name} must be a tensor or a sequence of integers, got {type(x).__name__} {x!r}") from None


def _host_ints(name: str, x: IntsLike, host: Optional[torch.Tensor] = None) -> np.ndarray:
    """int64 host copy of x (numpy: a few host ops cost microseconds, not torch's dispatch per op):
    the given host copy, x itself when on the CPU, else one device read. Floats are refused, not truncated, and bools
    (True would read as 1)."""
    check_int_dtype(name, x)
    if not isinstance(x, torch.Tensor):
        _count(name, x)
    if host is not None:
        if not isinstance(host, torch.Tensor):
            raise LocError(f"{name}'s host copy must be a CPU tensor, got {type(host).__name__} {host!r}")
        check_int_dtype(f"{name}'s host copy", host)
        if host.numel() != _count(name, x):  # (the steps size from the host copy, the kernels read x)
            raise LocError(f"{name} has {_count(name, x)} entries, its host copy {host.numel()}")
        if isinstance(x, torch.Tensor):
            check_host_copy(name, x, host)
        x = host
    if isinstance(x, torch.Tensor):
        if x.dtype == I64 and x.dim() == 1 and x.device.type == "cpu" and not x.requires_grad:
            return x.numpy()  # already what the general path would give (a view): one call
        if x.is_meta:
            raise LocError(f"{name} is on meta: it holds no values to read")
        return x.reshape(-1).to("cpu", I64).numpy()
    try:
        values = [operator.index(v) for v in x]  # int(6.9) would be 6
    except TypeError:
        values = None
    # a bool is no integer (True would read as 1): Python's by their type (a C-level scan), torch's by their dtype
    kinds = set(map(type, x)) if values is not None else ()
    if values is None or bool in kinds or (torch.Tensor in kinds and any(map(is_bool, x))):
        for v in x:  # the refusal only: name the first value that is no integer
            if as_int(v) is None:  # (the core's integer rule: a bool is none)
                raise LocError(f"{name} must hold integers, got {type(v).__name__} {v!r}")
    try:
        return np.asarray(values, dtype=np.int64)
    except OverflowError:
        v = next(v for v in values if not -2 ** 63 <= v < 2 ** 63)
        raise LocError(f"{name} holds {v}: values must fit int64 (below 2**63 in magnitude)") from None


def _claim_ran(ring: PageRing, pages: int) -> bool:
    """Whether the allocation of the last `pages` pages the ring gave ran: one of them is live, or one is free again
    (an allocation that opened fewer pages than it claimed pushes the rest back; never run, they stay popped)."""
    claimed = ring.popped(ring.head - pages, pages)
    if bool((ring.refs[claimed] >= 1).any()):
        return True
    return bool(torch.isin(claimed.cpu(), ring.free_list()).any())


def _refs_view(ring: PageRing) -> np.ndarray:
    """A ring's reference counts as numpy: its kept view on the CPU, else one device read (debug checks)."""
    return ring.refs_np if ring.refs_np is not None else _host_view(ring.refs)


def _host_view(t: torch.Tensor) -> np.ndarray:
    """A numpy view of t's values for host checks (t itself on the CPU, shared memory; else one device read):
    numpy indexing and reductions cost a microsecond where torch's dispatch costs several."""
    if t.dim() == 1 and t.device.type == "cpu" and not t.requires_grad:
        return t.numpy()  # a strided view where t is one: one call instead of four
    return t.detach().cpu().reshape(-1).numpy()


def _on_device(device: torch.device, x: IntsLike, host: np.ndarray) -> torch.Tensor:
    """x as an int64 tensor on `device` (no copy when it already is one)."""
    if isinstance(x, torch.Tensor) and x.device.type == device.type:
        return x.reshape(-1).to(I64)
    t = torch.from_numpy(np.ascontiguousarray(host))
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)  # pinned: the copy does not stall the host


def _flat(t: torch.Tensor) -> torch.Tensor:
    """t as 1-D (itself when it already is: no dispatch)."""
    return t if t.dim() == 1 else t.reshape(-1)


def _check_loc_tensor(loc: object, device: torch.device) -> torch.Tensor:
    """loc as a flat int64 tensor on the allocator's device or the CPU (a meta tensor holds no values)."""
    if not isinstance(loc, torch.Tensor) or loc.dtype != I64:
        got = f"{loc.dtype} tensor" if isinstance(loc, torch.Tensor) else (
            f"{type(loc).__name__} of {loc.dtype}" if hasattr(loc, "dtype") else type(loc).__name__)
        raise LocError(f"loc must be an int64 tensor, got {got}")
    check_on_device("loc", loc, device, "allocator")
    return _flat(loc)


class _Batch:
    """One alloc call checked on the host: tokens, new pages, tokens continuing a partial page (numpy), and
    `pre`: each request's prefix length (extend) or `seq`: its length (decode), host arrays kept for the
    continuation check."""

    def __init__(self, n: int, pages: int, cont: Optional[np.ndarray], pre: Optional[np.ndarray] = None,
                 seq: Optional[np.ndarray] = None) -> None:
        self.n, self.pages, self.cont, self.pre, self.seq = n, pages, cont, pre, seq

    @classmethod
    def extend(cls, prefix: np.ndarray, seq: np.ndarray, n_last: int, n: int, page: int) -> "_Batch":
        if not prefix.size == seq.size == n_last:
            raise LocError(f"prefix_lens ({prefix.size}), seq_lens ({seq.size}) and last_loc "
                           f"({n_last}) must have one entry per request")
        ext = seq - prefix
        if ext.size and int(ext.min()) < 0:
            b = int(np.argmin(ext))
            raise LocError(f"seq_len {int(seq[b])} is shorter than prefix_len {int(prefix[b])} (request {b})")
        if ext.size and int(prefix.min()) < 0:
            raise LocError(f"prefix_lens must be >= 0, got {int(prefix.min())}")
        total = int(ext.sum())
        if total != n:
            raise LocError(f"extend_num_tokens={n} but seq_lens - prefix_lens sum to {total}")
        cont = np.minimum(ext, (-prefix) % page)
        return cls(n, int(((ext - cont + page - 1) // page).sum()), cont, pre=prefix)

    @classmethod
    def decode(cls, seq: np.ndarray, bs: int, page: int) -> "_Batch":
        if seq.size != bs:
            raise LocError(f"seq_lens_cpu has {seq.size} entries, seq_lens {bs}")
        if bs and int(seq.min()) < 1:
            raise LocError(f"decode seq_lens must be >= 1, got {int(seq.min())}")
        # bool: a request whose token does not start a page continues it ((seq - 1) % page != 0, one op less)
        cont = seq % page != 1 % page
        return cls(bs, bs - int(np.count_nonzero(cont)), cont, seq=seq)


class PagedTokenToKVPoolAllocator:
    """Slots in pages of `page_size`; page 0 (slots [0, page_size)) is the padding page."""

    @normal_tensors
    def __init__(self, size: int, page_size: int, device: Union[str, torch.device], name: str = "full") -> None:
        if not is_int(page_size) or not is_int(size) or page_size < 1 or size < 0 or size % page_size:
            raise ConfigError(f"size={size} must be a non-negative multiple of page_size={page_size} >= 1")
        self.size, self.page_size, self.device = size, page_size, check_device(device)
        self.num_pages = size // page_size
        self.pages = PageRing(self.num_pages, page_size, self.device, name)
        self._ring_set: Tuple[PageRing, ...] = (self.pages,)  # `_rings()`; the hybrid allocator adds its SWA ring
        self._ops = page_ops_for(self.device)
        # check device values before changing anything: free on CPU, a host sync elsewhere (debug only)
        self.immediate = self.device.type == "cpu" or HWKV_DEBUG.get()
        # checked ops on a CPU pool (no registered kernels) are applied through numpy views, not the torch ops
        # (same results, same ring order; tests set False to compare the two)
        self.host_ops = True
        self._map_src: Optional[torch.Tensor] = None  # the table `_map_np` views (SWA allocator, CPU)
        self._map_np: Optional[np.ndarray] = None

    @property
    def immediate(self) -> bool:
        """Check device values on the host before each op (CPU, HWKV_DEBUG=1) instead of recording
        errors on the device for the next synchronizing call."""
        return self._immediate

    @immediate.setter
    def immediate(self, value: bool) -> None:
        self._immediate = bool(value)
        for r in self._rings():
            r.deferred = not self._immediate

    # ---- the parts the hybrid allocator overrides ------------------------------------------------
    @property
    def _swa(self) -> Optional[PageRing]:
        return None

    @property
    def _mapping(self) -> Optional[torch.Tensor]:
        return None

    def _rings(self) -> Tuple[PageRing, ...]:
        """Every ring an allocation takes from: the full one, then the SWA one where there is one (made once)."""
        return self._ring_set

    def _mapping_view(self) -> np.ndarray:
        """The full->SWA table as a numpy array: a view kept from construction on the CPU, else one read."""
        m = self._mapping
        if m is not None and m is self._map_src:
            return self._map_np
        return _host_view(m)

    def _on_host(self) -> bool:
        """Apply this op through numpy on the host: checked first (immediate), CPU tensors, no kernels."""
        return self.host_ops and self.immediate and self._ops is None and self.device.type == "cpu"

    # ---- sizes --------------------------------------------------------------------------------------
    def clear(self) -> None:
        """Forget every allocation: all pages free, never allocated."""
        with interrupts_held():  # every ring (and the SWA allocator's table after it) or none
            self._clear()

    def _clear(self) -> None:
        for r in self._rings():
            r.reset()

    def available_size(self) -> int:
        """Free slots (reads the device; raises a deferred free/release error first)."""
        self.pages.raise_pending()
        return self.pages.free_pages() * self.page_size

    @property
    def allocates_in_graph(self) -> bool:
        """Whether an allocation can run inside a device graph: the device's page-op kernels read the ring heads
        from device memory (`alloc_reserved` with heads on the device); the torch ops size themselves from host
        values, so they serve only steps the host runs each time (an allocator handed the torch ops is no different
        from one without kernels: the ops say so, `reads_heads_on_device`)."""
        return bool(getattr(self._ops, "reads_heads_on_device", False))

    def has_room(self, pages: int) -> bool:
        """Whether `pages` more pages fit in every ring, on the host's bound of free pages (the device is read
        only when the bound says they might not)."""
        return all(r.has_room(pages) for r in self._rings())

    def _check_room(self, pages: int) -> None:
        for r in self._rings():
            if not r.has_room(pages):
                raise OutOfSlotsError(f"need {pages} pages ({pages * self.page_size} slots) in the {r.name} pool, "
                                      f"only {r.free_pages() * self.page_size} slots are free")

    # ---- allocation -----------------------------------------------------------------------------------
    def alloc(self, need_size: int) -> torch.Tensor:
        """`need_size` slots in whole pages (a multiple of page_size), pages in ring order. An integer (Python or numpy,
        as `reserve` takes), never a bool (True had taken one slot at page_size 1) or a tensor (a device read)."""
        n = _count_arg(need_size)
        if n is None or n < 0 or n % self.page_size or n >= 2 ** 63:
            raise ConfigError(f"alloc({need_size!r}) must be a non-negative multiple of page_size={self.page_size} "
                              "below 2**63 (a Python or numpy int; a bool is no count)")
        return self.alloc_extend([0], [n], [0], n)

    def alloc_extend(self, prefix_lens: IntsLike, seq_lens: IntsLike, last_loc: IntsLike, extend_num_tokens: int, *,
                     prefix_lens_cpu: Optional[torch.Tensor] = None,
                     seq_lens_cpu: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Slots for tokens [prefix_len, seq_len) of each request; `last_loc` = slot of token prefix_len-1.

        Device tensors need their host copies (`*_cpu`) to stay free of host syncs; lists work too.
        """
        for name, x in (("prefix_lens", prefix_lens), ("seq_lens", seq_lens), ("last_loc", last_loc)):
            check_on_device(name, x, self.device, "allocator")
        pre_cpu = _host_ints("prefix_lens", prefix_lens, prefix_lens_cpu)
        seq_cpu = _host_ints("seq_lens", seq_lens, seq_lens_cpu)
        n_last = _count("last_loc", last_loc)
        check_int_dtype("last_loc", last_loc)  # a device tensor skips `_host_ints`
        n = as_int(extend_num_tokens)  # an int (numpy's, a 0-d tensor's too); 1.9 and "1" are not truncated
        if n is None:
            raise LocError(f"extend_num_tokens must be an integer, got {type(extend_num_tokens).__name__} "
                           f"{extend_num_tokens!r}")
        plan = _Batch.extend(pre_cpu, seq_cpu, n_last, n, self.page_size)
        last_cpu = None if isinstance(last_loc, torch.Tensor) and last_loc.device.type != "cpu" else \
            _host_ints("last_loc", last_loc)
        return self._alloc(_on_device(self.device, prefix_lens, pre_cpu), _on_device(self.device, seq_lens, seq_cpu),
                           last_loc if last_cpu is None else _on_device(self.device, last_loc, last_cpu),
                           plan, decode=False)

    def alloc_decode(self, seq_lens: IntsLike, last_loc: IntsLike, *,
                     seq_lens_cpu: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One slot per request for token seq_len-1 (seq_lens are lengths after this step).

        At page size 1 nothing is read from the device even without `seq_lens_cpu` (lengths on the CPU, free to
        read, are checked as at any page size).
        """
        check_on_device("seq_lens", seq_lens, self.device, "allocator")
        check_on_device("last_loc", last_loc, self.device, "allocator")
        bs, n_last = _count("seq_lens", seq_lens), _count("last_loc", last_loc)
        if n_last != bs:
            raise LocError(f"seq_lens ({bs}) and last_loc ({n_last}) must have one entry per request")
        check_int_dtype("seq_lens", seq_lens)  # the tensor fast paths below skip `_host_ints`
        check_int_dtype("last_loc", last_loc)
        if self.page_size == 1 and seq_lens_cpu is None and isinstance(seq_lens, torch.Tensor) \
                and seq_lens.device.type != "cpu":
            seq_cpu, plan = None, _Batch(bs, bs, None)  # every token takes a fresh page: nothing to read
        else:
            seq_cpu = _host_ints("seq_lens", seq_lens, seq_lens_cpu)
            plan = _Batch.decode(seq_cpu, bs, self.page_size)
        seq_dev = _flat(seq_lens) if isinstance(seq_lens, torch.Tensor) and \
            seq_lens.device.type == self.device.type else _on_device(self.device, seq_lens, seq_cpu)
        last_dev = _flat(last_loc) if isinstance(last_loc, torch.Tensor) and \
            last_loc.device.type == self.device.type else _on_device(self.device, last_loc,
                                                                       _host_ints("last_loc", last_loc))
        if seq_dev.dtype != I64 or last_dev.dtype != I64:
            seq_dev, last_dev = seq_dev.to(I64), last_dev.to(I64)
        return self._alloc(None, seq_dev, last_dev, plan, decode=True)

    def _alloc(self, prefix: Optional[torch.Tensor], seq: torch.Tensor, last: torch.Tensor, plan: _Batch,
               decode: bool) -> torch.Tensor:
        if plan.pages:  # no new page always fits
            self._check_room(plan.pages)
        if self.immediate:
            self._check_continuations(prefix, seq, last, plan, decode)
        if decode and plan.n and plan.pages == 0:
            # every token continues its request's page (pages are whole, in-page offsets equal): last + 1, and
            # no ring moves; the deferred record of a continuation whose SWA slots were released stays
            self._next_op()
            out = last + 1
            if self.pages.deferred:  # immediate mode checked on the host first
                _record(self.pages, _bad_continuation(self.pages, self._mapping, out, seq - 1, self.page_size),
                        torch.div(out, self.page_size, rounding_mode="floor"), ERR_CONT_RELEASED)
            return out
        if plan.n == 0:
            return torch.empty(0, dtype=I64, device=self.device)
        marks = [r.head for r in self._rings()]
        self._counts_were: Union[None, bool, List[np.ndarray]] = None
        try:  # (free of cost until it raises) an allocation that raises part way gives back the pages it took
            if self._on_host():
                if decode and plan.cont is not None and plan.cont.dtype == np.bool_:
                    return self._alloc_decode_on_host(last, plan.cont, plan.pages)
                return self._alloc_on_host(prefix, seq, last, plan.n, plan.pages)
            out = torch.empty(plan.n, dtype=I64, device=self.device)
            heads = [r.take(plan.pages) for r in self._rings()]
            self._next_op()
            ops = self._ops or TORCH_OPS
            self._counts_were = True  # (the device op writes them: what they were is not kept)
            ops.alloc_extend(self.pages, self._swa, self._mapping, prefix, seq, last, out, plan.pages, heads, decode)
            return out
        except BaseException:
            self._untake(marks)
            raise

    def _untake(self, marks: List[int]) -> None:
        """The error path of an allocation: each ring's pages popped since its head was at `marks` back in the ring,
        free (a Ctrl-C after the host path popped them, which nobody would hold or give back otherwise), with the
        counts they had (`_counts_were`: kept by the host path before it wrote them; None: none written yet), and no
        full page mapping an SWA page. After a device op that raised part way, a page from the ring's first pass
        (position < num_pages) is taken for never allocated, any other for free."""
        was = self._counts_were
        with interrupts_held() as held:
            for i, (r, m) in enumerate(zip(self._rings(), marks)):
                if r.head == m:
                    continue
                pages = r.popped(m, r.head - m)
                if was is True:
                    r.refs[pages] = torch.where(torch.arange(m, r.head, dtype=I64, device=r.refs.device) < r.num_pages,
                                                NEVER, FREE)
                elif was is not None and i < len(was):
                    r.refs[pages] = torch.from_numpy(was[i])
                if r is self.pages and self._mapping is not None:  # (a free full page maps nothing)
                    _unmap(self._mapping, pages, torch.ones_like(pages, dtype=torch.bool), self.page_size)
                r.head = m
            held.drop()  # (the allocation's own error is the one raised)

    def _alloc_on_host(self, prefix: Optional[torch.Tensor], seq: torch.Tensor, last: torch.Tensor, n: int,
                       k: int) -> torch.Tensor:
        """`TorchPageOps.alloc_extend` (k new pages per ring) applied through numpy views of the CPU tensors:
        the same slots, pages popped in the same ring order, in a dozen numpy calls instead of ~25 torch
        dispatches. The caller checked everything first (immediate mode)."""
        p = self.page_size
        seq_h = _host_view(seq)
        pre_h = seq_h - 1 if prefix is None else _host_view(prefix)
        ext = seq_h - pre_h
        r = np.repeat(np.arange(ext.size), ext)  # each token's request
        j = np.arange(n) - np.repeat(np.cumsum(ext) - ext, ext)  # its index among the request's new tokens
        res = _host_view(last)[r] + 1 + j  # continuing the request's partial page: the next slot
        if k:
            cont = np.minimum(ext, (-pre_h) % p)
            newp = (ext - cont + p - 1) // p
            fpages = self._pop_on_host(k)
            pidx = np.clip((np.cumsum(newp) - newp)[r] + (j - cont[r]) // p, 0, k - 1)
            res = np.where(j < cont[r], res, fpages[pidx] * p + (pre_h[r] + j) % p)
        self._next_op()
        return torch.from_numpy(np.ascontiguousarray(res, dtype=np.int64))

    def _alloc_decode_on_host(self, last: torch.Tensor, cont: np.ndarray, k: int) -> torch.Tensor:
        """`_alloc_on_host` for a decode step (one token per request, `cont` from `_Batch.decode`): a continuing
        request takes last + 1, each other one the first slot of a new page, popped in request order; the same
        slots and ring order in half the numpy calls."""
        res = _host_view(last) + 1
        res[~cont] = self._pop_on_host(k) * self.page_size  # a request starting a page: its token at offset 0
        self._next_op()
        return torch.from_numpy(res)

    def _pop_on_host(self, k: int) -> np.ndarray:
        """Pop k pages of every ring (numpy views, immediate mode), each with one reference, the SWA pages mapped
        behind the full ones; returns the full pages in ring order."""
        p = self.page_size
        heads = [ring.take(k) for ring in self._rings()]
        full, swa = self.pages, self._swa
        fpages = full.ring_np[(heads[0] + np.arange(k)) % full.num_pages]
        spages = swa.ring_np[(heads[1] + np.arange(k)) % swa.num_pages] if swa is not None else None
        # the counts they had, for `_untake` (an allocation that raises from here gives them back as they were)
        self._counts_were = [full.refs_np[fpages]] + ([swa.refs_np[spages]] if swa is not None else [])
        full.refs_np[fpages] = 1
        if swa is not None:
            swa.refs_np[spages] = 1
            off = np.arange(p)
            self._mapping_view()[(fpages[:, None] * p + off).reshape(-1)] = (spages[:, None] * p + off).reshape(-1)
        return fpages

    def reserve(self, pages: int, ops: int = 1) -> List[int]:
        """Claim `pages` pages of every ring for an allocation the device runs later (a captured decode step):
        the room is settled here, on the host's bound of free pages (OutOfSlotsError, nothing changed, when
        they might not fit); returns the rings' heads (mod their sizes) for `alloc_reserved`. `ops`: how many
        ops the device runs for it (a captured step's allocation and its release: 2), numbered here; the first's
        number is `op_number - ops + 1` (staged beside the heads, a captured launch reads it there). `pages`: an
        integer (Python, numpy), never a bool (True would claim a page), as every other count here."""
        if type(pages) is not int:  # (the common case, one compare)
            n = _count_arg(pages)
            if n is None:
                raise ConfigError(f"reserve(pages={pages!r}) needs an integer >= 0 (a Python or numpy int; a bool is "
                                  "no count)")
            pages = n
        if pages < 0:
            raise ConfigError(f"reserve(pages={pages!r}) needs an integer >= 0")
        if type(ops) is not int or ops < 1:
            raise ConfigError(f"reserve(ops={ops!r}) needs an int >= 1")
        if pages:  # no page always fits (most decode steps open none)
            self._check_room(pages)
        return held_or_undone(self._claim, self._unclaim, pages, ops)  # every ring claims, or (a Ctrl-C) none

    def _claim(self, pages: int, ops: int) -> List[int]:
        heads = []
        for r in self._ring_set:  # claimed and numbered in one pass (`_next_op`'s numbering)
            heads.append(r.take(pages))
            r.op += ops
        return heads

    def _unclaim(self, heads: List[int], pages: int, ops: int) -> None:
        """`_claim` undone: the caller never got its heads."""
        for r in self._ring_set:
            r.head -= pages
            r.op -= ops

    def cancel_reserve(self, pages: int) -> bool:
        """Give back the pages of the last `reserve(pages, ...)` where its allocation never ran (a replay that raised
        before it, or whose launch failed): each ring's head moves back, unless one of the pages it claimed there is
        live (the allocation ran: the caller's undo frees those). The ops `reserve` numbered stay numbered (a gap in
        the numbers ranks errors as before; reusing a number that ran could not). Returns whether a head moved. Nothing
        else may have taken from the rings since that `reserve`. The error path only: it reads the device."""
        ran = [_claim_ran(r, pages) for r in self._ring_set] if pages else []
        with interrupts_held():  # every ring's head back, or none
            for r, done in zip(self._ring_set, ran):
                if not done:
                    r.head -= pages
        return not all(ran)

    @property
    def op_number(self) -> int:
        """The number of the last op numbered since the error record was last read (the record keeps the
        earliest op's error: a launch a graph captures reads its number from memory the host writes per replay)."""
        return self.pages.op

    def alloc_reserved(self, prefix: torch.Tensor, seq: torch.Tensor, last: torch.Tensor, out: torch.Tensor,
                       heads: Union[List[int], torch.Tensor], pages: int) -> None:
        """Slots for tokens [prefix, seq) of each request, from the pages `reserve` claimed, into `out` (token
        order). `heads`: reserve's list, or an int64 device tensor holding it (read when the kernel runs, so a
        captured step takes the heads the host writes before each replay) and, where it has 4 entries or more,
        the op's number at heads[3] (reserve's: `op_number` after it; else the host's now, which a captured launch
        would keep from its capture), and with 5 or more the pages claimed at heads[4] (else `pages`, reserve's
        count; heads on the device with no claim beside them go unchecked). A request with prefix == seq takes
        nothing (a graph bucket's padding). The caller planned its sizes; what the device finds is recorded there in
        every mode (raised by the next `check_integrity`/`available_size`), by the torch ops as by the kernels:
        `reserve` has claimed the pages, so nothing can be refused before a change here. A continuation whose page
        is not held (or has no SWA slot): ERR_CONT_RELEASED. Pages past the claim (lengths on the device that are
        not the host's) are not opened, their tokens take the padding slot and the first such request is recorded
        (ERR_CLAIM, a LocError); claimed pages the step does not open go back to the rings."""
        if isinstance(heads, torch.Tensor) and not self.allocates_in_graph:
            raise ConfigError("heads on the device need the device's page-op kernels: the torch ops take reserve's "
                              "host list (they size themselves from host values)")
        with interrupts_held():  # (the torch ops' several steps: counts, table rows and give-backs together)
            (self._ops or TORCH_OPS).alloc_extend(self.pages, self._swa, self._mapping, prefix, seq, last, out, pages,
                                                  heads, False)

    @property
    def allocates_step_in_one(self) -> bool:
        """Whether the device's page ops run a captured decode step's allocation in one launch (`alloc_step`)."""
        return getattr(self._ops, "alloc_step", None) is not None

    def alloc_step(self, ctl: torch.Tensor, rows_in: torch.Tensor, seq_in: torch.Tensor, pad_row: int,
                   req_to_token: torch.Tensor, rows: torch.Tensor, seq: torch.Tensor, out: torch.Tensor,
                   advance: bool = False, frontiers: Optional[torch.Tensor] = None, window: int = 0) -> bool:
        """A captured decode step's rows, slots and req_to_token write in one launch (`hwkv.step_graph`). For
        b < len(rows), live = b < ctl[2]: rows[b] = rows_in[b], seq[b] = seq_in[b] and token seq[b] - 1 gets a
        slot (a fresh page from `reserve`'s claim, ring heads ctl[0:2], where it opens one) into out[b] and
        req_to_token[rows[b], seq[b] - 1]; padded entries take pad_row, length 1 and slot 0. The caller planned it.
        `advance`: seq_in[b] becomes seq[b] + 1 for the live requests too (the next step's lengths: a host that
        sends nothing else new need not copy), where the kernel can (one program); returns whether it does.
        `frontiers` (int64, one per req_to_token row; hybrid pools) and `window`: then, in the same launch, the live
        rows' out-of-window release (`release_out_of_window_batch(..., by_row=True)` for the step's lengths), which
        frees only tokens no query of this step sees, so it may run before the step's layers; its errors rank as the
        op after the allocation's (`reserve`'s), as they do when the release runs apart. A `ctl` of 4 entries or
        more holds the allocation's op number at ctl[3] (`reserve(pages, ops=2)` numbered both; with `advance` the
        launch moves it on by the ops it ran), read when the launch runs; with 3, the host's, numbered here. One of 5
        or more holds the pages claimed at ctl[4], checked as `alloc_reserved` checks them."""
        if not self.allocates_step_in_one:
            raise ConfigError(f"alloc_step needs page-op kernels that have it; {self.device.type} has none")
        if frontiers is not None and (self._swa is None or not window or window <= 0):
            raise ConfigError(f"alloc_step releases out of window on a hybrid pool with a window > 0, got {window!r}")
        advanced = bool(self._ops.alloc_step(self.pages, self._swa, self._mapping, ctl, rows_in, seq_in, pad_row,
                                             req_to_token, rows, seq, out, advance, frontiers, int(window or 0)))
        if frontiers is not None and ctl.numel() < 4:  # the release: the op after the allocation's, as run apart
            self._next_op()
        return advanced

    def _check_continuations(self, prefix: Optional[torch.Tensor], seq: torch.Tensor, last: torch.Tensor,
                             plan: _Batch, decode: bool) -> None:
        """A request continuing a partial page (prefix % P != 0 and new tokens: `plan.cont`) takes last_loc + 1..,
        so last_loc must be the slot of its token prefix-1 on a page it holds: inside the pool's pages (slots
        [P, size + P)), at in-page offset (prefix - 1) % P, the page live and (hybrid) its SWA slots still mapped.
        Vectorised host checks (CPU views; a device read in debug mode), raised before anything changes."""
        cont = plan.cont
        if cont is None or (decode and plan.pages == plan.n):  # none continues (a decode: one page per request)
            return
        sel = cont if cont.dtype == np.bool_ else cont > 0
        if not (decode and plan.pages == 0):  # else every request continues: no selection
            if not np.count_nonzero(sel):
                return
        p = self.page_size
        last_h = _host_view(last)
        # token prefix-1's in-page offset, (prefix - 1) % P, as last_loc's: d % P == 0 for d below
        d = last_h - plan.pre + 1 if plan.seq is None else last_h - plan.seq + 2
        if not (decode and plan.pages == 0):
            last_h, d = last_h[sel], d[sel]
        # the common case in a few vectorised ops (count_nonzero: no ufunc reduction); hybrid: one clipped gather
        # of the table, whose padding page holds 0 and trailing entry -1, settles range and liveness (a mapped full
        # page is live); the failure path says which check failed
        ok = not np.count_nonzero(d % p)
        if ok and self._mapping is not None:
            ok = not np.count_nonzero(self._mapping_view().take(last_h, mode="clip") <= 0)
        elif ok:
            ok = not np.count_nonzero(last_h >= self.size + p) and \
                not np.count_nonzero(_refs_view(self.pages).take(last_h // p, mode="clip") < 1)  # page 0: NEVER
        if not ok:
            pre = plan.pre if plan.seq is None else plan.seq - 1
            self._refuse_continuation(last_h, pre if decode and plan.pages == 0 else pre[sel], np.flatnonzero(sel))

    def _refuse_continuation(self, last_h: np.ndarray, pre_h: np.ndarray, reqs: np.ndarray) -> None:
        """Raise the first failed check of `_check_continuations` (host arrays of the continuing requests reqs)."""
        p, name = self.page_size, self.pages.name
        page = last_h // p
        for i in np.flatnonzero((page < 1) | (page > self.num_pages))[:1]:
            raise LocError(f"last_loc {int(last_h[i])} (request {int(reqs[i])}) is outside the {name} pool's "
                           f"slots [{p}, {self.size + p})")
        for i in np.flatnonzero((last_h - pre_h + 1) % p)[:1]:
            l, t = int(last_h[i]), int(pre_h[i]) - 1
            raise LocError(f"last_loc {l} (request {int(reqs[i])}) is at in-page offset {l % p}; it must be token "
                           f"{t}'s slot, at offset {t % p} (page_size {p})")
        refs = _refs_view(self.pages)[page]
        live = refs >= 1 if self._mapping is None else self._mapping_view()[last_h] > 0
        for i in np.flatnonzero(~live)[:1]:
            what = f"last_loc {int(last_h[i])} (request {int(reqs[i])}) is on {name} page {int(page[i])}, which"
            if refs[i] < 1:
                raise NotAllocatedError(f"{what} is {'never allocated' if refs[i] == NEVER else 'free'}: a request "
                                        "continues only a page it holds")
            raise NotAllocatedError(f"{what} has no SWA slot (released or never allocated); release must keep a "
                                    "page of margin behind the last page")
        raise AssertionError("a continuation check failed without a reason")  # unreachable: the checks agree

    def _next_op(self) -> None:
        """Number the op about to run on every ring (orders the errors it may record)."""
        for r in self._rings():
            r.next_op()

    # ---- free -------------------------------------------------------------------------------------------
    def free(self, loc: torch.Tensor, with_swa: bool = True) -> None:
        """Drop one reference to each full page holding `loc` and, with `with_swa`, to its SWA page where
        it still has one (a holder passes False for pages its out-of-window release already dropped);
        pages reaching 0 go back. With False, a page whose last full reference goes while its SWA page is still
        held is refused (LocError before any change; deferred: recorded as ERR_SWA_HELD, the page skipped)."""
        if with_swa is not True and with_swa is not False:   # a truthy "no" would drop the SWA references
            check_flag("with_swa", with_swa)
        self._change(loc, -1, -1 if with_swa else 0)

    def share(self, loc: torch.Tensor, with_swa: bool = True, *, checked: bool = False) -> None:
        """Take one more reference to each live full page holding `loc` and, with `with_swa`, to its SWA
        page (which must be there): a cached prefix or a second request now holds them too. `checked`: the
        caller ran `check_share` over these pages (or more) since the last change, so it is not run again."""
        if with_swa is not True and with_swa is not False:
            check_flag("with_swa", with_swa)
        self._change(loc, 1, 1 if with_swa else 0, checked)

    def _change(self, loc: torch.Tensor, full_delta: int, swa_delta: int, checked: bool = False) -> None:
        loc = _check_loc_tensor(loc, self.device)
        if loc.numel() == 0:
            return
        pages = None
        if self.immediate and not checked:
            pages = self._check_free(loc, swa_required=swa_delta != 0 and full_delta >= 0 and self._swa is not None,
                                     sharing=full_delta > 0)
            if full_delta < 0 and not swa_delta and self._swa is not None:
                self._check_keeps_swa(loc, pages)
        with interrupts_held():  # the counts, the table rows and the pushes land together
            self._next_op()
            if self._on_host():
                self._change_on_host(loc, full_delta, swa_delta if self._swa is not None else 0, pages)
                return
            (self._ops or TORCH_OPS).change_refs(self.pages, self._swa, self._mapping, loc, full_delta,
                                                 swa_delta if self._swa is not None else 0)

    def _change_on_host(self, loc: torch.Tensor, full_delta: int, swa_delta: int,
                        fp: Optional[np.ndarray] = None) -> None:
        """`TorchPageOps.change_refs` applied through numpy views of the CPU tensors, after `_check_free` passed
        (every page in range and live): the same counts, table rows and pushes in the same ring order (each
        distinct page is represented by its last entry, as the torch op's scatter leaves it). fp: loc's pages
        where the check computed them."""
        p = self.page_size
        fp = _host_view(loc) // p if fp is None else fp
        pages = _last_of_runs(fp)  # a row's locs come in runs of one page: its last entry ends the run
        fp = pages if _distinct(pages) else fp[np.sort(fp.size - 1 - np.unique(fp[::-1], return_index=True)[1])]
        if full_delta:
            refs = self.pages.refs_np
            left = refs[fp] + full_delta
            refs[fp] = left
            if full_delta < 0:
                _push_on_host(self.pages, fp[left == 0])
        swa = self._swa
        if swa is None or not swa_delta:
            return
        mapping = self._mapping_view()
        sp = mapping[fp * p] // p
        srefs = swa.refs_np
        sel = (sp > 0) & (srefs[sp] >= 1)  # mapped: one SWA page per full page, so these are distinct too
        fp, sp = fp[sel], sp[sel]
        srefs[sp] += swa_delta
        if swa_delta > 0:
            return
        gone = srefs[sp] == 0
        mapping[(fp[gone, None] * p + np.arange(p)).reshape(-1)] = 0
        _push_on_host(swa, sp[gone])

    @property
    def shares_checkable(self) -> bool:
        """Whether `check_share(..., host_too=True)` checks: checks are immediate (CPU, HWKV_DEBUG=1), or the pool is
        on the CPU, where reading its counts waits for nothing (a prefix cache must not keep what a share refused)."""
        return self.immediate or self.device.type == "cpu"

    def check_share(self, loc: torch.Tensor, with_swa: bool = True, *, host_too: bool = False) -> None:
        """Raise what `share(loc, with_swa)` would refuse, changing nothing: for a share taken in several calls,
        checked whole before the first (CPU, HWKV_DEBUG=1; with deferred checks the device op records it, unless
        `host_too` and `shares_checkable`). A loc whose page is not live is named as such (NotAllocatedError `loc
        ... is not live`), where `share` itself still raises the free's DoubleFreeError."""
        loc = _check_loc_tensor(loc, self.device)
        if (self.shares_checkable if host_too else self.immediate) and loc.numel():
            self._check_free(loc, swa_required=with_swa and self._swa is not None, sharing=True, not_live=True)

    def _check_free(self, loc: torch.Tensor, swa_required: bool, sharing: bool = False,
                    not_live: bool = False) -> np.ndarray:
        """Raise what the device op would record, before anything changes (CPU, debug mode). `sharing`: a page
        whose SWA slots are gone cannot give them another holder (NotAllocatedError, not a double free).
        `not_live` (`check_share`, the prefix cache's checks before an insert or acquire): a page that is free or
        never allocated is a NotAllocatedError naming the loc, not the free's DoubleFreeError (a share frees
        nothing). Returns loc's pages (host array)."""
        full = self.pages
        loc_h = _host_view(loc)
        pages = loc_h // self.page_size  # repeats are harmless here
        if not pages.size:
            return pages
        # the common case in four reductions: every page in range and live (and mapped where required)
        if pages.min() >= 1 and pages.max() <= self.num_pages and _refs_view(full)[pages].min() >= 1 and (
                not swa_required or self._mapping_view()[pages * self.page_size].min() > 0):
            return pages
        out = (pages < 1) | (pages > self.num_pages)
        if out.any():
            raise LocError(f"page {int(pages[int(out.argmax())])} of a slot to free is outside "
                           f"[1, {self.num_pages}]")
        refs = _refs_view(full)[pages]
        for code, mask in ((ERR_NEVER, refs == NEVER), (ERR_DOUBLE_FREE, refs == 0)):
            if mask.any():
                i = int(mask.argmax())
                if not_live:
                    raise NotAllocatedError(f"loc {int(loc_h[i])} ({full.name} page {int(pages[i])}) is not live "
                                            f"({'never allocated' if code == ERR_NEVER else 'already free'}): only a "
                                            "page that is held can be shared")
                raise _err(code, int(pages[i]), self.page_size, full.name)
        if swa_required:
            gone = self._mapping_view()[pages * self.page_size] <= 0
            if gone.any():
                i = int(gone.argmax())
                if sharing:
                    raise NotAllocatedError(f"loc {int(loc_h[i])} (full page {int(pages[i])}) has no SWA "
                                            "slot (released): its SWA cannot be shared")
                raise _err(ERR_SWA_RELEASED, int(pages[i]), self.page_size, "full")
        return pages

    def _check_keeps_swa(self, loc: torch.Tensor, pages: np.ndarray) -> None:
        """A free that keeps the SWA references (`free(loc, with_swa=False)`) must not leave a mapped SWA page more
        holders than its full page (swa refs >= full refs before it): the last full free would leak the SWA page
        (held, mapped from a free full page). Raised before anything changes, naming the first such loc (immediate
        mode; the device ops record ERR_SWA_HELD and skip the page)."""
        p = self.page_size
        swa_loc = self._mapping_view()[pages * p]
        swa_refs = _refs_view(self._swa)[np.where(swa_loc > 0, swa_loc // p, 0)]
        full_refs = _refs_view(self.pages)[pages]
        held = (swa_loc > 0) & (swa_refs >= full_refs)
        if held.any():
            i = int(held.argmax())
            raise LocError(f"loc {int(_host_view(loc)[i])} ({self.pages.name} page {int(pages[i])}, "
                           f"{int(full_refs[i])} holders) would keep fewer full holders than its SWA slots still held "
                           f"(SWA page {int(swa_loc[i]) // p}, {int(swa_refs[i])} holders): free(with_swa=False) would "
                           "leak them; free it with with_swa=True, or free_swa first")

    def record_error(self, bad: torch.Tensor, which: torch.Tensor, code: int) -> None:
        """Record error `code` (`hwkv.pages.ERR_*`) for the lowest of which[bad] as an op of its own, on
        the device, no host sync: the next `available_size`/`check_integrity` raises it. For callers
        whose checks need device values (speculative accept) outside the allocator's own ops."""
        self._next_op()
        _record(self.pages, bad.reshape(-1), which.reshape(-1).to(I64), code, force=True)

    def check_integrity(self) -> None:
        """Free ring and reference counts agree; no page is free twice; no deferred error pending."""
        self.pages.check_integrity()

    def integrity_snapshot(self) -> dict:
        """Host copy of the whole state (tests: an error must leave it unchanged; `same_snapshot` compares)."""
        snap = {r.name: r.state() for r in self._rings()}
        if self._mapping is not None:
            snap["full->SWA"] = {"table": self._mapping.cpu().clone()}
        return snap


def _count_arg(x: object) -> Optional[int]:
    """A count the allocator's calls take (`alloc`, `reserve`) as an int: Python and numpy integers; None for a bool
    (True would count 1), a float, a string or a tensor (its value would be a device read)."""
    if type(x) is int:
        return x
    return None if isinstance(x, torch.Tensor) else as_int(x)


def same_snapshot(a: dict, b: dict) -> bool:
    """Two `integrity_snapshot()`s ({pool: {field: tensor or int}}) hold the same allocator state."""
    def t(x: object) -> torch.Tensor:
        return torch.as_tensor(x, device="cpu")

    return a.keys() == b.keys() and all(
        a[p].keys() == b[p].keys() and all(torch.equal(t(a[p][f]), t(b[p][f])) for f in a[p]) for p in a)


def _err(code: int, page: int, page_size: int, pool: str) -> Exception:
    from hwkv.pages import error_for
    return error_for(code, page, page_size, pool)


class TokenToKVPoolAllocator(PagedTokenToKVPoolAllocator):
    """Page size 1: every slot is its own page."""

    def __init__(self, size: int, device: Union[str, torch.device]) -> None:
        super().__init__(size, 1, device)


def _check_fits_pool(size: int, size_swa: int, page_size: int, kvcache: object) -> None:
    """The allocator's sizes are its pool's: the pool holds every slot it hands out, and its full->SWA table covers
    every slot the pool takes."""
    if kvcache is None:
        return
    for name, mine in (("size", size), ("size_swa", size_swa), ("page_size", page_size)):
        theirs = getattr(kvcache, name, None)
        if not isinstance(theirs, int):
            continue
        if mine != theirs:   # larger: writes past the pool; smaller: the pool checks locs its table does not hold
            raise ConfigError(f"allocator {name}={mine} is not its pool's {name}={theirs} "
                              f"({type(kvcache).__name__}); build both with the same sizes")


def _check_pool_device(device: torch.device, kvcache: object) -> None:
    """The allocator lives on its pool's device (type, and index where both name one): its full->SWA table becomes
    the pool's translation table."""
    theirs = getattr(kvcache, "device", None)
    if theirs is None:
        return
    theirs = torch.device(theirs)
    if device.type != theirs.type or (None not in (device.index, theirs.index) and device.index != theirs.index):
        raise ConfigError(f"allocator device={str(device)!r} is not its pool's device {theirs} "
                          f"({type(kvcache).__name__}): build both on one device (the allocator's "
                          "full_to_swa_index_mapping becomes the pool's translation table)")


class SWATokenToKVPoolAllocator(PagedTokenToKVPoolAllocator):
    """Allocates each token a full slot and an SWA slot (equal in-page offsets) and owns the table."""

    @normal_tensors
    def __init__(self, size: int, size_swa: int, page_size: int, device: Union[str, torch.device],
                 kvcache: object) -> None:
        if kvcache is not None and not callable(getattr(kvcache, "register_mapping", None)):
            raise ConfigError(f"kvcache must be a pool (SWAKVPool, or one with register_mapping) or None, got "
                              f"{type(kvcache).__name__}")
        _check_pool_device(check_device(device), kvcache)  # before its table replaces the pool's
        if all(map(is_int, (size, size_swa, page_size))):  # before any ring is made (else the constructor refuses)
            _check_fits_pool(size, size_swa, page_size, kvcache)
        super().__init__(size, page_size, device, "full")
        if not is_int(size_swa) or size_swa < 0 or size_swa % page_size:
            raise ConfigError(f"size_swa={size_swa} must be a non-negative multiple of page_size={page_size}")
        self.size_swa = size_swa
        self.swa_attn_allocator = PagedTokenToKVPoolAllocator(size_swa, page_size, device, "SWA")
        self._ring_set = (self.pages, self.swa_attn_allocator.pages)
        self.immediate = self.immediate  # the SWA ring follows this allocator's checking mode
        # one trailing -1 so that mapping[-1] == -1
        self.full_to_swa_index_mapping = torch.zeros(size + page_size + 1, dtype=I64, device=self.device)
        self.full_to_swa_index_mapping[-1] = -1
        if self.device.type == "cpu":
            self._map_src, self._map_np = self.full_to_swa_index_mapping, self.full_to_swa_index_mapping.numpy()
        self._kvcache = kvcache
        if kvcache is not None:
            if hasattr(kvcache, "_mapping_owner"):  # hwkv's pool: it refuses a second live allocator
                kvcache.register_mapping(self.full_to_swa_index_mapping, self)
            else:  # a pool of the caller's own, with the one-argument hook
                kvcache.register_mapping(self.full_to_swa_index_mapping)

    @property
    def full_attn_allocator(self) -> "SWATokenToKVPoolAllocator":
        """SGLang's name for the full half (this allocator; a property, not a reference to itself, so that an
        allocator dropped by its last holder goes at once and its pool can take another)."""
        return self

    @property
    def _swa(self) -> Optional[PageRing]:
        return self.swa_attn_allocator.pages

    @property
    def _mapping(self) -> Optional[torch.Tensor]:
        return self.full_to_swa_index_mapping

    def full_available_size(self) -> int:
        return PagedTokenToKVPoolAllocator.available_size(self)

    def holds_pages(self) -> bool:
        """Whether any full or SWA page is live (reads the device: not for a hot path)."""
        return any(r.free_pages() < r.num_pages for r in self._ring_set)

    def swa_available_size(self) -> int:
        self.pages.raise_pending()
        return self.swa_attn_allocator.available_size()

    def available_size(self) -> int:
        return min(self.full_available_size(), self.swa_available_size())

    def _clear(self) -> None:
        super()._clear()
        self.full_to_swa_index_mapping[:-1].zero_()

    def translate_loc_from_full_to_swa(self, loc: torch.Tensor) -> torch.Tensor:
        """SWA slots of full-pool locs (0: none; -1 for -1); loc checked as the pool's translation checks it."""
        check_loc("loc", loc, self.size + self.page_size, self.device, low=-1, ndim=None)
        return self.full_to_swa_index_mapping[loc]

    def free_swa(self, loc: torch.Tensor) -> None:
        """Drop the reference to the SWA slots of the (whole) full pages holding `loc`; the full slots stay."""
        self._change(loc, 0, -1)

    def check_integrity(self) -> None:
        """Both rings are sound; live full and SWA pages pair one to one through whole-page table rows."""
        self.pages.check_integrity()
        self.swa_attn_allocator.pages.check_integrity()
        p = self.page_size
        m = self.full_to_swa_index_mapping.cpu()
        assert int(m[-1]) == -1, "mapping[-1] must be -1"
        assert not m[:p].any(), "the padding page must map to 0"
        rows = m[:-1].view(-1, p)
        swa_page = rows[:, 0] // p
        mapped = rows[:, 0] > 0
        expect = swa_page[:, None] * p + torch.arange(p, device="cpu")
        assert torch.equal(rows[mapped], expect[mapped]), "a mapped full page does not map whole, offsets equal"
        assert not rows[~mapped].any(), "a full page maps only some of its slots"
        full_refs = self.pages.refs.cpu()
        swa_refs = self.swa_attn_allocator.pages.refs.cpu()
        assert (full_refs[mapped.nonzero().reshape(-1)] >= 1).all(), "a freed full page still maps"
        s = swa_page[mapped]
        assert s.numel() == torch.unique(s).numel(), "an SWA page is mapped from two full pages"
        assert (swa_refs[s] >= 1).all(), "a mapping points at a free SWA page"
        assert (swa_refs[s] <= full_refs[mapped.nonzero().reshape(-1)]).all(), \
            "an SWA page has more holders than its full page (a holder of S must hold F)"
        assert int((swa_refs[1:] >= 1).sum()) == s.numel(), "a live SWA page is mapped from no full page (leak)"


# ---- host helpers (numpy) shared with hwkv.release --------------------------------------------------
def _last_of_runs(a: np.ndarray) -> np.ndarray:
    """The last entry of each run of equal values in a (entry order): a's distinct values by their last entry
    whenever the result holds no value twice."""
    if a.size < 2:
        return a
    end = np.empty(a.size, dtype=bool)
    end[-1] = True
    np.not_equal(a[1:], a[:-1], out=end[:-1])
    return a[end]


def _distinct(a: np.ndarray) -> bool:
    """Whether a host array holds no value twice (`hwkv.checks.first_repeat`)."""
    return first_repeat(a) is None


def _push_on_host(ring: PageRing, pages: np.ndarray) -> None:
    """`_push` through numpy views (CPU): pages appended at the ring's tail, in order."""
    if not pages.size:
        return
    tail = ring._tail_host
    ring.ring_np[(int(tail[0]) + np.arange(pages.size)) % max(ring.num_pages, 1)] = pages
    tail[0] += pages.size


# Names that moved to their own modules, which import this one: kept here lazily (no import cycle).
_MOVED = {"release_out_of_window": "hwkv.release", "release_out_of_window_batch": "hwkv.release",
          "ReqToTokenPool": "hwkv.req_to_token"}


def __getattr__(name: str) -> object:
    if name in _MOVED:
        import importlib
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
