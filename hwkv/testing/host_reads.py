"""Counting the device reads a piece of host code makes (the contract's "host work once per forward, not per layer").

`HostReads` is a torch dispatch mode: every op that hands a tensor's values to the host is one read: `.item()` and
`bool()`/`int()` of a tensor (`_local_scalar_dense`, `is_nonzero`), `nonzero`, and a copy from a device tensor into
host memory that is not `non_blocking` (`.cpu()`, `.tolist()` of a device tensor, `.to("cpu")`). On the CPU a
`.tolist()` or `.numpy()` reads memory directly and is not seen: the count is exact on accelerators and a lower bound
on the CPU."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_SCALAR_READS = frozenset({"aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.nonzero.default"})


def _device_to_host(name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    """Whether the op copies a device tensor's values into host memory and waits for them."""
    if kwargs.get("non_blocking"):
        return False
    if name.startswith("aten._to_copy") and args and isinstance(args[0], torch.Tensor):
        dev = kwargs.get("device")
        return args[0].device.type != "cpu" and dev is not None and torch.device(dev).type == "cpu"
    if name.startswith("aten.copy_") and len(args) > 1 and all(isinstance(a, torch.Tensor) for a in args[:2]):
        return args[0].device.type == "cpu" and args[1].device.type != "cpu" and not (args[2:3] and args[2])
    return False


def _tensors(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> List[torch.Tensor]:
    """Every tensor an op takes, inside lists too (`aten.index`'s indices, `cat`'s inputs)."""
    return [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]


def _storage(t: torch.Tensor) -> Optional[int]:
    """Where a tensor's values live (its storage's address), None where it has no plain storage (nested, sparse)."""
    try:
        return t.untyped_storage().data_ptr() if t.layout == torch.strided and not t.is_nested else None
    except (RuntimeError, NotImplementedError):
        return None


class HostReads(TorchDispatchMode):
    """`with HostReads() as r: ...` counts the device reads the block makes (`r.count`; `r.ops`: their op names).
    `host`: tensors whose values live on the host by design (an engine's host copies of the lengths): reads of
    them, and of what is computed from them alone, are no device reads (on the CPU they would look like one)."""

    def __init__(self, host: Sequence[Optional[torch.Tensor]] = ()) -> None:
        super().__init__()
        self.count = 0
        self.ops: List[str] = []
        self._kept = [t for t in host if t is not None]   # (alive, so their addresses stay theirs)
        self._host = {_storage(t) for t in self._kept} - {None}

    def _on_host(self, t: torch.Tensor) -> bool:
        return bool(self._host) and _storage(t) in self._host

    def __torch_dispatch__(self, func: Any, types: Any, args: Tuple[Any, ...] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        name = str(func)
        inputs = _tensors(args, kwargs) if self._host else []
        from_host = bool(inputs) and all(self._on_host(t) for t in inputs)
        if (name in _SCALAR_READS or _device_to_host(name, args, kwargs)) and not from_host:
            self.count += 1
            self.ops.append(name)
        out = func(*args, **kwargs)
        if from_host:   # what is computed from host copies alone lives on the host too
            for t in _tensors((out,), {}):
                ptr = _storage(t)
                if ptr is not None:
                    self._host.add(ptr)
                    self._kept.append(t)
        return out


class StorageReads(TorchDispatchMode):
    """`with StorageReads(t) as r: ...` counts the ops in the block that take a tensor viewing `t`'s storage
    (`r.count`, `r.ops`), lists of tensors included: the contract's check that the layers never read the pool's
    full->SWA table. Kernels given raw pointers (Triton launches) are not seen: the count is a lower bound."""

    def __init__(self, t: torch.Tensor) -> None:
        super().__init__()
        self.ptr = _storage(t)
        self.count = 0
        self.ops: List[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Tuple[Any, ...] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if any(_storage(a) == self.ptr for a in _tensors(args, kwargs)):
            self.count += 1
            self.ops.append(str(func))
        return func(*args, **kwargs)
