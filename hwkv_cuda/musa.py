"""The MUSA DeviceSpec: Moore Threads GPUs through torch_musa, running hwkv_cuda's Triton kernels."""
from __future__ import annotations

import importlib
from typing import Optional

from hwkv.devices import DeviceSpec, probe_torch_extension


def _probe() -> Optional[str]:
    reason = probe_torch_extension("torch_musa", "musa")
    if reason is not None:
        return reason
    # hwkv's MUSA path is the Triton kernels; Moore Threads ships its own Triton build with torch_musa
    # (PyPI's triton is CUDA-only), so a torch_musa without it is reported rather than failing at first launch
    try:
        importlib.import_module("triton")
    except ImportError as e:
        return (f"triton does not import ({e}); hwkv runs Triton kernels on MUSA: install the Triton build "
                f"that comes with torch_musa")
    return None


DEVICE = DeviceSpec(
    name="musa",
    priority=60,
    probe=_probe,
    backend="hwkv_cuda.backend:TritonBackend",
    graph_adapter="hwkv_cuda.graph:MUSAGraphAdapter",
    torch_device="musa",
    layer_paths="hwkv_cuda.paths:musa_layer_paths",
    description="Moore Threads GPU (torch_musa): Triton kernels, MUSA graphs",
)
