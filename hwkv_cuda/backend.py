"""TritonBackend: the core template with hwkv's Triton kernels (CUDA, MUSA; ROCm/XPU reuse them)."""
from __future__ import annotations

from hwkv import ops
from hwkv.backend import KernelSetBackend
from hwkv.pages import register_page_ops
from hwkv_cuda import kernels as _kernels
from hwkv_cuda.kernels.alloc import TritonPageOps

for _dev in ("cuda", "musa"):
    register_page_ops(_dev, TritonPageOps())
    ops.register_store_kv(_dev, _kernels.store_kv)
    ops.register_fill_kv_indices(_dev, _kernels.fill_kv_indices)


class TritonBackend(KernelSetBackend):
    """Split-K decode and paged extend kernels; graphs through the device's graph adapter."""

    name = "triton"
    kernels = _kernels
