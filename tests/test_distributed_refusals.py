"""Context-parallel refusals found by review (hwkv.distributed over gloo, 2 ranks): every per-forward refusal
raises the same typed error on every rank before anything is written, including what only one rank can see
(its device=, a token count beyond int64, its HWKV_DEBUG); an fp8 pool needs cp_plan's dtype=; fp8 K/V
gather as bytes and save as one process would; check_ranks compares the layers' geometry; a CPShards built
by hand drops its padded rows. Each job runs under a 10 s group timeout and a hard deadline, so a rank
left waiting fails the test instead of hanging it."""
from __future__ import annotations

import importlib
import json
import os
import re
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hwkv
from hwkv.allocator import SWATokenToKVPoolAllocator
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.distributed import CPShards, cp_allgather_and_save_kv, cp_plan
from hwkv.errors import ShardError
from hwkv.layer import AttentionLayer
from hwkv.loc import KVWriteLoc
from hwkv.pool import SWAKVPool

F8 = torch.float8_e4m3fn
KVH, WINDOW, NEW = 2, 4, (5, 4)   # two requests of 5 and 4 new tokens: 9 tokens, shards (5, 4)


class Engine:
    """An SWA pool (layer 0 SWA, layer 1 full), its allocator and backend; one extend forward's write locs."""

    def __init__(self, dtype: torch.dtype = torch.float32, d: int = 8) -> None:
        self.pool = SWAKVPool(64, 32, 1, dtype, KVH, d, [0], [1], "cpu")
        alloc = SWATokenToKVPoolAllocator(64, 32, 1, "cpu", self.pool)
        rtt = hwkv.ReqToTokenPool(size=3, max_context_len=32, device="cpu")
        backend = hwkv.make_backend(self.pool, rtt, device="cpu", sliding_window=WINDOW)
        self.layers = [AttentionLayer(0, 4, KVH, d, sliding_window=WINDOW), AttentionLayer(1, 4, KVH, d)]
        rows = torch.tensor(rtt.alloc(len(NEW)))
        new = torch.tensor(NEW)
        prefix = torch.zeros_like(new)
        loc = alloc.alloc_extend(prefix, new, torch.full_like(new, -1), int(new.sum()), prefix_lens_cpu=prefix,
                                 seq_lens_cpu=new)
        for row, start, n in zip(rows.tolist(), (0, NEW[0]), NEW):
            rtt.write(row, 0, loc[start:start + n])
        batch = ForwardBatch(ForwardMode.EXTEND, len(NEW), rows, new, loc, extend_prefix_lens=prefix,
                             extend_seq_lens=new, seq_lens_cpu=new, extend_seq_lens_cpu=new)
        self.write_loc: KVWriteLoc = backend.init_forward_metadata(batch).write_loc

    def snapshot(self) -> List[torch.Tensor]:
        """Every K/V buffer as bytes (fp8 compares bit for bit)."""
        subs = (self.pool.full_kv_pool, self.pool.swa_kv_pool)
        return [b.view(torch.uint8).clone() for s in subs for b in s.k_buffer + s.v_buffer]

    def same(self, snap: List[torch.Tensor]) -> bool:
        return all(torch.equal(a, b) for a, b in zip(snap, self.snapshot()))


def kv(layer: AttentionLayer, t: int = sum(NEW)) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(layer.layer_id)
    return torch.randn(t, KVH, layer.head_dim, generator=g), torch.randn(t, KVH, layer.v_head_dim, generator=g)


def raised(call: Callable[[], object]) -> Optional[List[str]]:
    """[error type, message] of what call() raised, None when it returned."""
    try:
        call()
    except Exception as e:  # noqa: BLE001  (the test compares what every rank raised)
        return [type(e).__name__, str(e)]
    return None


# ---- the jobs (one per spawn; each returns what its rank saw) --------------------------------------------

def job_fp8_plan(rank: int) -> Dict[str, object]:
    """An fp8 pool planned without dtype=, then with ranks computing K/V in bf16 and fp16 (same itemsize)."""
    eng = Engine(F8)
    before = eng.snapshot()
    out = {"no dtype": raised(lambda: cp_plan(eng.write_loc, pool=eng.pool)),
           "mixed": raised(lambda: cp_plan(eng.write_loc, pool=eng.pool,
                                           dtype=torch.bfloat16 if rank == 0 else torch.float16))}
    out["unchanged"] = eng.same(before)
    return out


