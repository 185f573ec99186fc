"""Extend (prefill with or without a cached prefix) attention in vectorized torch.

Per request, queries go in blocks of `block_q` rows and keys in chunks of `chunk`, through the
decode module's chunk step. A key chunk that no query of the block sees is skipped; a chunk
every query of the block sees fully needs no mask; only chunks on the causal diagonal or the
window edge build a [block, 1, chunk] visibility mask (key at kp visible to a query at qp iff
kp <= qp and kp > qp - W).

Tree verify (`tree`, a `hwkv.spec.TreeMask`): a query block's rows sit at the tree's positions and
walk the keys from the smallest one's window start to the request's last draft; chunks of prefix
keys inside every row's window need no mask, the others build it from the rule of `_tree_hidden`.
"""
from __future__ import annotations

import threading
from typing import NamedTuple, Optional, Tuple

import torch

from hwkv.spec import TreeMask
from hwkv_cpu.host_plan import HostLists
from hwkv_cpu.kernels_decode import (Gather, OnlineSoftmax, Params, chunks, head_rows, key_range, neg_inf_where,
                                     parallel_map, workspace)

EXTEND_CHUNK = 512  # keys per chunk
EXTEND_ROWS = 2048  # query rows (queries x heads) per block: the fp32 score tile is rows x chunk
RESIDENT_BYTES = 16 << 20  # a request's keys up to this size (K, and as much V) are gathered once


def _hidden(q_lo: int, nq: int, k_lo: int, nk: int, window: int) -> torch.Tensor:
    """bool [nq, 1, nk]: True where the key at position k_lo + j is invisible to the query at q_lo + i."""
    dist = (torch.arange(q_lo, q_lo + nq, device="cpu")[:, None] - torch.arange(k_lo, k_lo + nk, device="cpu")[None, :])
    hide = dist < 0
    if window:
        hide |= dist >= window
    return hide.unsqueeze(1)


class TreeBlock(NamedTuple):
    """A query block's part of a verify tree: q_pos [nq] its rows' positions, bits [nq, n] their rows
    of the request's ancestor mask, draft_pos [n] the request's draft positions, q_pos0 the list
    position of draft 0."""

    q_pos: torch.Tensor
    bits: torch.Tensor
    draft_pos: torch.Tensor
    q_pos0: int


def _tree_hidden(tb: TreeBlock, k_lo: int, nk: int, window: int) -> torch.Tensor:
    """bool [nq, 1, nk]: True where list position k_lo + j is invisible to the block's row i: a prefix
    key (position < q_pos0) only outside the window, draft t = position - q_pos0 unless bits[i, t]
    and draft_pos[t] is inside the window."""
    kp = torch.arange(k_lo, k_lo + nk, device="cpu")
    t = kp - tb.q_pos0
    draft = t >= 0
    ti = t.clamp(0, max(tb.draft_pos.shape[0] - 1, 0))
    hide = draft[None, :] & ~tb.bits[:, ti]
    if window:
        kpos = torch.where(draft, tb.draft_pos[ti], kp)
        hide |= kpos[None, :] <= tb.q_pos[:, None] - window
    return hide.unsqueeze(1)


