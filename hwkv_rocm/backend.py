"""ROCmBackend: hwkv_cuda's Triton kernels on AMD GPUs, with AITER's decode where it fits the layer.

ROCm torch answers device type "cuda", so the Triton store/fill kernels registered by
hwkv_cuda.backend already serve ROCm pools, and HIP graphs are torch.cuda.CUDAGraph.
Decode layers go to `aiter.paged_attention_ragged` (see `hwkv_rocm.aiter_ops` for what was
verified) when AITER is installed with the verified signature, the GPU is gfx90a/gfx942/gfx950 and
the layer has no sinks, no K/V scale, fp16/bf16 and head size 64 or 128; every other layer, and
every extend, runs the Triton kernels. `aiter_status` says which and why.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from hwkv import ops
from hwkv.backend import BackendOptions
from hwkv.batch import ForwardBatch
from hwkv.layer import AttentionLayer
from hwkv.metadata import ForwardMetadata, KVIndexList
from hwkv_cuda.backend import TritonBackend
from hwkv_rocm import aiter_ops


@dataclass(frozen=True)
class ROCmOptions(BackendOptions):
    """`aiter`: use AITER's decode kernel where it supports the layer (when AITER is installed)."""

    aiter: bool = True


class ROCmBackend(TritonBackend):
    """TritonBackend plus AITER decode; HIP graphs through the CUDA graph adapter."""

    metadata_in_graph = False  # graph refill stays before each replay (not verified inside this vendor's graphs)

    name = "rocm"
    Options = ROCmOptions

    def __init__(self, pool: Any, req_to_token_pool: Any, **options: Any) -> None:
        super().__init__(pool, req_to_token_pool, **options)
        self.aiter, self.aiter_status = self._load_aiter()
        self._indices_i32: Dict[Optional[int], torch.Tensor] = {}

    def _load_aiter(self) -> Tuple[Optional[aiter_ops.AiterDecode], str]:
        if not self.options.aiter:
            return None, "Triton only: disabled by aiter=False"
        ctx = int(self.req_to_token_pool.max_context_len)
        if ctx > aiter_ops.MAX_CONTEXT:
            return None, f"Triton only: max_context_len {ctx} > {aiter_ops.MAX_CONTEXT}"
        reason = aiter_ops.arch_reason(self.device)
        if reason is None:
            fn, reason = aiter_ops.load_paged_attention_ragged()
            if fn is not None:
                return aiter_ops.AiterDecode(fn, self.device, ctx), "AITER decode where the layer allows"
        return None, f"Triton only: {reason}"

    def init_graph_state(self, max_bs: int, max_num_tokens: int, max_context_len: Optional[int] = None) -> None:
        super().init_graph_state(max_bs, max_num_tokens, max_context_len)
        if self.aiter is not None and not self._indices_i32:
            # int32 twins of the static index lists AITER reads: allocated once, like the core's static
            # buffers, and shared by every runner (a graph captured earlier keeps reading them)
            st = self.static
            lists = {None: st.full_indices, **st.win_indices}
            self._indices_i32 = {w: torch.zeros(t.shape, dtype=torch.int32, device=self.device)
                                 for w, t in lists.items()}

    def init_kernel_metadata(self, md: ForwardMetadata, batch: ForwardBatch, graph: bool) -> None:
        """Decode with AITER: the index lists as int32, once per forward. In graph mode the full list is
        filled straight into its int32 twin from req_to_token (live entries only, never the capacity of
        max_bs x context); window lists, bounded by W per request, are converted in place."""
        if self.aiter is None or not md.is_decode:
            return
        if not graph:
            lists = {None: md.full, **md.windows}
            md.extra["aiter_indices"] = {w: lst.indices.to(torch.int32) for w, lst in lists.items()}
            return
        full = self._indices_i32[None]
        ops.fill_kv_indices(self.req_to_token_pool.req_to_token, batch.req_pool_indices, md.full.pos0,
                            md.full.indptr, full)
        wins = {w: self._indices_i32[w].copy_(lst.indices) for w, lst in md.windows.items()}
        md.extra["aiter_indices"] = {None: full, **wins}

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList,
                       md: ForwardMetadata, out: torch.Tensor) -> None:
        indices = md.extra.get("aiter_indices")
        if indices is not None:
            k_buf, v_buf = self.kv_buffers(layer)
            if aiter_ops.layer_reason(q, layer, kv, k_buf, v_buf) is None:
                self.aiter(q, k_buf, v_buf, kv.indptr, indices[kv.window], out, layer.scaling, layer.logit_cap)
                return
        super().forward_decode(q, layer, kv, md, out)
