"""Kernel dispatch by device type: device packages register fast ops, torch code is the default.

The core calls these from the pool and the metadata step; a device package only supplies
kernels here (it never translates locations: the pool and the backend's base class decide what
is translated and when, and count it).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict, NamedTuple, Optional

import torch

from hwkv.checks import check_tensors
from hwkv.csr_checks import check_store
from hwkv.errors import ConfigError

if TYPE_CHECKING:
    from hwkv.loc import ListRefill

_STORE: Dict[str, Callable[..., None]] = {}
_STORE_PRECHECKED: Dict[str, Callable[..., None]] = {}
_FILL: Dict[str, Callable[..., None]] = {}
_REFILL: Dict[str, "GraphRefillKernels"] = {}
_TREE_DECODE: Dict[str, Callable[..., None]] = {}
_STEP: Dict[str, "StepKernels"] = {}

# OCP e4m3fn / e5m2, and e4m3fnuz: the fp8 that MI300 (gfx942) computes in, so ROCm pools feeding AITER's fp8
# kernels there must hold it (ROCm/aiter aiter/utility/dtypes.py: gfx942 -> float8_e4m3fnuz, gfx950 -> e4m3fn)
FP8_DTYPES = tuple(d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None),
                               getattr(torch, "float8_e4m3fnuz", None)) if d)


def register_store_kv(device_type: str, fn: Callable[..., None],
                      prechecked: Optional[Callable[..., None]] = None) -> None:
    """Use `fn(k_buf, v_buf, loc, k, v, k_scale, v_scale)` for pools on `device_type`.

    `prechecked` (optional): the same store for callers that already checked `loc` (1-D int64 on the
    buffers' device, in range) and the k/v shapes, as the pool does; it may skip its own argument
    checks, except those the caller cannot know about (strides, devices of k and v).
    """
    _STORE[device_type] = fn
    _STORE_PRECHECKED[device_type] = prechecked or fn


def register_fill_kv_indices(device_type: str, fn: Callable[..., None]) -> None:
    """Use `fn(req_to_token, req_pool_indices, pos0, indptr, out)` on `device_type` (over the core's own lists: no
    argument checks needed)."""
    _FILL[device_type] = fn


class GraphRefillKernels(NamedTuple):
    """The fused graph-metadata refill of a device (see `hwkv_cuda.kernels.refill` for one).

    translate_into(mapping, loc, out):  out[:n] = mapping[loc], out[n:] = 0; one launch.
    translate_runs(mapping, req_to_token, req_pool_indices, pos0, indptr, out):
        out[indptr[b] + j] = mapping[req_to_token[req_pool_indices[b], pos0[b] + j]]; one launch.
    fill_lists(req_to_token, req_pool_indices, seq_lens, extend_lens, windows, lens, q_pos0,
               qo_indptr, list_indptr, list_pos0, full_indices):
        positions, qo_indptr and every list's indptr/pos0 (list 0 is the full list, window 0), and
        the full list's locs; extend_lens None means DECODE (one token per request); one launch.
    fill_translated(req_to_token, req_pool_indices, seq_lens, extend_lens, windows, lens, q_pos0, qo_indptr,
                    list_indptr, list_pos0, full_indices, mapping, loc, loc_out, window_indices):
        optional (None: the three above, 2 + windows launches): a hybrid pool's whole refill in one launch,
        fill_lists plus translate_into(mapping, loc, loc_out) plus, for window i (list 1 + i),
        translate_runs(mapping, req_to_token, req_pool_indices, list_pos0[1 + i], list_indptr[1 + i],
        window_indices[i]); window_indices is [len(windows) - 1, cap], one row per window list.
    """

    translate_into: Callable[..., None]
    translate_runs: Callable[..., None]
    fill_lists: Callable[..., None]
    fill_translated: Optional[Callable[..., None]] = None


def register_graph_refill(device_type: str, kernels: GraphRefillKernels) -> None:
    """Refill graph metadata on `device_type` with these fused kernels (the torch path stays the default)."""
    _REFILL[device_type] = kernels


def graph_refill_kernels(device_type: str) -> Optional[GraphRefillKernels]:
    """The fused refill kernels registered for `device_type`, or None (the backend's torch path)."""
    return _REFILL.get(device_type)


def register_tree_decode(device_type: str, fn: Callable[..., None]) -> None:
    """Build the decode-like tree verify's lists on `device_type` with `fn` (signature of
    `hwkv_cuda.kernels.tree.tree_decode_fill`); `hwkv.spec.tree_decode_list`'s torch path stays the default."""
    _TREE_DECODE[device_type] = fn


def tree_decode_kernel(device_type: str) -> Optional[Callable[..., None]]:
    """The fused tree-decode list builder registered for `device_type`, or None (the torch path)."""
    return _TREE_DECODE.get(device_type)


class StepKernels(NamedTuple):
    """The whole-step graph's bookkeeping around the allocation (`hwkv.step_graph`), one launch each.

    prologue(ctl, rows_in, seq_in, pad_row, req_to_token, rows, seq, prefix, last, out, tokens=1): for
        b < len(rows), live = b < ctl[2]; rows[b] = rows_in[b] if live else pad_row; seq[b] = seq_in[b] if live
        else tokens; prefix[b] = seq[b] - live * tokens; last[b] = req_to_token[rows[b], max(prefix[b] - 1, 0)];
        out[:len(rows) * tokens] = 0.
    write(req_to_token, rows, seq, out, frontiers, f, tokens=1): req_to_token[rows[b], seq[b] - tokens + j] =
        out[b * tokens + j] for j < tokens (`tokens` > 1: a verify step's drafts) and, when frontiers is not
        None, f[b] = frontiers[rows[b]].
    """

    prologue: Callable[..., None]
    write: Callable[..., None]


def step_prologue_torch(ctl: torch.Tensor, rows_in: torch.Tensor, seq_in: torch.Tensor, pad_row: int,
                        req_to_token: torch.Tensor, rows: torch.Tensor, seq: torch.Tensor, prefix: torch.Tensor,
                        last: torch.Tensor, out: torch.Tensor, tokens: int = 1) -> None:
    """`StepKernels.prologue` in torch ops (the default; about a dozen launches)."""
    bs = rows.shape[0]
    live = torch.arange(bs, device=rows.device) < ctl[2]
    rows.copy_(rows_in[:bs]).masked_fill_(~live, pad_row)
    seq.copy_(seq_in[:bs]).masked_fill_(~live, tokens)
    torch.sub(seq, live.to(seq.dtype), alpha=tokens, out=prefix)
    last.copy_(req_to_token[rows, (prefix - 1).clamp_(min=0)])
    out.zero_()


def step_write_torch(req_to_token: torch.Tensor, rows: torch.Tensor, seq: torch.Tensor, out: torch.Tensor,
                     frontiers: Optional[torch.Tensor], f: Optional[torch.Tensor], tokens: int = 1) -> None:
    """`StepKernels.write` in torch ops (the default)."""
    if tokens == 1:
        req_to_token[rows, seq - 1] = out
    else:
        at = seq.unsqueeze(1) - tokens + torch.arange(tokens, dtype=seq.dtype, device=seq.device)
        req_to_token[rows.unsqueeze(1), at] = out.view(-1, tokens)
    if frontiers is not None:
        f.copy_(frontiers[rows])


TORCH_STEP = StepKernels(step_prologue_torch, step_write_torch)


def register_step_kernels(device_type: str, kernels: StepKernels) -> None:
    """Run the whole-step graph's bookkeeping on `device_type` with these kernels (torch stays the default)."""
    _STEP[device_type] = kernels


def step_kernels(device_type: str) -> StepKernels:
    """The step kernels registered for `device_type`, else the torch ones."""
    return _STEP.get(device_type, TORCH_STEP)


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: Optional[float]) -> torch.Tensor:
    """x / scale cast to `dtype` (clamped to the fp8 range). x is never written; where nothing changes (x's own dtype,
    no scale) the result is x itself, so a caller must not write into it (the stores only read it, every layer)."""
    if scale is not None and scale != 1.0:
        x = x.float() / scale  # out of place: never divide the caller's tensor
    if dtype in FP8_DTYPES:
        fmax = torch.finfo(dtype).max
        x = x.float().clamp(-fmax, fmax)
    return x.to(dtype)


def store_kv_torch(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, k_scale: Optional[float] = None, v_scale: Optional[float] = None) -> None:
    """Reference store: k_buf[loc] = k / k_scale, v_buf[loc] = v / v_scale. Where nothing is quantized (the
    pool's dtype, no scale) the rows are copied straight in: one index_copy_ each, no cast or indexing
    machinery (a layer's store on CPU, ~4x fewer dispatches); index_copy_ takes int64 indices only, so an int32 loc
    (which `check_store` allows) is widened first. K/V from a forward in grad mode are stored detached: the pools
    never join the caller's autograd graph (which would keep every step's activations alive)."""
    if k.requires_grad or v.requires_grad:
        k, v = k.detach(), v.detach()
    if k.dtype == k_buf.dtype and v.dtype == v_buf.dtype and k_scale in (None, 1.0) and v_scale in (None, 1.0) \
            and k_buf.dtype not in FP8_DTYPES:
        if loc.dtype != torch.int64:
            loc = loc.long()
        k_buf.index_copy_(0, loc, k)
        v_buf.index_copy_(0, loc, v)
        return
    k_buf[loc] = quantize(k, k_buf.dtype, k_scale)
    v_buf[loc] = quantize(v, v_buf.dtype, v_scale)


def checked_store(prechecked: Callable[..., None]) -> Callable[..., None]:
    """A store that checks its arguments (`hwkv.csr_checks.check_store`: LocError / ShapeError before anything is
    written) and then runs `prechecked`, for a device whose store kernel checks nothing itself
    (`register_store_kv(device, checked_store(fn), prechecked=fn)`)."""
    def store(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              k_scale: Optional[float] = None, v_scale: Optional[float] = None) -> None:
        check_store(k_buf, v_buf, loc, k, v)
        prechecked(k_buf, v_buf, loc, k, v, k_scale, v_scale)
    return store


# the torch store behind the checks: a device without a store kernel of its own gets the typed errors a kernel's
# store gives (an index past the pool had been a bare IndexError, -1 a silent write into the last slot)
store_kv_checked = checked_store(store_kv_torch)


def store_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, k_scale: Optional[float] = None, v_scale: Optional[float] = None) -> None:
    """Write K/V of the new tokens at `loc` with the device's registered kernel (checked: see
    `register_store_kv`)."""
    if type(loc) is not torch.Tensor or type(k_buf) is not torch.Tensor:   # (what the dispatch reads: typed first)
        check_tensors(k_buf=k_buf, v_buf=v_buf, loc=loc, k=k, v=v)
    if loc.numel() == 0:   # nothing to write: no launch, but the same refusals as a store of some rows
        check_store(k_buf, v_buf, loc, k, v)
        return
    _STORE.get(k_buf.device.type, store_kv_checked)(k_buf, v_buf, loc, k, v, k_scale, v_scale)


