"""Checks of an attention call's CSR index lists, shared by the device packages' public kernels.

Dtypes are host attributes, checked on every checked call. Values (`check_csr_values`) are read only where
`hwkv.checks.values_checkable` allows (CPU tensors; accelerators in debug mode): an indptr starts at >= 0,
never decreases and ends inside what it indexes, and the listed slots lie in the pool. Entries of kv_indices
outside [kv_indptr[0], kv_indptr[-1]) are never read, so they are not checked (docs/architecture.md).
`check_slots` is the range check alone, for a store's write locs.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from hwkv.checks import check_shape, check_tensors, value_range, values_checkable
from hwkv.errors import CapacityError, LocError, ShapeError

INDEX_DTYPES = (torch.int32, torch.int64)


def check_index_dtypes(named: Sequence[Tuple[str, torch.Tensor]]) -> None:
    """Each (name, tensor) is int32 or int64 (LocError names the tensor and its dtype)."""
    for name, t in named:
        if t.dtype not in INDEX_DTYPES:
            raise LocError(f"{name} must be int32 or int64, got {t.dtype}")


def check_float_dtypes(named: Sequence[Tuple[str, Optional[torch.Tensor]]]) -> None:
    """Each (name, tensor) not None is floating point (fp8 included; ShapeError names the tensor and its dtype)."""
    for name, t in named:
        if t is not None and not t.dtype.is_floating_point:
            raise ShapeError(f"{name} must be a floating-point tensor, got {t.dtype}")


def indptr_span(name: str, ptr: torch.Tensor, limit: int, what: str) -> Tuple[int, int]:
    """(first, last) of an indptr that starts at >= 0, never decreases and ends at <= limit."""
    vals = ptr.tolist()
    first, last = vals[0], vals[-1]
    if first < 0:
        raise LocError(f"{name} starts at {first}; an indptr starts at >= 0")
    if vals != sorted(vals):  # sorted() is linear on an already sorted list
        b = next(i for i in range(len(vals) - 1) if vals[i + 1] < vals[i])
        raise LocError(f"{name} decreases at {b}: {name}[{b}] = {vals[b]} > {name}[{b + 1}] = {vals[b + 1]}")
    if last > limit:
        raise LocError(f"{name} ends at {last}, past {what}")
    return first, last


def check_csr_values(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, slots: int,
                     qo_indptr: Optional[torch.Tensor] = None, rows: int = 0, max_q_len: Optional[int] = None) -> None:
    """Where values are checkable: kv_indptr spans kv_indices (0 <= kv_indptr[0] <= ... <= kv_indptr[-1] <=
    kv_indices.numel()), its entries lie in the pool's slots [0, slots), and qo_indptr (extend) spans q's `rows`
    the same way, no run longer than `max_q_len` (the bound that sizes a grid: rows past it were never written).
    Call after the dtype and shape checks (1-D int tensors on one device)."""
    if not values_checkable(kv_indices):
        return
    if qo_indptr is not None:
        indptr_span("qo_indptr", qo_indptr, rows, f"q's {rows} rows")
        if max_q_len is not None and qo_indptr.shape[0] > 1:
            runs = qo_indptr[1:] - qo_indptr[:-1]
            b = int(torch.argmax(runs))
            if int(runs[b]) > max_q_len:
                raise CapacityError(f"request {b} has {int(runs[b])} query rows (qo_indptr); max_q_len={max_q_len} "
                                    "bounds every request's (the rows past it would not be written)")
    start, end = indptr_span("kv_indptr", kv_indptr, kv_indices.shape[0], f"kv_indices' {kv_indices.shape[0]} entries")
    _check_range("kv_indices", kv_indices, slots, start, end)


def check_slots(name: str, loc: torch.Tensor, slots: int) -> None:
    """Where values are checkable: every entry of the 1-D int tensor `loc` lies in the pool's slots [0, slots)
    (a store's write locs)."""
    if loc.shape[0] and values_checkable(loc):
        _check_range(name, loc, slots, 0, loc.shape[0])


def _check_range(name: str, t: torch.Tensor, slots: int, start: int, end: int) -> None:
    """Entries [start, end) of the 1-D int tensor `t` lie in [0, slots)."""
    if end <= start:
        return
    used = t[start:end]
    lo, hi = value_range(used)
    if lo < 0 or hi >= slots:
        i = start + int(torch.nonzero((used < 0) | (used >= slots))[0, 0])
        listed = "" if (start, end) == (0, t.shape[0]) else f" (entries [{start}, {end}) are listed)"
        raise LocError(f"{name}[{i}] = {int(t[i])} lies outside the pool's slots [0, {slots}){listed}")


def check_dims(name: str, t: torch.Tensor, expected: Sequence[Optional[int]]) -> None:
    """`t.shape` must match `expected` (None = any size) and its last dim must be contiguous (as kernels read it)."""
    check_shape(name, t, expected)
    if t.numel() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ShapeError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")


def check_same_device(**tensors: Optional[torch.Tensor]) -> None:
    """Every given tensor lives on the device of the first one."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ShapeError(f"{name} is on {t.device}, {first_name} is on {first.device}")


def check_store(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> None:
    """A K/V store's arguments (`hwkv.ops.store_kv`, every device's): loc a 1-D int64 (or int32) list of unit
    stride with values in the pool's slots (where checkable), k [n, KVH, D] and v [n, KVH, Dv] matching the
    buffers, all on one device. LocError / ShapeError before anything is written."""
    check_tensors(k_buf=k_buf, v_buf=v_buf, loc=loc, k=k, v=v)
    if loc.dtype not in (torch.int64, torch.int32) or loc.dim() != 1:
        raise LocError(f"loc must be a 1-D int64 (or int32) tensor, got {loc.dtype} {list(loc.shape)}")
    if loc.stride(0) != 1 and loc.shape[0] > 1:  # a kernel reads loc + row: a strided view would name other slots
        raise LocError(f"loc has stride {loc.stride(0)}; the store reads it with stride 1: pass loc.contiguous()")
    check_dims("k_buf", k_buf, [None, None, None])
    n, kvh = loc.shape[0], k_buf.shape[1]
    check_dims("v_buf", v_buf, [k_buf.shape[0], kvh, None])
    check_dims("k", k, [n, kvh, k_buf.shape[2]])
    check_dims("v", v, [n, kvh, v_buf.shape[2]])
    check_same_device(k_buf=k_buf, v_buf=v_buf, loc=loc, k=k, v=v)
    check_slots("loc", loc, k_buf.shape[0])  # values: CPU / HWKV_DEBUG only (hwkv.checks.values_checkable)
