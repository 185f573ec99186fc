"""Benchmark (and check) hwkv_cuda's Triton kernels on one CUDA GPU.

    python3 benchmarks/bench_cuda_kernels.py --out results.json [--sweep] [--no-check]

Measures, each as the median over repeats of a CUDA graph replay:
  * device copy bandwidth (4 GiB device-to-device copy, bytes read + written),
  * store_kv for 36 layers x {1, 64, 8192} tokens (KVH=8, D=64, bf16) vs copy bandwidth,
  * decode attention, one layer (H=64, KVH=8, D=64, bf16, sinks), batch {1,16,64,256} x
    context {4K, 32K}, against copy bandwidth (bytes = K + V read), and SWA decode over a
    128-key window list at batch 1 and 256,
  * torch SDPA (enable_gqa) over the same K/V gathered dense, in the same run,
  * prefill/extend (same layer shape, page 16, pages at random places): 1 x 8192 causal,
    4 x 2048 new tokens over a 2048-token prefix, 8 x 1024, one 2048-token chunk over a 30K
    prefix, each full and W=128, beside torch SDPA's flash and cuDNN backends over dense K/V
    (causal_lower_right for prefixes, an explicit boolean mask for windows; "n/a" where a
    backend refuses); TFLOP/s counts visible (query, key) pairs only,
  * tree verify (15 drafts, top-2 tree) over 4K/32K prefixes, full and W=128: the extend kernel with
    the tree mask against the decode-like path, and the decode-like lists' build (fused and torch).
Each request's slots are one contiguous run at a random place in the pool. Small cases
rotate over several disjoint KV sets inside one graph so that the L2 cache does not serve them.
Prints a Markdown table last and writes every number as JSON to --out.
"""
from __future__ import annotations

import argparse
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
    """R disjoint KV sets of `bs` requests with `ctx` keys each (last `window` only when given)."""

    def __init__(self, bs, ctx, window=None, dense=True, scatter=False):
        list_len = min(ctx, window) if window else ctx
        self.bytes = bs * list_len * KVH * 2 * D * 2
        self.reps = max(1, min(32, math.ceil(L2_BYTES / self.bytes)))
        total = self.reps * bs
        slots = total * ctx + 1
        self.k_buf = torch.randn(slots, KVH, D, device=DEV).to(DT)
        self.v_buf = torch.randn(slots, KVH, D, device=DEV).to(DT)
        order = torch.randperm(total, device=DEV)            # request r*bs+b lives at block order[.]
        self.bs, self.ctx, self.window, self.list_len = bs, ctx, window, list_len
        self.q = torch.randn(bs, H, D, device=DEV).to(DT)
        self.out = torch.empty(bs, H, D, device=DEV, dtype=DT)
        self.sinks = torch.randn(H, device=DEV)
        self.q_pos = torch.full((bs,), ctx - 1, dtype=torch.int64, device=DEV)
        self.kv_pos0 = torch.full((bs,), ctx - list_len, dtype=torch.int64, device=DEV)
        self.indptr = torch.arange(0, bs + 1, dtype=torch.int32, device=DEV) * list_len
        j = torch.arange(ctx - list_len, ctx, device=DEV)
        self.indices = [(1 + order[r * bs:(r + 1) * bs, None] * ctx + j[None]).reshape(-1)
                        for r in range(self.reps)]
        if scatter:   # page size 1 after heavy churn: every token at a random slot
            perm = torch.randperm(slots - 1, device=DEV) + 1
            self.indices = [perm[ix - 1] for ix in self.indices]
        self.dense = None
        if dense:   # the same K/V gathered dense for SDPA: [bs, KVH, len, D]
            self.dense = [(self.k_buf[ix].view(bs, list_len, KVH, D).transpose(1, 2).contiguous(),
                           self.v_buf[ix].view(bs, list_len, KVH, D).transpose(1, 2).contiguous())
                          for ix in self.indices]

    def run(self, r, cfg=None, ws=None):
        decode_attention(self.q, self.k_buf, self.v_buf, self.indptr, self.indices[r], self.kv_pos0,
                         self.q_pos, self.out, 1 / 8, self.window, 0.0, self.sinks, None, None,
                         self.list_len, workspace=ws, config=cfg)

    def time(self, cfg=None):
        cfg = cfg or decode_mod.decode_config(self.bs, KVH, D, self.list_len, DEV)
        splits = decode_num_splits(self.bs, KVH, self.list_len, DEV, cfg, head_dim=D)
        ws = make_decode_workspace(self.bs, H, D, splits, DEV)
        return graph_us([lambda r=r: self.run(r, cfg, ws) for r in range(self.reps)]), splits

    def time_sdpa(self):
        q4 = self.q.view(self.bs, H, 1, D)

        def sdpa(k, v):
            with sdpa_kernel(FAST_SDPA):   # never the math fallback (it would copy K/V per q head)
                F.scaled_dot_product_attention(q4, k, v, scale=1 / 8, enable_gqa=True)
        try:
            return graph_us([lambda k=k, v=v: sdpa(k, v) for k, v in self.dense])
        except Exception as e:  # noqa: BLE001 - reported in the table, not hidden
            return f"n/a ({type(e).__name__})"


