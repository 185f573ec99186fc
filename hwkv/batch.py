"""What the engine hands over each forward."""
from __future__ import annotations

import enum
import operator
from dataclasses import dataclass
from typing import Any, List, Optional

import torch

from hwkv.checks import as_int, check_host_copy, check_int_dtype, check_on_device, check_rows, values_checkable
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

    def is_decode_or_idle(self) -> bool:
        """Modes with at most one new token per request: IDLE is a forward of no requests (a rank of data-parallel
        attention with nothing to run still runs its layers), planned as a DECODE of none."""
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)

    def is_extend_like(self) -> bool:
        """Modes whose queries run the extend kernel (several tokens per request)."""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)


_REQUIRED = ("req_pool_indices", "seq_lens", "out_cache_loc")  # ForwardBatch fields that are never None
_INTEGERS = ("extend_prefix_lens", "positions")  # integer fields beside the tensors checked one by one below
# the fields a metadata step reads on the backend's device (or the CPU)
_DEVICE_FIELDS = ("req_pool_indices", "seq_lens", "out_cache_loc", "extend_seq_lens", "extend_prefix_lens", "positions")


def check_seq_lens(seq_h: List[int], max_context_len: int) -> None:
    """1 <= each host length <= max_context_len (the ReqToTokenPool's): a ShapeError naming the first that is not
    (C-level min/max over the list; nothing per request in Python unless refused)."""
    if seq_h and (min(seq_h) < 1 or max(seq_h) > max_context_len):
        i = next(i for i, n in enumerate(seq_h) if not 1 <= n <= max_context_len)
        raise ShapeError(f"seq_lens[{i}] is {seq_h[i]}; allowed range is [1, {max_context_len}] (the "
                         "ReqToTokenPool's max_context_len)")


