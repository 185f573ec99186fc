"""`ReqToTokenPool`: the request rows of token locs (`req_to_token[row, pos]`), with their free list.

A table of its own, apart from the allocators that hand out the locs it holds.
"""
from __future__ import annotations

from typing import List, Sequence, Union

import torch

from hwkv.checks import as_int, check_device, check_int_dtype, check_on_device, normal_tensors
from hwkv.errors import ConfigError, DoubleFreeError, LocError, OutOfSlotsError
from hwkv.pool import check_memory_fits
from hwkv.torch_page_ops import I64


class ReqToTokenPool:
    """Rows of locs per request: `req_to_token[row, pos]` is the full-pool loc of token `pos`."""

    @normal_tensors
    def __init__(self, size: int, max_context_len: int, device: Union[str, torch.device]) -> None:
        n, ctx = as_int(size), as_int(max_context_len)
        if n is None or ctx is None or n < 1 or ctx < 1:
            raise ConfigError(f"size={size!r} and max_context_len={max_context_len!r} must be integers >= 1")
        self.size, self.max_context_len, self.device = n, ctx, check_device(device)
        check_memory_fits(f"ReqToTokenPool(size={n}, max_context_len={ctx})", 8 * n * ctx, self.device, "its table")
        self.req_to_token = torch.zeros(n, ctx, dtype=I64, device=self.device)
        self._free = list(range(n - 1, -1, -1))
        self._free_set = set(self._free)  # (a free checks against it: no set of the whole list built per call)

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, need_size: int = 1) -> List[int]:
        n = as_int(need_size)
        if n is None or n < 0:
            raise ConfigError(f"alloc({need_size!r}): need_size must be an integer >= 0 (request rows)")
        if n > len(self._free):
            raise OutOfSlotsError(f"need {need_size} request rows, only {len(self._free)} of {self.size} are free")
        rows = [self._free.pop() for _ in range(n)]
        self._free_set.difference_update(rows)
        return rows

    def free(self, rows: Union[int, Sequence[int]]) -> None:
        """Return rows to the pool; every row is checked (in range, held, named once) before any is freed."""
        self._give_back(self.check_free(rows))

    def _give_back(self, rows: List[int]) -> None:
        """`free` of rows `check_free` returned (a caller that checked them before freeing what they hold)."""
        self._free.extend(rows)
        self._free_set.update(rows)

    def check_free(self, rows: Union[int, Sequence[int]]) -> List[int]:
        """The rows a `free(rows)` would return, checked as it checks them (LocError, DoubleFreeError), changing
        nothing: for a caller that frees what the rows hold first."""
        try:
            rows = [self._row(r) for r in ([rows] if as_int(rows) is not None else rows)]
        except TypeError:  # not iterable
            raise LocError(f"request rows must be an integer or a sequence of integers, got {type(rows).__name__} "
                           f"{rows!r}") from None
        seen = set()
        for r in rows:
            if r in self._free_set or r in seen:
                raise DoubleFreeError(f"request row {r} is already free"
                                      + (" (named twice in this free)" if r not in self._free_set else ""))
            seen.add(r)
        return rows

    def write(self, row: int, start: int, locs: torch.Tensor) -> None:
        """req_to_token[row, start:start+len(locs)] = locs, bounds-checked (a negative row or start would wrap)."""
        row = self._row(row)
        if not isinstance(locs, torch.Tensor) or locs.dim() != 1:
            got = f"shape {list(locs.shape)}" if isinstance(locs, torch.Tensor) else type(locs).__name__
            raise LocError(f"locs must be a 1-D tensor, got {got}")
        check_int_dtype("locs", locs)
        check_on_device("locs", locs, self.device, "table")
        if as_int(start) is None:
            raise LocError(f"start {start!r} of a write to request row {row} must be an integer")
        end = start + int(locs.shape[0])
        if start < 0:
            raise LocError(f"start {start} of a write to request row {row} must be >= 0")
        if end > self.max_context_len:
            raise LocError(f"positions up to {end} exceed max_context_len {self.max_context_len}")
        self.req_to_token[row, start:end] = locs

    def row_locs(self, row: int, seq_len: int) -> torch.Tensor:
        """req_to_token[row, :seq_len], the row and the length checked (LocError naming the one out of range)."""
        row = self._row(row)
        if as_int(seq_len) is None:
            raise LocError(f"seq_len {seq_len!r} must be an integer")
        if not 0 <= seq_len <= self.max_context_len:
            raise LocError(f"seq_len {seq_len} is outside [0, max_context_len {self.max_context_len}]")
        return self.req_to_token[row, :seq_len]

    def _row(self, row: object) -> int:
        """row as an int inside [0, size) (ints, numpy and 0-d/1-element torch integers), else LocError."""
        r = as_int(row)  # (bools are no rows)
        if r is None:
            raise LocError(f"request row must be an integer, got {type(row).__name__} {row!r}")
        if not 0 <= r < self.size:
            raise LocError(f"request row {r} is outside [0, {self.size})")
        return r

    def check_integrity(self) -> None:
        assert len(set(self._free)) == len(self._free), "a request row is free twice"
        assert self._free_set == set(self._free), "the free rows' set disagrees with their list"
