"""Kernels of the Ascend NPU backend: the K/V store (ATB reshape-and-cache) and the device-agnostic torch
attention every layer the fused op cannot compute falls back to (hwkv_npu.fia holds the fused op).

torch_npu is imported lazily (first use), never at import time.

- `torch_npu._npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices)`: ATB
  ReshapeAndCache, schema registered in Ascend/op-plugin (`atb::_npu_reshape_and_cache`); caches
  ND [num_blocks, block_size, KVH, D], fp16/bf16/int8 in the key's dtype, slot_indices int32 (as
  vllm-ascend and SGLang's NPU pool call it; hwkv.testing.vendor_schemas.npu checks the same).
- `torch_attention` is plain torch over the paged pool (runs on any device, static shapes from the
  host bounds it is given, so it can be captured in a graph): the fallback for every feature
  combination the fused op lacks (soft-cap, fp32/fp8 pools, K/V scales, sinks without v2, page sizes
  it refuses).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from hwkv import ops as core_ops
from hwkv.metadata import block_table_from_csr  # noqa: F401 - re-exported: the NPU page tables come from it

NEG_BIG = -1.0e30  # finite running-max floor: exp(m_old - m_new) never sees inf - inf
SCORE_BUDGET = 1 << 25  # fp32 score elements per torch_attention step (128 MiB)
KV_CHUNK = 1024
CACHE_DTYPES = (torch.float16, torch.bfloat16)  # the ones hwkv stores through ATB reshape-and-cache


def _torch_npu() -> Any:
    import torch_npu  # noqa: F401  (registers torch.npu and torch.ops.npu)

    return torch_npu


# ---- store -----------------------------------------------------------------------------------

def _cache_block(rows: int) -> int:
    """A block size dividing the pool's rows (ND layout: the slot addresses are the same for any)."""
    for b in (128, 64, 32, 16):
        if rows % b == 0:
            return b
    return 0


def store_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             k_scale: Optional[float] = None, v_scale: Optional[float] = None) -> None:
    """k_buf[loc] = k / k_scale (cast), same for v: ATB reshape-and-cache for fp16/bf16 pools,
    hwkv's torch store otherwise. The caller's k and v are never modified."""
    block = _cache_block(k_buf.shape[0])
    if (k_buf.dtype not in CACHE_DTYPES or v_buf.dtype != k_buf.dtype or not block
            or not (k_buf.is_contiguous() and v_buf.is_contiguous())):
        core_ops.store_kv_torch(k_buf, v_buf, loc, k, v, k_scale, v_scale)
        return
    kq = core_ops.quantize(k, k_buf.dtype, k_scale).contiguous()
    vq = core_ops.quantize(v, v_buf.dtype, v_scale).contiguous()
    _torch_npu()._npu_reshape_and_cache(
        key=kq, value=vq, key_cache=k_buf.view(-1, block, *k_buf.shape[1:]),
        value_cache=v_buf.view(-1, block, *v_buf.shape[1:]), slot_indices=loc.to(torch.int32))


# ---- device-agnostic torch attention ------------------------------------------------------------

@dataclass
class TokenRows:
    """Query token t belongs to request req[t] as its row[t]-th new token (device tensors)."""

    req: torch.Tensor
    row: torch.Tensor
    batch_size: int
    max_q: int

    @classmethod
    def build(cls, qo_indptr: torch.Tensor, num_tokens: int, max_q: int) -> "TokenRows":
        qo = qo_indptr.to(torch.int64)
        bs = qo.shape[0] - 1
        t = torch.arange(num_tokens, device=qo.device)
        req = torch.searchsorted(qo[1:], t, right=True).clamp_(max=max(bs - 1, 0))
        row = (t - qo[req]).clamp_(0, max(max_q - 1, 0))
        return cls(req, row, bs, max(max_q, 1))


