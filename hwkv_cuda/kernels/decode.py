"""decode_attention: one query per request over a CSR list of token slots, split-K in two stages.

Stage 1, grid (kv-head program, split, request): a program takes HPP adjacent kv heads (HPP > 1
where `decode_config` chooses it: each key row is then one wide load) and every q head of their GQA
groups as one block-diagonal [BLOCK_H, HPP * D] query tile (a row is zero outside its own head's
columns, so one dot gives each row its own head's logits), or (`DecodeConfig.batched_heads`, up to 8 heads: whole
key rows) as a batch of per-head [GROUP, D] dots with no zeros in them. It walks its share of the request's
*visible* keys (the window and the causal bound are turned into one contiguous range of list entries first, so no
masked tile is ever loaded) and keeps an online softmax (max, sum, acc) in fp32. Its gathers carry no row mask: a
tile's rows past the split's end repeat the split's last key (its logits masked after the product), list positions
are int32 and, where both pools' element offsets fit int32 (OFF32, from the plan), a row's offset is one multiply:
the loop's instructions fall by 17-36% and its registers from 166-219 to 96-98 in the two-head tiles (H200, every cell
0.3-10% faster, docs/benchmarks.md). With one split it
finishes in place (sinks, normalisation, output dtype); otherwise it writes (acc / sum,
log2-sum-exp) per split into the workspace and the splits are merged with the sink, in one of two ways
the plan picks: the last split program of a (request, kv-head program) to finish merges them itself
(a self-resetting arrival counter per pair in the workspace; no second launch), or stage 2, grid
(request, q head), merges them in a launch of its own (where the last program would read more partials
alone than `DecodeConfig.fused_merge_bytes`, and off NVIDIA, where that ordering is not relied on); on sm_90+ the
merge kernel launches as the split kernel's programmatic dependent (PDL: its launch overlaps the splits, and its
programs wait in hardware for their results; H200 1 x 4K 8.7 -> 8.6 us, 1 x 32K 25.2 -> 24.7).
Empty splits write lse = -inf and are ignored by either merge.

The kv head is the fastest grid axis so that the programs reading the KVH slices of one
token row run side by side (on an H200 this took batch 256 x 4K from 0.93 to 0.98 of copy
bandwidth); the request is the z axis, so a call takes at most 65535 requests. Two kv heads per
program (256-byte rows at D=64) took batch 64-256 from 0.91-0.93 of cuDNN over dense K/V to 0.99-1.01; whole
key rows of 8 heads (1 KiB, a page of 16 tokens one 16 KiB run) took batch 256 1.2-2.8% further.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any, Dict, NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl
try:  # grid dependency control (PDL); a Triton without it keeps plain launches (DecodeConfig.pdl)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None

from hwkv.checks import check_attention_options, check_int_option, check_max_kv_len, check_tensors
from hwkv.csr_checks import (check_csr_values, check_dims, check_float_dtypes, check_index_dtypes,
                              check_same_device)
from hwkv.errors import ShapeError
from hwkv_cuda.kernels.launch import Launch, current_stream, launch, spec
from hwkv_cuda.kernels.common import (LOG2E, NEG_BIG, as_scale, build_for_sm90, cdiv,
                                      dot, fold_sink, hopper_class, interpreting, logits_log2, next_pow2, num_sms,
                                      online_softmax_step, pow2)


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernels (tuned on an H200; the interpreter uses tiny blocks)."""

    block_n: int = 128           # keys per loop iteration
    mid_block_n: int = 64        # ... when a split holds between block_n and 1024 keys
    num_warps: int = 4
    num_stages: int = 3
    ctas_per_sm: int = 4         # stage 1 aims for batch * kv-head programs * splits >= ctas_per_sm * SMs
    min_keys_per_split: int = 128
    max_splits: int = 64
    heads_per_program: int = 1   # kv heads one program reads (see kv_heads_per_program)
    # ... each head's rows a dot of their own (a batched dot over the program's heads: no block-diagonal zeros, so a
    # program may read whole key rows, every kv head's 1 KiB at D=64) rather than one block-diagonal dot
    batched_heads: bool = False
    # the last split to finish merges in place while its rows' partials (splits x rows x Dv fp32) hold at
    # most this many bytes, else the merge kernel runs; 0: always the merge kernel (see the module doc). H200,
    # GQA 8, Dv 64 (docs/benchmarks.md): 5 splits (10 KiB) merge in place as fast or faster (16 x 4K 41.3 vs
    # 42.8 us), 32 splits (64 KiB) slower (1 x 4K 11.9 vs 8.7 us): one program reading them all is the tail
    fused_merge_bytes: int = 32 << 10
    # ... in a plan without the caller's workspace (an eager call): there the host's launch (11-14 us on the H200
    # host) costs more than the in-place merge's tail adds to the device (<= 8 us at 64 splits), so the plan merges
    # in place up to this bound instead (0 in fused_merge_bytes still means never)
    eager_fused_merge_bytes: int = 256 << 10
    # partial values the in-place merge loads per step, which bounds the registers it adds to the split kernel:
    # sm_90 builds (Triton 3.9) of the H200 plans for B 1-16 x 4K-32K keep the merge kernel's 64-161 registers
    # (+4 at most) at 2048, while 4096 took 16 x 4K from 64 to 96 and 8192 every plan up to 168-237
    merge_chunk: int = 2048
    # the merge kernel launches as a programmatic dependent of the split kernel (PDL, sm_90+: the split programs
    # signal at their start, so the merge grid's launch overlaps their work and its programs wait in hardware for
    # the split grid's results), where the merge kernel runs at all
    pdl: bool = True
    # each tile's slots load one iteration ahead (a loop-carried tile; the first before the loop): the pipeliner
    # keeps the K/V gathers behind the same iteration's index load, so without this they stay one tile deep at any
    # num_stages (sm_90 builds: one K and one V buffer at 3 and 4 stages); with it, num_stages - 1 tiles are in flight
    slots_ahead: bool = False
    # the K/V gathers load with L2's evict-first hint: each key is read once a step, so the hint leaves L2 to the
    # lists, the query and the partials that are read again (Triton 3.9 emits it on the cp.async gathers; Triton 3.6
    # drops it there, so on 3.6 this changes nothing: tests/test_decode_build.py)
    evict_first: bool = False
    # splits rounded down rather than up, so the programs never exceed ctas_per_sm x SMs: one even wave of at most
    # ctas_per_sm programs an SM, where rounding up leaves a partial second wave or SMs holding one more program
    # than the rest (16 x 4K at one kv head a program: 2 splits of 128 programs, not 3)
    fill_down: bool = False

    def kv_heads_per_program(self, num_kv_heads: int, head_dim: int) -> int:
        """KV heads per program: at most heads_per_program, a power of two dividing num_kv_heads, and no wider than
        MAX_ROW_COLUMNS key columns (block-diagonal tiles; wider rows overflow shared memory at 128-key tiles), or
        (batched heads) no larger a key tile than those: heads x columns x keys within MAX_ROW_COLUMNS x 128."""
        keys = max(self.block_n, self.mid_block_n) if self.batched_heads else 128
        hpp = 1
        while (hpp * 2 <= self.heads_per_program and num_kv_heads % (hpp * 2) == 0
               and hpp * 2 * pow2(head_dim) * keys <= MAX_ROW_COLUMNS * 128):
            hpp *= 2
        return hpp

    def keys_per_iter(self, keys_per_split: Optional[int]) -> int:
        """Short splits (a few tiles) finish sooner with smaller tiles; H200 sweep, see benchmarks/."""
        if keys_per_split is not None and self.block_n < keys_per_split < 1024:
            return self.mid_block_n
        return self.block_n


