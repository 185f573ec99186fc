"""hwkv's Triton kernels (CUDA, ROCm, XPU; CPU CI runs them under TRITON_INTERPRET=1).

The interfaces are fixed by docs/architecture.md ("Kernel interfaces"):
store_kv, decode_attention, extend_attention, fill_kv_indices. The public functions check their
arguments on every call; the backend checks once per forward and uses the internal entry points
(`store_kv_prechecked`, `plan_decode` + `decode_layer` + `decode_attention_planned`, `plan_extend` +
`extend_attention_planned`). `refill` holds the fused graph-metadata refill, `tree` the decode-like
tree verify's list builder, `step` the whole-step graph's bookkeeping. Importing this package registers
`torch.ops.hwkv.store_kv`, `.decode_attention` and `.extend_attention` (custom ops with fake
implementations, for models compiled with torch.compile: `torch_ops`).
"""
from hwkv_cuda.kernels import refill, step, torch_ops, tree
from hwkv_cuda.kernels.decode import (DecodeConfig, DecodeLayer, DecodePlan, DecodeWorkspace, decode_attention,
                                      decode_attention_planned, decode_config, decode_layer, decode_num_splits,
                                      make_decode_workspace, plan_decode)
from hwkv_cuda.kernels.extend import ExtendConfig, ExtendPlan, extend_attention, extend_attention_planned, plan_extend
from hwkv_cuda.kernels.index import fill_kv_indices
from hwkv_cuda.kernels.store import StoreConfig, store_kv, store_kv_prechecked

__all__ = [
    "store_kv", "decode_attention", "extend_attention", "fill_kv_indices",
    "DecodeConfig", "DecodeWorkspace", "decode_config", "decode_num_splits", "make_decode_workspace", "ExtendConfig",
    "StoreConfig", "store_kv_prechecked", "DecodePlan", "DecodeLayer", "plan_decode", "decode_layer",
    "decode_attention_planned",
    "ExtendPlan", "plan_extend", "extend_attention_planned", "refill", "step", "torch_ops", "tree",
]
