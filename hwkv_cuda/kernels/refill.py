"""The graph-metadata refill in one launch for a hybrid pool (CUDA, ROCm, XPU, MUSA; CPU CI interpreted).

Before every replay the backend rebuilds its static buffers. The torch path takes about twenty
small ops for that; these kernels take one launch each for:

- `translate_into`: the write locs into the static `swa_out_cache_loc` buffer, `[n:]` zeroed;
- `fill_lists`: `lens`, `q_pos0`, `qo_indptr`, every list's `indptr` and `pos0` (row 0 is the
  full list, row 1 + i window i), and the full list's locs. Program (b, j) sums the lengths of
  requests 0..b-1 itself (one block of loads up to 1024 requests), so no launch waits on a scan;
- `translate_runs`: one window list gathered from `req_to_token` and translated through
  `full_to_swa_index_mapping` in the same pass (it never exists in full-pool locs);
- `fill_translated`: all of it at once, a hybrid pool's whole graph refill: `fill_lists`' launch
  also translates the write locs (every program a share of the buffer) and each window's list
  (program (b, 1 + i) gathers request b's run of window i into row i of the window lists' buffer).
  The other three remain for the draft refill, the eager lists and plain pools (nothing translated).

They are kernels only: registered through `hwkv.ops.register_graph_refill`, launched by the core
(the pool's `translate_loc_from_full_to_swa` and the backend template's refill), which decides what
is translated, when, and counts it; this package never calls them on its own.
Entries of a list's buffer past its `indptr[bs]` are left as they were: no kernel reads them.
Nothing is read back to the host. A mapping read with a negative loc reads from the end, as
torch indexing does (`mapping[-1] == -1`).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
import triton
import triton.language as tl

from hwkv.errors import LocError, ShapeError
from hwkv.ops import GraphRefillKernels
from hwkv_cuda.kernels.common import jit_interpreted
from hwkv_cuda.kernels.launch import Launch, launch


def _launch_sizes() -> "tuple[int, int, int]":
    """(block of list entries, block of requests, warps): tiny blocks under the interpreter (Triton
    decided when it decorated the kernels whether it interprets them)."""
    return (16, 4, 1) if _INTERPRETED else (1024, 1024, 4)


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ShapeError(what)


_UNIT = (1,)  # a 1-D list of stride 1's strides


def _unit_stride(**named: Optional[torch.Tensor]) -> None:
    """Each given 1-D list has stride 1: the kernels read entry b at base + b, so a strided view (one column of a
    table) would be read as other entries. Host attributes only."""
    for name, t in named.items():
        if t is not None and t.stride(0) != 1 and t.shape[0] > 1:
            raise ShapeError(f"{name} has stride {t.stride(0)}; the refill kernels read it with stride 1: pass "
                             f"{name}.contiguous()")


@triton.jit
def _mapped(mapping, full, mask, map_len):
    """mapping[full] where mask (0 elsewhere); a negative loc reads from the end, as torch indexing does."""
    full = full.to(tl.int64)
    return tl.load(mapping + tl.where(full < 0, full + map_len, full), mask=mask, other=0)


@triton.jit
def _translate_block(mapping, loc, out, i, n, cap, map_len):
    """out[i] = mapping[loc[i]] for i < n, 0 for n <= i < cap (one block of the write locs' buffer)."""
    live = i < n
    slot = _mapped(mapping, tl.load(loc + i, mask=live, other=0), live, map_len)
    tl.store(out + i, slot.to(out.dtype.element_ty), mask=i < cap)


@triton.jit
def _copy_run(src, dst, n, first, cols, room, mapping, map_len, part, parts, TRANSLATE: tl.constexpr,
              BLOCK: tl.constexpr):
    """dst[k] = src[k] (through `mapping` when TRANSLATE) for k < n, a run of one req_to_token row from column
    `first` (k < cols - first) into a list (k < room); this is program `part` of the `parts` that stride the run."""
    for off in range(part * BLOCK, n, parts * BLOCK):
        k = off + tl.arange(0, BLOCK)
        mask = (k < n) & (first + k < cols) & (k < room)
        v = tl.load(src + k, mask=mask, other=0)
        if TRANSLATE:
            v = _mapped(mapping, v, mask, map_len)
        tl.store(dst + k, v.to(dst.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n", "cap", "map_len"])  # sizes: one compile, whatever the batch
def _translate_into_kernel(mapping, loc, out, n, cap, map_len, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    _translate_block(mapping, loc, out, i, n, cap, map_len)


def _check_into(mapping: torch.Tensor, loc: torch.Tensor, out: torch.Tensor) -> None:
    """`translate_into`'s argument checks: 1-D int locs, an int64 buffer at least as long, one device."""
    n, cap = loc.shape[0], out.shape[0]
    if loc.dtype not in (torch.int64, torch.int32) or loc.dim() != 1 or out.dtype != torch.int64:
        raise LocError(f"loc must be 1-D int64/int32 and out int64, got {loc.dtype} {list(loc.shape)}, {out.dtype}")
    _need(out.dim() == 1 and out.stride(0) == 1 and n <= cap and loc.stride(0) == 1 and mapping.stride(0) == 1,
          f"out [{cap}] must be a contiguous 1-D buffer at least as long as loc [{n}]")
    _need(loc.device == out.device == mapping.device, f"loc, out and mapping must share a device, got "
          f"{loc.device}, {out.device}, {mapping.device}")


def translate_into(mapping: torch.Tensor, loc: torch.Tensor, out: torch.Tensor) -> None:
    """out[:n] = mapping[loc], out[n:] = 0, in one launch (n = len(loc) <= len(out))."""
    _check_into(mapping, loc, out)
    n, cap = loc.shape[0], out.shape[0]
    if cap == 0:
        return
    block, _, warps = _launch_sizes()
    launch(_LAUNCHES, ("into", cap), _translate_into_kernel, (-(-cap // block),),
           (mapping, loc, out, n, cap, mapping.shape[0]), dict(BLOCK=block, num_warps=warps))


@triton.jit
def _window_pos0(q_pos0, window):
    """First visible key of a query at q_pos0 (window 0: the full list starts at 0)."""
    return tl.where(window > 0, tl.maximum(q_pos0 - window + 1, 0), 0)


@triton.jit(do_not_specialize=["full_cap", "stride_indptr", "stride_pos0", "copies", "n_loc", "loc_cap", "map_len",
                               "stride_win", "win_cap"])  # they follow the batch (or the pools): one compile
def _fill_lists_kernel(req_to_token, req_pool_indices, seq_lens, ext_lens, windows,
                       lens, q_pos0, qo_indptr, list_indptr, list_pos0, full_indices,
                       mapping, loc, loc_out, win_out,
                       stride_rtt, rtt_cols, full_cap, stride_indptr, stride_pos0, copies,
                       n_loc, loc_cap, map_len, stride_win, win_cap,
                       DECODE: tl.constexpr, TRANSLATE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    j = tl.program_id(1)          # 0: the full list; 1 + i: window i
    c = tl.program_id(2)          # which of the `copies` programs copying list j's locs of request b this is
    window = tl.load(windows + j).to(tl.int64)
    list_before = tl.zeros([BLOCK_B], tl.int64)   # this list's entries of requests 0..b-1
    q_before = tl.zeros([BLOCK_B], tl.int64)      # their new tokens
    for start in range(0, b, BLOCK_B):
        i = start + tl.arange(0, BLOCK_B)
        m = i < b
        s = tl.load(seq_lens + i, mask=m, other=0).to(tl.int64)
        if DECODE:
            e = m.to(tl.int64)
        else:
            e = tl.load(ext_lens + i, mask=m, other=0).to(tl.int64)
        list_before += tl.where(m, s - _window_pos0(s - e, window), 0)
        q_before += e
    seq = tl.load(seq_lens + b).to(tl.int64)
    if DECODE:
        ext = seq * 0 + 1
    else:
        ext = tl.load(ext_lens + b).to(tl.int64)
    pos0 = _window_pos0(seq - ext, window)
    start_b = tl.sum(list_before, 0)
    n = seq - pos0
    if c == 0:
        tl.store(list_indptr + j * stride_indptr + b + 1, (start_b + n).to(tl.int32))
        tl.store(list_pos0 + j * stride_pos0 + b, pos0)
        if b == 0:
            tl.store(list_indptr + j * stride_indptr, 0)
        if j == 0:
            tl.store(lens + b, seq)
            tl.store(q_pos0 + b, seq - ext)
            tl.store(qo_indptr + b + 1, (tl.sum(q_before, 0) + ext).to(tl.int32))
            if b == 0:
                tl.store(qo_indptr, 0)
    # the copy, BLOCK entries per program in turn: a small batch's long lists are not one program's loop
    src = req_to_token + tl.load(req_pool_indices + b).to(tl.int64) * stride_rtt + pos0
    if j == 0:
        _copy_run(src, full_indices + start_b, n, pos0, rtt_cols, full_cap - start_b, mapping, map_len, c, copies,
                  False, BLOCK)
    if TRANSLATE:
        if j > 0:  # window j - 1's list, gathered and translated: it never exists in full-pool locs
            _copy_run(src, win_out + (j - 1).to(tl.int64) * stride_win + start_b, n, pos0, rtt_cols, win_cap - start_b,
                      mapping, map_len, c, copies, True, BLOCK)
        # the write locs: every program a share of the buffer's blocks (translated below n_loc, zeroed after)
        nb, nj = tl.num_programs(0), tl.num_programs(1)
        p = ((b * nj + j) * copies + c).to(tl.int64)
        for off in range(p * BLOCK, loc_cap, nb * nj * copies * BLOCK):
            _translate_block(mapping, loc, loc_out, off + tl.arange(0, BLOCK), n_loc, loc_cap, map_len)


def _check_lists(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                 extend_lens: Optional[torch.Tensor], windows: torch.Tensor, lens: torch.Tensor, q_pos0: torch.Tensor,
                 qo_indptr: torch.Tensor, list_indptr: torch.Tensor, list_pos0: torch.Tensor,
                 full_indices: torch.Tensor) -> None:
    """`fill_lists`' argument checks (shapes, strides, dtypes), before its kernel reads anything: every 1-D list of
    stride 1 (its kernel reads them so)."""
    bs, nlists = req_pool_indices.shape[0], windows.shape[0]
    _need(req_to_token.dim() == 2 and req_to_token.stride(1) == 1, "req_to_token must be [rows, ctx], contiguous rows")
    _need(seq_lens.shape[0] >= bs and (extend_lens is None or extend_lens.shape[0] >= bs),
          f"seq_lens/extend_lens must hold {bs} entries")
    _need(lens.shape[0] >= bs and q_pos0.shape[0] >= bs and qo_indptr.shape[0] >= bs + 1,
          f"lens, q_pos0 and qo_indptr must hold {bs}, {bs} and {bs + 1} entries")
    _need(list_indptr.dim() == 2 and list_indptr.shape[0] == nlists and list_indptr.shape[1] >= bs + 1
          and list_pos0.dim() == 2 and list_pos0.shape[0] == nlists and list_pos0.shape[1] >= bs,
          f"list_indptr/list_pos0 must be [{nlists}, >= {bs + 1}] / [{nlists}, >= {bs}]")
    _need(list_indptr.stride(1) == 1 and list_pos0.stride(1) == 1, "list_indptr/list_pos0 rows must be contiguous")
    lists = (req_pool_indices, seq_lens, windows, lens, q_pos0, qo_indptr, full_indices)
    if not (all(t.stride() == _UNIT for t in lists) and (extend_lens is None or extend_lens.stride() == _UNIT)):
        # one pass above when all is well (every eager forward comes here); which list is wrong, only when one is
        _need(all(t.dim() == 1 for t in lists) and (extend_lens is None or extend_lens.dim() == 1),
              "the per-request lists and full_indices must be 1-D")
        _unit_stride(req_pool_indices=req_pool_indices, seq_lens=seq_lens, extend_lens=extend_lens, windows=windows,
                     lens=lens, q_pos0=q_pos0, qo_indptr=qo_indptr, full_indices=full_indices)
    if qo_indptr.dtype != torch.int32 or list_indptr.dtype != torch.int32 or full_indices.dtype != torch.int64:
        raise LocError("qo_indptr and list_indptr must be int32, full_indices int64")


def _launch_fill(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                 extend_lens: Optional[torch.Tensor], windows: torch.Tensor, lists: Tuple[torch.Tensor, ...],
                 translate: Optional[Tuple[Any, ...]]) -> None:
    """The fill kernel over a batch of at least one request; `translate`: (mapping, loc, loc_out, win_out,
    n_loc, loc_cap, map_len, stride_win, win_cap), or None (TRANSLATE off: `fill_lists`)."""
    bs, nlists = req_pool_indices.shape[0], windows.shape[0]
    lens, q_pos0, qo_indptr, list_indptr, list_pos0, full_indices = lists
    block, block_b, warps = _launch_sizes()
    ext = extend_lens if extend_lens is not None else seq_lens
    copies, on = _copies(bs), translate is not None
    if translate is None:  # placeholders the kernel never reads: any tensor will do
        translate = (full_indices,) * 4 + (0,) * 5
    launch(_LAUNCHES, ("fill", bs, nlists, extend_lens is None, on), _fill_lists_kernel, (bs, nlists, copies),
           (req_to_token, req_pool_indices, seq_lens, ext, windows, lens, q_pos0, qo_indptr, list_indptr,
            list_pos0, full_indices, *translate[:4], req_to_token.stride(0), req_to_token.shape[1],
            full_indices.shape[0], list_indptr.stride(0), list_pos0.stride(0), copies, *translate[4:]),
           dict(DECODE=extend_lens is None, TRANSLATE=on, BLOCK_B=block_b, BLOCK=block, num_warps=warps))


def fill_lists(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
               extend_lens: Optional[torch.Tensor], windows: torch.Tensor, lens: torch.Tensor,
               q_pos0: torch.Tensor, qo_indptr: torch.Tensor, list_indptr: torch.Tensor,
               list_pos0: torch.Tensor, full_indices: torch.Tensor) -> None:
    """Positions, qo_indptr, every list's indptr/pos0 and the full list's locs, in one launch.

    For b < bs = len(req_pool_indices): lens[b] = seq_lens[b]; q_pos0[b] = seq_lens[b] - ext[b]
    (ext = extend_lens, or ones when it is None: DECODE); qo_indptr[:bs+1] = [0, cumsum(ext)].
    List j (window W_j = windows[j], 0 for the full list): list_pos0[j, b] = max(0, q_pos0[b] - W_j + 1)
    (0 when W_j is 0), list_indptr[j, :bs+1] = [0, cumsum(seq_lens - list_pos0[j])]. The full list:
    full_indices[list_indptr[0, b] + k] = req_to_token[req_pool_indices[b], k] for k < seq_lens[b].
    """
    lists = (lens, q_pos0, qo_indptr, list_indptr, list_pos0, full_indices)
    _check_lists(req_to_token, req_pool_indices, seq_lens, extend_lens, windows, *lists)
    if req_pool_indices.shape[0] == 0:
        list_indptr[:, 0].zero_()
        qo_indptr[:1].zero_()
        return
    _launch_fill(req_to_token, req_pool_indices, seq_lens, extend_lens, windows, lists, None)


def fill_translated(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                    extend_lens: Optional[torch.Tensor], windows: torch.Tensor, lens: torch.Tensor,
                    q_pos0: torch.Tensor, qo_indptr: torch.Tensor, list_indptr: torch.Tensor,
                    list_pos0: torch.Tensor, full_indices: torch.Tensor, mapping: torch.Tensor, loc: torch.Tensor,
                    loc_out: torch.Tensor, window_indices: torch.Tensor) -> None:
    """`fill_lists`, `translate_into(mapping, loc, loc_out)` and, for each window i (list 1 + i),
    `translate_runs(mapping, req_to_token, req_pool_indices, list_pos0[1 + i], list_indptr[1 + i],
    window_indices[i])`, in one launch (a batch of none: the first two alone). `window_indices`:
    [len(windows) - 1, cap] int64, contiguous rows."""
    lists = (lens, q_pos0, qo_indptr, list_indptr, list_pos0, full_indices)
    _check_lists(req_to_token, req_pool_indices, seq_lens, extend_lens, windows, *lists)
    _check_into(mapping, loc, loc_out)
    _need(window_indices.dim() == 2 and window_indices.shape[0] == windows.shape[0] - 1
          and window_indices.stride(1) == 1, f"window_indices must be [{windows.shape[0] - 1}, cap], contiguous rows")
    _need(window_indices.device == mapping.device, "window_indices and mapping must share a device")
    if window_indices.dtype != torch.int64:
        raise LocError(f"window_indices must be int64, got {window_indices.dtype}")
    if req_pool_indices.shape[0] == 0:
        fill_lists(req_to_token, req_pool_indices, seq_lens, extend_lens, windows, *lists)
        translate_into(mapping, loc, loc_out)
        return
    _launch_fill(req_to_token, req_pool_indices, seq_lens, extend_lens, windows, lists,
                 (mapping, loc, loc_out, window_indices, loc.shape[0], loc_out.shape[0], mapping.shape[0],
                  window_indices.stride(0), window_indices.shape[1]))


def _copies(bs: int) -> int:
    """Programs that copy one request's full list (fixed per batch size, so a graph bucket's grid is; a runtime
    argument, so batch sizes share one compiled kernel): a
    batch of one copies its 4K-32K locs in 16 programs side by side instead of one program's 4-32 serial
    steps; from 128 requests the batch alone fills the device. Two under the interpreter (the striding
    stays tested)."""
    if _INTERPRETED:
        return 2
    return max(1, min(16, 128 // bs))


@triton.jit(do_not_specialize=["cap", "map_len"])
def _translate_runs_kernel(mapping, req_to_token, req_pool_indices, pos0, indptr, out,
                           stride_rtt, rtt_cols, cap, map_len, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    start = tl.load(indptr + b).to(tl.int64)
    n = tl.load(indptr + b + 1).to(tl.int64) - start
    first = tl.load(pos0 + b).to(tl.int64)
    src = req_to_token + tl.load(req_pool_indices + b).to(tl.int64) * stride_rtt + first
    _copy_run(src, out + start, n, first, rtt_cols, cap - start, mapping, map_len, 0, 1, True, BLOCK)


def translate_runs(mapping: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                   pos0: torch.Tensor, indptr: torch.Tensor, out: torch.Tensor) -> None:
    """out[indptr[b] + j] = mapping[req_to_token[req_pool_indices[b], pos0[b] + j]], one launch (1-D lists of
    stride 1)."""
    bs = req_pool_indices.shape[0]
    _need(req_to_token.dim() == 2 and req_to_token.stride(1) == 1, "req_to_token must be [rows, ctx], contiguous rows")
    _need(pos0.shape[0] >= bs and indptr.shape[0] >= bs + 1, f"pos0/indptr must hold {bs}/{bs + 1} entries")
    _need(out.dim() == 1 and out.stride(0) == 1 and mapping.stride(0) == 1, "out and mapping must be contiguous 1-D")
    _need(req_pool_indices.dim() == 1 and pos0.dim() == 1 and indptr.dim() == 1,
          "req_pool_indices, pos0 and indptr must be 1-D")
    _unit_stride(req_pool_indices=req_pool_indices, pos0=pos0, indptr=indptr)
    if out.dtype != torch.int64:
        raise LocError(f"out must be int64, got {out.dtype}")
    if bs == 0:
        return
    block, _, warps = _launch_sizes()
    launch(_LAUNCHES, ("runs", bs), _translate_runs_kernel, (bs,),
           (mapping, req_to_token, req_pool_indices, pos0, indptr, out,
            req_to_token.stride(0), req_to_token.shape[1], out.shape[0], mapping.shape[0]),
           dict(BLOCK=block, num_warps=warps))


_INTERPRETED = jit_interpreted(_translate_into_kernel)
_LAUNCHES: Dict[Tuple, Launch] = {}  # planned launches of the refill kernels, by kernel and grid
KERNELS = GraphRefillKernels(translate_into, translate_runs, fill_lists, fill_translated)
