"""Dense torch oracle for attention: causal + window, sinks, soft-cap, GQA, fp32.

Deliberately simple and independent of pools, allocators and kernels: it takes plain
per-request K/V with explicit positions, so every backend can be checked against it.
"""
from __future__ import annotations

import math
from typing import Any, List, Optional, Sequence, Tuple

import torch

from hwkv.checks import as_int, check_attention_options, check_shape, check_tensors
from hwkv.errors import ShapeError
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
    instead of the window rule over q_pos/k_pos. `window` None or 0 and `logit_cap` None or 0 are off; arguments that
    disagree are a ShapeError, an option out of range a ConfigError, each naming the value and the limit."""
    _check_attention_args(q, k, v, q_pos, k_pos, scaling, window, logit_cap, sinks, mask)
    tq, h, d = q.shape
    kvh = k.shape[1]
    scale = scaling if scaling is not None else 1.0 / math.sqrt(d)
    qf = q.detach().float().cpu()
    kf = k.detach().float().cpu().repeat_interleave(h // kvh, dim=1)
    vf = v.detach().float().cpu().repeat_interleave(h // kvh, dim=1)
    with torch.autocast("cpu", enabled=False):   # fp32 whatever the caller's autocast (it ran the einsums in bf16)
        return _attention_fp32(qf, kf, vf, q_pos, k_pos, scale, window, logit_cap, sinks, mask)


def _attention_fp32(qf: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                    scale: float, window: Optional[int], logit_cap: float, sinks: Optional[torch.Tensor],
                    mask: Optional[torch.Tensor]) -> torch.Tensor:
    tq, h = qf.shape[:2]
    logits = torch.einsum("qhd,khd->hqk", qf, kf) * scale
    if logit_cap:
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
    """A batch: q [sum(extend_lens), H, D]; keys[b]/values[b] hold request b's whole sequence (at least seq_lens[b]
    rows), its last extend_lens[b] tokens the queries. ShapeError naming the counts where they disagree; the answer
    [sum(extend_lens), H, Dv] is fp32 on the CPU (an empty batch's too, Dv from q's D where no values tell it)."""
    lens = _check_batch_args(q, keys, values, seq_lens, extend_lens)
    outs: List[torch.Tensor] = []
    start = 0
    for kb, vb, (slen, elen) in zip(keys, values, lens):
        q_pos = torch.arange(slen - elen, slen, device="cpu")
        k_pos = torch.arange(slen, device="cpu")
        outs.append(attention(q[start:start + elen], kb[:slen], vb[:slen], q_pos, k_pos,
                              scaling, window, logit_cap, sinks))
        start += elen
    if not outs:
        return torch.zeros(0, q.shape[1], q.shape[2], dtype=torch.float32, device="cpu")
    return torch.cat(outs, dim=0)


def _check_attention_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                          k_pos: torch.Tensor, scaling: Any, window: Any, logit_cap: Any,
                          sinks: Optional[torch.Tensor], mask: Optional[torch.Tensor]) -> None:
    """`attention`'s arguments against each other (host attributes only, no value read): ShapeError / ConfigError
    naming the value and the limit, where a bare RuntimeError from view or einsum had come, or a bad option had
    silently read as off."""
    check_tensors(q=q, k=k, v=v, q_pos=q_pos, k_pos=k_pos, sinks=sinks, mask=mask)
    check_shape("q", q, [None, None, None])
    tq, h, d = q.shape
    check_shape("k", k, [None, None, d])
    tk, kvh, _ = k.shape
    if kvh < 1 or h % kvh:
        raise ShapeError(f"q has {h} heads, k {kvh}: num_heads must be a multiple of num_kv_heads >= 1 "
                         f"(q {list(q.shape)}, k {list(k.shape)})")
    check_shape("v", v, [tk, kvh, None])
    check_shape("q_pos", q_pos, [tq])
    check_shape("k_pos", k_pos, [tk])
    if mask is not None:
        check_shape("mask", mask, [tq, tk])
    if sinks is not None and sinks.numel() != h:
        raise ShapeError(f"sinks has shape {list(sinks.shape)}, expected [{h}] (one per query head; k has {kvh} "
                         "KV heads)")
    check_attention_options(scaling, window, logit_cap)


def _check_batch_args(q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                      seq_lens: Sequence[int], extend_lens: Sequence[int]) -> List[Tuple[int, int]]:
    """`batch_attention`'s per-request (seq_len, extend_len) as ints, checked: one entry per request in every list,
    0 <= extend_len <= seq_len <= the rows of keys[b] and values[b], q rows == sum(extend_lens); ShapeError naming
    the counts otherwise (zip had dropped requests, extra q rows were ignored, negative positions output zeros)."""
    counts = {"keys": len(keys), "values": len(values), "seq_lens": len(seq_lens), "extend_lens": len(extend_lens)}
    if len(set(counts.values())) != 1:
        raise ShapeError("batch_attention: one entry per request in each list, got "
                         + ", ".join(f"len({n}) = {c}" for n, c in counts.items()))
    check_shape("q", q, [None, None, None])
    lens = []
    for b, (kb, vb, s, e) in enumerate(zip(keys, values, seq_lens, extend_lens)):
        slen, elen = as_int(s), as_int(e)
        if slen is None or elen is None:
            raise ShapeError(f"request {b}: seq_len {s!r} and extend_len {e!r} must be integers")
        rows = min(kb.shape[0], vb.shape[0])
        if not 0 <= elen <= slen <= rows:
            raise ShapeError(f"request {b}: needs 0 <= extend_len <= seq_len <= rows of keys/values, got extend_len "
                             f"{elen}, seq_len {slen}, keys {kb.shape[0]} rows, values {vb.shape[0]} rows")
        lens.append((slen, elen))
    total = sum(e for _, e in lens)
    if q.shape[0] != total:
        raise ShapeError(f"q has {q.shape[0]} rows, sum(extend_lens) = {total} (one query row per new token)")
    return lens
