"""Argument checks at the boundary: each names the argument, what was expected and what came."""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from hwkv.env import HWKV_DEBUG
from hwkv.errors import LocError, ShapeError


def values_checkable(t: torch.Tensor) -> bool:
    """Value checks (min/max) cost a host sync on accelerators: always on CPU, else only in debug mode;
    never while torch.compile traces (a value read there re-specializes the graph on every call)."""
    if torch.compiler.is_compiling():
        return False
    if t.device.type == "cpu":
        return True
    if not HWKV_DEBUG.get():
        return False
    is_capturing = getattr(getattr(torch, t.device.type, None), "is_current_stream_capturing", None)
    return not (is_capturing and is_capturing())


def check_loc(name: str, loc: torch.Tensor, limit: int, device: torch.device) -> None:
    """`loc` must be a 1-D int64 tensor on `device` (its index too, when `device` names one) with
    values in [0, limit)."""
    if not isinstance(loc, torch.Tensor):
        raise LocError(f"{name} must be a torch.Tensor, got {type(loc).__name__}")
    if loc.dtype != torch.int64:
        raise LocError(f"{name} must be int64, got {loc.dtype}")
    if loc.dim() != 1:
        raise LocError(f"{name} must be 1-D, got shape {tuple(loc.shape)}")
    dev = torch.device(device)
    if loc.device.type != dev.type or (dev.index is not None and loc.device.index != dev.index):
        raise LocError(f"{name} is on {loc.device}, the pool is on {device}")
    if loc.numel() and values_checkable(loc):
        lo, hi = int(loc.min()), int(loc.max())
        if lo < 0 or hi >= limit:
            raise LocError(f"{name} holds values in [{lo}, {hi}], allowed range is [0, {limit})")


def check_shape(name: str, t: torch.Tensor, expected: Sequence[Optional[int]]) -> None:
    """`t.shape` must match `expected` (None = any size in that dimension)."""
    ok = t.dim() == len(expected) and all(e is None or e == s for e, s in zip(expected, t.shape))
    if not ok:
        want = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise ShapeError(f"{name} has shape {list(t.shape)}, expected {want}")


def scale_value(name: str, scale: Union[None, float, int, torch.Tensor]) -> float:
    """A K/V scale as a host float (None -> 1.0). A tensor scale costs one host read: layers
    convert theirs once at construction, so kernels on the hot path only ever see floats."""
    if scale is None:
        return 1.0
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ShapeError(f"{name} must be a scalar, got shape {list(scale.shape)}")
        return float(scale.item())
    return float(scale)