def extend_torch(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, indptr: list, indices: torch.Tensor,
                 pos0: list, qo_indptr: list, q_pos0: list, out: torch.Tensor, p: Params,
                 sinks: Optional[torch.Tensor], chunk: int = EXTEND_CHUNK, rows: int = EXTEND_ROWS, *,
                 tree: Optional[TreeMask] = None, plans: Optional[HostLists] = None) -> None:
    """out[t] = attention of query t over the keys of its request visible to it (see `extend_attention`).

    Query blocks are independent tasks, spread over threads by `parallel_map`; a thread keeps
    the gathered keys of its last request for its next block of the same request. The task list (and a verify
    tree's mask offsets) are kept in `plans`, this forward's host lists of the list, where the caller has them.
    """
    block_q = max(1, rows // q.shape[1])
    make = lambda: [(b, a, e) for b in range(len(q_pos0))  # noqa: E731
                    for a, e in chunks(qo_indptr[b], qo_indptr[b + 1], block_q)]
    tasks = make() if plans is None else plans.get(("extend", block_q), make)
    cached = threading.local()  # per thread: (request, K, V) of the request gathered whole
    mask_ptr = None
    if tree is not None:
        mask_ptr = tree.mask_indptr.tolist() if plans is None else plans.get(("tree",), tree.mask_indptr.tolist)

    def block(task: Tuple[int, int, int]) -> None:
        b, a, e = task
        r0, n = qo_indptr[b], qo_indptr[b + 1] - qo_indptr[b]
        tb = None
        if mask_ptr is not None:
            bits = tree.mask[mask_ptr[b]: mask_ptr[b] + n * n].reshape(n, n)[a - r0: e - r0]
            tb = TreeBlock(tree.q_positions[a:e], bits, tree.q_positions[r0: r0 + n], q_pos0[b])
        _extend_block(q[a:e], out[a:e], k_buf, v_buf, indices[indptr[b]: indptr[b + 1]], pos0[b],
                      q_pos0[b] + a - r0, (q_pos0[b], n), p, sinks, chunk, cached, b, tb)

    parallel_map(block, tasks)


def _extend_block(qb: torch.Tensor, out: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                  slots: torch.Tensor, pos0: int, qa: int, new: Tuple[int, int], p: Params,
                  sinks: Optional[torch.Tensor], chunk: int, cached: threading.local, req: int,
                  tree: Optional[TreeBlock] = None) -> None:
    """out [nq, H, Dv] for the queries qb [nq, H, D] at positions qa.. of request `req`, whose
    list `slots` starts at position pos0; new = (position of its first new token, their count);
    tree: the block's part of a verify tree (rows at tree.q_pos, every position in new's range)."""
    nq, h, d = qb.shape
    kvh, dv = k_buf.shape[1], v_buf.shape[2]
    g = h // kvh
    ws = workspace()
    # every block of the request reads keys of [span_lo, span_hi): gather them once when they fit
    span_lo, span_hi = key_range(slots.numel(), pos0, new[0], new[0] + new[1] - 1, p.window)
    if span_hi == span_lo:  # no query of the request sees a key (none listed, or all outside): zeros, as in decode
        out.zero_()
        return
    resident = max(chunk, RESIDENT_BYTES // (kvh * max(d, dv) * p.cdt.itemsize))
    gather = Gather(k_buf, v_buf, p.cdt, resident * kvh, ws)
    whole = span_hi - span_lo <= resident
    if whole and getattr(cached, "req", None) != req:
        cached.kv = gather(head_rows(slots[span_lo:span_hi], kvh))  # [KVH, keys, D]
    cached.req = req if whole else None
    qg = ws.take("qx", (kvh, nq, g, d), p.cdt)
    qg.copy_(qb.view(nq, kvh, g, d).permute(1, 0, 2, 3)).mul_(p.qk_scale)
    qg = qg.view(kvh, nq * g, d)
    state = OnlineSoftmax(kvh, nq * g, dv, p, ws, tag="x")
    state.reset(None if sinks is None else sinks.view(kvh, 1, g).expand(kvh, nq, g).reshape(kvh, nq * g, 1))
    if tree is None:
        lo, hi = key_range(slots.numel(), pos0, qa, qa + nq - 1, p.window)
        all_lo, all_hi = key_range(slots.numel(), pos0, qa + nq - 1, qa, p.window)  # seen by every query
    else:  # up to the last draft; all rows see the prefix keys inside the highest row's window
        lo, hi = key_range(slots.numel(), pos0, int(tree.q_pos.min()), new[0] + new[1] - 1, p.window)
        all_lo, all_hi = key_range(slots.numel(), pos0, int(tree.q_pos.max()), new[0] - 1, p.window)
    for c0, c1 in chunks(lo, hi, chunk):
        mask = None
        if c0 < all_lo or c1 > all_hi:
            hide = (_hidden(qa, nq, pos0 + c0, c1 - c0, p.window) if tree is None
                    else _tree_hidden(tree, pos0 + c0, c1 - c0, p.window))
            bias = neg_inf_where(hide)
            mask = lambda s, bias=bias: s.view(kvh, nq, g, -1).add_(bias)  # noqa: E731
        if whole:
            k, v = (t[:, c0 - span_lo: c1 - span_lo] for t in cached.kv)
        else:
            k, v = gather(head_rows(slots[c0:c1], kvh))
        state.step(qg, k, v, mask)
    out.view(nq, kvh, g, dv).copy_(state.result().view(kvh, nq, g, dv).permute(1, 0, 2, 3))
