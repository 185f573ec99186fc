"""The torch implementation of the allocator's batched page ops (CPU; any device without registered kernels).

Its own module so that `hwkv.allocator`, `hwkv.release` and device kernels share one reference implementation.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from hwkv.pages import (ERR_CLAIM, ERR_CONT_RELEASED, ERR_DOUBLE_FREE, ERR_FRONTIER, ERR_NEVER, ERR_RANGE,
                        ERR_SWA_HELD, ERR_SWA_RELEASED, NEVER, PAGE_LO, PageRing, code_key, op_key)

I64 = torch.int64


def _record(ring: PageRing, bad: torch.Tensor, pages: torch.Tensor, code: int, force: bool = False) -> None:
    """Record the error of pages[bad] (`hwkv.pages.error_key`: this op, `code`, the lowest bad page) into
    ring.err, without a host sync. Deferred checks only (otherwise the allocator checked on the host
    before the op), unless `force`."""
    if not (ring.deferred or force) or pages.numel() == 0:
        return
    part = op_key(ring.op) + code_key(code)
    keys = part - pages.clamp(PAGE_LO, -PAGE_LO - 1)
    best = torch.where(bad, keys, 0).amax().reshape(1)
    torch.maximum(ring.err[:1], best, out=ring.err[:1])


def _bad_continuation(full: PageRing, mapping: Optional[torch.Tensor], nxt: torch.Tensor, pos: torch.Tensor,
                      p: int) -> torch.Tensor:
    """Deferred check of continuation slots nxt (last_loc + 1..) of tokens at positions pos: bad where the slot sits
    at another in-page offset than pos % p (last_loc was not token pos-1's slot), or, hybrid, has no SWA slot (page
    released, never allocated; a slot outside the table reads its padding 0 or trailing -1, not past its end), or,
    plain, lies on no page of the pool or on one that is not live."""
    off = torch.remainder(nxt - pos, p) != 0
    if mapping is not None:
        return (_g(mapping, nxt.clamp(0, mapping.numel() - 1)) <= 0) | off
    page = torch.div(nxt, p, rounding_mode="floor")
    n = full.num_pages
    return (page < 1) | (page > n) | (_g(full.refs, page.clamp(0, n)) < 1) | off


def _g(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t[idx] for 1-D t: index_select, ~20x faster than advanced indexing for large idx on a busy CPU."""
    return t.index_select(0, idx)


def _s(t: torch.Tensor, idx: torch.Tensor, v: torch.Tensor) -> None:
    """t[idx] = v for 1-D t; with repeated indices one value wins. scatter_ runs serially on CPU:
    index_put_ and advanced indexing open an OpenMP region that costs milliseconds on a busy CPU."""
    t.scatter_(0, idx, v)


