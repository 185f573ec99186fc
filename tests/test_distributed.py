"""Context parallelism (hwkv.distributed) over gloo with 2 and 4 processes: each rank computes only its
shard of K/V and saves through cp_allgather_and_save_kv; pools and outputs must equal a single-process run
that saves the full K/V directly, nothing may translate per layer, and a forward with a plan costs one
small collective and one host read for the plan plus one collective per layer for K/V, nothing else
(counted: the torch.distributed functions wrapped, and c10d ops and host reads seen by a dispatch mode).
Bad per-forward input raises the same typed error on every rank (cp_plan), bad per-layer input raises on
the bad rank before its gather (or on every rank with check_ranks / HWKV_DEBUG); no pool changes.
One spawn per world size holds all its checks."""
from __future__ import annotations

import collections
import contextlib
import gc
import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

import hwkv
from hwkv.allocator import SWATokenToKVPoolAllocator
from hwkv.release import release_out_of_window_batch
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.devices import discover
from hwkv.distributed import BACKENDS, CPShards, cp_allgather_and_save_kv, cp_plan, default_backend
from hwkv.errors import ConfigError, LocError, MissingSWALocError, ShapeError, ShardError
from hwkv.layer import AttentionLayer
from hwkv.loc import KVWriteLoc
from hwkv.pool import SWAKVPool

I64 = torch.int64
EXTEND, DECODE = ForwardMode.EXTEND, ForwardMode.DECODE
# how a forward saves: "plan" cp_plan(pool=) once then shards=; "self" the public plan-less signature;
# "debug" HWKV_DEBUG=1 while planning; "rank0" cp_plan(check_ranks=True) on rank 0 only
PLAN, SELF, DEBUG, RANK0 = "plan", "self", "debug", "rank0"


@dataclass(frozen=True)
class Scenario:
    page_size: int
    window: int
    size: int
    size_swa: int
    layer_is_swa: Tuple[bool, ...]
    head_dim: int
    v_head_dim: int
    # per forward: mode, new tokens per request, shard sizes (None: cp_plan's even split), how it saves
    steps: Tuple[Tuple[ForwardMode, Tuple[int, ...], Optional[Tuple[int, ...]], str], ...]
    num_heads: int = 4
    num_kv_heads: int = 2


SCENARIOS: Dict[int, Scenario] = {
    2: Scenario(page_size=1, window=8, size=256, size_swa=64, layer_is_swa=(True, False, True, False),
                head_dim=16, v_head_dim=16,
                steps=((EXTEND, (5, 13, 20), None, PLAN),         # requests longer than W, equal shards
                       (EXTEND, (3, 9, 6), (11, 7), SELF),        # chunked prefill, the public signature
                       (DECODE, (1, 1, 1), None, PLAN),           # 3 tokens over 2 ranks
                       (EXTEND, (12, 1, 4), (0, 17), PLAN),       # an empty shard
                       (DECODE, (1, 1, 1), None, DEBUG))),
    4: Scenario(page_size=4, window=6, size=256, size_swa=96, layer_is_swa=(True, True, False),
                head_dim=16, v_head_dim=8,
                steps=((EXTEND, (7, 10, 3), None, PLAN),
                       (EXTEND, (5, 2, 9), (0, 9, 1, 6), PLAN),
                       (DECODE, (1, 1, 1), None, SELF),           # shards [1, 1, 1, 0]
                       (EXTEND, (4, 11, 2), (3, 3, 8, 3), PLAN),
                       (DECODE, (1, 1, 1), None, RANK0))),
}

# what one forward costs, per how: (plan's collectives, host reads), (each layer's collectives, host reads)
# ("self" forwards count the cp_plan the test makes for local_slice)
EXPECTED_COST = {PLAN: ([1, 1], [1, 0]), SELF: ([1, 1], [2, 1]), DEBUG: ([1, 1], [2, 1]), RANK0: ([1, 1], [2, 1])}