SWEEP = [DecodeConfig(block_n=bn, mid_block_n=bn, num_warps=4, num_stages=st, ctas_per_sm=c,
                      min_keys_per_split=128, heads_per_program=hpp)
         for hpp in (1, 2) for bn, st in ((64, 3), (128, 2), (128, 3), (128, 4)) for c in (1, 2, 4, 8)]


def bench_decode(copy_bw, sweep):
    rows = []
    cases = ([(b, c, None, False) for c in (4096, 32768) for b in (1, 16, 64, 256)]
             + [(1, 32768, 128, False), (256, 32768, 128, False), (64, 4096, None, True)])
    for bs, ctx, window, scatter in cases:
        s = DecodeSetup(bs, ctx, window, scatter=scatter)
        us, splits = s.time()
        row = dict(batch=bs, context=ctx, window=window, scatter=scatter, keys=s.list_len, splits=splits, us=us,
                   frac_copy_bw=s.bytes / (us * 1e-6) / copy_bw, sdpa_us=s.time_sdpa())
        if sweep:
            res = sorted((s.time(cfg)[0], repr(cfg)) for cfg in SWEEP)
            row.update(best_us=res[0][0], best_config=res[0][1], sweep=res)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "sweep"}), flush=True)
        del s
        torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- prefill / extend
PREFILL_CASES = [  # (requests, new tokens each, prefix each)
    (1, 8192, 0), (4, 2048, 2048), (8, 1024, 0), (1, 2048, 30720)]