def _scalar(x: Any) -> float:
    if x is None:
        return 1.0
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def torch_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indptr: torch.Tensor,
                    kv_indices: torch.Tensor, kv_pos0: torch.Tensor, qo_indptr: torch.Tensor,
                    q_pos0: torch.Tensor, out: torch.Tensor, max_q_len: int, max_kv_len: int,
                    scaling: Optional[float], window: Optional[int], logit_cap: float = 0.0,
                    sinks: Optional[torch.Tensor] = None, k_scale: Any = None, v_scale: Any = None,
                    tree: Any = None) -> None:
    """out[t] = softmax(scaling * q[t] . K^T) V over the keys of t's request visible to it
    (`tree`: a verify tree's hwkv.spec.TreeMask, whose rule hwkv/spec.py states).

    The interface of docs/architecture.md (decode is the case qo_indptr = arange, max_q_len = 1).
    max_q_len / max_kv_len are host upper bounds of any request's query rows / list length; they
    fix every shape, so nothing here reads device values on the host. Window None/0: causal only;
    logit_cap > 0: cap * tanh(s / cap); sinks [H]: one raw logit per head in the denominator.
    """
    t, h, d = q.shape
    bs = kv_pos0.shape[0]
    if t == 0 or bs == 0:
        return
    kvh, dv = k_buf.shape[1], v_buf.shape[2]
    g = h // kvh
    rows = TokenRows.build(qo_indptr, t, int(max_q_len))
    cap = float(logit_cap or 0.0)
    scale = (1.0 / math.sqrt(d) if scaling is None else float(scaling)) * _scalar(k_scale)
    qs = torch.zeros(bs, rows.max_q, h, d, dtype=torch.float32, device=q.device)
    qs[rows.req, rows.row] = q.float() * (scale / cap if cap else scale)
    qs = qs.view(bs, rows.max_q, kvh, g, d).permute(0, 2, 1, 3, 4)  # [bs, KVH, Mq, G, D]
    res = torch.empty(bs, kvh, rows.max_q, g, dv, dtype=torch.float32, device=q.device)
    kv = _KeyLists(kv_indptr, kv_indices, kv_pos0, max(int(max_kv_len), 0), k_buf, v_buf)
    trees = None if tree is None else _TreeRows(tree, qo_indptr, q_pos0)
    step = max(1, SCORE_BUDGET // max(1, bs * h * min(KV_CHUNK, max(kv.max_len, 1))))
    for i0 in range(0, rows.max_q, step):
        i1 = min(rows.max_q, i0 + step)
        if trees is None:
            qpos = q_pos0.to(torch.int64)[:, None] + torch.arange(i0, i1, device=q.device)[None, :]
        else:
            qpos = trees.q_positions(i0, i1)
        res[:, :, i0:i1] = _attend_rows(qs[:, :, i0:i1], qpos, kv, window, cap, sinks, g,
                                        None if trees is None else (trees, i0, i1))
    res.mul_(_scalar(v_scale))
    out.copy_(res.permute(0, 2, 1, 3, 4).reshape(bs, rows.max_q, h, dv)[rows.req, rows.row].to(out.dtype))


class _KeyLists:
    """The CSR key lists of a batch, gathered from the pool a chunk of list entries at a time."""

    def __init__(self, indptr: torch.Tensor, indices: torch.Tensor, pos0: torch.Tensor, max_len: int,
                 k_buf: torch.Tensor, v_buf: torch.Tensor) -> None:
        self.start = indptr[:-1].to(torch.int64)
        self.lens = indptr[1:].to(torch.int64) - self.start
        self.indices, self.pos0, self.max_len = indices, pos0.to(torch.int64), max_len
        self.k_buf, self.v_buf = k_buf, v_buf

    def chunk(self, c0: int, c1: int):
        """(K [bs, KVH, D, n] fp32, V [bs, KVH, n, Dv] fp32, valid [bs, n], key positions [bs, n])."""
        j = torch.arange(c0, c1, device=self.indices.device)
        valid = j[None, :] < self.lens[:, None]
        flat = (self.start[:, None] + j[None, :]).clamp_(0, max(self.indices.numel() - 1, 0))
        slots = torch.where(valid, self.indices[flat], torch.zeros_like(flat))
        k = self.k_buf[slots].float().permute(0, 2, 3, 1)
        v = self.v_buf[slots].float().permute(0, 2, 1, 3)
        return k, v, valid, self.pos0[:, None] + j[None, :]


class _TreeRows:
    """A verify tree over the padded [bs, rows] layout: query positions and which draft keys a row sees."""

    def __init__(self, tree: Any, qo_indptr: torch.Tensor, q_pos0: torch.Tensor) -> None:
        self.tree = tree
        self.start = qo_indptr[:-1].to(torch.int64)
        self.n = qo_indptr[1:].to(torch.int64) - self.start
        self.q_pos0 = q_pos0.to(torch.int64)

    def _row(self, i0: int, i1: int) -> torch.Tensor:
        i = torch.arange(i0, i1, device=self.start.device)[None, :]
        return torch.minimum(i, (self.n - 1).clamp(min=0)[:, None])  # rows past a request's end: clamped

    def q_positions(self, i0: int, i1: int) -> torch.Tensor:
        pos = self.tree.q_positions
        return pos[(self.start[:, None] + self._row(i0, i1)).clamp(0, max(pos.numel() - 1, 0))]

    def keys(self, kpos: torch.Tensor, i0: int, i1: int) -> "tuple[torch.Tensor, torch.Tensor]":
        """(key positions [bs, 1, n], tree visibility [bs, m, n]) for list positions kpos [bs, n]."""
        draft = kpos >= self.q_pos0[:, None]
        t = torch.minimum((kpos - self.q_pos0[:, None]).clamp(min=0), (self.n - 1).clamp(min=0)[:, None])
        pos, mask = self.tree.q_positions, self.tree.mask
        kp = torch.where(draft, pos[(self.start[:, None] + t).clamp(0, max(pos.numel() - 1, 0))], kpos)
        bit = (self.tree.mask_indptr[:-1, None, None] + self._row(i0, i1)[:, :, None] * self.n[:, None, None]
               + t[:, None, :])
        see = mask[bit.clamp(0, max(mask.numel() - 1, 0))] | ~draft[:, None, :]
        return kp[:, None, :], see


def _attend_rows(qs: torch.Tensor, qpos: torch.Tensor, kv: _KeyLists, window: Optional[int], cap: float,
                 sinks: Optional[torch.Tensor], g: int, tree: Any = None) -> torch.Tensor:
    """Online softmax of query rows qs [bs, KVH, m, G, D] (pre-scaled) at positions qpos [bs, m];
    `tree`: (_TreeRows, i0, i1) of a verify tree, whose draft keys take their tree positions and mask."""
    bs, kvh, m, _, d = qs.shape
    rows = qs.reshape(bs, kvh, m * g, d)
    rpos = qpos.repeat_interleave(g, dim=1)[:, None, :, None]  # [bs, 1, m*G, 1]
    dv = kv.v_buf.shape[2]
    if sinks is None:
        mx = torch.full((bs, kvh, m * g, 1), NEG_BIG, device=qs.device)
        den = torch.zeros_like(mx)
    else:
        mx = sinks.float().view(1, kvh, 1, g, 1).expand(bs, kvh, m, g, 1).reshape(bs, kvh, m * g, 1).clone()
        den = torch.ones_like(mx)
    acc = torch.zeros(bs, kvh, m * g, dv, device=qs.device)
    for c0 in range(0, kv.max_len, KV_CHUNK):
        k, v, valid, kpos = kv.chunk(c0, min(kv.max_len, c0 + KV_CHUNK))
        s = torch.matmul(rows, k)  # [bs, KVH, m*G, n]
        if cap:
            s = s.tanh_().mul_(cap)
        kp = kpos[:, None, None, :]
        vis = valid[:, None, None, :]
        if tree is not None:
            tkp, see = tree[0].keys(kpos, tree[1], tree[2])
            kp = tkp[:, None]                                                  # [bs, 1, 1, n]
            vis = vis & see.repeat_interleave(g, dim=1)[:, None]               # [bs, 1, m*G, n]
        vis = vis & (kp <= rpos)
        if window:
            vis &= kp > rpos - window
        s = s.masked_fill_(~vis, float("-inf"))
        m_new = torch.maximum(mx, s.amax(-1, keepdim=True))
        alpha = torch.exp(mx - m_new)
        p = torch.exp(s - m_new)
        den = den * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p, v)
        mx = m_new
    return (acc / den.clamp_min(1e-30)).view(bs, kvh, m, g, dv)

