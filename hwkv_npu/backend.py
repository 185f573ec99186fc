"""NPUBackend: the core template on Ascend NPUs through torch_npu, with a device-agnostic torch fallback.

Per layer (see `hwkv_npu.ops` for the verified vendor APIs):
- decode: `npu_fused_infer_attention_score` with page attention when it supports the layer
  (fp16/bf16 pool, no sinks, no soft-cap, no K/V scale, equal K/V head dims, page size a multiple
  of 16), otherwise `hwkv_npu.ops.torch_attention`;
- extend: the fused op for full-attention layers when the page size is a multiple of 128 in
  [128, 512]; windowed layers and everything else use `torch_attention`.
The fused op takes host length lists, so it runs in eager forwards only: graph replays use
`torch_attention` (static shapes, no host sync). K/V stores go through ATB reshape-and-cache,
registered for device type "npu". Nothing here translates locations: the page tables are read
off the index lists the core built (already SWA slots for SWA layers).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from hwkv import ops
from hwkv.backend import AttentionBackend, BackendOptions
from hwkv.batch import ForwardBatch
from hwkv.layer import AttentionLayer
from hwkv.metadata import ForwardMetadata, KVIndexList
from hwkv_npu import ops as npu_ops

ops.register_store_kv("npu", npu_ops.store_kv)


@dataclass(frozen=True)
class NPUOptions(BackendOptions):
    """`fused`: use torch_npu's fused infer attention wherever it supports the layer."""

    fused: bool = True


class NPUBackend(AttentionBackend):
    """Fused infer attention (eager) or torch attention over the paged pool; NPU graphs."""

    name = "npu"
    Options = NPUOptions

    def __init__(self, pool: Any, req_to_token_pool: Any, **options: Any) -> None:
        super().__init__(pool, req_to_token_pool, **options)
        self.page_size = int(pool.page_size)
        self.fused_reason: Optional[str] = self._fused_reason()  # None: the fused op is in use
        self._causal_mask: Optional[torch.Tensor] = None

    def _fused_reason(self) -> Optional[str]:
        if not self.options.fused:
            return "disabled by fused=False"
        if self.device.type != "npu":
            return f"the pool lives on {self.device}, not on an NPU"
        if importlib.util.find_spec("torch_npu") is None:
            return "torch_npu is not installed"
        npu_ops._torch_npu()
        return npu_ops.fia_schema_reason()

    # ---- metadata: page tables and host lengths, once per eager forward -----------------------
    def init_kernel_metadata(self, md: ForwardMetadata, batch: ForwardBatch, graph: bool) -> None:
        if graph or self.fused_reason is not None or md.batch_size == 0:
            return
        p = self.page_size
        seq, ext = md.seq_lens_cpu, md.extend_lens_cpu  # the base class's host copies: no second sync
        plans: Dict[Optional[int], npu_ops.FIAPlan] = {}
        if md.is_decode and p % 16 == 0:
            plans[None] = self._plan(md.full, torch.zeros_like(seq), seq, decode=True)
            for w, lst in md.windows.items():
                plans[w] = self._plan(lst, (seq - ext - (w - 1)).clamp(min=0), seq, decode=True)
        elif not md.is_decode and p % 128 == 0 and p <= 512:
            plans[None] = self._plan(md.full, torch.zeros_like(seq), seq, decode=False)
            plans[None].q_lens = ext.tolist()
            md.extra["npu_rows"] = npu_ops.TokenRows.build(md.qo_indptr, batch.num_tokens, md.max_q_len)
            if self._causal_mask is None:
                self._causal_mask = npu_ops.fia_causal_mask(self.device)
        md.extra["npu_fia"] = plans

    def _plan(self, lst: KVIndexList, pos0_cpu: torch.Tensor, seq_cpu: torch.Tensor,
              decode: bool) -> npu_ops.FIAPlan:
        """Page table of a list from its first key's page; decode windows mask that page's head."""
        p = self.page_size
        off = pos0_cpu % p
        kv_lens = seq_cpu - pos0_cpu + off
        max_pages = -(-int(kv_lens.max()) // p)
        table = npu_ops.block_table_from_csr(lst.indptr, lst.indices, lst.pos0, p, max_pages)
        mask = None
        if decode and bool((off > 0).any()):
            j = torch.arange(max_pages * p)
            mask = (j[None, :] < off[:, None]).view(len(off), 1, 1, -1).to(self.device)
        return npu_ops.FIAPlan(table, kv_lens.tolist(), p, mask)

    def _fia_plan(self, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList,
                  md: ForwardMetadata) -> Optional[npu_ops.FIAPlan]:
        """The plan when the fused op supports this layer here, else None (torch attention)."""
        plan = md.extra.get("npu_fia", {}).get(kv.window)
        if plan is None or layer.sinks is not None or layer.logit_cap:
            return None
        if layer.k_scale not in (None, 1.0) or layer.v_scale not in (None, 1.0):
            return None
        if layer.window is not None and (kv.window != layer.window or not md.is_decode):
            return None  # the list is not trimmed to the layer's window, or a windowed extend
        k_buf, v_buf = self.kv_buffers(layer)
        h, d = q.shape[1], q.shape[2]
        kvh = k_buf.shape[1]
        if q.dtype not in npu_ops.FIA_DTYPES or k_buf.dtype != q.dtype or v_buf.dtype != q.dtype:
            return None
        if v_buf.shape[2] != d or d % 16 or d > 512 or h > 256 or h // kvh > 64 or kvh * d >= 65536:
            return None
        return plan

    # ---- kernels --------------------------------------------------------------------------------
    def forward_decode(self, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList,
                       md: ForwardMetadata, out: torch.Tensor) -> None:
        plan = self._fia_plan(q, layer, kv, md)
        if plan is None:
            self._torch_attention(q, layer, kv, md, out)
            return
        k_buf, v_buf = self.kv_buffers(layer)
        npu_ops.fia_decode(q, k_buf, v_buf, plan, layer.scaling, out)

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList,
                       md: ForwardMetadata, out: torch.Tensor) -> None:
        plan = self._fia_plan(q, layer, kv, md)
        if plan is None:
            self._torch_attention(q, layer, kv, md, out)
            return
        k_buf, v_buf = self.kv_buffers(layer)
        npu_ops.fia_extend(q, k_buf, v_buf, plan, layer.scaling, md.extra["npu_rows"], self._causal_mask, out)

    def _torch_attention(self, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList,
                         md: ForwardMetadata, out: torch.Tensor) -> None:
        k_buf, v_buf = self.kv_buffers(layer)
        npu_ops.torch_attention(q, k_buf, v_buf, kv.indptr, kv.indices, kv.pos0, md.qo_indptr, md.q_pos0, out,
                                md.max_q_len, kv.max_len, layer.scaling, layer.window, layer.logit_cap,
                                layer.sinks, layer.k_scale, layer.v_scale)