def fp8_save(rank: int) -> Dict[str, object]:
    """fp8 K/V into an fp8 pool, planned (dtype=fp8) and plan-less: each rank's pool equals one process's save."""
    eng, ref = Engine(F8), Engine(F8)
    plan = cp_plan(eng.write_loc, pool=eng.pool, dtype=F8)
    gathered = []
    for layer in eng.layers:
        k, v = (x.to(F8) for x in kv(layer))
        k_mine, v_mine = k[plan.local_slice].clone(), v[plan.local_slice].clone()
        how = {"shards": plan} if layer.is_swa else {}   # the full layer through the plan-less signature
        k_full, v_full = cp_allgather_and_save_kv(eng.pool, layer, eng.write_loc, k_mine, v_mine, **how)
        gathered.append(torch.equal(k_full.view(torch.uint8), k.view(torch.uint8))
                        and torch.equal(v_full.view(torch.uint8), v.view(torch.uint8)))
        ref.pool.set_kv_buffer(layer, ref.write_loc, k, v)
    return {"gathered": gathered, "pools equal": eng.same(ref.snapshot())}


def job_geometry(rank: int) -> Dict[str, object]:
    """check_ranks=True without pool=: rank 1's layers and pool have head_dim 16, rank 0's 8."""
    eng = Engine(d=8 if rank == 0 else 16)
    plan = cp_plan(eng.write_loc, check_ranks=True)
    before = eng.snapshot()
    layer = eng.layers[1]
    k, v = kv(layer)
    out = {"error": raised(lambda: cp_allgather_and_save_kv(eng.pool, layer, eng.write_loc, k[plan.local_slice],
                                                            v[plan.local_slice], shards=plan))}
    out["unchanged"] = eng.same(before)
    return out


def job_one_rank_plan(rank: int) -> Dict[str, object]:
    """What only rank 1 sees, in cp_plan: its device=, a token count past int64, its HWKV_DEBUG."""
    eng = Engine()
    wl, bad = eng.write_loc, rank == 1
    before = eng.snapshot()
    out: Dict[str, object] = {}
    for name, device in (("cuda", "cuda:99"), ("string", "gpu0"), ("backend", "meta")):
        out[name] = raised(lambda: cp_plan(wl, pool=eng.pool, device=device if bad else None))
    out["count"] = raised(lambda: cp_plan(2 ** 63 if bad else 9))
    out["count below"] = raised(lambda: cp_plan(-2 ** 70 if bad else 9))
    out["local"] = raised(lambda: cp_plan(9, 2 ** 70 if bad else 5))
    if bad:
        os.environ["HWKV_DEBUG"] = "maybe"
    out["env"] = raised(lambda: cp_plan(wl, pool=eng.pool))
    os.environ.pop("HWKV_DEBUG", None)
    out["then"] = cp_plan(wl, pool=eng.pool).sizes   # the group is still in step
    out["unchanged"] = eng.same(before)
    return out


def hand_built_shards(rank: int) -> Dict[str, object]:
    """Unequal shards (6, 3) from CPShards(rank, sizes), as tests build them: the padded rows are dropped."""
    eng, ref = Engine(), Engine()
    shards = CPShards(rank, (6, 3))
    layer = eng.layers[1]
    k, v = kv(layer)
    k_full, v_full = cp_allgather_and_save_kv(eng.pool, layer, eng.write_loc, k[shards.local_slice],
                                              v[shards.local_slice], shards=shards)
    ref.pool.set_kv_buffer(layer, ref.write_loc, k, v)
    return {"gathered": torch.equal(k_full, k) and torch.equal(v_full, v), "pools equal": eng.same(ref.snapshot())}


def job_saves(rank: int) -> Dict[str, object]:
    """Both saves in one spawn; each one's error (raised on every rank, after its gather) is reported."""
    out: Dict[str, object] = {}
    for name, save in (("fp8", fp8_save), ("hand-built", hand_built_shards)):
        try:
            out[name] = save(rank)
        except Exception as e:  # noqa: BLE001  (the test fails on it)
            out[name] = f"{type(e).__name__}: {e}"
    return out


# ---- spawning --------------------------------------------------------------------------------------------

def _job(job: str):
    """A job of this module by name, or another test module's as 'module:function' (the spawned rank imports it)."""
    if ":" not in job:
        return globals()[job]
    module, name = job.split(":")
    return getattr(importlib.import_module(module), name)


