"""TritonBackend: the core template with hwkv's Triton kernels (CUDA, MUSA; ROCm/XPU reuse them).

Per layer it launches its store and its attention with arguments planned once per forward: the
first layer of each (index list, head geometry) checks its arguments fully and plans the launch
(split count, decode workspace); the others compare shapes against that plan and launch.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from hwkv import ops
from hwkv.backend import KernelSetBackend
from hwkv.layer import AttentionLayer, storage_key
from hwkv.metadata import ForwardMetadata, KVIndexList
from hwkv.pages import register_page_ops
from hwkv_cuda import kernels as _kernels
from hwkv_cuda.kernels.alloc import TritonPageOps
from hwkv_cuda.kernels.common import next_pow2, num_sms

for _dev in ("cuda", "musa"):
    register_page_ops(_dev, TritonPageOps())
    ops.register_store_kv(_dev, _kernels.store_kv, prechecked=_kernels.store_kv_prechecked)
    ops.register_fill_kv_indices(_dev, _kernels.index.fill_kv_indices_prechecked)
    ops.register_graph_refill(_dev, _kernels.refill.KERNELS)
    ops.register_tree_decode(_dev, _kernels.tree.tree_decode_fill)
    ops.register_step_kernels(_dev, _kernels.step.KERNELS)


_PLANS = "triton_plans"


class TritonBackend(KernelSetBackend):
    """Split-K decode and paged extend kernels; graphs through the device's graph adapter."""

    name = "triton"
    kernels = _kernels
    strided_query = False  # its kernels read q rows of unit stride
    # the graph refill is device launches into static buffers (one for a hybrid pool) and the layers' plans are fixed per
    # bucket: GraphRunner captures the refill with the layers (no host work per replay but input copies)
    metadata_in_graph = True

    def __init__(self, pool: Any, req_to_token_pool: Any, **options: Any) -> None:
        super().__init__(pool, req_to_token_pool, **options)
        # decode scratch that captured graphs write: kept for the backend's lifetime, shared by every
        # layer and bucket (graphs replay one at a time, in stream order)
        self._graph_workspaces: Dict[Tuple[int, int, int], _kernels.DecodeWorkspace] = {}
        self._outgrown: List[_kernels.DecodeWorkspace] = []  # earlier captures may still write these
        self._decode_layers: Dict[int, Tuple[Any, ...]] = {}  # layer id -> what _decode_layer made, and from what

    @staticmethod
    def _plans(md: ForwardMetadata) -> Dict[Any, Any]:
        plans = md.extra.get(_PLANS)
        if plans is None:
            plans = md.extra[_PLANS] = {}
        return plans

    def _plan(self, md: ForwardMetadata, decode: bool, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList,
              k_buf: torch.Tensor, v_buf: torch.Tensor, out: torch.Tensor) -> Any:
        """The launch plan of this forward for a list and head geometry (checked once, then reused)."""
        plans = self._plans(md)
        key = (decode, kv.window, q.shape[1], q.shape[2], k_buf.shape[1], v_buf.shape[2])
        plan = plans.get(key)
        if plan is None:
            if decode and md.graph:  # one config sizes the backend's scratch and plans the launch (an eager plan
                # picks by the list bound rounded up to a power of two, which may give another split count)
                cfg = _kernels.decode_config(q.shape[0], k_buf.shape[1], max(q.shape[2], v_buf.shape[2]),
                                             kv.max_len, q.device)
                plan = _kernels.plan_decode(
                    q, k_buf, v_buf, kv.indptr, kv.indices, kv.pos0, md.q_pos0, out, layer.sinks, kv.max_len,
                    workspace=self._graph_workspace(q, k_buf, v_buf, kv, cfg), config=cfg)
            elif decode:
                plan = _kernels.plan_decode(q, k_buf, v_buf, kv.indptr, kv.indices, kv.pos0, md.q_pos0, out,
                                            layer.sinks, kv.max_len)
            else:
                plan = _kernels.plan_extend(q, k_buf, v_buf, kv.indptr, kv.indices, kv.pos0, md.qo_indptr,
                                            md.q_pos0, out, md.max_q_len, layer.sinks, tree=md.tree,
                                            window=kv.window)
            plans[key] = plan
        return plan

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList,
                       md: ForwardMetadata, out: torch.Tensor) -> None:
        k_buf, v_buf = self.kv_buffers(layer)
        plan = self._plan(md, True, q, layer, kv, k_buf, v_buf, out)
        _kernels.decode_attention_planned(plan, q, k_buf, v_buf, kv.indptr, kv.indices, kv.pos0, md.q_pos0, out,
                                          layer.scaling, layer.window, layer.logit_cap, layer.sinks,
                                          layer.k_scale, layer.v_scale, self._decode_layer(layer, k_buf, v_buf))

    def _decode_layer(self, layer: AttentionLayer, k_buf: torch.Tensor, v_buf: torch.Tensor) -> Any:
        """The layer's part of its decode launches, made at its first decode and kept while the layer object, its
        buffers, sinks (and their storage) and scalars stay the ones it was made from (identity and value
        compares)."""
        kept = self._decode_layers.get(layer.layer_id)
        values = (layer.scaling, layer.sliding_window, layer.logit_cap, layer.k_scale, layer.v_scale,
                  storage_key(layer.sinks))  # (the launch's spec holds the sinks' alignment and dtype)
        if (kept is None or kept[0] is not layer or kept[1] is not k_buf or kept[2] is not v_buf
                or kept[3] is not layer.sinks or kept[4] != values):
            part = _kernels.decode_layer(k_buf, v_buf, layer.sinks, layer.scaling, layer.window, layer.logit_cap,
                                         layer.k_scale, layer.v_scale)
            kept = self._decode_layers[layer.layer_id] = (layer, k_buf, v_buf, layer.sinks, values, part)
        return kept[5]

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList,
                       md: ForwardMetadata, out: torch.Tensor) -> None:
        k_buf, v_buf = self.kv_buffers(layer)
        plan = self._plan(md, False, q, layer, kv, k_buf, v_buf, out)
        _kernels.extend_attention_planned(plan, q, k_buf, v_buf, kv.indptr, kv.indices, kv.pos0, md.qo_indptr,
                                          md.q_pos0, out, md.max_q_len, layer.scaling, layer.window,
                                          layer.logit_cap, layer.sinks, layer.k_scale, layer.v_scale, tree=md.tree)

    def decode_like_verify_pays(self, num_requests: int, num_tokens: int) -> bool:
        """tree_verify="auto": decode-like while the extend kernel's verify grid over the full layers (a program
        per request and kv head for trees of up to 16 drafts at GQA 8) holds fewer programs than the device has
        SMs, so it would leave most of them idle; the decode lists split every draft's keys instead. The full
        layers decide: their lists are long, while both kernels take a few us over a window. H200, 15 drafts,
        GQA 8, one 36-layer verify through graphs (docs/benchmarks.md): decode-like 6.4x at batch 1 over 4K, 7.6x
        over 32K, 1.7x at batch 8 over 4K; extend 1.85x ahead at batch 32 over 32K. Measured on NVIDIA only."""
        return num_requests * self._full_kv_heads < num_sms(self.device)

    def decode_like_chain_pays(self, num_requests: int, num_tokens: int) -> bool:
        """A chain of drafts keeps the extend kernel's causal verify (no tree mask), so decode-like lists pay only
        while the extend grid over the full layers fills at most a quarter of the SMs. H200, 4 drafts, GQA 8, 36
        layers over 4K through graphs (docs/benchmarks.md): decode-like 0.36x the extend verify's time at batch 1,
        0.71x at 4, 1.25x at 8, 2.17x at 16. Measured on NVIDIA at 4K only."""
        return 4 * num_requests * self._full_kv_heads <= num_sms(self.device)

    @property
    def _full_kv_heads(self) -> int:
        """KV heads of the full layers, which decide both verify rules (their lists are the long ones)."""
        return (self.pool.full_kv_pool if self.hybrid else self.pool).head_num

    def _graph_workspace(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                         kv: KVIndexList, cfg: _kernels.DecodeConfig) -> Optional[_kernels.DecodeWorkspace]:
        """Graph metadata: the split-K scratch comes from the backend (it outlives the forward that
        captured it), sized to the largest batch seen, in powers of two, for the plan's config; None when one
        split does."""
        bs, h, dv = q.shape[0], q.shape[1], v_buf.shape[2]
        splits = _kernels.decode_num_splits(bs, k_buf.shape[1], kv.max_len, q.device, cfg,
                                             head_dim=max(q.shape[2], dv))
        if splits == 1:
            return None
        ws = self._graph_workspaces.get((h, dv, splits))
        if ws is None or ws.lse.shape[0] < bs:
            if ws is not None:
                self._outgrown.append(ws)
            ws = _kernels.make_decode_workspace(next_pow2(bs), h, dv, splits, q.device)
            self._graph_workspaces[(h, dv, splits)] = ws
        return ws