MAX_ROW_COLUMNS = 128
# Recorded from an H200 sweep (2026-12-01, GPT-OSS layer: 64 q / 8 kv heads, D=64, bf16; the
# session's sweep script and docs/benchmarks.md): which config wins depends on how many programs
# the batch makes and how long the lists are, so `decode_config` picks one of these per plan.
GPU_CONFIG = DecodeConfig()   # one kv head per program: small batches over short lists, W=128 at batch 1
# Two kv heads per program (each key row one 256-byte load at D=64, 16 query rows for GQA 8):
WIDE_CONFIG = DecodeConfig(block_n=128, mid_block_n=128, num_stages=3, ctas_per_sm=1, heads_per_program=2)
LONG_CONFIG = DecodeConfig(block_n=128, mid_block_n=128, num_stages=2, ctas_per_sm=2, heads_per_program=2)
# Whole key rows (fifteenth session): a program reads up to 8 kv heads as a batch of per-head dots (each key row of 8
# heads one 1 KiB load at D=64, 16 KiB a page of 16 tokens). H200, random pages, interleaved rounds of two runs (us):
# 256 x 4K 481.0-481.5 against WIDE_CONFIG's 491.0-491.5, 256 x 32K 3,755-3,758 against 3,815-3,818, 256 x 32K at
# W=128 25.5-25.7 against LONG_CONFIG's 26.0; at 64 x 4K (64 programs) 144.5-144.7 against 130.7, so only batches of
# a program an SM take it
ROWS_CONFIG = DecodeConfig(block_n=32, mid_block_n=32, num_stages=3, ctas_per_sm=1, heads_per_program=8,
                           batched_heads=True)
# ... four heads of 64-key tiles for wide batches over long lists: 64 x 32K 952.8-953.2 against 966.2-967.0 (64 x 4K
# 130.9-131.1 against 130.7, so not there). Measured with 8 kv heads only: two batched heads (all a 2-kv-head model
# has) measured 4-9% slower than WIDE_CONFIG's two-head tile, so such models keep WIDE_CONFIG
WIDE_LONG_CONFIG = DecodeConfig(block_n=64, mid_block_n=64, num_stages=3, ctas_per_sm=1, heads_per_program=4,
                                batched_heads=True)
# Middle batches of one-head programs (over an eighth of a program an SM, short of WIDE_CONFIG's batches): 128-key
# tiles read a tile ahead, splits rounded down to at most two programs an SM. H100, random pages, interleaved rounds
# (us, against GPU_CONFIG's 3-17 splits): 4 x 4K 18.5 against 19.0, 8 x 4K 29.9 against 32.7, 16 x 4K 52.0 against
# 53.6, 32 x 4K 95.9 against 112.1 (cuDNN 17.3, 28.6, 49.9 and 92.3 there), 16 x 16K 185.9 against 191.3; at 1 x 4K
# the tile ahead cost 5%
MID_CONFIG = DecodeConfig(block_n=128, mid_block_n=128, num_stages=3, ctas_per_sm=2, slots_ahead=True,
                          fill_down=True)
# ... and LONG_CONFIG's split count rounded down at small batches over long lists: 8 x 32K 186.4 against 195.0 (8
# splits, not 9), 16 x 32K 359.4 against 374.0 (4, not 5), 4 x 32K 97.8 against 98.6, 1 x 32K unchanged (64)
LONG_FEW_CONFIG = replace(LONG_CONFIG, fill_down=True)
SHORT_LIST = 512    # lists at most this long (window layers) take LONG_CONFIG's two stages when wide (not ROWS-wide)
LONG_LIST = 16384   # lists at least this long (or of unknown length): LONG_CONFIG at small batches, else WIDE_LONG
INTERPRET_CONFIG = DecodeConfig(block_n=16, mid_block_n=16, num_warps=1, num_stages=1, ctas_per_sm=2,
                                min_keys_per_split=16, max_splits=4, merge_chunk=512)


def decode_config(batch: int, num_kv_heads: int, head_dim: int, max_kv_len: Optional[int],
                  device: torch.device) -> DecodeConfig:
    """The recorded config for this shape: whole key rows (ROWS_CONFIG) where a program of 4-8 kv heads a batch still
    fills every SM; two kv heads per program where the head dim allows it and the batch makes at least one program
    per SM (three stages, one split; two stages for short lists; four heads of 64-key tiles for long lists) or the
    lists are long (LONG_FEW_CONFIG); one head a program otherwise, MID_CONFIG's one even wave from an eighth of a
    program an SM, else GPU_CONFIG. Host ints only: decided once per plan."""
    if interpreting():
        return INTERPRET_CONFIG
    if not hopper_class(torch.device(device)) or WIDE_CONFIG.kv_heads_per_program(num_kv_heads, head_dim) < 2:
        return GPU_CONFIG   # the two-head tiles (up to 192 KiB of shared memory) were recorded on an H200
    sms = num_sms(torch.device(device))
    rows = ROWS_CONFIG.kv_heads_per_program(num_kv_heads, head_dim)
    if rows >= 4 and batch * num_kv_heads // rows >= sms:
        return ROWS_CONFIG
    short = max_kv_len is not None and max_kv_len <= SHORT_LIST
    long = max_kv_len is None or max_kv_len >= LONG_LIST
    if batch * num_kv_heads // 2 >= sms:
        quad = WIDE_LONG_CONFIG.kv_heads_per_program(num_kv_heads, head_dim) >= 4
        return LONG_CONFIG if short else WIDE_LONG_CONFIG if long and quad else WIDE_CONFIG
    if long:
        return LONG_FEW_CONFIG
    return MID_CONFIG if 8 * batch * num_kv_heads > sms else GPU_CONFIG


class DecodeWorkspace(NamedTuple):
    """Preallocated split-K scratch, so a CUDA graph capture allocates nothing.

    acc fp32 [max_bs, H, splits, Dv]; lse fp32 [max_bs, H, splits]; counts int32 [max_bs, >= kv heads],
    zero between launches (the in-place merge's arrival counters: the merging program puts its own back to
    zero; None: always the merge kernel). The split count of a call that is handed a workspace is the
    workspace's.
    """

    acc: torch.Tensor
    lse: torch.Tensor
    counts: Optional[torch.Tensor] = None

    @property
    def num_splits(self) -> int:
        return self.lse.shape[2]


