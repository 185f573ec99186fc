"""Small forwards' attention over a dense key table planned once per forward.

The vectorized kernels of `kernels_decode` / `kernels_extend` read a CSR list on the host and plan
their chunks, slot tables and masks inside every call: at a few dozen keys per request that planning
is most of a layer's time, repeated in every layer of the forward. Here the backend plans once per
forward and list (`plan_dense`): a padded key table [bs, L] (L = the list's longest request), the
pool rows each KV head reads, and, where anything is hidden, one additive mask (padding, causal,
window) in the score layout. A layer then costs a fixed handful of torch ops whatever the batch:
two row gathers (one request: the list's slots themselves, whole pool rows read through transposed views, so
its plan computes nothing), one batched matmul with the scale and mask folded in (`baddbmm`), the sinks' column (in
decode kept per layer and batch size by the caller and refilled from the sinks, `kept_sink_column`), one softmax and
one matmul into `out`
(`dense_attention`).

The padding makes this pay only while the tables are small: `plan_dense` returns None above
`max_elements` (gathered K/V plus scores), when a real query would see no key (the contract gives
it zeros, which a softmax over an all-hidden row would not), or without host lengths (graph mode),
and the layer runs the chunked kernels instead. Computation is in fp32 (fp64 for fp64 pools):
reduced-precision pools are upcast when gathered, as the chunked kernels do without AMX.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

I64 = torch.int64
DENSE_MAX_ELEMENTS = 1 << 21  # gathered K/V plus scores (fp32 elements, 8 MiB) per layer call


@dataclass
class DensePlan:
    """One list's dense layout for one forward (shared by every layer reading it with this geometry)."""

    bs: int
    kvh: int
    g: int                            # query heads per KV head
    tq: int                           # query rows per request (1: decode)
    keys: int                         # L: key columns per request
    rows: torch.Tensor                # int64 [bs * kvh * L]: rows of the pool viewed as [slots * kvh, D];
    #                                   one request (bs 1): its slots [L], rows of the pool as it is
    bias: Optional[torch.Tensor]      # fp32 [bs * kvh, tq * g or 1, L]: 0 / -inf, None when nothing is hidden
    q_src: Optional[torch.Tensor]     # extend: int64 [bs * tq], the token of each padded query row
    out_b: Optional[torch.Tensor]     # extend: int64 [T], each token's request
    out_t: Optional[torch.Tensor]     # extend: int64 [T], its row within the request
    decode: bool = True               # False: extend; q_src None there means every request has tq queries


_ZEROS: Dict[torch.dtype, torch.Tensor] = {}


def _zero(dtype: torch.dtype) -> torch.Tensor:
    """A [1, 1, 1] zero of `dtype`: baddbmm's ignored input when nothing is masked (made once per dtype)."""
    z = _ZEROS.get(dtype)
    if z is None:
        z = _ZEROS[dtype] = torch.zeros(1, 1, 1, dtype=dtype, device="cpu")
    return z


