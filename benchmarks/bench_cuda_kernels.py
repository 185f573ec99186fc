"""Benchmark (and check) hwkv_cuda's Triton kernels on one CUDA GPU.

    python3 benchmarks/bench_cuda_kernels.py --out results.json [--sweep] [--no-check]
        [--layout random|contiguous] [--page-size 16] [--seed 0] [--only all|extend|decode|tree]
        [--decode-config field=value,... [--rounds N]] [--decode-cells BxC[xW],...] [--profile-decode BxC[xW]]

Measures, each as the median over repeats of a CUDA graph replay:
  * device copy bandwidth (4 GiB device-to-device copy, bytes read + written),
  * store_kv for 36 layers x {1, 64, 8192} tokens (KVH=8, D=64, bf16) vs copy bandwidth,
  * decode attention, one layer (H=64, KVH=8, D=64, bf16, sinks), batch {1,16,64,256} x
    context {4K, 32K}, against copy bandwidth (bytes = K + V read), and SWA decode over a
    128-key window list at batch 1 and 256; where the plan splits the keys, both merges are timed
    (the last split merging in place, and the separate merge kernel),
  * torch SDPA (enable_gqa) over the same K/V gathered dense, in the same run: any fast backend
    (`sdpa_us`), and cuDNN and flash each on their own, whose times the kernel's are divided by,
  * prefill/extend (same layer shape, page 16): 1 x 8192 causal,
    4 x 2048 new tokens over a 2048-token prefix, 8 x 1024, one 2048-token chunk over a 30K
    prefix, each full and W=128, beside torch SDPA's flash and cuDNN backends over dense K/V
    (causal_lower_right for prefixes, an explicit boolean mask for windows; "n/a" where a
    backend refuses); TFLOP/s counts visible (query, key) pairs only (decode: every listed key),
    also as a fraction of the H200's dense bf16 peak (H200_BF16_TFLOPS),
  * tree verify (15 drafts, top-2 tree) over 4K/32K prefixes, full and W=128: the extend kernel with
    the tree mask against the decode-like path, and the decode-like lists' build (fused and torch).
Pages (--page-size tokens, 16 by default) are placed by --layout: "random" (the default, what a serving
pool looks like after churn) deals one seeded random permutation of the pool's pages out to the requests,
so each request's pages sit at random places in random order; "contiguous" gives each request one run of
pages (the runs in random order). One decode case puts every token at a random slot (page size 1). Small
cases rotate over several disjoint KV sets inside one graph so that the L2 cache does not serve them.
--decode-config SPEC (repeatable; field=value,... over DecodeConfig's fields, e.g. `heads_per_program=4,block_n=64`)
also times each decode case under the config its dispatch picks with those fields changed, beside that config, in
--rounds interleaved rounds (medians; each variant's ratio to the dispatched config, < 1 faster), with no code edit.
Prints a Markdown table last and writes every number as JSON to --out.
--profile-decode BxC[xW] runs only hwkv's decode and cuDNN's SDPA over the same K/V once each (after three warm-up
calls) between cudaProfilerStart and Stop, for a profiler that starts with profiling off:

    ncu --profile-from-start off --clock-control none --set full python3 benchmarks/bench_cuda_kernels.py \
        --profile-decode 24x4096
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hwkv_cuda.kernels import (DecodeConfig, ExtendConfig, StoreConfig, decode_attention,  # noqa: E402
                               decode_num_splits, extend_attention, make_decode_workspace, store_kv)
from hwkv_cuda.kernels import decode as decode_mod  # noqa: E402

H, KVH, D = 64, 8, 64
DT = torch.bfloat16
LAYERS = 36
L2_BYTES = 256 << 20    # rotate data until one graph replay touches at least this much
DEV = torch.device("cuda")
FAST_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
SDPA_BACKENDS = (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION))
H200_BF16_TFLOPS = 989.4   # NVIDIA H200 SXM, dense bf16 tensor-core peak (no sparsity)
LAYOUTS = ("random", "contiguous")
EXPAND_LIMIT = 16 << 30    # bytes of K/V repeated per q head for an SDPA backend that refuses enable_gqa


# ----------------------------------------------------------------------------- layout and metrics
def place_pages(requests, tokens, page, layout, gen, device=None):
    """Slots [requests, tokens] (int64) of `requests` sequences of `tokens` tokens in a pool of
    `pool_slots(requests, tokens, page)` slots, page 0 reserved. "random": one random permutation of the
    pool's pages (from `gen`) dealt out in order, so each request's pages are at random places in random
    order; "contiguous": each request's pages are one run, the runs in random order."""
    per = -(-tokens // page)
    if layout == "random":
        pages = (torch.randperm(requests * per, generator=gen) + 1).view(requests, per)
    elif layout == "contiguous":
        pages = torch.randperm(requests, generator=gen)[:, None] * per + torch.arange(per) + 1
    else:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    slots = (pages[:, :, None] * page + torch.arange(page)).reshape(requests, per * page)[:, :tokens]
    return slots.to(device or DEV)


def pool_slots(requests, tokens, page):
    """Slots of the pool `place_pages` places into (the reserved page included)."""
    return (requests * -(-tokens // page) + 1) * page


def tflops(flops, us):
    return flops / (us * 1e-6) / 1e12 if isinstance(us, float) else None


def frac_peak(tf):
    return tf / H200_BF16_TFLOPS if isinstance(tf, float) else None


def time_ratio(us, other_us):
    """The kernel's time over another's (< 1: the kernel is faster); None where the other did not run."""
    return us / other_us if isinstance(us, float) and isinstance(other_us, float) else None


# ----------------------------------------------------------------------------- timing
def graph_us(fns, reps=30):
    """Median microseconds per call of `fns` (captured back to back in one CUDA graph)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    for _ in range(3):
        g.replay()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    del g
    return statistics.median(a.elapsed_time(b) for a, b in ev) * 1e3 / len(fns)


def copy_bandwidth():
    n = 4 << 30
    src = torch.empty(n, dtype=torch.uint8, device=DEV).random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ts = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / statistics.median(ts)


# ----------------------------------------------------------------------------- store
def bench_store(copy_bw, sweep):
    rows = []
    for n in (1, 64, 8192):
        size = max(4096, 2 * n)
        bufs = [(torch.randn(size, KVH, D, device=DEV).to(DT), torch.randn(size, KVH, D, device=DEV).to(DT))
                for _ in range(LAYERS)]
        ins = [(torch.randn(n, KVH, D, device=DEV).to(DT), torch.randn(n, KVH, D, device=DEV).to(DT))
               for _ in range(LAYERS)]
        loc = torch.randperm(size - 1, device=DEV)[:n] + 1
        configs = [None] + ([StoreConfig(bt, w) for bt in (1, 2, 4, 8, 16) for w in (2, 4, 8)]
                            if sweep and n == 8192 else [])
        best = None
        for cfg in configs:
            fns = [lambda kb=kb, vb=vb, k=k, v=v, c=cfg: store_kv(kb, vb, loc, k, v, config=c)
                   for (kb, vb), (k, v) in zip(bufs, ins)]
            us = graph_us(fns) * LAYERS
            if best is None or us < best[0]:
                best = (us, cfg)
            if cfg is None:
                default_us = us
        bytes_ = LAYERS * n * KVH * D * 2 * 2 * 2          # K and V, read + written
        rows.append(dict(tokens=n, us_36_layers=default_us, pct_copy_bw=100 * bytes_ / (default_us * 1e-6) / copy_bw,
                         best_us=best[0], best_config=repr(best[1])))
        del bufs, ins
        torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- decode
class DecodeSetup:
    """R disjoint KV sets of `bs` requests with `ctx` keys each (last `window` only when given), their pages
    placed by `layout` (scatter: every token at a random slot)."""

    def __init__(self, bs, ctx, window=None, dense=True, scatter=False, layout="random", page=16, seed=0):
        list_len = min(ctx, window) if window else ctx
        self.bytes = bs * list_len * KVH * 2 * D * 2
        self.flops = 2 * bs * H * list_len * (D + D)     # q.k and p.v over every listed key
        self.reps = max(1, min(32, math.ceil(L2_BYTES / self.bytes)))
        total = self.reps * bs
        page = 1 if scatter else page
        gen = torch.Generator().manual_seed(seed)
        placed = place_pages(total, ctx, page, "random" if scatter else layout, gen)  # request r*bs+b: row r*bs+b
        slots = pool_slots(total, ctx, page)
        self.k_buf = torch.randn(slots, KVH, D, device=DEV, dtype=DT)
        self.v_buf = torch.randn(slots, KVH, D, device=DEV, dtype=DT)
        self.bs, self.ctx, self.window, self.list_len = bs, ctx, window, list_len
        self.q = torch.randn(bs, H, D, device=DEV).to(DT)
        self.out = torch.empty(bs, H, D, device=DEV, dtype=DT)
        self.sinks = torch.randn(H, device=DEV)
        self.q_pos = torch.full((bs,), ctx - 1, dtype=torch.int64, device=DEV)
        self.kv_pos0 = torch.full((bs,), ctx - list_len, dtype=torch.int64, device=DEV)
        self.indptr = torch.arange(0, bs + 1, dtype=torch.int32, device=DEV) * list_len
        self.indices = [placed[r * bs:(r + 1) * bs, ctx - list_len:].reshape(-1).contiguous()
                        for r in range(self.reps)]
        del placed
        self.dense = None
        if dense:   # the same K/V gathered dense for SDPA: [bs, KVH, len, D]
            self.dense = [(self.k_buf[ix].view(bs, list_len, KVH, D).transpose(1, 2).contiguous(),
                           self.v_buf[ix].view(bs, list_len, KVH, D).transpose(1, 2).contiguous())
                          for ix in self.indices]

    def run(self, r, cfg=None, ws=None):
        decode_attention(self.q, self.k_buf, self.v_buf, self.indptr, self.indices[r], self.kv_pos0,
                         self.q_pos, self.out, 1 / 8, self.window, 0.0, self.sinks, None, None,
                         self.list_len, workspace=ws, config=cfg)

    def config(self, cfg=None):
        return cfg or decode_mod.decode_config(self.bs, KVH, D, self.list_len, DEV)

    def plan(self, cfg=None):
        """The plan a call with this config makes (split count, merge in place or not)."""
        cfg = self.config(cfg)
        splits = decode_num_splits(self.bs, KVH, self.list_len, DEV, cfg, head_dim=D)
        return decode_mod.plan_decode(self.q, self.k_buf, self.v_buf, self.indptr, self.indices[0], self.kv_pos0,
                                      self.q_pos, self.out, self.sinks, self.list_len,
                                      workspace=make_decode_workspace(self.bs, H, D, splits, DEV), config=cfg)

    def time(self, cfg=None):
        cfg = self.config(cfg)
        splits = decode_num_splits(self.bs, KVH, self.list_len, DEV, cfg, head_dim=D)
        ws = make_decode_workspace(self.bs, H, D, splits, DEV)
        return graph_us([lambda r=r: self.run(r, cfg, ws) for r in range(self.reps)]), splits

    def time_merges(self):
        """(us with the last split merging in place, us with the merge kernel) under this shape's config; None
        for both where one split needs no merge."""
        cfg = self.config()
        if self.plan(cfg).splits == 1:
            return None, None
        return tuple(self.time(dataclasses.replace(cfg, fused_merge_bytes=b))[0] for b in (1 << 62, 0))

    def time_sdpa(self, backends=FAST_SDPA):
        """SDPA over the dense K/V with `backends` (enable_gqa; K/V repeated per q head for a backend that
        refuses it, where that fits EXPAND_LIMIT); us, or 'n/a (why)'."""
        q4 = self.q.view(self.bs, H, 1, D)

        def sdpa(k, v, gqa):
            with sdpa_kernel(backends):   # never the math fallback (it would copy K/V per q head)
                F.scaled_dot_product_attention(q4, k, v, scale=1 / 8, enable_gqa=gqa)
        try:
            return graph_us([lambda k=k, v=v: sdpa(k, v, True) for k, v in self.dense])
        except Exception as e:  # noqa: BLE001 - reported in the table, not hidden
            why = f"n/a ({type(e).__name__})"
        if sum(k.numel() + v.numel() for k, v in self.dense) * 2 * (H // KVH) > EXPAND_LIMIT:
            return why
        g = H // KVH
        try:
            return graph_us([lambda k=k.repeat_interleave(g, 1), v=v.repeat_interleave(g, 1): sdpa(k, v, False)
                             for k, v in self.dense])
        except Exception as e:  # noqa: BLE001
            return f"n/a ({type(e).__name__})"


SWEEP = [DecodeConfig(block_n=bn, mid_block_n=bn, num_warps=4, num_stages=st, ctas_per_sm=c,
                      min_keys_per_split=128, heads_per_program=hpp)
         for hpp in (1, 2) for bn, st in ((64, 3), (128, 2), (128, 3), (128, 4)) for c in (1, 2, 4, 8)]


DECODE_CASES = ([(b, c, None, False) for c in (4096, 32768) for b in (1, 16, 64, 256)]
                + [(1, 32768, 128, False), (256, 32768, 128, False), (64, 4096, None, True)])  # (bs, ctx, W, scatter)


def parse_decode_cells(spec):
    """--decode-cells BxC[xW],...: (batch, context, window or None, False) cases; ValueError naming the bad item."""
    cases = []
    for item in spec.split(","):
        parts = item.strip().lower().split("x")
        try:
            nums = [int(p) for p in parts]
        except ValueError:
            nums = []
        if len(nums) not in (2, 3) or min(nums) < 1:
            raise ValueError(f"--decode-cells {spec!r}: {item.strip()!r} is not BATCHxCONTEXT[xWINDOW] "
                             "of integers >= 1")
        cases.append((nums[0], nums[1], nums[2] if len(nums) == 3 else None, False))
    return cases


def parse_fields(flag, spec, body, defaults, zero_ok=()):
    """`field=value,...` (body) over a config's fields (`defaults`: each field's default, whose type it takes: 1, 0,
    true or false for bools, integers >= 1 otherwise, >= 0 for the fields in zero_ok); ValueError naming the flag,
    the spec and what is wrong, before any device time is spent."""
    typed = {}
    for item in filter(None, (x.strip() for x in body.split(","))):
        key, eq, value = (x.strip() for x in item.partition("="))
        if not eq:
            raise ValueError(f"{flag} {spec!r}: {item!r} is not field=value")
        if key not in defaults:
            raise ValueError(f"{flag} {spec!r}: no field {key!r} (fields: {', '.join(defaults)})")
        if key in typed:
            raise ValueError(f"{flag} {spec!r}: {key} given twice")
        if isinstance(defaults[key], bool):
            if value.lower() not in ("1", "0", "true", "false"):
                raise ValueError(f"{flag} {spec!r}: {key}={value!r} is not 1, 0, true or false")
            typed[key] = value.lower() in ("1", "true")
        else:
            try:
                typed[key] = int(value)
            except ValueError:
                raise ValueError(f"{flag} {spec!r}: {key}={value!r} is not an integer") from None
            least = 0 if key in zero_ok else 1
            if typed[key] < least:
                raise ValueError(f"{flag} {spec!r}: {key}={typed[key]} is not an integer >= {least}")
    return typed


# DecodeConfig's int fields where 0 means something (a byte bound of 0: never merge in place)
DECODE_ZERO_OK = ("fused_merge_bytes", "eager_fused_merge_bytes")


def parse_decode_config(spec):
    """The DecodeConfig field changes a --decode-config SPEC names (see the module doc)."""
    if not spec.strip():
        raise ValueError("--decode-config '': an empty spec (give field=value pairs)")
    defaults = {f.name: f.default for f in dataclasses.fields(DecodeConfig)}
    changes = parse_fields("--decode-config", spec, spec, defaults, DECODE_ZERO_OK)
    if not changes:
        raise ValueError(f"--decode-config {spec!r}: no field=value pair")
    return changes


def time_variants(s, changes, rounds):
    """Decode case s under its dispatched config and under each of `changes` applied to it, in `rounds` interleaved
    rounds: one row per variant (its spec, config, median us, every round's, ratio to the dispatched config's) and
    the dispatched config's median. A variant that fails to build or run is a result row."""
    base = s.config()
    cfgs = {"dispatched": base}
    res = []
    for spec, change in changes:
        try:
            cfgs[spec] = dataclasses.replace(base, **change)
        except Exception as e:  # noqa: BLE001 - reported, the other variants still run
            res.append(dict(spec=spec, error=f"{type(e).__name__}: {str(e)[:120]}"))
    runs = {k: [] for k in cfgs}
    for _ in range(rounds):
        for k, cfg in cfgs.items():
            if runs[k] is None:
                continue
            try:
                runs[k].append(s.time(cfg)[0])
            except Exception as e:  # noqa: BLE001
                res.append(dict(spec=k, error=f"{type(e).__name__}: {str(e)[:120]}"))
                runs[k] = None
    med = {k: statistics.median(v) for k, v in runs.items() if v}
    for k, cfg in cfgs.items():
        if k != "dispatched" and runs[k]:
            res.append(dict(spec=k, config=repr(cfg), us=med[k], runs=runs[k],
                            vs_dispatched=med[k] / med["dispatched"] if "dispatched" in med else None))
    return res, med.get("dispatched")


def variant_cell(v, row):
    """One variant's result as text: its error, or its us against the dispatched config's (and their ratio)."""
    if "error" in v:
        return v["error"]
    if v["vs_dispatched"] is None:
        return f"{v['us']:.1f} us (the dispatched config failed)"
    return f"{v['us']:.1f} us against {row['variants_dispatched_us']:.1f} ({v['vs_dispatched']:.3f}x)"


def bench_decode(copy_bw, sweep, layout="random", page=16, seed=0, changes=(), rounds=3, cases=DECODE_CASES):
    rows = []
    for bs, ctx, window, scatter in cases:
        s = DecodeSetup(bs, ctx, window, scatter=scatter, layout=layout, page=page, seed=seed)
        us, splits = s.time()
        fused_us, merge_kernel_us = s.time_merges()
        pdl = bool(s.plan().merge_consts.get("PDL"))   # the merge kernel a programmatic dependent: A/B, same run
        plain_us = s.time(dataclasses.replace(s.config(), pdl=False))[0] if pdl else None
        tf = tflops(s.flops, us)
        row = dict(batch=bs, context=ctx, window=window, scatter=scatter, layout="scatter" if scatter else layout,
                   page=1 if scatter else page, keys=s.list_len, splits=splits,
                   merge="none" if splits == 1 else ("in place" if s.plan().fused else "kernel"), us=us,
                   us_fused_merge=fused_us, us_merge_kernel=merge_kernel_us, pdl=pdl, us_without_pdl=plain_us,
                   frac_copy_bw=s.bytes / (us * 1e-6) / copy_bw, tflops=tf, frac_peak=frac_peak(tf),
                   sdpa_us=s.time_sdpa())
        for name, backend in SDPA_BACKENDS:
            t = s.time_sdpa([backend])
            row[f"sdpa_{name}_us"] = t
            row[f"vs_{name}"] = time_ratio(us, t)
        if sweep:
            res = sorted((s.time(cfg)[0], repr(cfg)) for cfg in SWEEP)
            row.update(best_us=res[0][0], best_config=res[0][1], sweep=res)
        if changes:
            row["variants"], row["variants_dispatched_us"] = time_variants(s, changes, rounds)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("sweep", "variants")}), flush=True)
        for v in row.get("variants", ()):
            print(f"decode {bs} x {ctx}{f' W={window}' if window else ''}: {v['spec']}: {variant_cell(v, row)}",
                  flush=True)
        del s
        gc.collect()               # a setup's graphs and buffers go before the next (the wide cases fill an H100)
        torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- prefill / extend
