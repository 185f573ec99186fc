"""extend_attention on Hopper (sm_90) in Gluon: FlashAttention-3's schedule over hwkv's paged key lists.

Same contract as `hwkv_cuda.kernels.extend` (q [T, H, D], keys listed per request by kv_indptr/kv_indices,
causal + window, GQA packed, sinks, soft-cap, K/V scales) for the plain features; the rest (fp8 K/V, verify
trees, Dv != D, fp32, other head dims, group sizes that are not powers of two) stays with the portable kernel.
On by default on sm_90 (HWKV_HOPPER_EXTEND=0 turns it off) for calls of at least MIN_TOKENS query tokens: on an
H200 it is 1.18-1.51x the portable kernel at D=64 and 1.58-1.70x at D=128 on causal prefills (docs/benchmarks.md,
fourteenth session). Window layers take 32-key tiles (WINDOW_CONFIGS: 1.30-1.34x the portable kernel at D=64, 1.90x
at D=128, W=128 over 8192, with the tiles tuned on Triton 3.6; other releases' tiles measured 1.03x and 1.73x).

Work items: NC consumer warpgroups (2 to 4) of 64 query rows each; an item is NC x BT consecutive query tokens
of one request times the GROUP q heads of one kv head (BT = 64 // GROUP tokens a consumer), rows ordered (token,
head), so one TMA box [BT, GROUP, D] of q (3-D descriptor over [T, H, D]) is exactly one consumer's rows. The
blocks end at the request's last token: a partial block is the request's first, the lightest, whose rows before
the request are loaded (the previous request's rows, or TMA's zero fill before the tensor) but never stored. Items
run kv head fastest, then request, then token block from the heaviest; a persistent grid of one program per SM
takes them in rounds, every other round in reverse order, so the programs' totals even out under the causal
triangle. Warp-specialised partitions of one warpgroup each:

  producer (default,     for every item: the item's six numbers (request bounds and positions) loaded an item
  the registers the      ahead; every key tile of BLOCK_N list entries: its slots loaded a tile ahead, then,
  consumers leave)       once the stage is free, K and V rows gathered (any page size, pages in any order) by
                         cp.async into the stage's NVMMA-swizzled buffers, each thread's
                         `cp.async.mbarrier.arrive.noinc` completing the stage's `ready` barrier (the tuned
                         D=64 tiles, `fence_lag` 1: each thread waits for its copies a tile behind, fences them
                         for the products and arrives itself, so no consumer fences); after the
                         item's first tile, each consumer's Q tile by TMA once that consumer has released the
                         previous one (`q_free`).
  consumer 0 .. NC-1     for every key tile j, in the built kernel's order (ptxas's, see below): issue S_j =
  (workers, setmaxnreg)  Q K_j^T (async wgmma), issue O += P_{j-1} V_{j-1} (async, P from registers; none for
                         the item's first tile, and the last tile's product runs after the loop), wait for S_j
                         (Q in shared memory is free after the item's last S; Q in registers was freed at the
                         item's start), mask it (soft-cap first; the mask only on tiles at the causal diagonal,
                         the window edge or the list end, the causal bound and the list end folded into one limit
                         a row: 8 x 1024 212.8 -> 206.7 us at D=64), wait for the PV product, free stage j-1, run
                         the softmax of S_j (the scale folded into the exponent's FFMA) and rescale. With
                         `sums_mma` the row sums are a third product, P_{j-1} times a K-major tile of ones, issued
                         with the PV product and rescaled with O, in place of the softmax's FADD reductions (the
                         D=64 and window tiles tuned on Triton 3.6; 8 x 1024 206.7 -> 201.0 us). The source waits
                         for the PV product and frees the stage after the softmax, FA3's overlap within a
                         warpgroup, but ptxas moves that wait to the top of its basic block, which starts after
                         the mask. A build that keeps it after the softmax (a block boundary between them)
                         measured 1-14% slower. So the overlap comes from the consumers' streams interleaving on
                         the SM: the softmax of one runs under another's products. An explicit ping-pong
                         (`pingpong`: the turns rotate among the consumers) measured slower, with two consumers
                         and with three or four (H100: 8 x 1024 206.3 against 202.9 us, W=128 103.9 against 92.2).
  epilogue               sinks folded into the denominator, O scaled by v_scale / l and stored by TMA from the
                         consumer's own O tile (its previous store waited for first) when all BT tokens belong
                         to the request, by masked stores otherwise (the first block's rows start before the
                         request: a box would overwrite the previous request's rows).

Tiles (H200 sweeps, `bench_hopper_extend.py --sweep`): D=64 takes 3 consumers x 64-key tiles at 152 registers, in 8
stages with the row sums on the tensor cores (Triton 3.6: 1 x 8192 causal 426-433 TFLOP/s), in 6 without them (other
releases; 425 against 393 for 2 consumers x 128 keys: a key tile serves 192 rows, and three warps a scheduler hide
each other's softmax; 2 consumers of 128 rows each measured 397); D=128 3 consumers x 64 keys in 4 stages (587
against 504). At
D=64 the softmax's exp2 (16 a clock an SM) takes as long as the products on the tensor cores, which is what keeps
both this kernel and cuDNN under half the dense peak. Built for sm_90 with Triton 3.6 and 3.9 without spills
(`compile_for_sm90`; the test reads the SASS), but for a few producer spill slots at D=128. Calls under MIN_TOKENS
query tokens keep the portable kernel (the TMA descriptors make this one's launch cost twice the host time).
"""
from __future__ import annotations

import functools
import re
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch
import triton

from hwkv.env import HWKV_HOPPER_EXTEND
from hwkv.errors import ConfigError
from hwkv_cuda.kernels.common import TANH_APPROX, as_scale, build_for_sm90, interpreting, num_sms, tanh_fp32
from hwkv_cuda.kernels.launch import launch

try:  # Gluon's Hopper API as of Triton 3.6; older or other builds simply keep the portable kernel
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    GLUON_ERROR: Optional[str] = None
except Exception as e:  # ImportError, or an API that moved (AttributeError)
    gluon = gl = None
    GLUON_ERROR = f"{type(e).__name__}: {e}"

ENV_FLAG = HWKV_HOPPER_EXTEND.name   # the switch, from hwkv.env's one table
ROWS = 64            # query rows (tokens x packed heads) per consumer warpgroup: one wgmma M
SUM_COLS = 8         # columns of ones the row sums' product takes (`sums_mma`): the narrowest wgmma N
HEAD_DIMS = (64, 128)
LOG2E_F = 1.4426950408889634


