"""Small per-step host data to the device in one copy, without a wait and without a fresh pinned block.

A step's host values (control words, rows, lengths) travel in one asynchronous copy from pinned memory. A
pinned block must not be rewritten before the device has read it: `StagingRing` rotates through `slots`
blocks, each with an event recorded after its copy, and waits on a block's event only when the device is a
whole ring of steps behind (then the host has nothing better to do). `torch.Tensor.pin_memory()` per step
is the simple alternative and costs a pinned allocation each time (about 16 us on the H200 host).
"""
from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional

import numpy as np
import torch


@functools.lru_cache(maxsize=None)
def _device_module(device_type: str) -> Any:
    """torch's module for a device type (torch.cuda, torch.xpu, ...), looked up once: `record_on` runs every step."""
    return torch.get_device_module(device_type)


def record_on(event: torch.Event, device: torch.device) -> None:
    """Record `event` on `device`'s current stream, where a copy into or out of its memory was just issued (the
    event's own default, the current device's stream, misses that copy when another device is current). `device`:
    the copied tensor's, which names its index."""
    event.record(_device_module(device.type).current_stream(device))


class StagingRing:
    """`slots` pinned int64 host blocks of `n` values bound for `device`; `next()` hands out the next one (as a
    numpy array to fill), `send(dst)` copies its first len(dst) values into `dst`. On the CPU (or where memory
    cannot be pinned) one plain block serves: the copy is synchronous there."""

    def __init__(self, n: int, device: torch.device, slots: int = 64) -> None:
        self.device = torch.device(device)
        self._blocks: List[torch.Tensor] = []  # zeroed: a send may carry values past those its caller wrote
        if self.device.type != "cpu":
            try:
                self._blocks = [torch.zeros(n, dtype=torch.int64, device="cpu", pin_memory=True) for _ in range(slots)]
            except RuntimeError:  # no pinned memory here: copies from pageable memory finish before returning
                self._blocks = []
        self.pinned = bool(self._blocks)
        if not self.pinned:
            self._blocks = [torch.zeros(n, dtype=torch.int64, device="cpu")]
        self._events: List[Optional[torch.Event]] = [
            torch.Event(device=self.device.type) if self.pinned else None for _ in self._blocks]
        self._recorded = [False] * len(self._blocks)
        self._arrays = [b.numpy() for b in self._blocks]
        # each block's leading views by length, made once: a tensor slice per step costs more than the copy
        self._heads: List[Dict[int, torch.Tensor]] = [{} for _ in self._blocks]
        self._i = -1

    def next(self) -> np.ndarray:
        """The next block to fill (waits only if the device has not yet read it: a whole ring behind)."""
        self._i = i = (self._i + 1) % len(self._blocks)
        if self._recorded[i] and not self._events[i].query():
            self._events[i].synchronize()
        return self._arrays[i]

    def send(self, dst: torch.Tensor) -> None:
        """Copy the current block's first len(dst) values into dst (asynchronous from pinned memory)."""
        i, k = self._i, dst.shape[0]
        src = self._heads[i].get(k)
        if src is None:
            src = self._heads[i][k] = self._blocks[i][:k]
        dst.copy_(src, non_blocking=self.pinned)
        if self.pinned:
            record_on(self._events[i], dst.device)
            self._recorded[i] = True
