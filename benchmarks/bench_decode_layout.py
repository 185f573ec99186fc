"""Decode over the pool's `[slot, kv head, D]` rows against a head-major copy of the same pool, and cuDNN.

    python3 benchmarks/bench_decode_layout.py 16x4096,64x4096,1x32768 --rounds 5

Each cell (batch x context, pages of 16 at random places: `bench_cuda_kernels.DecodeSetup`) is decoded with the
dispatched config over the pool as hwkv lays it out (a one-head program reads 128 of each 1 KiB row at D=64) and over
a copy whose kv heads are each contiguous (a page's keys of one head 2 KiB in one piece; same slots and lists, other
strides), beside SDPA's cuDNN over the same keys dense, in interleaved rounds; prints one JSON line a cell (medians,
us, every round, and the largest output difference between the layouts). Whether DRAM row locality is what keeps a
cell from cuDNN's time: docs/benchmarks.md, thirty-sixth session. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_cuda_kernels as b  # noqa: E402


def cell(bs: int, ctx: int, rounds: int) -> dict:
    """One cell's medians (us), rounds and largest output difference between the layouts."""
    s = b.DecodeSetup(bs, ctx)
    cfg = s.config()
    splits = b.decode_num_splits(bs, b.KVH, s.list_len, b.DEV, cfg, head_dim=b.D)
    ws = b.make_decode_workspace(bs, b.H, b.D, splits, b.DEV)
    kh = s.k_buf.transpose(0, 1).contiguous().transpose(0, 1)   # [slots, KVH, D] view of a head-major copy
    vh = s.v_buf.transpose(0, 1).contiguous().transpose(0, 1)

    def run(r, k, v):
        b.decode_attention(s.q, k, v, s.indptr, s.indices[r], s.kv_pos0, s.q_pos, s.out, 1 / 8, None, 0.0,
                           s.sinks, None, None, s.list_len, workspace=ws, config=cfg)

    run(0, s.k_buf, s.v_buf)
    ref = s.out.clone()
    run(0, kh, vh)
    err = (s.out.float() - ref.float()).abs().max().item()
    t = {"pool": [], "head-major": [], "cudnn": []}
    for _ in range(rounds):
        t["pool"].append(b.graph_us([lambda r=r: run(r, s.k_buf, s.v_buf) for r in range(s.reps)]))
        t["head-major"].append(b.graph_us([lambda r=r: run(r, kh, vh) for r in range(s.reps)]))
        t["cudnn"].append(s.time_sdpa([b.SDPBackend.CUDNN_ATTENTION]))
    return dict(cell=f"{bs}x{ctx}", splits=splits, err=err, **{k: round(statistics.median(v), 2) for k, v in t.items()},
                rounds={k: [round(x, 1) for x in v] for k, v in t.items()})


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cells", help="BxC,... (batch x context)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    for c in args.cells.split(","):
        bs, ctx = (int(x) for x in c.split("x"))
        print(json.dumps(cell(bs, ctx, args.rounds)), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