class ExtendSetup:
    """`bs` requests of `new` tokens over `prefix` cached ones, K/V in page-16 pages at random places."""

    def __init__(self, bs, new, prefix, window=None, h=H, kvh=KVH, d=D, page=16):
        seq = prefix + new
        self.bs, self.new, self.prefix, self.window, self.h, self.kvh, self.d = bs, new, prefix, window, h, kvh, d
        pages_per = -(-seq // page)
        n_pages = bs * pages_per + 1
        self.k_buf = torch.randn(n_pages * page, kvh, d, device=DEV).to(DT)
        self.v_buf = torch.randn(n_pages * page, kvh, d, device=DEV).to(DT)
        order = (torch.randperm(n_pages - 1, device=DEV) + 1).view(bs, pages_per)
        slots = (order[:, :, None] * page + torch.arange(page, device=DEV)).reshape(bs, -1)[:, :seq]
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
        return 4 * self.pairs * self.h * self.d / (us * 1e-6) / 1e12

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


def bench_extend(copy_bw, sweep):
    rows = []
    for bs, new, prefix in PREFILL_CASES:
        for window in (None, 128):
            s = ExtendSetup(bs, new, prefix, window)
            us = s.time()
            row = dict(batch=bs, new=new, prefix=prefix, window=window, us=us, tflops=s.tflops(us),
                       frac_copy_bw=s.bytes / (us * 1e-6) / copy_bw, rel_err=s.check())
            for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                t = s.sdpa(backend)
                row[f"sdpa_{name}_us"] = t
                row[f"sdpa_{name}_tflops"] = s.tflops(t) if isinstance(t, float) else None
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


def bench_tree_verify():
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
        s = ExtendSetup(bs, n, prefix, window)
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
    for d, dv, window, cap in ((64, 64, None, 0.0), (64, 64, 128, 0.0), (80, 80, 100, 30.0), (96, 64, None, 0.0)):
        errs[f"extend d={d} dv={dv} W={window} cap={cap}"] = check_extend_large(d, dv, window, cap)
    errs["extend fp32 d=64 W=64"] = check_extend_large(64, 64, 64, 0.0, (8, 2), torch.float32)
    for name, e in errs.items():
        print(f"check {name}: rel err {e:.2e} {'ok' if e < 1e-2 else 'FAIL'}", flush=True)
    return errs


# ----------------------------------------------------------------------------- report
def fmt(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) else str(x)


def extend_table(rows):
    lines = ["| prefill/extend (H=64 KVH=8 D=64 bf16, page 16) | us (graph) | TFLOP/s | frac of copy BW "
             "| SDPA flash us (TFLOP/s) | SDPA cuDNN us (TFLOP/s) | best us (sweep) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        name = (f"{r['batch']} x {r['new']}" + (f" over {r['prefix']}" if r["prefix"] else "")
                + (f" W={r['window']}" if r["window"] else " causal"))
        sd = [f"{fmt(r[f'sdpa_{n}_us'], '.1f')}" + (f" ({r[f'sdpa_{n}_tflops']:.0f})" if r[f"sdpa_{n}_tflops"] else "")
              for n in ("flash", "cudnn")]
        lines.append(f"| {name} | {r['us']:.1f} | {r['tflops']:.0f} | {r['frac_copy_bw']:.3f} | {sd[0]} | {sd[1]} "
                     f"| {fmt(r.get('best_us', '-'), '.1f')} |")
    return "\n".join(lines)


def table(copy_bw, store, decode):
    lines = [f"copy bandwidth (4 GiB D2D, read+write): {copy_bw / 1e12:.3f} TB/s", "",
             "| store_kv, 36 layers | us (graph) | % of copy BW | best us (sweep) |", "| --- | --- | --- | --- |"]
    for r in store:
        lines.append(f"| {r['tokens']} tokens | {r['us_36_layers']:.1f} | {r['pct_copy_bw']:.1f} "
                     f"| {r['best_us']:.1f} |")
    lines += ["", "| decode (H=64 KVH=8 D=64 bf16 sinks) | keys | splits | us (graph) | frac of copy BW "
              "| SDPA dense us | best us (sweep) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in decode:
        name = (f"{r['batch']} x {r['context']}" + (f" SWA W={r['window']}" if r["window"] else "")
                + (" random slots" if r["scatter"] else ""))
        lines.append(f"| {name} | {r['keys']} | {r['splits']} | {r['us']:.1f} | {r['frac_copy_bw']:.3f} "
                     f"| {fmt(r['sdpa_us'], '.1f')} | {fmt(r.get('best_us', '-'), '.1f')} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_cuda_kernels.json")
    ap.add_argument("--sweep", action="store_true", help="also time a grid of launch configs")
    ap.add_argument("--no-check", action="store_true", help="skip the large-shape correctness checks")
    ap.add_argument("--only", choices=["all", "extend", "decode", "tree"], default="all",
                    help="run only the prefill/extend, the store+decode or the tree-verify section")
    ap.add_argument("--sweep-head-dims", action="store_true",
                    help="also sweep extend configs for head dims 128 and 256 (the recorded table)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_cuda_kernels needs a CUDA GPU")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "decode_configs": {n: repr(getattr(decode_mod, n)) for n in ("GPU_CONFIG", "WIDE_CONFIG", "LONG_CONFIG")}}
    import triton
    result["triton"] = triton.__version__
    if not args.no_check:
        result["checks"] = run_checks()
    copy_bw = copy_bandwidth()
    result["copy_bw_bytes_per_s"] = copy_bw
    if args.only in ("all", "extend"):
        result["extend"] = bench_extend(copy_bw, args.sweep)
        if args.sweep_head_dims:
            result["extend_head_dims"] = sweep_extend_head_dims()
    if args.only in ("all", "tree"):
        result["tree_verify"] = bench_tree_verify()
    if args.only in ("all", "decode"):
        result["store"] = bench_store(copy_bw, args.sweep)
        result["decode"] = bench_decode(copy_bw, args.sweep)
    Path(args.out).write_text(json.dumps(result, indent=1))
    if "extend" in result:
        print(extend_table(result["extend"]))
    if "decode" in result:
        print(table(copy_bw, result["store"], result["decode"]))


if __name__ == "__main__":
    main()
