"""TorchCPUBackend: the core template with vectorized torch kernels (AMX through oneDNN in bf16), and IPEX's
paged-attention ops for the layers they run exactly when intel_extension_for_pytorch is installed.

Per layer (see `hwkv_cpu.ipex` for what was verified): decode goes to IPEX's
single_query_cached_kv_attention, and with `ipex_extend=True` extend to its flash_attn_varlen_func, when
`ipex.layer_reason` finds nothing the op lacks (sinks, fp8/K-V scales, unequal K/V head dims, a window with
softcap in decode over the full list, W=1 in extend); every other layer runs `hwkv_cpu.kernels`. The slot
tables IPEX reads are built once per forward from the core's index lists (graph mode: into tables
allocated once per static buffer set by `alloc_graph_tables`).

Extend stays on the torch kernels unless asked for: the varlen op reads hwkv's token-major pool only with
block_size 1, and there it measured 7-13x slower than `hwkv_cpu.kernels` (IPEX 2.8.0, 2-core AVX-512 VM,
2 x 256 queries over 2,048 keys, 32/8 heads of 128: 990 vs 130 ms fp32, 1,890 vs 150 ms bf16), while
decode measured 13.5 vs 28 ms in bf16 and 60 vs 55 ms in fp32 (8 requests x 2,048 keys).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from hwkv import ops
from hwkv.backend import BackendOptions, KernelSetBackend
from hwkv.batch import ForwardBatch
from hwkv.errors import ConfigError
from hwkv.layer import AttentionLayer
from hwkv.metadata import ForwardMetadata, KVIndexList, StaticBuffers, cumsum_into
from hwkv_cpu import ipex
from hwkv_cpu import kernels as _kernels
from hwkv_cpu.kernels_dense import (DENSE_MAX_ELEMENTS, DensePlan, compute_dtype, dense_attention, plan_dense,
                                    sink_column)

if ipex.installed_reason() is None:  # cheap: package metadata only; IPEX itself is imported on first use
    ops.register_store_kv("cpu", ops.store_kv_torch, prechecked=ipex.store_kv_prechecked)

_IPEX = "ipex_lists"
_DENSE = "dense_plans"
TABLE_SLACK = 1 << 16  # table entries beyond twice the list's that an eager list may take to be one gather


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
        super().__post_init__()
        m = self.dense_max_elements
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ConfigError(f"dense_max_elements={m!r} must be an int >= 0 (0: off)")


class TorchCPUBackend(KernelSetBackend):
    """CPU kernels over the paged pool; graph mode through torch.compile over static buffers."""

    name = "cpu"
    kernels = _kernels
    Options = CPUOptions

    def __init__(self, pool: Any, req_to_token_pool: Any, **options: Any) -> None:
        super().__init__(pool, req_to_token_pool, **options)
        self.ipex_reason: Optional[str] = self._ipex_reason()  # None: IPEX ops in use where they fit
        self._head_maps: Dict[Tuple[int, int], torch.Tensor] = {}
        self._cols = torch.arange(256, dtype=torch.int64, device=self.device)  # see _columns
        # decode's sinks column per (layer, bs, kvh, g, dtype), with the sinks tensor it was made from
        self._sink_cols: Dict[Tuple[Any, ...], Tuple[torch.Tensor, torch.Tensor]] = {}

    def _ipex_reason(self) -> Optional[str]:
        if not self.options.ipex:
            return "disabled by ipex=False"
        if self.device.type != "cpu":
            return f"the pool lives on {self.device}"
        return ipex.load()[1] or None

    # ---- metadata: the lists through one dense gather, once per forward ------------------------------
    def _eager_list(self, batch: ForwardBatch, seq: torch.Tensor, pos0: torch.Tensor, total: int,
                    window: Optional[int], max_len: int, min_len: int = 0) -> KVIndexList:
        """On the CPU a list is one gather of req_to_token into a [bs, max_len] table (translated at once for
        a window of a hybrid pool: still the list's one translation), the CSR entries its valid part; the
        table stays on the list for the dense kernels. Tables much larger than the list (lengths far apart,
        long contexts) take the core's CSR fill."""
        bs = batch.batch_size
        if bs == 0 or max_len <= 0 or bs * max_len > 2 * total + TABLE_SLACK or self.device.type != "cpu":
            return super()._eager_list(batch, seq, pos0, total, window, max_len, min_len)
        rtt = self.req_to_token_pool.req_to_token
        uniform = min_len == max_len  # every request lists max_len keys: no padding, no clamping
        col = self._columns(max_len)
        pos = col if window is None else pos0[:, None] + col  # the full list starts at 0
        if not uniform:
            pos = pos.clamp(max=rtt.shape[1] - 1)
        table = rtt[batch.req_pool_indices.to(torch.int64)[:, None], pos]
        swa_slots = window is not None and self.hybrid
        if swa_slots:
            table = self._translate_window(table)
        if uniform:
            indices = table.view(-1)
            indptr = torch.arange(0, (bs + 1) * max_len, max_len, dtype=torch.int32, device=self.device)
        else:
            lens = seq - pos0
            indices = table[col < lens[:, None]]
            indptr = cumsum_into(lens, torch.empty(bs + 1, dtype=torch.int32, device=self.device))
        if swa_slots and self.debug:
            self._check_not_evicted(indices, window)
        return KVIndexList(indptr, indices, pos0, window, max_len, swa_slots, min_len, table)

    def _columns(self, n: int) -> torch.Tensor:
        """arange(n) as a view of one kept arange (grown by doubling; read only, never written)."""
        cols = self._cols
        if cols.shape[0] < n:
            cols = self._cols = torch.arange(max(n, 2 * cols.shape[0]), dtype=torch.int64, device=self.device)
        return cols[:n]

    # ---- metadata: IPEX's slot tables, once per forward --------------------------------------------
    def alloc_graph_tables(self, static: StaticBuffers) -> Optional[ipex.GraphTables]:
        """IPEX's slot tables for one static buffer set (once, like them: every runner shares them)."""
        if self.ipex_reason is not None:
            return None
        return ipex.GraphTables.alloc(static.max_bs, static.max_num_tokens, self.graph_max_context_len,
                                      self.windows, self.device)

    def init_kernel_metadata(self, md: ForwardMetadata, batch: ForwardBatch, graph: bool) -> None:
        if self.ipex_reason is None and md.batch_size and (md.is_decode or self.options.ipex_extend):
            lists = {None: md.full, **md.windows}
            if graph:
                g = self.graph_tables(md)
                md.extra[_IPEX] = {w: ipex.plan_list(lst, g.width(w), out=g) for w, lst in lists.items()}
            else:
                md.extra[_IPEX] = {w: ipex.plan_list(lst, max(lst.max_len, 1)) for w, lst in lists.items()}

    def _ipex_list(self, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList, md: ForwardMetadata,
                   decode: bool) -> Optional[ipex.IpexList]:
        """The list's IPEX plan when IPEX runs this layer, else None (the torch kernels)."""
        plans = md.extra.get(_IPEX)
        if plans is None or md.tree is not None:  # IPEX's ops take no verify-tree mask: the torch kernels do
            return None
        k_buf, v_buf = self.kv_buffers(layer)
        if ipex.layer_reason(q, layer, kv, k_buf, v_buf, decode) is not None:
            return None
        return plans[kv.window]

    def _head_map(self, q: torch.Tensor, layer: AttentionLayer) -> torch.Tensor:
        key = (layer.num_heads, layer.num_kv_heads)
        hm = self._head_maps.get(key)
        if hm is None:  # made at the first forward (graph capture warms up eagerly first): kept for life
            hm = self._head_maps[key] = ipex.head_mapping(layer.num_heads, layer.num_kv_heads, q.device)
        return hm

    def _dense_plan(self, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList, md: ForwardMetadata,
                    k_buf: torch.Tensor, v_buf: torch.Tensor) -> Optional[DensePlan]:
        """The list's dense plan for this layer's geometry and window: made by the first layer that reads it
        in this forward, reused by the others; None where the chunked kernels run (graph mode, a verify tree,
        no host lengths, too large, or arguments their checks should see)."""
        if (not self.options.dense_max_elements or md.graph or md.tree is not None or md.seq_lens_cpu is None
                or k_buf.dim() != 3 or q.dim() != 3):
            return None
        kvh, d, dv = k_buf.shape[1], k_buf.shape[2], v_buf.shape[2]
        h = q.shape[1]
        if h % kvh or q.shape[2] != d or v_buf.shape[:2] != k_buf.shape[:2] or q.device.type != "cpu":
            return None
        plans = md.extra.get(_DENSE)
        if plans is None:
            plans = md.extra[_DENSE] = {}
        key = (kv.window, kv.is_swa_slots, layer.window or 0, kvh, h // kvh, d, dv)
        if key not in plans:
            # decode over lists of equal lengths ending at each query (the metadata step's): nothing to hide
            # unless the layer's window is shorter than the list
            full_rows = md.is_decode and kv.table is not None and kv.min_len == kv.max_len
            plans[key] = plan_dense(kv.indptr, kv.indices, kv.pos0, md.q_pos0, None if md.is_decode else md.qo_indptr,
                                    kv.max_len, md.max_q_len, layer.window or 0, kvh, h // kvh, d, dv,
                                    self.options.dense_max_elements, table=kv.table, all_visible=full_rows)
        return plans[key]

    def _run_dense(self, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList, md: ForwardMetadata,
                   out: torch.Tensor) -> bool:
        k_buf, v_buf = self.kv_buffers(layer)
        plan = self._dense_plan(q, layer, kv, md, k_buf, v_buf)
        if plan is None:
            return False
        qk_scale, cap, v_scale, _ = _kernels._scalars(q, layer.scaling, layer.window, layer.logit_cap,
                                                      layer.k_scale, layer.v_scale)
        sinks, col = layer.sinks, None
        if sinks is not None and plan.decode:  # the sinks' column, kept per layer and decode batch size
            cdt = compute_dtype(k_buf.dtype)
            key = (layer.layer_id, plan.bs, plan.kvh, plan.g, cdt)
            kept = self._sink_cols.get(key)
            if kept is None or kept[0] is not sinks:
                kept = self._sink_cols[key] = (sinks, sink_column(sinks, plan, cdt))
            col = kept[1]
        dense_attention(q, k_buf, v_buf, plan, out, qk_scale, cap, v_scale, sinks, col)
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
