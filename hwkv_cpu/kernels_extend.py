"""Extend (prefill with or without a cached prefix) attention in vectorized torch.

Per request, queries go in blocks of `block_q` rows and keys in chunks of `chunk`, through the
decode module's chunk step. A key chunk that no query of the block sees is skipped; a chunk
every query of the block sees fully needs no mask; only chunks on the causal diagonal or the
window edge build a [block, 1, chunk] visibility mask (key at kp visible to a query at qp iff
kp <= qp and kp > qp - W).
"""
from __future__ import annotations

from typing import Optional

import torch

from hwkv_cpu.kernels_decode import (Gather, OnlineSoftmax, Params, chunks, heads_view, key_range, neg_inf_where,
                                     workspace)

EXTEND_CHUNK = 512  # keys per chunk
EXTEND_ROWS = 2048  # query rows (queries x heads) per block: the fp32 score tile is rows x chunk
RESIDENT_BYTES = 16 << 20  # a request's keys up to this size (K, and as much V) are gathered once


def _hidden(q_lo: int, nq: int, k_lo: int, nk: int, window: int) -> torch.Tensor:
    """bool [nq, 1, nk]: True where the key at position k_lo + j is invisible to the query at q_lo + i."""
    dist = (torch.arange(q_lo, q_lo + nq)[:, None] - torch.arange(k_lo, k_lo + nk)[None, :])
    hide = dist < 0
    if window:
        hide |= dist >= window
    return hide.unsqueeze(1)


def extend_torch(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, indptr: list, indices: torch.Tensor,
                 pos0: list, qo_indptr: list, q_pos0: list, out: torch.Tensor, p: Params,
                 sinks: Optional[torch.Tensor], chunk: int = EXTEND_CHUNK, rows: int = EXTEND_ROWS) -> None:
    """out[t] = attention of query t over the keys of its request visible to it (see `extend_attention`)."""
    h, d = q.shape[1], q.shape[2]
    kvh, dv = k_buf.shape[1], v_buf.shape[2]
    g = h // kvh
    block_q = max(1, rows // h)
    ws = workspace()
    resident = max(chunk, RESIDENT_BYTES // (kvh * max(d, dv) * p.cdt.itemsize))
    gather = Gather(k_buf, v_buf, p.cdt, resident, ws)
    for b in range(len(q_pos0)):
        t0, t1, n = qo_indptr[b], qo_indptr[b + 1], indptr[b + 1] - indptr[b]
        slots = indices[indptr[b]: indptr[b + 1]]
        # every query block reads keys of [span_lo, span_hi): gather them once when they fit
        span_lo, span_hi = key_range(n, pos0[b], q_pos0[b], q_pos0[b] + t1 - t0 - 1, p.window)
        whole = span_hi - span_lo <= resident
        if whole:
            k_all, v_all = gather(slots[span_lo:span_hi])
        for a, e in chunks(t0, t1, block_q):
            nq = e - a
            qa = q_pos0[b] + (a - t0)  # positions qa .. qa + nq - 1
            qg = ws.take("qx", (kvh, nq, g, d), p.cdt)
            qg.copy_(q[a:e].view(nq, kvh, g, d).permute(1, 0, 2, 3)).mul_(p.qk_scale)
            qg = qg.view(kvh, nq * g, d)
            state = OnlineSoftmax(kvh, nq * g, dv, p, ws, tag="x")
            state.reset(None if sinks is None else sinks.view(kvh, 1, g).expand(kvh, nq, g).reshape(kvh, nq * g, 1))
            lo, hi = key_range(n, pos0[b], qa, qa + nq - 1, p.window)
            all_lo, all_hi = key_range(n, pos0[b], qa + nq - 1, qa, p.window)  # seen by every query
            for c0, c1 in chunks(lo, hi, chunk):
                mask = None
                if c0 < all_lo or c1 > all_hi:
                    bias = neg_inf_where(_hidden(qa, nq, pos0[b] + c0, c1 - c0, p.window))
                    mask = lambda s, bias=bias, nq=nq: s.view(kvh, nq, g, -1).add_(bias)  # noqa: E731
                if whole:
                    k, v = k_all[c0 - span_lo: c1 - span_lo], v_all[c0 - span_lo: c1 - span_lo]
                else:
                    k, v = gather(slots[c0:c1])
                state.step(qg, heads_view(k, c1 - c0, 1, kvh), heads_view(v, c1 - c0, 1, kvh), mask)
            res = state.result().view(kvh, nq, g, dv).permute(1, 0, 2, 3)
            out[a:e].view(nq, kvh, g, dv).copy_(res)
