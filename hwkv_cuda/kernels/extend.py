"""extend_attention: flash attention of a batch of query runs over paged keys (prefix + new).

Every key, prefix and new alike, is already in the pool. Grid (kv head, token block, request):
a program takes BLOCK_T consecutive query tokens times the GROUP q heads that share one kv
head as one [BLOCK_M = BLOCK_T * GP, D] tile (GP: GROUP rounded up to a power of two), so each
key tile is loaded once for the whole GQA group, and a decode row inside a mixed batch fills
GROUP rows of a small tile rather than one row of a 128-row tile. The program walks only the
key tiles some of its queries can see (window start of the first token to the causal end of
the last), in three loops: masked tiles at the window edge, unmasked tiles every row sees in
full (no mask arithmetic at all), masked tiles across the causal diagonal (`one_loop` configs, for
window lists, walk them all as one masked loop instead). Window prefill thus
costs about N x (W + BLOCK_T) keys, not N x N. Token blocks run from the last (the heaviest
under the causal mask) to the first, so the long programs start first.

Tree verify (`tree=`, a `hwkv.spec.TreeMask`; HAS_TREE constexpr): each row's position comes from
q_positions; a program walks list entries [window start of its smallest row position, the
request's list end restricted to positions <= q_pos0 + n_b - 1), every tile masked: a prefix key
(list position < q_pos0) by the window (tiles holding only prefix keys take the causal tiles' mask,
which is that), a draft key t by its ancestor bit mask[row, t] (loaded per row token and draft key,
only in tiles reaching the draft region) and the window over the draft's position.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from hwkv.checks import check_attention_options, check_max_q_len, check_tensors
from hwkv.csr_checks import (check_csr_values, check_dims, check_float_dtypes, check_index_dtypes,
                              check_same_device)
from hwkv.errors import ShapeError
from hwkv.spec import TreeMask, check_tree_mask
from hwkv_cuda.kernels import extend_hopper
from hwkv_cuda.kernels.launch import Launch, launch
from hwkv_cuda.kernels.common import (LOG2E, NEG_BIG, as_scale, build_for_sm90, cdiv, dot, fast_tanh_for, fold_sink,
                                      hopper_class, interpreting, logits_log2, next_pow2, online_softmax_step, pow2)


@dataclass(frozen=True)
class ExtendConfig:
    """Launch parameters of the extend kernel. block_m: query rows per program (tokens x packed
    q heads; fewer when no request has that many tokens); block_n: keys per loop iteration."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    one_loop: bool = False   # walk every key tile in one masked loop (no edge / full / diagonal split)
    mask32: bool = True      # mask from int32 offsets inside the tile (else int64 list positions)
    # a soft-cap by the hardware's tanh where `common.fast_tanh_for` allows it (NVIDIA sm_75+, bf16/fp16): 2.5x the
    # exact form at cap 50 on an H100 (1 x 8192 causal D=64 1,906 against 4,798 us; docs/benchmarks.md)
    fast_tanh: bool = True