def plan_dense(indptr: torch.Tensor, indices: torch.Tensor, pos0: torch.Tensor, q_pos0: torch.Tensor,
               qo_indptr: Optional[torch.Tensor], max_len: int, max_q_len: int, window: int, kvh: int, g: int,
               d: int, dv: int, max_elements: int = DENSE_MAX_ELEMENTS, table: Optional[torch.Tensor] = None,
               all_visible: bool = False) -> Optional[DensePlan]:
    """The dense plan of a CSR list (see `hwkv.metadata.KVIndexList`) for queries at q_pos0[b] + t, or None
    where the chunked kernels should run (too large, or a real query with no visible key).

    qo_indptr None: decode, one query per request at q_pos0[b]. window: the layer's W (0: none); the
    mask applies it whatever the list was trimmed to. max_len / max_q_len: host bounds of the list's and
    the queries' lengths per request (eager metadata has them exact). table: the list as [bs, max_len]
    (`KVIndexList.table`) where the metadata step built it, else gathered here. all_visible: decode where
    every request lists max_len keys ending at its query, so only a window shorter than that hides any."""
    bs = int(pos0.shape[0])
    decode = qo_indptr is None
    tq = 1 if decode else int(max_q_len)
    keys = int(max_len)
    if bs == 0 or keys <= 0 or tq <= 0 or indices.shape[0] == 0:
        return None
    if bs * keys * (kvh * (d + dv) + kvh * g * tq) > max_elements:
        return None
    if table is None:
        n = min(int(indptr[-1]), int(indices.shape[0]))  # listed entries (a graph buffer's tail is not)
        if n == 0:
            return None
        col = torch.arange(keys, dtype=I64, device=indices.device)
        start = indptr[:-1].to(I64)
        table = indices[(start[:, None] + col).clamp_(max=n - 1)]  # padding reads listed slots, masked below
    elif not (decode and all_visible):  # the metadata's table: a shorter request's row past its length holds stale
        # locs (a finished request's, whose K/V may be anything, inf included: 0 x inf is NaN), so it repeats the
        # request's first listed slot there instead (a real key, masked below)
        col = torch.arange(keys, dtype=I64, device=table.device)
        lens = indptr[1:].to(I64) - indptr[:-1].to(I64)
        table = torch.where(col < lens[:, None], table[:, :keys], table[:, :1])
    if bs == 1:  # the slots themselves: [L, KVH, D] gathered whole, the heads split by views
        rows = table.reshape(-1)
    else:
        rows = (table[:, None, :] * kvh + torch.arange(kvh, dtype=I64, device=table.device)[:, None]).view(-1)
    if decode and all_visible and (not window or keys <= window):
        return DensePlan(bs, kvh, g, 1, keys, rows, None, None, None, None)
    col = torch.arange(keys, dtype=I64, device=table.device)
    lens = indptr[1:].to(I64) - indptr[:-1].to(I64)
    kpos = pos0.to(I64)[:, None] + col  # [bs, L]
    if decode:
        qpos = q_pos0.to(I64)[:, None]  # [bs, 1]
        q_src = out_b = out_t = None
    else:
        qo = qo_indptr.to(I64)
        ext = qo[1:] - qo[:-1]
        t = torch.arange(tq, dtype=I64, device=table.device)
        total = int(qo[-1])
        if total == bs * tq:  # every request has tq queries (max_q_len bounds them): no padding
            t_eff = t[None, :]
            q_src = out_b = out_t = None
        else:
            # padded rows repeat their request's last query (their output is dropped): never an all-hidden row
            t_eff = torch.minimum(t[None, :], (ext - 1).clamp(min=0)[:, None])  # [bs, tq]
            q_src = (qo[:-1, None] + t_eff).clamp_(0, max(total - 1, 0)).view(-1)
            out_b = torch.repeat_interleave(torch.arange(bs, dtype=I64, device=table.device), ext, output_size=total)
            out_t = torch.arange(total, dtype=I64, device=table.device) - qo[:-1][out_b]
        qpos = q_pos0.to(I64)[:, None] + t_eff
    dist = qpos[:, :, None] - kpos[:, None, :]  # [bs, tq, L]: query position - key position
    hide = (dist < 0) | (col >= lens[:, None])[:, None, :]
    if window:
        hide |= dist >= window
    bias = None
    if bool(hide.any()):
        seen = ~hide.all(-1)  # [bs, tq]
        real = seen if decode else seen | (t[None, :] >= ext[:, None])
        if not bool(real.all()):
            return None  # a query with no visible key gets zeros: the chunked kernels' contract
        per_row = 1 if decode else g
        bias = torch.zeros(bs, 1, tq, 1, keys, dtype=torch.float32, device=table.device).masked_fill_(hide.view(bs, 1, tq, 1, keys), float("-inf"))
        bias = bias.expand(bs, kvh, tq, per_row, keys).reshape(bs * kvh, tq * per_row, keys)
    return DensePlan(bs, kvh, g, tq, keys, rows, bias, q_src, out_b, out_t, decode)


def compute_dtype(pool_dtype: torch.dtype) -> torch.dtype:
    """The dtype `dense_attention` computes in for a pool of `pool_dtype`."""
    return torch.float64 if pool_dtype == torch.float64 else torch.float32


def sink_column(sinks: torch.Tensor, plan: DensePlan, cdt: torch.dtype) -> torch.Tensor:
    """The sinks [H] as the scores' extra column [bs * kvh, tq * g, 1] in `cdt` (rows KV-head-major as the
    scores'), made from their current values (a column kept across calls: `kept_sink_column`)."""
    bs, kvh, g, tq = plan.bs, plan.kvh, plan.g, plan.tq
    return sinks.detach().to(cdt).view(1, kvh, 1, g).expand(bs, kvh, tq, g).reshape(bs * kvh, tq * g, 1).contiguous()


