"""The decode-like tree verify's per-token lists in two launches (CUDA, ROCm, XPU, MUSA; CPU CI under
the interpreter).

`hwkv.spec.tree_decode_list` builds, once per forward and list, one decode list per draft token: its
request's prefix keys (for window lists those in the token's window), then its ancestors by depth,
then itself. Its torch path takes about sixty small ops, which on a GPU cost more than the decode
kernels they feed (about 130 us on an H200 for 15 drafts). Here:

- `_tree_lens_kernel` (one program): every token's list length, their running sum into the output
  indptr and each list's first position, a block of tokens at a time with the carry in a register;
- `_tree_fill_kernel` (token x prefix chunk): the prefix keys, copied from the request's list or
  straight from its `req_to_token` row, and (chunk 0) the token's ancestors from its tree-mask row.

Kernels only: registered through `hwkv.ops.register_tree_decode`, launched by `tree_decode_list`,
which checks capacities and decides what is built. Nothing is read back to the host.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import triton
import triton.language as tl

from hwkv.errors import LocError, ShapeError
from hwkv_cuda.kernels.common import cdiv, jit_interpreted
from hwkv_cuda.kernels.launch import Launch, launch


@triton.jit
def _token_facts(t, tok_ok, qo_indptr, q_positions, q_pos0, list_pos0, bs, window, LOG_BS: tl.constexpr):
    """For tokens t: request b (largest b with qo_indptr[b] <= t), rel0 (list entries before the drafts),
    depth, lo (first prefix entry kept), dmin (shallowest ancestor kept)."""
    lo_b = t * 0
    hi_b = lo_b + bs                   # invariant: qo_indptr[lo_b] <= t < qo_indptr[hi_b] (hi_b = bs: past the end)
    for _ in range(LOG_BS):
        mid = (lo_b + hi_b) // 2
        go = (hi_b - lo_b > 1) & (tl.load(qo_indptr + mid, mask=tok_ok & (mid < bs), other=0).to(tl.int64) <= t)
        lo_b = tl.where(go, mid, lo_b)
        hi_b = tl.where((hi_b - lo_b > 1) & ~go, mid, hi_b)
    b = lo_b
    qp0 = tl.load(q_pos0 + b, mask=tok_ok, other=0).to(tl.int64)
    lp0 = tl.load(list_pos0 + b, mask=tok_ok, other=0).to(tl.int64)
    q_pos = tl.load(q_positions + t, mask=tok_ok, other=0).to(tl.int64)
    rel0 = qp0 - lp0
    depth = q_pos - qp0
    start = q_pos - window + 1 - lp0                 # the token's window start, relative to the list
    lo = tl.where(window > 0, tl.minimum(tl.maximum(start, 0), rel0), 0)
    dmin = tl.where(window > 0, tl.maximum(start - rel0, 0), 0)
    return b, qp0, lp0, rel0, depth, lo, dmin


@triton.jit
def _tree_lens_kernel(qo_indptr, q_positions, q_pos0, list_pos0, out_indptr, out_pos0, num_tokens, bs, window,
                      LOG_BS: tl.constexpr, BLOCK_T: tl.constexpr):
    tl.store(out_indptr, 0)
    carry = tl.zeros([1], tl.int64).sum(0)
    for t0 in range(0, num_tokens, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        ok = t < num_tokens
        b, qp0, lp0, rel0, depth, lo, dmin = _token_facts(t, ok, qo_indptr, q_positions, q_pos0, list_pos0, bs,
                                                          window, LOG_BS)
        lens = tl.where(ok, rel0 - lo + depth - dmin + 1, 0)
        ends = carry + tl.cumsum(lens, 0)
        tl.store(out_indptr + t + 1, ends.to(out_indptr.dtype.element_ty), mask=ok)
        tl.store(out_pos0 + t, lp0 + lo + dmin, mask=ok)
        carry += tl.sum(lens, 0)


@triton.jit
def _tree_fill_kernel(qo_indptr, q_positions, q_pos0, list_indptr, list_indices, list_pos0, mask, mask_indptr,
                      req_to_token, req_pool_indices, out_indptr, out_indices, bs, window, chunk, cap, stride_rtt,
                      FROM_ROWS: tl.constexpr, LOG_BS: tl.constexpr, BLOCK: tl.constexpr,
                      BLOCK_J: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    b, qp0, lp0, rel0, depth, lo, dmin = _token_facts(t, t >= 0, qo_indptr, q_positions, q_pos0, list_pos0, bs,
                                                      window, LOG_BS)
    start = tl.load(out_indptr + t).to(tl.int64)
    kv_start = tl.load(list_indptr + b).to(tl.int64)
    prefix = rel0 - lo
    k_end = tl.minimum(prefix, (s + 1) * chunk)
    if FROM_ROWS:   # full list: slot of position p = req_to_token[row, p]
        src = req_to_token + tl.load(req_pool_indices + b).to(tl.int64) * stride_rtt + lp0 + lo
    else:
        src = list_indices + kv_start + lo
    for k0 in range(s * chunk, k_end, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        m = (k < k_end) & (start + k < cap)
        tl.store(out_indices + start + k, tl.load(src + k, mask=m, other=0).to(tl.int64), mask=m)
    if s == 0:      # ancestors (mask row of t, set bits whose depth is in the window), then itself
        first = tl.load(qo_indptr + b).to(tl.int64)
        n_b = tl.load(qo_indptr + b + 1).to(tl.int64) - first
        row = mask + tl.load(mask_indptr + b).to(tl.int64) + (t - first) * n_b
        for j0 in range(0, n_b, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            jm = j < n_b
            see = tl.load(row + j, mask=jm, other=0) != 0
            depth_j = tl.load(q_positions + first + j, mask=jm, other=0).to(tl.int64) - qp0
            keep = jm & see & (depth_j >= dmin)
            dst = start + prefix + depth_j - dmin
            keep = keep & (dst < cap)
            slot = tl.load(list_indices + kv_start + rel0 + j, mask=keep, other=0)
            tl.store(out_indices + dst, slot.to(tl.int64), mask=keep)


_TARGET_PROGRAMS = 2048   # fill programs to aim for (token x prefix chunk) when the tokens are few


def _sizes() -> "tuple[int, int, int, int]":
    """(token block, key block, draft block, warps): tiny blocks under the interpreter."""
    return (8, 8, 4, 1) if _INTERPRETED else (1024, 1024, 32, 4)


def tree_decode_fill(q_positions: torch.Tensor, mask: torch.Tensor, mask_indptr: torch.Tensor,
                     qo_indptr: torch.Tensor, q_pos0: torch.Tensor, list_indptr: torch.Tensor,
                     list_indices: torch.Tensor, list_pos0: torch.Tensor, window: Optional[int],
                     out_indptr: torch.Tensor, out_pos0: torch.Tensor, out_indices: torch.Tensor,
                     num_tokens: int, num_requests: int, row_cap: int,
                     rows: Optional["tuple[torch.Tensor, torch.Tensor]"] = None) -> None:
    """`tree_decode_list`'s lists of `num_tokens` draft tokens of `num_requests` requests into out_indptr
    [>= T + 1] (int32), out_pos0 [>= T] and out_indices (entries past out_indptr[T] untouched), two launches.

    rows = (req_to_token, req_pool_indices): the prefixes come from the rows instead of the list
    (full lists only). row_cap: host bound on one token's list, sizes the prefix chunks."""
    bs = num_requests
    if out_indptr.dtype != torch.int32 or out_indices.dtype != torch.int64 or out_pos0.dtype != torch.int64:
        raise LocError(f"out_indptr must be int32 and out_indices/out_pos0 int64, got {out_indptr.dtype}, "
                       f"{out_indices.dtype}, {out_pos0.dtype}")
    if out_indptr.shape[0] < num_tokens + 1 or out_pos0.shape[0] < num_tokens or qo_indptr.shape[0] < bs + 1 \
            or q_pos0.shape[0] < bs or list_pos0.shape[0] < bs or list_indptr.shape[0] < bs + 1:
        raise ShapeError(f"out_indptr [{out_indptr.shape[0]}] / out_pos0 [{out_pos0.shape[0]}] must hold "
                         f"{num_tokens + 1} / {num_tokens} entries; qo_indptr [{qo_indptr.shape[0]}], list_indptr "
                         f"[{list_indptr.shape[0]}] {bs + 1}; q_pos0 [{q_pos0.shape[0]}], list_pos0 "
                         f"[{list_pos0.shape[0]}] {bs}")
    if not (out_indices.is_contiguous() and list_indices.is_contiguous() and mask.is_contiguous()):
        raise ShapeError("out_indices, list_indices and the tree mask must be contiguous")
    if rows is not None and (rows[0].dim() != 2 or rows[0].stride(1) != 1):
        raise ShapeError(f"req_to_token must be [rows, ctx] with contiguous rows, got {list(rows[0].shape)}")
    if num_tokens == 0 or bs == 0:
        out_indptr[:1].zero_()
        return
    block_t, block, block_j, warps = _sizes()
    log_bs = max(1, int(bs).bit_length())
    w = int(window or 0)
    launch(_LAUNCHES, ("lens", log_bs), _tree_lens_kernel, (1,),
           (qo_indptr, q_positions, q_pos0, list_pos0, out_indptr, out_pos0, num_tokens, bs, w),
           dict(LOG_BS=log_bs, BLOCK_T=block_t, num_warps=warps))
    # prefix chunks per token: enough programs to fill the device at small token counts, one at large
    splits = max(1, min(cdiv(max(row_cap, 1), block), cdiv(_TARGET_PROGRAMS, num_tokens)))
    chunk = cdiv(cdiv(max(row_cap, 1), splits), block) * block
    if rows is None:
        rtt, req_rows, stride = list_indices, q_pos0, 0   # unused (FROM_ROWS off)
    else:
        rtt, req_rows = rows
        stride = rtt.stride(0)
    launch(_LAUNCHES, ("fill", num_tokens, splits, rows is not None, log_bs), _tree_fill_kernel, (num_tokens, splits),
           (qo_indptr, q_positions, q_pos0, list_indptr, list_indices, list_pos0, mask, mask_indptr, rtt, req_rows,
            out_indptr, out_indices, bs, w, chunk, out_indices.shape[0], stride),
           dict(FROM_ROWS=rows is not None, LOG_BS=log_bs, BLOCK=block, BLOCK_J=block_j, num_warps=warps))


_INTERPRETED = jit_interpreted(_tree_lens_kernel)
_LAUNCHES: Dict[Tuple, Launch] = {}  # planned launches of the tree-list kernels, by kernel, grid and constexprs