# Keyed by (head dim rounded up to a power of two, fp32 queries). Recorded here rather than
# autotuned at run time, so every run (CI, graphs, the interpreter) launches the same config and
# no first call pays a search. D=64 (GPT-OSS) was swept on an H200 on 2026-12-01
# (`benchmarks/bench_cuda_kernels.py --only extend --sweep`, docs/benchmarks.md): causal 1 x 8192
# and 4 x 2048 over 2048 were fastest at 128/128/4 warps/2 stages (3-6% over 128/64/4/3). With
# 128-key tiles the mask from int64 list positions measured 10-18% faster than from int32 tile
# offsets (1 x 8192: 1504 vs 1672 us; 1 x 2048 over 30K: 2961 vs 3595); with 32- and 64-key tiles
# the int32 form was 4-7% faster, hence the flag. D=128 and 256 were swept on the same day with
# `--sweep-head-dims` (Llama-like 32 q / 8 kv heads, causal 1 x 8192): D=128 128/64/4/3 1389 us
# (396 TFLOP/s; the earlier FlashAttention-2 starting point 128/64/8/3 took 1724 us), D=256 128/64/8/3
# 2664 us (414 TFLOP/s; 64/32/4/2 took 4325 us); 4 stages were within 0.5%.
TUNED: Dict[Tuple[int, bool], ExtendConfig] = {
    (64, False): ExtendConfig(block_m=128, block_n=128, num_warps=4, num_stages=2, mask32=False),
    (128, False): ExtendConfig(block_m=128, block_n=64, num_warps=4, num_stages=3),
    (256, False): ExtendConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
}
# Window lists (W <= WINDOWED_MAX): a program walks only W + BLOCK_T keys, so smaller tiles waste less,
# and one masked loop (about five tiles) pipelines where three short loops do not: W=128 over 8192
# tokens 121 us at 64/32/4/2 in one loop, 130 us in three (same sweep; 178 us at the causal tiles).
WINDOWED_MAX = 512
# D=128 W=128: 128/32/4/3 134 us against 183 us at the earlier causal tiles. D=256 W=128: 64/32/4/2
# (272 us) was within 0.6% of the sweep's best and far ahead of the new causal tiles there.
WINDOWED: Dict[int, ExtendConfig] = {
    64: ExtendConfig(block_m=64, block_n=32, num_warps=4, num_stages=2, one_loop=True),
    128: ExtendConfig(block_m=128, block_n=32, num_warps=4, num_stages=3),
    256: ExtendConfig(block_m=64, block_n=32, num_warps=4, num_stages=2),
}
# Devices other than Hopper-class NVIDIA GPUs (less shared memory: MI300's 64 KiB LDS, sm_8x's 100-164 KiB)
# keep the configs that ran there before the H200 sweep wherever the swept one needs more.
PORTABLE: Dict[int, ExtendConfig] = {256: ExtendConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)}
INTERPRET_CONFIG = ExtendConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)


