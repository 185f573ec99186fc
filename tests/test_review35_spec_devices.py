"""Review 35 (speculative decoding, context parallelism, device plug-ins): defects found, each a failing test."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List


sys.path.insert(0, str(Path(__file__).resolve().parent))

from hwkv.distributed import cp_allgather_and_save_kv  # noqa: E402

from test_review25_cp import E4M3, E5M2, EXTEND, Eng, kv_of, last_rank_passes_other_locs, raised  # noqa: E402


# ---- context parallelism: the plan-less save agrees on less than cp_plan does ------------------------------------

def job_planless_loc_values_differ(rank: int) -> Dict[str, object]:
    """The plan-less save (no shards=): the last rank passes another forward's write locs of the same length."""
    import torch.distributed as dist
    world = dist.get_world_size()
    eng, wl, mine = last_rank_passes_other_locs(rank)
    before = eng.snapshot()
    layer = eng.layers[1]
    k, v = kv_of(0, layer, len(wl))
    n = len(wl) // world
    sl = slice(rank * n, (rank + 1) * n if rank < world - 1 else len(wl))
    out = {"error": raised(lambda: cp_allgather_and_save_kv(eng.pool, layer, mine, k[sl], v[sl]))}
    out["unchanged"] = eng.same(before)
    return out


def job_planless_pool_dtypes_differ(rank: int) -> Dict[str, object]:
    """The plan-less save: rank 0's pool is fp8 e4m3, rank 1's e5m2; both ranks' K/V are e4m3."""
    eng = Eng(dtype=E4M3 if rank == 0 else E5M2)
    _, wl = eng.forward(EXTEND, (5, 4, 2))
    before = eng.snapshot()
    layer = eng.layers[1]
    k, v = kv_of(0, layer, len(wl), E4M3)
    n = len(wl) // 2
    sl = slice(0, n) if rank == 0 else slice(n, len(wl))
    out = {"error": raised(lambda: cp_allgather_and_save_kv(eng.pool, layer, wl, k[sl], v[sl]))}
    out["unchanged"] = eng.same(before)
    return out


def _spawn(job: str, tmp_path: Path, world: int = 2) -> List[Dict[str, object]]:
    from test_distributed_refusals import spawn as spawn_ranks
    return spawn_ranks(f"test_review35_spec_devices:{job}", tmp_path, 60, world)


def test_planless_save_refuses_write_locs_of_another_forward_on_every_rank(tmp_path: Path) -> None:
    """hwkv/distributed.py `_self_planned`: the plan-less `cp_allgather_and_save_kv(pool, layer, write_loc, k, v)`
    agreed only on len(write_loc); cp_plan (`_plan`) also agrees on the locs' values by a checksum (review 25). A
    rank passing another forward's write locs of the same length was saved silently, its pool diverging from the
    others'.
    Expected: the same ShardError on every rank, no pool written (as cp_plan raises)."""
    results = _spawn("job_planless_loc_values_differ", tmp_path, world=2)
    errors = [r["error"] for r in results]
    assert all(e == errors[0] for e in errors), errors
    assert errors[0] is not None and errors[0][0] == "ShardError", errors
    assert all(r["unchanged"] for r in results)


def test_planless_save_refuses_a_pool_that_cannot_store_the_kv_on_every_rank(tmp_path: Path) -> None:
    """hwkv/distributed.py `_self_planned`: the plan-less save never asks whether each rank's pool stores the K/V
    dtype (`_writable`, which cp_plan agrees on): rank 1's e5m2 pool refuses e4m3 K/V in set_kv_buffer after the
    gather, on rank 1 only, while rank 0 has written its pool. Expected: the same typed error on every rank before
    the gather, every pool unchanged."""
    results = _spawn("job_planless_pool_dtypes_differ", tmp_path)
    errors = [r["error"] for r in results]
    assert errors[0] == errors[1], f"ranks raised different errors: {errors}"
    assert errors[0] is not None
    assert all(r["unchanged"] for r in results), [r["unchanged"] for r in results]
