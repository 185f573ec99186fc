"""Decode attention in vectorized torch, and the chunk step extend reuses.

The pool [S, KVH, D] is read as rows of one head, [S * KVH, D]. Keys are read a chunk at a
time: `index_select` copies the chunk's (slot, head) rows into a scratch buffer
[request * KVH, key, D] that stays in cache (upcast there to the compute dtype), one `bmm`
scores the query rows of each KV head against it (q viewed as [request * KVH, group, D], K
never repeated), an online softmax (running max m, running sum l, accumulator acc) folds the
chunk in, and a second `bmm` adds P @ V; one step serves every request with keys left. Each request's slots are sorted
first: one query sees all of its keys, so their order is free, and ascending slots make the
gather's scattered reads forward sweeps. Scratch lives in a per-thread workspace, so steps
allocate nothing.

Threads: `parallel_map` spreads independent pieces (decode: ranges of key columns, merged
afterwards; extend: query blocks) over the caller's torch thread count, each thread running
torch single-threaded. A kernel of this kind is ~10 torch ops per step; run with intra-op
threads, each op is a parallel region whose barrier, on a busy CPU, can wait a scheduler
slice (measured here: decode 8x slower than SDPA under a load average of 4, 1.5x with
`parallel_map`).

Folded constants: the softmax scale and k_scale multiply q once (divided by the cap when
soft-capping: s = cap * tanh(q.k * scale / cap)); v_scale multiplies the output once. Sinks
start (extend) or join (decode merge) the softmax state as m = sink, l = 1, acc = 0, so they
count in the denominator only.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import torch

from hwkv.window import first_visible
from hwkv_cpu.host_plan import HostLists

T = TypeVar("T")
R = TypeVar("R")
NEG_BIG = -1.0e30  # finite floor of the running max: exp(m_old - m_new) never sees inf - inf
DECODE_KEYS = 1024  # keys gathered per step over all requests (K+V scratch: 2 x 1024 x KVH x D)
MIN_CHUNK = 64  # keys per request per step, at least


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
            with torch.inference_mode(False):  # a normal tensor: calls in and out of inference mode both write it
                buf = torch.empty(max(numel, 1), dtype=dtype, device="cpu")
            self._bufs[(name, dtype)] = buf
        return buf[:numel].view(shape)


_TLS = threading.local()


def workspace() -> Workspace:
    ws = getattr(_TLS, "ws", None)
    if ws is None:
        ws = _TLS.ws = Workspace()
    return ws


_POOL: Optional[ThreadPoolExecutor] = None


def parallel_map(fn: Callable[[T], R], items: Sequence[T]) -> List[R]:
    """[fn(x) for x in items], spread over torch.get_num_threads() threads (the caller's thread
    and a pool) that pull items in order; each runs its torch ops single-threaded, so the
    caller's thread count is spent without one parallel region (and its barrier) per op.

    For the duration of the call torch.set_num_threads(1) holds process-wide; the caller's
    setting is restored before returning, also on error (the first error is re-raised once
    every thread has stopped). Calls from several threads at once stay correct but may run
    with fewer threads; the setting found by the first of them comes back when the last
    returns (each restoring what it had read left the process at one thread).
    """
    threads = min(torch.get_num_threads(), len(items))
    if threads <= 1:
        return [fn(x) for x in items]
    _single_threaded(True)
    try:
        return _parallel_map(fn, items, threads)
    finally:
        _single_threaded(False)


_ACTIVE = [0, 1]  # parallel_map calls in flight, and the thread count the first of them found
_ACTIVE_LOCK = threading.Lock()


def _single_threaded(enter: bool) -> None:
    """torch's thread count held at 1 from the first parallel_map call in flight to the last."""
    with _ACTIVE_LOCK:
        if enter:
            if _ACTIVE[0] == 0:
                _ACTIVE[1] = torch.get_num_threads()
                torch.set_num_threads(1)
            _ACTIVE[0] += 1
        else:
            _ACTIVE[0] -= 1
            if _ACTIVE[0] == 0:
                torch.set_num_threads(_ACTIVE[1])