def default_config(head_dim: int, fp32: bool = False, window: Optional[int] = None,
                   device: Optional[torch.device] = None) -> ExtendConfig:
    """The recorded config for this head dim, query dtype, window and device (tiny blocks under the
    interpreter; `PORTABLE` off Hopper-class GPUs, and when no device is named)."""
    if interpreting():
        return INTERPRET_CONFIG
    d = min(max(pow2(head_dim), 64), 256)
    cfg = TUNED[(d, False)]
    if d in PORTABLE and (device is None or not hopper_class(torch.device(device))):
        cfg = PORTABLE[d]
    if window and window <= WINDOWED_MAX and d in WINDOWED:
        cfg = WINDOWED[d]
    if fp32:   # fp32 tiles take twice the registers and shared memory of bf16 ones
        cfg = ExtendConfig(block_m=max(16, cfg.block_m // 2), block_n=max(16, cfg.block_n // 2),
                           num_warps=cfg.num_warps, num_stages=min(cfg.num_stages, 2), one_loop=cfg.one_loop,
                           mask32=cfg.mask32)
    return cfg


def tile_rows(config: ExtendConfig, group: int, max_q_len: int) -> Tuple[int, int]:
    """(BLOCK_T tokens, GP packed heads) of one program: GP = group rounded up to a power of two;
    BLOCK_T fills config.block_m rows but never exceeds the longest query run, and the tile keeps
    at least 16 rows (tl.dot's minimum)."""
    gp = next_pow2(max(1, group))
    block_t = max(1, min(config.block_m // gp, next_pow2(max(1, int(max_q_len)))))
    return max(block_t, 16 // min(gp, 16)), gp


@triton.jit
def _tree_visible(offs_n, mask_n, q_rel, window, tree_mask, tree_row, tok_ok, tree_pos, rel0, pos0,
                  HAS_WINDOW: tl.constexpr):
    """[rows, keys] visibility in a tree verify: list entry j < rel0 is a prefix key (window only);
    j >= rel0 is draft t = j - rel0, seen iff its ancestor bit tree_mask[tree_row + t] is set and
    its position tree_pos[t] is inside the row's window (positions relative to pos0)."""
    draft = mask_n & (offs_n >= rel0)
    t = offs_n - rel0
    bit = tl.load(tree_mask + tree_row[:, None] + t[None, :], mask=tok_ok[:, None] & draft[None, :], other=0)
    vis = mask_n[None, :] & ((bit != 0) | (offs_n < rel0)[None, :])
    if HAS_WINDOW:
        k_rel = tl.where(draft, tl.load(tree_pos + t, mask=draft, other=0) - pos0, offs_n)
        vis = vis & (k_rel[None, :] > q_rel[:, None] - window)
    return vis


@triton.jit
def _key_slots(kv_indices, kv_start, offs_n, mask_n, MASKED: tl.constexpr):
    """A key tile's pool slots (masked: 0 past the list's end) as int64 whatever the list's dtype: an int32 list's
    slot times the row stride would wrap in a pool of 2**31 elements or more."""
    if MASKED:
        slot = tl.load(kv_indices + kv_start + offs_n, mask=mask_n, other=0)
    else:
        slot = tl.load(kv_indices + kv_start + offs_n)
    return slot.to(tl.int64)


@triton.jit
def _extend_tile(qt, k_buf, v_buf, kv_indices, kv_start, start, hi, q_rel, m, l_sum, acc, kvh,
                 s_kb, s_kh, s_vb, s_vh, qk_scale, cap, window, offs_d, offs_dv,
                 tree_mask, tree_row, tok_ok, tree_pos, rel0, pos0,
                 D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 BLOCK_N: tl.constexpr, HAS_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
                 MASKED: tl.constexpr, F32: tl.constexpr, TREE: tl.constexpr, MASK32: tl.constexpr = True):
    """Fold key tile [start, start + BLOCK_N) into (m, l_sum, acc); MASKED: apply the list end, the
    causal bound and the window per element (otherwise every row sees every key of the tile); TREE
    (masked tiles only): the tree's visibility instead of the causal bound (`_tree_visible`; the
    tree_* arguments are unused otherwise)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hi
    slot = _key_slots(kv_indices, kv_start, offs_n, mask_n, MASKED)
    k_ptr = k_buf + slot[:, None] * s_kb + kvh * s_kh + offs_d[None, :]
    v_ptr = v_buf + slot[:, None] * s_vb + kvh * s_vh + offs_dv[None, :]
    if MASKED:
        kt = tl.load(k_ptr, mask=mask_n[:, None] & (offs_d[None, :] < D), other=0.0)
    elif BLOCK_D == D:
        kt = tl.load(k_ptr)
    else:
        kt = tl.load(k_ptr, mask=offs_d[None, :] < D, other=0.0)
    s = logits_log2(dot(qt, tl.trans(kt.to(qt.dtype)), F32), qk_scale, cap, HAS_CAP)
    if MASKED:
        if TREE:
            vis = _tree_visible(offs_n, mask_n, q_rel, window, tree_mask, tree_row, tok_ok, tree_pos, rel0, pos0,
                                HAS_WINDOW)
        else:
            if MASK32:
                # int32 offsets inside the tile: one compare per element instead of int64 arithmetic
                # (each row's bounds clamped to [-1, BLOCK_N] in int64 first: a query 2**31 or more past the tile
                # must not wrap, and the clamped compares are the exact ones inside the tile)
                ar = tl.arange(0, BLOCK_N)
                dq = tl.minimum(tl.maximum(q_rel - start, -1), BLOCK_N).to(tl.int32)
                vis = (ar[None, :] < (hi - start).to(tl.int32)) & (ar[None, :] <= dq[:, None])
                if HAS_WINDOW:
                    dw = tl.minimum(tl.maximum(q_rel - start - window, -1), BLOCK_N).to(tl.int32)
                    vis = vis & (ar[None, :] > dw[:, None])
            else:
                vis = mask_n[None, :] & (offs_n[None, :] <= q_rel[:, None])
                if HAS_WINDOW:
                    vis = vis & (offs_n[None, :] > q_rel[:, None] - window)
        s = tl.where(vis, s, float("-inf"))
        vt = tl.load(v_ptr, mask=mask_n[:, None] & (offs_dv[None, :] < DV), other=0.0)
    elif BLOCK_DV == DV:
        vt = tl.load(v_ptr)
    else:
        vt = tl.load(v_ptr, mask=offs_dv[None, :] < DV, other=0.0)
    return online_softmax_step(m, l_sum, acc, s, vt.to(qt.dtype), F32)


@triton.jit
def _extend_kernel(
        q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, qo_indptr, q_pos0, sinks, tree_mask, tree_indptr,
        q_positions, out, qk_scale, v_scale, cap, window,
        s_qt, s_qh, s_kb, s_kh, s_vb, s_vh, s_ot, s_oh,
        GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, F32: tl.constexpr,
        HAS_TREE: tl.constexpr, ONE_LOOP: tl.constexpr, MASK32: tl.constexpr):
    BLOCK_M: tl.constexpr = BLOCK_T * GP
    kvh = tl.program_id(0)
    first = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_T   # heaviest (last) token blocks first
    b = tl.program_id(2)
    q_start = tl.load(qo_indptr + b).to(tl.int64)
    q_len = tl.load(qo_indptr + b + 1).to(tl.int64) - q_start
    kv_start = tl.load(kv_indptr + b).to(tl.int64)
    kv_len = tl.load(kv_indptr + b + 1).to(tl.int64) - kv_start
    pos0 = tl.load(kv_pos0 + b).to(tl.int64)
    rel0 = tl.load(q_pos0 + b).to(tl.int64) - pos0  # q_pos0 - pos0
    last = tl.minimum(q_len, first + BLOCK_T) - 1   # last valid token of the block (< first: empty)

    offs_r = tl.arange(0, BLOCK_M)
    tok = first + offs_r // GP
    g = offs_r % GP
    head = kvh * GROUP + g
    mask_r = (tok < q_len) & (g < GROUP)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    qt = tl.load(q + (q_start + tok)[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :],
                 mask=mask_r[:, None] & (offs_d[None, :] < D), other=0.0)

    m = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    if HAS_TREE:
        # Rows at their tree positions; list entries [lo, hi): from the smallest row position's window
        # start to the last draft; every tile masked (a prefix key is older than every row: the causal
        # bound holds, the window applies as usual).
        tok_ok = tok < q_len
        q_rel = tl.load(q_positions + q_start + tok, mask=tok_ok, other=0).to(tl.int64) - pos0
        lo = tl.maximum(tl.zeros_like(rel0), -pos0)   # entries at negative positions are no keys
        if HAS_WINDOW:
            lo = tl.maximum(lo, tl.min(tl.where(tok_ok, q_rel, tl.max(q_rel, 0)), 0) - window + 1)
        hi = tl.minimum(kv_len, rel0 + q_len)
        hi = tl.where(last < first, lo, tl.maximum(hi, lo))
        d_lo = tl.minimum(lo + tl.maximum(rel0 - lo, 0) // BLOCK_N * BLOCK_N, hi)   # first tile with a draft
        tree_row = tl.load(tree_indptr + b).to(tl.int64) + tok * q_len   # row token's [n_b] mask bits
        tree_pos = q_positions + q_start                                 # draft t's position: tree_pos[t]
        for start in range(lo, d_lo, BLOCK_N):           # prefix keys only: list end and window, no bits
            m, l_sum, acc = _extend_tile(qt, k_buf, v_buf, kv_indices, kv_start, start, hi, q_rel, m, l_sum, acc,
                                         kvh, s_kb, s_kh, s_vb, s_vh, qk_scale, cap, window, offs_d, offs_dv,
                                         tree_mask, tree_row, tok_ok, tree_pos, rel0, pos0, D, DV,
                                         BLOCK_D, BLOCK_DV, BLOCK_N, HAS_CAP, HAS_WINDOW, True, F32, False, MASK32)
        for start in range(d_lo, hi, BLOCK_N):           # tiles reaching the drafts: the tree's bits
            m, l_sum, acc = _extend_tile(qt, k_buf, v_buf, kv_indices, kv_start, start, hi, q_rel, m, l_sum, acc,
                                         kvh, s_kb, s_kh, s_vb, s_vh, qk_scale, cap, window, offs_d, offs_dv,
                                         tree_mask, tree_row, tok_ok, tree_pos, rel0, pos0, D, DV,
                                         BLOCK_D, BLOCK_DV, BLOCK_N, HAS_CAP, HAS_WINDOW, True, F32, True)
    else:
        # List entries some query of the block may see, [lo, hi), and those all of them see, [full_lo, full_hi).
        lo = tl.maximum(tl.zeros_like(rel0), -pos0)   # entries at negative positions are no keys
        full_lo = lo
        if HAS_WINDOW:
            lo = tl.maximum(lo, rel0 + first - window + 1)
            full_lo = tl.maximum(lo, rel0 + last - window + 1)
        hi = tl.minimum(kv_len, rel0 + last + 1)
        hi = tl.where(last < first, lo, tl.maximum(hi, lo))
        full_hi = tl.minimum(kv_len, rel0 + first + 1)
        a_end = tl.minimum(lo + tl.cdiv(tl.maximum(full_lo - lo, 0), BLOCK_N) * BLOCK_N, hi)
        b_end = a_end + tl.maximum((full_hi - a_end) // BLOCK_N, 0) * BLOCK_N
        q_rel = rel0 + tok                              # query positions, relative to pos0
        # (the tree arguments of _extend_tile are unused without TREE: placeholders)
        if ONE_LOOP:   # short walks (window lists): one pipelined loop of masked tiles beats three short loops
            a_end = hi
            b_end = hi
        for start in range(lo, a_end, BLOCK_N):          # window edge
            m, l_sum, acc = _extend_tile(qt, k_buf, v_buf, kv_indices, kv_start, start, hi, q_rel, m, l_sum, acc,
                                         kvh, s_kb, s_kh, s_vb, s_vh, qk_scale, cap, window, offs_d, offs_dv,
                                         kv_indices, q_rel, mask_r, kv_indices, rel0, pos0, D, DV,
                                         BLOCK_D, BLOCK_DV, BLOCK_N, HAS_CAP, HAS_WINDOW, True, F32, False, MASK32)
        for start in range(a_end, b_end, BLOCK_N):       # seen by every row: no masks
            m, l_sum, acc = _extend_tile(qt, k_buf, v_buf, kv_indices, kv_start, start, hi, q_rel, m, l_sum, acc,
                                         kvh, s_kb, s_kh, s_vb, s_vh, qk_scale, cap, window, offs_d, offs_dv,
                                         kv_indices, q_rel, mask_r, kv_indices, rel0, pos0, D, DV,
                                         BLOCK_D, BLOCK_DV, BLOCK_N, HAS_CAP, HAS_WINDOW, False, F32, False, MASK32)
        for start in range(b_end, hi, BLOCK_N):          # causal diagonal
            m, l_sum, acc = _extend_tile(qt, k_buf, v_buf, kv_indices, kv_start, start, hi, q_rel, m, l_sum, acc,
                                         kvh, s_kb, s_kh, s_vb, s_vh, qk_scale, cap, window, offs_d, offs_dv,
                                         kv_indices, q_rel, mask_r, kv_indices, rel0, pos0, D, DV,
                                         BLOCK_D, BLOCK_DV, BLOCK_N, HAS_CAP, HAS_WINDOW, True, F32, False, MASK32)

    if HAS_SINKS:
        sink = tl.load(sinks + head, mask=mask_r, other=0.0).to(tl.float32) * LOG2E
        m, l_sum, acc = fold_sink(m, l_sum, acc, sink)
    o = acc * v_scale / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(out + (q_start + tok)[:, None] * s_ot + head[:, None] * s_oh + offs_dv[None, :],
             o.to(out.dtype.element_ty), mask=mask_r[:, None] & (offs_dv[None, :] < DV))


def _check_extend(q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, qo_indptr, q_pos0, out, sinks, max_q_len):
    check_tensors(q=q, k_buf=k_buf, v_buf=v_buf, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_pos0=kv_pos0,
                  qo_indptr=qo_indptr, q_pos0=q_pos0, out=out, sinks=sinks)
    check_dims("q", q, [None, None, None])
    t, h, d = q.shape
    bs = kv_pos0.shape[0] if kv_pos0.dim() == 1 else -1
    check_dims("k_buf", k_buf, [None, None, d])
    kvh = k_buf.shape[1]
    check_dims("v_buf", v_buf, [k_buf.shape[0], kvh, None])
    check_dims("out", out, [t, h, v_buf.shape[2]])
    check_dims("kv_pos0", kv_pos0, [bs])
    check_dims("kv_indptr", kv_indptr, [bs + 1])
    check_dims("kv_indices", kv_indices, [None])
    check_dims("qo_indptr", qo_indptr, [bs + 1])
    check_dims("q_pos0", q_pos0, [bs])
    if sinks is not None:
        check_dims("sinks", sinks, [h])
    if h % kvh:
        raise ShapeError(f"q has {h} heads, not a multiple of the buffers' {kvh} kv heads")
    check_same_device(q=q, k_buf=k_buf, v_buf=v_buf, kv_indptr=kv_indptr, kv_indices=kv_indices,
                      kv_pos0=kv_pos0, qo_indptr=qo_indptr, q_pos0=q_pos0, out=out, sinks=sinks)
    check_index_dtypes((("kv_indptr", kv_indptr), ("kv_indices", kv_indices), ("kv_pos0", kv_pos0),
                        ("qo_indptr", qo_indptr), ("q_pos0", q_pos0)))
    check_float_dtypes((("q", q), ("k_buf", k_buf), ("v_buf", v_buf), ("out", out), ("sinks", sinks)))
    check_max_q_len(max_q_len)
    check_csr_values(kv_indptr, kv_indices, k_buf.shape[0], qo_indptr, t, max_q_len)


# planned launches of the extend kernel: a plan is per forward, its launches outlive it (keyed by what fixes them)
_LAUNCHES: Dict[Any, Launch] = {}


class ExtendPlan(NamedTuple):
    """How to launch extend for calls sharing a batch, a head geometry and the metadata lists: the
    grid and tile config, and the shapes/strides the first call was checked with (`plan_extend`);
    has_tree: planned with a verify tree (the kernel's HAS_TREE)."""

    q_shape: Tuple[int, ...]
    k_shape: Tuple[int, ...]
    v_shape: Tuple[int, ...]
    k_stride: Tuple[int, ...]
    v_stride: Tuple[int, ...]
    out_shape: Tuple[int, ...]
    device: torch.device
    grid: Tuple[int, int, int]   # (0, 0, 0): nothing to launch
    config: ExtendConfig
    consts: Dict[str, Any]       # the kernel's constexprs and launch options
    interpreted: bool
    has_tree: bool
    launch_key: Tuple[Any, ...]  # what fixes its launch (grid, constexprs): shared across forwards
    hopper: Any = None           # an extend_hopper.HopperPlan: the Gluon sm_90 kernel runs the call instead
    fast_tanh: bool = False      # a soft-cap by the hardware's tanh (config.fast_tanh where fast_tanh_for allows it)


def _consts(cfg: ExtendConfig, group: int, d: int, dv: int, max_q_len: int, has_tree: bool) -> Dict[str, Any]:
    """The kernel's constexprs and launch options under `cfg` for this head geometry and longest query run (all
    but the per-layer HAS_CAP, HAS_WINDOW, HAS_SINKS and F32)."""
    block_t, gp = tile_rows(cfg, group, max_q_len)
    return dict(GROUP=group, GP=gp, D=d, DV=dv, BLOCK_T=block_t, BLOCK_D=pow2(d), BLOCK_DV=pow2(dv),
                BLOCK_N=cfg.block_n, HAS_TREE=has_tree, ONE_LOOP=cfg.one_loop, MASK32=cfg.mask32,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _make_plan(q, k_buf, v_buf, kv_pos0, out, max_q_len, config, has_tree, window=None) -> ExtendPlan:
    t, h, d = q.shape
    bs, kvh, dv = kv_pos0.shape[0], k_buf.shape[1], v_buf.shape[2]
    cfg = config or default_config(d, q.dtype == torch.float32, window, q.device)
    consts = _consts(cfg, h // kvh, d, dv, max_q_len, has_tree)
    empty = t == 0 or bs == 0 or max_q_len <= 0
    grid = (0, 0, 0) if empty else (kvh, cdiv(int(max_q_len), consts["BLOCK_T"]), bs)
    # on sm_90 the Gluon kernel where it applies (an explicit config names the portable one); window layers take it
    # with window tiles where recorded (extend_hopper.takes_window)
    gluon = not (empty or config)
    hopper = extend_hopper.plan_hopper_extend(q, k_buf, v_buf, out, max_q_len, has_tree, window) if gluon else None
    return ExtendPlan(tuple(q.shape), tuple(k_buf.shape), tuple(v_buf.shape), k_buf.stride(), v_buf.stride(),
                      tuple(out.shape), q.device, grid, cfg, consts, interpreting(), has_tree,
                      (grid, tuple(consts.items())), hopper,
                      cfg.fast_tanh and fast_tanh_for(q.device, q.dtype == torch.float32))


def _run(plan: ExtendPlan, q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, qo_indptr, q_pos0, out, scaling,
         window, logit_cap, sinks, k_scale, v_scale, tree) -> None:
    if plan.grid[0] == 0:
        return
    # a window layer reading the full list (its plan made without the window, so causal tiles) keeps the portable kernel
    gluon = plan.hopper is not None and (not window or plan.hopper.windows)
    if gluon and extend_hopper.run_hopper_extend(plan.hopper, q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0,
                                                 qo_indptr, q_pos0, out, scaling, window, logit_cap, sinks, k_scale,
                                                 v_scale):
        return
    cap = float(logit_cap or 0.0)
    window = int(window or 0)
    if tree is None:   # pointers the kernel never reads without HAS_TREE
        tree_mask = tree_indptr = q_positions = q
    else:
        tree_mask, tree_indptr, q_positions = tree.mask.view(torch.uint8), tree.mask_indptr, tree.q_positions
    f32 = q.dtype == torch.float32 or plan.interpreted
    has_cap = 0 if cap <= 0 else 2 if plan.fast_tanh and not f32 else 1   # none, the exact tanh, the hardware's
    flags = (has_cap, window > 0, sinks is not None, f32)
    launch(_LAUNCHES, (plan.launch_key,) + flags, _extend_kernel, plan.grid,
           (q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, qo_indptr, q_pos0,
            sinks if sinks is not None else q, tree_mask, tree_indptr, q_positions, out,
            float(scaling) * as_scale(k_scale, "k_scale"), as_scale(v_scale, "v_scale"), cap, window,
            q.stride(0), q.stride(1), plan.k_stride[0], plan.k_stride[1], plan.v_stride[0],
            plan.v_stride[1], out.stride(0), out.stride(1)),
           dict(HAS_CAP=flags[0], HAS_WINDOW=flags[1], HAS_SINKS=flags[2], F32=flags[3], **plan.consts))


def extend_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_pos0: torch.Tensor,
                     qo_indptr: torch.Tensor, q_pos0: torch.Tensor, out: torch.Tensor,
                     max_q_len: int, scaling: Optional[float], window: Optional[int] = None,
                     logit_cap: float = 0.0, sinks: Optional[torch.Tensor] = None,
                     k_scale: Optional[float] = None, v_scale: Optional[float] = None, *,
                     config: Optional[ExtendConfig] = None, tree: Optional[TreeMask] = None) -> None:
    """Causal (+ window) attention of query runs over their request's listed keys.

    q [T, H, D]; out [T, H, Dv] (written). Request b's queries are rows
    qo_indptr[b]:qo_indptr[b+1] at positions q_pos0[b] + row - qo_indptr[b]; its keys are
    kv_indices[kv_indptr[b]:kv_indptr[b+1]] at positions kv_pos0[b] + j. max_q_len: host
    upper bound on any request's query count (sizes the grid; rows past it are not written).
    tree: a verify tree (`hwkv.spec.TreeMask`): rows sit at tree.q_positions and see prefix keys
    (list positions < q_pos0[b]) in their window and draft keys by the tree's ancestor mask (see
    hwkv.spec; its values are checked on CPU tensors and in debug mode). Other arguments as in
    decode_attention. No host sync.
    """
    _check_extend(q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, qo_indptr, q_pos0, out, sinks, max_q_len)
    check_attention_options(scaling, window, logit_cap, sinks)
    if scaling is None:   # (as the CPU kernels and the layer read it)
        scaling = q.shape[-1] ** -0.5
    if tree is not None:
        check_tree_mask(tree, q, qo_indptr, q_pos0)
    plan = _make_plan(q, k_buf, v_buf, kv_pos0, out, max_q_len, config, tree is not None, window)
    _run(plan, q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, qo_indptr, q_pos0, out, scaling, window,
         logit_cap, sinks, k_scale, v_scale, tree)


def plan_extend(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indptr: torch.Tensor,
                kv_indices: torch.Tensor, kv_pos0: torch.Tensor, qo_indptr: torch.Tensor, q_pos0: torch.Tensor,
                out: torch.Tensor, max_q_len: int, sinks: Optional[torch.Tensor] = None, *,
                config: Optional[ExtendConfig] = None, tree: Optional[TreeMask] = None,
                window: Optional[int] = None) -> ExtendPlan:
    """Check one call's arguments as `extend_attention` does and plan it (`window`: the list's W, which
    picks the tile config); calls with the same shapes and metadata tensors (the tree's included) reuse
    the plan through `extend_attention_planned`."""
    _check_extend(q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, qo_indptr, q_pos0, out, sinks, max_q_len)
    if tree is not None:
        check_tree_mask(tree, q, qo_indptr, q_pos0)
    return _make_plan(q, k_buf, v_buf, kv_pos0, out, max_q_len, config, tree is not None, window)


def extend_attention_planned(plan: ExtendPlan, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                             kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_pos0: torch.Tensor,
                             qo_indptr: torch.Tensor, q_pos0: torch.Tensor, out: torch.Tensor, max_q_len: int,
                             scaling: float, window: Optional[int] = None, logit_cap: float = 0.0,
                             sinks: Optional[torch.Tensor] = None, k_scale: Optional[float] = None,
                             v_scale: Optional[float] = None, *, tree: Optional[TreeMask] = None) -> None:
    """`extend_attention` under a plan from `plan_extend` (internal: the backend's per-layer call).
    Tensors are compared with the plan (tuples, no helper calls; the sinks' layout too, as every layer of a plan has
    its own); a call that differs (a tree where the plan has none or the reverse included) takes the checked
    `extend_attention`."""
    if (q.shape != plan.q_shape or k_buf.shape != plan.k_shape or v_buf.shape != plan.v_shape
            or out.shape != plan.out_shape or k_buf.stride() != plan.k_stride or v_buf.stride() != plan.v_stride
            or (q.stride(2) != 1 and plan.q_shape[2] > 1) or (out.stride(2) != 1 and plan.out_shape[2] > 1)
            or q.device != plan.device or k_buf.device != plan.device or (tree is not None) != plan.has_tree
            or (sinks is not None and (sinks.shape != plan.q_shape[1:2] or sinks.device != plan.device
                                       or not sinks.is_contiguous()))):
        extend_attention(q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, qo_indptr, q_pos0, out, max_q_len,
                         scaling, window, logit_cap, sinks, k_scale, v_scale, config=plan.config, tree=tree)
        return
    _run(plan, q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, qo_indptr, q_pos0, out, scaling, window,
         logit_cap, sinks, k_scale, v_scale, tree)


def compile_extend_for_sm90(config: ExtendConfig, d: int = 64, group: int = 8, cap: int = 0, window: bool = False,
                            sinks: bool = False, max_q_len: int = 8192, dtype: str = "bf16") -> Any:
    """Compile the portable extend kernel for an sm_90 target without a GPU (`common.build_for_sm90`), with the
    constexprs a plan of this shape takes under `config`; `cap` is the launch's HAS_CAP (0 none, 1 the exact tanh, 2
    the hardware's). For CI: the soft-cap's inline PTX cannot run in the interpreter, so its build is checked here."""
    consts = _consts(config, group, d, d, max_q_len, False)
    options = dict(num_warps=consts.pop("num_warps"), num_stages=consts.pop("num_stages"))
    consts.update(HAS_CAP=cap, HAS_WINDOW=window, HAS_SINKS=sinks, F32=False)
    sig = {n: "i32" for n in _extend_kernel.arg_names if n not in consts}   # strides and the window
    sig.update({n: f"*{dtype}" for n in ("q", "out", "k_buf", "v_buf")})
    sig.update(sinks="*fp32", tree_mask="*u8", tree_indptr="*i32", q_positions="*i64", kv_indptr="*i32",
               kv_indices="*i64", kv_pos0="*i64", qo_indptr="*i32", q_pos0="*i64", qk_scale="fp32", v_scale="fp32",
               cap="fp32")
    aligned = [n for n in sig if sig[n].startswith("*")] + ["s_qt", "s_qh", "s_kb", "s_kh", "s_vb", "s_vh", "s_ot",
                                                            "s_oh"]
    return build_for_sm90(_extend_kernel, sig, consts, aligned, options)
