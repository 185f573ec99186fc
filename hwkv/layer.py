"""A model's attention layer as the backend sees it."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch

from hwkv.checks import LOGIT_CAP_LIMITS, as_layer_id, check_sink_values, logit_cap_ok, scale_value
from hwkv.errors import ConfigError
from hwkv.window import no_window


def _int_at_least_1(val: object) -> bool:
    """An int (numpy's too, not a bool) >= 1."""
    return isinstance(val, numbers.Integral) and not isinstance(val, bool) and val >= 1


def _finite_float(name: str, val: object, what: str) -> float:
    """A finite real (numpy's too, not a bool) as a host float; else ConfigError naming it (a NaN or inf scale
    would make every output NaN, silently)."""
    if isinstance(val, bool) or not isinstance(val, numbers.Real) or not math.isfinite(val):
        raise ConfigError(f"{name}={val!r} must be a finite number ({what}), got {type(val).__name__}")
    return float(val)


@dataclass(eq=False)
class AttentionLayer:
    """Geometry and options of one attention layer; `sliding_window` is W in Hugging Face meaning."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: Optional[float] = None
    v_head_dim: Optional[int] = None
    sliding_window: Optional[int] = None
    logit_cap: float = 0.0
    sinks: Optional[torch.Tensor] = None
    k_scale: Optional[float] = None
    v_scale: Optional[float] = None
    # the sinks' storage_key whose values passed `check_sink_values` (here, or in the backend's forward when a caller
    # assigned other sinks since): a forward checks the values only of sinks it has not seen
    sinks_checked: Optional[Tuple[int, torch.dtype]] = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        layer_id = as_layer_id(self.layer_id)
        if layer_id is None:  # True or 1.0 would find layer 1 in a pool
            raise ConfigError(f"layer_id={self.layer_id!r} must be an int >= 0")
        self.layer_id = layer_id
        # geometry first: 1/sqrt(head_dim) below, and W = 0 would silently mean full attention
        for name, or_none in (("num_heads", None), ("num_kv_heads", None), ("head_dim", None),
                              ("v_head_dim", "head_dim"), ("sliding_window", "full attention")):
            val = getattr(self, name)
            if not (or_none and val is None) and not _int_at_least_1(val):
                none = f" (or None for {or_none})" if or_none else ""
                raise ConfigError(f"{name}={val!r} must be an int >= 1{none}")
            if val is not None and val >= 2 ** 63:  # kernels and torch ops take it as int64
                raise ConfigError(f"{name}={val!r} must be below 2**63")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.scaling is None:
            self.scaling = 1.0 / math.sqrt(self.head_dim)
        self.scaling = _finite_float("scaling", self.scaling, "the softmax scale; None for 1/sqrt(head_dim)")
        if self.v_head_dim is None:
            self.v_head_dim = self.head_dim
        if self.sinks is not None and not isinstance(self.sinks, torch.Tensor):
            raise ConfigError(f"sinks must be a torch.Tensor of shape ({self.num_heads},) (one per query head), got "
                              f"{type(self.sinks).__name__} {self.sinks!r}")
        if self.sinks is not None and tuple(self.sinks.shape) != (self.num_heads,):
            raise ConfigError(f"sinks has shape {tuple(self.sinks.shape)}, expected ({self.num_heads},)")
        if self.sinks is not None and not self.sinks.is_contiguous():  # kernels read sinks + head
            raise ConfigError(f"sinks has strides {tuple(self.sinks.stride())}; they must be contiguous (stride 1): "
                              "pass sinks.contiguous(), not a strided view such as one column of a table")
        if self.sinks is not None:
            check_sink_values(self.sinks)
            self.sinks_checked = storage_key(self.sinks)
        # scales become host floats here, once, so no layer forward ever reads a device scalar
        self.k_scale = None if self.k_scale is None else scale_value("k_scale", self.k_scale)
        self.v_scale = None if self.v_scale is None else scale_value("v_scale", self.v_scale)
        cap = self.logit_cap
        if not logit_cap_ok(cap):
            raise ConfigError(f"logit_cap={cap!r} must be a finite number >= 0 (0 = off), {LOGIT_CAP_LIMITS}")

    @property
    def window(self) -> Optional[int]:
        """W, or None for a full-attention layer."""
        return None if no_window(self.sliding_window) else self.sliding_window

    @property
    def is_swa(self) -> bool:
        return self.window is not None


def storage_key(t: Optional[torch.Tensor]) -> Optional[Tuple[int, torch.dtype]]:
    """Where a tensor kept by identity reads its values (address, dtype): the same object whose storage was swapped
    (`param.data = new`, as weight loaders and `vector_to_parameters` do) reads elsewhere, so what was kept from
    it (a view, a launch's alignment and dtype) is stale."""
    return None if t is None else (t.data_ptr(), t.dtype)
