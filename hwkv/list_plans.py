"""ListPlans: a vendor op's per-list tables, made only for the lists its layers read; one rule every device shares."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

from hwkv.batch import ForwardBatch
from hwkv.metadata import ForwardMetadata, KVIndexList

Plan = Callable[[ForwardMetadata, KVIndexList], Any]
Refill = Callable[[ForwardMetadata, ForwardBatch, Optional[int]], Any]


class ListPlans:
    """One backend's plans for one vendor op (IPEX's slot or page tables, AITER's int32 lists), per forward and list
    (its window; None: the full list), kept in `md.extra[key]`.

    Contract:
    - `open(md, batch, graph, enabled)` runs once per forward, in the backend's `init_kernel_metadata`. With
      `enabled` False (the op is off, or off for this forward) nothing opens, and `get` answers None all forward.
      In graph mode it refills, before the replay, the lists recorded at capture (with `per_mode`, only those the
      forward's mode, decode or extend, recorded): `refill(md, batch, window)`, by default `fill` over the
      forward's own list.
    - `get(md, kv)` from a layer the op runs: the list's plan, made by the forward's first such layer and reused by
      the others. Eager: `make(md, kv)`. Graph mode (capture's eager warm-up): `fill(md, kv)` writes it into the
      backend's static tables (`graph_tables(md)`) and the list is recorded; a `fill` that answers None (the list is
      not one those tables hold) records nothing and `get` answers None: the layer runs the portable kernels.
    - A forward that was never opened (metadata built without kernel metadata, such as a graph decode-like verify's
      own lists) plans nothing. Host work: a dict lookup per layer, one plan per forward and list read.
    """

    def __init__(self, key: str, make: Plan, fill: Plan, refill: Optional[Refill] = None,
                 per_mode: bool = False) -> None:
        self.key, self.make, self.fill, self.per_mode = key, make, fill, per_mode
        self.refill: Refill = refill or (lambda md, batch, w: fill(md, md.full if w is None else md.windows[w]))
        # (mode, window) of the lists a layer read in graph mode, in the order read (mode: md.is_decode with
        # per_mode, else None); a dict for its order
        self.recorded: Dict[Tuple[Optional[bool], Optional[int]], None] = {}

    def _mode(self, md: ForwardMetadata) -> Optional[bool]:
        return md.is_decode if self.per_mode else None

    def open(self, md: ForwardMetadata, batch: ForwardBatch, graph: bool, enabled: bool = True) -> None:
        """This forward's plans, empty (eager) or the recorded lists' refilled (graph); none when not `enabled`."""
        if not enabled:
            return
        plans = md.extra[self.key] = {}
        if graph:
            mode = self._mode(md)
            for m, w in self.recorded:
                if m == mode:
                    plans[w] = self.refill(md, batch, w)

    def opened(self, md: ForwardMetadata) -> bool:
        """Whether `open` opened this forward: the backend may ask before its per-layer checks."""
        return self.key in md.extra

    def get(self, md: ForwardMetadata, kv: KVIndexList) -> Any:
        """The plan of the list `kv` in this forward, made by its first reader; None: the op does not run here."""
        plans = md.extra.get(self.key)
        if plans is None:
            return None
        plan = plans.get(kv.window)
        if plan is not None:
            return plan
        if not md.graph:
            plan = self.make(md, kv)
        else:
            plan = self.fill(md, kv)
            if plan is None:
                return None
            self.recorded[(self._mode(md), kv.window)] = None
        plans[kv.window] = plan
        return plan
