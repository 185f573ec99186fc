"""hwkv's Ascend NPU device: torch_npu ops (reshape-and-cache, fused infer attention), NPU graphs.

Only the DeviceSpec lives here, so importing the package stays cheap.
"""
from __future__ import annotations

from typing import Optional

from hwkv.devices import DeviceSpec, probe_torch_extension

__all__ = ["DEVICE"]


def _probe() -> Optional[str]:
    return probe_torch_extension("torch_npu", "npu")


DEVICE = DeviceSpec(
    name="npu",
    priority=50,
    probe=_probe,
    backend="hwkv_npu.backend:NPUBackend",
    graph_adapter="hwkv_npu.graph:NPUGraphAdapter",
    torch_device="npu",
    layer_paths="hwkv_npu.paths:layer_paths",
    description="Ascend NPU (torch_npu): fused infer attention, NPU graphs",
)
