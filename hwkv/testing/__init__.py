"""The contract suite every backend passes, in-tree or third-party (CPU-only where the backend allows).

Run it against your backend: define a pytest fixture `hwkv_target` returning a `ContractTarget`
and `from hwkv.testing.contract import *` in a test module; or run `hwkv verify`.

The graph tests replay through the capture check (`hwkv.testing.capture_check`) whatever adapter the target
names: a replay that reads memory its capture did not (metadata moved out of the static buffers) fails, as it
would read stale memory in a real device graph. A device graph adapter (`records_device_work`) runs as it is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional

from hwkv.graph import EagerAdapter


@dataclass(frozen=True)
class ContractTarget:
    """A backend class, the torch device its pools live on, and how to make its graph adapter."""

    name: str
    backend_cls: Any
    device: str
    adapter_factory: Callable[[], Any] = EagerAdapter

    def __str__(self) -> str:
        return self.name

    def graph_adapter(self) -> Any:
        """A fresh adapter for the suite's graph tests: `adapter_factory()` under the capture check."""
        return graph_adapter(self)


def graph_adapter(target: Any) -> Any:
    """The adapter the contract suite's graph tests use for `target` (a `ContractTarget`, or any object with an
    `adapter_factory`): a new one from the factory, through `hwkv.testing.capture_check.capture_checked`."""
    from hwkv.testing.capture_check import capture_checked

    return capture_checked(target.adapter_factory())


def available_targets(only: Optional[str] = None) -> List[ContractTarget]:
    """One target per registered device that can run here (optionally only the named one)."""
    from hwkv import devices

    out = []
    # the named device's plugin only (as the device choice loads it): a third party's plugin that fails to import
    # does not stop `hwkv verify --device cpu`
    for name, spec in sorted(devices.discover(only=only).items(), key=lambda kv: -kv[1].priority):
        if (only and name != only) or not spec.is_available():
            continue
        adapter_cls = spec.load_graph_adapter()
        out.append(ContractTarget(name, spec.load_backend_class(), spec.torch_device,
                                  adapter_cls if adapter_cls is not None else EagerAdapter))
    return out
