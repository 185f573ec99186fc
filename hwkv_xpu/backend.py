"""XPUBackend: hwkv_cuda's Triton kernels on Intel GPUs (Triton's XPU backend runs them unchanged), and
IPEX's flash_attn_varlen_func for the layers it fits when asked for (`ipex=True`).

Importing this module registers the Triton store, index-fill, graph-refill and allocator kernels for "xpu";
attention is TritonBackend's. Graphs go through `hwkv_xpu.graph.XPUGraphAdapter`. With `ipex=True` and an
XPU build of IPEX, decode and extend of fp16/bf16 layers without sinks or K/V scales, with 64 | head dim
and W != 1, run IPEX's varlen op over page tables built once per forward for the lists such layers read (see
`hwkv_intel.ipex`, "Intel GPU", for what was read in IPEX's source and what could not be checked without an Intel
GPU); the rest, Triton, and a forward none of whose layers IPEX runs builds no table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from hwkv import ops
from hwkv.backend import BackendOptions
from hwkv.batch import ForwardBatch
from hwkv.layer import AttentionLayer
from hwkv.list_plans import ListPlans
from hwkv.metadata import ForwardMetadata, KVIndexList, StaticBuffers
from hwkv.pages import register_page_ops
from hwkv_cuda import kernels
from hwkv_cuda.kernels.alloc import TritonPageOps
from hwkv_cuda.backend import TritonBackend
from hwkv_intel import ipex

ops.register_store_kv("xpu", kernels.store_kv, prechecked=kernels.store_kv_prechecked)
ops.register_fill_kv_indices("xpu", kernels.index.fill_kv_indices_prechecked)
ops.register_graph_refill("xpu", kernels.refill.KERNELS)
ops.register_tree_decode("xpu", kernels.tree.tree_decode_fill)
ops.register_step_kernels("xpu", kernels.step.KERNELS)
register_page_ops("xpu", TritonPageOps())

_IPEX = "ipex_xpu_lists"


@dataclass(frozen=True)
class XPUOptions(BackendOptions):
    """`ipex`: IPEX's XPU flash_attn_varlen_func for the layers it fits (off: not yet run on an Intel GPU)."""

    ipex: bool = False


class XPUBackend(TritonBackend):
    """TritonBackend on torch.xpu pools, IPEX's varlen attention per layer when enabled; XPU graphs."""

    metadata_in_graph = False  # graph refill stays before each replay (not verified inside this vendor's graphs)

    name = "xpu"
    Options = XPUOptions

    def __init__(self, pool: Any, req_to_token_pool: Any, **options: Any) -> None:
        super().__init__(pool, req_to_token_pool, **options)
        self.page_size = int(pool.page_size)
        self.ipex_reason: Optional[str] = self._ipex_reason()  # None: IPEX in use where it fits
        # IPEX's page tables, per forward, of the lists IPEX layers read (graph mode: into graph_tables(md))
        self._ipex_plans = ListPlans(_IPEX, self._ipex_make, self._ipex_fill)

    def _ipex_reason(self) -> Optional[str]:
        if not self.options.ipex:
            return "off (XPUBackend(..., ipex=True) enables IPEX's varlen attention)"
        if self.device.type != "xpu":
            return f"the pool lives on {self.device}, not on an Intel GPU"
        return ipex.xpu_reason()

    def alloc_graph_tables(self, static: StaticBuffers) -> Optional[ipex.GraphTables]:
        """IPEX's page tables for one static buffer set (once, like them: every runner shares them)."""
        if self.ipex_reason is not None:
            return None
        return ipex.GraphTables.alloc(static.max_bs, static.max_num_tokens, self.graph_max_context_len,
                                      self.windows, self.device, self.page_size)

    def init_kernel_metadata(self, md: ForwardMetadata, batch: ForwardBatch, graph: bool) -> None:
        """IPEX's page tables of this forward, made by the first layer IPEX runs over each list, so a forward whose
        layers IPEX refuses builds none; a graph refill fills the static tables of the lists IPEX layers read at
        capture (a replay's layers read them): `hwkv.list_plans`, as for hwkv_cpu's IPEX tables."""
        super().init_kernel_metadata(md, batch, graph)
        self._ipex_plans.open(md, batch, graph, self.ipex_reason is None and bool(md.batch_size))

    def _ipex_make(self, md: ForwardMetadata, kv: KVIndexList) -> ipex.IpexList:
        """An eager forward's list as IPEX's page table, as wide as its longest request's pages."""
        p = self.page_size
        return ipex.plan_list(kv, -(-(kv.max_len + p - 1) // p), p)

    def _ipex_fill(self, md: ForwardMetadata, kv: KVIndexList) -> ipex.IpexList:
        """A graph forward's list into IPEX's static page tables of its buffer set (`alloc_graph_tables`)."""
        g = self.graph_tables(md)
        return ipex.plan_list(kv, g.width(kv.window), self.page_size, out=g)

    def _ipex_attend(self, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList, md: ForwardMetadata,
                     out: torch.Tensor) -> bool:
        if not self._ipex_plans.opened(md) or md.tree is not None:  # IPEX's varlen op takes no verify-tree mask
            return False
        k_buf, v_buf = self.kv_buffers(layer)
        if k_buf.shape[0] % self.page_size or ipex.xpu_layer_reason(q, layer, k_buf, v_buf) is not None:
            return False
        k_cache, v_cache = ipex.xpu_caches(k_buf, v_buf, self.page_size)
        ipex.varlen(q, k_cache, v_cache, self._ipex_plans.get(md, kv), md.qo_indptr, md.max_q_len, out,
                    layer.scaling, layer.window, layer.logit_cap)
        return True

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList,
                       md: ForwardMetadata, out: torch.Tensor) -> None:
        if not self._ipex_attend(q, layer, kv, md, out):
            super().forward_decode(q, layer, kv, md, out)

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList,
                       md: ForwardMetadata, out: torch.Tensor) -> None:
        if not self._ipex_attend(q, layer, kv, md, out):
            super().forward_extend(q, layer, kv, md, out)