def allocate_batch(alloc, rtt, rows: torch.Tensor, seq: torch.Tensor, mode: ForwardMode,
                   new_lens: Sequence[int]) -> ForwardBatch:
    """Slots for `new_lens` new tokens after each request's `seq`, written into req_to_token; the ForwardBatch
    (its seq_lens the lengths after it)."""
    new = torch.tensor(list(new_lens), dtype=I64)
    prefix, seq = seq.clone(), seq + new
    table = rtt.req_to_token
    last = torch.where(prefix > 0, table[rows, (prefix - 1).clamp(min=0)], -1)
    if mode == DECODE:
        loc = alloc.alloc_decode(seq, last, seq_lens_cpu=seq)
    else:
        loc = alloc.alloc_extend(prefix, seq, last, int(new.sum()), prefix_lens_cpu=prefix, seq_lens_cpu=seq)
    start = 0
    for row, p, n in zip(rows.tolist(), prefix.tolist(), new.tolist()):
        rtt.write(row, p, loc[start:start + n])
        start += n
    return ForwardBatch(mode, len(new_lens), rows, seq, loc, extend_prefix_lens=prefix, extend_seq_lens=new,
                        seq_lens_cpu=seq, extend_seq_lens_cpu=new)


class Engine:
    """The README's "Use from an engine" setup on CPU: SWAKVPool + SWA allocator + ReqToTokenPool + backend."""

    def __init__(self, sc: Scenario, num_requests: int = 3) -> None:
        self.sc = sc
        swa = [i for i, s in enumerate(sc.layer_is_swa) if s]
        full = [i for i, s in enumerate(sc.layer_is_swa) if not s]
        self.pool = SWAKVPool(size=sc.size, size_swa=sc.size_swa, page_size=sc.page_size, dtype=torch.float32,
                              head_num=sc.num_kv_heads, head_dim=sc.head_dim, swa_attention_layer_ids=swa,
                              full_attention_layer_ids=full, device="cpu", v_head_dim=sc.v_head_dim)
        self.alloc = SWATokenToKVPoolAllocator(sc.size, sc.size_swa, sc.page_size, "cpu", self.pool)
        self.rtt = hwkv.ReqToTokenPool(size=num_requests + 1, max_context_len=128, device="cpu")
        self.backend = hwkv.make_backend(self.pool, self.rtt, device="cpu", sliding_window=sc.window)
        self.layers = [AttentionLayer(i, sc.num_heads, sc.num_kv_heads, sc.head_dim, v_head_dim=sc.v_head_dim,
                                      sliding_window=sc.window if s else None)
                       for i, s in enumerate(sc.layer_is_swa)]
        self.rows = torch.tensor(self.rtt.alloc(num_requests), dtype=I64)
        self.seq = torch.zeros(num_requests, dtype=I64)
        self.frontiers = torch.zeros(num_requests, dtype=I64)

    def allocate(self, mode: ForwardMode, new_lens: Sequence[int]) -> ForwardBatch:
        """Slots for the new tokens of every request, written into req_to_token; the ForwardBatch."""
        batch = allocate_batch(self.alloc, self.rtt, self.rows, self.seq, mode, new_lens)
        self.seq = batch.seq_lens
        return batch

    def release(self) -> None:
        release_out_of_window_batch(self.alloc, self.rtt.req_to_token, self.rows, self.seq, self.frontiers,
                                    self.sc.window)

    def check_integrity(self) -> None:
        self.alloc.check_integrity()
        self.pool.check_integrity()
        self.rtt.check_integrity()


