"""hwkv's ROCm device: AITER ops when importable, otherwise hwkv_cuda's Triton kernels; HIP graphs.

Only the DeviceSpec lives here, so importing the package stays cheap.
"""
from __future__ import annotations

from typing import Optional

from hwkv.devices import DeviceSpec

__all__ = ["DEVICE"]


def _probe() -> Optional[str]:
    import torch

    if not torch.version.hip:
        return "torch is not a ROCm build (torch.version.hip is None)"
    if not torch.cuda.is_available():
        return f"ROCm build (hip {torch.version.hip}) but torch.cuda.is_available() is False (no GPU visible)"
    return None


DEVICE = DeviceSpec(
    name="rocm",
    priority=40,
    probe=_probe,
    backend="hwkv_rocm.backend:ROCmBackend",
    graph_adapter="hwkv_cuda.graph:CUDAGraphAdapter",  # HIP graphs answer torch.cuda.CUDAGraph
    torch_device="cuda",
    layer_paths="hwkv_rocm.paths:layer_paths",
    description="AMD GPU (ROCm torch): AITER when importable, else Triton kernels; HIP graphs",
)
