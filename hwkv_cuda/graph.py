"""Device graph adapters for the Triton backend: CUDA (and HIP, which answers torch.cuda) and MUSA."""
from __future__ import annotations

from hwkv.graph import TorchDeviceGraphAdapter


class CUDAGraphAdapter(TorchDeviceGraphAdapter):
    """torch.cuda.CUDAGraph, captured on a side stream, one memory pool across buckets."""

    module = "cuda"
    graph_class = "CUDAGraph"


class MUSAGraphAdapter(TorchDeviceGraphAdapter):
    """torch.musa.MUSAGraph (torch_musa mirrors torch.cuda's graph API)."""

    module = "musa"
    graph_class = "MUSAGraph"
