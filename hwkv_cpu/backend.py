"""TorchCPUBackend: the core template with vectorized torch kernels (AMX through oneDNN in bf16)."""
from __future__ import annotations

from hwkv.backend import KernelSetBackend
from hwkv_cpu import kernels as _kernels


class TorchCPUBackend(KernelSetBackend):
    """CPU kernels over the paged pool; graph mode through torch.compile over static buffers."""

    name = "cpu"
    kernels = _kernels
