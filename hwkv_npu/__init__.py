"""hwkv's Ascend NPU device: torch_npu ops (reshape-and-cache, fused infer attention), NPU graphs.

Only the DeviceSpec and the guarded torch_npu import live here, so importing the package stays cheap.
"""
from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Optional

from hwkv.devices import DeviceSpec, probe_torch_extension
from hwkv.errors import ConfigError

__all__ = ["DEVICE", "import_torch_npu"]


def import_torch_npu() -> ModuleType:
    """torch_npu, imported (it registers torch.npu and torch.ops.npu). A ConfigError, chained, when it is not
    installed or its import raises anything: a CANN/driver mismatch raises OSError or RuntimeError, not ImportError,
    and the path table and graph adapter report it the same way."""
    if importlib.util.find_spec("torch_npu") is None:
        raise ConfigError("torch_npu is not installed")
    try:
        return importlib.import_module("torch_npu")
    except Exception as e:  # kept as the error's text and its cause, never swallowed
        raise ConfigError(f"torch_npu is installed but does not import: {type(e).__name__}: {e}") from e


def _probe() -> Optional[str]:
    return probe_torch_extension("torch_npu", "npu")


DEVICE = DeviceSpec(
    name="npu",
    priority=50,
    probe=_probe,
    backend="hwkv_npu.backend:NPUBackend",
    graph_adapter="hwkv_npu.graph:NPUGraphAdapter",
    torch_device="npu",
    layer_paths="hwkv_npu.paths:layer_paths",
    description="Ascend NPU (torch_npu): fused infer attention, NPU graphs",
)
