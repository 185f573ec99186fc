"""Dense torch oracle for attention: causal + window, sinks, soft-cap, GQA, fp32.

Deliberately simple and independent of pools, allocators and kernels: it takes plain
per-request K/V with explicit positions, so every backend can be checked against it.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from hwkv.window import first_visible


def visible_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """[Tq, Tk] bool: key j visible to query i iff first_visible(i, W) <= j <= i."""
    lo = torch.tensor([first_visible(int(p), window) for p in q_pos.tolist()], dtype=torch.long, device="cpu")
    qp = q_pos.long().cpu()[:, None]
    kp = k_pos.long().cpu()[None, :]
    return (kp <= qp) & (kp >= lo[:, None])


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scaling: Optional[float] = None,
    window: Optional[int] = None,
    logit_cap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One request: q [Tq, H, D], k [Tk, KVH, D], v [Tk, KVH, Dv] -> [Tq, H, Dv] fp32.
    `mask` [Tq, Tk] bool, when given, is the visibility itself (a verify tree's, `hwkv.spec.tree_visible`)
    instead of the window rule over q_pos/k_pos."""
    tq, h, d = q.shape
    kvh = k.shape[1]
    if h % kvh:
        raise ValueError(f"num_heads {h} is not a multiple of num_kv_heads {kvh}")
    scale = scaling if scaling is not None else 1.0 / math.sqrt(d)
    qf = q.detach().float().cpu()
    kf = k.detach().float().cpu().repeat_interleave(h // kvh, dim=1)
    vf = v.detach().float().cpu().repeat_interleave(h // kvh, dim=1)
    logits = torch.einsum("qhd,khd->hqk", qf, kf) * scale
    if logit_cap and logit_cap > 0:
        logits = logit_cap * torch.tanh(logits / logit_cap)
    if mask is None:
        mask = visible_mask(q_pos, k_pos, window)
    mask = mask.bool().cpu()
    logits = logits.masked_fill(~mask[None], float("-inf"))
    if sinks is not None:
        sink_col = sinks.detach().float().cpu().view(h, 1, 1).expand(h, tq, 1)
        probs = torch.softmax(torch.cat([logits, sink_col], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(logits, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # a query with no visible key outputs zeros
    return torch.einsum("hqk,khd->qhd", probs, vf)


def batch_attention(
    q: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    seq_lens: Sequence[int],
    extend_lens: Sequence[int],
    scaling: Optional[float] = None,
    window: Optional[int] = None,
    logit_cap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """A batch: q [sum(extend_lens), H, D]; keys[b]/values[b] hold request b's whole sequence."""
    outs, start = [], 0
    for kb, vb, slen, elen in zip(keys, values, seq_lens, extend_lens):
        q_pos = torch.arange(slen - elen, slen, device="cpu")
        k_pos = torch.arange(slen, device="cpu")
        outs.append(attention(q[start:start + elen], kb[:slen], vb[:slen], q_pos, k_pos,
                              scaling, window, logit_cap, sinks))
        start += elen
    if not outs:
        return torch.zeros(0, q.shape[1], values[0].shape[-1] if values else q.shape[-1], device=q.device)
    return torch.cat(outs, dim=0)