class HopperConfig(NamedTuple):
    block_n: int      # keys per tile
    stages: int       # K/V shared-memory stages
    consumer_regs: int = 224   # setmaxnreg of each consumer warpgroup; the producer (default partition) keeps the rest
    persistent: bool = True    # one program per SM walking the work items (False: one program per item)
    pingpong: bool = False     # the consumers take turns issuing their products, in rotation (FA3's ping-pong)
    q_regs: bool = False       # Q read into registers once per item (S = Q K^T from registers, not shared memory)
    consumers: int = 2         # consumer warpgroups (2 to 4) sharing each key tile: 64 query rows each
    sums_mma: bool = False     # the softmax's row sums by the tensor cores (P times an [8, keys] tile of ones)
    # the producer's gathers without row masks: rows past the list's end repeat its last slot (a real key, masked to
    # P = 0 by the consumers as the zero-filled rows were), so no predicate is formed per row and tile
    lean_gather: bool = False
    # the soft-cap's tanh by the hardware's approximation (tanh.approx.f32: one special-function op a score, relative
    # error below 2**-10.9) rather than the Triton kernels' exact form (an exp and a division a score); the dispatch's
    # tiles take it (see CONFIGS)
    fast_tanh: bool = False
    # the proxy fence (cp.async's writes before wgmma reads them) in the producer rather than in every consumer: each
    # producer thread commits a tile's copies as a group, waits for the group `fence_lag` tiles back, fences and
    # arrives for that tile (0: the consumers fence after their wait, the copies arriving on their own completion).
    # The D=64 tiles tuned on Triton 3.6 take lag 1 (H100, 9 interleaved rounds, us: 8 x 1024 200.5 against 203.4,
    # W=128 88.5 against 89.4 (window tile), 4 x 2048 over 2048 1,002.6 against 1,008.0, 1 x 8192 inside its spread);
    # lag 2 is no better and slower over a prefix; D=128 is 3-9% slower with it on causal cases, so keeps lag 0
    # (docs/benchmarks.md, thirty-fourth and thirty-fifth sessions)
    fence_lag: int = 0


PRODUCER_WARPS = 4
# H200 sweeps (docs/benchmarks.md). D=64: 3 consumers x 64 keys x 6 stages at 152 registers beat 2 consumers x 128 keys
# (the best two-consumer tile) by 7-11% on every causal case; 160 registers leave the producer too few (it spills).
# D=128: 3 consumers x 64 keys x 4 stages at 152 registers beat 2 x 64 keys at 208 by 8-16% on causal cases (5% slower
# at W=128, still 1.5x the portable kernel) although the producer spills a few values (17 local stores in the Triton 3.9
# build, 44 in the 3.6 build the H200 sweeps ran). Q in registers (eleventh session): D=64 8 x 1024 212.9-214.5 us
# against 221.6 (the producer loads the next item's Q while this one runs), the same on the other causal cases.
# Window layers (plans made with the list's window) take 32-key tiles: an item of NC x BT tokens over W + NC x BT - 1
# keys wastes less of its last tile. A window item is only ~5 tiles, so its fixed latencies (Q load, first gather,
# epilogue) weigh: Q in registers frees its buffer for the next item's load at once, and at D=64 four consumers of 104
# registers (the 32-key tile's accumulators fit) run four rows' chains at a time. H200, 1 x 8192 at W=128 (eleventh
# session, one request): D=64 97.7-97.9 us against 103.7-105.6 for 3 consumers without Q in registers and 121.6 for the
# portable kernel; D=128 (4 consumers spill there) 135.3-136.1 against 143.0 and 252.0. Head dims here take it.
# Register allocation differs between Triton releases: 3.6 (the H200's, where all of this was measured) builds the
# D=64 Q-in-registers tiles without spills (the D=128 window tile with 2 spill stores in a consumer, measured 5%
# faster all the same), 3.9 spills them all (3 local stores at D=64 causal, 53 in the four-consumer window tile, 96
# at D=128), so any other release keeps the tiles without Q in registers, which build clean on both.
# Row sums on the tensor cores (`sums_mma`, fourteenth session; interleaved A/B rounds, us): D=64 8 x 1024 201.0-203.1
# against 206.7-208.5, 1 x 8192 1,318 against 1,324-1,325, 4 x 2048 over 2048 1,021.6-1,024.8 against 1,020.8-1,036.7,
# W=128 91.2 against 92.8; D=128 W=128 129.8 against 131.9, but D=128 causal 1-3% slower (why not measured), so not
# there. The sums are of the bf16 P the PV product takes, not of the fp32 p: outputs move by up to one bf16 step (0.016
# at magnitude 2-4) against the portable kernel. Measured on the 3.6 tiles only: the other releases' tiles keep the
# FADD sums. With them, D=64 causal takes 8 stages (4 x 2048 over 2048 978.6 and 1,021.6 us against 999.0 and 1,036.7
# for 6, medians of two runs' interleaved rounds; the other cases the same or 0.1-0.6% faster).
# Soft-capped calls (twenty-third session, H100, cap 50, `bench_hopper_extend.py --cap 50 --config causal:fast_tanh=1
# --config window:fast_tanh=1`): the exact tanh made a capped call 3.6-4.3x an uncapped one and slower than the
# portable kernel on three of four D=64 cases; the hardware's tanh takes D=64 1 x 8192 from 5,380 to 1,730 us (the
# portable kernel 4,720), 4 x 2048 over 2048 4,231 -> 1,320, 8 x 1024 768 -> 263, W=128 258 -> 119 (portable 181);
# D=128 1 x 8192 5,971 -> 2,220 (portable 6,082), W=128 269 -> 148; the same largest difference from the portable
# kernel's exact form (0.0156, one bf16 step). Uncapped calls build the same kernel either way (CAP is 0).
_FAST = dict(fast_tanh=True)
_CLEAN = {64: HopperConfig(block_n=64, stages=6, consumer_regs=152, consumers=3, **_FAST),
          128: HopperConfig(block_n=64, stages=4, consumer_regs=152, consumers=3, **_FAST)}
_CLEAN_WINDOW = {64: HopperConfig(block_n=32, stages=8, consumer_regs=152, consumers=3, **_FAST),
                 128: HopperConfig(block_n=32, stages=4, consumer_regs=152, consumers=3, **_FAST)}
_TUNED = {64: _CLEAN[64]._replace(stages=8, q_regs=True, sums_mma=True, fence_lag=1), 128: _CLEAN[128]}
_TUNED_WINDOW = {64: _CLEAN_WINDOW[64]._replace(consumer_regs=104, q_regs=True, consumers=4, sums_mma=True,
                                                fence_lag=1),
                 128: _CLEAN_WINDOW[128]._replace(q_regs=True, sums_mma=True)}
TUNED_TRITON = (3, 6)