def _parallel_map(fn: Callable[[T], R], items: Sequence[T], threads: int) -> List[R]:
    """`parallel_map`'s body, torch's thread count at 1."""
    global _POOL
    if _POOL is None or _POOL._max_workers < threads - 1:  # noqa: SLF001 (the pool's own size)
        _POOL = ThreadPoolExecutor(threads - 1, thread_name_prefix="hwkv_cpu")
    results: List[Optional[R]] = [None] * len(items)
    order = iter(range(len(items)))
    lock = threading.Lock()
    errors: List[BaseException] = []
    # grad and inference mode are thread-local: the helpers run fn as the caller would (an engine step's outputs
    # are inference tensors, which only inference mode may write in place)
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def drain() -> None:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            while not errors:
                with lock:
                    i = next(order, None)
                if i is None:
                    return
                try:
                    results[i] = fn(items[i])
                except BaseException as e:  # noqa: BLE001 - re-raised below in the caller's thread
                    errors.append(e)

    helpers = [_POOL.submit(drain) for _ in range(threads - 1)]
    drain()
    wait(helpers)
    if errors:
        raise errors[0]
    return results  # type: ignore[return-value]


@dataclass(frozen=True)
class Params:
    """What every chunk step needs, resolved once per call."""

    qk_scale: float  # scaling * k_scale, divided by logit_cap when soft-capping
    cap: float  # 0: no soft-cap
    v_scale: float
    window: int  # 0: no window
    cdt: torch.dtype  # compute dtype of the matmuls


def key_range(n: int, pos0: int, q_lo: int, q_hi: int, window: int) -> Tuple[int, int]:
    """List indices [lo, hi) of the keys that some query at positions q_lo..q_hi sees (their
    union); with q_lo > q_hi (arguments swapped), the keys that every such query sees."""
    lo = max(0, first_visible(q_lo, window or None) - pos0)
    return lo, max(lo, min(n, q_hi + 1 - pos0))


def neg_inf_where(hide: torch.Tensor) -> torch.Tensor:
    """fp32 0 / -inf from a bool mask: an additive bias (add_ with broadcasting measured ~15x
    faster than masked_fill_ with a broadcast mask)."""
    return torch.zeros(hide.shape, dtype=torch.float32, device="cpu").masked_fill_(hide, float("-inf"))


