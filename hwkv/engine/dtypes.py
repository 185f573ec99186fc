"""The dtypes hwkv runs a model's KV cache in by name (`hwkv bench`, `hwkv generate`, `load_model`), and a model
shape priced in one of them.

A preset's `dtype_bytes` is bf16's 2 (or `--kv-dtype`'s); a workload that allocates its pools in another dtype
sizes and reports them at that dtype's bytes per element, or the bytes it plans are not the bytes it allocates.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, Optional

import torch

from hwkv.engine.presets import ModelShape

DTYPES: Dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def shape_in(shape: ModelShape, dtype: str, layers: Optional[int] = None) -> ModelShape:
    """`shape` at `dtype`'s bytes per element (a name of DTYPES); with `layers`, only its first `layers` layers."""
    fields = {} if layers is None else {"layer_is_swa": shape.layer_is_swa[:layers]}
    return replace(shape, dtype_bytes=DTYPES[dtype].itemsize, **fields)
