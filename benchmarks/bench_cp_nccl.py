"""Context-parallel all-gather-and-save across processes: NCCL on GPUs (issue 13), or gloo on CPU.

    torchrun --nproc_per_node=2 benchmarks/bench_cp_nccl.py --out cp.json            # 2 GPUs, NCCL
    python3 benchmarks/bench_cp_nccl.py --spawn 2 --device cpu --tokens 64 --layers 4 --repeats 2 --out cp.json

Every rank builds an SWAKVPool with GPT-OSS-120B's KV geometry (36 layers alternating SWA W=128 and
full, 8 KV heads x 64, bf16 on GPUs) and runs one forward of --tokens new tokens (one request):
1. equality: the forward's K/V are seeded per layer, so every rank can make all of them; each rank
   computes only its cp_plan shard and saves with cp_allgather_and_save_kv. Its pool must equal, bit
   for bit, a second pool on the same rank that saved the whole K/V directly.
2. timing: the --layers saves of one forward (median of --repeats, device events on GPUs), beside one
   all_gather_into_tensor of the same bytes per rank on the same group in the same run (the link's
   all-gather speed), as a fraction of it; bytes = K + V of the other ranks' tokens, per rank.
NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE=0 is set before the group starts (see the device
tool's notes). Rank 0 writes the JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hwkv.allocator import SWATokenToKVPoolAllocator  # noqa: E402
from hwkv.distributed import cp_allgather_and_save_kv, cp_plan, default_backend  # noqa: E402
from hwkv.layer import AttentionLayer  # noqa: E402
from hwkv.loc import KVWriteLoc  # noqa: E402
from hwkv.pool import SWAKVPool  # noqa: E402

KVH, D, WINDOW = 8, 64, 128


def make_pool(args, device: torch.device, dtype: torch.dtype):
    swa = [i for i in range(args.layers) if i % 2 == 0]
    full = [i for i in range(args.layers) if i % 2 == 1]
    size = args.tokens + 16
    pool = SWAKVPool(size=size, size_swa=size, page_size=1, dtype=dtype, head_num=KVH, head_dim=D,
                     swa_attention_layer_ids=swa, full_attention_layer_ids=full, device=device, v_head_dim=D)
    alloc = SWATokenToKVPoolAllocator(size, size, 1, str(device), pool)
    layers = [AttentionLayer(i, KVH * 8, KVH, D, sliding_window=WINDOW if i in swa else None)
              for i in range(args.layers)]
    return pool, alloc, layers


def forward_kv(args, device: torch.device, dtype: torch.dtype, layer_id: int):
    """The whole forward's K and V of one layer, the same on every rank (seeded by the layer)."""
    g = torch.Generator(device="cpu").manual_seed(1000 + layer_id)
    k = torch.randn(args.tokens, KVH, D, generator=g).to(dtype).to(device)
    v = torch.randn(args.tokens, KVH, D, generator=g).to(dtype).to(device)
    return k, v


def timer(device: torch.device):
    """(start(), stop() -> seconds) measured on the device's stream on GPUs, on the host clock on CPU."""
    if device.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        return a.record, lambda: (b.record(), b.synchronize(), a.elapsed_time(b) * 1e-3)[2]
    t0 = []
    return lambda: t0.append(time.perf_counter()), lambda: time.perf_counter() - t0[-1]


