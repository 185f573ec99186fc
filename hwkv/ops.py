"""Kernel dispatch by device type: device packages register fast ops, torch code is the default.

The core calls these from the pool and the metadata step; a device package only supplies
kernels here (it never translates locations).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

_STORE: Dict[str, Callable[..., None]] = {}
_FILL: Dict[str, Callable[..., None]] = {}

FP8_DTYPES = tuple(d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d)


def register_store_kv(device_type: str, fn: Callable[..., None]) -> None:
    """Use `fn(k_buf, v_buf, loc, k, v, k_scale, v_scale)` for pools on `device_type`."""
    _STORE[device_type] = fn


def register_fill_kv_indices(device_type: str, fn: Callable[..., None]) -> None:
    """Use `fn(req_to_token, req_pool_indices, pos0, indptr, out)` on `device_type`."""
    _FILL[device_type] = fn


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: Optional[float]) -> torch.Tensor:
    """x / scale cast to `dtype` (clamped to the fp8 range); always a new tensor, x is untouched."""
    if scale is not None and scale != 1.0:
        x = x.float() / scale  # out of place: never divide the caller's tensor
    if dtype in FP8_DTYPES:
        fmax = torch.finfo(dtype).max
        x = x.float().clamp(-fmax, fmax)
    return x.to(dtype)


def store_kv_torch(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, k_scale: Optional[float] = None, v_scale: Optional[float] = None) -> None:
    """Reference store: k_buf[loc] = k / k_scale, v_buf[loc] = v / v_scale."""
    k_buf[loc] = quantize(k, k_buf.dtype, k_scale)
    v_buf[loc] = quantize(v, v_buf.dtype, v_scale)


def store_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, k_scale: Optional[float] = None, v_scale: Optional[float] = None) -> None:
    """Write K/V of the new tokens at `loc` with the device's registered kernel."""
    if loc.numel() == 0:
        return
    _STORE.get(k_buf.device.type, store_kv_torch)(k_buf, v_buf, loc, k, v, k_scale, v_scale)


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
