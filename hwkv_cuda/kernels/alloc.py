"""The allocator's batched ops as Triton kernels: one launch each for alloc, free and release.

They implement `hwkv.torch_page_ops.TorchPageOps` on the same device state (`hwkv.pages.PageRing`:
free-page ring, reference counts, error record) without any host sync:
- alloc: grid (request,); each program sums the new tokens and pages of the requests before
  it, writes its tokens' slots (continuing its partial page, then fresh pages popped at the
  ring head the host passes in), marks its new pages live and maps full page -> SWA page whole.
- change_refs (free, free_swa, share): one program (pages can repeat within `loc`; a first pass
  picks one entry per page), adding -1/0/+1 to each page's full and SWA references (a free that keeps the SWA
  references skips, and records, a page whose last full reference it would drop while its SWA page is held).
- release: grid (request,); each program frees the SWA pages between its frontier and the new
  one, pushes them with an atomic add on the ring's tail, and moves its frontier (one per request,
  or, `by_row`, the request's row's entry of a table with one per req_to_token row).
- alloc_step: a captured decode step's rows, its one new slot per request and the req_to_token write,
  from the staged block, in one launch (grid: blocks of requests; each counts the pages earlier
  blocks open itself); its release's errors are keyed as the op after the allocation's.
A launch a graph captures (heads on the device) reads its op number from device memory too, where the caller
stages it beside the heads (`ctl[3]`): an argument would stay the capture's in every replay, and the record's
order (the earliest op since the last check) would rank a replay's error as the capture's op.
Bad pages are skipped and recorded in the full ring's `err` with an atomic max of their error keys
(`hwkv.pages.error_key`), so the record is the torch ops' whatever order the programs run in.
Index tensors are made contiguous here (the kernels read them with unit stride); req_to_token is
read through both its strides, except by alloc_step, which checks that its rows are contiguous.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import triton
import triton.language as tl

from hwkv import pages
from hwkv.errors import LocError
from hwkv.pages import PageRing
from hwkv.torch_page_ops import TORCH_OPS
from hwkv_cuda.kernels.common import interpreting, request_block
from hwkv_cuda.kernels.launch import Launch, launch

# the error codes, as constants a jit'ed function may read
ERR_CONT_RELEASED = tl.constexpr(pages.ERR_CONT_RELEASED)
ERR_DOUBLE_FREE = tl.constexpr(pages.ERR_DOUBLE_FREE)
ERR_NEVER = tl.constexpr(pages.ERR_NEVER)
ERR_RANGE = tl.constexpr(pages.ERR_RANGE)
ERR_SWA_RELEASED = tl.constexpr(pages.ERR_SWA_RELEASED)
ERR_SWA_HELD = tl.constexpr(pages.ERR_SWA_HELD)
CODE_SHIFT = tl.constexpr(pages.CODE_SHIFT)
CODE_TOP = tl.constexpr(pages.CODE_TOP)
ERR_CLAIM = tl.constexpr(pages.ERR_CLAIM)
ERR_FRONTIER = tl.constexpr(pages.ERR_FRONTIER)
PAGE_LO = tl.constexpr(pages.PAGE_LO)
PAGE_HI = tl.constexpr(-pages.PAGE_LO - 1)
KEY_BASE = tl.constexpr(pages.PAGE_MASK + pages.PAGE_LO)
OP_MAX = tl.constexpr(pages.OP_MAX)
OP_SHIFT = tl.constexpr(pages.OP_SHIFT)


@triton.jit
def _op_key(opk, op_at, delta: tl.constexpr, OP_PTR: tl.constexpr):
    """The op part of a launch's error keys: the host's `opk`, or (OP_PTR) `pages.op_key` of the op number at
    op_at plus delta, read when the kernel runs (a captured launch: the number the host staged for the replay)."""
    key = opk.to(tl.int64)
    if OP_PTR:
        op = tl.load(op_at).to(tl.int64) + delta
        key = (OP_MAX - tl.minimum(op, OP_MAX)) << OP_SHIFT
    return key


@triton.jit
def _record(err, bad, pages, code: tl.constexpr, opk):
    """Error key of this op (`opk`), `code` and the lowest bad page, atomically maxed into err[0]."""
    if tl.sum(bad.to(tl.int32), 0) > 0:
        lo = tl.full([], PAGE_LO, tl.int64)  # int64 constants: a literal in [2^31, 2^32) would be uint32
        hi = tl.full([], PAGE_HI, tl.int64)
        page = tl.minimum(tl.maximum(pages.to(tl.int64), lo), hi)
        key = opk.to(tl.int64) + tl.full([], ((CODE_TOP - code) << CODE_SHIFT) + KEY_BASE, tl.int64) - page
        tl.atomic_max(err, tl.max(tl.where(bad, key, 0), 0))


@triton.jit
def _floor_div(x, P: tl.constexpr):
    """x // P rounded down like torch's floor division (Triton's integer division truncates)."""
    return tl.where(x >= 0, x // P, -((P - 1 - x) // P))


@triton.jit
def _lens(seq, prefix, r, m, P: tl.constexpr, DECODE: tl.constexpr):
    """New tokens, tokens continuing the partial last page, and new pages of requests r."""
    s = tl.load(seq + r, mask=m, other=0).to(tl.int64)
    if DECODE:
        pre = tl.where(m, s - 1, 0)
    else:
        pre = tl.load(prefix + r, mask=m, other=0).to(tl.int64)
    e = s - pre
    c = tl.minimum(e, (P - pre % P) % P)
    return pre, e, c, (e - c + P - 1) // P


@triton.jit
def _parts(buf, n):
    """A PageRing's one buffer: ring [n + 1] | refs [n + 1] | tail [1] | err [2]."""
    return buf, buf + n + 1, buf + 2 * n + 2, buf + 2 * n + 3


@triton.jit
def _open_pages(buf_f, n_full, buf_s, n_swa, mapping, head_f, head_s, pidx, m, P: tl.constexpr,
                HYBRID: tl.constexpr, BLOCK_P: tl.constexpr):
    """This op's pages pidx[m], popped at the rings' heads: live (reference 1) and, hybrid, full page F mapped whole
    onto its SWA page S (slot F*P+o -> S*P+o, BLOCK_P slots at a time). Returns the full pages."""
    ring_f, refs_f, tail_f, err_f = _parts(buf_f, n_full)
    fp = tl.load(ring_f + (head_f + pidx) % tl.maximum(n_full, 1), mask=m, other=0)
    tl.store(refs_f + fp, fp * 0 + 1, mask=m)
    if HYBRID:
        ring_s, refs_s, tail_s, err_s = _parts(buf_s, n_swa)
        sp = tl.load(ring_s + (head_s + pidx) % tl.maximum(n_swa, 1), mask=m, other=0)
        tl.store(refs_s + sp, sp * 0 + 1, mask=m)
        for o0 in range(0, P, BLOCK_P):
            o = o0 + tl.arange(0, BLOCK_P)
            tl.store(mapping + fp[:, None] * P + o[None, :], sp[:, None] * P + o[None, :],
                     mask=m[:, None] & (o[None, :] < P))
    return fp


@triton.jit
def _check_continuation(err, mapping, refs_f, nxt, pos, m, opk, n_full, P: tl.constexpr, HYBRID: tl.constexpr):
    """A request continuing its partial page at slot nxt[m] (its token at position pos) must hold that page (hybrid:
    still own its SWA slots), and nxt must sit at pos's in-page offset (last_loc was token pos-1's slot): recorded
    if not. Reads are clamped to the table / the pages (a slot outside reads the padding or the trailing entry)."""
    if HYBRID:
        bad = tl.load(mapping + tl.minimum(tl.maximum(nxt, 0), (n_full + 1) * P), mask=m, other=1) <= 0
    else:
        page = _floor_div(nxt, P)
        refs = tl.load(refs_f + tl.minimum(tl.maximum(page, 0), n_full), mask=m, other=1)
        bad = (page < 1) | (page > n_full) | (refs < 1)
    _record(err, m & (bad | ((nxt - pos) % P != 0)), _floor_div(nxt, P), ERR_CONT_RELEASED, opk)


@triton.jit
def _return_unopened(buf, n, head, used, claim, BLOCK: tl.constexpr):
    """Pages claimed at a ring's head past the `used` this op opened go back to its tail, in order (a claim larger
    than the step's need: they are free), at entries reserved atomically (a release in the same launch pushes to the
    tail too). The destinations never lie after their sources (the ring holds at most n entries), so ascending
    blocks, each read whole before it is written, are safe."""
    ring, refs, tail, err = _parts(buf, n)
    mod = tl.maximum(n, 1)
    t = tl.atomic_add(tail, claim - used, sem="acq_rel")  # the entries reserved: a release in the launch pushes too
    for i0 in range(0, claim - used, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        m = i < claim - used
        pg = tl.load(ring + (head + used + i) % mod, mask=m, other=0)
        tl.debug_barrier()  # every lane has read its entry before any writes one it may overlap (a shift < BLOCK)
        tl.store(ring + (t + i) % mod, pg, mask=m)


@triton.jit
def _give_back(err, buf_f, n_full, buf_s, n_swa, head_f, head_s, used, claim, HYBRID: tl.constexpr,
               BLOCK: tl.constexpr):
    """Claimed pages past the `used` the whole op opened go back to the rings' tails, by the program that arrives
    last (err[1], spare in the error record, counts the arrivals and is put back to 0): every other program has read
    its ring entries by then, and the tail's new entries may lie where those were (a ring nearly all free). Every
    program of the launch calls this with the same `used` and `claim`."""
    if used < claim:
        if tl.atomic_add(err + 1, 1, sem="acq_rel") == tl.num_programs(0) - 1:
            tl.debug_barrier()  # (and this program's own warps have read theirs)
            _return_unopened(buf_f, n_full, head_f, used, claim, BLOCK)
            if HYBRID:
                _return_unopened(buf_s, n_swa, head_s, used, claim, BLOCK)
            tl.store(err + 1, 0)


@triton.jit
def _give_back_all_kernel(heads, buf_f, n_full, buf_s, n_swa, HYBRID: tl.constexpr, BLOCK: tl.constexpr):
    """An op of no request with its heads and claim on the device (heads[0:2], heads[4]): every claimed page goes
    back (one program)."""
    claim = tl.load(heads + 4).to(tl.int64)
    if claim > 0:
        _return_unopened(buf_f, n_full, tl.load(heads).to(tl.int64), 0, claim, BLOCK)
        if HYBRID:
            _return_unopened(buf_s, n_swa, tl.load(heads + 1).to(tl.int64), 0, claim, BLOCK)
        tl.store(heads + 4, 0)  # given back once (a replay with nothing restaged claims none)


@triton.jit(do_not_specialize=["head_f", "head_s", "opk", "claim"])
def _alloc_kernel(seq, prefix, last, out, buf_f, head_f, n_full, buf_s, head_s, n_swa, mapping, opk, heads, claim,
                  P: tl.constexpr, HYBRID: tl.constexpr, DECODE: tl.constexpr, HEADS_PTR: tl.constexpr,
                  OP_PTR: tl.constexpr, CLAIM_PTR: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr,
                  BLOCK: tl.constexpr):
    if HEADS_PTR:  # the ring heads from device memory (a captured step: the host writes them before a replay)
        head_f = tl.load(heads).to(tl.int64)
        head_s = tl.load(heads + 1).to(tl.int64)
    opk = _op_key(opk, heads + 3, 0, OP_PTR)  # and the op number beside them, at heads[3]
    if CLAIM_PTR:  # and the pages `reserve` claimed, at heads[4]
        claim = tl.load(heads + 4).to(tl.int64)
    claim = claim.to(tl.int64)
    lim = tl.where(claim < 0, tl.full([], 1 << 62, tl.int64), claim)  # pages this op may open (-1: unchecked)
    ring_f, refs_f, tail_f, err = _parts(buf_f, n_full)
    mod_f = tl.maximum(n_full, 1)
    b = tl.program_id(0)
    tok_base = tl.zeros([], tl.int64)
    page_base = tl.zeros([], tl.int64)
    used = tl.zeros([], tl.int64)  # the whole op's pages (a claim's check reads every request; else those before b)
    for start in range(0, tl.where(claim >= 0, tl.num_programs(0), b), BLOCK_B):
        r = start + tl.arange(0, BLOCK_B)
        m = r < b
        pre_r, e_r, c_r, npg_r = _lens(seq, prefix, r, r < tl.num_programs(0), P, DECODE)
        tok_base += tl.sum(tl.where(m, e_r, 0), 0)
        page_base += tl.sum(tl.where(m, npg_r, 0), 0)
        used += tl.sum(tl.where(r < tl.num_programs(0), npg_r, 0), 0)
    one = tl.arange(0, 1)
    pre, e, c, npg = _lens(seq, prefix, b + one, one < 1, P, DECODE)
    pre, e, c, npg = tl.sum(pre, 0), tl.sum(e, 0), tl.sum(c, 0), tl.sum(npg, 0)
    last_b = tl.load(last + b).to(tl.int64)
    for j0 in range(0, e, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        m = j < e
        is_cont = j < c
        pidx = page_base + tl.where(is_cont, 0, (j - c) // P)
        fresh = ~is_cont & (pidx < lim)  # a page past the claim is not this op's: the padding slot
        page = tl.load(ring_f + (head_f + pidx) % mod_f, mask=m & fresh, other=0)
        loc = tl.where(is_cont, last_b + 1 + j, tl.where(fresh, page * P + (pre + j) % P, 0))
        tl.store(out + tok_base + j, loc, mask=m)
    for i0 in range(0, npg, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        _open_pages(buf_f, n_full, buf_s, n_swa, mapping, head_f, head_s, page_base + i,
                    (i < npg) & (page_base + i < lim), P, HYBRID, BLOCK_P)
    if c > 0:
        _check_continuation(err, mapping, refs_f, last_b + 1 + one, pre + one, one < 1, opk, n_full, P, HYBRID)
    if claim >= 0:  # (-1: heads on the device with no claim beside them, unchecked)
        if (npg > 0) & (page_base + npg > claim):  # the caller sized the claim short: its pages past it not opened
            _record(err, one < 1, b + one.to(tl.int64), ERR_CLAIM, opk)
        _give_back(err, buf_f, n_full, buf_s, n_swa, head_f, head_s, used, claim, HYBRID, BLOCK)


@triton.jit(do_not_specialize=["pad_row", "bs", "opk", "opk_release"])
def _alloc_step_kernel(ctl, rows_in, seq_in, stride_in, pad_row, rtt, stride_rtt, rows, seq, out, buf_f, n_full,
                       buf_s, n_swa, mapping, opk, opk_release, bs, frontiers, window, P: tl.constexpr,
                       HYBRID: tl.constexpr, BLOCK_P: tl.constexpr, ADVANCE: tl.constexpr, RELEASE: tl.constexpr,
                       OP_PTR: tl.constexpr, CLAIM_PTR: tl.constexpr, BLOCK: tl.constexpr):
    """`alloc_step`: program k takes requests [k * BLOCK, (k + 1) * BLOCK) and counts the pages the live requests
    before them open from the staged lengths itself (decode: a step opens a page where its prefix is 0 mod P).
    ADVANCE (one program only: others read the lengths it would move): the staged lengths become the next step's.
    RELEASE: then each live request's out-of-window release by its row's frontier (`_release_kernel`'s rule), its
    errors keyed as the next op's (`opk_release`), as when the release runs apart.
    OP_PTR: the op number is ctl[3] (the release's ctl[3] + 1), and ADVANCE moves it on to the next step's too.
    CLAIM_PTR: the pages `reserve` claimed are ctl[4] (`_alloc_kernel`'s rule: none opened past it, the rest given
    back); ADVANCE leaves 0 there (the staged step it leaves opens no page)."""
    head_f = tl.load(ctl).to(tl.int64)
    head_s = tl.load(ctl + 1).to(tl.int64)
    n_live = tl.load(ctl + 2).to(tl.int64)
    claim = tl.full([], -1, tl.int64)
    if CLAIM_PTR:
        claim = tl.load(ctl + 4).to(tl.int64)
    opk = _op_key(opk, ctl + 3, 0, OP_PTR)
    opk_release = _op_key(opk_release, ctl + 3, 1, OP_PTR)
    if OP_PTR and ADVANCE:  # (one program: every warp has read ctl[3] once past the barrier)
        op = tl.load(ctl + 3)
        tl.debug_barrier()
        if RELEASE:
            tl.store(ctl + 3, op + 2)
        else:
            tl.store(ctl + 3, op + 1)
        if CLAIM_PTR:  # a next step the host does not stage opens no page: it claims none
            tl.store(ctl + 4, 0)
    ring_f, refs_f, tail_f, err = _parts(buf_f, n_full)
    first = tl.program_id(0).to(tl.int64) * BLOCK
    base = tl.zeros([], tl.int64)
    total = tl.zeros([], tl.int64)  # the whole step's pages (a claim's check reads every live lane)
    for start in range(0, tl.where(claim >= 0, bs, first), BLOCK):  # pages the live requests of earlier programs open
        i = start + tl.arange(0, BLOCK)
        m = (i < n_live) & (i < bs)  # (live: below ctl[2] and the batch)
        s = tl.load(seq_in + i * stride_in, mask=m, other=1).to(tl.int64)
        opening = m & ((s - 1) % P == 0)
        base += tl.sum(tl.where(opening & (i < first), 1, 0), 0)
        total += tl.sum(tl.where(opening, 1, 0), 0)
    i = first + tl.arange(0, BLOCK)
    m = i < bs
    live = m & (i < n_live)
    # the staged block is the bucket's width: its pairs load beside the control words (a padded lane's are stale and
    # replaced), and each row's frontier beside its last slot, before any store: fewer dependent loads in a row
    r = tl.where(live, tl.load(rows_in + i * stride_in, mask=m, other=0).to(tl.int64), pad_row)
    s = tl.where(live, tl.load(seq_in + i * stride_in, mask=m, other=1).to(tl.int64), 1)
    pre = s - 1  # a live request's new token; a padded one takes nothing (its prefix is its length)
    opens = live & (pre % P == 0)
    cont = live & ~opens
    pidx = base + tl.cumsum(opens.to(tl.int64), 0) - opens.to(tl.int64)
    short = opens & (pidx >= tl.where(claim < 0, tl.full([], 1 << 62, tl.int64), claim))  # past the claim: not
    # opened, the padding slot
    opens = opens & ~short
    last = tl.load(rtt + r * stride_rtt + tl.maximum(pre - 1, 0), mask=cont, other=0).to(tl.int64)
    if RELEASE:
        f = tl.load(frontiers + r, mask=m, other=0)  # a padded lane's too: its pad row's frontier is checked as the
        # release of the three launches checks it (it releases nothing either way)
    fp = _open_pages(buf_f, n_full, buf_s, n_swa, mapping, head_f, head_s, pidx, opens, P, HYBRID, BLOCK_P)
    loc = tl.where(opens, fp * P, tl.where(cont, last + 1, 0))
    _check_continuation(err, mapping, refs_f, last + 1, pre, cont, opk, n_full, P, HYBRID)
    if claim >= 0:
        _record(err, short, i, ERR_CLAIM, opk)
        _give_back(err, buf_f, n_full, buf_s, n_swa, head_f, head_s, total, claim, HYBRID, BLOCK)
    tl.store(rows + i, r, mask=m)
    tl.store(seq + i, s, mask=m)
    tl.store(out + i, loc, mask=m)
    if ADVANCE:
        tl.store(seq_in + i * stride_in, s + 1, mask=live)
    tl.store(rtt + r * stride_rtt + s - 1, loc.to(rtt.dtype.element_ty), mask=m)
    if RELEASE:  # pages below the new frontiers: no query of this step or a later one sees them
        off = m & ((f < 0) | (f % P != 0))  # recorded, and that row releases nothing (its frontier stays)
        _record(err, off, r, ERR_FRONTIER, opk_release)
        nf = tl.where(off, f, _frontier(f, s, window, P))
        cnt = tl.where(live, (nf - f) // P, 0)
        for j in range(0, tl.max(cnt, 0)):
            act = j < cnt
            l = tl.load(rtt + r * stride_rtt + f + j * P, mask=act, other=0)
            _release_pages(err, buf_s, n_swa, mapping, _floor_div(l, P), act, opk_release, n_full, P)
        tl.store(frontiers + r, nf, mask=live)


@triton.jit
def _change_swa(err_f, buf_s, n_swa, mapping, fp, sp, sel, opk, DELTA: tl.constexpr, P: tl.constexpr):
    """Add DELTA to the references of SWA pages sp[sel]; at zero unmap full page fp and push sp. A drop
    with no holder left is recorded as full page fp's ERR_SWA_RELEASED (what a program that reads the
    row after another unmapped it records too, so the record does not depend on their order)."""
    ring_s, refs_s, tail_s, err_s = _parts(buf_s, n_swa)
    # atomics: a page may appear in several lanes or programs (holders sharing it); the lane that
    # takes it to zero pushes it, once
    srefs = tl.atomic_add(refs_s + sp, sp * 0 + DELTA, mask=sel)
    ok = sel & (srefs >= 1) & (srefs + DELTA >= 0)
    bad = sel & ~ok
    _record(err_f, bad, fp, ERR_SWA_RELEASED, opk)
    tl.atomic_add(refs_s + sp, sp * 0 - DELTA, mask=bad)  # undo what a bad lane added
    if DELTA < 0:
        gone = ok & (srefs + DELTA == 0)
        for o in range(0, P):
            tl.store(mapping + fp * P + o, fp * 0, mask=gone)
        k = tl.sum(gone.to(tl.int64), 0)
        if k > 0:
            base = tl.atomic_add(tail_s, k)
            pos = base + tl.cumsum(gone.to(tl.int64), 0) - 1
            tl.store(ring_s + pos % tl.maximum(n_swa, 1), sp, mask=gone)


@triton.jit(do_not_specialize=["n", "opk"])
def _refs_kernel(loc, n, buf_f, n_full, buf_s, n_swa, mapping, who, opk, P: tl.constexpr, HYBRID: tl.constexpr,
                 FULL_DELTA: tl.constexpr, SWA_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    ring_f, refs_f, tail_f, err_f = _parts(buf_f, n_full)
    for i0 in range(0, n, BLOCK):  # pass 1: one entry per distinct page wins `who`
        i = i0 + tl.arange(0, BLOCK)
        m = i < n
        l = tl.load(loc + i, mask=m, other=0)
        fp = l // P
        inr = m & (l >= 0) & (fp >= 1) & (fp <= n_full)
        tl.store(who + fp, i.to(tl.int64), mask=inr)
    tl.debug_barrier()
    for i0 in range(0, n, BLOCK):  # pass 2: the winners change their page's references
        i = i0 + tl.arange(0, BLOCK)
        m = i < n
        l = tl.load(loc + i, mask=m, other=0)
        fp = l // P
        inr = m & (l >= 0) & (fp >= 1) & (fp <= n_full)
        _record(err_f, m & ~inr, _floor_div(l, P), ERR_RANGE, opk)
        rep = inr & (tl.load(who + fp, mask=inr, other=-1) == i)
        refs = tl.load(refs_f + fp, mask=rep, other=0)
        live = rep & (refs >= 1)
        _record(err_f, rep & (refs == -1), fp, ERR_NEVER, opk)
        _record(err_f, rep & (refs == 0), fp, ERR_DOUBLE_FREE, opk)
        if HYBRID:
            if FULL_DELTA < 0 and SWA_DELTA == 0:  # a mapped SWA page left more holders than its full page
                ring_s, refs_s, tail_s, err_s = _parts(buf_s, n_swa)
                sl = tl.load(mapping + fp * P, mask=live, other=0)
                srefs = tl.load(refs_s + tl.where(sl > 0, sl // P, 0), mask=live & (sl > 0), other=0)
                held = live & (sl > 0) & (srefs > refs + FULL_DELTA)
                _record(err_f, held, fp, ERR_SWA_HELD, opk)
                live = live & ~held
            if FULL_DELTA >= 0 and SWA_DELTA != 0:  # the SWA page must be there: else nothing changes
                gone = live & (tl.load(mapping + fp * P, mask=live, other=0) <= 0)
                _record(err_f, gone, fp, ERR_SWA_RELEASED, opk)
                live = live & ~gone
        if FULL_DELTA != 0:
            tl.store(refs_f + fp, refs + FULL_DELTA, mask=live)
            if FULL_DELTA < 0:
                gone = live & (refs + FULL_DELTA == 0)
                k = tl.sum(gone.to(tl.int64), 0)
                if k > 0:
                    base = tl.atomic_add(tail_f, k)
                    pos = base + tl.cumsum(gone.to(tl.int64), 0) - 1
                    tl.store(ring_f + pos % tl.maximum(n_full, 1), fp, mask=gone)
        if HYBRID:
            if SWA_DELTA != 0:
                sp = tl.load(mapping + fp * P, mask=live, other=0) // P
                _change_swa(err_f, buf_s, n_swa, mapping, fp, sp, live & (sp > 0), opk, SWA_DELTA, P)


@triton.jit
def _frontier(f, seq, window, P: tl.constexpr):
    """A request's new frontier after a step to `seq` tokens: page-aligned, one page behind the first dead token."""
    dead = seq.to(tl.int64) - window + 1
    aligned = tl.where(dead > 0, (dead // P) * P - P, 0)
    return tl.maximum(f, tl.maximum(aligned, 0))


@triton.jit
def _release_pages(err_f, buf_s, n_swa, mapping, fp, act, opk, n_full, P: tl.constexpr):
    """Drop full pages fp[act]'s SWA pages (recorded where one is gone already); a page outside [1, n_full] (a
    corrupt req_to_token entry) is recorded (ERR_RANGE) and skipped, its table read clamped."""
    inr = (fp >= 1) & (fp <= n_full)
    _record(err_f, act & ~inr, fp, ERR_RANGE, opk)
    act = act & inr
    fp = tl.where(inr, fp, 0)
    sp = tl.load(mapping + fp * P, mask=act, other=0) // P
    _record(err_f, act & (sp <= 0), fp, ERR_SWA_RELEASED, opk)
    _change_swa(err_f, buf_s, n_swa, mapping, fp, sp, act & (sp > 0), opk, -1, P)


@triton.jit(do_not_specialize=["opk"])
def _release_kernel(rtt, stride_row, stride_pos, rows, seq, frontiers, window, buf_f, n_full, buf_s, n_swa,
                    mapping, opk, op_word, P: tl.constexpr, BY_ROW: tl.constexpr, OP_PTR: tl.constexpr,
                    BLOCK: tl.constexpr):
    ring_f, refs_f, tail_f, err_f = _parts(buf_f, n_full)
    opk = _op_key(opk, op_word, 1, OP_PTR)  # OP_PTR: numbered as the op after the one op_word holds
    b = tl.program_id(0)
    row = tl.load(rows + b).to(tl.int64)
    at = frontiers + row if BY_ROW else frontiers + b  # BY_ROW: one frontier per req_to_token row
    f = tl.load(at)
    off = (f < 0) | (f % P != 0)  # recorded, and that row releases nothing (its frontier stays)
    one = tl.arange(0, 1)
    _record(err_f, off & (one == 0), row + one, ERR_FRONTIER, opk)
    nf = tl.where(off, f, _frontier(f, tl.load(seq + b), window, P))
    cnt = (nf - f) // P
    for i0 in range(0, cnt, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        act = i < cnt
        l = tl.load(rtt + row * stride_row + (f + i * P) * stride_pos, mask=act, other=0)
        _release_pages(err_f, buf_s, n_swa, mapping, _floor_div(l, P), act, opk, n_full, P)
    tl.store(at, nf)


def _block(n_gpu: int) -> int:
    return 16 if interpreting() else n_gpu


def _page_block(p: int) -> int:
    """Slots of a page mapped per pass (`_open_pages`): a whole page up to 16."""
    return min(16, triton.next_power_of_2(p))


def _host_op_key(full: PageRing, op_ptr: bool, after: int = 0) -> int:
    """The op key argument: the host's op number (plus `after`), or 0 where the kernel reads it from memory (a
    captured launch's arguments stay the capture's: nothing there may change from one replay to the next)."""
    return 0 if op_ptr else pages.op_key(full.op + after)


_LAUNCHES: Dict[Tuple, Launch] = {}  # planned launches of the page ops, by kernel, batch and geometry


def _give_back_all(full: PageRing, swa: Optional[PageRing], heads: torch.Tensor) -> None:
    """`_give_back_all_kernel`: the claim staged at heads[4] for an op of no request goes back to the rings."""
    hybrid = swa is not None
    s = swa if hybrid else full
    launch(_LAUNCHES, ("give back", hybrid), _give_back_all_kernel, (1,),
           (heads, full.buf, full.num_pages, s.buf, s.num_pages),
           dict(HYBRID=hybrid, BLOCK=_block(1024), num_warps=1 if interpreting() else 4))


class TritonPageOps:
    """hwkv.allocator's batched ops, one launch each (registered for cuda, musa, rocm and xpu)."""

    @staticmethod
    def alloc_extend(full: PageRing, swa: Optional[PageRing], mapping: Optional[torch.Tensor],
                     prefix: Optional[torch.Tensor], seq: torch.Tensor, last: torch.Tensor, out: torch.Tensor,
                     k: int, heads: List[int], decode: bool) -> None:
        hybrid = swa is not None
        s = swa if hybrid else full
        seq, last = seq.contiguous(), last.contiguous()
        on_device = isinstance(heads, torch.Tensor)  # [head_full, head_swa] read by the kernel (graph replays)
        op_ptr = on_device and heads.numel() >= 4  # and the op number, heads[3]
        claim_ptr = on_device and heads.numel() >= 5  # and the claim, heads[4] (else k, or unchecked)
        if not seq.numel():  # no request: what was claimed goes back (a host list's by the torch ops)
            if not on_device:
                TORCH_OPS.alloc_extend(full, swa, mapping, prefix, seq, last, out, k, heads, decode)
            elif claim_ptr:
                _give_back_all(full, swa, heads)
            return
        launch(_LAUNCHES, ("alloc", seq.numel(), full.page_size, hybrid, prefix is None, on_device, op_ptr,
                           claim_ptr), _alloc_kernel, (seq.numel(),),
               (seq, prefix.contiguous() if prefix is not None else seq, last, out, full.buf,
                0 if on_device else heads[0], full.num_pages, s.buf, 0 if on_device or not hybrid else heads[1],
                s.num_pages, mapping if hybrid else full.buf, _host_op_key(full, op_ptr), heads if on_device else seq,
                -1 if on_device and not claim_ptr else int(k)),
               dict(P=full.page_size, HYBRID=hybrid, DECODE=prefix is None, HEADS_PTR=on_device, OP_PTR=op_ptr,
                    CLAIM_PTR=claim_ptr,
                    BLOCK_B=_block(256), BLOCK_P=_page_block(full.page_size), BLOCK=_block(256),
                    num_warps=1 if interpreting() else 4))

    @staticmethod
    def alloc_step(full: PageRing, swa: Optional[PageRing], mapping: Optional[torch.Tensor], ctl: torch.Tensor,
                   rows_in: torch.Tensor, seq_in: torch.Tensor, pad_row: int, req_to_token: torch.Tensor,
                   rows: torch.Tensor, seq: torch.Tensor, out: torch.Tensor, advance: bool = False,
                   frontiers: Optional[torch.Tensor] = None, window: int = 0) -> bool:
        """`hwkv.allocator`'s `alloc_step` in one launch: the staged rows, one new slot each, written to
        req_to_token (rows_in and seq_in may be strided views of one buffer), and with `frontiers` (one per
        req_to_token row) the rows' out-of-window release. Returns whether it advanced."""
        bs = rows.shape[0]
        if bs == 0:
            if ctl.numel() >= 5:  # a claim staged for no request goes back
                _give_back_all(full, swa, ctl)
            return False
        if req_to_token.stride(1) != 1 or rows_in.stride(0) != seq_in.stride(0) or not all(
                t.is_contiguous() for t in (rows, seq, out)) or (frontiers is not None and not frontiers.is_contiguous()):
            raise LocError("alloc_step reads req_to_token's rows with unit stride, rows_in and seq_in with one stride "
                           "and writes rows, seq, out and frontiers contiguous: got strides "
                           f"{req_to_token.stride()}, {rows_in.stride()}, {seq_in.stride()}")
        if rows_in.shape[0] < bs or seq_in.shape[0] < bs:  # every lane reads its pair, live or padded
            raise LocError(f"alloc_step reads {bs} staged (row, length) pairs; rows_in has {rows_in.shape[0]}, "
                           f"seq_in {seq_in.shape[0]}")
        hybrid = swa is not None
        s = swa if hybrid else full
        p = full.page_size
        block, programs = request_block(bs)
        advance = bool(advance) and programs == 1
        release = hybrid and frontiers is not None
        op_ptr = ctl.numel() >= 4  # the op number staged at ctl[3]
        claim_ptr = ctl.numel() >= 5  # the claim at ctl[4]
        launch(_LAUNCHES, ("step", bs, p, hybrid, advance, release, op_ptr, claim_ptr), _alloc_step_kernel,
               (programs,),
               (ctl, rows_in, seq_in, rows_in.stride(0), int(pad_row), req_to_token, req_to_token.stride(0), rows, seq,
                out, full.buf, full.num_pages, s.buf, s.num_pages, mapping if hybrid else full.buf,
                _host_op_key(full, op_ptr), _host_op_key(full, op_ptr, 1), bs, frontiers if release else out,
                int(window)),
               dict(P=p, HYBRID=hybrid, BLOCK_P=_page_block(p), ADVANCE=advance, RELEASE=release, OP_PTR=op_ptr,
                    CLAIM_PTR=claim_ptr, BLOCK=block, num_warps=1 if interpreting() else (4 if block >= 256 else 1)))
        return advance

    @staticmethod
    def change_refs(full: PageRing, swa: Optional[PageRing], mapping: Optional[torch.Tensor], loc: torch.Tensor,
                    full_delta: int, swa_delta: int) -> None:
        hybrid = swa is not None
        s = swa if hybrid else full
        loc = loc.contiguous()
        launch(_LAUNCHES, ("refs", full.page_size, hybrid, full_delta, swa_delta), _refs_kernel, (1,),
               (loc, loc.numel(), full.buf, full.num_pages, s.buf, s.num_pages, mapping if hybrid else full.buf,
                full.who, pages.op_key(full.op)),
               dict(P=full.page_size, HYBRID=hybrid, FULL_DELTA=full_delta, SWA_DELTA=swa_delta, BLOCK=_block(1024),
                    num_warps=1 if interpreting() else 8))

    releases_by_row = True  # release_window takes by_row (frontiers indexed by req_to_token row)
    reads_heads_on_device = True  # alloc_extend takes heads as a device tensor (a captured step's)
    reads_op_word = True  # release_window takes op_word (a captured release's op number, read when it runs)

    @staticmethod
    def release_window(full: PageRing, swa: PageRing, mapping: torch.Tensor, req_to_token: torch.Tensor,
                       rows: torch.Tensor, seq: torch.Tensor, frontiers: torch.Tensor, window: int,
                       by_row: bool = False, op_word: Optional[torch.Tensor] = None) -> None:
        """`op_word`: a device word holding the op number before this release's (read when the kernel runs);
        None: the host's current op number."""
        f = frontiers if frontiers.is_contiguous() else frontiers.contiguous()  # moved in place: copied back
        bs = rows.numel()
        op_ptr = op_word is not None
        launch(_LAUNCHES, ("release", bs, full.page_size, by_row, op_ptr), _release_kernel, (bs,),
               (req_to_token, req_to_token.stride(0), req_to_token.stride(1), rows.contiguous(), seq.contiguous(), f,
                int(window), full.buf, full.num_pages, swa.buf, swa.num_pages, mapping, _host_op_key(full, op_ptr),
                op_word if op_ptr else f),
               dict(P=full.page_size, BY_ROW=bool(by_row), OP_PTR=op_ptr, BLOCK=_block(128),
                    num_warps=1 if interpreting() else 4))
        if f is not frontiers:
            frontiers.copy_(f)
