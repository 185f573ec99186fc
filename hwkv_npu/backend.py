"""NPUBackend: the core template on Ascend NPUs through torch_npu, with a device-agnostic torch fallback.

Each layer asks `hwkv_npu.fia.decide` (the function `hwkv info` prints) whether the fused infer attention
computes it exactly: decode over page tables (windows trimmed by the index list plus a head mask),
extend with sparse_mode 3 (full) or the band sparse_mode 4 (SWA), an extend-like forward with one query row
per request (Q_S == 1: the op's incremental branch) in the decode form, sink layers through v2's
learnable_sink; in graph replays too, through task groups updated before each replay
(hwkv_npu.graph). Soft-cap, fp32/fp8 pools, K/V scales and page sizes the op refuses run
`hwkv_npu.ops.torch_attention`, layer by layer. K/V stores go through ATB reshape-and-cache, registered
for device type "npu". Nothing here translates locations: the page tables are read off the index lists
the core built (already SWA slots for SWA layers), once per forward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from hwkv import ops
from hwkv.backend import AttentionBackend, BackendOptions
from hwkv.batch import ForwardBatch
from hwkv.errors import ConfigError
from hwkv.layer import AttentionLayer
from hwkv.metadata import ForwardMetadata, KVIndexList, StaticBuffers, block_table_from_csr, window_pos0
from hwkv.paths import FUSED
from hwkv_npu import fia, import_torch_npu
from hwkv_npu import ops as npu_ops
from hwkv_npu.graph import record_task

ops.register_store_kv("npu", ops.checked_store(npu_ops.store_kv), prechecked=npu_ops.store_kv)  # (it checks nothing)

_PLANS, _ROWS, _FORM = "npu_fia", "npu_rows", "npu_form"


@dataclass(frozen=True)
class NPUOptions(BackendOptions):
    """`fused`: use torch_npu's fused infer attention wherever it supports the layer."""

    fused: bool = True


@dataclass
class _GraphList:
    """One index list's persistent graph plan and its static buffers (allocated once per static buffer set)."""

    plan: fia.FIAPlan
    table: torch.Tensor            # int32 [max_bs, max_pages]
    mask: Optional[torch.Tensor]   # bool [max_bs, 1, 1, max_pages * P] (window lists)
    cols: torch.Tensor             # int64 [max_pages * P]: key index within the list's pages