@dataclass
class ForwardBatch:
    """One forward: requests' rows, lengths after this forward, and the new tokens' full-pool locs.

    `extend_seq_lens` is required for extend-like modes; for DECODE each request adds one token.
    `extend_prefix_lens` is optional: the metadata steps derive each prefix as `seq_lens - extend_seq_lens`
    (a graph runner copies it into its static batch when given). `seq_lens_cpu`/`extend_seq_lens_cpu`
    (optional host copies, as engines keep them) let the eager metadata step size its lists without a
    host sync. Rows, locs, positions and lengths are integer tensors: a float or bool one is a LocError here.
    `batch_size` is an integer >= 0 (a numpy or 0-d tensor one is stored as an int): else a ShapeError here.
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
        bs = as_int(self.batch_size)  # 2.0 would match the tensors' lengths and fail later in torch; True would be 1
        if bs is None or bs < 0:
            raise ShapeError(f"batch_size must be an integer >= 0 (the number of requests), got {self.batch_size!r}")
        self.batch_size = bs  # numpy and 0-d tensor integers become ints
        for name in ("req_pool_indices", "seq_lens", "out_cache_loc", "extend_seq_lens", "extend_prefix_lens",
                     "seq_lens_cpu", "extend_seq_lens_cpu"):   # a list here would fail below as an AttributeError
            t = getattr(self, name)
            if not (isinstance(t, torch.Tensor) or (t is None and name not in _REQUIRED)):
                raise ShapeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            check_int_dtype(name, t)  # a float or bool row, loc or length: LocError naming the dtype (a host attribute)
        for name in _INTEGERS:
            check_int_dtype(name, getattr(self, name))
        if self.forward_mode.is_idle() and (self.batch_size or self.out_cache_loc.shape[0]):
            raise ShapeError(f"IDLE is a forward without requests: batch_size is {self.batch_size} and out_cache_loc "
                             f"has {self.out_cache_loc.shape[0]} entries, both must be 0")
        # shapes only (host attributes): the values are checked where host copies exist (init_forward_metadata)
        for name in ("req_pool_indices", "seq_lens", "extend_seq_lens", "extend_prefix_lens", "seq_lens_cpu",
                     "extend_seq_lens_cpu"):
            t = getattr(self, name)
            if t is not None and (t.dim() != 1 or t.shape[0] != self.batch_size):
                got = f"{t.shape[0]} entries" if t.dim() == 1 else f"shape {list(t.shape)}"
                raise ShapeError(f"{name} has {got}, batch_size is {self.batch_size}")
        # a strided view (one column of a table) becomes a contiguous copy, so every backend's lists read the same
        # values (kernels read them with stride 1); a contiguous tensor stays the caller's own: host attributes only
        for name in ("req_pool_indices", "seq_lens", "extend_seq_lens"):
            t = getattr(self, name)
            if t is not None and not t.is_contiguous():
                setattr(self, name, t.contiguous())
        if self.forward_mode.is_extend_like() and self.extend_seq_lens is None:
            raise ShapeError(f"{self.forward_mode.name} needs extend_seq_lens (new tokens per request)")
        steps = getattr(self.spec_info, "num_steps", 1)  # hwkv.spec.MultiStepDraft: that many tokens each
        if self.forward_mode.is_decode() and self.out_cache_loc.shape[0] != self.batch_size * steps:
            per = "one token" if steps == 1 else f"{steps} tokens (MultiStepDraft)"
            raise ShapeError(f"DECODE writes {per} per request: out_cache_loc has "
                             f"{self.out_cache_loc.shape[0]} entries, batch_size is {self.batch_size}")

    def check_devices(self, device: torch.device) -> None:
        """The batch's tensors are on the backend's device or the CPU (host copies): a LocError naming the device
        otherwise (a meta tensor holds no values; another device's cannot be indexed), before any is read."""
        ok = ("cpu", device.type)
        for t in (self.req_pool_indices, self.seq_lens, self.out_cache_loc, self.extend_seq_lens,
                  self.extend_prefix_lens, self.positions):   # (per step: attribute reads, a call only to refuse)
            if t is not None and t.device.type not in ok:
                for name in _DEVICE_FIELDS:
                    check_on_device(name, getattr(self, name), device, "backend")

    @property
    def num_tokens(self) -> int:
        return int(self.out_cache_loc.shape[0])

    def extend_lens(self) -> torch.Tensor:
        """New tokens per request (ones for DECODE, and for IDLE's no requests)."""
        if self.forward_mode.is_decode_or_idle():
            return torch.ones_like(self.seq_lens)
        return self.extend_seq_lens

    def checkable_seq_lens(self) -> Optional[torch.Tensor]:
        """The lengths the host may read with no sync: the caller's host copy, else seq_lens where its values are
        checkable (CPU; elsewhere only in debug mode, never while capturing); None otherwise."""
        if self.seq_lens_cpu is not None:
            return self.seq_lens_cpu
        return self.seq_lens if values_checkable(self.seq_lens) else None

    def host_lens(self) -> "tuple[torch.Tensor, torch.Tensor]":
        """(seq_lens, extend lens) as int64 CPU tensors: the engine's host copies when given
        (no sync), else one device-to-host read each; DECODE's (and IDLE's) extend lens are known ones."""
        seq = self.seq_lens_cpu if self.seq_lens_cpu is not None else self.seq_lens.cpu()
        if self.forward_mode.is_decode_or_idle():
            ext = torch.ones(self.batch_size, dtype=torch.int64, device="cpu")  # not torch's default device
        elif self.extend_seq_lens_cpu is not None:
            ext = self.extend_seq_lens_cpu
        else:
            ext = self.extend_seq_lens.cpu()
        return seq.to("cpu", torch.int64), ext.to("cpu", torch.int64)  # (no copy of int64 CPU tensors)

    def check_lens(self, seq_h: List[int], ext_h: List[int], rows: int, max_context_len: int) -> None:
        """The batch against a req_to_token table of `rows` x `max_context_len`, typed (ShapeError, LocError), before
        a metadata step translates or builds anything: 1 <= seq_lens <= max_context_len, 0 <= extend lens <= seq_lens
        summing to out_cache_loc's length, 0 <= req_pool_indices < rows. `seq_h`/`ext_h` are the host lengths the
        step read anyway (`host_lens`, as lists): C-level min/max/sum over them, no device read and nothing per
        request in Python. The rows have no host copy: checked where their values are checkable (CPU; elsewhere
        only with HWKV_DEBUG, never while capturing)."""
        bs = self.batch_size
        for name, lens in (("seq_lens", seq_h), ("extend_seq_lens", ext_h)):
            if len(lens) != bs:  # a host copy that disagrees with the batch (a field changed after construction)
                raise ShapeError(f"{name} has {len(lens)} entries (its host copy), batch_size is {bs}")
        for name in ("req_pool_indices", "seq_lens", "extend_seq_lens"):   # (a field set since: attribute reads)
            t = getattr(self, name)
            if t is not None and t.shape != (bs,):
                raise ShapeError(f"{name} has shape {list(t.shape)}, batch_size is {bs}")
        check_seq_lens(seq_h, max_context_len)
        if bs and not self.forward_mode.is_decode_or_idle():  # (DECODE's token count: checked at construction)
            if min(ext_h) < 0 or min(map(operator.sub, seq_h, ext_h)) < 0:
                i = next(i for i, (n, e) in enumerate(zip(seq_h, ext_h)) if not 0 <= e <= n)
                raise ShapeError(f"extend_seq_lens[{i}] is {ext_h[i]}; allowed range is [0, seq_lens[{i}]] = "
                                 f"[0, {seq_h[i]}]")
            if sum(ext_h) != self.num_tokens:
                raise ShapeError(f"extend_seq_lens sum to {sum(ext_h)} new tokens, out_cache_loc has "
                                 f"{self.num_tokens}")
        check_rows(self.req_pool_indices, rows)
        # a host copy that disagrees with its tensor sizes the lists from one and fills them from the other: compared
        # where both are readable for free (the tensor on the CPU)
        if self.seq_lens_cpu is not None:
            check_host_copy("seq_lens", self.seq_lens, self.seq_lens_cpu)
        if self.extend_seq_lens_cpu is not None and self.extend_seq_lens is not None:
            check_host_copy("extend_seq_lens", self.extend_seq_lens, self.extend_seq_lens_cpu)
