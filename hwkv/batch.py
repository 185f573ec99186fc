"""What the engine hands over each forward."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional

import torch

from hwkv.errors import ConfigError, ShapeError


class ForwardMode(enum.IntEnum):
    EXTEND = 1
    DECODE = 2
    MIXED = 3
    TARGET_VERIFY = 4
    DRAFT_EXTEND = 5
    IDLE = 6

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_extend_like(self) -> bool:
        """Modes whose queries run the extend kernel (several tokens per request)."""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)


@dataclass
class ForwardBatch:
    """One forward: requests' rows, lengths after this forward, and the new tokens' full-pool locs.

    `extend_prefix_lens`/`extend_seq_lens` are required for extend-like modes; for DECODE each
    request adds one token. `seq_lens_cpu`/`extend_seq_lens_cpu` (optional host copies, as engines
    keep them) let the eager metadata step size its lists without a host sync.
    """

    forward_mode: ForwardMode
    batch_size: int
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    extend_prefix_lens: Optional[torch.Tensor] = None
    extend_seq_lens: Optional[torch.Tensor] = None
    positions: Optional[torch.Tensor] = None
    spec_info: Any = None
    seq_lens_cpu: Optional[torch.Tensor] = None
    extend_seq_lens_cpu: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if not isinstance(self.forward_mode, ForwardMode):  # e.g. "decode": typed here, not an AttributeError below
            members = ", ".join(f"ForwardMode.{m}" for m in ForwardMode.__members__)
            raise ConfigError(f"forward_mode is {self.forward_mode!r} ({type(self.forward_mode).__name__}), not a "
                              f"ForwardMode; use one of {members}")
        if self.forward_mode.is_idle():
            return
        for name in ("req_pool_indices", "seq_lens"):
            t = getattr(self, name)
            if t.shape[0] != self.batch_size:
                raise ShapeError(f"{name} has {t.shape[0]} entries, batch_size is {self.batch_size}")
        if self.forward_mode.is_extend_like() and self.extend_seq_lens is None:
            raise ShapeError(f"{self.forward_mode.name} needs extend_seq_lens (new tokens per request)")
        steps = getattr(self.spec_info, "num_steps", 1)  # hwkv.spec.MultiStepDraft: that many tokens each
        if self.forward_mode.is_decode() and self.out_cache_loc.shape[0] != self.batch_size * steps:
            per = "one token" if steps == 1 else f"{steps} tokens (MultiStepDraft)"
            raise ShapeError(f"DECODE writes {per} per request: out_cache_loc has "
                             f"{self.out_cache_loc.shape[0]} entries, batch_size is {self.batch_size}")

    @property
    def num_tokens(self) -> int:
        return int(self.out_cache_loc.shape[0])

    def extend_lens(self) -> torch.Tensor:
        """New tokens per request (ones for DECODE)."""
        if self.forward_mode.is_decode():
            return torch.ones_like(self.seq_lens)
        return self.extend_seq_lens

    def host_lens(self) -> "tuple[torch.Tensor, torch.Tensor]":
        """(seq_lens, extend lens) as int64 CPU tensors: the engine's host copies when given
        (no sync), else one device-to-host read each; DECODE's extend lens are known ones."""
        seq = self.seq_lens_cpu if self.seq_lens_cpu is not None else self.seq_lens.cpu()
        if self.forward_mode.is_decode():
            ext = torch.ones(self.batch_size, dtype=torch.int64, device="cpu")  # not torch's default device
        elif self.extend_seq_lens_cpu is not None:
            ext = self.extend_seq_lens_cpu
        else:
            ext = self.extend_seq_lens.cpu()
        return seq.to(torch.int64), ext.to(torch.int64)
