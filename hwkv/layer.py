"""A model's attention layer as the backend sees it."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from hwkv.checks import scale_value
from hwkv.errors import ConfigError
from hwkv.window import no_window


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

    def __post_init__(self) -> None:
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.scaling is None:
            self.scaling = 1.0 / math.sqrt(self.head_dim)
        if self.v_head_dim is None:
            self.v_head_dim = self.head_dim
        if self.sliding_window is not None and self.sliding_window < 0:
            raise ConfigError(f"sliding_window={self.sliding_window} must be >= 1 (or None for full attention)")
        if self.sinks is not None and tuple(self.sinks.shape) != (self.num_heads,):
            raise ConfigError(f"sinks has shape {tuple(self.sinks.shape)}, expected ({self.num_heads},)")
        # scales become host floats here, once, so no layer forward ever reads a device scalar
        self.k_scale = None if self.k_scale is None else scale_value("k_scale", self.k_scale)
        self.v_scale = None if self.v_scale is None else scale_value("v_scale", self.v_scale)
        if self.logit_cap < 0:
            raise ConfigError(f"logit_cap={self.logit_cap} must be >= 0 (0 = off)")

    @property
    def window(self) -> Optional[int]:
        """W, or None for a full-attention layer."""
        return None if no_window(self.sliding_window) else self.sliding_window

    @property
    def is_swa(self) -> bool:
        return self.window is not None
