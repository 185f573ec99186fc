"""hwkv's Triton kernels (CUDA, ROCm, XPU; CPU CI runs them under TRITON_INTERPRET=1).

The interfaces are fixed by docs/architecture.md ("Kernel interfaces"):
store_kv, decode_attention, extend_attention, fill_kv_indices.
"""
from hwkv_cuda.kernels.decode import (DecodeConfig, DecodeWorkspace, decode_attention,
                                      decode_num_splits, make_decode_workspace)
from hwkv_cuda.kernels.extend import ExtendConfig, extend_attention
from hwkv_cuda.kernels.index import fill_kv_indices
from hwkv_cuda.kernels.store import StoreConfig, store_kv

__all__ = [
    "store_kv", "decode_attention", "extend_attention", "fill_kv_indices",
    "DecodeConfig", "DecodeWorkspace", "decode_num_splits", "make_decode_workspace", "ExtendConfig",
    "StoreConfig",
]
