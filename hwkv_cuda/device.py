"""The CUDA DeviceSpec: NVIDIA GPUs through torch.cuda (ROCm builds are left to hwkv_rocm)."""
from __future__ import annotations

from typing import Optional

from hwkv.devices import DeviceSpec


def _probe() -> Optional[str]:
    import torch

    if torch.version.hip:
        return f"ROCm build of torch (torch.version.hip={torch.version.hip}): use rocm"
    if not torch.version.cuda:
        return "torch is not built with CUDA (torch.version.cuda is None)"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False (no driver or no GPU visible)"
    return None


DEVICE = DeviceSpec(
    name="cuda",
    priority=30,
    probe=_probe,
    backend="hwkv_cuda.backend:TritonBackend",
    graph_adapter="hwkv_cuda.graph:CUDAGraphAdapter",
    torch_device="cuda",
    layer_paths="hwkv_cuda.paths:cuda_layer_paths",
    description="NVIDIA GPU: Triton kernels, CUDA graphs",
)
