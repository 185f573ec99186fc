"""Counting the device reads a piece of host code makes (the contract's "host work once per forward, not per layer").

`HostReads` is a torch dispatch mode: every op that hands a tensor's values to the host is one read: `.item()` and
`bool()`/`int()` of a tensor (`_local_scalar_dense`, `is_nonzero`), `nonzero`, and a copy from a device tensor into
host memory that is not `non_blocking` (`.cpu()`, `.tolist()` of a device tensor, `.to("cpu")`). On the CPU a
`.tolist()` or `.numpy()` reads memory directly and is not seen: the count is exact on accelerators and a lower bound
on the CPU."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


class HostReads(TorchDispatchMode):
    """`with HostReads() as r: ...` counts the device reads the block makes (`r.count`; `r.ops`: their op names)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.ops: List[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Tuple[Any, ...] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        name = str(func)
        if name in _SCALAR_READS or _device_to_host(name, args, kwargs):
            self.count += 1
            self.ops.append(name)
        return func(*args, **kwargs)


class StorageReads(TorchDispatchMode):
    """`with StorageReads(t) as r: ...` counts the ops in the block that take a tensor viewing `t`'s storage
    (`r.count`, `r.ops`): the contract's check that the layers never read the pool's full->SWA table. Kernels given
    raw pointers (Triton launches) are not seen: the count is a lower bound."""

    def __init__(self, t: torch.Tensor) -> None:
        super().__init__()
        self.ptr = t.untyped_storage().data_ptr()
        self.count = 0
        self.ops: List[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Tuple[Any, ...] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == self.ptr:
                self.count += 1
                self.ops.append(str(func))
                break
        return func(*args, **kwargs)
