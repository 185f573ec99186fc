"""Per-forward KV-write path and full decode step of GPT-OSS-120B's attention stack on one GPU.

Reports, in one run: device copy bandwidth (4 GiB D2D, read + write counted); the KV-write
path of all 36 layers per forward (translation once per forward vs per SWA layer, hwkv's
Triton store vs plain torch index_put, eager vs CUDA graph); a full decode step (write +
attention, 36 layers) eager vs graph; torch SDPA over the same KV gathered dense.

    python3 benchmarks/bench_cuda_step.py --out results.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable, Dict, List

import torch

from hwkv import ops
from hwkv.allocator import ReqToTokenPool, SWATokenToKVPoolAllocator, release_out_of_window
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.graph import EagerAdapter, GraphRunner
from hwkv.layer import AttentionLayer
from hwkv.loc import KVWriteLoc
from hwkv.pool import SWAKVPool

LAYERS, W, H, KVH, D = 36, 128, 64, 8, 64


def timeit(fn: Callable[[], object], dev: str, iters: int = 50, warmup: int = 5) -> float:
    """Median microseconds per call (CUDA events around each call; wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if dev == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def copy_bandwidth(dev: str) -> float:
    """Bytes/s of a 4 GiB device-to-device copy, read + write counted."""
    n = (4 << 30) if dev == "cuda" else (256 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    us = timeit(lambda: dst.copy_(src), dev, iters=20)
    del src, dst
    return 2 * n / (us * 1e-6)


def capture(fn: Callable[[], object], dev: str) -> Callable[[], None]:
    if dev != "cuda":
        return fn
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


class Setup:
    """A GPT-OSS-120B-shaped hybrid pool with `bs` requests of `ctx` tokens each."""

    def __init__(self, dev: str, bs: int, ctx: int, size: int, size_swa: int) -> None:
        self.dev = dev
        swa_ids = [i for i in range(LAYERS) if i % 2 == 0]
        full_ids = [i for i in range(LAYERS) if i % 2 == 1]
        self.pool = SWAKVPool(size, size_swa, 1, torch.bfloat16, KVH, D, swa_ids, full_ids, dev)
        self.alloc = SWATokenToKVPoolAllocator(size, size_swa, 1, dev, self.pool)
        self.rtt = ReqToTokenPool(max(bs, 1), ctx + 16, dev)
        self.layers = [AttentionLayer(i, H, KVH, D, sliding_window=W if i % 2 == 0 else None,
                                      sinks=torch.zeros(H, device=dev)) for i in range(LAYERS)]
        self.bs, self.ctx = bs, ctx
        rows = self.rtt.alloc(bs)
        for r in rows:
            loc = self.alloc.alloc_extend([0], [ctx - 1], [0], ctx - 1)
            self.rtt.write(r, 0, loc)
            release_out_of_window(self.alloc, self.rtt.req_to_token[r], ctx - 1, 0, W)
        self.rows = torch.tensor(rows, dtype=torch.int64, device=dev)

    def decode_batch(self) -> ForwardBatch:
        last = self.rtt.req_to_token[self.rows, self.ctx - 2].tolist()
        loc = self.alloc.alloc_decode([self.ctx] * self.bs, last)
        self.rtt.req_to_token[self.rows, self.ctx - 1] = loc
        seq = torch.full((self.bs,), self.ctx, dtype=torch.int64, device=self.dev)
        return ForwardBatch(ForwardMode.DECODE, self.bs, self.rows, seq, loc, seq_lens_cpu=seq.cpu())


def kv_write_rows(dev: str, tokens: List[int], bw: float) -> List[Dict]:
    """The write path of one forward for all 36 layers."""
    rows = []
    for n in tokens:
        size = max(2 * n, 4096)
        s = Setup(dev, 0, 1, size, size)
        loc = s.alloc.alloc(n)
        k = torch.randn(n, KVH, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        swa_buf = torch.zeros(n, dtype=torch.int64, device=dev)

        def once(store=None):
            swa = s.pool.translate_loc_from_full_to_swa(loc, out=swa_buf)
            wl = KVWriteLoc(loc, swa)
            for layer in s.layers:
                s.pool.set_kv_buffer(layer, wl, k, v)

        def per_layer():
            for layer in s.layers:
                swa = s.pool.translate_loc_from_full_to_swa(loc) if layer.is_swa else None
                s.pool.set_kv_buffer(layer, KVWriteLoc(loc, swa), k, v)

        moved = 2 * LAYERS * 2 * k.numel() * k.element_size()  # read k/v + write pool, K and V
        for impl in ("triton", "torch"):
            saved = dict(ops._STORE)
            if impl == "torch":
                ops._STORE.pop(dev, None)
            for name, fn in (("once", once), ("per-layer", per_layer)):
                for mode in ("eager", "graph"):
                    f = fn if mode == "eager" else capture(fn, dev)
                    us = timeit(f, dev)
                    rows.append(dict(bench="kv-write", tokens=n, store=impl, translate=name, mode=mode,
                                     us=round(us, 2), frac_copy_bw=round(moved / (us * 1e-6) / bw, 3)))
            ops._STORE.clear()
            ops._STORE.update(saved)
        del s
    return rows


def decode_step_rows(dev: str, batches: List[int], ctx: int, backend_cls) -> List[Dict]:
    """A full decode step (write + attention, 36 layers), eager vs graph, and SDPA per full layer."""
    rows = []
    for bs in batches:
        s = Setup(dev, bs, ctx, bs * ctx + 4096, ctx + bs * (W + 64) + 4096)
        be = backend_cls(s.pool, s.rtt, sliding_window=W)
        batch = s.decode_batch()
        inputs = {"q": torch.randn(bs, H, D, device=dev, dtype=torch.bfloat16),
                  "k": torch.randn(bs, KVH, D, device=dev, dtype=torch.bfloat16),
                  "v": torch.randn(bs, KVH, D, device=dev, dtype=torch.bfloat16)}

        def step(b, i):
            out = None
            for layer in s.layers:
                out = be.forward(i["q"], i["k"], i["v"], layer, b)
            return out

        def eager():
            be.init_forward_metadata(batch)
            step(batch, inputs)

        us_eager = timeit(eager, dev, iters=20)
        adapter = EagerAdapter() if dev != "cuda" else __import__("hwkv_cuda.graph", fromlist=["x"]).CUDAGraphAdapter()
        runner = GraphRunner(be, step, [bs], {k: (tuple(v.shape[1:]), v.dtype) for k, v in inputs.items()}, adapter)
        runner.capture()
        us_graph = timeit(lambda: runner.run(batch, inputs), dev, iters=20)
        cap = runner.graphs[bs]
        us_replay = timeit(lambda: runner.adapter.replay(cap.graph), dev, iters=20)
        static = runner._static_batch(bs)
        us_refill = timeit(lambda: be.init_forward_metadata_graph(static), dev, iters=20)
        full = s.layers[1]
        be.init_forward_metadata(batch)
        md = be.forward_metadata
        us_layer_eager = timeit(lambda: be.forward(inputs["q"], inputs["k"], inputs["v"], full, batch), dev)
        kd = s.pool.get_key_buffer(1)[md.full.indices[:bs * ctx]].view(bs, ctx, KVH, D).transpose(1, 2).contiguous()
        vd = s.pool.get_value_buffer(1)[md.full.indices[:bs * ctx]].view(bs, ctx, KVH, D).transpose(1, 2).contiguous()
        qd = inputs["q"].view(bs, H, 1, D)
        sdpa = timeit(lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True), dev)
        rows.append(dict(bench="decode-step", bs=bs, ctx=ctx, eager_us=round(us_eager, 1), graph_us=round(us_graph, 1),
                         graph_replay_only_us=round(us_replay, 1), metadata_refill_us=round(us_refill, 1),
                         full_layer_eager_us=round(us_layer_eager, 1), sdpa_dense_full_layer_us=round(sdpa, 1)))
        del s, be, runner, kd, vd
        if dev == "cuda":
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", default="1,8,64,256,2048,8192")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--out", default="")
    a = p.parse_args()
    dev = a.device
    if dev == "cuda":
        from hwkv_cuda.backend import TritonBackend as backend_cls
    else:
        from hwkv_cpu.backend import TorchCPUBackend as backend_cls
    bw = copy_bandwidth(dev)
    res = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu", copy_bw_TBps=round(bw / 1e12, 3),
               torch=torch.__version__)
    res["kv_write"] = kv_write_rows(dev, [int(x) for x in a.tokens.split(",")], bw)
    res["decode_step"] = decode_step_rows(dev, [int(x) for x in a.batches.split(",")], a.ctx, backend_cls)
    print(f"copy bandwidth {res['copy_bw_TBps']} TB/s on {res['device']}")
    print("| tokens | store | translate | mode | us | frac of copy bw |\n|---|---|---|---|---|---|")
    for r in res["kv_write"]:
        print(f"| {r['tokens']} | {r['store']} | {r['translate']} | {r['mode']} | {r['us']} | {r['frac_copy_bw']} |")
    print("| bs | ctx | step eager us | step graph us (refill + replay) | replay only us | metadata refill us "
          "| 1 full layer eager us | SDPA dense 1 layer us |\n|---|---|---|---|---|---|---|---|")
    for r in res["decode_step"]:
        print(f"| {r['bs']} | {r['ctx']} | {r['eager_us']} | {r['graph_us']} | {r['graph_replay_only_us']} | "
              f"{r['metadata_refill_us']} | {r['full_layer_eager_us']} | "
              f"{r['sdpa_dense_full_layer_us']} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
