"""Paged CPU attention (hwkv_cpu.kernels) against torch SDPA over the same K/V laid out dense.

One GPT-OSS layer by default: 64 q heads, 8 KV heads, head dim 64. Decode: batch x context
keys per request at page size 1, slots a random permutation of a pool 1.25x the tokens.
Extend: requests x new tokens over a cached prefix. All timings of one table come from one
process, interleaved (every repeat runs each contender once, in rotating order), so load
from other processes hits them alike; the table gives medians and the ratio of medians.

    .venv/bin/python benchmarks/bench_cpu_decode.py            # the table of docs/benchmarks.md
    .venv/bin/python benchmarks/bench_cpu_decode.py --quick    # small shapes, a smoke run
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F

from hwkv_cpu import amx, kernels, kernels_decode


def interleaved(fns: Dict[str, Callable[[], object]], repeats: int) -> Dict[str, List[float]]:
    """Seconds per call of each fn: one warm-up, then `repeats` rounds in rotating order."""
    for fn in fns.values():
        fn()
    times: Dict[str, List[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t)
    return times


class Paged:
    """reqs requests of `ctx` keys each at random slots of a pool 1.25x as large (slot 0 = padding)."""

    def __init__(self, reqs: int, ctx: int, kvh: int, d: int, dtype: torch.dtype, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        size = int(reqs * ctx * 1.25) + 1
        self.k_buf = torch.randn(size, kvh, d, generator=g).to(dtype)
        self.v_buf = torch.randn(size, kvh, d, generator=g).to(dtype)
        self.slots = torch.randperm(size - 1, generator=g)[:reqs * ctx] + 1
        self.indptr = torch.arange(0, reqs * ctx + 1, ctx, dtype=torch.int32)
        self.pos0 = torch.zeros(reqs, dtype=torch.int64)
        dense = lambda buf: buf[self.slots].view(reqs, ctx, kvh, d).transpose(1, 2).contiguous()  # noqa: E731
        self.k_dense, self.v_dense = dense(self.k_buf), dense(self.v_buf)


def decode_case(args, dtype: torch.dtype, label: str, with_naive: bool, with_fp32: bool) -> List[Tuple]:
    b, ctx, h, kvh, d = args.batch, args.context, args.heads, args.kv_heads, args.head_dim
    pool = Paged(b, ctx, kvh, d, dtype)
    q = torch.randn(b, h, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    q_pos = torch.full((b,), ctx - 1, dtype=torch.int64)
    out = torch.empty(b, h, d, dtype=dtype)
    scale = 1.0 / math.sqrt(d)

    def ours(pool=pool, q=q, out=out):
        kernels.decode_attention(q, pool.k_buf, pool.v_buf, pool.indptr, pool.slots, pool.pos0, q_pos, out,
                                 scale, None, 0.0, None, None, None)
        return out

    def sdpa():
        return F.scaled_dot_product_attention(q.view(b, h, 1, d), pool.k_dense, pool.v_dense,
                                              scale=scale, enable_gqa=True).view(b, h, d)

    fns = {f"hwkv paged ({label} pool)": ours, f"torch SDPA dense ({label})": sdpa}
    if with_fp32:
        p32, q32, o32 = Paged(b, ctx, kvh, d, torch.float32), q.float(), torch.empty(b, h, d)
        fns["hwkv paged (fp32 pool)"] = lambda: ours(p32, q32, o32)
    if with_naive:
        def naive():
            k = pool.k_buf[pool.slots].view(b, ctx, kvh, d).transpose(1, 2)
            v = pool.v_buf[pool.slots].view(b, ctx, kvh, d).transpose(1, 2)
            return F.scaled_dot_product_attention(q.view(b, h, 1, d), k, v, scale=scale, enable_gqa=True)
        fns["gather + SDPA (naive)"] = naive
    err = (ours().float() - sdpa().float()).abs().max().item()
    times = interleaved(fns, args.repeats)
    ref = statistics.median(times[f"torch SDPA dense ({label})"])
    case = f"decode {b} x {ctx}, {label}"
    return [(case, name, statistics.median(t), min(t), statistics.median(t) / ref, err if name.startswith("hwkv")
             and label in name else None) for name, t in times.items()]


def extend_repeats(args: argparse.Namespace) -> int:
    """The extend rows' repeats: a third of --repeats, at least 3 (an extend case takes ~15x a decode case's time)."""
    return max(3, args.repeats // 3)


def extend_case(args) -> List[Tuple]:
    r, new, pre, h, kvh, d = args.ext_requests, args.ext_new, args.ext_prefix, args.heads, args.kv_heads, args.head_dim
    label = args.ext_dtype
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[label]
    seq = pre + new
    pool = Paged(r, seq, kvh, d, dtype, seed=2)
    q = torch.randn(r * new, h, d, generator=torch.Generator().manual_seed(3)).to(dtype)
    qo = torch.arange(0, r * new + 1, new, dtype=torch.int32)
    q_pos0 = torch.full((r,), pre, dtype=torch.int64)
    out = torch.empty(r * new, h, d, dtype=dtype)
    scale = 1.0 / math.sqrt(d)
    mask = torch.arange(seq)[None, :] <= (pre + torch.arange(new))[:, None]  # [new, seq]
    q_dense = q.view(r, new, h, d).transpose(1, 2)

    def ours():
        kernels.extend_attention(q, pool.k_buf, pool.v_buf, pool.indptr, pool.slots, pool.pos0, qo, q_pos0, out,
                                 new, scale, None, 0.0, None, None, None)
        return out

    def sdpa():
        o = F.scaled_dot_product_attention(q_dense, pool.k_dense, pool.v_dense, attn_mask=mask, scale=scale,
                                           enable_gqa=True)
        return o.transpose(1, 2).reshape(r * new, h, d)

    err = (ours().float() - sdpa().float()).abs().max().item()
    sdpa_name = f"torch SDPA dense, causal mask ({label})"
    fns = {f"hwkv paged ({label} pool)": ours, sdpa_name: sdpa}
    times = interleaved(fns, extend_repeats(args))
    ref = statistics.median(times[sdpa_name])
    case = f"extend {r} x {new} new over {pre} prefix, {label}"
    return [(case, name, statistics.median(t), min(t), statistics.median(t) / ref, err if name.startswith("hwkv")
             else None) for name, t in times.items()]


def cpu_name() -> str:
    """The CPU's model name for the table header (says why when it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError as e:
        return f"{platform.processor() or 'unknown CPU'} (/proc/cpuinfo unreadable: {e})"
    return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--ext-requests", type=int, default=4)
    ap.add_argument("--ext-new", type=int, default=512)
    ap.add_argument("--ext-prefix", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--decode-keys", type=int, default=None,
                    help="override hwkv_cpu.kernels_decode.DECODE_KEYS (keys per step)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads first (default: torch's)")
    ap.add_argument("--compute", default=None, choices=["fp32", "bf16"],
                    help="force the compute dtype of bf16/fp16/fp8 pools (default: hwkv_cpu.amx.compute_dtype)")
    ap.add_argument("--ext-dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--skip", default="", help="comma list of cases to skip: fp32,bf16,extend")
    ap.add_argument("--quick", action="store_true", help="small shapes and few repeats")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.context, args.ext_requests, args.ext_new, args.ext_prefix, args.repeats = 2, 512, 1, 64, 128, 3
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.compute:
        forced = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.compute]
        amx.compute_dtype = lambda buf_dtype: torch.float32 if buf_dtype == torch.float32 else forced
    if args.decode_keys:
        kernels_decode.decode_torch.__defaults__ = (args.decode_keys,)
    skip = set(filter(None, args.skip.split(",")))
    load0 = os.getloadavg()
    t0 = time.time()
    rows: List[Tuple] = []
    if "fp32" not in skip:
        rows += decode_case(args, torch.float32, "fp32", with_naive=True, with_fp32=False)
    if "bf16" not in skip:
        rows += decode_case(args, torch.bfloat16, "bf16", with_naive=False, with_fp32=True)
    if "extend" not in skip:
        rows += extend_case(args)
    path, why = amx.active_path()
    print(f"CPU: {cpu_name()}, {os.cpu_count()} logical CPUs; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads ({torch.backends.cpu.get_cpu_capability()})")
    print(f"hwkv_cpu path: {path} ({why})")
    print(f"heads {args.heads} / KV heads {args.kv_heads}, head dim {args.head_dim}; page size 1, random slots; "
          f"{args.repeats} interleaved repeats (extend: {extend_repeats(args)}); load average {load0[0]:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after ({time.time() - t0:.0f} s)\n")
    print("| case | implementation | median ms | min ms | / SDPA (median) | max abs diff vs SDPA |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for case, name, med, best, ratio, err in rows:
        diff = "" if err is None else f"{err:.1e}"
        print(f"| {case} | {name} | {med * 1e3:.1f} | {best * 1e3:.1f} | {ratio:.2f}x | {diff} |")


if __name__ == "__main__":
    main()
