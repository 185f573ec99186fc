"""`hwkv info`'s table for CUDA and MUSA: every layer kind runs hwkv's Triton kernels."""
from __future__ import annotations

from hwkv.paths import TRITON, Geometry, LayerPath, PathTable, layer_kinds

_WHY = "hwkv's kernels compute windows, sinks, soft-cap and fp8 KV with scales themselves"


def _table(device: str, geometry: Geometry) -> PathTable:
    rows = tuple((k, LayerPath(TRITON, f"hwkv_cuda.kernels ({k.mode})", _WHY)) for k in layer_kinds())
    return PathTable(device, rows, (), geometry.describe("float8_e4m3fn"))


def cuda_layer_paths(geometry: Geometry = Geometry()) -> PathTable:
    return _table("cuda", geometry)


def musa_layer_paths(geometry: Geometry = Geometry()) -> PathTable:
    return _table("musa", geometry)
