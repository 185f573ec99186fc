"""A slow backend whose kernels are hwkv.reference over the index lists: tests the template alone."""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from hwkv import reference
from hwkv.backend import AttentionBackend
from hwkv.layer import AttentionLayer
from hwkv.metadata import ForwardMetadata, KVIndexList


class ReferenceBackend(AttentionBackend):
    """Per-request loop over `reference.attention`; correct by construction, not fast."""

    name = "reference"

    def _attend(self, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList, md: ForwardMetadata,
                out: torch.Tensor) -> None:
        k_buf, v_buf = self.kv_buffers(layer)
        indptr, qo = kv.indptr.tolist(), md.qo_indptr.tolist()
        pos0, qpos0 = kv.pos0.tolist(), md.q_pos0.tolist()
        for b in range(md.batch_size):
            idx = kv.indices[indptr[b]:indptr[b + 1]]
            k = k_buf[idx].float() * (layer.k_scale or 1.0)
            v = v_buf[idx].float() * (layer.v_scale or 1.0)
            nq = qo[b + 1] - qo[b]
            q_pos = torch.arange(qpos0[b], qpos0[b] + nq, device="cpu")
            k_pos = torch.arange(pos0[b], pos0[b] + idx.numel(), device="cpu")
            mask = None if md.tree is None else _tree_visibility(md.tree, b, qo[b], nq, qpos0[b], k_pos, layer.window)
            o = self.request_attention(layer, md, q[qo[b]:qo[b + 1]], k, v, q_pos, k_pos, mask,
                                       dict(scaling=layer.scaling, window=layer.window, logit_cap=layer.logit_cap,
                                            sinks=layer.sinks))
            out[qo[b]:qo[b + 1]] = o.to(out.dtype)

    def request_attention(self, layer: AttentionLayer, md: ForwardMetadata, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, mask: Optional[torch.Tensor],
                          options: Dict[str, Any]) -> torch.Tensor:
        """One request's attention (its keys dequantized fp32, positions, tree mask, the layer's `options`): where a
        test's deliberately broken backend puts its one fault."""
        return reference.attention(q, k, v, q_pos, k_pos, options["scaling"], options["window"],
                                   options["logit_cap"], options["sinks"], mask=mask)

    forward_decode = _attend
    forward_extend = _attend


def _tree_visibility(tree, b: int, q_start: int, nq: int, first_draft: int, k_pos: torch.Tensor,
                     window) -> torch.Tensor:
    """[nq, keys] bool of request b under a verify tree, entry by entry from hwkv/spec.py's rule."""
    mask, off = tree.mask.cpu(), int(tree.mask_indptr[b])
    pos = tree.q_positions.cpu()[q_start:q_start + nq].tolist()
    see = torch.zeros(nq, k_pos.numel(), dtype=torch.bool, device="cpu")
    for i in range(nq):
        for j, p in enumerate(k_pos.tolist()):
            if p < first_draft:
                kp, ok = p, True
            else:
                t = p - first_draft
                kp, ok = pos[t], bool(mask[off + i * nq + t])
            see[i, j] = ok and kp <= pos[i] and (not window or kp > pos[i] - window)
    return see
