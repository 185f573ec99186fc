"""NPU graphs: torch.npu.NPUGraph and torch.npu.graph, which torch_npu registers on import.

Verified in Ascend/pytorch torch_npu/npu/graphs.py: `graph(npu_graph, pool=None, stream=None, ...)`
captures on the given stream, `NPUGraph.pool()` / `.replay()` mirror torch.cuda's.
"""
from __future__ import annotations

import importlib
import importlib.util

import torch

from hwkv.errors import ConfigError
from hwkv.graph import TorchDeviceGraphAdapter


class NPUGraphAdapter(TorchDeviceGraphAdapter):
    """torch.npu.NPUGraph captured on a side stream, one memory pool across buckets."""

    module = "npu"
    graph_class = "NPUGraph"

    def __init__(self) -> None:
        if getattr(torch, "npu", None) is None:
            if importlib.util.find_spec("torch_npu") is None:
                raise ConfigError("torch_npu is not installed: NPU graphs (torch.npu.NPUGraph) are unavailable")
            try:
                importlib.import_module("torch_npu")  # registers torch.npu
            except ImportError as e:
                raise ConfigError(f"torch_npu is installed but does not import ({e}): "
                                  "NPU graphs are unavailable") from e
        npu = getattr(torch, "npu", None)
        if npu is None:
            raise ConfigError("torch_npu imported but did not register torch.npu: NPU graphs are unavailable")
        if not npu.is_available():
            raise ConfigError("torch.npu.is_available() is False: NPU graphs need a visible Ascend NPU")
        super().__init__()