PREFILL_CASES = [  # (requests, new tokens each, prefix each)
    (1, 8192, 0), (4, 2048, 2048), (8, 1024, 0), (1, 2048, 30720)]


class ExtendSetup:
    """`bs` requests of `new` tokens over `prefix` cached ones, K/V in pages of `page` tokens placed by `layout`."""

    def __init__(self, bs, new, prefix, window=None, h=H, kvh=KVH, d=D, page=16, layout="random", seed=0):
        seq = prefix + new
        self.bs, self.new, self.prefix, self.window, self.h, self.kvh, self.d = bs, new, prefix, window, h, kvh, d
        n_slots = pool_slots(bs, seq, page)
        self.k_buf = torch.randn(n_slots, kvh, d, device=DEV).to(DT)
        self.v_buf = torch.randn(n_slots, kvh, d, device=DEV).to(DT)
        slots = place_pages(bs, seq, page, layout, torch.Generator().manual_seed(seed))
        self.pos0 = max(0, prefix - window + 1) if window else 0        # the SWA list starts at the window
        self.indices = slots[:, self.pos0:].reshape(-1).contiguous()
        i32, i64 = dict(dtype=torch.int32, device=DEV), dict(dtype=torch.int64, device=DEV)
        self.kv_indptr = torch.arange(bs + 1, **i32) * (seq - self.pos0)
        self.qo_indptr = torch.arange(bs + 1, **i32) * new
        self.kv_pos0 = torch.full((bs,), self.pos0, **i64)
        self.q_pos0 = torch.full((bs,), prefix, **i64)
        self.q = torch.randn(bs * new, h, d, device=DEV).to(DT)
        self.out = torch.empty_like(self.q)
        self.sinks = torch.randn(h, device=DEV)
        self.slots = slots
        qp = torch.arange(prefix, seq, device=DEV)
        kp = torch.arange(seq, device=DEV)
        vis = kp[None, :] <= qp[:, None]
        if window:
            vis &= kp[None, :] > qp[:, None] - window
        self.pairs = bs * int(vis.sum())
        self.mask = vis
        # bytes a perfect kernel moves: q and out once, every visible key's K and V once
        keys = seq - self.pos0
        self.bytes = 2 * bs * new * h * d * 2 + bs * keys * kvh * 2 * d * 2

    def tflops(self, us):
        return tflops(4 * self.pairs * self.h * self.d, us)

    def run(self, cfg=None):
        extend_attention(self.q, self.k_buf, self.v_buf, self.kv_indptr, self.indices, self.kv_pos0,
                         self.qo_indptr, self.q_pos0, self.out, self.new, self.d ** -0.5, self.window, 0.0,
                         None, None, None, config=cfg)

    def time(self, cfg=None):
        return graph_us([lambda: self.run(cfg)], reps=20)

    def sdpa(self, backend):
        """Same attention (no sinks) by torch SDPA over dense K/V; us, or 'n/a (why)'."""
        seq = self.prefix + self.new
        q4 = self.q.view(self.bs, self.new, self.h, self.d).transpose(1, 2)
        k4 = self.k_buf[self.slots].transpose(1, 2).contiguous()          # [bs, KVH, seq, D]
        v4 = self.v_buf[self.slots].transpose(1, 2).contiguous()
        kw = dict(scale=self.d ** -0.5)
        if self.window:
            kw["attn_mask"] = self.mask
        elif self.prefix:
            from torch.nn.attention.bias import causal_lower_right
            kw["attn_mask"] = causal_lower_right(self.new, seq)
        else:
            kw["is_causal"] = True
        last = None
        for gqa in (True, False):   # some backends refuse enable_gqa: give them K/V per q head
            k, v = (k4, v4) if gqa else (k4.repeat_interleave(self.h // self.kvh, 1),
                                         v4.repeat_interleave(self.h // self.kvh, 1))
            try:
                def f(k=k, v=v, gqa=gqa):
                    with sdpa_kernel([backend]):
                        F.scaled_dot_product_attention(q4, k, v, enable_gqa=gqa, **kw)
                return graph_us([f], reps=20)
            except Exception as e:  # noqa: BLE001 - reported in the table
                last = f"n/a ({type(e).__name__})"
        return last

    def check(self):
        """Relative error of one kernel run against fp32 attention of request 0 (rows sampled)."""
        self.out.fill_(float("nan"))
        self.run()
        rows = torch.linspace(0, self.new - 1, min(self.new, 64), device=DEV).long()
        seq = self.prefix + self.new
        ref = dense_ref(self.q[rows], self.k_buf[self.slots[0]], self.v_buf[self.slots[0]], self.prefix + rows,
                        torch.arange(seq, device=DEV), self.d ** -0.5, self.window, None)
        return rel_err(self.out[rows], ref)


EXTEND_SWEEP = [ExtendConfig(bm, bn, w, st) for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8)
                for st in (2, 3, 4)]


def bench_extend(copy_bw, sweep, layout="random", page=16, seed=0):
    rows = []
    for bs, new, prefix in PREFILL_CASES:
        for window in (None, 128):
            s = ExtendSetup(bs, new, prefix, window, page=page, layout=layout, seed=seed)
            us = s.time()
            row = dict(batch=bs, new=new, prefix=prefix, window=window, layout=layout, page=page, us=us,
                       tflops=s.tflops(us), frac_peak=frac_peak(s.tflops(us)),
                       frac_copy_bw=s.bytes / (us * 1e-6) / copy_bw, rel_err=s.check())
            for name, backend in SDPA_BACKENDS:
                t = s.sdpa(backend)
                row[f"sdpa_{name}_us"] = t
                row[f"sdpa_{name}_tflops"] = s.tflops(t) if isinstance(t, float) else None
                row[f"vs_{name}"] = time_ratio(us, t)
            if sweep and (bs, new, prefix) in ((1, 8192, 0), (4, 2048, 2048)):
                res = []
                for cfg in EXTEND_SWEEP:
                    try:
                        res.append((s.time(cfg), repr(cfg)))
                    except Exception as e:  # noqa: BLE001 - out of shared memory etc.
                        res.append((float("inf"), f"{cfg!r}: {type(e).__name__}"))
                res.sort()
                row.update(best_us=res[0][0], best_config=res[0][1], sweep=res[:8])
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "sweep"}), flush=True)
            del s
            torch.cuda.empty_cache()
    return rows