def worker(rank: int, world: int, job: str, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=10))   # a rank left in a collective fails in 10 s
    torch.set_num_threads(1)
    try:
        result = _job(job)(rank)
    except BaseException as e:  # noqa: BLE001  (reported to the test, which fails on it)
        result = {"crashed": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result, default=str))
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(job: str, tmp_path: Path, deadline_s: float = 50, world: int = 2) -> List[Dict[str, object]]:
    """Run `job` on `world` gloo ranks (it reads its world from the group); each rank's result (a rank that died
    or hung fails the test)."""
    ctx = mp.start_processes(worker, args=(world, job, str(tmp_path / "init"), str(tmp_path)), nprocs=world,
                             join=False, start_method="spawn")
    end = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=1):
            assert time.monotonic() < end, f"{job}: ranks still running after {deadline_s} s"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for r in results:
        assert "crashed" not in r, r
    return results


def same_everywhere(results: List[Dict[str, object]], key: str, error: str, match: str) -> None:
    """Both ranks raised the same typed error, whose message matches."""
    got = [r[key] for r in results]
    assert got[0] == got[1], f"{key}: ranks raised different errors: {got}"
    assert got[0] is not None and got[0][0] == error and re.search(match, got[0][1]), f"{key}: {got[0]}"


# ---- the tests -------------------------------------------------------------------------------------------

def test_fp8_pool_plan_needs_dtype_and_agrees_on_it(tmp_path: Path) -> None:
    results = spawn("job_fp8_plan", tmp_path)
    same_everywhere(results, "no dtype", "ConfigError",
                    r"rank 0: cp_plan\(pool=\) of a torch.float8_e4m3fn pool needs dtype=")
    same_everywhere(results, "mixed", "ShapeError",
                    r"ranks' K/V dtypes differ: \['torch.bfloat16', 'torch.float16'\]")
    assert all(r["unchanged"] for r in results)


def test_fp8_kv_and_hand_built_shards_save_like_one_process(tmp_path: Path) -> None:
    """fp8 K/V gather as bytes; a CPShards built by hand with unequal sizes drops its padded rows."""
    for r in spawn("job_saves", tmp_path):
        assert r["fp8"] == {"gathered": [True, True], "pools equal": True}, r
        assert r["hand-built"] == {"gathered": True, "pools equal": True}, r


def test_check_ranks_compares_layer_geometry(tmp_path: Path) -> None:
    results = spawn("job_geometry", tmp_path)
    same_everywhere(results, "error", "ShapeError",
                    r"ranks save layers of different geometry: \[KVH, D, Dv\] \[\[2, 8, 8\], \[2, 16, 16\]\]")
    assert all(r["unchanged"] for r in results)


def test_plan_refusals_seen_by_one_rank_raise_on_every_rank(tmp_path: Path) -> None:
    results = spawn("job_one_rank_plan", tmp_path)
    same_everywhere(results, "cuda", "DeviceError", r"rank 1: cp_plan: device='cuda:99': torch")
    same_everywhere(results, "string", "DeviceError", r"rank 1: cp_plan: device='gpu0' is not a torch device")
    same_everywhere(results, "backend", "DeviceError",
                    r"rank 1: cp_plan: device='meta': the group's backend 'gloo' moves \['cpu', 'cuda'\] only")
    same_everywhere(results, "count", "ShardError", r"rank 1: the forward's token count must be in "
                                                    r"\[0, 2\*\*63 - 1\], got an int outside")
    same_everywhere(results, "count below", "ShardError", r"token count must be in .*got an int outside")
    same_everywhere(results, "local", "ShardError", r"rank 1: local_num_tokens must be an int in \[0, 9\] "
                                                    r".*got an int outside")
    same_everywhere(results, "env", "ConfigError", r"rank 1: cp_plan: HWKV_DEBUG='maybe' is not a valid value")
    assert [r["then"] for r in results] == [[5, 4]] * 2
    assert all(r["unchanged"] for r in results)


def test_hand_built_shards_layout_and_refusals() -> None:
    assert CPShards(1, (2, 5)).row_index.tolist() == [0, 1, 5, 6, 7, 8, 9]
    assert CPShards(0, (3, 3)).row_index is None
    with pytest.raises(ShardError, match=r"CPShards: rank 2 is outside \[0, 2\) \(one per shard size\)"):
        CPShards(2, (1, 1))
    with pytest.raises(ShardError, match=r"CPShards: sizes must be ints >= 0, got \[3, -1\]"):
        CPShards(0, (3, -1))
    with pytest.raises(ShardError, match=r"CPShards: row_index has shape \[4\], expected \[5\]"):
        CPShards(0, (3, 2), torch.arange(4))
