"""The chunked CPU kernels' host plan: what they read of a forward's index lists on the host, once per forward.

The ops of `hwkv_cpu.kernels` read a CSR list on the host (`tolist`) and derive per-request work from it (decode:
the request order, the key-column split, slot tables and masks; extend: the query-block tasks; sgl-kernel's
tables). Every layer of a forward reads the same few lists, so that is done by the first layer reading each list
and kept here for the others (`host_lists`). Layers of one forward find it through the backend's forward counter
(`new_epoch`): an int64 tensor that every metadata step advances (`next_forward`: eagerly, and in a graph runner's
refill, which runs before each replay), and that each layer hands the ops.

The rule this rests on: the metadata step writes the lists before it advances the counter, and nothing rewrites
them until the next metadata step (a multi-step draft's k steps keep their own lists alive under one count). Within
one count a list is then known by its tensors' data pointers and lengths. A list rewritten in place within a count
would be read stale, silently: a backend in debug mode (`HWKV_DEBUG`) re-reads the lists at every reuse and
raises if they changed. A call without a counter (the public `decode_attention` / `extend_attention`) plans for
itself.

Why not the forward's metadata (`md.extra`, where the dense path keeps its plans): the chunked kernels run as torch
custom ops, also inside `torch.compile`d layers, and an op sees tensors only; the counter is the tensor that names
the forward there.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch

_SHIFT = 40  # a backend's counter starts at its own multiple of 2**40: no two backends' counts meet
_BASES = itertools.count(1)
_LOCK = threading.Lock()
_FORWARDS: Dict[int, Tuple[int, Dict[Tuple[Any, ...], "HostLists"]]] = {}  # base -> (count, that forward's lists)


_CHECKED: Set[int] = set()  # the bases of counters whose reuses re-read the lists (debug mode)


def new_epoch(owner: Any, debug: bool = False) -> torch.Tensor:
    """A forward counter for `owner` (a backend): int64 [1]; the plans kept for it go when the owner does. `debug`:
    every reuse of a kept list checks it against the list's tensors now."""
    base = next(_BASES) << _SHIFT
    weakref.finalize(owner, _FORWARDS.pop, base, None)
    if debug:
        _CHECKED.add(base)
        weakref.finalize(owner, _CHECKED.discard, base)
    with torch.inference_mode(False):  # a normal tensor: advanced in and out of inference mode alike
        return torch.full((1,), base, dtype=torch.int64, device="cpu")


def next_forward(epoch: torch.Tensor) -> None:
    """A new forward: the plans of the previous one are never read again (a torch op, so graphs record it)."""
    epoch.add_(1)


class HostLists:
    """One forward's list as the kernels read it on the host: `lists` (each tensor's tolist(), read once) and what
    the kernels derive from it, kept by key (`plans`: the caller's keys, e.g. a window and thread count)."""

    __slots__ = ("lists", "plans")

    def __init__(self, lists: List[list]) -> None:
        self.lists = lists
        self.plans: Dict[Tuple[Any, ...], Any] = {}

    def get(self, key: Tuple[Any, ...], make: Callable[[], Any]) -> Any:
        """The plan kept under `key`, made by `make` the first time."""
        if key in self.plans:
            return self.plans[key]
        plan = self.plans[key] = make()
        return plan


def host_lists(epoch: Optional[torch.Tensor], read: Tuple[torch.Tensor, ...],
               also: Tuple[Optional[torch.Tensor], ...] = ()) -> HostLists:
    """The host lists of `read` (their tolist()) for plans that depend on `also` too (a list's slots, a verify
    tree): this forward's, made by the first call that reads them (with `epoch`), or made for this call (without)."""
    if epoch is None:
        return HostLists([t.tolist() for t in read])
    key = tuple(None if t is None else (t.data_ptr(), t.shape[0]) for t in read + also)
    count = int(epoch)
    base = count >> _SHIFT << _SHIFT
    with _LOCK:
        kept = _FORWARDS.get(base)
        if kept is None or kept[0] != count:
            kept = _FORWARDS[base] = (count, {})
        lists = kept[1].get(key)
    if lists is None:
        made = HostLists([t.tolist() for t in read])
        with _LOCK:
            lists = kept[1].setdefault(key, made)
    elif base in _CHECKED and [t.tolist() for t in read] != lists.lists:
        raise AssertionError("a forward's index list changed after its metadata step (hwkv_cpu.host_plan's rule: "
                             "the lists are written before the forward counter moves and not again until it moves)")
    return lists
