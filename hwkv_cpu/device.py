"""The CPU DeviceSpec: always available, the fallback of every detection."""
from __future__ import annotations

from typing import Optional

from hwkv.devices import DeviceSpec


def _probe() -> Optional[str]:
    return None


DEVICE = DeviceSpec(
    name="cpu",
    priority=0,
    probe=_probe,
    backend="hwkv_cpu.backend:TorchCPUBackend",
    graph_adapter="hwkv_cpu.graph:CompileGraphAdapter",
    torch_device="cpu",
    description="CPU: torch matmul (oneDNN, AMX when present); sgl-kernel CPU ops when importable",
    attention_path="hwkv_cpu.amx:active_path",
)