def run(args) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(args.device if args.device == "cpu" else f"{args.device}:{rank % max(torch.cuda.device_count(), 1)}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pool, alloc, layers = make_pool(args, device, dtype)
    ref_pool, ref_alloc, _ = make_pool(args, device, dtype)
    t = args.tokens
    zero, seq = torch.zeros(1, dtype=torch.int64), torch.tensor([t])
    locs = []
    for a in (alloc, ref_alloc):
        loc = a.alloc_extend(zero.to(device), seq.to(device), torch.tensor([-1], device=device), t,
                             prefix_lens_cpu=zero, seq_lens_cpu=seq)
        locs.append(loc)
    wl = KVWriteLoc(locs[0], pool.translate_loc_from_full_to_swa(locs[0]))
    ref_wl = KVWriteLoc(locs[1], ref_pool.translate_loc_from_full_to_swa(locs[1]))
    plan = cp_plan(wl, group=None, pool=pool)
    mine = plan.local_slice
    kv = [forward_kv(args, device, dtype, layer.layer_id) for layer in layers]
    shards = [(k[mine].contiguous(), v[mine].contiguous()) for k, v in kv]

    # 1. equality with the single-process save
    for layer, (k, v), (ks, vs) in zip(layers, kv, shards):
        cp_allgather_and_save_kv(pool, layer, wl, ks, vs, None, shards=plan)
        ref_pool.set_kv_buffer(layer, ref_wl, k, v)
    equal = all(torch.equal(pool.get_key_buffer(layer.layer_id)[wl_of(pool, layer, wl)],
                            ref_pool.get_key_buffer(layer.layer_id)[wl_of(ref_pool, layer, ref_wl)])
                and torch.equal(pool.get_value_buffer(layer.layer_id)[wl_of(pool, layer, wl)],
                                ref_pool.get_value_buffer(layer.layer_id)[wl_of(ref_pool, layer, ref_wl)])
                for layer in layers)

    # 2. timing: one forward's saves, and one all-gather of the same bytes per rank
    start, stop = timer(device)
    saves = []
    for _ in range(args.warmup + args.repeats):
        dist.barrier()
        start()
        for layer, (ks, vs) in zip(layers, shards):
            cp_allgather_and_save_kv(pool, layer, wl, ks, vs, None, shards=plan)
        saves.append(stop())
    elems = max(plan.sizes) * KVH * D * 2 * len(layers)            # K + V per rank, every layer
    per_rank = elems * (torch.finfo(dtype).bits // 8)
    src = torch.zeros(elems, dtype=dtype, device=device)            # the saves' dtype (gloo lacks int16)
    dst = torch.empty(world * elems, dtype=dtype, device=device)
    gathers = []
    for _ in range(args.warmup + args.repeats):
        dist.barrier()
        start()
        dist.all_gather_into_tensor(dst, src)
        gathers.append(stop())
    save_s = statistics.median(saves[args.warmup:])
    gather_s = statistics.median(gathers[args.warmup:])
    received = (world - 1) * per_rank       # bytes each rank takes in from the others
    row = dict(rank=rank, world=world, device=str(device), backend=dist.get_backend(), tokens=t, layers=len(layers),
               dtype=str(dtype), pools_equal=bool(equal), save_forward_us=save_s * 1e6, allgather_us=gather_s * 1e6,
               save_gbps=received / save_s / 1e9, allgather_gbps=received / gather_s / 1e9,
               fraction_of_allgather=gather_s / save_s,
               nvls=os.environ.get("NCCL_NVLS_ENABLE"))
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        out = dict(rows=rows, all_pools_equal=all(r["pools_equal"] for r in rows),
                   device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                   torch=torch.__version__)
        Path(args.out).write_text(json.dumps(out, indent=1))
        print(json.dumps(out, indent=1))
    if not equal:
        raise SystemExit(f"rank {rank}: the pool differs from the single-process save")


def wl_of(pool: SWAKVPool, layer: AttentionLayer, wl: KVWriteLoc) -> torch.Tensor:
    """The slots a layer's save wrote: swa_loc for the SWA group, loc for the full one."""
    return wl.swa_loc if layer.sliding_window is not None else wl.loc


def _spawned(rank: int, world: int, init_file: str, args) -> None:
    dist.init_process_group(default_backend(args.device), init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        run(args)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (NCCL) or cpu (gloo)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--spawn", type=int, default=0, help="start this many processes here (else: torchrun's env)")
    ap.add_argument("--out", default="bench_cp_nccl.json")
    args = ap.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")   # NVLink multicast off
    if args.spawn:
        import tempfile

        import torch.multiprocessing as mp
        with tempfile.TemporaryDirectory() as tmp:   # file:// rendezvous: no port to collide on
            mp.spawn(_spawned, args=(args.spawn, os.path.join(tmp, "init"), args), nprocs=args.spawn, join=True)
        return
    dist.init_process_group(default_backend(args.device))
    try:
        run(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
