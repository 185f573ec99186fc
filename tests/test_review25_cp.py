"""Review 25: context parallelism (hwkv.distributed) over gloo, worlds 2 and 3. Each job returns what its rank
saw; a rank left in a collective fails within the group's 10 s timeout, a hung spawn within the deadline."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hwkv  # noqa: E402
from hwkv.allocator import SWATokenToKVPoolAllocator  # noqa: E402
from hwkv.batch import ForwardBatch, ForwardMode  # noqa: E402
from hwkv.distributed import cp_allgather_and_save_kv, cp_plan  # noqa: E402
from hwkv.layer import AttentionLayer  # noqa: E402
from hwkv.loc import KVWriteLoc  # noqa: E402
from hwkv.pool import SWAKVPool  # noqa: E402
from hwkv.release import release_out_of_window_batch  # noqa: E402

I64 = torch.int64
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EXTEND, DECODE = ForwardMode.EXTEND, ForwardMode.DECODE
KVH, D = 2, 8


class Eng:
    """SWA pool (layers 0, 2 SWA; 1 full), allocator, req_to_token, backend; forwards allocated like an engine."""

    def __init__(self, page_size: int = 1, window: int = 4, dtype: torch.dtype = torch.float32,
                 num_requests: int = 3, k_scale: Optional[float] = None) -> None:
        self.window = window
        self.pool = SWAKVPool(256, 128, page_size, dtype, KVH, D, [0, 2], [1], "cpu")
        self.alloc = SWATokenToKVPoolAllocator(256, 128, page_size, "cpu", self.pool)
        self.rtt = hwkv.ReqToTokenPool(size=num_requests + 1, max_context_len=128, device="cpu")
        self.backend = hwkv.make_backend(self.pool, self.rtt, device="cpu", sliding_window=window)
        self.layers = [AttentionLayer(i, 4, KVH, D, sliding_window=window if i != 1 else None,
                                      k_scale=k_scale, v_scale=k_scale) for i in range(3)]
        self.rows = torch.tensor(self.rtt.alloc(num_requests), dtype=I64)
        self.seq = torch.zeros(num_requests, dtype=I64)
        self.frontiers = torch.zeros(num_requests, dtype=I64)

    def forward(self, mode: ForwardMode, new_lens) -> Tuple[ForwardBatch, KVWriteLoc]:
        from test_distributed import allocate_batch
        batch = allocate_batch(self.alloc, self.rtt, self.rows, self.seq, mode, new_lens)
        self.seq = batch.seq_lens
        return batch, self.backend.init_forward_metadata(batch).write_loc

    def release(self) -> None:
        release_out_of_window_batch(self.alloc, self.rtt.req_to_token, self.rows, self.seq, self.frontiers,
                                    self.window)

    def snapshot(self) -> List[torch.Tensor]:
        subs = (self.pool.full_kv_pool, self.pool.swa_kv_pool)
        return [b.view(torch.uint8).clone() for s in subs for b in s.k_buffer + s.v_buffer] + [
            self.pool.full_to_swa_index_mapping.clone()]

    def same(self, snap: List[torch.Tensor]) -> bool:
        return all(torch.equal(a, b) for a, b in zip(snap, self.snapshot()))


def kv_of(step: int, layer: AttentionLayer, t: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(100 * step + layer.layer_id)
    return (torch.randn(t, KVH, D, generator=g).to(dtype), torch.randn(t, KVH, D, generator=g).to(dtype))


def raised(call: Callable[[], object]) -> Optional[List[str]]:
    try:
        call()
    except Exception as e:  # noqa: BLE001
        return [type(e).__name__, str(e)]
    return None


# ---- jobs --------------------------------------------------------------------------------------------

def job_pool_dtypes_differ(rank: int) -> Dict[str, object]:
    """Rank 0's pool is fp8 e4m3, rank 1's fp8 e5m2; every rank computes K/V in e4m3 (dtype=E4M3 agreed).
    Rank 1's pool refuses e4m3 K/V (a lossy cast), rank 0's takes them."""
    eng = Eng(dtype=E4M3 if rank == 0 else E5M2)
    _, wl = eng.forward(EXTEND, (5, 4, 2))
    before = eng.snapshot()
    out: Dict[str, object] = {}

    def save() -> None:
        plan = cp_plan(wl, pool=eng.pool, dtype=E4M3)
        layer = eng.layers[1]
        k, v = kv_of(0, layer, len(wl), E4M3)
        cp_allgather_and_save_kv(eng.pool, layer, wl, k[plan.local_slice], v[plan.local_slice], shards=plan)

    out["error"] = raised(save)
    out["unchanged"] = eng.same(before)
    return out


def last_rank_passes_other_locs(rank: int) -> Tuple["Eng", Any, Any]:
    """An engine after two forwards of the same lengths: (the engine, the first forward's write locs, the locs this
    rank passes: the second forward's on the last rank, the first's elsewhere)."""
    eng = Eng()
    _, wl = eng.forward(EXTEND, (5, 4, 3))
    _, wl2 = eng.forward(EXTEND, (5, 4, 3))
    return eng, wl, wl2 if rank == dist.get_world_size() - 1 else wl


def job_loc_values_differ(rank: int) -> Dict[str, object]:
    """Same token count on every rank, but the last rank passes the write locs of another forward (the same
    length): its pool ends up with the K/V at other slots than the others' and than one process's save."""
    eng, wl, mine = last_rank_passes_other_locs(rank)
    before = eng.snapshot()
    out = {"error": raised(lambda: cp_plan(mine, pool=eng.pool))}
    out["unchanged"] = eng.same(before)
    return out


def job_edges(rank: int) -> Dict[str, object]:
    """Uneven splits, empty shards, single tokens, windows across rank boundaries and larger than the context,
    page sizes 1 and 4, fp8 pools with scales: every rank's pools equal one process's saves."""
    world = dist.get_world_size()
    results = []
    cases = [(1, 4, torch.float32, None), (4, 6, torch.float32, None), (1, 64, torch.float32, None),
             (4, 3, E4M3, 0.5), (2, 5, torch.bfloat16, None)]
    for page_size, window, dtype, scale in cases:
        cp, ref = Eng(page_size, window, dtype, k_scale=scale), Eng(page_size, window, dtype, k_scale=scale)
        steps = [(EXTEND, (7, 1, 3), None), (DECODE, (1, 1, 1), None), (EXTEND, (1, 1, 1), (0,) * (world - 1) + (3,)),
                 (EXTEND, (9, 0, 2), (11,) + (0,) * (world - 1)), (DECODE, (1, 1, 1), (1,) + (0,) * (world - 2) + (2,)),
                 (EXTEND, (1, 6, 1), None), (EXTEND, (0, 1, 0), None), (DECODE, (1, 1, 1), None)]
        kvd = torch.bfloat16 if dtype in (E4M3,) else dtype
        for step, (mode, new, sizes, ) in enumerate(steps):
            batch, wl = cp.forward(mode, new)
            rbatch, rwl = ref.forward(mode, new)
            local = None if sizes is None else sizes[rank]
            plan = cp_plan(wl, local, pool=cp.pool, dtype=kvd if dtype == E4M3 else None)
            for layer, rlayer in zip(cp.layers, ref.layers):
                k, v = kv_of(step, layer, len(wl), kvd)
                kf, vf = cp_allgather_and_save_kv(cp.pool, layer, wl, k[plan.local_slice].clone(),
                                                  v[plan.local_slice].clone(), shards=plan)
                assert torch.equal(kf, k) and torch.equal(vf, v)
                ref.pool.set_kv_buffer(rlayer, rwl, k, v, rlayer.k_scale, rlayer.v_scale)
            cp.release()
            ref.release()
            results.append([page_size, window, str(dtype), step, cp.same(ref.snapshot())])
    return {"results": results}


# ---- spawning: test_distributed_refusals' ranks, each job by 'module:function' -------------------------------

def spawn(job: str, tmp_path: Path, world: int = 2, deadline_s: float = 60) -> List[Dict[str, object]]:
    from test_distributed_refusals import spawn as spawn_ranks
    return spawn_ranks(f"test_review25_cp:{job}", tmp_path, deadline_s, world)


# ---- tests -------------------------------------------------------------------------------------------

def test_pools_of_other_dtypes_refused_on_every_rank(tmp_path: Path) -> None:
    """cp_plan(pool=, dtype=) agrees on the K/V dtype but not on the pools' dtypes: rank 1's pool refuses the
    agreed K/V after the gather (ShapeError on rank 1 only) while rank 0 writes its pool."""
    results = spawn("job_pool_dtypes_differ", tmp_path)
    errors = [r["error"] for r in results]
    assert errors[0] == errors[1], f"ranks raised different errors: {errors}"
    assert errors[0] is not None
    assert all(r["unchanged"] for r in results), [r["unchanged"] for r in results]


def test_write_locs_of_another_forward_refused(tmp_path: Path) -> None:
    """The plan agrees on len(write_loc) only: a rank passing another forward's write locs (same length) is
    not refused, and its pool silently diverges from the others'."""
    results = spawn("job_loc_values_differ", tmp_path, world=3)
    errors = [r["error"] for r in results]
    assert all(e == errors[0] for e in errors), errors
    assert errors[0] is not None and errors[0][0] == "ShardError", errors


@pytest.mark.parametrize("world", [2, 3])
def test_edge_splits_save_like_one_process(tmp_path: Path, world: int) -> None:
    for r in spawn("job_edges", tmp_path, world=world, deadline_s=120):
        assert len(r["results"]) == 40
        bad = [x for x in r["results"] if not x[-1]]
        assert not bad, bad


def test_a_plan_row_with_no_device_named_travels_where_the_backend_moves(monkeypatch) -> None:
    """cp_plan(int) with neither pool= nor device= sent its row on the CPU, which NCCL refuses: every rank raised a
    DeviceError the caller never asked for. Now a row with no device named goes on the first present device the
    group's backend moves (CPU first); a device the caller names is still refused where the backend cannot move it."""
    import hwkv.distributed as d
    monkeypatch.setattr(d.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(d, "check_device", lambda x: torch.device(str(x)))  # as if a GPU were present
    dev, refusal = d._travel(None, None)
    assert dev.type == "cuda" and refusal is None
    dev, refusal = d._travel("cpu", None)
    assert dev.type == "cuda" and "moves ['cuda'] only" in str(refusal)
    monkeypatch.setattr(d.dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert d._travel(None, None) == (torch.device("cpu"), None)