def chunks(lo: int, hi: int, size: int):
    """[lo, hi) cut into near-equal pieces of at most `size` (no tiny tail chunk)."""
    if hi <= lo:
        return
    count = max(1, -(-(hi - lo) // size))
    step = -(-(hi - lo) // count)
    for c0 in range(lo, hi, step):
        yield c0, min(c0 + step, hi)


def head_rows(slots: torch.Tensor, kvh: int) -> torch.Tensor:
    """[..., n] slots -> [..., KVH, n] rows of the pool viewed as [S * KVH, D]."""
    return slots.unsqueeze(-2) * kvh + torch.arange(kvh, device="cpu")[:, None]


class Gather:
    """Copies pool rows of one (slot, head) each into scratch, upcast to the compute dtype (K and V each from its
    own dtype: the buffers may differ, as the Triton kernels allow)."""

    def __init__(self, k_buf: torch.Tensor, v_buf: torch.Tensor, cdt: torch.dtype, rows: int, ws: Workspace):
        self.k_rows = k_buf.view(-1, k_buf.shape[2])
        self.v_rows = v_buf.view(-1, v_buf.shape[2])
        self.k = ws.take("k", (rows, k_buf.shape[2]), cdt)
        self.v = ws.take("v", (rows, v_buf.shape[2]), cdt)
        # scratch in the buffer's own dtype, for a buffer not already in the compute dtype
        self.k_raw = ws.take("k_raw", tuple(self.k.shape), k_buf.dtype) if k_buf.dtype != cdt else None
        self.v_raw = ws.take("v_raw", tuple(self.v.shape), v_buf.dtype) if v_buf.dtype != cdt else None

    def __call__(self, rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """K [*rows.shape, D] and V [*rows.shape, Dv] of the rows (scratch: valid until the next call)."""
        n = rows.numel()
        k, v = self.k[:n], self.v[:n]
        flat = rows.reshape(-1)
        for dst, src, raw in ((k, self.k_rows, self.k_raw), (v, self.v_rows, self.v_raw)):
            if raw is None:
                torch.index_select(src, 0, flat, out=dst)
            else:
                dst.copy_(torch.index_select(src, 0, flat, out=raw[:n]))
        return k.view(*rows.shape, k.shape[-1]), v.view(*rows.shape, v.shape[-1])


class OnlineSoftmax:
    """Running (m, l, acc) of [batch, rows] query rows; `step` folds in one key chunk.

    A step may cover only a leading part of the batch (requests whose keys ran out drop off
    the end); state rows past it keep their values.
    """

    def __init__(self, batch: int, rows: int, dv: int, p: Params, ws: Workspace, tag: str = ""):
        self.p, self.ws = p, ws
        self.m = ws.take(tag + "m", (batch, rows, 1), torch.float32)
        self.m_new = ws.take(tag + "m_new", (batch, rows, 1), torch.float32)
        self.alpha = ws.take(tag + "alpha", (batch, rows, 1), torch.float32)
        self.l = ws.take(tag + "l", (batch, rows, 1), torch.float32)
        self.acc = ws.take(tag + "acc", (batch, rows, dv), torch.float32)
        self.fresh = True

    def reset(self, sinks: Optional[torch.Tensor]) -> None:
        """sinks: None, or the sink logit of every row, broadcastable to [batch, rows, 1]."""
        self.fresh = sinks is None
        if sinks is not None:   # a -inf sink (none for that head) starts the max at NEG_BIG, as a chunk's max
            self.m.copy_(sinks).clamp_min_(NEG_BIG)   # does, so a chunk with no visible key rescales by 1, not NaN
            torch.sub(sinks, self.m, out=self.l).exp_()   # 1 for a sink, 0 for -inf
            self.acc.zero_()

    def step(self, qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             mask: Optional[Callable[[torch.Tensor], None]] = None) -> None:
        """Fold one key chunk into the first b rows of the state.

        qg [b, rows, D] (pre-scaled), k [b, n, D], v [b, n, Dv] in the compute dtype.
        mask: None, or a function that sets the invisible scores of s [b, rows, n] to -inf.
        The first step of a fresh state must cover the whole batch.
        """
        b, rows, _ = qg.shape
        n, p, ws = k.shape[1], self.p, self.ws
        m, l, acc = self.m[:b], self.l[:b], self.acc[:b]
        s = ws.take("s", (b, rows, n), torch.float32)
        if p.cdt == torch.float32:
            torch.bmm(qg, k.transpose(1, 2), out=s)
        else:
            s.copy_(torch.bmm(qg, k.transpose(1, 2), out=ws.take("s_c", (b, rows, n), p.cdt)))
        if p.cap:
            s.tanh_().mul_(p.cap)
        if mask is not None:
            mask(s)
        if self.fresh:  # first chunk, no sinks: nothing to rescale
            torch.amax(s, -1, keepdim=True, out=m).clamp_min_(NEG_BIG)
            s.sub_(m).exp_()
            torch.sum(s, -1, keepdim=True, out=l)
            self._pv(s, v, acc, add=False)
            self.fresh = False
            return
        m_new = torch.amax(s, -1, keepdim=True, out=self.m_new[:b])
        torch.maximum(m_new, m, out=m_new)
        alpha = torch.sub(m, m_new, out=self.alpha[:b]).exp_()
        s.sub_(m_new).exp_()
        l.mul_(alpha).add_(s.sum(-1, keepdim=True))
        acc.mul_(alpha)
        self._pv(s, v, acc, add=True)
        m.copy_(m_new)

    def _pv(self, s: torch.Tensor, v: torch.Tensor, acc: torch.Tensor, add: bool) -> None:
        """acc (+)= s @ V."""
        if self.p.cdt == torch.float32:
            if add:
                acc.baddbmm_(s, v)
            else:
                torch.bmm(s, v, out=acc)
            return
        pc = self.ws.take("p_c", tuple(s.shape), self.p.cdt).copy_(s)
        part = torch.bmm(pc, v, out=self.ws.take("pv_c", tuple(acc.shape), self.p.cdt))
        if add:
            acc.add_(part)
        else:
            acc.copy_(part)

    def result(self) -> torch.Tensor:
        """acc / l * v_scale (fp32 [batch, rows, Dv]); rows that saw no key give 0."""
        if self.fresh:  # no chunk and no sinks
            return self.acc.zero_()
        self.acc.div_(self.l.clamp_min_(1e-30))
        if self.p.v_scale != 1.0:
            self.acc.mul_(self.p.v_scale)
        return self.acc


def _slot_table(indices: torch.Tensor, starts: List[int], lens: List[int], cols: Tuple[int, int]) -> torch.Tensor:
    """[reqs, cols[1] - cols[0]]: row r = key columns cols of request r (slots
    indices[starts[r] + c]) in ascending order, then slot 0 past the request's end. One query
    sees all of its request's keys, so their order is free, and ascending slots turn the
    gather's scattered row reads into forward sweeps."""
    cols_t = torch.arange(cols[0], cols[1], device="cpu")
    pick = (torch.tensor(starts, device="cpu")[:, None] + cols_t[None, :]).clamp_(max=max(indices.numel() - 1, 0))
    pad = cols_t[None, :] >= torch.tensor(lens, device="cpu")[:, None]
    table = torch.sort(indices[pick].masked_fill_(pad, torch.iinfo(torch.int64).max), dim=1).values
    return table.masked_fill_(pad, 0)


@dataclass
class ColumnPart:
    """One thread's share of a decode: key columns `cols` of the requests longer than cols[0]."""

    cols: Tuple[int, int]
    slots: torch.Tensor  # int64 [requests, cols]: `_slot_table`
    steps: List[Tuple[int, int, int, Optional[torch.Tensor]]]  # per chunk: its columns of `slots` [lo, hi), the
    #                                                            requests it covers, the padding bias or None
    rows: Dict[int, torch.Tensor]  # head_rows(slots, KVH) per KV head count, made by the first layer needing it


@dataclass
class DecodePlan:
    """What `decode_torch` derives from a list on the host for one window and thread count (`plan_decode`):
    made once per forward and list when the caller keeps it (`hwkv_cpu.host_plan`), else per call."""

    live: int                     # requests with a visible key
    rank: Optional[torch.Tensor]  # int64 [live]: those requests, longest first
    dead: Optional[torch.Tensor]  # int64: the requests without one (their output is 0)
    chunk: int                    # keys per request per step
    parts: List[ColumnPart]


def plan_decode(indptr: list, indices: torch.Tensor, pos0: list, q_pos: list, window: int, threads: int,
                keys_per_step: int = DECODE_KEYS) -> DecodePlan:
    """Requests longest first (rows of a key table padded with slot 0); the key columns split over `threads` so
    that each gets an equal number of keys; per split, its slot table and each step's requests and padding mask."""
    bs = len(pos0)
    spans = [key_range(indptr[b + 1] - indptr[b], pos0[b], q_pos[b], q_pos[b], window) for b in range(bs)]
    order = sorted(range(bs), key=lambda b: spans[b][0] - spans[b][1])
    lens = [spans[b][1] - spans[b][0] for b in order]
    live = sum(1 for n in lens if n > 0)
    dead = torch.tensor(order[live:], device="cpu") if live < bs else None
    if live == 0:
        return DecodePlan(0, None, dead, 0, [])
    order, lens = order[:live], lens[:live]
    starts = [indptr[b] + spans[b][0] for b in order]
    chunk = max(MIN_CHUNK, keys_per_step // live)
    parts = parallel_map(lambda cols: _plan_columns(indices, starts, lens, cols, chunk),
                         _split_columns(lens, threads, chunk))
    return DecodePlan(live, torch.tensor(order, device="cpu"), dead, chunk, parts)


def _plan_columns(indices: torch.Tensor, starts: List[int], lens: List[int], cols: Tuple[int, int],
                  chunk: int) -> ColumnPart:
    active = sum(1 for n in lens if n > cols[0])
    slots = _slot_table(indices, starts[:active], lens[:active], cols)
    n_keys = torch.tensor(lens[:active], device="cpu")
    steps = []
    for c0 in range(cols[0], cols[1], chunk):
        c1 = min(c0 + chunk, cols[1])
        while lens[active - 1] <= c0:
            active -= 1
        bias = None
        if lens[active - 1] < c1:  # the shortest active request ends inside this chunk
            hidden = torch.arange(c0, c1, device="cpu")[None, :] >= n_keys[:active, None]
            bias = neg_inf_where(hidden).view(active, 1, 1, c1 - c0)
        steps.append((c0 - cols[0], c1 - cols[0], active, bias))
    return ColumnPart(cols, slots, steps, {})


def decode_torch(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, indptr: list, indices: torch.Tensor,
                 pos0: list, q_pos: list, out: torch.Tensor, p: Params, sinks: Optional[torch.Tensor],
                 keys_per_step: int = DECODE_KEYS, *, plans: Optional[HostLists] = None) -> None:
    """out[b] = attention of q[b] over the visible part of request b's list (see `decode_attention`).

    The host part is `plan_decode`'s (kept in `plans`, this forward's host lists of the list, where the caller has
    them: every layer after the first reuses it). Threads run the plan's column splits, each step taking the next
    keys of every request that still has some (a leading run of rows, masking the tail of requests that end inside
    the step); the partial softmax states merge.
    """
    bs, h, d = q.shape
    kvh, dv = k_buf.shape[1], v_buf.shape[2]
    g = h // kvh
    threads = torch.get_num_threads()
    make = lambda: plan_decode(indptr, indices, pos0, q_pos, p.window, threads, keys_per_step)  # noqa: E731
    plan = make() if plans is None else plans.get(("decode", p.window, threads, keys_per_step), make)
    if plan.dead is not None:
        out[plan.dead] = 0
    if plan.live == 0:
        return
    live = plan.live
    qs = q.index_select(0, plan.rank).to(p.cdt).view(live * kvh, g, d).mul_(p.qk_scale)
    states = parallel_map(lambda part: _decode_columns(qs, part, k_buf, v_buf, p, plan.chunk), plan.parts)
    res = _merge(states, live * kvh, g, dv, None if sinks is None else sinks.view(kvh, g, 1).repeat(live, 1, 1))
    if p.v_scale != 1.0:
        res.mul_(p.v_scale)
    out[plan.rank] = res.view(live, h, dv).to(out.dtype)   # (index_copy_ has no fp8 kernel on the CPU)


def _split_columns(lens: List[int], parts: int, chunk: int) -> List[Tuple[int, int]]:
    """Cut key columns [0, lens[0]) into up to `parts` ranges holding equal numbers of keys
    (lens sorted descending: column c holds one key of each request longer than c)."""
    total = sum(lens)
    parts = max(1, min(parts, total // max(chunk, 1)))
    bounds, c, done, active = [0], 0, 0, len(lens)
    for goal in (total * w // parts for w in range(1, parts)):
        while done < goal:
            while lens[active - 1] <= c:
                active -= 1
            step = min(lens[active - 1] - c, -(-(goal - done) // active))  # within the run of `active` keys
            c, done = c + step, done + step * active
        bounds.append(c)
    bounds.append(lens[0])
    return [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]


def _decode_columns(qs: torch.Tensor, part: ColumnPart, k_buf: torch.Tensor, v_buf: torch.Tensor, p: Params,
                    chunk: int):
    """(m, l, acc) of the part's requests over its key columns."""
    kvh, g = k_buf.shape[1], qs.shape[1]
    active = part.slots.shape[0]
    rows = part.rows.get(kvh)
    if rows is None:
        rows = part.rows[kvh] = head_rows(part.slots, kvh)  # [active, KVH, cols]
    ws = workspace()
    gather = Gather(k_buf, v_buf, p.cdt, chunk * active * kvh, ws)
    state = OnlineSoftmax(active * kvh, g, v_buf.shape[2], p, ws)
    for lo, hi, a, bias in part.steps:
        k, v = gather(rows[:a, :, lo:hi])  # [a, KVH, n, D]
        mask = None if bias is None else (lambda s, bias=bias, a=a: s.view(a, kvh, g, -1).add_(bias))
        state.step(qs[:a * kvh], k.flatten(0, 1), v.flatten(0, 1), mask)
    return state.m.clone(), state.l.clone(), state.acc.clone()


def _merge(states, rows: int, g: int, dv: int, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """Normalized output [rows, g, Dv] from partial (m, l, acc) states covering leading rows. The state is fp32 whatever
    torch's default dtype (a caller's set_default_dtype between steps must not round it)."""
    f32 = dict(dtype=torch.float32, device="cpu")
    m = torch.full((rows, g, 1), NEG_BIG, **f32) if sinks is None else sinks.to(torch.float32, copy=True)
    for m_w, _, _ in states:
        torch.maximum(m[:m_w.shape[0]], m_w, out=m[:m_w.shape[0]])
    l = torch.zeros(rows, g, 1, **f32) if sinks is None else (sinks - m).exp_()
    acc = torch.zeros(rows, g, dv, **f32)
    for m_w, l_w, acc_w in states:
        n = m_w.shape[0]
        f = (m_w - m[:n]).exp_()
        l[:n].addcmul_(l_w, f)
        acc[:n].addcmul_(acc_w, f)
    return acc.div_(l.clamp_min_(1e-30))