def inputs(step: int, layer: AttentionLayer, t: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward's full q, k, v of one layer: the same on every rank (seeded by step and layer)."""
    g = torch.Generator().manual_seed(1000 * step + layer.layer_id)
    q = torch.randn(t, layer.num_heads, layer.head_dim, generator=g)
    k = torch.randn(t, layer.num_kv_heads, layer.head_dim, generator=g)
    v = torch.randn(t, layer.num_kv_heads, layer.v_head_dim, generator=g)
    return q, k, v


def snapshot(pool: SWAKVPool) -> List[torch.Tensor]:
    return [b.clone() for sub in (pool.full_kv_pool, pool.swa_kv_pool) for b in sub.k_buffer + sub.v_buffer]


def same_pools(a: SWAKVPool, b: SWAKVPool) -> bool:
    return all(torch.equal(x, y) for x, y in zip(snapshot(a), snapshot(b))) and torch.equal(
        a.full_to_swa_index_mapping, b.full_to_swa_index_mapping)


def count_translations(pool: SWAKVPool) -> List[int]:
    """Wrap the pool's translate method: every translation anyone asks for is counted in the list."""
    calls, translate = [0], pool.translate_loc_from_full_to_swa

    def counted(*args, **kwargs):
        calls[0] += 1
        return translate(*args, **kwargs)

    pool.translate_loc_from_full_to_swa = counted
    return calls


def even_split(t: int, world: int) -> Tuple[int, ...]:
    return tuple(t // world + (r < t % world) for r in range(world))


COLLECTIVES = tuple(n for n in (
    "all_gather_single", "all_gather_into_tensor", "all_gather", "all_gather_object", "all_reduce", "all_to_all",
    "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list", "gather",
    "gather_object", "irecv", "isend", "monitored_barrier", "recv", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "scatter", "scatter_object_list", "send") if hasattr(dist, n))


class Probe:
    """Inside `with probe.window() as c:` counts every torch.distributed collective function called
    (c["collectives"], by name in c["py:<name>"]), every c10d op dispatched (c["c10d"], any route), and
    every host read of a tensor value (c["host_reads"]: aten._local_scalar_dense, i.e. item/bool/int, and
    Tensor.tolist). Installed once per worker: the module looks dist functions up at call time."""

    def __init__(self) -> None:
        self.counts: Optional[collections.Counter] = None
        for name in COLLECTIVES:
            setattr(dist, name, self._counted(name, getattr(dist, name)))
        tolist = torch.Tensor.tolist

        def counted_tolist(t: torch.Tensor):
            if self.counts is not None:
                self.counts["host_reads"] += 1
            return tolist(t)

        torch.Tensor.tolist = counted_tolist

    def _counted(self, name: str, fn: Callable) -> Callable:
        def counted(*args, **kwargs):
            if self.counts is not None:
                self.counts["collectives"] += 1
                self.counts["py:" + name] += 1
            return fn(*args, **kwargs)
        return counted

    @contextlib.contextmanager
    def window(self) -> Iterator[collections.Counter]:
        counts = collections.Counter()
        probe = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if probe.counts is not None:
                    if func.namespace == "c10d":
                        probe.counts["c10d"] += 1
                    elif func is torch.ops.aten._local_scalar_dense.default:
                        probe.counts["host_reads"] += 1
                return func(*args, **(kwargs or {}))

        self.counts = counts
        try:
            with Mode():
                yield counts
        finally:
            self.counts = None


def cost(c: collections.Counter) -> List[int]:
    """[collectives, host reads] of one window; every collective function called is one c10d op."""
    assert c["collectives"] == c["c10d"], dict(c)
    assert set(c) <= {"collectives", "c10d", "host_reads", "py:all_gather_single", "py:all_gather_into_tensor"}, \
        dict(c)
    return [c["collectives"], c["host_reads"]]


@contextlib.contextmanager
def env(name: str, value: Optional[str]) -> Iterator[None]:
    old = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


# ---- the spawned jobs ---------------------------------------------------------------------------------

def run_equivalence(sc: Scenario, rank: int, world: int, probe: Probe) -> Dict[str, object]:
    """Every forward: CP saves of each rank's shard equal direct saves of the full K/V, pools and outputs;
    what the plan and each layer's save cost in collectives and host reads."""
    cp, ref = Engine(sc), Engine(sc)
    calls = count_translations(cp.pool)
    per_forward, costs = [], []
    for step, (mode, new_lens, sizes, how) in enumerate(sc.steps):
        batch, ref_batch = cp.allocate(mode, new_lens), ref.allocate(mode, new_lens)
        assert torch.equal(batch.out_cache_loc, ref_batch.out_cache_loc)
        writes0, windows0, calls0 = cp.backend.loc_cache.translations, cp.backend.window_translations, calls[0]
        md = cp.backend.init_forward_metadata(batch)
        ref.backend.init_forward_metadata(ref_batch)
        calls_md = calls[0]
        t = batch.num_tokens
        local = None if sizes is None else sizes[rank]
        with probe.window() as plan_cost, env("HWKV_DEBUG", "1" if how == DEBUG else None):
            shards = cp_plan(md.write_loc, local, pool=cp.pool, check_ranks=True if how == RANK0 and rank == 0
                             else None)
        assert shards.sizes == (sizes or even_split(t, world)) and shards.num_tokens == t
        assert (shards.dtype, shards.device_type, shards.check_ranks) == (torch.float32, "cpu", how in (DEBUG, RANK0))
        assert shards.groups == ((sc.num_kv_heads, sc.head_dim, sc.v_head_dim),) * 2
        layer_costs = []
        for layer in cp.layers:
            q, k, v = inputs(step, layer, t)
            k_mine, v_mine = k[shards.local_slice].clone(), v[shards.local_slice].clone()
            k_before, v_before = k_mine.clone(), v_mine.clone()
            with probe.window() as c:
                if how == SELF:
                    k_full, v_full = cp_allgather_and_save_kv(cp.pool, layer, md.write_loc, k_mine, v_mine,
                                                              dist.group.WORLD)
                else:
                    k_full, v_full = cp_allgather_and_save_kv(cp.pool, layer, md.write_loc, k_mine, v_mine,
                                                              shards=shards)
            layer_costs.append(cost(c))
            assert torch.equal(k_mine, k_before) and torch.equal(v_mine, v_before)  # inputs untouched
            assert torch.equal(k_full, k) and torch.equal(v_full, v)
            out = cp.backend.forward(q, k_full, v_full, layer, batch, save_kv_cache=False)
            assert torch.equal(out, ref.backend.forward(q, k, v, layer, ref_batch)), (step, layer.layer_id)
        costs.append({"how": how, "plan": cost(plan_cost), "layers": layer_costs})
        # translation happened in the metadata step only: the write locs once, each window list once
        assert calls[0] == calls_md, "a CP save translated locations"
        assert cp.backend.loc_cache.translations == writes0 + 1
        assert calls_md - calls0 == 1 + (cp.backend.window_translations - windows0)
        assert same_pools(cp.pool, ref.pool), f"step {step}: pools differ"
        per_forward.append([cp.backend.loc_cache.translations - writes0, calls[0] - calls0, len(cp.layers)])
        cp.release()
        ref.release()
        cp.check_integrity()
    swa_live = sc.size_swa - cp.alloc.swa_available_size()
    return {"forwards": per_forward, "costs": costs, "swa_slots_released": int(cp.frontiers.sum()) > 0,
            "swa_live": swa_live}


def other_pool(sc: Scenario, head_dim: Optional[int] = None, swap: bool = False, device: str = "cpu") -> SWAKVPool:
    """A pool unlike the scenario's: another head_dim, the SWA and full layer ids swapped, or on `device`."""
    swa = [i for i, s in enumerate(sc.layer_is_swa) if s != swap]
    full = [i for i, s in enumerate(sc.layer_is_swa) if s == swap]
    return SWAKVPool(size=sc.size, size_swa=sc.size_swa, page_size=sc.page_size, dtype=torch.float32,
                     head_num=sc.num_kv_heads, head_dim=head_dim or sc.head_dim, swa_attention_layer_ids=swa,
                     full_attention_layer_ids=full, device=device, v_head_dim=sc.v_head_dim)


def run_bad_inputs(sc: Scenario, rank: int, world: int, probe: Probe) -> Dict[str, object]:
    """The last rank alone gets bad input. Per-forward checks (cp_plan, the plan-less call, check_ranks /
    HWKV_DEBUG) raise the same error on every rank; the default per-layer checks raise on the bad rank only,
    before any collective, while the others stay out of the call. No pool may change."""
    eng, ref = Engine(sc, num_requests=2), Engine(sc, num_requests=2)
    batch, ref_batch = eng.allocate(EXTEND, (6, 9)), ref.allocate(EXTEND, (6, 9))
    md = eng.backend.init_forward_metadata(batch)
    ref.backend.init_forward_metadata(ref_batch)
    wl, t, bad, last = md.write_loc, batch.num_tokens, rank == world - 1, world - 1
    shards = cp_plan(wl, pool=eng.pool)
    swa_layer = next(l for l in eng.layers if l.is_swa)
    full_layer = next(l for l in eng.layers if not l.is_swa)
    _, k, v = inputs(0, swa_layer, t)
    k_mine, v_mine = k[shards.local_slice], v[shards.local_slice]
    n, kvh, d = k_mine.shape
    n_last = shards.sizes[last]  # what the last rank holds: every rank's message names it
    sid = swa_layer.layer_id
    before = snapshot(eng.pool)
    every: List[List[str]] = []   # raised on every rank
    local: List[List[str]] = []   # raised on the bad rank only

    def unchanged() -> bool:
        return all(torch.equal(x, y) for x, y in zip(before, snapshot(eng.pool)))

    def expect(error: type, match: str, call: Callable[[], object]) -> None:
        with pytest.raises(error, match=match) as e:
            call()
        assert unchanged(), f"{match}: pool changed"
        every.append([type(e.value).__name__, str(e.value)])

    def expect_local(error: type, match: str, call: Callable[[], object]) -> None:
        """Only the bad rank calls: it raises before any collective (so no other rank may be in one)."""
        if bad:
            with probe.window() as c, pytest.raises(error, match=match) as e:
                call()
            assert cost(c) == [0, 0], f"{match}: collectives or host reads before the local error"
            assert "raised on this rank only, before its K/V gather" in str(e.value)
            local.append([type(e.value).__name__, str(e.value)])
        assert unchanged(), f"{match}: pool changed"

    def save(layer=swa_layer, write_loc=wl, k_=k_mine, v_=v_mine, plan: Optional[CPShards] = shards,
             pool=eng.pool, **kw):
        return cp_allgather_and_save_kv(pool, layer, write_loc, k_, v_, shards=plan, **kw)

    def checked(**kw):  # the opt-in per-layer agreement
        return save(check_ranks=True, **kw)

    short = KVWriteLoc(wl.loc[:-1], wl.swa_loc[:-1])
    # -- per forward, in cp_plan: every rank
    expect(ShardError, rf"shards of .* add up to {t + 1}, len\(write_loc\) is {t}",
           lambda: cp_plan(wl, shards.local_size + bad))
    expect(ShardError, rf"disagree on the forward's token count .*\[{t}, .*{t - 1}\]",
           lambda: cp_plan(short if bad else wl))
    expect(ShardError, rf"rank {last}: local_num_tokens must be an int in \[0, {t}\] .*, got {t + 5}",
           lambda: cp_plan(wl, t + 5 if bad else shards.local_size))
    expect(LocError, rf"rank {last}: write_loc must be a KVWriteLoc or an int token count .*got Tensor",
           lambda: cp_plan(wl.loc if bad else wl))
    expect(ShapeError, r"ranks' K/V dtypes differ: \['torch.float32', .*'torch.float64'\]",
           lambda: cp_plan(wl, pool=eng.pool, dtype=torch.float64 if bad else None))
    expect(ShapeError, rf"ranks' pools differ .*rank 0: full \[{kvh}, {d}, .*rank {last}: full \[{kvh}, {d + 8}, ",
           lambda: cp_plan(wl, pool=other_pool(sc, head_dim=d + 8) if bad else eng.pool))
    expect(ShapeError, r"ranks' pools differ \(layer groups' \[KVH, D, Dv\] and which layer ids are SWA\)",
           lambda: cp_plan(wl, pool=other_pool(sc, swap=True) if bad else eng.pool))
    expect(ConfigError, r"ranks' pools are on different device types: \['cpu', .*'meta'\]",
           lambda: cp_plan(wl, pool=other_pool(sc, device="meta") if bad else eng.pool))
    expect(ConfigError, rf"cp_plan got pool= on ranks \[{last}\] only",
           lambda: cp_plan(wl, pool=eng.pool if bad else None))
    expect(MissingSWALocError, rf"the write locs of ranks \[{last}\] have no swa_loc",
           lambda: cp_plan(KVWriteLoc(wl.loc) if bad else wl))
    # -- the plan-less call: plan and layer checks in one agreement, every rank
    expect(ShardError, "disagree on the forward's token count",
           lambda: cp_allgather_and_save_kv(eng.pool, swa_layer, short if bad else wl, k_mine, v_mine, None))
    expect(LocError, rf"rank {last}: write_loc must be a KVWriteLoc \(.*got Tensor",
           lambda: save(write_loc=wl.loc if bad else wl, plan=None))
    expect(ShapeError, r"ranks' K/V dtypes differ: .*torch.float64",
           lambda: save(k_=k_mine.double() if bad else k_mine, v_=v_mine.double() if bad else v_mine, plan=None))
    expect(ShapeError, rf"rank {last}: layer {sid}: v has shape \[{n_last}, {kvh}, {sc.v_head_dim + 1}\]",
           lambda: save(v_=torch.zeros(n, kvh, sc.v_head_dim + 1) if bad else v_mine, plan=None))
    # -- per layer, opt-in agreement (check_ranks=True): every rank
    expect(ShapeError, rf"rank {last}: layer {sid}: k has shape \[{n_last}, {kvh}, {d + 1}\], "
                       rf"expected \[{n_last}, {kvh}, {d}\]",
           lambda: checked(k_=torch.zeros(n, kvh, d + 1) if bad else k_mine))
    expect(ShapeError, rf"rank {last}: layer {sid}: v has shape \[{n_last - 1}, ",
           lambda: checked(v_=v_mine[:-1] if bad else v_mine))
    expect(ShapeError, r"k is torch.float32, v is torch.float64",
           lambda: checked(v_=v_mine.double() if bad else v_mine))
    expect(ShapeError, rf"rank {last}: layer {sid}: k and v are torch.float64, the plan agreed on torch.float32",
           lambda: checked(k_=k_mine.double() if bad else k_mine, v_=v_mine.double() if bad else v_mine))
    no_dtype = cp_plan(wl)  # no pool, no dtype: the per-layer agreement still compares the ranks' dtypes
    assert no_dtype.dtype is None and no_dtype.groups is None
    expect(ShapeError, r"ranks' K/V dtypes differ: .*torch.float64",
           lambda: checked(k_=k_mine.double() if bad else k_mine, v_=v_mine.double() if bad else v_mine,
                           plan=no_dtype))
    expect(LocError, rf"rank {last}: write_loc must be a KVWriteLoc \(.*got Tensor",
           lambda: checked(write_loc=wl.loc if bad else wl))
    expect(MissingSWALocError, rf"rank {last}: layer {sid}: an SWA layer, but write_loc has no swa_loc",
           lambda: checked(write_loc=KVWriteLoc(wl.loc) if bad else wl))
    expect(ShardError, r"different layers",
           lambda: checked(layer=full_layer if bad else swa_layer,
                           v_=torch.zeros(n, kvh, full_layer.v_head_dim) if bad else v_mine))
    stale = CPShards(rank, tuple(s + 1 for s in shards.sizes))
    expect(ShardError, rf"rank {last}: layer {sid}: the CPShards plan is for rank {last} of "
                       rf"{world} and {t + world} tokens, this call is rank {last} of {world} with "
                       rf"len\(write_loc\)={t}",
           lambda: checked(plan=stale if bad else shards))
    # HWKV_DEBUG while planning on one rank turns the per-layer agreement on for every rank
    with env("HWKV_DEBUG", "1" if bad else None):
        debug_plan = cp_plan(wl, pool=eng.pool)
    assert debug_plan.check_ranks
    expect(ShapeError, rf"rank {last}: layer {sid}: k has shape \[{n_last}, {kvh}, {d + 1}\]",
           lambda: save(k_=torch.zeros(n, kvh, d + 1) if bad else k_mine, plan=debug_plan))
    # -- per layer, default: local checks, the bad rank only, before its gather
    expect_local(ShapeError, rf"rank {last}: layer {sid}: k has shape \[{n_last}, {kvh}, {d + 1}\], "
                             rf"expected \[{n_last}, {kvh}, {d}\]",
                 lambda: save(k_=torch.zeros(n, kvh, d + 1)))
    expect_local(ShapeError, rf"rank {last}: layer {sid}: v has shape \[{n_last - 1}, ", lambda: save(v_=v_mine[:-1]))
    expect_local(ShapeError, r"k is torch.float32, v is torch.float64", lambda: save(v_=v_mine.double()))
    expect_local(ShapeError, r"k and v are torch.float64, the plan agreed on torch.float32",
                 lambda: save(k_=k_mine.double(), v_=v_mine.double()))
    expect_local(ShapeError, r"layer \d+: k is on meta, the plan agreed on cpu",
                 lambda: save(k_=k_mine.to("meta"), v_=v_mine.to("meta")))
    wide = other_pool(sc, head_dim=d + 8)
    wide_layer = AttentionLayer(sid, sc.num_heads, kvh, d + 8, v_head_dim=sc.v_head_dim, sliding_window=sc.window)
    expect_local(ShapeError, rf"its pool's SWA group is \[{kvh}, {d + 8}, {sc.v_head_dim}\] \[KVH, D, Dv\], "
                             rf"the plan agreed on \[{kvh}, {d}, {sc.v_head_dim}\]",
                 lambda: save(layer=wide_layer, pool=wide, k_=torch.zeros(n, kvh, d + 8)))
    expect_local(LocError, r"write_loc must be a KVWriteLoc \(.*got Tensor", lambda: save(write_loc=wl.loc))
    expect_local(MissingSWALocError, rf"layer {sid}: an SWA layer, but write_loc has no swa_loc",
                 lambda: save(write_loc=KVWriteLoc(wl.loc)))
    expect_local(ShardError, r"the CPShards plan is for rank", lambda: save(plan=stale))
    expect_local(ConfigError, r"layer_id 99 is in none of the pool's layer groups",
                 lambda: save(layer=AttentionLayer(99, sc.num_heads, kvh, d, v_head_dim=sc.v_head_dim)))
    # what the others see: they wait in the K/V gather until the group's timeout, then the collective raises
    quick = dist.new_group(backend="gloo", timeout=timedelta(seconds=1))
    # planned on WORLD (its 60 s timeout): `quick`'s 1 s is for the one gather meant to time out, not for a
    # collective every rank must reach within a second of the others on a loaded machine
    quick_plan = cp_plan(wl, pool=eng.pool)
    waited = None
    if bad:
        with pytest.raises(ShapeError, match="raised on this rank only"):
            save(k_=torch.zeros(n, kvh, d + 1), plan=quick_plan)
    else:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as e:
            cp_allgather_and_save_kv(eng.pool, swa_layer, wl, k_mine, v_mine, quick, shards=quick_plan)
        waited = [type(e.value).__name__, round(time.monotonic() - t0, 1), str(e.value)[:200]]
        del e  # its traceback (a cycle through this frame) held `quick` and the failed gather's work past teardown
    assert unchanged()
    dist.barrier()  # WORLD is still in step; `quick` is not used again
    dist.destroy_process_group(quick)  # on every rank, here, not whenever the garbage collector frees it
    del quick
    # the pool's own refusal of an SWA write without swa_loc stays (a local call: no collective)
    with pytest.raises(MissingSWALocError):
        eng.pool.set_kv_buffer(swa_layer, KVWriteLoc(wl.loc), k, v)
    assert unchanged()
    # the group is still in step: good saves of every layer (a full layer ignores the missing swa_loc)
    for layer in eng.layers:
        q, k, v = inputs(7, layer, t)
        write_loc = wl if layer.is_swa else KVWriteLoc(wl.loc)
        cp_allgather_and_save_kv(eng.pool, layer, write_loc, k[shards.local_slice], v[shards.local_slice],
                                 shards=shards)
        ref.backend.forward(q, k, v, layer, ref_batch)
    assert same_pools(eng.pool, ref.pool)
    return {"every": every, "local": local, "waited": waited}


def worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))  # a desynchronised collective fails, not hangs
    try:
        torch.set_num_threads(1)
        probe = Probe()
        sc = SCENARIOS[world]
        report = {"equivalence": run_equivalence(sc, rank, world, probe),
                  "errors": run_bad_inputs(sc, rank, world, probe)}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
        # every rank done before any tears the group down: a rank destroying it while another still talks
        # to it aborted that process in gloo's teardown ("terminate called without an active exception")
        dist.barrier()
    finally:
        # exceptions the checks caught sit in reference cycles (traceback -> frame -> exception) that keep process
        # groups and failed works alive: free them now, so every group's gloo context is torn down here, after the
        # barrier, and none at interpreter exit in whatever order the ranks finalize
        gc.collect()
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_cp_saves_equal_single_process(tmp_path: Path, world: int) -> None:
    mp.spawn(worker, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world, join=True)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    sc = SCENARIOS[world]
    for rep in reports:
        eq = rep["equivalence"]
        # per forward: one write-loc translation, 1 + one per window in all, however many layers
        assert eq["forwards"] == [[1, 2, len(sc.layer_is_swa)]] * len(sc.steps)
        assert eq["swa_slots_released"] and 0 < eq["swa_live"] < sc.size_swa
        # per forward with a plan: one collective and one host read to plan, one collective per layer for
        # K/V and no host read; plan-less calls and the per-layer agreement add one of each per layer
        for (_, _, _, how), c in zip(sc.steps, eq["costs"]):
            plan_cost, layer_cost = EXPECTED_COST[how]
            assert c == {"how": how, "plan": plan_cost, "layers": [layer_cost] * len(sc.layer_is_swa)}, c
    errors = [rep["errors"] for rep in reports]
    assert len(errors[0]["every"]) == 24
    assert all(e["every"] == errors[0]["every"] for e in errors), "ranks raised different errors"
    assert [len(e["local"]) for e in errors] == [0] * (world - 1) + [10]
    for e in errors[:-1]:  # the others timed out in the gather the bad rank never joined
        name, waited, _ = e["waited"]
        assert name in ("RuntimeError", "DistBackendError") and waited < 30, e["waited"]
    assert errors[-1]["waited"] is None


