"""ReadBack: each forward's sampled tokens (and, where pages moved, the allocator's free counts) on their way to the
host: one asynchronous copy into a pinned block per forward, no wait when issued; read in issue order, a forward
leaving the list only once its values are read, so an interrupted wait (Ctrl-C) loses none."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch

from hwkv.batch import ForwardMode
from hwkv.engine.forward import HOST
from hwkv.engine.scheduler import Row
from hwkv.staging import record_on

# what the free counts add to a forward's block: the rings' tails (device), their host heads, and the (full, SWA)
# slots only the prefix cache held then (evictable)
Held = Tuple[torch.Tensor, List[int], Tuple[int, int]]


@dataclass
class Inflight:
    """A forward issued and not yet read back: its sampling rows, the pinned block its tokens (and the free counts,
    when `heads` is set: the rings' host heads at that moment) are copied into, the copy's event."""

    sampled: List[Row]
    buf: torch.Tensor
    event: Any
    heads: Optional[List[int]]
    mode: ForwardMode
    cached: Tuple[int, int] = (0, 0)  # (full, SWA) slots only the prefix cache held then (evictable)
    done: int = -1     # the rows the engine has read so far (-1: not started, its free counts not yet recorded)
    dropped: int = 0   # of those, tokens sampled after their request's stop (never counted)


class ReadBack:
    """The engine's forwards in flight, oldest first (`inflight`), and the pinned blocks their values travel in:
    `size` values a block (the sampled tokens, then the rings' tails), two blocks reused in turn."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.device = device
        self._blocks = [torch.zeros(size, **HOST, pin_memory=device.type != "cpu") for _ in range(2)]
        self.inflight: List[Inflight] = []
        self._sent = 0

    def send(self, sampled: List[Row], tokens: Optional[torch.Tensor], mode: ForwardMode,
             held: Optional[Held] = None) -> None:
        """A forward's sampled tokens (one per `sampled` row; None: none) and, with `held`, the free counts' tails,
        on their way to the host in one block: copies issued after the forward's work, not waited for."""
        buf, n = self._block(), len(sampled)
        source = self.device   # the copies' device, with its index where a tensor names it
        if tokens is not None:
            buf[:n].copy_(tokens, non_blocking=True)
            source = tokens.device
        heads, cached = None, (0, 0)
        if held is not None:
            tails, heads, cached = held
            buf[n:n + len(heads)].copy_(tails, non_blocking=True)
            source = tails.device
        self.inflight.append(Inflight(sampled, buf, self._event(source), heads, mode, cached))

    def read_oldest(self) -> Tuple[Inflight, List[int]]:
        """The oldest forward in flight and its values (its tokens, then the tails where it holds heads), waiting
        for its copy; it stays listed: the reader takes it off once its values are applied."""
        rec = self.inflight[0]
        if rec.event is not None:
            rec.event.synchronize()
        return rec, rec.buf[:len(rec.sampled) + (0 if rec.heads is None else len(rec.heads))].tolist()

    def _block(self) -> torch.Tensor:
        """The pinned block a forward's values are copied into: the next of the blocks, or one more where that one
        is still in flight (after an interrupted read-back, or beside a verify's free counts)."""
        buf = self._blocks[self._sent % len(self._blocks)]
        if any(rec.buf is buf for rec in self.inflight):
            buf = torch.zeros_like(buf, pin_memory=buf.is_pinned())
            self._blocks.append(buf)
        self._sent += 1
        return buf

    def _event(self, source: torch.device) -> Any:
        """An event after the copies just issued from `source` (None on the CPU, where they are done)."""
        if self.device.type == "cpu":
            return None
        event = torch.Event(device=self.device.type)
        record_on(event, source)
        return event