def decode_num_splits(batch: int, num_kv_heads: int, max_kv_len: Optional[int],
                      device: torch.device, config: Optional[DecodeConfig] = None, *,
                      head_dim: Optional[int] = None) -> int:
    """Splits per (request, kv-head program) that fill the device; capped by max_kv_len when known.
    Without a config, the one `decode_config` picks for this shape; without head_dim (older callers),
    one kv head per program as in GPU_CONFIG."""
    if head_dim is None:
        cfg = config or (INTERPRET_CONFIG if interpreting() else GPU_CONFIG)
        hpp = 1
    else:
        cfg = config or decode_config(batch, num_kv_heads, head_dim, max_kv_len, device)
        hpp = cfg.kv_heads_per_program(num_kv_heads, head_dim)
    programs = batch * (num_kv_heads // hpp)
    slots = cfg.ctas_per_sm * num_sms(torch.device(device))
    want = slots // max(1, programs) if cfg.fill_down else cdiv(slots, max(1, programs))
    if max_kv_len is not None:
        want = min(want, cdiv(max(int(max_kv_len), 1), cfg.min_keys_per_split))
    return max(1, min(want, cfg.max_splits))


def make_decode_workspace(max_bs: int, num_heads: int, v_head_dim: int, num_splits: int,
                          device: torch.device) -> DecodeWorkspace:
    """Scratch for decode_attention with `num_splits` splits and up to `max_bs` requests (counters for
    up to `num_heads` kv heads, which bounds the kv heads of any layer with that many q heads).

    Made while a CUDA graph is being captured it holds no counters (its calls take the merge kernel): the
    zeroing would run only inside that graph's replays, and a workspace outlives the graph that made it
    (other graphs and eager calls share it) while its memory holds whatever was there before."""
    for name, value, lo in (("max_bs", max_bs, 0), ("num_heads", num_heads, 1), ("v_head_dim", v_head_dim, 1),
                            ("num_splits", num_splits, 1)):
        check_int_option(name, value, lo)
    device = torch.device(device)
    counts = None if _capturing(device) else torch.zeros(max_bs, num_heads, dtype=torch.int32, device=device)
    return DecodeWorkspace(
        torch.empty(max_bs, num_heads, num_splits, v_head_dim, dtype=torch.float32, device=device),
        torch.empty(max_bs, num_heads, num_splits, dtype=torch.float32, device=device), counts)


def _capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is capturing a graph (False off CUDA)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@triton.jit
def _visible_range(kv_indptr, kv_pos0, q_pos, b, window):
    """List entries [lo, hi) of request b that its query may see, and the list's start."""
    kv_start = tl.load(kv_indptr + b).to(tl.int64)
    kv_len = tl.load(kv_indptr + b + 1).to(tl.int64) - kv_start
    pos0 = tl.load(kv_pos0 + b).to(tl.int64)
    rel = tl.load(q_pos + b).to(tl.int64) - pos0  # query pos - pos0
    hi = tl.minimum(kv_len, rel + 1)
    lo = tl.maximum(-pos0, 0)   # entries at negative positions (a list start given below 0) are no keys
    if window > 0:
        lo = tl.maximum(lo, rel - window + 1)
    hi = tl.maximum(hi, lo)
    # in int32 from here (a list stays below 2**31 entries; positions may not): both bounds clamped to the list's
    # length first, which keeps an empty range empty
    return kv_start, tl.minimum(lo, kv_len).to(tl.int32), tl.minimum(hi, kv_len).to(tl.int32)


@triton.jit
def _tile_slots(idx, offs_n, s_hi, OFF32: tl.constexpr, GUARD: tl.constexpr = False, first=0):
    """A key tile's pool slots. Rows past the split's end repeat its last entry (a real key of the list, whose
    logits there are masked to -inf after the product, so its p is 0 and its finite values add nothing): the
    index, K and V loads need no row mask. OFF32: every element offset of the pools fits int32 (one multiply a row);
    otherwise int64 whatever the list's dtype, so an int32 list's slot times the row stride does not wrap."""
    if GUARD:  # the first tile, loaded before the split's loop: an empty split (its first entry `first` >= s_hi)
        # loads nothing; one scalar test, where the tile's own minimum was a cross-warp reduction
        # (two barriers) on the path from the request's bounds to its first slots
        slot = tl.load(idx + tl.minimum(offs_n, s_hi - 1), mask=(tl.zeros_like(offs_n) + first) < s_hi, other=0)
    else:
        slot = tl.load(idx + tl.minimum(offs_n, s_hi - 1))
    if OFF32:
        slot = slot.to(tl.int32)
    else:
        slot = slot.to(tl.int64)
    return slot


@triton.jit
def _next_slots(idx, offs_n, s_hi, ahead, BLOCK_N: tl.constexpr, OFF32: tl.constexpr, AHEAD: tl.constexpr):
    """(this tile's slots, the carried tile): loaded here, or (AHEAD, DecodeConfig.slots_ahead) the tile the last
    iteration loaded, with the next tile's loaded now (clamped to the split's end, as `_tile_slots` clamps)."""
    if AHEAD:
        slot = ahead
        ahead = _tile_slots(idx, offs_n + BLOCK_N, s_hi, OFF32)
    else:
        slot = _tile_slots(idx, offs_n, s_hi, OFF32)
    return slot, ahead


@triton.jit
def _gather(buf, rows, cols, mask_c, C: tl.constexpr, BLOCK_C: tl.constexpr, EVICT: tl.constexpr = False):
    """Rows of a K or V tile (element offsets rows + cols): masked only where the head dim is padded; EVICT
    (DecodeConfig.evict_first) marks them first to leave L2."""
    policy: tl.constexpr = "evict_first" if EVICT else ""
    if C == BLOCK_C:
        t = tl.load(buf + rows + cols, eviction_policy=policy)
    else:
        t = tl.load(buf + rows + cols, mask=mask_c, other=0.0, eviction_policy=policy)
    return t


@triton.jit
def _row_heads(kvh0, GROUP: tl.constexpr, HPP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_G: tl.constexpr,
               BATCHED: tl.constexpr):
    """A program's rows as the helpers below order them: (the q head of each row, whether it is a real one).
    Block-diagonal: the HPP groups' heads in a row, padded once at the end; batched: head-major, each kv head's
    group padded to BLOCK_G rows (`_batched_heads` builds the same order as [HPP, BLOCK_G] for its loads)."""
    if BATCHED:
        r = tl.arange(0, HPP * BLOCK_G)
        return (kvh0 + r // BLOCK_G) * GROUP + r % BLOCK_G, r % BLOCK_G < GROUP
    else:
        r = tl.arange(0, BLOCK_H)
        return kvh0 * GROUP + r, r < HPP * GROUP


@triton.jit
def _block_diagonal_heads(q, s_qb, s_qh, k_buf, v_buf, s_kb, s_kh, s_vb, s_vh, kv_indices, kv_start, s_lo, s_hi, b,
                          kvh0, qk_scale, cap, GROUP: tl.constexpr, HPP: tl.constexpr, D: tl.constexpr,
                          DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                          BLOCK_N: tl.constexpr, HAS_CAP: tl.constexpr, F32: tl.constexpr, OFF32: tl.constexpr,
                          AHEAD: tl.constexpr, EVICT: tl.constexpr = False):
    """The split's online softmax over HPP adjacent kv heads as one block-diagonal tile: each key row is one
    [HPP * D] load, and the query tile is block-diagonal (row r belongs to local kv head r // GROUP and is zero
    outside that head's columns), so one dot gives every row its own head's logits and the rows of a small GQA
    group fill the tile. Returns (acc [BLOCK_H, HPP * BLOCK_DV], m, l, the rows' q heads, their mask, the
    columns' dims, the mask of each row's own columns)."""
    offs_h = tl.arange(0, BLOCK_H)
    heads, mask_h = _row_heads(kvh0, GROUP, HPP, BLOCK_H, 1, False)
    row_kv = offs_h // GROUP
    offs_c = tl.arange(0, HPP * BLOCK_D)       # K columns: local kv head c // BLOCK_D, dim c % BLOCK_D
    col_d = offs_c % BLOCK_D
    col_kv = offs_c // BLOCK_D
    mask_d = col_d < D
    offs_cv = tl.arange(0, HPP * BLOCK_DV)     # V / output columns, the same way
    col_dv = offs_cv % BLOCK_DV
    col_kv_v = offs_cv // BLOCK_DV
    mask_dv = col_dv < DV
    qt = tl.load(q + b * s_qb + heads[:, None] * s_qh + col_d[None, :],
                 mask=mask_h[:, None] & mask_d[None, :] & (row_kv[:, None] == col_kv[None, :]), other=0.0)
    k_cols = (kvh0 + col_kv) * s_kh + col_d
    v_cols = (kvh0 + col_kv_v) * s_vh + col_dv

    m = tl.full([BLOCK_H], NEG_BIG, tl.float32)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HPP * BLOCK_DV], tl.float32)
    idx = kv_indices + kv_start
    ahead = _tile_slots(idx, s_lo + tl.arange(0, BLOCK_N), s_hi, OFF32, True, s_lo) if AHEAD else 0
    for start in range(s_lo, s_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < s_hi
        slot, ahead = _next_slots(idx, offs_n, s_hi, ahead, BLOCK_N, OFF32, AHEAD)
        kt = _gather(k_buf, slot[:, None] * s_kb, k_cols[None, :], mask_d[None, :], D, BLOCK_D, EVICT)
        s = logits_log2(dot(qt, tl.trans(kt.to(qt.dtype)), F32), qk_scale, cap, HAS_CAP)
        s = tl.where(mask_n[None, :], s, float("-inf"))
        vt = _gather(v_buf, slot[:, None] * s_vb, v_cols[None, :], mask_dv[None, :], DV, BLOCK_DV,
                     EVICT).to(qt.dtype)
        m, l_sum, acc = online_softmax_step(m, l_sum, acc, s, vt, F32)

    # a row's result is its own head's columns of acc (the others mix in another head's values)
    mask_o = mask_h[:, None] & mask_dv[None, :] & (row_kv[:, None] == col_kv_v[None, :])
    return acc, m, l_sum, heads, mask_h, col_dv, mask_o


@triton.jit
def _batched_heads(q, s_qb, s_qh, k_buf, v_buf, s_kb, s_kh, s_vb, s_vh, kv_indices, kv_start, s_lo, s_hi, b, kvh0,
                   qk_scale, cap, GROUP: tl.constexpr, HPP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                   HAS_CAP: tl.constexpr, F32: tl.constexpr, OFF32: tl.constexpr, AHEAD: tl.constexpr,
                   EVICT: tl.constexpr = False):
    """The split's online softmax over HPP adjacent kv heads as a batch of per-head dots ([HPP, BLOCK_G] query rows,
    GROUP of them real): a key row of all HPP heads is one load, with no block-diagonal zeros in the products.
    Returns (acc [HPP * BLOCK_G, BLOCK_DV], m, l, the rows' q heads, their mask), rows head-major."""
    offs_k = tl.arange(0, HPP)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_g = offs_g < GROUP
    mask_d = offs_d < D
    mask_dv = offs_dv < DV
    heads = (kvh0 + offs_k)[:, None] * GROUP + offs_g[None, :]      # [HPP, BLOCK_G]; padded rows are masked
    q3 = tl.load(q + b * s_qb + heads[:, :, None] * s_qh + offs_d[None, None, :],
                 mask=mask_g[None, :, None] & mask_d[None, None, :], other=0.0)
    k_heads = (kvh0 + offs_k) * s_kh
    v_heads = (kvh0 + offs_k) * s_vh
    m = tl.full([HPP, BLOCK_G], NEG_BIG, tl.float32)
    l_sum = tl.zeros([HPP, BLOCK_G], tl.float32)
    acc = tl.zeros([HPP, BLOCK_G, BLOCK_DV], tl.float32)
    idx = kv_indices + kv_start
    ahead = _tile_slots(idx, s_lo + tl.arange(0, BLOCK_N), s_hi, OFF32, True, s_lo) if AHEAD else 0
    for start in range(s_lo, s_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < s_hi
        slot, ahead = _next_slots(idx, offs_n, s_hi, ahead, BLOCK_N, OFF32, AHEAD)
        kt = _gather(k_buf, slot[None, :, None] * s_kb, k_heads[:, None, None] + offs_d[None, None, :],
                     mask_d[None, None, :], D, BLOCK_D, EVICT)                            # [HPP, BLOCK_N, BLOCK_D]
        s = logits_log2(dot(q3, tl.permute(kt.to(q3.dtype), (0, 2, 1)), F32), qk_scale, cap, HAS_CAP)
        s = tl.where(mask_n[None, None, :], s, float("-inf"))                            # [HPP, BLOCK_G, BLOCK_N]
        vt = _gather(v_buf, slot[None, :, None] * s_vb, v_heads[:, None, None] + offs_dv[None, None, :],
                     mask_dv[None, None, :], DV, BLOCK_DV, EVICT).to(q3.dtype)
        m, l_sum, acc = online_softmax_step(m, l_sum, acc, s, vt, F32)
    rows: tl.constexpr = HPP * BLOCK_G
    mask_h = mask_g[None, :] & (offs_k[:, None] < HPP)
    return (tl.reshape(acc, [rows, BLOCK_DV]), tl.reshape(m, [rows]), tl.reshape(l_sum, [rows]),
            tl.reshape(heads, [rows]), tl.reshape(mask_h, [rows]))


@triton.jit(do_not_specialize=["window", "num_splits"])  # scalar math only: a server's batches share one compile
def _decode_split_kernel(
        q, out, s_qb, s_qh, s_ob, s_oh,                                                # a call's (CALL_ARGS)
        k_buf, v_buf, sinks, qk_scale, v_scale, cap, window, s_kb, s_kh, s_vb, s_vh,   # a layer's (LAYER_ARGS)
        kv_indptr, kv_indices, kv_pos0, q_pos, ws_acc, ws_lse, ws_counts, num_splits,  # a forward's
        s_ab, s_ah, s_as, s_lb, s_lh, s_cb,
        GROUP: tl.constexpr, HPP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, DIRECT: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_CAP: tl.constexpr, HAS_SINKS: tl.constexpr, F32: tl.constexpr,
        FUSED: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr, PDL: tl.constexpr = False,
        BATCHED: tl.constexpr = False, BLOCK_G: tl.constexpr = 16, OFF32: tl.constexpr = False,
        AHEAD: tl.constexpr = False, EVICT: tl.constexpr = False):
    if PDL:   # the merge kernel may launch once every split program has started (it waits for their results)
        gdc_launch_dependents()
    kvh0 = tl.program_id(0) * HPP   # kv heads fastest: the programs reading one token row run together
    split = tl.program_id(1)
    b = tl.program_id(2)
    kv_start, lo, hi = _visible_range(kv_indptr, kv_pos0, q_pos, b, window)
    if DIRECT:   # one split: its range is the visible one (no division by the split count on the way to the keys)
        s_lo = lo
        s_hi = hi
    else:
        per = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
        s_lo = lo + split * per
        s_hi = tl.minimum(s_lo + per, hi)
    if DIRECT and HAS_SINKS:   # the rows' sinks loaded before the loop, not on the epilogue's path (H100: 24 x 4K
        # at W=16 5.7 -> 5.5 us, other cells within 0.3%)
        r_head, r_ok = _row_heads(kvh0, GROUP, HPP, BLOCK_H, BLOCK_G, BATCHED)
        sink0 = tl.load(sinks + r_head, mask=r_ok, other=0.0).to(tl.float32) * LOG2E
    if BATCHED:
        acc, m, l_sum, heads, mask_h = _batched_heads(
            q, s_qb, s_qh, k_buf, v_buf, s_kb, s_kh, s_vb, s_vh, kv_indices, kv_start, s_lo, s_hi, b, kvh0,
            qk_scale, cap, GROUP, HPP, D, DV, BLOCK_G, BLOCK_D, BLOCK_DV, BLOCK_N, HAS_CAP, F32, OFF32, AHEAD, EVICT)
        col_dv = tl.arange(0, BLOCK_DV)
        mask_o = mask_h[:, None] & (col_dv < DV)[None, :]
    else:
        acc, m, l_sum, heads, mask_h, col_dv, mask_o = _block_diagonal_heads(
            q, s_qb, s_qh, k_buf, v_buf, s_kb, s_kh, s_vb, s_vh, kv_indices, kv_start, s_lo, s_hi, b, kvh0,
            qk_scale, cap, GROUP, HPP, D, DV, BLOCK_H, BLOCK_D, BLOCK_DV, BLOCK_N, HAS_CAP, F32, OFF32, AHEAD, EVICT)

    if DIRECT:  # one split: finish here: sink, normalisation, output dtype
        if HAS_SINKS:
            m_fin, l_sum, acc = fold_sink(m, l_sum, acc, sink0)
        o = acc * v_scale / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
        tl.store(out + b * s_ob + heads[:, None] * s_oh + col_dv[None, :],
                 o.to(out.dtype.element_ty), mask=mask_o)
    else:
        l_safe = tl.where(l_sum > 0, l_sum, 1.0)
        lse = tl.where(l_sum > 0, m + tl.log2(l_safe), float("-inf"))
        o = acc / l_safe[:, None]
        tl.store(ws_acc + b * s_ab + heads[:, None] * s_ah + split * s_as + col_dv[None, :],
                 o, mask=mask_o)
        tl.store(ws_lse + b * s_lb + heads * s_lh + split, lse, mask=mask_h)
        if FUSED:  # the last split of (b, this kv-head program) to arrive merges every split's partials
            # every thread's stores above precede the counter's release (CTA barrier, then one acq_rel atomic)
            tl.debug_barrier()
            count = ws_counts + b * s_cb + tl.program_id(0)
            if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
                _merge_rows(sinks, out, ws_acc, ws_lse, b, heads, mask_h, v_scale, num_splits,
                            s_ob, s_oh, s_ab, s_ah, s_as, s_lb, s_lh,
                            DV, BLOCK_H, BLOCK_S, CHUNK_S, BLOCK_DV, HAS_SINKS)
                tl.store(count, 0)   # zero again for the next launch (stream order publishes it)


@triton.jit
def _merge_rows(sinks, out, ws_acc, ws_lse, b, heads, mask_h, v_scale, num_splits,
                s_ob, s_oh, s_ab, s_ah, s_as, s_lb, s_lh,
                DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr,
                BLOCK_DV: tl.constexpr, HAS_SINKS: tl.constexpr):
    """`_decode_merge_kernel` for the q heads `heads` of request b inside the split kernel: the partials
    are read through L2 (.cg: other SMs wrote them), CHUNK_S splits at a time."""
    offs_s = tl.arange(0, BLOCK_S)
    lse_rows = ws_lse + b * s_lb + heads[:, None] * s_lh
    lse = tl.load(lse_rows + offs_s[None, :], mask=mask_h[:, None] & (offs_s[None, :] < num_splits),
                  other=float("-inf"), cache_modifier=".cg")
    m = tl.maximum(tl.max(lse, 1), NEG_BIG)
    if HAS_SINKS:
        sink = tl.load(sinks + heads, mask=mask_h, other=0.0).to(tl.float32) * LOG2E
        m = tl.maximum(m, sink)
    denom = tl.sum(tl.exp2(lse - m[:, None]), 1)
    if HAS_SINKS:
        denom += tl.exp2(sink - m)
    offs_c = tl.arange(0, CHUNK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < DV
    acc_rows = ws_acc + b * s_ab + heads * s_ah
    o = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for s0 in range(0, num_splits, CHUNK_S):
        sp = s0 + offs_c
        ok = mask_h[:, None] & (sp[None, :] < num_splits)
        w = tl.exp2(tl.load(lse_rows + sp[None, :], mask=ok, other=float("-inf"), cache_modifier=".cg")
                    - m[:, None])
        part = tl.load(acc_rows[:, None, None] + sp[None, :, None] * s_as + offs_dv[None, None, :],
                       mask=ok[:, :, None] & mask_dv[None, None, :], other=0.0, cache_modifier=".cg")
        o += tl.sum(w[:, :, None] * part, 1)
    o = o * v_scale / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out + b * s_ob + heads[:, None] * s_oh + offs_dv[None, :], o.to(out.dtype.element_ty),
             mask=mask_h[:, None] & mask_dv[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
        sinks, out, ws_acc, ws_lse, v_scale, num_splits,
        s_ob, s_oh, s_ab, s_ah, s_as, s_lb, s_lh,
        DV: tl.constexpr, BLOCK_S: tl.constexpr,
        BLOCK_DV: tl.constexpr, HAS_SINKS: tl.constexpr, PDL: tl.constexpr = False):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_s = offs_s < num_splits
    mask_dv = offs_dv < DV
    if PDL:   # launched as the split kernel's dependent: its partials are complete and visible after this
        gdc_wait()
    lse = tl.load(ws_lse + b * s_lb + h * s_lh + offs_s, mask=mask_s, other=float("-inf"))
    acc = tl.load(ws_acc + b * s_ab + h * s_ah + offs_s[:, None] * s_as + offs_dv[None, :],
                  mask=mask_s[:, None] & mask_dv[None, :], other=0.0)
    m = tl.maximum(tl.max(lse, 0), NEG_BIG)
    if HAS_SINKS:
        sink = tl.load(sinks + h).to(tl.float32) * LOG2E
        m = tl.maximum(m, sink)
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    if HAS_SINKS:
        denom += tl.exp2(sink - m)
    o = tl.sum(w[:, None] * acc, 0) * v_scale / tl.where(denom > 0, denom, 1.0)
    tl.store(out + b * s_ob + h * s_oh + offs_dv, o.to(out.dtype.element_ty), mask=mask_dv)


def _check_decode(q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, q_pos, out, sinks) -> None:
    check_tensors(q=q, k_buf=k_buf, v_buf=v_buf, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_pos0=kv_pos0,
                  q_pos=q_pos, out=out, sinks=sinks)
    bs, h, d = q.shape if q.dim() == 3 else (None, None, None)
    check_dims("q", q, [None, None, None])
    check_dims("k_buf", k_buf, [None, None, d])
    kvh = k_buf.shape[1]
    check_dims("v_buf", v_buf, [k_buf.shape[0], kvh, None])
    check_dims("out", out, [bs, h, v_buf.shape[2]])
    check_dims("kv_indptr", kv_indptr, [bs + 1])
    check_dims("kv_indices", kv_indices, [None])
    check_dims("kv_pos0", kv_pos0, [bs])
    check_dims("q_pos", q_pos, [bs])
    if sinks is not None:
        check_dims("sinks", sinks, [h])
    if h % kvh:
        raise ShapeError(f"q has {h} heads, not a multiple of the buffers' {kvh} kv heads")
    check_same_device(q=q, k_buf=k_buf, v_buf=v_buf, kv_indptr=kv_indptr, kv_indices=kv_indices,
                      kv_pos0=kv_pos0, q_pos=q_pos, out=out, sinks=sinks)
    check_index_dtypes((("kv_indptr", kv_indptr), ("kv_indices", kv_indices), ("kv_pos0", kv_pos0),
                        ("q_pos", q_pos)))
    check_float_dtypes((("q", q), ("k_buf", k_buf), ("v_buf", v_buf), ("out", out), ("sinks", sinks)))
    check_csr_values(kv_indptr, kv_indices, k_buf.shape[0])


def _workspace(workspace, bs, h, kvh, d, dv, max_kv_len, device, cfg) -> DecodeWorkspace:
    """Split-K scratch: the caller's (checked), a fresh one, or (out-free) dummies for 1 split."""
    if workspace is not None:
        acc, lse = workspace.acc, workspace.lse
        splits = workspace.num_splits if lse.dim() == 3 else 0
        if splits < 1:   # (the split range divides by the count: nothing would be written)
            raise ShapeError(f"workspace lse has shape {list(lse.shape)}: a workspace holds >= 1 split")
        # every row the kernels write lies inside them (an acc of fewer rows had taken partials past its end)
        for name, t, want in (("acc", acc, (h, splits, dv)), ("lse", lse, (h, splits))):
            if (t.dim() != len(want) + 1 or t.shape[0] < bs or tuple(t.shape[1:]) != want
                    or t.dtype != torch.float32 or t.device != device):
                raise ShapeError(f"workspace {name} is {t.dtype} of shape {list(t.shape)} on {t.device}, expected "
                                 f"torch.float32 [>={bs}, {', '.join(map(str, want))}] on {device}")
        counts = workspace.counts
        if counts is not None and (counts.dim() != 2 or counts.shape[0] < bs or counts.shape[1] < kvh
                                   or counts.dtype != torch.int32 or counts.device != device):
            raise ShapeError(f"workspace counts is {counts.dtype} of shape {list(counts.shape)} on {counts.device}, "
                             f"expected torch.int32 [>={bs}, >={kvh}] on {device}")
        return DecodeWorkspace(*workspace)
    splits = decode_num_splits(bs, kvh, max_kv_len, device, cfg, head_dim=max(d, dv))
    if splits > 1:
        return make_decode_workspace(bs, h, dv, splits, device)
    dummy = torch.empty(0, dtype=torch.float32, device=device)   # never touched with one split
    return DecodeWorkspace(dummy, dummy)


def _merges_in_place(device: torch.device, interpreted: bool) -> bool:
    """Where the last split may merge: NVIDIA GPUs (the barrier + acq_rel atomic + L2 reads the kernel relies
    on) and the interpreter (programs run one after another). ROCm, XPU and MUSA keep the merge kernel."""
    return interpreted or (device.type == "cuda" and torch.version.hip is None)


# planned launches of the decode kernels: a plan is per forward, its launches outlive it (keyed by what fixes them)
_LAUNCHES: Dict[Any, Launch] = {}


class DecodePlan(NamedTuple):
    """How to launch decode for a set of calls that share a batch, a head geometry and a key-list
    bound: split count, workspace, tile sizes, and the shapes/strides the first call was checked with.

    Built once per forward by `plan_decode` (from the cached plan of its kind, checked fully at the first call of
    that kind); every layer then runs `decode_attention_planned`, which only compares its tensors against these
    fields. The forwards of one kind share its workspace and its launches.
    """

    q_shape: Tuple[int, ...]
    k_shape: Tuple[int, ...]
    v_shape: Tuple[int, ...]
    k_stride: Tuple[int, ...]
    v_stride: Tuple[int, ...]
    out_shape: Tuple[int, ...]
    device: torch.device
    splits: int
    ws_acc: torch.Tensor
    ws_lse: torch.Tensor
    ws_counts: torch.Tensor        # the in-place merge's counters (a dummy without it)
    ws_strides: Tuple[int, ...]
    config: DecodeConfig
    split_consts: Dict[str, Any]   # the split kernel's constexprs and launch options
    merge_consts: Dict[str, Any]
    interpreted: bool
    launch_key: Tuple[Any, ...]    # what fixes its launches (grids, constexprs): shared across forwards
    launches: Dict[Any, Launch]    # this plan's planned launches by kernel and flags (no hash of launch_key per call)
    geometry: Tuple[Any, ...]      # what a layer's buffers must match (DecodeLayer.geometry)
    lists: Optional[Tuple[torch.Tensor, ...]]  # the index lists plan_decode checked (None: a public call's plan)
    forward_args: Tuple[Any, ...]  # the split kernel's arguments of a forward (lists, workspace) and their spec
    forward_spec: Optional[Tuple[Any, ...]]

    @property
    def workspace(self) -> Optional[DecodeWorkspace]:
        if self.splits == 1:
            return None
        return DecodeWorkspace(self.ws_acc, self.ws_lse, self.ws_counts if self.fused else None)

    @property
    def fused(self) -> bool:
        """Whether the last split merges in place (no merge launch); False with one split."""
        return bool(self.split_consts["FUSED"])


def _split_consts(cfg: DecodeConfig, group: int, kvh: int, d: int, dv: int, splits: int, per_split: Optional[int],
                  fused: bool, pdl: bool, pool_elements: int) -> Dict[str, Any]:
    """The split kernel's constexprs and launch options for a plan (all but the per-layer HAS_CAP, HAS_SINKS, F32)."""
    hpp = cfg.kv_heads_per_program(kvh, max(d, dv))
    # rows of a program: block-diagonal, HPP groups padded once; batched, each head's group padded to a dot's rows
    block_h, block_dv = (hpp * pow2(group) if cfg.batched_heads else pow2(hpp * group)), pow2(dv)
    block_s = next_pow2(splits)
    # splits the in-place merge loads per step: the largest power of two (>= 2) within merge_chunk values
    chunk_s = min(block_s, max(2, next_pow2(cfg.merge_chunk // (block_h * block_dv) + 1) // 2))
    return dict(GROUP=group, HPP=hpp, D=d, DV=dv, DIRECT=splits == 1, BLOCK_H=block_h,
                BLOCK_D=pow2(d), BLOCK_DV=block_dv, BLOCK_N=cfg.keys_per_iter(per_split), FUSED=fused,
                BLOCK_S=block_s if fused else 1, CHUNK_S=chunk_s if fused else 1, PDL=pdl,
                BATCHED=cfg.batched_heads, BLOCK_G=pow2(group), OFF32=pool_elements < 2 ** 31, AHEAD=cfg.slots_ahead,
                EVICT=cfg.evict_first,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _span(t: torch.Tensor) -> int:
    """Elements from a tensor's first to one past its last (its strides may leave gaps a numel does not count)."""
    return 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()) if n > 0)


def _make_plan(q, k_buf, v_buf, out, max_kv_len, workspace, cfg, lists=None) -> DecodePlan:
    bs, h, d = q.shape
    kvh, dv = k_buf.shape[1], v_buf.shape[2]
    cfg = cfg or decode_config(bs, kvh, max(d, dv), max_kv_len, q.device)
    ws = _workspace(workspace, bs, h, kvh, d, dv, max_kv_len, q.device, cfg)
    splits = ws.lse.shape[2] if ws.lse.dim() == 3 else 1
    per_split = None if max_kv_len is None else cdiv(max(int(max_kv_len), 1), splits)
    ws_strides = ((ws.acc.stride(0), ws.acc.stride(1), ws.acc.stride(2), ws.lse.stride(0),
                   ws.lse.stride(1)) if splits > 1 else (0,) * 5)
    interpreted = interpreting()
    group = h // kvh
    hpp = cfg.kv_heads_per_program(kvh, max(d, dv))
    limit = cfg.fused_merge_bytes
    if workspace is None and limit > 0:  # eager: a launch fewer is worth more than the merge's tail
        limit = max(limit, cfg.eager_fused_merge_bytes)
    fused = (splits > 1 and ws.counts is not None and _merges_in_place(q.device, interpreted)
             and splits * hpp * group * dv * 4 <= limit)
    pdl = splits > 1 and not fused and cfg.pdl and gdc_wait is not None and hopper_class(q.device)
    split_consts = _split_consts(cfg, group, kvh, d, dv, splits, per_split, fused, pdl,
                                 max(_span(k_buf), _span(v_buf)))
    merge_consts = dict(DV=dv, BLOCK_S=next_pow2(splits), BLOCK_DV=next_pow2(dv), PDL=pdl,
                        num_warps=1 if interpreted else 4, **({"launch_pdl": True} if pdl else {}))
    counts = ws.counts if fused else ws.lse
    workspace_args = (ws.acc, ws.lse, counts, splits, *ws_strides, counts.stride(0))
    forward_args = (*lists, *workspace_args) if lists is not None else workspace_args
    return DecodePlan(tuple(q.shape), tuple(k_buf.shape), tuple(v_buf.shape), k_buf.stride(), v_buf.stride(),
                      tuple(out.shape), q.device, splits, ws.acc, ws.lse, counts, ws_strides + (counts.stride(0),),
                      cfg, split_consts, merge_consts, interpreted,
                      (bs, kvh // hpp, splits, h, tuple(split_consts.items()), tuple(merge_consts.items())), {},
                      _geometry(k_buf, v_buf), lists, forward_args,
                      spec(_decode_split_kernel, forward_args, _FORWARD_AT) if lists is not None else None)


# where the split kernel's parameters of a layer and of a forward begin (see its signature)
_LAYER_AT, _FORWARD_AT = 6, 17


def _geometry(k_buf: torch.Tensor, v_buf: torch.Tensor) -> Tuple[Any, ...]:
    return (k_buf.shape, v_buf.shape, k_buf.stride(), v_buf.stride(), k_buf.get_device(), v_buf.get_device())


class DecodeLayer(NamedTuple):
    """One layer's arguments of the split kernel (buffers, sinks, scales, window), with their spec, launch flags
    and buffer geometry: made once per layer by the backend (`decode_layer`), then handed to every forward."""

    args: Tuple[Any, ...]
    spec: Tuple[Any, ...]
    flags: Tuple[bool, bool]     # HAS_CAP, HAS_SINKS
    geometry: Tuple[Any, ...]
    sinks: Optional[Tuple[Any, ...]]  # the sinks' (shape, device index, contiguous), None without sinks


def decode_layer(k_buf: torch.Tensor, v_buf: torch.Tensor, sinks: Optional[torch.Tensor], scaling: float,
                 window: Optional[int] = None, logit_cap: float = 0.0, k_scale: Optional[float] = None,
                 v_scale: Optional[float] = None, kept: bool = True) -> DecodeLayer:
    """A layer's part of a decode launch (see DecodeLayer); nothing is checked here: a plan compares it.
    `kept=False` (a part made for one call): no spec, the launch compares every argument itself."""
    cap = float(logit_cap or 0.0)
    ks, vs = k_buf.stride(), v_buf.stride()
    args = (k_buf, v_buf, sinks if sinks is not None else k_buf, float(scaling) * as_scale(k_scale, "k_scale"),
            as_scale(v_scale, "v_scale"), cap, int(window or 0), ks[0], ks[1], vs[0], vs[1])
    return DecodeLayer(args, spec(_decode_split_kernel, args, _LAYER_AT) if kept else None,
                       (cap > 0, sinks is not None), _geometry(k_buf, v_buf),
                       None if sinks is None else (sinks.shape, sinks.get_device(), sinks.is_contiguous()))


def _run(plan: DecodePlan, q, out, layer: DecodeLayer, lists: Tuple[torch.Tensor, ...], qs=None, os_=None) -> None:
    """The launches (split, then the merge kernel when there is more than one split and the last split does
    not merge in place); nothing is checked here. The split kernel's arguments come in three parts, each with
    its spec computed as often as it changes: the call's (q, out), the layer's, the forward's (the plan's)."""
    bs, h, _ = plan.q_shape
    if bs == 0:
        return
    splits = plan.splits
    if qs is None:
        qs, os_ = q.stride(), out.stride()
    call = (q, out, qs[0], qs[1], os_[0], os_[1])
    kept = plan.lists is not None and layer.spec is not None  # both parts' specs made once: compare those
    args = call + layer.args + (plan.forward_args if plan.lists is not None else lists + plan.forward_args)
    flags = layer.flags + (q.dtype == torch.float32 or plan.interpreted,)
    planned = plan.launches.get(flags)
    if planned is not None:  # the plan keeps the launch that ran (a variant's, where its lists' alignment asks)
        used = planned.parts(args, (layer.spec, plan.forward_spec)) if kept else planned.run(args)
        if used is not planned:
            plan.launches[flags] = used
    else:
        key = (plan.launch_key, "split") + flags
        plan.launches[flags] = launch(
            _LAUNCHES, key, _decode_split_kernel, (plan.k_shape[1] // plan.split_consts["HPP"], splits, bs), args,
            dict(HAS_CAP=flags[0], HAS_SINKS=flags[1], F32=flags[2], **plan.split_consts),
            ((_LAYER_AT, _FORWARD_AT), (_FORWARD_AT, len(args))))
    if splits > 1 and not plan.split_consts["FUSED"]:
        args = (layer.args[2], out, plan.ws_acc, plan.ws_lse, layer.args[4], splits, os_[0], os_[1],
                *plan.ws_strides[:5])
        planned = plan.launches.get(flags[1])
        if planned is not None:
            used = planned.run(args)
            if used is not planned:
                plan.launches[flags[1]] = used
        else:
            key = (plan.launch_key, "merge", flags[1])
            plan.launches[flags[1]] = launch(_LAUNCHES, key, _decode_merge_kernel, (bs, h), args,
                                             dict(HAS_SINKS=flags[1], **plan.merge_consts))


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_pos0: torch.Tensor,
                     q_pos: torch.Tensor, out: torch.Tensor, scaling: Optional[float],
                     window: Optional[int] = None, logit_cap: float = 0.0,
                     sinks: Optional[torch.Tensor] = None, k_scale: Optional[float] = None,
                     v_scale: Optional[float] = None, max_kv_len: Optional[int] = None, *,
                     workspace: Optional[DecodeWorkspace] = None,
                     config: Optional[DecodeConfig] = None) -> None:
    """out[b] = softmax over request b's visible keys of q[b] . k, times v (see module doc).

    q [B, H, D]; k_buf [S, KVH, D]; v_buf [S, KVH, Dv]; out [B, H, Dv] (written, any float
    dtype). kv_indptr int32 [B+1], kv_indices int64, kv_pos0 int64 [B], q_pos int64 [B].
    window None/0: none. logit_cap > 0: cap * tanh(s / cap) after scaling. sinks fp32 [H]:
    raw logits in the denominator only. k_scale/v_scale multiply the loaded K/V values.
    max_kv_len (host int, optional) only sizes the split grid. workspace: scratch from
    make_decode_workspace (its split count wins) so graph capture allocates nothing; without
    it, a multi-split call allocates scratch at the first call of its kind (shapes, devices,
    stream, thread, max_kv_len's power of two) and reuses it for the calls like it. No host sync
    either way.
    """
    if workspace is None and config is None:
        plan = _public_plan(q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, q_pos, out, sinks, max_kv_len)
    else:
        _check_decode(q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, q_pos, out, sinks)
        check_max_kv_len(max_kv_len)
        plan = _make_plan(q, k_buf, v_buf, out, max_kv_len, workspace, config)
    check_attention_options(scaling, window, logit_cap, sinks)   # (after the shapes: a plan's key holds them)
    if scaling is None:   # (as the CPU kernels and the layer read it)
        scaling = q.shape[-1] ** -0.5
    if q.shape[0] == 0:
        return
    _run(plan, q, out, decode_layer(k_buf, v_buf, sinks, scaling, window, logit_cap, k_scale, v_scale, False),
         (kv_indptr, kv_indices, kv_pos0, q_pos))


# plans of public calls by what their checks and plan read: a call like an earlier one (the same shapes, last-dim
# strides, buffer strides, devices, list bound's power of two, stream and thread) skips the checks and the
# workspace allocation
_PUBLIC_PLANS: Dict[Tuple[Any, ...], DecodePlan] = {}


def _public_plan(q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, q_pos, out, sinks, max_kv_len) -> DecodePlan:
    """The plan of a `decode_attention` call without workspace or config: checked and made at the first call of
    its signature, then reused, its split-K scratch too. That is safe because the key holds the stream and the
    calling thread: one thread's calls on one stream run in order (another thread's split could otherwise land
    between this call's split and merge launches on a shared stream), and the in-place merge's counters return to
    zero at the end of each launch. `max_kv_len` is rounded up to a power of two first (it only sizes the split
    grid, as an upper bound), so a caller passing each step's growing maximum keeps a few plans, not one a step.
    A kv_indices with a strided last dim is never cached (its length is not in the key, and only a one-entry view
    may be strided), nor is a call while a graph is being captured (its workspace must not be one an eager call
    shares). Host work: one tuple of C-level reads and one dict lookup instead of ~20 check helpers and three
    scratch allocations; the key holds the dtypes `_check_decode` checks, and the list values (which change
    between calls of one kind) are checked on every call where they are checkable (CPU, HWKV_DEBUG)."""
    if max_kv_len is not None and (type(max_kv_len) is not int or max_kv_len < 0):
        check_max_kv_len(max_kv_len)
    try:
        dev = q.device
        bound = None if max_kv_len is None else next_pow2(max_kv_len)
        key = _public_key(q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, q_pos, out, sinks, dev, bound)
    except (AttributeError, IndexError, TypeError, RuntimeError):   # no tensor, a 0-d one: the checks name it
        _check_decode(q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, q_pos, out, sinks)
        raise
    plan = _PUBLIC_PLANS.get(key)
    if plan is not None and not _capturing(dev):
        check_csr_values(kv_indptr, kv_indices, k_buf.shape[0])  # the dtypes are the key's; values change
        return plan
    _check_decode(q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, q_pos, out, sinks)
    plan = _make_plan(q, k_buf, v_buf, out, bound, None, None)
    if not _capturing(dev) and kv_indices.stride(-1) == 1:
        if len(_PUBLIC_PLANS) >= 64:
            _PUBLIC_PLANS.clear()
        _PUBLIC_PLANS[key] = plan
    return plan


def _public_key(q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, q_pos, out, sinks, dev, bound) -> Tuple[Any, ...]:
    """What fixes a public call's plan (see `_public_plan`)."""
    return (q.shape, k_buf.shape, v_buf.shape, out.shape, kv_indptr.shape, kv_indices.dim(), kv_pos0.shape,
            q_pos.shape, sinks.shape if sinks is not None else None, q.stride(-1), out.stride(-1), k_buf.stride(),
            v_buf.stride(), kv_indptr.stride(-1), kv_indices.stride(-1), kv_pos0.stride(-1), q_pos.stride(-1),
            sinks.stride(-1) if sinks is not None else None, dev, k_buf.get_device(), v_buf.get_device(),
            kv_indptr.get_device(), kv_indices.get_device(), kv_pos0.get_device(), q_pos.get_device(),
            out.get_device(), sinks.get_device() if sinks is not None else None, bound, current_stream(dev),
            threading.get_ident(), q.dtype, k_buf.dtype, v_buf.dtype, out.dtype, kv_indptr.dtype, kv_indices.dtype,
            kv_pos0.dtype, q_pos.dtype, sinks.dtype if sinks is not None else None)


def plan_decode(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indptr: torch.Tensor,
                kv_indices: torch.Tensor, kv_pos0: torch.Tensor, q_pos: torch.Tensor, out: torch.Tensor,
                sinks: Optional[torch.Tensor] = None, max_kv_len: Optional[int] = None, *,
                workspace: Optional[DecodeWorkspace] = None, config: Optional[DecodeConfig] = None) -> DecodePlan:
    """Check one call's arguments as `decode_attention` does and plan it (split count, workspace: the given one,
    else the scratch of `decode_attention`'s plan of the same kind, made and checked at the first call of its
    kind: a forward like an earlier one neither checks nor allocates again). Calls with the same shapes, the same
    index list and q_pos reuse the plan through `decode_attention_planned`."""
    lists = (kv_indptr, kv_indices, kv_pos0, q_pos)
    if workspace is None and config is None:
        kind = _public_plan(q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, q_pos, out, sinks, max_kv_len)
        forward_args = lists + kind.forward_args
        return kind._replace(lists=lists, forward_args=forward_args,
                             forward_spec=spec(_decode_split_kernel, forward_args, _FORWARD_AT))
    _check_decode(q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, q_pos, out, sinks)
    check_max_kv_len(max_kv_len)
    return _make_plan(q, k_buf, v_buf, out, max_kv_len, workspace, config, lists)


def decode_attention_planned(plan: DecodePlan, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                             kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_pos0: torch.Tensor,
                             q_pos: torch.Tensor, out: torch.Tensor, scaling: float,
                             window: Optional[int] = None, logit_cap: float = 0.0,
                             sinks: Optional[torch.Tensor] = None, k_scale: Optional[float] = None,
                             v_scale: Optional[float] = None, layer: Optional[DecodeLayer] = None) -> None:
    """`decode_attention` under a plan from `plan_decode` (internal: the backend's per-layer call).

    `layer`: this layer's `decode_layer(k_buf, v_buf, sinks, scaling, ...)`, kept by the caller across forwards
    (made here when None). q, out and the layer's buffers and sinks are compared with the plan (tuple
    compares; the sinks' layout too, as every layer of a plan has its own); a call that differs, or whose index lists
    are not the plan's, takes the checked
    `decode_attention` (which raises the typed error, or runs it).
    """
    if layer is None:
        layer = decode_layer(k_buf, v_buf, sinks, scaling, window, logit_cap, k_scale, v_scale)
    lists = plan.lists
    qs, os_ = q.stride(), out.stride()  # read once: the check and the launch share them
    if (q.shape != plan.q_shape or out.shape != plan.out_shape or layer.geometry != plan.geometry
            or (qs[-1] != 1 and plan.q_shape[2] > 1) or (os_[-1] != 1 and plan.out_shape[2] > 1)
            or q.get_device() != layer.geometry[4] or out.get_device() != layer.geometry[4]
            or (layer.sinks is not None and layer.sinks != (plan.q_shape[1:2], layer.geometry[4], True))
            or lists is None or lists[0] is not kv_indptr or lists[1] is not kv_indices
            or lists[2] is not kv_pos0 or lists[3] is not q_pos):
        decode_attention(q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, q_pos, out, scaling, window, logit_cap,
                         sinks, k_scale, v_scale, config=plan.config)
        return
    _run(plan, q, out, layer, lists, qs, os_)


def compile_split_for_sm90(config: DecodeConfig, splits: int = 1, fused: bool = False, max_kv_len: int = 4096,
                           group: int = 8, kv_heads: int = 8, d: int = 64, dtype: str = "bf16", sinks: bool = True,
                           cap: bool = False, pool_elements: int = 1 << 30) -> Any:
    """Compile the split kernel for an sm_90 target without a GPU (TTGIR -> PTX -> cubin through the wheel's ptxas),
    with the constexprs a plan of this shape takes under `config` and the specialisations the JIT gives real launches
    (16-byte aligned pointers and strides); pools of `pool_elements` (2**31 or more: 64-bit gathers). For CI and for
    checking a Triton upgrade without a Hopper GPU."""
    consts = _split_consts(config, group, kv_heads, d, d, splits, cdiv(max_kv_len, splits), fused and splits > 1,
                           pdl=splits > 1 and not fused and config.pdl and gdc_wait is not None,
                           pool_elements=pool_elements)
    options = dict(num_warps=consts.pop("num_warps"), num_stages=consts.pop("num_stages"))
    consts.update(HAS_CAP=cap, HAS_SINKS=sinks, F32=False)
    sig = {n: "i32" for n in _decode_split_kernel.arg_names if n not in consts}   # strides, window, split count
    sig.update({n: f"*{dtype}" for n in ("q", "out", "k_buf", "v_buf")})
    sig.update(sinks="*fp32", ws_acc="*fp32", ws_lse="*fp32", ws_counts="*i32", kv_indptr="*i32", kv_indices="*i64",
               kv_pos0="*i64", q_pos="*i64", qk_scale="fp32", v_scale="fp32", cap="fp32")
    aligned = [n for n in sig if sig[n].startswith("*")] + ["s_qb", "s_qh", "s_ob", "s_oh", "s_kb", "s_kh", "s_vb",
                                                            "s_vh"]
    return build_for_sm90(_decode_split_kernel, sig, consts, aligned, options)