def _owners(counts: torch.Tensor, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """For the n items that `counts` spreads over its entries: each item's entry and its index within it.

    Built from a cumsum of start marks: searchsorted and repeat_interleave run an OpenMP region per
    call even on a few hundred items, which costs milliseconds on a busy 2-core CPU.
    """
    starts = counts.cumsum(0) - counts
    mark = torch.zeros(n + 1, dtype=counts.dtype, device=counts.device)
    mark.index_add_(0, starts.clamp(max=n), torch.ones_like(starts))
    r = mark[:n].cumsum(0) - 1  # requests with no items share the next one's start and are skipped
    return r, torch.arange(n, device=counts.device) - _g(starts, r)


def _push(ring: PageRing, pages: torch.Tensor, mask: torch.Tensor) -> None:
    """Append pages[mask] to the ring's tail, in order."""
    n = ring.num_pages
    pos = ring.tail + mask.to(I64).cumsum(0) - 1
    _s(ring.ring, torch.where(mask, pos % max(n, 1), n), pages)
    ring.tail += mask.sum()


class TorchPageOps:
    """Batched allocator ops in plain torch: a constant number of ops per call, no per-request Python."""

    @staticmethod
    def alloc_extend(full: PageRing, swa: Optional[PageRing], mapping: Optional[torch.Tensor],
                     prefix: Optional[torch.Tensor], seq: torch.Tensor, last: torch.Tensor, out: torch.Tensor,
                     k: int, heads: List[int], decode: bool) -> None:
        p, dev, n = full.page_size, out.device, out.numel()
        if prefix is None:
            prefix = seq - 1
        ext = seq - prefix
        cont = torch.minimum(ext, torch.remainder(-prefix, p))
        newp = (ext - cont + p - 1) // p
        r, j = _owners(ext, n)
        is_cont = j < _g(cont, r)
        res = _g(last, r) + 1 + j
        pos = _g(prefix, r) + j  # each new token's position
        # the pages `reserve` claimed (k) against the op's need: a token on a page past the claim takes the padding
        # slot (recorded: ERR_CLAIM, the request); claimed pages the op does not open go back to the tail
        pidx = _g(newp.cumsum(0) - newp, r) + torch.div(j - _g(cont, r), p, rounding_mode="floor")
        short = ~is_cont & (pidx >= k)
        if k:
            idx = torch.arange(k, device=dev)
            fpages = _g(full.ring, (heads[0] + idx) % full.num_pages)
            res = torch.where(is_cont, res, torch.where(short, 0, _g(fpages, pidx.clamp(0, k - 1)) * p + pos % p))
            opened = idx < newp.sum()
            _s(full.refs, fpages, torch.where(opened, 1, _g(full.refs, fpages)))
            _push(full, fpages, ~opened)
            if swa is not None:
                spages = _g(swa.ring, (heads[1] + idx) % swa.num_pages)
                _s(swa.refs, spages, torch.where(opened, 1, _g(swa.refs, spages)))
                _push(swa, spages, ~opened)
                off = torch.arange(p, device=dev)
                at = (fpages[:, None] * p + off).reshape(-1)
                _s(mapping, at, torch.where(opened[:, None], spages[:, None] * p + off, _g(mapping, at).view(k, p))
                   .reshape(-1))
        else:
            res = torch.where(is_cont, res, 0)
        out.copy_(res)
        _record(full, short, r, ERR_CLAIM, force=True)
        # recorded in every mode, as the kernels do: `alloc_reserved` (a whole step) is checked nowhere else; an
        # eager alloc in immediate mode was checked on the host first, so nothing is recorded for it
        bad = is_cont & _bad_continuation(full, mapping, res, pos, p)
        _record(full, bad, torch.div(res, p, rounding_mode="floor"), ERR_CONT_RELEASED, force=True)

    @staticmethod
    def change_refs(full: PageRing, swa: Optional[PageRing], mapping: Optional[torch.Tensor], loc: torch.Tensor,
                    full_delta: int, swa_delta: int) -> None:
        """Add `full_delta` (-1, 0, +1) to the references of each distinct full page holding `loc` and
        `swa_delta` to its SWA page's; pages reaching 0 return to their ring (an SWA page is unmapped).
        A page must be live; its SWA page must be mapped unless a free (full_delta -1) skips it (one whose SWA
        page is gone is recorded, ERR_SWA_RELEASED, before anything changes, and changes nothing). A free that keeps
        the SWA page (swa_delta 0) must not leave a mapped SWA page more holders than its full page: that page is
        recorded (ERR_SWA_HELD) and skipped."""
        p, n_full = full.page_size, full.num_pages
        fp = torch.div(loc, p, rounding_mode="floor")
        inr = (fp >= 1) & (fp <= n_full)
        fp = torch.where(inr, fp, 0)
        i = torch.arange(fp.numel(), device=fp.device)
        _s(full.who, fp, i)  # one index per distinct page wins: that entry represents the page
        rep = inr & (_g(full.who, fp) == i)
        refs = _g(full.refs, fp)
        live = rep & (refs >= 1)
        if swa is not None and full_delta < 0 and not swa_delta:  # its SWA page would outlive its holders
            sl = _g(mapping, fp * p)
            sref = _g(swa.refs, torch.where(sl > 0, torch.div(sl, p, rounding_mode="floor"), 0))
            held = live & (sl > 0) & (sref > refs + full_delta)
            _record(full, held, fp, ERR_SWA_HELD)
            live = live & ~held
        if swa is not None and swa_delta and full_delta >= 0:  # the SWA page must be there: else nothing changes
            gone = live & (_g(mapping, fp * p) <= 0)
            _record(full, gone, fp, ERR_SWA_RELEASED)
            live = live & ~gone
        _record(full, ~inr, torch.div(loc, p, rounding_mode="floor"), ERR_RANGE)
        _record(full, rep & (refs == NEVER), fp, ERR_NEVER)
        _record(full, rep & (refs == 0), fp, ERR_DOUBLE_FREE)
        if full_delta:
            left = refs + full_delta
            _s(full.refs, torch.where(live, fp, 0), torch.where(live, left, NEVER).to(refs.dtype))
            if full_delta < 0:
                _push(full, fp, live & (left == 0))
        if swa is None or not swa_delta:
            return
        s = torch.div(_g(mapping, fp * p), p, rounding_mode="floor")
        _change_swa(full, swa, mapping, fp, s, live & (s > 0), swa_delta)

    @staticmethod
    def release_window(full: PageRing, swa: PageRing, mapping: torch.Tensor, req_to_token: torch.Tensor,
                       rows: torch.Tensor, seq: torch.Tensor, frontiers: torch.Tensor, window: int) -> None:
        p = full.page_size
        off = (frontiers < 0) | (torch.remainder(frontiers, p) != 0)  # recorded, and that row releases nothing
        _record(full, off, rows.to(I64), ERR_FRONTIER)
        dead = seq.to(I64) - window + 1
        aligned = torch.where(dead > 0, torch.div(dead, p, rounding_mode="floor") * p - p, 0)  # no wrap near 2**63
        new_f = torch.maximum(frontiers, aligned.clamp(min=0))
        new_f = torch.where(off, frontiers, new_f)
        cnt = torch.div(new_f - frontiers, p, rounding_mode="floor")
        total = int(cnt.sum())  # free on CPU; one host read on a device without release kernels
        if total:
            r, j = _owners(cnt, total)
            flat = _g(rows.to(I64), r) * req_to_token.stride(0) + (_g(frontiers, r) + j * p) * req_to_token.stride(1)
            loc = torch.take(req_to_token, flat) if req_to_token.is_contiguous() else \
                req_to_token[_g(rows.to(I64), r), _g(frontiers, r) + j * p]
            fp = torch.div(loc.to(I64), p, rounding_mode="floor")   # (an int32 table, SGLang's: int64 keys below)
            inr = (fp >= 1) & (fp <= full.num_pages)  # a corrupt entry: recorded as a bad loc to free is
            _record(full, ~inr, fp, ERR_RANGE)
            fp = torch.where(inr, fp, 0)
            s = torch.div(_g(mapping, fp * p), p, rounding_mode="floor")
            _record(full, inr & (s <= 0), fp, ERR_SWA_RELEASED)
            _change_swa(full, swa, mapping, fp, s, inr & (s > 0), -1)
        frontiers.copy_(new_f)


def _change_swa(full: PageRing, swa: PageRing, mapping: torch.Tensor, fp: torch.Tensor, s: torch.Tensor,
                sel: torch.Tensor, delta: int) -> None:
    """Add delta to the references of SWA pages s[sel] (of full pages fp), once per entry: a page may
    appear once per holder (a release batch of requests sharing a prefix). At 0 a page is unmapped
    and pushed, once. A drop with no holder left is recorded on the full ring as its full page's
    (ERR_SWA_RELEASED): where concurrent programs may see the row already unmapped, that is what
    they record too."""
    p = full.page_size
    s = torch.where(sel, s, 0)
    refs = _g(swa.refs, s)
    ok = sel & (refs >= 1)
    _record(full, sel & (refs < 1), fp, ERR_SWA_RELEASED)
    swa.refs.index_add_(0, torch.where(ok, s, 0), ok.to(I64) * delta)
    if delta > 0:
        return
    after = _g(swa.refs, s)
    over = ok & (after < 0)  # more drops than holders within one batch
    _record(full, over, fp, ERR_SWA_RELEASED)
    _s(swa.refs, torch.where(over, s, 0), torch.where(over, 0, NEVER))
    i = torch.arange(s.numel(), device=s.device)
    _s(swa.who, s, i)
    gone = ok & (_g(swa.who, s) == i) & (_g(swa.refs, s) == 0)
    _unmap(mapping, fp, gone, p)
    _push(swa, s, gone)


def _unmap(mapping: torch.Tensor, fp: torch.Tensor, gone: torch.Tensor, p: int) -> None:
    """Zero the table rows of full pages fp[gone] (each listed once). On the host only those rows are
    touched (P entries per page, not per entry of fp: a free of n locs costs O(n + P x pages)); other
    devices keep a static size, P per entry, since counting the pages would be a host sync."""
    if fp.device.type == "cpu":
        fp = _g(fp, gone.nonzero().reshape(-1))
    else:
        fp = torch.where(gone, fp, 0)  # page 0's row is the padding row: zero already
    rows = (fp[:, None] * p + torch.arange(p, device=fp.device)).reshape(-1)
    _s(mapping, rows, torch.zeros_like(rows))


TORCH_OPS = TorchPageOps()
