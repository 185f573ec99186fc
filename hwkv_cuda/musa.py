"""The MUSA DeviceSpec: Moore Threads GPUs through torch_musa, running hwkv_cuda's Triton kernels."""
from __future__ import annotations

from typing import Optional

from hwkv.devices import DeviceSpec, probe_torch_extension


def _probe() -> Optional[str]:
    return probe_torch_extension("torch_musa", "musa")


DEVICE = DeviceSpec(
    name="musa",
    priority=60,
    probe=_probe,
    backend="hwkv_cuda.backend:TritonBackend",
    graph_adapter="hwkv_cuda.graph:MUSAGraphAdapter",
    torch_device="musa",
    description="Moore Threads GPU (torch_musa): Triton kernels, MUSA graphs",
)