def sweep_extend_head_dims():
    """Config sweep for the other recorded head dims (Llama-like 32 q / 8 kv heads), causal 1 x 8192 and W=128."""
    out = {}
    for d in (128, 256):
        for window in (None, 128):
            s = ExtendSetup(1, 8192, 0, window, h=32, kvh=8, d=d)
            res = []
            for cfg in EXTEND_SWEEP:
                try:
                    res.append((s.time(cfg), repr(cfg)))
                except Exception as e:  # noqa: BLE001
                    res.append((float("inf"), f"{cfg!r}: {type(e).__name__}"))
            res.sort()
            out[f"d={d} W={window}"] = dict(default_us=s.time(), tflops_best=s.tflops(res[0][0]), best=res[:5])
            print(json.dumps({f"d={d} W={window}": out[f"d={d} W={window}"]}), flush=True)
            del s
            torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------- tree verify
TREE_CASES = [(1, 32768, None), (8, 32768, None), (8, 4096, None), (32, 4096, None),
              (1, 32768, 128), (8, 32768, 128), (32, 4096, 128)]   # (batch, prefix, W)
TREE_LAYERS = 18    # GPT-OSS-120B: 18 full and 18 window layers, each kind's lists built once per forward


def bench_tree_verify(layout="random", page=16, seed=0):
    """Tree verify (top-2 tree of 15 drafts) over a long prefix, one layer of each kind: the extend
    kernel with the tree's mask against the decode-like path (split-K decode over one list per draft
    token). The decode-like lists are built once per forward (per list kind), so the build is timed
    apart: the fused builder (hwkv_cuda.kernels.tree) and the torch path it replaces; `forward_*_us`
    prices TREE_LAYERS layers of the kind plus one build."""
    import hwkv_cuda.backend  # noqa: F401 - registers the fused builder for "cuda", as an engine's backend does
    from hwkv import ops
    from hwkv.metadata import KVIndexList
    from hwkv.spec import DraftTree, alloc_tree_decode, build_tree_mask, tree_decode_list
    par = [-1] + [(i - 1) // 2 for i in range(1, 15)]
    rows = []
    for bs, prefix, window in TREE_CASES:
        n = len(par)
        s = ExtendSetup(bs, n, prefix, window, page=page, layout=layout, seed=seed)
        draft = DraftTree.from_parents([par] * bs, device=DEV)
        ext = torch.full((bs,), n, dtype=torch.int64, device=DEV)
        tree = build_tree_mask(draft, ext, s.qo_indptr, s.q_pos0, int(draft.mask.shape[0]), bs * n)
        keys = prefix + n - s.pos0
        lst = KVIndexList(s.kv_indptr, s.indices, s.kv_pos0, window, keys)
        cap = min(keys, window) if window else keys
        buf = alloc_tree_decode(bs * n, cap, DEV)

        def build():
            return tree_decode_list(tree, lst, s.qo_indptr, s.q_pos0, ext, bs * n, cap, buf)

        def build_torch():
            fused = ops._TREE_DECODE.pop("cuda")
            try:
                return build()
            finally:
                ops._TREE_DECODE["cuda"] = fused

        r = build_torch()
        want_lists = (r.indptr.clone(), r.pos0.clone(), r.indices[:int(r.indptr[-1])].clone())
        r = build()
        same = (torch.equal(r.indptr, want_lists[0]) and torch.equal(r.pos0, want_lists[1])
                and torch.equal(r.indices[:int(r.indptr[-1])], want_lists[2]))

        def ext_fn():
            extend_attention(s.q, s.k_buf, s.v_buf, s.kv_indptr, s.indices, s.kv_pos0, s.qo_indptr, s.q_pos0,
                             s.out, n, 0.125, window, 0.0, s.sinks, None, None, tree=tree)

        def dec_fn():
            decode_attention(s.q, s.k_buf, s.v_buf, r.indptr, r.indices, r.pos0, tree.q_positions, s.out, 0.125,
                             window, 0.0, s.sinks, None, None, cap)
        ext_fn()
        want = s.out.clone()
        dec_fn()
        err = rel_err(s.out, want.float())
        ext_us, dec_us = graph_us([ext_fn], reps=20), graph_us([dec_fn], reps=20)
        build_us, build_torch_us = graph_us([build], reps=20), graph_us([build_torch], reps=20)
        row = dict(batch=bs, prefix=prefix, drafts=n, window=window, extend_us=ext_us, decode_like_us=dec_us,
                   build_us=build_us, build_torch_us=build_torch_us, fused_equals_torch=same,
                   forward_extend_us=TREE_LAYERS * ext_us, forward_decode_like_us=TREE_LAYERS * dec_us + build_us,
                   rel_diff=err)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del s, buf
        torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- checks
def dense_ref(q, k, v, q_pos, k_pos, scaling, window, sinks, cap=0.0):
    """fp32 attention of one request on the GPU: q [T,H,D], k/v [N,KVH,*] at positions."""
    g = q.shape[1] // k.shape[1]
    kf, vf = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    s = torch.einsum("thd,nhd->htn", q.float(), kf) * scaling
    if cap:
        s = cap * torch.tanh(s / cap)
    vis = k_pos[None, :] <= q_pos[:, None]
    if window:
        vis &= k_pos[None, :] > q_pos[:, None] - window
    s = s.masked_fill(~vis[None], float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.float().view(-1, 1, 1).expand(-1, s.shape[1], 1)], -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)[..., :k.shape[0]]
    return torch.einsum("htn,nhd->thd", p, vf)