def _release(version: str) -> Optional[Tuple[int, int]]:
    """A Triton version's (major, minor): "3.6.0", "3.6+git1a2b" and "3.6rc1" are (3, 6); None where it starts
    with no such pair (such a build takes the untuned tiles)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


_RELEASE = _release(triton.__version__)
CONFIGS: Dict[int, HopperConfig] = _TUNED if _RELEASE == TUNED_TRITON else _CLEAN
WINDOW_CONFIGS: Dict[int, HopperConfig] = _TUNED_WINDOW if _RELEASE == TUNED_TRITON else _CLEAN_WINDOW
# Calls with fewer query tokens keep the portable kernel. Both launch directly (hwkv_cuda.kernels.launch), but the Gluon
# launch also builds two TMA descriptors and encodes their tensor maps: 32-57 us of host time per planned layer call on
# the H200 host against 17-31 (`bench_hopper_extend.py --host`, five runs: that host is noisy). Eager layer calls back
# to back (`--threshold`), where the host time shows: at 1024 tokens the Gluon kernel is as fast or faster at D=64
# and D=128 (1 x 1024: 38 against 41 us, 47 against 74; 4 x 256 over 1024: 66 against 73, 92 against 136), at 512
# slower (38 against 20 us at D=64).
MIN_TOKENS = 1024
# ... and window calls under min_window_tokens(D): a window call's device time grows by only 14-18 us per 1024 tokens
# (W=128), so the Gluon launch's extra host time (its eager floor is 30-63 us against the portable kernel's 19-36) is
# hidden only in long calls. Eager W=128 layer calls back to back (`bench_hopper_extend.py --threshold`, H200, twelfth
# session, Triton 3.6's window tiles), Gluon against portable: D=64 breaks even at 4096 tokens (1 x 4096 65.1 against
# 65.0 us, 4 x 1024 over 1024 61.3 against 65.6, 1 x 8192 98.6 against 122.2; at 2048 34-63 against 35); D=128 pays
# from 2048 (1 x 2048 52.0 against 70.8, 4 x 512 over 1024 52.9 against 71.0; at 1024 tokens 33-59 against 35-36).
MIN_WINDOW_TOKENS = 4096               # the default and the ceiling: 0 lifts every head dim's threshold
_WINDOW_TOKENS_BY_DIM = {128: 2048}    # head dims whose window calls pay sooner


def min_window_tokens(head_dim: int) -> int:
    """Query tokens from which a window call of this head dim takes the Gluon kernel (at most MIN_WINDOW_TOKENS, so
    lowering that constant lowers every head dim's)."""
    return min(MIN_WINDOW_TOKENS, _WINDOW_TOKENS_BY_DIM.get(head_dim, MIN_WINDOW_TOKENS))


if gluon is not None:
    _ROWS = gl.constexpr(ROWS)
    _SUM_COLS = gl.constexpr(SUM_COLS)
    _LOG2E = gl.constexpr(LOG2E_F)
    # Triton 3.6 names the copies async_copy_*; later releases renamed them async_load / async_store
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier   # renamed barrier after 3.6

    @gluon.jit
    def _item_index(i, n_items):
        """The i-th work item of this program: rounds of one item per program, the order reversed every other
        round (items come heaviest first, so each program's total evens out); n_items or more: none."""
        pid = gl.program_id(0)
        n_prog = gl.num_programs(0)
        return i * n_prog + pid + (i % 2) * (n_prog - 1 - 2 * pid)

    @gluon.jit
    def _item_loads(idx, kv_indptr, qo_indptr, kv_pos0, q_pos0, n_kvh, bs):
        """The six numbers work item idx reads (its request's q and kv bounds, positions): issued a whole item ahead
        of their use, so the loads' latency hides under the current item. Any idx >= 0 reads inside the batch."""
        b = (idx // n_kvh) % bs
        return (gl.load(qo_indptr + b), gl.load(qo_indptr + b + 1), gl.load(kv_indptr + b),
                gl.load(kv_indptr + b + 1), gl.load(q_pos0 + b), gl.load(kv_pos0 + b))

    @gluon.jit
    def _item(idx, loads, n_kvh, bs, window, TOKENS: gl.constexpr, BLOCK_N: gl.constexpr,
              HAS_WINDOW: gl.constexpr):
        """Work item idx (kv head fastest, then request, then token block from the heaviest) from its loads: its
        kv head, first token (negative in a request's first, partial block), the request's q_start, q_len, kv_start
        and rel0 (q position - list start), the key range [lo, hi) some stored row sees, its tile count and whether
        any of its tokens exist."""
        q_lo, q_hi, kv_lo, kv_hi, q_p0, kv_p0 = loads
        kvh = idx % n_kvh
        # positions and counts in int32 (a request's list and the batch's tokens stay below 2**31); pointer
        # offsets of slots are widened where they are formed
        q_start = q_lo.to(gl.int32)
        q_len = q_hi.to(gl.int32) - q_start
        kv_start = kv_lo.to(gl.int64)
        kv_len = (kv_hi.to(gl.int64) - kv_start).to(gl.int32)
        rel0 = (q_p0.to(gl.int64) - kv_p0.to(gl.int64)).to(gl.int32)
        # blocks end at the request's last token, so a partial block is its first (the lightest under the causal
        # triangle) and its rows before the request are loaded but never stored (H200: 1 x 8192 1,310 -> 1,280 us)
        first = q_len - (idx // n_kvh // bs + 1) * TOKENS
        last = gl.minimum(q_len, first + TOKENS) - 1
        lo = rel0 * 0
        if HAS_WINDOW:
            lo = gl.maximum(lo, rel0 + gl.maximum(first, 0) - window + 1)
        hi = gl.maximum(gl.minimum(kv_len, rel0 + last + 1), lo)
        n_tiles = (hi - lo + BLOCK_N - 1) // BLOCK_N
        return kvh, first, q_start, q_len, kv_start, rel0, lo, hi, n_tiles, last >= 0

    @gluon.jit
    def _load_q(q_desc, q_smem, q_ready, q_free, n_q, row, col):
        """TMA-load one consumer's Q tile once it has released the previous one."""
        mbarrier.wait(q_free, (n_q & 1) ^ 1)                    # first item: passes at once
        mbarrier.expect(q_ready, q_desc.block_type.nbytes)
        _tma_load(q_desc, [row, col, 0], q_ready, q_smem)

    @gluon.jit
    def _load_qs(q_desc, q0_smem, q1_smem, q2_smem, q3_smem, q_ready, q_free, n_q, row, col, BT: gl.constexpr,
                 NC: gl.constexpr):
        """Every consumer's Q tile of one item (consumer c's rows start BT * c tokens in)."""
        _load_q(q_desc, q0_smem, q_ready.index(0), q_free.index(0), n_q, row, col)
        _load_q(q_desc, q1_smem, q_ready.index(1), q_free.index(1), n_q, row + BT, col)
        if NC >= 3:
            _load_q(q_desc, q2_smem, q_ready.index(2), q_free.index(2), n_q, row + 2 * BT, col)
        if NC == 4:
            _load_q(q_desc, q3_smem, q_ready.index(3), q_free.index(3), n_q, row + 3 * BT, col)

    @gluon.jit
    def _copies_done(ready, done, upto, STAGES: gl.constexpr):
        """The producer's fence (`HopperConfig.fence_lag`): this thread's copies of tiles done .. upto - 1 have
        landed; fence them for the consumers' products and complete those tiles' stages. Returns upto."""
        fence_async_shared()
        for t in range(done, upto):
            mbarrier.arrive(ready.index(t % STAGES), count=1)
        return upto

    @gluon.jit
    def _producer(shared, n_kvh: gl.constexpr, WARPS: gl.constexpr, HAS_WINDOW: gl.constexpr, NC: gl.constexpr,
                  LEAN: gl.constexpr, LAG: gl.constexpr, Q_REGS: gl.constexpr):
        """For every item: every consumer's Q tile (TMA, after the item's first key tile), then every key tile's
        K and V rows gathered into the ring of stages (cp.async, 16 bytes a thread; any page size, pages in any
        order), each tile's slots loaded one tile ahead so the gather never waits on them."""
        (q_desc, o_desc, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, qo_indptr, q_pos0, q0_smem, q1_smem, q2_smem,
         q3_smem, o0_smem, o1_smem, o2_smem, o3_smem, q_ready, q_free, k_smem, v_smem, ready, empty, turns, out, sinks,
         bs, n_items, window, s_kb, s_kh, s_vb, s_vh, s_ot, s_oh, qk_scale, v_scale, cap, ones_smem) = shared
        STAGES: gl.constexpr = k_smem.shape[0]
        BLOCK_N: gl.constexpr = k_smem.shape[1]
        GROUP: gl.constexpr = q0_smem.shape[1]
        D: gl.constexpr = q0_smem.shape[2]
        BT: gl.constexpr = _ROWS // GROUP
        vec: gl.constexpr = 8                       # 16-byte vectors of 2-byte elements
        tpw_d: gl.constexpr = D // vec if D // vec < 32 else 32
        layout: gl.constexpr = gl.BlockedLayout([1, vec], [32 // tpw_d, tpw_d], [WARPS, 1], [1, 0])
        rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
        it = 0
        done = 0   # with LAG: the tiles whose copies this program has fenced and arrived for
        n_q = 0
        loads = _item_loads(_item_index(0, n_items), kv_indptr, qo_indptr, kv_pos0, q_pos0, n_kvh, bs)
        for i in range((n_items + gl.num_programs(0) - 1) // gl.num_programs(0)):
            idx = _item_index(i, n_items)
            cur = loads
            loads = _item_loads(_item_index(i + 1, n_items), kv_indptr, qo_indptr, kv_pos0, q_pos0, n_kvh, bs)
            if idx < n_items:
                kvh, first, q_start, q_len, kv_start, rel0, lo, hi, n_tiles, active = _item(
                    idx, cur, n_kvh, bs, window, NC * BT, BLOCK_N, HAS_WINDOW)
                if active:
                    k_head = k_buf + kvh * s_kh + cols[None, :]
                    v_head = v_buf + kvh * s_vh + cols[None, :]
                    span = hi - lo
                    lst = kv_indices + kv_start + lo
                    # slots held as int32 (a pool below 2**31 tokens) and widened where an address is formed: the
                    # producer lives on the registers the consumers leave
                    last = span - 1
                    if LEAN:   # rows past the end repeat the last slot (an empty list loads nothing)
                        slot = gl.load(lst + gl.minimum(rows, last), mask=rows < span + (span > 0) * BLOCK_N,
                                       other=0).to(gl.int32)
                    else:
                        slot = gl.load(lst + rows, mask=rows < span, other=0).to(gl.int32)
                    for j in range(n_tiles):
                        offs = j * BLOCK_N + rows
                        if LEAN:
                            nxt = gl.load(lst + gl.minimum(offs + BLOCK_N, last)).to(gl.int32)
                        else:
                            nxt = gl.load(lst + offs + BLOCK_N, mask=offs + BLOCK_N < span, other=0).to(gl.int32)
                        stage = it % STAGES
                        mbarrier.wait(empty.index(stage), ((it // STAGES) & 1) ^ 1)   # first round: at once
                        slot64 = slot.to(gl.int64)
                        if LEAN:
                            _cp_async(k_smem.index(stage), k_head + (slot64 * s_kb)[:, None])
                            _cp_async(v_smem.index(stage), v_head + (slot64 * s_vb)[:, None])
                        else:
                            ok = offs < span
                            # masked rows are zero-filled (src-size 0): finite values under P = 0
                            _cp_async(k_smem.index(stage), k_head + (slot64 * s_kb)[:, None], mask=ok[:, None])
                            _cp_async(v_smem.index(stage), v_head + (slot64 * s_vb)[:, None], mask=ok[:, None])
                        if LAG > 0:   # this thread's copies of the tile LAG back are done: fence, then arrive
                            async_copy.commit_group()
                            if it + 1 - LAG > done:
                                async_copy.wait_group(LAG)
                                done = _copies_done(ready, done, it + 1 - LAG, STAGES)
                        else:
                            async_copy.mbarrier_arrive(ready.index(stage), increment_count=False)
                        slot = nxt
                        it += 1
                        if j == 0:
                            # consumers holding Q in shared memory free it after their previous item's last
                            # product: that item's tiles must reach them first, or the Q load below waits on itself
                            if (LAG > 1) & (not Q_REGS):
                                async_copy.wait_group(1)
                                done = _copies_done(ready, done, it - 1, STAGES)
                            _load_qs(q_desc, q0_smem, q1_smem, q2_smem, q3_smem, q_ready, q_free, n_q, q_start + first,
                                     kvh * GROUP, BT, NC)
                    if n_tiles == 0:
                        if (LAG > 0) & (not Q_REGS):   # as above, with no tile of this item in flight
                            async_copy.wait_group(0)
                            done = _copies_done(ready, done, it, STAGES)
                        _load_qs(q_desc, q0_smem, q1_smem, q2_smem, q3_smem, q_ready, q_free, n_q, q_start + first,
                                 kvh * GROUP, BT, NC)
                    n_q += 1
        if LAG > 0:   # the tiles still held back
            async_copy.wait_group(0)
            _copies_done(ready, done, it, STAGES)

    @gluon.jit
    def _softmax_tile(s, m, l_sum, start, hi, q_rel, lo_all, hi_all, qk_scale, cap, window,
                      HAS_CAP: gl.constexpr, HAS_WINDOW: gl.constexpr, BLOCK_N: gl.constexpr,
                      s_layout: gl.constexpr, SUM: gl.constexpr = True):
        """Fold one tile's raw logits into (m, l): returns (m_new, p, alpha, l_new) in log2 units (SUM off: l as
        given, the row sums made elsewhere). The visibility mask (list end, causal bound, window) is applied only
        where some row needs it."""
        if HAS_CAP == 2:   # the hardware's tanh (see HopperConfig.fast_tanh)
            s = gl.inline_asm_elementwise(TANH_APPROX, "=f,f", [s * (qk_scale / cap)], dtype=gl.float32, is_pure=True,
                                          pack=1) * cap
            c = _LOG2E
        elif HAS_CAP:
            s = tanh_fp32(s * (qk_scale / cap)) * cap   # the Triton kernels' tanh (a tl jit function inlines here)
            c = _LOG2E
        else:
            c = qk_scale * _LOG2E     # > 0: the raw row max scales to the logits' max; s * c - m is one FFMA
        needs_mask = start + BLOCK_N > hi_all
        if HAS_WINDOW:
            needs_mask = needs_mask | (start < lo_all)
        if needs_mask:
            ar = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            dq = (q_rel - start).to(gl.int32)          # int32 offsets inside the tile
            # the causal bound and the list end folded into one limit a row: one compare and one select an element
            vis = ar[None, :] < gl.minimum(dq + 1, (hi - start).to(gl.int32))[:, None]
            if HAS_WINDOW:
                vis = vis & (ar[None, :] > dq[:, None] - window)
            s = gl.where(vis, s, float("-inf"))
        m_new = gl.maximum(m, gl.max(s, 1) * c)
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(s * c - m_new[:, None])
        if SUM:
            l_sum = l_sum * alpha + gl.sum(p, 1)
        return m_new, p, alpha, l_sum

    @gluon.jit
    def _epilogue(acc, m, l_sum, o_smem, o_desc, out, sinks, q_start, q_len, first, kvh, s_ot, s_oh, v_scale,
                  GROUP: gl.constexpr, BT: gl.constexpr, D: gl.constexpr, HAS_SINKS: gl.constexpr,
                  o_layout: gl.constexpr):
        """Sinks into the denominator, O = acc * v_scale / l, stored by TMA from this consumer's O tile (its
        previous store waited for first) when all BT tokens are the request's, by masked stores otherwise (a
        TMA box would overwrite the next request's rows)."""
        dtype: gl.constexpr = o_desc.dtype
        ro = gl.arange(0, _ROWS, layout=gl.SliceLayout(1, o_layout))
        head = kvh * GROUP + ro % GROUP
        tok = first + ro // GROUP
        if HAS_SINKS:
            sink = gl.load(sinks + head).to(gl.float32) * _LOG2E
            m_o = gl.convert_layout(m, gl.SliceLayout(1, o_layout))
            l_o = gl.convert_layout(l_sum, gl.SliceLayout(1, o_layout))
            m_fin = gl.maximum(m_o, sink)
            l_o = l_o * gl.exp2(m_o - m_fin) + gl.exp2(sink - m_fin)
            acc = acc * gl.exp2(m_o - m_fin)[:, None]
        else:
            l_o = gl.convert_layout(l_sum, gl.SliceLayout(1, o_layout))
        o = (acc * (v_scale / gl.where(l_o > 0, l_o, 1.0))[:, None]).to(dtype)
        if (first >= 0) & (first + BT <= q_len):
            tma.store_wait(0)
            o_smem.reshape([_ROWS, D]).store(o)
            fence_async_shared()
            _tma_store(o_desc, [(q_start + first).to(gl.int32), kvh * GROUP, 0], o_smem)
        else:
            cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
            ptrs = out + ((q_start + tok).to(gl.int64) * s_ot + head * s_oh)[:, None] + cols[None, :]
            gl.store(ptrs, o, mask=((tok >= 0) & (tok < q_len))[:, None])

    @gluon.jit
    def _turn(turns, n_b, C: gl.constexpr, PINGPONG: gl.constexpr):
        """Ping-pong: wait until it is consumer C's turn to issue its products (consumer 0 goes first, the turns
        rotate 0, 1, .., NC - 1)."""
        if PINGPONG:
            mbarrier.wait(turns.index(C), (n_b & 1) ^ (1 if C == 0 else 0))

    @gluon.jit
    def _pass(turns, n_b, C: gl.constexpr, PINGPONG: gl.constexpr):
        """Ping-pong: hand the tensor cores to the next consumer; returns the count of turns taken."""
        if PINGPONG:
            mbarrier.arrive(turns.index((C + 1) % turns.shape[0]), count=1)
        return n_b + 1

    @gluon.jit
    def _consumer(C: gl.constexpr, shared, n_kvh: gl.constexpr, HAS_CAP: gl.constexpr, HAS_WINDOW: gl.constexpr,
                  HAS_SINKS: gl.constexpr, PINGPONG: gl.constexpr, Q_REGS: gl.constexpr, NC: gl.constexpr,
                  SUMS_MMA: gl.constexpr, LAG: gl.constexpr):
        """Consumer C's 64 query rows of every item (tokens first + C * BT .. + BT - 1, all GROUP heads), in its own
        Q and O tiles: see the module doc."""
        (q_desc, o_desc, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, qo_indptr, q_pos0, q0_smem, q1_smem, q2_smem,
         q3_smem, o0_smem, o1_smem, o2_smem, o3_smem, q_ready_all, q_free_all, k_smem, v_smem, ready, empty, turns, out,
         sinks, bs, n_items, window, s_kb, s_kh, s_vb, s_vh, s_ot, s_oh, qk_scale, v_scale, cap,
         ones_smem) = shared
        STAGES: gl.constexpr = k_smem.shape[0]
        BLOCK_N: gl.constexpr = k_smem.shape[1]
        GROUP: gl.constexpr = q0_smem.shape[1]
        D: gl.constexpr = q0_smem.shape[2]
        q_ready = q_ready_all.index(C)
        q_free = q_free_all.index(C)
        if C == 0:
            q_smem = q0_smem
            o_smem = o0_smem
        elif C == 1:
            q_smem = q1_smem
            o_smem = o1_smem
        elif C == 2:
            q_smem = q2_smem
            o_smem = o2_smem
        else:
            q_smem = q3_smem
            o_smem = o3_smem
        BT: gl.constexpr = _ROWS // GROUP
        dtype: gl.constexpr = q_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        l_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, _SUM_COLS, 16])
        pl_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=l_layout, k_width=2)
        q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        q_tile = q_smem.reshape([_ROWS, D])
        r = gl.arange(0, _ROWS, layout=gl.SliceLayout(1, s_layout))
        s_zero = gl.zeros([_ROWS, BLOCK_N], gl.float32, layout=s_layout)
        p = gl.zeros([_ROWS, BLOCK_N], dtype, layout=p_layout)
        it = 0
        n_q = 0
        n_b = 0
        loads = _item_loads(_item_index(0, n_items), kv_indptr, qo_indptr, kv_pos0, q_pos0, n_kvh, bs)
        for i in range((n_items + gl.num_programs(0) - 1) // gl.num_programs(0)):
            idx = _item_index(i, n_items)
            cur = loads
            loads = _item_loads(_item_index(i + 1, n_items), kv_indptr, qo_indptr, kv_pos0, q_pos0, n_kvh, bs)
            if idx < n_items:
                kvh, first, q_start, q_len, kv_start, rel0, lo, hi, n_tiles, active = _item(
                    idx, cur, n_kvh, bs, window, NC * BT, BLOCK_N, HAS_WINDOW)
                if active:
                    first = first + C * BT
                    q_rel = rel0 + first + r // GROUP               # list position of each row's token
                    last = gl.minimum(q_len, first + BT) - 1
                    hi_all = gl.minimum(hi, rel0 + gl.maximum(first, 0) + 1)   # keys every stored row sees
                    lo_all = rel0 + last - window + 1
                    m = gl.full([_ROWS], -1.0e30, gl.float32, layout=gl.SliceLayout(1, s_layout))
                    l_sum = gl.zeros([_ROWS], gl.float32, layout=gl.SliceLayout(1, s_layout))
                    acc = gl.zeros([_ROWS, D], gl.float32, layout=o_layout)
                    l_acc = gl.zeros([_ROWS, _SUM_COLS], gl.float32, layout=l_layout)
                    mbarrier.wait(q_ready, n_q & 1)
                    if Q_REGS:
                        q_op = q_tile.load(q_layout)
                        mbarrier.arrive(q_free, count=1)
                    else:
                        q_op = q_tile
                    for j in range(n_tiles):
                        stage = it % STAGES
                        mbarrier.wait(ready.index(stage), (it // STAGES) & 1)
                        if LAG == 0:
                            fence_async_shared()   # cp.async wrote the stage through the generic proxy; wgmma reads it
                        start = lo + j * BLOCK_N
                        _turn(turns, n_b, C, PINGPONG)
                        s_tok = warpgroup_mma(q_op, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False,
                                              is_async=True)
                        if j > 0:
                            prev = (it + STAGES - 1) % STAGES
                            o_tok = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
                            if SUMS_MMA:   # P_{j-1} 1 beside P_{j-1} V_{j-1} (the layout change moves no data)
                                p_l = gl.convert_layout(p, pl_layout)
                                l_tok = warpgroup_mma(p_l, ones_smem.permute((1, 0)), l_acc, is_async=True)
                                n_b = _pass(turns, n_b, C, PINGPONG)
                                s = warpgroup_mma_wait(2, deps=(s_tok, ))
                            else:
                                n_b = _pass(turns, n_b, C, PINGPONG)
                                s = warpgroup_mma_wait(1, deps=(s_tok, ))      # S_j done; P_{j-1} V_{j-1} running
                            if not Q_REGS:
                                mbarrier.arrive(q_free, count=1, pred=j == n_tiles - 1)
                            m, p32, alpha, l_sum = _softmax_tile(s, m, l_sum, start, hi, q_rel, lo_all, hi_all,
                                                                 qk_scale, cap, window, HAS_CAP, HAS_WINDOW, BLOCK_N,
                                                                 s_layout, not SUMS_MMA)
                            # p's registers feed the running PV product: a dependency until the product is done
                            if SUMS_MMA:
                                acc, l_acc, p, p_l = warpgroup_mma_wait(0, deps=(o_tok, l_tok, p, p_l))
                            else:
                                acc, p = warpgroup_mma_wait(0, deps=(o_tok, p))
                            mbarrier.arrive(empty.index(prev), count=1)
                        else:
                            n_b = _pass(turns, n_b, C, PINGPONG)
                            s = warpgroup_mma_wait(0, deps=(s_tok, ))
                            if not Q_REGS:
                                mbarrier.arrive(q_free, count=1, pred=n_tiles == 1)
                            m, p32, alpha, l_sum = _softmax_tile(s, m, l_sum, start, hi, q_rel, lo_all, hi_all,
                                                                 qk_scale, cap, window, HAS_CAP, HAS_WINDOW, BLOCK_N,
                                                                 s_layout, not SUMS_MMA)
                        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
                        if SUMS_MMA:
                            l_acc = l_acc * gl.convert_layout(alpha, gl.SliceLayout(1, l_layout))[:, None]
                        p = gl.convert_layout(p32.to(dtype), p_layout)
                        it += 1
                    if n_tiles > 0:
                        last_stage = (it + STAGES - 1) % STAGES
                        _turn(turns, n_b, C, PINGPONG)
                        o_tok = warpgroup_mma(p, v_smem.index(last_stage), acc, is_async=True)
                        if SUMS_MMA:
                            p_l = gl.convert_layout(p, pl_layout)
                            l_tok = warpgroup_mma(p_l, ones_smem.permute((1, 0)), l_acc, is_async=True)
                            n_b = _pass(turns, n_b, C, PINGPONG)
                            acc, l_acc, p, p_l = warpgroup_mma_wait(0, deps=(o_tok, l_tok, p, p_l))
                        else:
                            n_b = _pass(turns, n_b, C, PINGPONG)
                            acc, p = warpgroup_mma_wait(0, deps=(o_tok, p))
                        mbarrier.arrive(empty.index(last_stage), count=1)
                    elif not Q_REGS:
                        mbarrier.arrive(q_free, count=1)
                    n_q += 1
                    if SUMS_MMA:   # every column holds the row's sum
                        l_sum = gl.convert_layout(gl.max(l_acc, 1), gl.SliceLayout(1, s_layout))
                    _epilogue(acc, m, l_sum, o_smem, o_desc, out, sinks, q_start, q_len, first, kvh, s_ot, s_oh,
                              v_scale, GROUP, BT, D, HAS_SINKS, o_layout)
        tma.store_wait(0)

    # a batch's scalars (window, work-item counts) are not specialised on: the JIT would compile, and a planned launch
    # (hwkv_cuda.kernels.launch) would plan, one variant per value that turns 1 or a multiple of 16. The kv-head count
    # (fixed per model) is a constexpr, and ONE_REQ (a batch of one request) a second variant at most: each removes
    # runtime divisions from every item's index math, and a one-request batch's bounds load from fixed addresses
    # (H200, 1 x 8192 at W=128, D=64: 104 us against 116 in A/B runs of kernel variants, docs/benchmarks.md).
    @gluon.jit(do_not_specialize=["window", "bs", "n_items"])
    def _hopper_extend_kernel(q_desc, o_desc, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, qo_indptr, q_pos0,
                              sinks, out, qk_scale, v_scale, cap, window, s_kb, s_kh, s_vb, s_vh, s_ot, s_oh,
                              bs, n_items, n_kvh: gl.constexpr, GROUP: gl.constexpr, D: gl.constexpr,
                              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_CAP: gl.constexpr,
                              HAS_WINDOW: gl.constexpr, HAS_SINKS: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
                              CONSUMER_REGS: gl.constexpr, PINGPONG: gl.constexpr, Q_REGS: gl.constexpr,
                              NC: gl.constexpr, ONE_REQ: gl.constexpr, SUMS_MMA: gl.constexpr,
                              LEAN: gl.constexpr = False, FAST_TANH: gl.constexpr = False,
                              FENCE_LAG: gl.constexpr = 0):
        if ONE_REQ:     # one request: a compile-time batch size (every item's bounds load from fixed addresses)
            bs = gl.constexpr(1)
        dtype: gl.constexpr = q_desc.dtype
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], dtype)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], kv_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], kv_layout)
        q0_smem = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
        q1_smem = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
        o0_smem = gl.allocate_shared_memory(dtype, o_desc.block_type.shape, o_desc.layout)
        o1_smem = gl.allocate_shared_memory(dtype, o_desc.block_type.shape, o_desc.layout)
        if NC >= 3:
            q2_smem = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
            o2_smem = gl.allocate_shared_memory(dtype, o_desc.block_type.shape, o_desc.layout)
        else:
            q2_smem = q1_smem
            o2_smem = o1_smem
        if NC == 4:
            q3_smem = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
            o3_smem = gl.allocate_shared_memory(dtype, o_desc.block_type.shape, o_desc.layout)
        else:
            q3_smem = q2_smem
            o3_smem = o2_smem
        if SUMS_MMA:   # the row sums' right-hand side, every key counted once: K-major like a key tile (an N-major
            #            [BLOCK_N, 8] tile gave wrong sums with 128-key tiles, unexplained; this form passes)
            ones_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_SUM_COLS, BLOCK_N], dtype)
            ones_smem = gl.allocate_shared_memory(dtype, [_SUM_COLS, BLOCK_N], ones_layout)
            ones_smem.store(gl.full([_SUM_COLS, BLOCK_N], 1.0, dtype,
                                    layout=gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])))
            fence_async_shared()
            _cta_barrier()
        else:
            ones_smem = k_smem   # unused
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [NC, 1], mbarrier.MBarrierLayout())
        q_free = gl.allocate_shared_memory(gl.int64, [NC, 1], mbarrier.MBarrierLayout())
        turns = gl.allocate_shared_memory(gl.int64, [NC, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            # one noinc arrive per producer thread, or with FENCE_LAG one arrive (after the producer's barrier)
            mbarrier.init(ready.index(i), count=1 if FENCE_LAG > 0 else PRODUCER_WARPS * 32)
            mbarrier.init(empty.index(i), count=NC)                    # one arrive per consumer
        for i in gl.static_range(NC):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_free.index(i), count=1)
        for i in gl.static_range(NC):
            mbarrier.init(turns.index(i), count=1)

        # the producer runs in the default partition (it gets the registers the consumers leave). Gluon takes the
        # partitions as one literal list, hence one call per consumer count; the partitions share one tuple of
        # values. Constexprs travel outside it: in a tuple handed to a partition they arrive as plain constants
        # (which still fold, as ONE_REQ's bs does) that cannot shape a layout or a static branch
        CAP: gl.constexpr = HAS_CAP * (1 + FAST_TANH)   # 0: no cap, 1: the exact tanh, 2: the hardware's
        shared = (q_desc, o_desc, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, qo_indptr, q_pos0, q0_smem, q1_smem,
                  q2_smem, q3_smem, o0_smem, o1_smem, o2_smem, o3_smem, q_ready, q_free, k_smem, v_smem, ready, empty,
                  turns, out, sinks, bs, n_items, window, s_kb, s_kh, s_vb, s_vh, s_ot, s_oh, qk_scale, v_scale,
                  cap, ones_smem)
        if NC == 4:
            gl.warp_specialize([(_producer, (shared, n_kvh, PRODUCER_WARPS, HAS_WINDOW, NC, LEAN, FENCE_LAG, Q_REGS)),
                                (_consumer, (0, shared, n_kvh, CAP, HAS_WINDOW, HAS_SINKS, PINGPONG, Q_REGS, NC,
                                              SUMS_MMA, FENCE_LAG)),
                                (_consumer, (1, shared, n_kvh, CAP, HAS_WINDOW, HAS_SINKS, PINGPONG, Q_REGS, NC,
                                              SUMS_MMA, FENCE_LAG)),
                                (_consumer, (2, shared, n_kvh, CAP, HAS_WINDOW, HAS_SINKS, PINGPONG, Q_REGS, NC,
                                              SUMS_MMA, FENCE_LAG)),
                                (_consumer, (3, shared, n_kvh, CAP, HAS_WINDOW, HAS_SINKS, PINGPONG, Q_REGS, NC,
                                              SUMS_MMA, FENCE_LAG))],
                               [4, 4, 4, 4], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS])
        elif NC == 3:
            gl.warp_specialize([(_producer, (shared, n_kvh, PRODUCER_WARPS, HAS_WINDOW, NC, LEAN, FENCE_LAG, Q_REGS)),
                                (_consumer, (0, shared, n_kvh, CAP, HAS_WINDOW, HAS_SINKS, PINGPONG, Q_REGS, NC,
                                              SUMS_MMA, FENCE_LAG)),
                                (_consumer, (1, shared, n_kvh, CAP, HAS_WINDOW, HAS_SINKS, PINGPONG, Q_REGS, NC,
                                              SUMS_MMA, FENCE_LAG)),
                                (_consumer, (2, shared, n_kvh, CAP, HAS_WINDOW, HAS_SINKS, PINGPONG, Q_REGS, NC,
                                              SUMS_MMA, FENCE_LAG))],
                               [4, 4, 4], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS])
        else:
            gl.warp_specialize([(_producer, (shared, n_kvh, PRODUCER_WARPS, HAS_WINDOW, NC, LEAN, FENCE_LAG, Q_REGS)),
                                (_consumer, (0, shared, n_kvh, CAP, HAS_WINDOW, HAS_SINKS, PINGPONG, Q_REGS, NC,
                                              SUMS_MMA, FENCE_LAG)),
                                (_consumer, (1, shared, n_kvh, CAP, HAS_WINDOW, HAS_SINKS, PINGPONG, Q_REGS, NC,
                                              SUMS_MMA, FENCE_LAG))],
                               [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


# ----------------------------------------------------------------------------------------------- host side
class HopperPlan(NamedTuple):
    """A planned launch of the Gluon kernel: its work items, programs, constexprs and TMA box."""

    blocks: int                            # token blocks of NC x BT tokens (one item) in the longest request
    programs: int                          # persistent: one per SM (0: one per work item)
    windows: bool                          # planned for window calls (WINDOW_CONFIGS' tiles); others take only causal
    consts: Dict[str, Any]
    block: Tuple[int, int, int]            # the Q/O TMA box: [BT tokens, GROUP heads, D]
    key: Tuple[Any, ...]                   # what fixes its launches but the grid and the feature flags (`_LAUNCHES`)

    @property
    def kv_heads(self) -> int:
        """The kv-head count the kernel is compiled for (its constexpr `n_kvh`): a request's items are kv heads x
        blocks."""
        return self.consts["n_kvh"]


# planned launches of the Gluon kernel (hwkv_cuda.kernels.launch: the compiled launcher called directly, not the JIT)
_LAUNCHES: Dict[Any, Any] = {}


def requested() -> bool:
    """On by default (faster than the portable kernel wherever it applies on an H200); HWKV_HOPPER_EXTEND=0 keeps
    the portable kernel."""
    return HWKV_HOPPER_EXTEND.get()


def takes_window(head_dim: int) -> bool:
    """Whether window layers of this head dim take the Gluon kernel: where a window tile config is recorded, faster
    than the portable kernel there (H200, W=128 over 8192: D=64 1.30-1.34x, D=128 1.90x with Triton 3.6's tiles; the
    tiles other releases take measured 1.03x and 1.73x)."""
    return head_dim in WINDOW_CONFIGS


@functools.lru_cache(maxsize=None)
def _sm90(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] == 9


def unsupported(q: Any, k_buf: Any, v_buf: Any, out: Any, max_q_len: int, has_tree: bool = False) -> Optional[str]:
    """Why this call keeps the portable kernel (None: the Gluon kernel applies). Features handled per call
    (soft-cap, sinks, window, K/V scales) are supported; see the module doc for the rest."""
    if GLUON_ERROR is not None:
        return f"Gluon's Hopper API is not importable ({GLUON_ERROR})"
    if interpreting() or q.device.type != "cuda":
        return "not a CUDA device (or the Triton interpreter)"
    if not _sm90(q.device.index if q.device.index is not None else torch.cuda.current_device()):
        return "not an sm_90 (Hopper) NVIDIA GPU"
    if q.dtype not in (torch.bfloat16, torch.float16) or {k_buf.dtype, v_buf.dtype, out.dtype} != {q.dtype}:
        return f"dtypes q {q.dtype}, k {k_buf.dtype}, v {v_buf.dtype}, out {out.dtype} (bf16/fp16 throughout only)"
    t, h, d = q.shape
    kvh = k_buf.shape[1]
    group = h // kvh
    if d not in CONFIGS or v_buf.shape[2] != d:
        return f"head dims D={d}, Dv={v_buf.shape[2]} (D = Dv in {HEAD_DIMS} only)"
    if group & (group - 1) or group > ROWS:
        return f"{group} q heads per kv head (a power of two <= {ROWS} only)"
    if has_tree:
        return "a verify tree"
    if max_q_len < 2 * (ROWS // group):
        return f"at most {max_q_len} query tokens per request (< {2 * (ROWS // group)}, two consumers' rows)"
    if any(s % 16 for s in (k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1))):
        return "K/V buffer strides not multiples of 16 elements"
    return None


def plan_hopper_extend(q: Any, k_buf: Any, v_buf: Any, out: Any, max_q_len: int, has_tree: bool = False,
                       window: Optional[int] = None) -> Optional[HopperPlan]:
    """The Gluon kernel's plan for these shapes (`window`: a window layer's, WINDOW_CONFIGS' tiles), or None (turned
    off, fewer than MIN_TOKENS query tokens, or min_window_tokens(D) for a window layer, a window layer's head dim
    without a window config, or `unsupported`)."""
    if q.shape[0] < MIN_TOKENS or not requested() or unsupported(q, k_buf, v_buf, out, max_q_len, has_tree):
        return None
    t, h, d = q.shape
    if window and (not takes_window(d) or t < min_window_tokens(d)):
        return None
    cfg = WINDOW_CONFIGS[d] if window else CONFIGS[d]
    return _plan(h // k_buf.shape[1], k_buf.shape[1], d, int(max_q_len), cfg, q.device, bool(window))


def _plan(group: int, kv_heads: int, d: int, max_q_len: int, cfg: HopperConfig, device: Any,
          windows: bool = False) -> HopperPlan:
    """The plan under tile config `cfg` (the benchmark's sweep builds its own); `windows`: for window calls."""
    bt = ROWS // group
    programs = num_sms(device) if cfg.persistent else 0
    consts = dict(_consts(group, d, cfg, kv_heads), num_warps=4)
    return HopperPlan(-(-max_q_len // (cfg.consumers * bt)), programs, windows, consts, (bt, group, d),
                      tuple(consts.items()))


def _consts(group: int, d: int, cfg: HopperConfig, kv_heads: int) -> Dict[str, Any]:
    """The kernel's constexprs under tile config `cfg` but the per-call feature flags (a launch and the CPU build); the
    kv-head count is one (fixed per model: the work items' index math divides by it)."""
    if cfg.consumers not in (2, 3, 4):   # the kernel has a partition list for each of these only
        raise ConfigError(f"consumers={cfg.consumers}: the Gluon extend kernel takes 2, 3 or 4 consumer warpgroups")
    if not 0 <= cfg.fence_lag < cfg.stages:   # the producer holds back at most stages - 1 tiles, or it waits on itself
        raise ConfigError(f"fence_lag={cfg.fence_lag}: the producer's fence takes 0 to stages - 1 = {cfg.stages - 1}")
    return dict(n_kvh=kv_heads, GROUP=group, D=d, BLOCK_N=cfg.block_n, STAGES=cfg.stages, PRODUCER_WARPS=PRODUCER_WARPS,
                CONSUMER_REGS=cfg.consumer_regs, PINGPONG=cfg.pingpong, Q_REGS=cfg.q_regs,
                NC=cfg.consumers, SUMS_MMA=cfg.sums_mma, LEAN=cfg.lean_gather,
                FAST_TANH=cfg.fast_tanh, FENCE_LAG=cfg.fence_lag)


@functools.lru_cache(maxsize=None)
def _box_layout(bf16: bool, block: Tuple[int, int, int]) -> Any:
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16 if bf16 else gl.float16)


_FIELDS = ("base", "shape", "strides", "block_shape", "layout")   # what a call gives; any later field keeps its default


def _unchecked_type() -> Any:
    """Gluon's TensorDescriptor without its validation at every construction, where its fields are the ones known
    (the five a call gives, then only fields with defaults: padding, and round_f32_to_tf32 from Triton 3.9), else
    TensorDescriptor itself. run_hopper_extend checks what that validation would (16-byte aligned bases, 16-byte
    strides, a contiguous last dim, a non-empty q) before it makes one, and the plan's box is a valid one; the
    validation is half of a descriptor's host time or more (4.2-6 -> 1.6-2.6 us a descriptor on a slow host core)."""
    import dataclasses
    if gluon is None:   # no Gluon: nothing launches the kernel (unsupported() says why)
        return None
    fields = dataclasses.fields(TensorDescriptor)
    rest = fields[len(_FIELDS):]
    if (tuple(f.name for f in fields[:len(_FIELDS)]) != _FIELDS
            or any(f.default is dataclasses.MISSING for f in rest)):
        return TensorDescriptor
    defaults = tuple((f.name, f.default) for f in rest)

    class Unchecked(TensorDescriptor):
        def __init__(self, base: Any, shape: Any, strides: Any, block_shape: Any, layout: Any) -> None:
            self.base, self.shape, self.strides = base, shape, strides
            self.block_shape, self.layout = block_shape, layout
            for name, value in defaults:
                setattr(self, name, value)
    return Unchecked


_DESCRIPTOR = _unchecked_type()


def _descriptor(x: Any, block: Tuple[int, int, int]) -> Any:
    """A TMA descriptor over x [T, H, D] with box `block`. Made per call and never kept: a kept one would keep its
    tensor alive (a prefill chunk's q is tens of MB); the launcher encodes the tensor map at every launch anyway."""
    return _DESCRIPTOR(x, list(x.shape), list(x.stride()), list(block),
                       _box_layout(x.dtype is torch.bfloat16, block))


def run_hopper_extend(plan: HopperPlan, q: Any, k_buf: Any, v_buf: Any, kv_indptr: Any, kv_indices: Any,
                      kv_pos0: Any, qo_indptr: Any, q_pos0: Any, out: Any, scaling: float,
                      window: Optional[int] = None, logit_cap: float = 0.0, sinks: Any = None,
                      k_scale: Any = None, v_scale: Any = None) -> bool:
    """Launch the planned Gluon kernel; False (nothing launched) where this call's tensors do not fit what TMA
    and cp.async need (16-byte aligned bases, 16-byte q/out row strides), or where the logit scale is not positive
    (the kernel folds it into the exponent after the row max): the caller runs the portable kernel."""
    qk_scale = float(scaling) * as_scale(k_scale, "k_scale")
    if (not qk_scale > 0 or q.data_ptr() % 16 or out.data_ptr() % 16 or k_buf.data_ptr() % 16 or v_buf.data_ptr() % 16
            or q.stride(0) % 8 or q.stride(1) % 8 or out.stride(0) % 8 or out.stride(1) % 8
            or q.stride(2) != 1 or out.stride(2) != 1
            or q.shape[0] == 0):
        return False
    bs = kv_pos0.shape[0]
    if bs == 0:
        return True
    cap = float(logit_cap or 0.0)
    window = int(window or 0)
    n_items = plan.kv_heads * plan.blocks * bs
    grid = (min(n_items, plan.programs) if plan.programs else n_items, )
    flags = (cap > 0, window > 0, sinks is not None, bs == 1)   # the per-call constexprs: part of the launch's key
    launch(_LAUNCHES, (plan.key, grid[0]) + flags, _hopper_extend_kernel, grid,
           (_descriptor(q, plan.block), _descriptor(out, plan.block), k_buf, v_buf, kv_indptr, kv_indices, kv_pos0,
            qo_indptr, q_pos0, sinks if sinks is not None else out, out, qk_scale, as_scale(v_scale, "v_scale"), cap,
            window, k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), out.stride(0), out.stride(1),
            bs, n_items),
           dict(HAS_CAP=flags[0], HAS_WINDOW=flags[1], HAS_SINKS=flags[2], ONE_REQ=flags[3], **plan.consts))
    return True


def compile_for_sm90(d: int = 64, group: int = 8, dtype: str = "bf16", window: bool = False, cap: bool = False,
                     sinks: bool = False, config: Optional[HopperConfig] = None, kv_heads: int = 8,
                     one_req: bool = False) -> Any:
    """Compile the kernel for an sm_90 target without a GPU (TTGIR -> PTX -> cubin through the wheel's ptxas), with
    the specialisations the JIT gives real launches (16-byte aligned pointers, strides divisible by 16). For CI and
    for checking a Triton upgrade on a machine without a Hopper GPU."""
    from triton.experimental.gluon._runtime import GluonASTSource
    if GLUON_ERROR is not None:
        raise RuntimeError(f"Gluon's Hopper API is not importable: {GLUON_ERROR}")
    cfg, bt = config or CONFIGS[d], ROWS // group
    layout = gl.NVMMASharedLayout.get_default_for([bt, group, d], gl.bfloat16 if dtype == "bf16" else gl.float16)
    desc = f"tensordesc<{dtype}[{bt}, {group}, {d}],{layout!r}>"
    sig = dict(q_desc=desc, o_desc=desc, k_buf=f"*{dtype}", v_buf=f"*{dtype}", kv_indptr="*i32", kv_indices="*i64",
               kv_pos0="*i64", qo_indptr="*i32", q_pos0="*i64", sinks="*fp32", out=f"*{dtype}", qk_scale="fp32",
               v_scale="fp32", cap="fp32", window="i32", s_kb="i32", s_kh="i32", s_vb="i32", s_vh="i32", s_ot="i32",
               s_oh="i32", bs="i32", n_items="i32")
    consts = dict(_consts(group, d, cfg, kv_heads), HAS_CAP=cap, HAS_WINDOW=window, HAS_SINKS=sinks,
                  ONE_REQ=one_req)
    aligned = [n for n in sig if sig[n].startswith("*")] + ["s_kb", "s_kh", "s_vb", "s_vh", "s_ot", "s_oh"]
    return build_for_sm90(_hopper_extend_kernel, sig, consts, aligned, dict(num_warps=4), source=GluonASTSource)
