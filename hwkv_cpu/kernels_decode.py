"""Decode attention in vectorized torch, and the chunk step extend reuses.

Keys are read a chunk at a time: `index_select` copies the chunk's rows from the pool into a
scratch buffer that stays in cache (upcast there to the compute dtype), one `bmm` per chunk
scores all query rows of a KV head group against it (q viewed as [KVH, rows, D], K never
repeated), and an online softmax (running max m, running sum l, accumulator acc) folds the
chunk in. Scratch buffers live in a per-thread workspace, so chunks allocate nothing.

Folded constants: the softmax scale and k_scale multiply q once (divided by the cap when
soft-capping: s = cap * tanh(q.k * scale / cap)); v_scale multiplies the output once. Sinks
start the softmax state (m = sink, l = 1, acc = 0), so they count in the denominator only.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from hwkv.window import first_visible

NEG_BIG = -1.0e30  # finite floor of the running max: exp(m_old - m_new) never sees inf - inf
SORT_SLOTS = True
DECODE_CHUNK = 1024  # keys per chunk: K+V scratch of 2 x 1024 x KVH x D fp32 stays in L2/L3


class Workspace:
    """Named scratch buffers of one thread, grown on demand and reused across calls."""

    def __init__(self) -> None:
        self._bufs: Dict[Tuple[str, torch.dtype], torch.Tensor] = {}

    def take(self, name: str, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for s in shape:
            numel *= s
        buf = self._bufs.get((name, dtype))
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), dtype=dtype)
            self._bufs[(name, dtype)] = buf
        return buf[:numel].view(shape)


_TLS = threading.local()


def workspace() -> Workspace:
    ws = getattr(_TLS, "ws", None)
    if ws is None:
        ws = _TLS.ws = Workspace()
    return ws


@dataclass(frozen=True)
class Params:
    """What every chunk step needs, resolved once per call."""

    qk_scale: float  # scaling * k_scale, divided by logit_cap when soft-capping
    cap: float  # 0: no soft-cap
    v_scale: float
    window: int  # 0: no window
    cdt: torch.dtype  # compute dtype of the matmuls


def key_range(n: int, pos0: int, q_lo: int, q_hi: int, window: int) -> Tuple[int, int]:
    """List indices [lo, hi) of keys visible to some query at positions q_lo..q_hi (inclusive)."""
    lo = max(0, first_visible(q_lo, window or None) - pos0)
    return lo, max(lo, min(n, q_hi + 1 - pos0))


def chunks(lo: int, hi: int, size: int):
    """[lo, hi) cut into near-equal pieces of at most `size` (no tiny tail chunk)."""
    if hi <= lo:
        return
    count = max(1, -(-(hi - lo) // size))
    step = -(-(hi - lo) // count)
    for c0 in range(lo, hi, step):
        yield c0, min(c0 + step, hi)


class Gather:
    """Copies K/V rows of the pool into scratch, upcast to the compute dtype.

    The pool is read as 2-D [S, KVH * D] rows: index_select copies whole rows (measured ~20%
    faster than on the 3-D view).
    """

    def __init__(self, k_buf: torch.Tensor, v_buf: torch.Tensor, cdt: torch.dtype, chunk: int, ws: Workspace):
        kvh, d, dv = k_buf.shape[1], k_buf.shape[2], v_buf.shape[2]
        self.shapes = ((kvh, d), (kvh, dv))
        self.k_rows, self.v_rows = k_buf.view(k_buf.shape[0], -1), v_buf.view(v_buf.shape[0], -1)
        self.k = ws.take("k", (chunk, kvh * d), cdt)
        self.v = ws.take("v", (chunk, kvh * dv), cdt)
        self.upcast = k_buf.dtype != cdt
        if self.upcast:
            self.k_raw = ws.take("k_raw", (chunk, kvh * d), k_buf.dtype)
            self.v_raw = ws.take("v_raw", (chunk, kvh * dv), v_buf.dtype)

    def __call__(self, slots: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """K [n, KVH, D] and V [n, KVH, Dv] of the n slots, in scratch (valid until the next call)."""
        n = slots.numel()
        k, v = self.k[:n], self.v[:n]
        if self.upcast:
            k.copy_(torch.index_select(self.k_rows, 0, slots, out=self.k_raw[:n]))
            v.copy_(torch.index_select(self.v_rows, 0, slots, out=self.v_raw[:n]))
        else:
            torch.index_select(self.k_rows, 0, slots, out=k)
            torch.index_select(self.v_rows, 0, slots, out=v)
        return k.view(n, *self.shapes[0]), v.view(n, *self.shapes[1])


class OnlineSoftmax:
    """Running (m, l, acc) of `rows` query rows per KV head; `step` folds in one key chunk."""

    def __init__(self, kvh: int, rows: int, dv: int, p: Params, ws: Workspace, tag: str = ""):
        self.p, self.ws, self.tag = p, ws, tag
        self.m = ws.take(tag + "m", (kvh, rows, 1), torch.float32)
        self.m_new = ws.take(tag + "m_new", (kvh, rows, 1), torch.float32)
        self.alpha = ws.take(tag + "alpha", (kvh, rows, 1), torch.float32)
        self.l = ws.take(tag + "l", (kvh, rows, 1), torch.float32)
        self.acc = ws.take(tag + "acc", (kvh, rows, dv), torch.float32)
        self.fresh = True

    def reset(self, sinks: Optional[torch.Tensor]) -> None:
        """sinks: None, or the sink logit of every row, broadcastable to [KVH, rows, 1]."""
        self.fresh = sinks is None
        if sinks is not None:
            self.m.copy_(sinks)
            self.l.fill_(1.0)
            self.acc.zero_()

    def step(self, qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             hide: Optional[torch.Tensor] = None) -> None:
        """qg [KVH, rows, D] (pre-scaled), k [n, KVH, D], v [n, KVH, Dv] in the compute dtype.

        hide: None or bool [q, 1, n] with rows = q * group: True masks that key for that query.
        """
        kvh, rows, _ = qg.shape
        n, p, ws = k.shape[0], self.p, self.ws
        s = ws.take("s", (kvh, rows, n), torch.float32)
        if p.cdt == torch.float32:
            torch.bmm(qg, k.permute(1, 2, 0), out=s)
        else:
            s.copy_(torch.bmm(qg, k.permute(1, 2, 0), out=ws.take("s_c", (kvh, rows, n), p.cdt)))
        if p.cap:
            s.tanh_().mul_(p.cap)
        if hide is not None:
            s.view(kvh, hide.shape[0], -1, n).masked_fill_(hide, float("-inf"))
        if self.fresh:  # first chunk, no sinks: nothing to rescale
            torch.amax(s, -1, keepdim=True, out=self.m).clamp_min_(NEG_BIG)
            s.sub_(self.m).exp_()
            torch.sum(s, -1, keepdim=True, out=self.l)
            self._pv(s, v, add=False)
            self.fresh = False
            return
        m_new = torch.amax(s, -1, keepdim=True, out=self.m_new)
        torch.maximum(m_new, self.m, out=m_new)
        torch.sub(self.m, m_new, out=self.alpha).exp_()
        s.sub_(m_new).exp_()
        self.l.mul_(self.alpha).add_(s.sum(-1, keepdim=True))
        self.acc.mul_(self.alpha)
        self._pv(s, v, add=True)
        self.m.copy_(m_new)

    def _pv(self, s: torch.Tensor, v: torch.Tensor, add: bool) -> None:
        """acc (+)= s @ V."""
        vt = v.permute(1, 0, 2)
        if self.p.cdt == torch.float32:
            if add:
                self.acc.baddbmm_(s, vt)
            else:
                torch.bmm(s, vt, out=self.acc)
            return
        kvh, rows, n = s.shape
        pc = self.ws.take("p_c", (kvh, rows, n), self.p.cdt).copy_(s)
        part = torch.bmm(pc, vt, out=self.ws.take("pv_c", self.acc.shape, self.p.cdt))
        if add:
            self.acc.add_(part)
        else:
            self.acc.copy_(part)

    def result(self) -> torch.Tensor:
        """acc / l * v_scale (fp32 [KVH, rows, Dv]); rows that saw no key give 0."""
        if self.fresh:  # no chunk and no sinks
            return self.acc.zero_()
        self.acc.div_(self.l.clamp_min_(1e-30))
        if self.p.v_scale != 1.0:
            self.acc.mul_(self.p.v_scale)
        return self.acc


def decode_torch(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, indptr: list, indices: torch.Tensor,
                 pos0: list, q_pos: list, out: torch.Tensor, p: Params, sinks: Optional[torch.Tensor],
                 chunk: int = DECODE_CHUNK) -> None:
    """out[b] = attention of q[b] over the visible part of request b's list (see `decode_attention`)."""
    bs, h, d = q.shape
    kvh, dv = k_buf.shape[1], v_buf.shape[2]
    g = h // kvh
    ws = workspace()
    qs = ws.take("q", (bs, kvh, g, d), p.cdt)
    qs.copy_(q.view(bs, kvh, g, d)).mul_(p.qk_scale)
    gather = Gather(k_buf, v_buf, p.cdt, chunk, ws)
    state = OnlineSoftmax(kvh, g, dv, p, ws)
    sink_rows = None if sinks is None else sinks.view(kvh, g, 1)
    for b in range(bs):
        lo, hi = key_range(indptr[b + 1] - indptr[b], pos0[b], q_pos[b], q_pos[b], p.window)
        # One query sees every key in [lo, hi), so key order is free: ascending slots turn the
        # gather's scattered row reads into a forward sweep (measured ~1.8x faster gathers).
        slots = torch.sort(indices[indptr[b] + lo: indptr[b] + hi]).values if SORT_SLOTS else \
            indices[indptr[b] + lo: indptr[b] + hi]
        state.reset(sink_rows)
        for c0, c1 in chunks(0, hi - lo, chunk):
            state.step(qs[b], *gather(slots[c0:c1]))
        out[b].view(kvh, g, dv).copy_(state.result())
