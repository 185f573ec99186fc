"""XPUBackend: hwkv_cuda's Triton kernels on Intel GPUs (Triton's XPU backend runs them unchanged).

Importing this module registers the Triton store, index-fill, graph-refill and allocator kernels for "xpu";
attention is TritonBackend's. Graphs go through `hwkv_xpu.graph.XPUGraphAdapter`.
"""
from __future__ import annotations

from hwkv import ops
from hwkv.pages import register_page_ops
from hwkv_cuda import kernels
from hwkv_cuda.kernels.alloc import TritonPageOps
from hwkv_cuda.backend import TritonBackend

ops.register_store_kv("xpu", kernels.store_kv, prechecked=kernels.store_kv_prechecked)
ops.register_fill_kv_indices("xpu", kernels.fill_kv_indices)
ops.register_graph_refill("xpu", kernels.refill.KERNELS)
register_page_ops("xpu", TritonPageOps())


class XPUBackend(TritonBackend):
    """TritonBackend on torch.xpu pools; XPU graphs."""

    metadata_in_graph = False  # graph refill stays before each replay (not verified inside this vendor's graphs)

    name = "xpu"