def rel_err(out, ref):
    assert not torch.isnan(out).any(), "NaN in kernel output"
    return ((out.float() - ref).norm() / ref.norm()).item()


def check_decode_large(cases=((16, 32768, None), (256, 4096, None), (256, 32768, 128))):
    errs = {}
    for bs, ctx, window in cases:
        s = DecodeSetup(bs, ctx, window, dense=False)
        s.out.fill_(float("nan"))
        s.run(0)
        kp = torch.arange(ctx - s.list_len, ctx, device=DEV)
        ix = s.indices[0].view(bs, -1)
        ref = torch.stack([dense_ref(s.q[b:b + 1], s.k_buf[ix[b]], s.v_buf[ix[b]], s.q_pos[b:b + 1], kp,
                                     1 / 8, window, s.sinks)[0] for b in range(0, bs, max(1, bs // 8))])
        errs[f"decode {bs}x{ctx} W={window}"] = rel_err(s.out[::max(1, bs // 8)], ref)
        del s
    return errs


def check_decode_merges(cases=((1, 4096), (16, 4096), (1, 32768), (16, 32768)), repeats=50):
    """The last split merging in place against the merge kernel (rel diff), and repeated in-place runs against
    the first (must be bit-equal: which program merges changes, the order it sums the splits in does not; a
    program that read a partial before its writer's stores landed would show here)."""
    errs = {}
    for bs, ctx in cases:
        s = DecodeSetup(bs, ctx, dense=False)
        cfg = s.config()
        fused, separate = (dataclasses.replace(cfg, fused_merge_bytes=b) for b in (1 << 62, 0))
        if s.plan(fused).splits == 1:
            continue
        splits = s.plan(fused).splits
        outs = []
        for c in (separate, fused):
            ws = make_decode_workspace(bs, H, D, splits, DEV)
            s.out.fill_(float("nan"))
            s.run(0, c, ws)
            outs.append(s.out.clone())
        errs[f"decode {bs}x{ctx} merge in place vs kernel"] = rel_err(outs[1], outs[0].float())
        ws = make_decode_workspace(bs, H, D, splits, DEV)
        worst = 0.0
        for _ in range(repeats):
            s.run(0, fused, ws)
            worst = max(worst, (s.out.float() - outs[1].float()).abs().max().item())
        errs[f"decode {bs}x{ctx} merge in place repeated (max abs change, must be 0)"] = worst
        del s
    return errs


def check_extend_large(d=64, dv=64, window=None, cap=0.0, heads=(H, KVH), dtype=DT,
                       prefix=(0, 1500, 3000, 37), ext=(700, 1000, 1, 200)):
    h, kvh = heads
    prefix, ext = list(prefix), list(ext)
    seq = [p + e for p, e in zip(prefix, ext)]
    size = 2 * sum(seq) + 1
    k_buf = torch.randn(size, kvh, d, device=DEV).to(dtype)
    v_buf = torch.randn(size, kvh, dv, device=DEV).to(dtype)
    slots = torch.split(torch.randperm(size - 1, device=DEV)[:sum(seq)] + 1, seq)
    pos0 = [max(0, p - window + 1) if window else 0 for p in prefix]
    lists = [sl[p0:] for sl, p0 in zip(slots, pos0)]
    i32 = dict(dtype=torch.int32, device=DEV)
    kv_indptr = torch.tensor([0] + [len(x) for x in lists], **i32).cumsum(0).to(torch.int32)
    qo_indptr = torch.tensor([0] + ext, **i32).cumsum(0).to(torch.int32)
    q = torch.randn(sum(ext), h, d, device=DEV).to(dtype)
    out = torch.full((sum(ext), h, dv), float("nan"), device=DEV, dtype=dtype)
    sinks = torch.randn(h, device=DEV)
    i64 = dict(dtype=torch.int64, device=DEV)
    extend_attention(q, k_buf, v_buf, kv_indptr, torch.cat(lists), torch.tensor(pos0, **i64), qo_indptr,
                     torch.tensor(prefix, **i64), out, max(ext), d ** -0.5, window, cap, sinks, None, None)
    refs = []
    for b, (p, e) in enumerate(zip(prefix, ext)):
        kp = torch.arange(p + e, device=DEV)
        refs.append(dense_ref(q[qo_indptr[b]:qo_indptr[b + 1]], k_buf[slots[b]], v_buf[slots[b]],
                              torch.arange(p, p + e, device=DEV), kp, d ** -0.5, window, sinks, cap))
    return rel_err(out, torch.cat(refs))


def run_checks():
    errs = check_decode_large()
    errs.update(check_decode_merges())
    for d, dv, window, cap in ((64, 64, None, 0.0), (64, 64, 128, 0.0), (80, 80, 100, 30.0), (96, 64, None, 0.0)):
        errs[f"extend d={d} dv={dv} W={window} cap={cap}"] = check_extend_large(d, dv, window, cap)
    errs["extend fp32 d=64 W=64"] = check_extend_large(64, 64, 64, 0.0, (8, 2), torch.float32)
    for name, e in errs.items():
        ok = e == 0 if "must be 0" in name else e < 1e-2
        print(f"check {name}: {e:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    return errs


# ----------------------------------------------------------------------------- report
def fmt(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) else str(x)


def ratio_cell(r, name):
    """'1.03x' of the backend's time, or why there is none."""
    x = r.get(f"vs_{name}")
    return f"{x:.2f}x" if isinstance(x, float) else str(r.get(f"sdpa_{name}_us", "-"))


def extend_table(rows):
    layout = f"{rows[0]['layout']} pages of {rows[0]['page']}" if rows and "layout" in rows[0] else "pages"
    lines = [f"| prefill/extend (H=64 KVH=8 D=64 bf16, {layout}) | us (graph) | TFLOP/s | frac of peak "
             "| frac of copy BW | SDPA flash us (TFLOP/s) | SDPA cuDNN us (TFLOP/s) | / cuDNN | / flash "
             "| best us (sweep) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        name = (f"{r['batch']} x {r['new']}" + (f" over {r['prefix']}" if r["prefix"] else "")
                + (f" W={r['window']}" if r["window"] else " causal"))
        sd = [f"{fmt(r[f'sdpa_{n}_us'], '.1f')}" + (f" ({r[f'sdpa_{n}_tflops']:.0f})" if r[f"sdpa_{n}_tflops"] else "")
              for n in ("flash", "cudnn")]
        lines.append(f"| {name} | {r['us']:.1f} | {r['tflops']:.0f} | {fmt(r.get('frac_peak'), '.3f')} "
                     f"| {r['frac_copy_bw']:.3f} | {sd[0]} | {sd[1]} | {ratio_cell(r, 'cudnn')} "
                     f"| {ratio_cell(r, 'flash')} | {fmt(r.get('best_us', '-'), '.1f')} |")
    return "\n".join(lines)


def table(copy_bw, store, decode):
    lines = [f"copy bandwidth (4 GiB D2D, read+write): {copy_bw / 1e12:.3f} TB/s", "",
             "| store_kv, 36 layers | us (graph) | % of copy BW | best us (sweep) |", "| --- | --- | --- | --- |"]
    for r in store:
        lines.append(f"| {r['tokens']} tokens | {r['us_36_layers']:.1f} | {r['pct_copy_bw']:.1f} "
                     f"| {r['best_us']:.1f} |")
    layout = next((f"{r['layout']} pages of {r['page']}" for r in decode if not r.get("scatter")), "pages")
    lines += ["", f"| decode (H=64 KVH=8 D=64 bf16 sinks, {layout}) | keys | splits | merge | us (graph) "
              "| us merge in place / kernel | TFLOP/s | frac of peak | frac of copy BW | SDPA dense us "
              "| cuDNN us | / cuDNN | flash us | / flash | best us (sweep) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in decode:
        name = (f"{r['batch']} x {r['context']}" + (f" SWA W={r['window']}" if r["window"] else "")
                + (" random slots" if r["scatter"] else ""))
        merges = (f"{r['us_fused_merge']:.1f} / {r['us_merge_kernel']:.1f}"
                  if isinstance(r.get("us_fused_merge"), float) else "-")
        lines.append(f"| {name} | {r['keys']} | {r['splits']} | {r.get('merge', '-')} | {r['us']:.1f} | {merges} "
                     f"| {fmt(r.get('tflops'), '.1f')} | {fmt(r.get('frac_peak'), '.4f')} | {r['frac_copy_bw']:.3f} "
                     f"| {fmt(r['sdpa_us'], '.1f')} | {fmt(r.get('sdpa_cudnn_us', '-'), '.1f')} "
                     f"| {ratio_cell(r, 'cudnn')} | {fmt(r.get('sdpa_flash_us', '-'), '.1f')} "
                     f"| {ratio_cell(r, 'flash')} | {fmt(r.get('best_us', '-'), '.1f')} |")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_cuda_kernels.json")
    ap.add_argument("--sweep", action="store_true", help="also time a grid of launch configs")
    ap.add_argument("--no-check", action="store_true", help="skip the large-shape correctness checks")
    ap.add_argument("--only", choices=["all", "extend", "decode", "tree"], default="all",
                    help="run only the prefill/extend, the store+decode or the tree-verify section")
    ap.add_argument("--sweep-head-dims", action="store_true",
                    help="also sweep extend configs for head dims 128 and 256 (the recorded table)")
    ap.add_argument("--layout", choices=LAYOUTS, default="random",
                    help="where the pages of the decode, extend and tree cases go: a seeded random permutation of "
                         "the pool's pages (default), or one run of pages per request")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the page placement and the random K/V/q")
    ap.add_argument("--decode-config", action="append", metavar="SPEC",
                    help="also time each decode case with these DecodeConfig fields changed (field=value,...; "
                         "repeatable), beside its dispatched config")
    ap.add_argument("--decode-cells", metavar="BxC[xW],...",
                    help="time these decode cells (batch x context [x window]) in place of the recorded ones, e.g. "
                         "8x4096,32x4096,1x32768x128")
    ap.add_argument("--rounds", type=int, default=3, help="--decode-config: interleaved rounds (median reported)")
    ap.add_argument("--profile-decode", metavar="BxC[xW]",
                    help="only run hwkv's decode and cuDNN's SDPA on this cell once each between cudaProfilerStart "
                         "and Stop (for ncu --profile-from-start off)")
    args = ap.parse_args(argv)
    if args.page_size < 1:
        ap.error("--page-size must be at least 1")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    args.decode_cases = DECODE_CASES
    if args.decode_cells is not None:
        if args.only not in ("all", "decode"):
            ap.error(f"--decode-cells with --only {args.only}: the decode section does not run")
        try:
            args.decode_cases = parse_decode_cells(args.decode_cells)
        except ValueError as e:
            ap.error(str(e))
    args.profile_cell = None
    if args.profile_decode is not None:
        try:
            cells = parse_decode_cells(args.profile_decode)
        except ValueError as e:
            ap.error(str(e).replace("--decode-cells", "--profile-decode"))
        if len(cells) != 1:
            ap.error(f"--profile-decode {args.profile_decode!r}: one cell (BxC[xW])")
        args.profile_cell = cells[0]
    args.decode_changes = []
    for spec in args.decode_config or ():
        if args.only not in ("all", "decode"):
            ap.error(f"--decode-config with --only {args.only}: the decode section does not run")
        try:
            args.decode_changes.append((spec, parse_decode_config(spec)))
        except ValueError as e:
            ap.error(str(e))
    return args


def profile_decode(bs, ctx, window):
    """hwkv's decode and cuDNN's SDPA over the same K/V, once each between cudaProfilerStart and Stop (three
    warm-up calls of each first, so the profile sees neither compiling nor the first launch)."""
    s = DecodeSetup(bs, ctx, window)
    cfg = s.config()
    ws = make_decode_workspace(bs, H, D, decode_num_splits(bs, KVH, s.list_len, DEV, cfg, head_dim=D), DEV)
    q4, (k, v) = s.q.view(bs, H, 1, D), s.dense[0]

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(q4, k, v, scale=1 / 8, enable_gqa=True)
    for _ in range(3):
        s.run(0, cfg, ws)
        cudnn()
    torch.cuda.synchronize()
    print(f"decode {bs} x {ctx}" + (f" W={window}" if window else "") + f": {cfg}", flush=True)
    torch.cuda.profiler.start()
    s.run(0, cfg, ws)
    cudnn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_cuda_kernels needs a CUDA GPU")
    if args.profile_cell is not None:
        profile_decode(*args.profile_cell[:3])
        return
    torch.manual_seed(args.seed)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layout": args.layout,
              "page_size": args.page_size, "seed": args.seed, "peak_bf16_tflops": H200_BF16_TFLOPS,
              "decode_configs": {n: repr(getattr(decode_mod, n))
                                 for n in ("GPU_CONFIG", "MID_CONFIG", "WIDE_CONFIG", "LONG_CONFIG", "LONG_FEW_CONFIG",
                                           "WIDE_LONG_CONFIG", "ROWS_CONFIG")}}
    import triton
    result["triton"] = triton.__version__
    if not args.no_check:
        result["checks"] = run_checks()
    copy_bw = copy_bandwidth()
    result["copy_bw_bytes_per_s"] = copy_bw
    if args.only in ("all", "extend"):
        result["extend"] = bench_extend(copy_bw, args.sweep, args.layout, args.page_size, args.seed)
        if args.sweep_head_dims:
            result["extend_head_dims"] = sweep_extend_head_dims()
    if args.only in ("all", "tree"):
        result["tree_verify"] = bench_tree_verify(args.layout, args.page_size, args.seed)
    if args.only in ("all", "decode"):
        result["store"] = bench_store(copy_bw, args.sweep)
        result["decode"] = bench_decode(copy_bw, args.sweep, args.layout, args.page_size, args.seed,
                                        args.decode_changes, args.rounds, args.decode_cases)
    Path(args.out).write_text(json.dumps(result, indent=1))
    if "extend" in result:
        print(extend_table(result["extend"]))
    if "decode" in result:
        print(table(copy_bw, result["store"], result["decode"]))


if __name__ == "__main__":
    main()
