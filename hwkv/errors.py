"""Typed errors of hwkv. Every message names the bad value and the limit it broke."""
from __future__ import annotations


class HwkvError(Exception):
    """Base of every error hwkv raises on purpose."""


class OutOfSlotsError(HwkvError):
    """An allocation asked for more slots than are free; nothing was allocated."""


class DoubleFreeError(HwkvError):
    """A slot was freed that is already free."""


class NotAllocatedError(HwkvError):
    """A slot was freed (or read) that was never allocated."""


class LocError(HwkvError, ValueError):
    """A location tensor has the wrong dtype, device, shape or a value out of range."""


class ShapeError(HwkvError, ValueError):
    """A K/V/Q tensor does not match the pool or layer geometry."""


class ConfigError(HwkvError, ValueError):
    """A constructor or option got a value it cannot work with."""


class BudgetError(ConfigError):
    """The pools a request count needs do not fit the memory budget (a ConfigError naming both)."""


class MissingSWALocError(AssertionError, HwkvError):
    """An SWA layer was written without its SWA slots (raised explicitly, so `python -O` keeps it)."""


class CapacityError(HwkvError):
    """A batch is larger than a pre-allocated (graph) buffer; the caller must run it eagerly."""


class CacheError(HwkvError):
    """A prefix-cache operation was refused (a locked node, more than is evictable); nothing changed."""


class DeviceError(HwkvError, RuntimeError):
    """A device was asked for that is unknown or unavailable, or detection is ambiguous."""


class EvictedSlotError(HwkvError):
    """Debug mode: an in-window token translated to the padding slot 0 (it was released)."""


class ReferenceMismatchError(HwkvError, AssertionError):
    """A backend's output differs from hwkv.reference beyond tolerance."""


class ShardError(HwkvError, ValueError):
    """Context-parallel ranks disagree (token count, shard sizes, the layer saved); every rank raises it."""
