"""XPU graphs: torch.xpu.XPUGraph and torch.xpu.graph (recent torch releases have them; this adapter
checks at construction and raises ConfigError otherwise, so hwkv_xpu still runs eagerly on an older torch).

The API mirrors torch.cuda's: `torch.xpu.graph(xpu_graph, pool=None, stream=None)`,
`XPUGraph.pool()` and `.replay()` (checked in torch/xpu/graphs.py).
"""
from __future__ import annotations

import torch

from hwkv.errors import ConfigError
from hwkv.graph import TorchDeviceGraphAdapter


class XPUGraphAdapter(TorchDeviceGraphAdapter):
    """torch.xpu.XPUGraph captured on a side stream, one memory pool across buckets."""

    module = "xpu"
    graph_class = "XPUGraph"

    def __init__(self) -> None:
        xpu = getattr(torch, "xpu", None)
        if xpu is None or not hasattr(xpu, "XPUGraph") or not hasattr(xpu, "graph"):
            raise ConfigError(f"torch {torch.__version__} has no torch.xpu.XPUGraph/graph: XPU graphs are "
                              "unavailable on this torch (hwkv_xpu still runs eagerly)")
        if not xpu.is_available():
            raise ConfigError("torch.xpu.is_available() is False: XPU graphs need a visible Intel GPU")
        super().__init__()
