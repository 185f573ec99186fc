"""A third-party device plugin as an out-of-tree package writes it; the tests install it as a real dist.

Its distribution declares `[hwkv.devices] dummy = hwkv_dummy:DEVICE`. `HWKV_DUMMY_REASON`, when set,
makes it unavailable with that reason.
"""
from __future__ import annotations

import os
from typing import Optional

from hwkv.devices import DeviceSpec


class DummyBackend:
    """Stands in for the plugin's AttentionBackend subclass."""


class DummyGraphAdapter:
    """Stands in for the plugin's graph adapter."""


def _probe() -> Optional[str]:
    return os.environ.get("HWKV_DUMMY_REASON") or None


DEVICE = DeviceSpec(
    name="dummy",
    priority=-10,  # below cpu: installing it never changes what auto-detection picks
    probe=_probe,
    backend="hwkv_dummy:DummyBackend",
    graph_adapter="hwkv_dummy:DummyGraphAdapter",
    torch_device="cpu",
    description="dummy third-party plugin (tests)",
)