def store_kv_prechecked(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, k_scale: Optional[float] = None, v_scale: Optional[float] = None) -> None:
    """`store_kv` for a caller that checked `loc` and the k/v shapes itself (the pool, per layer)."""
    if loc.shape[0] == 0:
        return
    _STORE_PRECHECKED.get(k_buf.device.type, store_kv_torch)(k_buf, v_buf, loc, k, v, k_scale, v_scale)


def fill_kv_indices_torch(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, pos0: torch.Tensor,
                          indptr: torch.Tensor, out: torch.Tensor) -> None:
    """out[indptr[b] + j] = req_to_token[req_pool_indices[b], pos0[b] + j]; no host sync.

    Vectorized over the whole capacity of `out`: entries past indptr[-1] get slot 0.
    """
    bs = req_pool_indices.numel()
    cap = out.numel()
    if cap == 0:
        return
    if bs == 0:
        out.zero_()
        return
    idx = torch.arange(cap, device=out.device, dtype=torch.int64)
    ends = indptr[1:].to(torch.int64)
    b = torch.searchsorted(ends, idx, right=True).clamp_(max=bs - 1)
    off = idx - indptr[:-1].to(torch.int64)[b]
    valid = idx < ends[-1]
    col = (pos0[b] + off).clamp_(0, req_to_token.shape[1] - 1)
    vals = req_to_token[req_pool_indices.to(torch.int64)[b], col]
    out.copy_(torch.where(valid, vals, torch.zeros_like(vals)))


