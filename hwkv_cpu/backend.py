"""TorchCPUBackend: the core template with vectorized torch kernels (AMX through oneDNN in bf16), and IPEX's
paged-attention ops for the layers they run exactly when intel_extension_for_pytorch is installed.

Per layer (see `hwkv_cpu.ipex` for what was verified): decode goes to IPEX's
single_query_cached_kv_attention, and with `ipex_extend=True` extend to its flash_attn_varlen_func, when
`ipex.layer_reason` finds nothing the op lacks (sinks, fp8/K-V scales, unequal K/V head dims, a window with
softcap in decode over the full list, W=1 in extend); every other layer runs `hwkv_cpu.kernels`. The slot
table IPEX reads of a list is built from the core's index list once per forward, by the first layer IPEX runs
over it, so a forward whose layers IPEX refuses builds none (graph mode: into tables allocated once per static
buffer set by `alloc_graph_tables`, refilled for the lists IPEX layers read at capture); `hwkv.list_plans` keeps
that rule for every device package.

Extend stays on the torch kernels unless asked for: the varlen op reads hwkv's token-major pool only with
block_size 1, and there it measured 7-13x slower than `hwkv_cpu.kernels` (IPEX 2.8.0, 2-core AVX-512 VM,
2 x 256 queries over 2,048 keys, 32/8 heads of 128: 990 vs 130 ms fp32, 1,890 vs 150 ms bf16), while
decode measured 13.5 vs 28 ms in bf16 and 60 vs 55 ms in fp32 (8 requests x 2,048 keys).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from hwkv import ops
from hwkv.backend import BackendOptions, KernelSetBackend
from hwkv.batch import ForwardBatch
from hwkv.checks import check_int_option
from hwkv.layer import AttentionLayer, storage_key
from hwkv.list_plans import ListPlans
from hwkv.metadata import ForwardMetadata, KVIndexList, StaticBuffers
from hwkv_cpu import host_plan, ipex
from hwkv_cpu import kernels as _kernels
from hwkv_cpu.kernels_dense import (DENSE_MAX_ELEMENTS, compute_dtype, dense_attention, kept_sink_column,
                                    plan_dense)

if ipex.installed_reason() is None:  # cheap: package metadata only; IPEX itself is imported on first use
    ops.register_store_kv("cpu", ops.store_kv_checked, prechecked=ipex.store_kv_prechecked)

_IPEX = "ipex_lists"
_DENSE = "dense_plans"


@dataclass(frozen=True)
class CPUOptions(BackendOptions):
    """`ipex`: IPEX's decode op where it runs the layer exactly (when IPEX is installed); `ipex_extend`: its
    varlen op for extend too (off: slower than the torch kernels over this pool's layout, see above).
    `dense_max_elements`: eager forwards whose padded key tables stay under this many elements per layer
    (gathered K/V plus scores) run `hwkv_cpu.kernels_dense`, planned once per forward; 0 turns it off."""

    ipex: bool = True
    ipex_extend: bool = False
    dense_max_elements: int = DENSE_MAX_ELEMENTS

    def __post_init__(self) -> None:
        super().__post_init__()  # (ipex and ipex_extend: switches, checked there as every option declared bool)
        check_int_option("dense_max_elements", self.dense_max_elements, 0)


@dataclass
class _LayerKit:
    """One layer's dense-call constants: made from the fields in `sig` (the sinks' storage among them, and the sinks
    by identity) and the pool's buffers of the layer (which never change), so a layer call reads them instead of
    deriving them. The sinks' values are not among them: `cols` are refilled from the sinks on every call (an
    in-place update of the sinks, e.g. a weight load into the parameter they view, shows at once)."""

    sig: Tuple[Any, ...]
    sinks: Optional[torch.Tensor]
    k_buf: torch.Tensor
    v_buf: torch.Tensor
    geometry: Optional[Tuple[int, int, int, int, int]]  # (kvh, g, d, dv, window or 0); None: not dense
    qk_scale: float
    cap: float
    v_scale: float
    cdt: torch.dtype
    cols: Dict[int, Tuple[torch.Tensor, ...]]  # decode's sinks column per batch size (kept_sink_column)

    @classmethod
    def make(cls, layer: AttentionLayer, sig: Tuple[Any, ...], k_buf: torch.Tensor, v_buf: torch.Tensor) -> "_LayerKit":
        h, d = layer.num_heads, layer.head_dim
        geometry = None
        if k_buf.dim() == 3 and v_buf.dim() == 3 and k_buf.device.type == "cpu":
            kvh = k_buf.shape[1]
            if not h % kvh and k_buf.shape[2] == d and v_buf.shape[:2] == k_buf.shape[:2]:
                geometry = (kvh, h // kvh, d, v_buf.shape[2], layer.window or 0)
        qk_scale, cap, v_scale, _ = _kernels._scalars(k_buf.new_empty(0, h, d), layer.scaling, layer.window,
                                                      layer.logit_cap, layer.k_scale, layer.v_scale)
        return cls(sig, layer.sinks, k_buf, v_buf, geometry, qk_scale, cap, v_scale, compute_dtype(k_buf.dtype), {})


class TorchCPUBackend(KernelSetBackend):
    """CPU kernels over the paged pool; graph mode through torch.compile over static buffers."""

    name = "cpu"
    dense_list_tables = True  # the dense kernels read each list's [bs, L] table: the core builds it with the list
    kernels = _kernels.BackendKernels()  # the class's, without a forward counter; each backend makes its own
    Options = CPUOptions

    def __init__(self, pool: Any, req_to_token_pool: Any, **options: Any) -> None:
        super().__init__(pool, req_to_token_pool, **options)
        self.ipex_reason: Optional[str] = self._ipex_reason()  # None: IPEX ops in use where they fit
        self._head_maps: Dict[Tuple[int, int], torch.Tensor] = {}
        # per layer object, held weakly (a layer's kit goes with it: layers made per forward leave none behind)
        self._kits: weakref.WeakKeyDictionary[AttentionLayer, _LayerKit] = weakref.WeakKeyDictionary()
        # the forward counter every layer hands the chunked kernels, so that they read a forward's lists once
        # (hwkv_cpu.host_plan); advanced by each metadata step
        self._epoch = host_plan.new_epoch(self, debug=self.debug)
        self.kernels = _kernels.BackendKernels(self._epoch)
        # IPEX's slot tables, per forward, of the lists IPEX layers read (graph mode: into graph_tables(md))
        self._ipex_plans = ListPlans(_IPEX, lambda md, kv: ipex.plan_list(kv, max(kv.max_len, 1)), self._ipex_fill)

    def _ipex_reason(self) -> Optional[str]:
        if not self.options.ipex:
            return "disabled by ipex=False"
        if self.device.type != "cpu":
            return f"the pool lives on {self.device}"
        return ipex.load()[1] or None

    # ---- metadata: IPEX's slot tables, once per forward and list IPEX reads ---------------------------
    def alloc_graph_tables(self, static: StaticBuffers) -> Optional[ipex.GraphTables]:
        """IPEX's slot tables for one static buffer set (once, like them: every runner shares them)."""
        if self.ipex_reason is not None:
            return None
        return ipex.GraphTables.alloc(static.max_bs, static.max_num_tokens, self.graph_max_context_len,
                                      self.windows, self.device)

    def init_kernel_metadata(self, md: ForwardMetadata, batch: ForwardBatch, graph: bool) -> None:
        host_plan.next_forward(self._epoch)  # a torch op: a refill recorded into a graph advances it per replay
        if self.options.dense_max_elements and not graph and md.tree is None and md.seq_lens_cpu is not None:
            md.extra[_DENSE] = {}  # this forward's dense plans, made by the first layer reading each list
        # IPEX's tables, made by the first layer IPEX runs over each list (_ipex_list); a graph refill fills those
        # of the lists IPEX layers read at capture (hwkv.list_plans)
        self._ipex_plans.open(md, batch, graph, self.ipex_reason is None and bool(md.batch_size)
                              and (md.is_decode or self.options.ipex_extend))

    def _ipex_list(self, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList, md: ForwardMetadata,
                   decode: bool) -> Optional[ipex.IpexList]:
        """The list's IPEX plan when IPEX runs this layer (made by the first such layer of the forward), else None
        (the torch kernels)."""
        if not self._ipex_plans.opened(md) or md.tree is not None:  # IPEX's ops take no verify-tree mask
            return None
        k_buf, v_buf = self.kv_buffers(layer)
        if ipex.layer_reason(q, layer, kv, k_buf, v_buf, decode) is not None:
            return None
        return self._ipex_plans.get(md, kv)

    def _ipex_fill(self, md: ForwardMetadata, kv: KVIndexList) -> ipex.IpexList:
        """A graph forward's list into IPEX's static tables of its buffer set (`alloc_graph_tables`)."""
        g = self.graph_tables(md)
        return ipex.plan_list(kv, g.width(kv.window), out=g)

    def _head_map(self, q: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
        key = (layer.num_heads, layer.num_kv_heads)
        hm = self._head_maps.get(key)
        if hm is None:  # made at the first forward (graph capture warms up eagerly first): kept for life
            hm = self._head_maps[key] = ipex.head_mapping(layer.num_heads, layer.num_kv_heads, q.device)
        return hm

    def _layer_kit(self, layer: AttentionLayer) -> _LayerKit:
        """The layer's kept dense-call constants (buffers, scales, geometry, sinks columns), remade whenever a field
        they came from changed (its `geometry` None where the layer or pool is not the dense kernels': the chunked
        kernels and their checks run it). Keyed by the layer object held weakly (the kit holds no reference to it),
        so a caller that makes its layers every forward does not grow the table: a kit goes with its layer, and a
        new object at a dead one's address is a new key."""
        kit = self._kits.get(layer)
        sig = (layer.layer_id, layer.num_heads, layer.head_dim, layer.scaling, layer.sliding_window,
               layer.logit_cap, layer.k_scale, layer.v_scale, storage_key(layer.sinks))  # (the columns' source view)
        if kit is not None and kit.sig == sig and kit.sinks is layer.sinks:
            return kit
        kit = self._kits[layer] = _LayerKit.make(layer, sig, *self.kv_buffers(layer))
        return kit

    def _run_dense(self, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList, md: ForwardMetadata,
                   out: torch.Tensor) -> bool:
        """The layer through `hwkv_cpu.kernels_dense` where this forward planned for it (`init_kernel_metadata`):
        the list's plan for this geometry and window, made by the first layer reading it and reused by the
        others; False where the chunked kernels run (graph mode, a verify tree, no host lengths, too large, a
        geometry their checks should see)."""
        plans = md.extra.get(_DENSE)
        if plans is None or not q.is_cpu:
            return False
        kit = self._layer_kit(layer)
        if kit.geometry is None:
            return False
        key = (kv.window, kv.is_swa_slots, kit.geometry)
        plan = plans.get(key, False)
        if plan is False:
            # decode over lists of equal lengths ending at each query (the metadata step's): nothing to hide
            # unless the layer's window is shorter than the list
            full_rows = md.is_decode and kv.table is not None and kv.min_len == kv.max_len
            kvh, g, d, dv, window = kit.geometry
            plan = plans[key] = plan_dense(kv.indptr, kv.indices, kv.pos0, md.q_pos0,
                                           None if md.is_decode else md.qo_indptr, kv.max_len, md.max_q_len, window,
                                           kvh, g, d, dv, self.options.dense_max_elements, table=kv.table,
                                           all_visible=full_rows)
        if plan is None:
            return False
        col = None
        if kit.sinks is not None and plan.decode:  # the sinks' column: kept per layer and decode batch size, refilled
            kept = kit.cols.get(plan.bs)
            if kept is None:
                kept = kit.cols[plan.bs] = kept_sink_column(kit.sinks, plan, kit.cdt)
            col, dst, src = kept
            dst.copy_(src)
        dense_attention(q, kit.k_buf, kit.v_buf, plan, out, kit.qk_scale, kit.cap, kit.v_scale, kit.sinks, col)
        return True

    # ---- kernels ---------------------------------------------------------------------------------------
    def forward_decode(self, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList,
                       md: ForwardMetadata, out: torch.Tensor) -> None:
        lst = self._ipex_list(q, layer, kv, md, decode=True)
        if lst is None:
            if not self._run_dense(q, layer, kv, md, out):
                super().forward_decode(q, layer, kv, md, out)
            return
        k_buf, v_buf = self.kv_buffers(layer)
        ipex.decode(q, k_buf, v_buf, lst, self._head_map(q, layer), out, layer.scaling,
                    ipex.decode_window(layer, kv), layer.logit_cap)

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList,
                       md: ForwardMetadata, out: torch.Tensor) -> None:
        lst = self._ipex_list(q, layer, kv, md, decode=False) if self.options.ipex_extend else None
        if lst is None:
            if not self._run_dense(q, layer, kv, md, out):
                super().forward_extend(q, layer, kv, md, out)
            return
        k_buf, v_buf = self.kv_buffers(layer)
        ipex.extend(q, k_buf, v_buf, lst, md.qo_indptr, md.max_q_len, out, layer.scaling, layer.window,
                    layer.logit_cap)