class NPUBackend(AttentionBackend):
    """Fused infer attention (eager and graphs) or torch attention over the paged pool; NPU graphs."""

    name = "npu"
    Options = NPUOptions

    def __init__(self, pool: Any, req_to_token_pool: Any, **options: Any) -> None:
        super().__init__(pool, req_to_token_pool, **options)
        self.page_size = int(pool.page_size)
        self.npu: Any = None
        self.env: fia.NPUEnv = self._load_env()
        self.fused_reason: Optional[str] = None if self.env.fused else self.env.fused_why
        self._mask2048: Optional[torch.Tensor] = None
        self._scratch: Dict[Tuple[Any, ...], torch.Tensor] = {}
        self._sinks = fia.KeptSinks()  # sink layers' learnable_sink in the query's dtype, refreshed per forward

    def _load_env(self) -> fia.NPUEnv:
        if not self.options.fused:
            return fia.NPUEnv(False, "disabled by fused=False")
        why = device_reason(self.device)
        if why is not None:
            return fia.NPUEnv(False, why)
        try:
            self.npu = import_torch_npu()
        except ConfigError as e:  # not installed, or its import raised (a CANN/driver mismatch): every layer on torch
            return fia.NPUEnv(False, str(e))
        return fia.load_env(self.npu)

    # ---- graph buffers: allocated once per static buffer set, shared by every runner -------------------
    def alloc_graph_tables(self, static: StaticBuffers) -> Optional[Dict[Optional[int], _GraphList]]:
        """Each list's persistent plan and page table / head mask for one static buffer set (one set per
        draft step, so each step's captured calls keep their own plan and host lengths)."""
        if not (self.env.fused and self.env.graph):
            return None
        p, ctx, st = self.page_size, self.graph_max_context_len, static
        max_q = st.max_num_tokens - st.max_bs + 1  # the most query rows one request of a graph batch has
        lists: Dict[Optional[int], _GraphList] = {}
        for w in [None, *self.windows]:
            span = ctx if w is None else min(ctx, w + max_q - 1)
            pages = -(-span // p) + 1  # + 1: a list may start mid-page
            table = torch.zeros(st.max_bs, pages, dtype=torch.int32, device=self.device)
            mask = None if w is None else torch.zeros(st.max_bs, 1, 1, pages * p, dtype=torch.bool, device=self.device)
            plan = fia.FIAPlan(table, [], p, mask)
            lists[w] = _GraphList(plan, table, mask, torch.arange(pages * p, device=self.device))
        return lists

    # ---- metadata: page tables and host lengths, once per forward -----------------------------------
    def init_kernel_metadata(self, md: ForwardMetadata, batch: ForwardBatch, graph: bool) -> None:
        if not self.env.fused:
            return
        self._sinks.refresh()  # before this forward's layers, task updates and replay (see fia.KeptSinks)
        if md.batch_size == 0 or (graph and not self.env.graph):
            return
        form = self._call_form(md, batch)
        if fia.page_size_reason(form, self.page_size) is not None:
            return
        if graph:
            seq, ext = batch.host_lens()  # the runner's host copies when the engine gave them: no sync
        else:
            seq, ext = md.seq_lens_cpu, md.extend_lens_cpu  # the base class's host copies: no second sync
            if seq is None:  # lists whose host lengths nobody has (a decode-like tree verify): torch path
                return
        if graph and not md.is_decode and not bool((ext == ext[0]).all()):
            return  # a graph extend step runs q as [B, S, H, D]: uneven rows run the torch kernel
        decode = form == "decode"
        plans: Dict[Optional[int], fia.FIAPlan] = {}
        for w, lst in [(None, md.full), *md.windows.items()]:
            pos0 = torch.zeros_like(seq) if w is None else window_pos0(seq - ext, w)
            plans[w] = (self._graph_plan(w, lst, pos0, seq, ext, md, decode) if graph
                        else self._plan(lst, pos0, seq, ext, md, decode))
        md.extra[_PLANS], md.extra[_FORM] = plans, form
        if not md.is_decode and not graph:
            md.extra[_ROWS] = npu_ops.TokenRows.build(md.qo_indptr, batch.num_tokens, md.max_q_len)
        if not decode and self._mask2048 is None:
            self._mask2048 = fia.causal_mask(self.device)

    @staticmethod
    def _call_form(md: ForwardMetadata, batch: ForwardBatch) -> str:
        """How this forward calls the fused op: "decode" when no request has more than one query row, extend-like
        modes included (a one-token prompt, a prefix hit recomputing its last token, a last prefill chunk of one
        token, one-token verify / draft-extend graphs). With Q_S == 1 the op runs its incremental branch, which
        ignores sparse_mode, pre_tokens and next_tokens and takes a [B, 1, 1, KV_S] mask, so such a forward runs
        the decode form: window lists trimmed plus the first page's head mask. Exact: the one query sits at
        seq_len - 1, as a decode token does (and a one-token verify tree is its own ancestor only). A graph's rows
        per request are its static token count over its batch size (every request has as many); eager, the
        metadata's max_q_len (host lengths; a request with no new token is padded and dropped)."""
        if md.is_decode:
            return "decode"
        rows = batch.num_tokens // md.batch_size if md.graph else md.max_q_len
        return "decode" if rows <= 1 else "extend"

    def _plan(self, lst: KVIndexList, pos0_cpu: torch.Tensor, seq_cpu: torch.Tensor, ext_cpu: torch.Tensor,
              md: ForwardMetadata, decode: bool) -> fia.FIAPlan:
        """Page table of a list from its first key's page; decode-form windows mask that page's head."""
        p = self.page_size
        off = pos0_cpu % p
        kv_lens = seq_cpu - pos0_cpu + off
        max_pages = -(-int(kv_lens.max()) // p)
        table = block_table_from_csr(lst.indptr, lst.indices, lst.pos0, p, max_pages)
        mask = None
        if decode and bool((off > 0).any()):
            j = torch.arange(max_pages * p, device="cpu")
            mask = (j[None, :] < off[:, None]).view(len(off), 1, 1, -1).to(self.device)
        return fia.FIAPlan(table, kv_lens.tolist(), p, mask, None if decode else ext_cpu.tolist())

    def _graph_plan(self, w: Optional[int], lst: KVIndexList, pos0_cpu: torch.Tensor, seq_cpu: torch.Tensor,
                    ext_cpu: torch.Tensor, md: ForwardMetadata, decode: bool) -> fia.FIAPlan:
        """The persistent plan refilled in place: page table and head mask into the static buffers (device
        work), host lengths into the plan that every captured call of this list reads when updated."""
        g, p, bs = self.graph_tables(md)[w], self.page_size, md.batch_size
        g.table[:bs].copy_(block_table_from_csr(lst.indptr, lst.indices, lst.pos0, p, g.table.shape[1]))
        if g.mask is not None:
            off = torch.remainder(lst.pos0, p)
            torch.lt(g.cols[None, :], off[:, None], out=g.mask[:bs].view(bs, -1))
        g.plan.kv_lens = (seq_cpu - pos0_cpu + pos0_cpu % p).tolist()
        g.plan.q_lens = None if decode else ext_cpu.tolist()
        return g.plan

    # ---- kernels --------------------------------------------------------------------------------
    def _fused_plan(self, mode: str, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList,
                    md: ForwardMetadata) -> Optional[fia.FIAPlan]:
        """This forward's plan of the layer's list when the fused op computes the layer, else None."""
        plan = md.extra.get(_PLANS, {}).get(kv.window)
        if plan is None:
            return None
        k_buf, v_buf = self.kv_buffers(layer)
        facts = fia.facts_of(mode, q, layer, kv, k_buf, v_buf, self.page_size, md.graph)
        return plan if fia.decide(facts, self.env).path == FUSED else None

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList,
                       md: ForwardMetadata, out: torch.Tensor) -> None:
        plan = self._fused_plan("decode", q, layer, kv, md)
        if plan is None:
            self._torch_attention(q, layer, kv, md, out)
            return
        bs, h, d = q.shape
        self._fused(q.contiguous().view(bs, 1, h, d), layer, plan, True, md, out.view(bs, 1, h, -1))

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList,
                       md: ForwardMetadata, out: torch.Tensor) -> None:
        form = md.extra.get(_FORM, "extend")
        decode = form == "decode"  # one query row per request: the decode call form (see _call_form)
        # the fused op's masks are causal/band only: a verify tree of several rows runs the torch path, which takes it
        plan = None if md.tree is not None and not decode else self._fused_plan(form, q, layer, kv, md)
        if plan is None:
            self._torch_attention(q, layer, kv, md, out)
            return
        t, h, d = q.shape
        if md.graph:  # every request has the same rows (checked in the metadata step)
            bs = md.batch_size
            self._fused(q.contiguous().view(bs, t // bs, h, d), layer, plan, decode, md, out.view(bs, t // bs, h, -1))
            return
        rows = md.extra[_ROWS]
        qpad = q.new_zeros(rows.batch_size, rows.max_q, h, d)
        qpad[rows.req, rows.row] = q
        k_buf, v_buf = self.kv_buffers(layer)
        res = fia.run_eager(self.npu, qpad, k_buf, v_buf, plan, layer, decode, self.env, self._mask2048,
                            self._kept_sinks(layer, q.dtype))
        out.copy_(res[rows.req, rows.row])

    def _fused(self, q4: torch.Tensor, layer: AttentionLayer, plan: fia.FIAPlan, decode: bool, md: ForwardMetadata,
               out4: torch.Tensor) -> None:
        k_buf, v_buf = self.kv_buffers(layer)
        mask = None if decode else self._mask2048
        sinks = self._kept_sinks(layer, q4.dtype)
        if md.graph:
            fia.graph_call(self.npu, q4, k_buf, v_buf, out4, plan, layer, decode, self.env, mask, sinks,
                           self._scratch_for, record_task)
        else:
            out4.copy_(fia.run_eager(self.npu, q4, k_buf, v_buf, plan, layer, decode, self.env, mask, sinks))

    def _kept_sinks(self, layer: AttentionLayer, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """A sink layer's learnable_sink: its sinks themselves when they are in the query's dtype (no copy, nothing
        to refresh), else a copy in that dtype kept per layer (fia.KeptSinks); None without sinks."""
        sinks = layer.sinks
        if sinks is None or sinks.dtype == dtype:
            return sinks
        return self._sinks.get(layer, dtype)

    def _scratch_for(self, key: Tuple[Any, ...], make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Buffers captured graphs keep reading (workspaces, lse): made once, kept for the backend's life."""
        t = self._scratch.get(key)
        if t is None:
            t = self._scratch[key] = make()
        return t

    def _torch_attention(self, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList,
                         md: ForwardMetadata, out: torch.Tensor) -> None:
        k_buf, v_buf = self.kv_buffers(layer)
        npu_ops.torch_attention(q, k_buf, v_buf, kv.indptr, kv.indices, kv.pos0, md.qo_indptr, md.q_pos0, out,
                                md.max_q_len, kv.max_len, layer.scaling, layer.window, layer.logit_cap,
                                layer.sinks, layer.k_scale, layer.v_scale, tree=md.tree)


def device_reason(device: torch.device) -> Optional[str]:
    """None for an NPU pool, else why the fused op cannot read it."""
    return None if device.type == "npu" else f"the pool lives on {device}, not on an NPU"