def fill_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, pos0: torch.Tensor,
                    indptr: torch.Tensor, out: torch.Tensor) -> None:
    """Gather each request's run of locs from `req_to_token` into the CSR list `out`."""
    _FILL.get(out.device.type, fill_kv_indices_torch)(req_to_token, req_pool_indices, pos0, indptr, out)


# ---- translation through a full->SWA table (called by the pool, the one place that translates) ----
def translate_into(mapping: torch.Tensor, loc: torch.Tensor, out: torch.Tensor) -> None:
    """out[:n] = mapping[loc], out[n:] = 0 (a graph-static buffer: no stale slot in its tail)."""
    kernels = _REFILL.get(out.device.type)
    if kernels is not None:
        kernels.translate_into(mapping, loc, out)
        return
    n = loc.shape[0]
    torch.take(mapping, loc.long(), out=out[:n])   # as mapping[loc]: -1 ("no loc") reads mapping[-1] (-1); take
    #                                                 wants int64 indices, the kernels take int32 too
    out[n:].zero_()


def fill_translated(mapping: torch.Tensor, loc: torch.Tensor, out: torch.Tensor, lists: "ListRefill") -> None:
    """out[:n] = mapping[loc], out[n:] = 0 and `lists` filled (their window lists translated) in the one launch of
    the device's `GraphRefillKernels.fill_translated` (the caller checked that it has one)."""
    kernels = _REFILL.get(out.device.type)
    if kernels is None or kernels.fill_translated is None:
        raise ConfigError(f"no fused refill kernel (GraphRefillKernels.fill_translated) registered for "
                          f"{out.device.type!r} tensors")
    kernels.fill_translated(*lists[:-1], mapping, loc, out, lists.window_indices)


def translate_runs(mapping: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                   pos0: torch.Tensor, indptr: torch.Tensor, out: torch.Tensor) -> None:
    """out[indptr[b] + j] = mapping[req_to_token[req_pool_indices[b], pos0[b] + j]]: a CSR list gathered
    and translated at once (fused on devices with refill kernels; the torch path gathers, then maps)."""
    kernels = _REFILL.get(out.device.type)
    if kernels is not None:
        kernels.translate_runs(mapping, req_to_token, req_pool_indices, pos0, indptr, out)
        return
    fill_kv_indices(req_to_token, req_pool_indices, pos0, indptr, out)
    out.copy_(mapping[out])
