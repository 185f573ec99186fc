"""Counting the device reads a piece of host code makes (the contract's "host work once per forward, not per layer").

`HostReads` is a torch dispatch mode that counts, as one read each, the ops that make the host wait for a tensor's
values: `.item()` and `bool()`/`int()` of a tensor (`_local_scalar_dense`, `is_nonzero`); a copy from a device tensor
into host memory that is not `non_blocking` (`.cpu()`, `.tolist()` of a device tensor, `.to("cpu")`); and the ops whose
output's size depends on the values (the host reads them to allocate it): `nonzero` (`torch.where(mask)`, `argwhere`),
indexing with a bool or uint8 mask (`x[mask]`; `x[mask] = y` too, unless aten runs it as a `masked_fill`: one mask,
one value in host memory), `masked_select`, `repeat_interleave` with tensor repeats and no `output_size`, `unique` in
every form, and `bincount`. Reads inside an op's own kernel are not seen, and on the CPU a `.tolist()` or `.numpy()`
reads memory directly: the count is a lower bound, exact on accelerators for code whose syncs are these ops."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_SCALAR_READS = frozenset({"aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.nonzero.default"})
# ops whose output's size is read from the values (the host waits for them to allocate it)
_SIZE_READS = frozenset({"aten.masked_select.default", "aten.bincount.default", "aten._unique.default",
                         "aten._unique2.default", "aten.unique_consecutive.default", "aten.unique_dim.default",
                         "aten.unique_dim_consecutive.default"})
_INDEX_PUTS = frozenset({"aten.index_put.default", "aten.index_put_.default", "aten._index_put_impl_.default"})
_MASKS = (torch.bool, torch.uint8)


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


def _sized_by_values(name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> List[torch.Tensor]:
    """The tensors whose values the op reads on the host to size its output (empty: none)."""
    if name in _SIZE_READS:
        return _tensors(args, kwargs)
    if name.startswith("aten.repeat_interleave.") and kwargs.get("output_size") is None:
        repeats = args[0] if name == "aten.repeat_interleave.Tensor" else (args[1:2] or [kwargs.get("repeats")])[0]
        return [repeats] if isinstance(repeats, torch.Tensor) else []   # (self_int's: a number, no read)
    if name == "aten.index.Tensor" or name in _INDEX_PUTS:
        masks = [i for i in (args[1] if len(args) > 1 else kwargs.get("indices", ()))
                 if isinstance(i, torch.Tensor) and i.dtype in _MASKS]
        if masks and name in _INDEX_PUTS and _becomes_masked_fill(args, kwargs, masks):
            return []
        return masks
    return []


def _becomes_masked_fill(args: Tuple[Any, ...], kwargs: Dict[str, Any], masks: List[torch.Tensor]) -> bool:
    """`x[mask] = value` that aten runs as `masked_fill_` (no read of the mask): one mask on x's device, every other
    index a full slice, one value in host memory (a Python number), not accumulating."""
    self, indices = args[0], args[1]
    value = args[2] if len(args) > 2 else kwargs.get("values")
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    return (len(masks) == 1 and masks[0].device == self.device and not accumulate
            and isinstance(value, torch.Tensor) and value.numel() == 1 and value.device.type == "cpu"
            and all(i is None or i is masks[0] for i in indices))


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

    def _reads_for_size(self, name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
        """Whether the op reads device values to size its output: some tensor it sizes by is neither a host copy nor
        (a mask over a device tensor) in host memory."""
        read = _sized_by_values(name, args, kwargs)
        on_device = bool(args) and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu"
        return any(not (self._on_host(t) or (on_device and t.device.type == "cpu")) for t in read)

    def __torch_dispatch__(self, func: Any, types: Any, args: Tuple[Any, ...] = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        name = str(func)
        inputs = _tensors(args, kwargs) if self._host else []
        from_host = bool(inputs) and all(self._on_host(t) for t in inputs)
        if (name in _SCALAR_READS or _device_to_host(name, args, kwargs)) and not from_host:
            self.count += 1
            self.ops.append(name)
        elif self._reads_for_size(name, args, kwargs):
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
