"""ROCmBackend: hwkv_cuda's Triton kernels on AMD GPUs, with AITER's decode and prefill where they fit.

ROCm torch answers device type "cuda", so the Triton store/fill kernels registered by
hwkv_cuda.backend already serve ROCm pools, and HIP graphs are torch.cuda.CUDAGraph.
Each layer asks `aiter_ops.decide` (the same function `hwkv info` prints) whether AITER computes it
exactly: decode through `aiter.paged_attention_ragged` (soft-cap and fp8 KV included), extend through
`aiter.mha_batch_prefill_func` (SWA as window (W - 1, 0), soft-cap included); sinks and whatever else
the ops lack run the Triton kernels, layer by layer. `aiter_status` says what AITER offers here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from hwkv import ops
from hwkv.backend import BackendOptions
from hwkv.batch import ForwardBatch
from hwkv.layer import AttentionLayer
from hwkv.list_plans import ListPlans
from hwkv.metadata import ForwardMetadata, KVIndexList, StaticBuffers
from hwkv.paths import FUSED
from hwkv_cuda.backend import TritonBackend
from hwkv_rocm import aiter_ops

_INDICES = "aiter_indices"


@dataclass(frozen=True)
class ROCmOptions(BackendOptions):
    """`aiter`: use AITER's kernels where they support the layer (when AITER is installed)."""

    aiter: bool = True


class _Twins(Dict[Optional[int], torch.Tensor]):
    """int32 twins of one static buffer set's index lists (window -> twin; None: the full list) and the lists they
    twin (`sources`), by which a layer tells the graph's own lists from others."""

    def __init__(self, sources: Dict[Optional[int], torch.Tensor], device: torch.device) -> None:
        super().__init__({w: torch.zeros(t.shape, dtype=torch.int32, device=device) for w, t in sources.items()})
        self.sources = sources


class ROCmBackend(TritonBackend):
    """TritonBackend plus AITER decode and prefill; HIP graphs through the CUDA graph adapter."""

    metadata_in_graph = False  # graph refill stays before each replay (not verified inside this vendor's graphs)

    name = "rocm"
    Options = ROCmOptions

    def __init__(self, pool: Any, req_to_token_pool: Any, **options: Any) -> None:
        super().__init__(pool, req_to_token_pool, **options)
        self.aiter, self.aiter_env, self.aiter_status = self._load_aiter()
        # the int32 lists AITER layers read, per forward (graph mode: their twins, refilled per mode before replays)
        self._aiter_lists = ListPlans(_INDICES, lambda md, kv: kv.indices.to(torch.int32), self._fill_twin,
                                      self._refill_twin, per_mode=True)

    def _load_aiter(self) -> Tuple[Optional[aiter_ops.AiterKernels], Optional[aiter_ops.AiterEnv], str]:
        if not self.options.aiter:
            return None, None, "Triton only: disabled by aiter=False"
        ctx = int(self.req_to_token_pool.max_context_len)
        reason = aiter_ops.arch_reason(self.device)
        if reason is not None:
            return None, None, f"Triton only: {reason}"
        found = aiter_ops.load_aiter(ctx)  # the loader `hwkv info` reads too
        if found.decode is None and found.prefill is None:
            return None, None, f"Triton only: {found.decode_why}"
        status = "; ".join(f"{what}: {'AITER where the layer allows' if fn is not None else 'Triton (' + why + ')'}"
                           for what, fn, why in (("decode", found.decode, found.decode_why),
                                                 ("extend", found.prefill, found.prefill_why)))
        kernels = aiter_ops.AiterKernels(found.decode, found.prefill, self.device, ctx)
        return kernels, found.env(aiter_ops.gpu_arch(self.device)), status

    def alloc_graph_tables(self, static: StaticBuffers) -> Optional[_Twins]:
        """int32 twins of one static buffer set's index lists, which AITER reads: made once beside them and
        shared by every runner (a graph captured earlier keeps reading them); one set per draft step."""
        if self.aiter is None:
            return None
        return _Twins({None: static.full_indices, **static.win_indices}, self.device)

    def init_kernel_metadata(self, md: ForwardMetadata, batch: ForwardBatch, graph: bool) -> None:
        """AITER reads int32 index lists, converted only for the lists an AITER layer reads (`hwkv.list_plans`): a
        forward whose layers all run Triton (sinks on every layer, say) converts none. Eager, the first AITER layer
        reading a list converts it. A graph refill fills the int32 twins of the lists AITER layers of its mode read
        at capture (`_refill_twin`)."""
        self._aiter_lists.open(md, batch, graph, self.aiter is not None)

    def _fill_twin(self, md: ForwardMetadata, kv: KVIndexList) -> Optional[torch.Tensor]:
        """A graph list into its int32 twin, once, by the capture warm-up's first AITER layer reading it (the static
        list converted whole). None for a list that is not one of the static buffers' (a decode-like verify's own
        lists): no twin is sized for it, the layer runs Triton."""
        twins = self.graph_tables(md)
        source = twins.sources.get(kv.window)
        return twins[kv.window].copy_(source) if source is kv.indices else None

    def _refill_twin(self, md: ForwardMetadata, batch: ForwardBatch, window: Optional[int]) -> torch.Tensor:
        """A graph refill's list `window` (None: full) into its int32 twin: the full list straight from
        req_to_token (live entries only, never the capacity of max_bs x context); window lists, bounded by W per
        request, converted in place."""
        twins = self.graph_tables(md)
        if window is not None:
            return twins[window].copy_(twins.sources[window])
        ops.fill_kv_indices(self.req_to_token_pool.req_to_token, batch.req_pool_indices, md.full.pos0,
                            md.full.indptr, twins[None])
        return twins[None]

    def _aiter_path(self, mode: str, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList,
                    md: ForwardMetadata) -> Optional[torch.Tensor]:
        """The int32 slot list when AITER computes this layer, else None (Triton)."""
        if not self._aiter_lists.opened(md):
            return None
        k_buf, v_buf = self.kv_buffers(layer)
        facts = aiter_ops.facts_of(mode, q, layer, kv, k_buf, v_buf)
        return self._aiter_lists.get(md, kv) if aiter_ops.decide(facts, self.aiter_env).path == FUSED else None

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList,
                       md: ForwardMetadata, out: torch.Tensor) -> None:
        indices = self._aiter_path("decode", q, layer, kv, md)
        if indices is None:
            super().forward_decode(q, layer, kv, md, out)
            return
        k_buf, v_buf = self.kv_buffers(layer)
        self.aiter.decode(q, k_buf, v_buf, kv.indptr, indices, out, layer)

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList,
                       md: ForwardMetadata, out: torch.Tensor) -> None:
        # AITER's prefill takes no per-request custom mask: a verify tree runs hwkv's Triton kernel
        indices = None if md.tree is not None else self._aiter_path("extend", q, layer, kv, md)
        if indices is None:
            super().forward_extend(q, layer, kv, md, out)
            return
        k_buf, v_buf = self.kv_buffers(layer)
        self.aiter.prefill(q, k_buf, v_buf, md.qo_indptr, kv.indptr, indices, md.max_q_len, kv.max_len, out, layer)