def kept_sink_column(sinks: torch.Tensor, plan: DensePlan,
                     cdt: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode's sinks column [bs * kvh, g, 1] for a caller to keep per layer and batch size, with the two views a
    call refills it through, `dst.copy_(src)` (one broadcast copy, ~1 us against ~8 us to make the column): the
    column then holds the sinks' current values, an in-place update of them (a weight load into the parameter they
    view) included. Returns (column, dst, src); a tuple of tensors, which torch.compile can keep too."""
    with torch.inference_mode(False):  # normal tensors: refilled in and out of inference mode alike
        col = torch.empty(plan.bs * plan.kvh, plan.g, 1, dtype=cdt, device=sinks.device)
        dst = col.view(plan.bs, plan.kvh, plan.g)
    return col, dst, sinks.detach().view(1, plan.kvh, plan.g)   # (detached: sinks may be a parameter)


def dense_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, plan: DensePlan, out: torch.Tensor,
                    qk_scale: float, cap: float, v_scale: float, sinks: Optional[torch.Tensor],
                    sink_col: Optional[torch.Tensor] = None) -> None:
    """out [T, H, Dv] = attention of q [T, H, D] over the plan's keys of k_buf / v_buf [S, KVH, D(v)].

    qk_scale: scaling * k_scale (divided by cap when soft-capping: s = cap * tanh(q.k * qk_scale));
    v_scale multiplies the output; sinks [H] (one raw logit per head in the denominator) or None;
    sink_col: the column ahead (`kept_sink_column`, refilled with the sinks' current values; else made here).
    Inference only, in the pool's compute dtype whatever the caller's autocast: a q that requires grad is read
    detached (the decode's `bmm(out=)` refuses autograd), and an autocast region is left for the products (it ran
    them in bf16 over fp32 pools: an error into an fp32 `out`, 1e-2 off on extend)."""
    if q.requires_grad:
        q = q.detach()
    if torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            _dense_attention(q, k_buf, v_buf, plan, out, qk_scale, cap, v_scale, sinks, sink_col)
        return
    _dense_attention(q, k_buf, v_buf, plan, out, qk_scale, cap, v_scale, sinks, sink_col)


def _dense_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, plan: DensePlan, out: torch.Tensor,
                     qk_scale: float, cap: float, v_scale: float, sinks: Optional[torch.Tensor],
                     sink_col: Optional[torch.Tensor]) -> None:
    bs, kvh, g, tq, keys = plan.bs, plan.kvh, plan.g, plan.tq, plan.keys
    d, dv = k_buf.shape[2], v_buf.shape[2]
    cdt = compute_dtype(k_buf.dtype)
    if bs == 1:  # [L, KVH, D(v)] -> [KVH, L, D(v)] views; bmm reads them strided
        k = k_buf.index_select(0, plan.rows)
        v = v_buf.index_select(0, plan.rows)
        if k.dtype != cdt:
            k, v = k.to(cdt), v.to(cdt)
        kt, v = k.permute(1, 2, 0), v.transpose(0, 1)
    else:
        k = k_buf.view(-1, d).index_select(0, plan.rows).view(bs * kvh, keys, d)
        v = v_buf.view(-1, dv).index_select(0, plan.rows).view(bs * kvh, keys, dv)
        if k.dtype != cdt:
            k, v = k.to(cdt), v.to(cdt)
        kt = k.transpose(1, 2)
    if plan.decode:  # [bs, H, D] is already [bs * KVH, G, D]
        qg = q.reshape(bs * kvh, g, d)
    else:  # the tokens as rows [bs, tq, KVH, G, D] (padded where requests have fewer), KV-head-major (t, g)
        qt = q if plan.q_src is None else q.index_select(0, plan.q_src)
        qg = qt.view(bs, tq, kvh, g, d).transpose(1, 2).reshape(bs * kvh, tq * g, d)
    if qg.dtype != cdt:
        qg = qg.to(cdt)
    bias = plan.bias
    if bias is not None and bias.dtype != cdt:
        bias = bias.to(cdt)
    if cap:
        s = torch.bmm(qg, kt).mul_(qk_scale).tanh_().mul_(cap)
        if bias is not None:
            s.add_(bias)
    else:  # scale (and mask) folded into the matmul; beta=0 ignores the placeholder input
        s = torch.baddbmm(_zero(cdt) if bias is None else bias, qg, kt, beta=0.0 if bias is None else 1.0,
                          alpha=qk_scale)
    if sinks is not None:  # one more column holding each head's sink: in the denominator only
        col = sink_col if sink_col is not None else sink_column(sinks, plan, cdt)
        p = torch.softmax(torch.cat([s, col], -1), -1)[..., :keys]
    else:
        p = torch.softmax(s, -1)
    if plan.decode:
        if v_scale == 1.0 and out.dtype == cdt and out.is_contiguous():
            torch.bmm(p, v, out=out.view(bs * kvh, g, dv))
            return
        o = torch.bmm(p, v)
        if v_scale != 1.0:
            o.mul_(v_scale)
        out.copy_(o.view(bs, kvh * g, dv))
        return
    o = torch.bmm(p, v).view(bs, kvh, tq, g, dv)
    if v_scale != 1.0:
        o.mul_(v_scale)
    o = o.transpose(1, 2) if plan.q_src is None else o[plan.out_b, :, plan.out_t]  # [bs, tq | T, KVH, G, Dv]
    if out.is_contiguous():
        out.view(o.shape).copy_(o)
    else:
        out.copy_(o.reshape(out.shape))
