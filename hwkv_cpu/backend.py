"""TorchCPUBackend: the core template with vectorized torch kernels (AMX through oneDNN in bf16)."""
from __future__ import annotations

import torch

from hwkv.backend import AttentionBackend
from hwkv.layer import AttentionLayer
from hwkv.metadata import ForwardMetadata, KVIndexList
from hwkv_cpu import kernels


class TorchCPUBackend(AttentionBackend):
    """CPU kernels over the paged pool; graph mode through torch.compile over static buffers."""

    name = "cpu"
    graph_adapter = "hwkv_cpu.graph:CompileGraphAdapter"

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
