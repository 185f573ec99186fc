"""hwkv's Intel XPU device: torch.xpu, Triton kernels on XPU, XPU graphs.

Only the DeviceSpec lives here, so importing the package stays cheap.
"""
from __future__ import annotations

from typing import Optional

from hwkv.devices import DeviceSpec

__all__ = ["DEVICE"]


def _probe() -> Optional[str]:
    import torch

    xpu = getattr(torch, "xpu", None)
    if xpu is None:
        return "this torch has no torch.xpu"
    if not xpu.is_available():
        return "torch.xpu.is_available() is False (no XPU build or no Intel GPU visible)"
    return None


DEVICE = DeviceSpec(
    name="xpu",
    priority=20,
    probe=_probe,
    backend="hwkv_xpu.backend:XPUBackend",
    graph_adapter="hwkv_xpu.graph:XPUGraphAdapter",
    torch_device="xpu",
    description="Intel GPU (torch.xpu): Triton kernels, XPU graphs",
)