# ---- in-process -----------------------------------------------------------------------------------------

def test_two_gpu_script_runs_over_gloo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/bench_cp_nccl.py (issue 13's two-GPU run) on 2 CPU processes over gloo: every rank's pool
    equals its single-process save, and the timing fields are filled."""
    import importlib
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # spawned children too
    mod = importlib.import_module("bench_cp_nccl")
    out = tmp_path / "cp.json"
    mod.main(["--spawn", "2", "--device", "cpu", "--tokens", "24", "--layers", "2", "--repeats", "1",
              "--warmup", "0", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["all_pools_equal"] and len(res["rows"]) == 2
    assert all(r["backend"] == "gloo" and r["save_forward_us"] > 0 and r["fraction_of_allgather"] > 0
               for r in res["rows"])


def test_default_backend_by_device_name() -> None:
    assert default_backend(torch.device("cuda", 1)) == "nccl"
    assert default_backend("cuda:0") == default_backend("rocm") == "nccl"
    assert default_backend("npu:3") == "hccl"
    assert default_backend("xpu") == "xccl"
    assert default_backend("musa") == "mccl"
    assert default_backend("cpu") == default_backend(torch.device("cpu")) == "gloo"
    specs = discover()
    assert {name: default_backend(spec) for name, spec in specs.items() if name in BACKENDS} == {
        "cpu": "gloo", "cuda": "nccl", "rocm": "nccl", "npu": "hccl", "xpu": "xccl", "musa": "mccl"}
    with pytest.raises(ConfigError, match=r"device type 'tpu'; known: \['cpu', 'cuda'"):
        default_backend("tpu:0")
    with pytest.raises(ConfigError, match="got int"):
        default_backend(0)


def test_default_backend_xccl_needs_torch_2_8(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.7.1+xpu")
    with pytest.raises(ConfigError, match=r"torch 2.7.1\+xpu has no 'xccl'.*'ccl'"):
        default_backend("xpu:0")
    assert default_backend("cuda") == "nccl"


def test_plan_needs_an_initialized_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match="not initialized"):
        cp_plan(4)


def test_shards_layout() -> None:
    s = CPShards(2, (3, 0, 5, 1))
    assert (s.world_size, s.num_tokens, s.max_size, s.local_size) == (4, 9, 5, 5)
    assert s.offsets == (0, 3, 3, 8, 9) and s.local_slice == slice(3, 8)
