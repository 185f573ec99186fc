"""TritonBackend: the core template with hwkv's Triton kernels (CUDA, MUSA; ROCm/XPU reuse them)."""
from __future__ import annotations

import torch

from hwkv import ops
from hwkv.backend import AttentionBackend
from hwkv.layer import AttentionLayer
from hwkv.metadata import ForwardMetadata, KVIndexList
from hwkv_cuda import kernels

for _dev in ("cuda", "musa"):
    ops.register_store_kv(_dev, kernels.store_kv)
    ops.register_fill_kv_indices(_dev, kernels.fill_kv_indices)


class TritonBackend(AttentionBackend):
    """Split-K decode and paged extend kernels; graphs through the device's graph adapter."""

    name = "triton"
    graph_adapter = "hwkv_cuda.graph:CUDAGraphAdapter"

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList,
                       md: ForwardMetadata, out: torch.Tensor) -> None:
        k_buf, v_buf = self.kv_buffers(layer)
        kernels.decode_attention(q, k_buf, v_buf, kv.indptr, kv.indices, kv.pos0, md.q_pos0, out,
                                 layer.scaling, layer.window, layer.logit_cap, layer.sinks,
                                 layer.k_scale, layer.v_scale, max_kv_len=kv.max_len)

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList,
                       md: ForwardMetadata, out: torch.Tensor) -> None:
        k_buf, v_buf = self.kv_buffers(layer)
        kernels.extend_attention(q, k_buf, v_buf, kv.indptr, kv.indices, kv.pos0, md.qo_indptr, md.q_pos0,
                                 out, md.max_q_len, layer.scaling, layer.window, layer.logit_cap,
                                 layer.sinks, layer.k_scale, layer.v_scale)
