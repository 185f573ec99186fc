"""Per-forward KV-write path, allocator and full decode step of GPT-OSS-120B's attention stack on one GPU.

Reports, in one run: device copy bandwidth (4 GiB D2D, read + write counted); the KV-write
path of all 36 layers per forward (translation once per forward vs per SWA layer, hwkv's
Triton store vs plain torch index_put, eager vs CUDA graph); a full decode step (write +
attention, 36 layers) eager vs graph; torch SDPA over the same KV gathered dense; the
allocator's part of a decode step (`alloc_decode` for B requests + one
`release_out_of_window_batch`, W=128) per batch size, context and page size, in host wall time
and host syncs; and the whole engine decode step (allocate + release + metadata refill +
replay) against the replay alone; a tree verify forward (15 drafts, top-2 tree: metadata + 36 layers'
write and attention, eager and through CUDA graphs) per `tree_verify` mode, extend, decode and auto; a linear
verify of 4 drafts as one VerifyStepGraph replay against the engine's host path around the layers' graph.

    python3 benchmarks/bench_cuda_step.py --out results.json
    python3 benchmarks/bench_cuda_step.py --device cpu --sections alloc,engine-step --alloc-batches 1,4 \
        --alloc-ctx 256 --step-bs 2 --step-ctx 256 --iters 5      # a smoke run on CPU
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hwkv import ops
from hwkv.allocator import SWATokenToKVPoolAllocator
from hwkv.release import release_out_of_window_batch
from hwkv.req_to_token import ReqToTokenPool
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.graph import EagerAdapter, GraphRunner
from hwkv.layer import AttentionLayer
from hwkv.loc import KVWriteLoc
from hwkv.pages import ERR_CLAIM
from hwkv.pool import SWAKVPool

LAYERS, W, H, KVH, D = 36, 128, 64, 8, 64
SECTIONS = ("kv-write", "decode-step", "alloc", "engine-step", "tree-verify", "host", "whole-step", "step-gap",
            "profile", "verify-step", "draft-step")


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


def sync(dev: str) -> None:
    if dev != "cpu":
        getattr(torch, dev).synchronize()


def wall(fn: Callable[[], object], dev: str, iters: int, warmup: int = 3) -> Tuple[List[float], List[float]]:
    """Microseconds per call on the host clock, the device synchronized before each call: until the
    call returns (host time: what the host cannot spend on anything else) and until the device is done."""
    for _ in range(warmup):
        fn()
    host, done = [], []
    for _ in range(iters):
        sync(dev)
        t = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t) * 1e6)
        sync(dev)
        done.append((time.perf_counter() - t) * 1e6)
    return host, done


def phase_walls(parts: List[Tuple[str, Callable[[], object]]], dev: str, iters: int,
                warmup: int = 3) -> Dict[str, Tuple[List[float], List[float]]]:
    """`wall` for each part of a step, the parts run in order every iteration (the state advances as
    in a real step), the device synchronized around each part."""
    out: Dict[str, Tuple[List[float], List[float]]] = {name: ([], []) for name, _ in parts}
    for it in range(warmup + iters):
        for name, fn in parts:
            sync(dev)
            t = time.perf_counter()
            fn()
            host = (time.perf_counter() - t) * 1e6
            sync(dev)
            if it >= warmup:
                out[name][0].append(host)
                out[name][1].append((time.perf_counter() - t) * 1e6)
    return out


def host_syncs(fn: Callable[[], object], dev: str) -> Optional[int]:
    """Host syncs in one call of fn, as torch.cuda's sync debug mode reports them (None off CUDA)."""
    if dev != "cuda":
        return None
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def med(xs: List[float]) -> float:
    return round(statistics.median(xs), 1)


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


def layers_fn(be, layers: List[AttentionLayer]) -> Callable[[ForwardBatch, Dict[str, torch.Tensor]], torch.Tensor]:
    """The model step a graph runner captures: every layer's write and attention on the same q/k/v."""
    def fn(b: ForwardBatch, i: Dict[str, torch.Tensor]) -> torch.Tensor:
        out = None
        for layer in layers:
            out = be.forward(i["q"], i["k"], i["v"], layer, b)
        return out
    return fn


def round_up(n: int, p: int) -> int:
    return -(-n // p) * p


class Setup:
    """A GPT-OSS-120B-shaped hybrid pool (`layers` layers, SWA and full alternating) at page size P,
    with `bs` requests of ctx-1 tokens each (prefilled and released out of window), room for
    `room` more decode steps. The pools are sized from those numbers."""

    def __init__(self, dev: str, bs: int, ctx: int, page_size: int = 1, room: int = 16, layers: int = LAYERS,
                 size: Optional[int] = None, size_swa: Optional[int] = None, spare_rows: int = 0) -> None:
        p = page_size
        self.dev, self.bs, self.p = dev, bs, p
        per_req = round_up(ctx + room, p) + p
        size = size or round_up(bs * per_req + 4096, p)
        size_swa = size_swa or round_up(bs * (round_up(W, p) + 3 * p) + per_req + 4096, p)  # windows + a prefill
        swa_ids = [i for i in range(layers) if i % 2 == 0]
        full_ids = [i for i in range(layers) if i % 2 == 1]
        self.pool = SWAKVPool(size, size_swa, p, torch.bfloat16, KVH, D, swa_ids, full_ids, dev)
        self.alloc = SWATokenToKVPoolAllocator(size, size_swa, p, dev, self.pool)
        self.rtt = ReqToTokenPool(max(bs, 1) + spare_rows, ctx + room + p, dev)
        self.layers = [AttentionLayer(i, H, KVH, D, sliding_window=W if i % 2 == 0 else None,
                                      sinks=torch.zeros(H, device=dev)) for i in range(layers)]
        i64 = dict(dtype=torch.int64, device=dev)
        rows = self.rtt.alloc(bs)
        self.rows = torch.tensor(rows, **i64)
        self.frontiers = torch.zeros(bs, **i64)
        for i, r in enumerate(rows):  # prefill one request at a time, each released right away
            loc = self.alloc.alloc_extend([0], [ctx - 1], [0], ctx - 1)
            self.rtt.write(r, 0, loc)
            release_out_of_window_batch(self.alloc, self.rtt.req_to_token, self.rows[i:i + 1],
                                        torch.full((1,), ctx - 1, **i64), self.frontiers[i:i + 1], W)
        self.seq_cpu = torch.full((bs,), ctx - 1, dtype=torch.int64)
        self.seq = self.seq_cpu.to(dev)

    def alloc_step(self) -> ForwardBatch:
        """An engine's allocation for one decode step: last locs gathered on the device, one
        `alloc_decode` (device lengths + host copies), the new locs scattered into req_to_token."""
        seq, seq_cpu = self.seq + 1, self.seq_cpu + 1
        last = self.rtt.req_to_token[self.rows, self.seq - 1]
        loc = self.alloc.alloc_decode(seq, last, seq_lens_cpu=seq_cpu)
        self.rtt.req_to_token[self.rows, self.seq] = loc
        self.seq, self.seq_cpu = seq, seq_cpu
        return ForwardBatch(ForwardMode.DECODE, self.bs, self.rows, seq, loc, seq_lens_cpu=seq_cpu)

    def release(self) -> None:
        """The out-of-window release after the step: one call for the whole batch."""
        release_out_of_window_batch(self.alloc, self.rtt.req_to_token, self.rows, self.seq, self.frontiers, W)

    decode_batch = alloc_step


def kv_write_rows(dev: str, tokens: List[int], bw: float) -> List[Dict]:
    """The write path of one forward for all 36 layers."""
    rows = []
    for n in tokens:
        s = Setup(dev, 0, 1, size=max(2 * n, 4096), size_swa=max(2 * n, 4096))
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
                for mode in ("eager", "graph") if dev == "cuda" else ("eager", ):   # no graph to capture elsewhere
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
        s = Setup(dev, bs, ctx)
        be = backend_cls(s.pool, s.rtt, sliding_window=W)
        batch = s.decode_batch()
        inputs = {"q": torch.randn(bs, H, D, device=dev, dtype=torch.bfloat16),
                  "k": torch.randn(bs, KVH, D, device=dev, dtype=torch.bfloat16),
                  "v": torch.randn(bs, KVH, D, device=dev, dtype=torch.bfloat16)}

        step = layers_fn(be, s.layers)

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


def alloc_rows(dev: str, batches: List[int], ctxs: List[int], pages: List[int], iters: int) -> List[Dict]:
    """The allocator's part of a decode step: `alloc_decode` for B requests (+ the req_to_token write)
    and one `release_out_of_window_batch`, W=128, over a 2-layer pool (the allocator sees no layers)."""
    rows = []
    for p in pages:
        for ctx in ctxs:
            for bs in batches:
                s = Setup(dev, bs, ctx, page_size=p, room=2 * iters + 16, layers=2)

                def step() -> None:
                    s.alloc_step()
                    s.release()

                host, done = wall(step, dev, iters)  # the pair as an engine runs it: one sync at the end
                ph = phase_walls([("alloc", s.alloc_step), ("release", s.release)], dev, iters, warmup=0)
                syncs = {f"syncs_{name}": host_syncs(fn, dev) for name, fn in (("alloc", s.alloc_step),
                                                                              ("release", s.release))}
                rows.append(dict(bench="alloc", page_size=p, ctx=ctx, bs=bs, step_host_us=med(host),
                                 step_us=med(done), step_mean_us=round(statistics.fmean(done), 1),
                                 **{f"{k}{suffix}": med(v[i]) for k, v in ph.items()
                                    for i, suffix in ((1, "_us"), (0, "_host_us"))}, **syncs))
                s.alloc.check_integrity()
                del s
    return rows


def engine_step_rows(dev: str, bs: int, ctx: int, page_size: int, backend_cls, iters: int) -> List[Dict]:
    """The whole engine decode step through a graph (allocate, refill, replay, release) vs the replay alone."""
    s = Setup(dev, bs, ctx, page_size=page_size, room=4 * iters + 16)
    be = backend_cls(s.pool, s.rtt, sliding_window=W)
    inputs = {"q": torch.randn(bs, H, D, device=dev, dtype=torch.bfloat16),
              "k": torch.randn(bs, KVH, D, device=dev, dtype=torch.bfloat16),
              "v": torch.randn(bs, KVH, D, device=dev, dtype=torch.bfloat16)}

    layers = layers_fn(be, s.layers)

    adapter = EagerAdapter() if dev != "cuda" else __import__("hwkv_cuda.graph", fromlist=["x"]).CUDAGraphAdapter()
    runner = GraphRunner(be, layers, [bs], {k: (tuple(v.shape[1:]), v.dtype) for k, v in inputs.items()}, adapter)
    runner.capture()
    state: Dict[str, object] = {}
    parts = (("alloc", lambda: state.update(batch=s.alloc_step())),
             ("prepare", lambda: state.update(prepared=runner.prepare(state["batch"], inputs))),
             ("replay", lambda: runner.replay(state["prepared"])),
             ("release", s.release))

    def step() -> None:
        for _, fn in parts:
            fn()

    host, done = wall(step, dev, iters)
    phases = {k: v[1] for k, v in phase_walls(list(parts), dev, iters).items()}  # each part alone
    _, replay_only = wall(lambda: runner.replay(state["prepared"]), dev, iters)
    step_us, replay_us = statistics.median(done), statistics.median(replay_only)
    row = dict(bench="engine-step", bs=bs, ctx=ctx, page_size=page_size, step_us=round(step_us, 1),
               step_host_us=med(host), replay_only_us=round(replay_us, 1),
               not_replay_frac=round(1 - replay_us / step_us, 3), syncs_per_step=host_syncs(step, dev),
               **{f"{k}_us": med(v) for k, v in phases.items()})
    s.alloc.check_integrity()
    return [row]


def _whole_step_pair(dev: str, bs: int, ctx: int, page_size: int, backend_cls, room: int):
    """A captured whole-step graph (hwkv.step_graph.DecodeStepGraph) and the same 36 layers captured alone (a
    GraphRunner), over one Setup: returns (setup, step graph, one engine step, one replay of the layers alone).
    The layers' batch is the step graph's after 5 steps (their slots written); `refresh` (also returned)
    prepares it again at the lengths the steps have reached."""
    from hwkv.step_graph import DecodeStepGraph
    s = Setup(dev, bs, ctx, page_size=page_size, room=room, spare_rows=1)
    be = backend_cls(s.pool, s.rtt, sliding_window=W)
    inputs = {"q": torch.randn(bs, H, D, device=dev, dtype=torch.bfloat16),
              "k": torch.randn(bs, KVH, D, device=dev, dtype=torch.bfloat16),
              "v": torch.randn(bs, KVH, D, device=dev, dtype=torch.bfloat16)}
    shapes = {k: (tuple(v.shape[1:]), v.dtype) for k, v in inputs.items()}
    layers = layers_fn(be, s.layers)
    adapter = EagerAdapter if dev != "cuda" else __import__("hwkv_cuda.graph", fromlist=["x"]).CUDAGraphAdapter
    frontiers = torch.zeros(s.rtt.size, dtype=torch.int64, device=dev)
    frontiers[s.rows] = s.frontiers
    g = DecodeStepGraph(be, s.alloc, layers, [bs], shapes, adapter(), frontiers, W)
    g.capture()
    only = GraphRunner(be, layers, [bs], shapes, adapter())
    only.capture()
    for k, v in inputs.items():  # an engine writes the step's inputs into the graph's buffers
        g.inputs[k][:bs].copy_(v)
    rows_cpu, seq = s.rows.cpu(), s.seq_cpu.clone()

    def step() -> None:  # an engine: rows and lengths on the host, one copy with the step's control words (or
        seq.add_(1)      # none), the inputs already in the graph's buffers (`inputs=None`, as the engine passes)
        g.step(rows_cpu, seq, seq)

    def refresh() -> None:  # the layers' graph prepared at the lengths the steps reached (its slots written)
        seq_dev = seq.to(dev)
        only.prepare(ForwardBatch(ForwardMode.DECODE, bs, s.rows, seq_dev, s.rtt.req_to_token[s.rows, seq_dev - 1],
                                  seq_lens_cpu=seq.clone()), inputs)

    for _ in range(5):
        step()
    refresh()
    return s, g, step, (lambda: only.adapter.replay(only.graphs[bs].graph)), refresh


def whole_step_rows(dev: str, batches: List[int], ctx: int, page_size: int, backend_cls, iters: int) -> List[Dict]:
    """The whole decode step in one graph (allocation, req_to_token write, release, refill, 36 layers) against the
    same 36 layers replayed alone: host time per step (the device caught up before each, `host_per_step`), step
    wall (device synchronized around each), replay alone, and both issued back to back in alternating rounds
    (`pipelined_pair`: an engine that never waits)."""
    rows = []
    for bs in batches:
        s, g, step, layers, refresh = _whole_step_pair(dev, bs, ctx, page_size, backend_cls, 16 * iters + 64)
        host = host_per_step(step, dev, iters)
        _, done = wall(step, dev, iters)
        refresh()
        _, replay = wall(layers, dev, iters)
        piped, layers_piped, piped_ratio = pipelined_pair(step, layers, dev, iters, refresh=refresh)
        syncs = host_syncs(step, dev)
        s.alloc.check_integrity()
        step_us, replay_us = statistics.median(done), statistics.median(replay)
        rows.append(dict(bench="whole-step", bs=bs, ctx=ctx, page_size=page_size, host_us=round(host, 1),
                         step_us=round(step_us, 1), layers_replay_us=round(replay_us, 1),
                         ratio=round(step_us / replay_us, 3), pipelined_step_us=round(piped, 1),
                         pipelined_layers_us=round(layers_piped, 1), pipelined_ratio=round(piped_ratio, 3),
                         syncs_per_step=syncs))
        del s, g, step, layers
        if dev == "cuda":
            torch.cuda.empty_cache()
    return rows


def _step_graph_driver(s: "Setup", g: Any, inputs: Dict[str, torch.Tensor], t: int, n: int):
    """What drives a step graph of `n` new tokens per request over a Setup as an engine does: the inputs written into
    its buffers, a ForwardSlots over the Setup's rows and frontiers, every request's length (all equal, in a list the
    paths move), and one graph step (the replay, then the out-of-window release on the new lengths)."""
    from hwkv.engine.forward import ForwardSlots
    for k, v in inputs.items():  # an engine writes the step's inputs into the graph's buffers
        g.inputs[k][:t].copy_(v)
    slots = ForwardSlots(s.alloc, s.rtt, W)
    rows = s.rows.tolist()
    slots.frontiers[s.rows] = s.frontiers
    slots.frontiers_cpu[rows] = s.frontiers.cpu().numpy()
    length = [int(s.seq_cpu[0])]
    rows_cpu = torch.tensor(rows, dtype=torch.int64)
    bs = len(rows)

    def graph_step() -> None:
        length[0] += n
        seq = torch.full((bs,), length[0], dtype=torch.int64)
        g.step(rows_cpu, seq, seq)
        slots.release(rows, [length[0]] * bs, g.req_pool_indices[:bs], g.seq_lens[:bs])
    return slots, rows, length, graph_step


def _three_paths(s: "Setup", graph_step: Callable[[], None], host_step: Callable[[], None], only: GraphRunner,
                 bs: int, dev: str, iters: int, rounds: int, baseline: str) -> Dict[str, Any]:
    """The step graph, the host path it replaces and the runner's replay alone (`baseline`: its column), pipelined
    in alternating rounds, the runner prepared again by a host step before each of its rounds (at the lengths
    reached); host time and syncs of the graph's step; the allocator checked after."""
    host_step()  # the runner prepared once
    host = host_per_step(graph_step, dev, iters)
    syncs = host_syncs(graph_step, dev)
    a, b, c = alternating_rounds((graph_step, host_step, lambda: only.adapter.replay(only.graphs[bs].graph)),
                                 dev, iters, rounds, before=(None, None, host_step))
    s.alloc.check_integrity()
    return {"graph_host_us": round(host, 1), "graph_step_us": round(statistics.median(a), 1),
            "host_path_us": round(statistics.median(b), 1), baseline: round(statistics.median(c), 1),
            "graph_ratio": round(statistics.median(x / z for x, z in zip(a, c)), 3),
            "host_path_ratio": round(statistics.median(y / z for y, z in zip(b, c)), 3), "syncs_per_step": syncs}


def verify_step_rows(dev: str, batches: List[int], ctx: int, page_size: int, backend_cls, iters: int,
                     drafts: int = 4, rounds: int = 7, modes: Sequence[str] = ("extend", "auto")) -> List[Dict]:
    """A linear verify of `drafts` drafts per request (TARGET_VERIFY, drafts + 1 tokens each, every draft kept)
    three ways over one Setup, each step followed by the out-of-window release (`ForwardSlots.release`, as the
    engine runs it after the acceptance): one VerifyStepGraph replay (allocation, req_to_token write, refill and
    36 layers inside); the engine's host path (`ForwardSlots.plan_extend` + `allocate`, then a GraphRunner of the
    layers prepared and replayed); the layers' replay alone. Pipelined in alternating rounds (us per step). Per
    backend `tree_verify` in `modes`: "extend" runs the extend kernels' causal verify, "auto" the graph's chain
    decode-like where the backend says that pays (the host path and the layers alone stay causal extend)."""
    from hwkv.step_graph import VerifyStepGraph
    n, out = drafts + 1, []
    adapter = EagerAdapter if dev != "cuda" else __import__("hwkv_cuda.graph", fromlist=["x"]).CUDAGraphAdapter
    for bs, mode in [(b, m) for b in batches for m in modes]:
        steps = 2 * (rounds * iters + 8) + 2 * iters + rounds + 16  # steps that take slots: paths, warm-ups, walls
        s = Setup(dev, bs, ctx, page_size=page_size, room=n * steps, spare_rows=1)
        be = backend_cls(s.pool, s.rtt, sliding_window=W, tree_verify=mode)
        t = bs * n
        inputs = {"q": torch.randn(t, H, D, device=dev, dtype=torch.bfloat16),
                  "k": torch.randn(t, KVH, D, device=dev, dtype=torch.bfloat16),
                  "v": torch.randn(t, KVH, D, device=dev, dtype=torch.bfloat16)}
        shapes = {k: (tuple(v.shape[1:]), v.dtype) for k, v in inputs.items()}
        layers = layers_fn(be, s.layers)
        be.init_graph_state(bs, t)  # the two graphs share the static buffers
        g = VerifyStepGraph(be, s.alloc, layers, [bs], shapes, drafts, adapter())
        g.capture()
        only = GraphRunner(be, layers, [bs], shapes, adapter(), ForwardMode.TARGET_VERIFY, n)
        only.capture()
        slots, rows, length, graph_step = _step_graph_driver(s, g, inputs, t, n)

        def host_step() -> None:
            lens = slots.plan_extend(ForwardMode.TARGET_VERIFY, rows, [length[0]] * bs, [n] * bs)
            batch = slots.allocate(lens)
            only.run(batch, inputs)
            length[0] += n
            slots.release(rows, lens.seq, batch.req_pool_indices, batch.seq_lens)

        out.append(dict(bench="verify-step", bs=bs, drafts=drafts, ctx=ctx, page_size=page_size, tree_verify=mode,
                        graph_runs="decode-like" if g.decode_like(bs) else "extend",
                        **_three_paths(s, graph_step, host_step, only, bs, dev, iters, rounds, "layers_replay_us")))
        del s, g, only, be
        if dev == "cuda":
            torch.cuda.empty_cache()
    return out


def draft_step_rows(dev: str, batches: List[int], ctx: int, page_size: int, backend_cls, iters: int,
                    steps: int = 3, draft_layers: int = 2, rounds: int = 7) -> List[Dict]:
    """A multi-step draft of `steps` decode steps over a draft model of the first `draft_layers` layers (one SWA,
    one full), every draft kept and the out-of-window release after each, three ways over one Setup: one
    DraftStepGraph replay (allocation, req_to_token write, step-major write locs, every step's metadata and the
    draft's layers inside); the host path before it (`ForwardSlots.plan_extend` + `allocate` of the k slots, the
    step-major batch, then a DraftGraphRunner prepared and replayed); the DraftGraphRunner's replay alone.
    Pipelined in alternating rounds (us per draft)."""
    from hwkv.draft import DraftGraphRunner
    from hwkv.spec import MultiStepDraft
    from hwkv.step_graph import DraftStepGraph
    out = []
    adapter = EagerAdapter if dev != "cuda" else __import__("hwkv_cuda.graph", fromlist=["x"]).CUDAGraphAdapter
    for bs in batches:
        room = steps * (2 * (rounds * iters + 8) + 2 * iters + rounds + 16)
        s = Setup(dev, bs, ctx, page_size=page_size, room=room, spare_rows=1)
        be = backend_cls(s.pool, s.rtt, sliding_window=W)
        t = bs * steps
        inputs = {"q": torch.randn(t, H, D, device=dev, dtype=torch.bfloat16),
                  "k": torch.randn(t, KVH, D, device=dev, dtype=torch.bfloat16),
                  "v": torch.randn(t, KVH, D, device=dev, dtype=torch.bfloat16)}
        shapes = {k: (tuple(v.shape[1:]), v.dtype) for k, v in inputs.items()}
        model = s.layers[:draft_layers]

        def fn(draft, i: Dict[str, torch.Tensor]) -> torch.Tensor:
            outs = []
            for j in range(len(draft)):
                b = draft.select(j)
                n = b.batch_size
                for layer in model:
                    o = be.forward(i["q"][j * n:(j + 1) * n], i["k"][j * n:(j + 1) * n], i["v"][j * n:(j + 1) * n],
                                   layer, b)
                outs.append(o)
            return torch.cat(outs)

        g = DraftStepGraph(be, s.alloc, fn, [bs], shapes, steps, adapter())
        g.capture()
        only = DraftGraphRunner(be, fn, [bs], shapes, steps, adapter())
        only.capture()
        slots, rows, length, graph_step = _step_graph_driver(s, g, inputs, t, steps)
        draft = MultiStepDraft(steps)

        def host_step() -> None:
            lens = slots.plan_extend(ForwardMode.EXTEND, rows, [length[0]] * bs, [steps] * bs)
            loc = slots.allocate(lens).out_cache_loc
            batch = ForwardBatch(ForwardMode.DECODE, bs, lens.rows_dev, lens.prefix_dev + 1,
                                 loc.view(bs, steps).t().reshape(-1), spec_info=draft,
                                 seq_lens_cpu=lens.prefix_cpu + 1)
            only.run(batch, inputs)
            length[0] += steps
            slots.release(rows, lens.seq, lens.rows_dev, lens.seq_dev)

        out.append(dict(bench="draft-step", bs=bs, steps=steps, draft_layers=draft_layers, ctx=ctx,
                        page_size=page_size,
                        **_three_paths(s, graph_step, host_step, only, bs, dev, iters, rounds, "runner_replay_us")))
        del s, g, only, be
        if dev == "cuda":
            torch.cuda.empty_cache()
    return out


def step_gap_rows(dev: str, ctx: int, page_size: int, backend_cls, iters: int, rounds: int = 9) -> List[Dict]:
    """Where the whole step's extra time over the layers' replay goes, at B=1: variants replayed back to back in
    alternating rounds (us per step, the median; ratio to the layers alone): host work between launches (a busy
    wait as long as the step's host path), one small device op per replay, the whole-step graph alone (the same
    step again, or a new token each replay) and the full host step; on CUDA also the profiler's device timeline
    (kernel time, gaps inside a graph and between graphs)."""
    s, g, step, layers, refresh = _whole_step_pair(dev, 1, ctx, page_size, backend_cls,
                                                   (rounds + 2) * 4 * iters + 64)
    replay = g.graphs[1].graph
    staged_len = g.seq_in[:1]
    back = 1 if g._advances.get(1) else 0  # undo the replay's own advance, where it has one

    def busy(us: float) -> None:
        end = time.perf_counter() + us * 1e-6
        while time.perf_counter() < end:
            pass

    def bare(undo: int) -> None:
        """The graph replayed with no host step: what it leaves staged is no longer what the host sent (the next
        host step stages everything), and a replay that opens a page does so past the claim (none staged: the
        padding slot, recorded below)."""
        g.adapter.replay(replay)
        staged_len.sub_(undo)
        g._sent = None

    variants = {
        "layers alone": layers,
        "layers, host busy 22 us before each": lambda: (busy(22), layers()),
        "layers + one small op": lambda: (layers(), staged_len.add_(0)),
        "whole-step graph, the same step again": lambda: bare(back),
        "whole-step graph, a new token each": lambda: bare(0),
        "full step (host path)": step,
    }
    before = [refresh if k.startswith("layers") else None for k in variants]  # at the lengths the steps reached
    times = dict(zip(variants, alternating_rounds(list(variants.values()), dev, iters, rounds, 5, before)))
    base = statistics.median(times["layers alone"])
    out = [dict(bench="step-gap", what=k, us=round(statistics.median(v), 1), ratio=round(statistics.median(v) / base, 3))
           for k, v in times.items()]
    if dev == "cuda":
        for what, fn, first in (("timeline: full step", step, "_alloc_step_kernel"),
                                ("timeline: layers alone", layers, "_fill_lists_kernel")):
            out.append(dict(bench="step-gap", what=what, **device_timeline(fn, first)))
    found = s.alloc.pages.pending()
    if found is not None and found[0] == ERR_CLAIM:  # the bare replays' pages past their claim (none): expected
        s.alloc.pages.err.zero_()
    s.alloc.check_integrity()
    return out


def device_timeline(fn: Callable[[], object], first: str, n: int = 40) -> Dict:
    """n calls of fn under the profiler (CUDA activity): per step (from one `first` kernel to the next) the span,
    the kernels' busy time, the gap between the step's last kernel and the next step's first, and the rest (gaps
    inside the step), medians in us; and each kernel's median time."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(5):
        fn()
    sync("cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        sync("cuda")
    ev = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type.name == "CUDA")
    starts = [i for i, e in enumerate(ev) if first in e[2]]
    spans, busy, between, kernels = [], [], [], {}
    for a, c in zip(starts, starts[1:]):
        steps = ev[a:c]
        spans.append(ev[c][0] - ev[a][0])
        busy.append(sum(e[1] - e[0] for e in steps))
        between.append(ev[c][0] - steps[-1][1])
        for e in steps:
            kernels.setdefault(e[2][:40], []).append(e[1] - e[0])
    med = statistics.median
    return dict(steps=len(spans), span_us=round(med(spans), 1), kernels_us=round(med(busy), 1),
                gap_between_us=round(med(between), 1), gaps_inside_us=round(med(spans) - med(busy) - med(between), 1),
                per_kernel_us={k: round(med(v), 2) for k, v in kernels.items()})


def profile_text(fn: Callable[[], object], dev: str, n: int = 200, top: int = 18) -> str:
    """Where the host time of `fn` goes: cProfile over n calls, the `top` functions by own time (us per call)."""
    import cProfile
    import pstats
    for _ in range(5):
        fn()
    sync(dev)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    sync(dev)
    st = pstats.Stats(prof)
    lines = [f"{'own us/call':>11} {'cum us/call':>11} {'calls/call':>10}  function"]
    for (file, line, name), (_, calls, own, cum, _) in sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]:
        where = f"{'/'.join(file.rsplit('/', 2)[-2:])}:{line}" if line else file
        lines.append(f"{own * 1e6 / n:11.1f} {cum * 1e6 / n:11.1f} {calls / n:10.1f}  {name} ({where})")
    return "\n".join(lines)


def profile_rows(dev: str, ctx: int, page_size: int, backend_cls) -> List[Dict]:
    """Profiles (not timings) of the host paths the targets name: one whole-step graph step at B=1, one eager
    full layer (store + attention), one SWA layer, one eager metadata step."""
    from hwkv.step_graph import DecodeStepGraph
    out: List[Dict] = []
    s = Setup(dev, 1, ctx, page_size=page_size, room=600, spare_rows=1)
    be = backend_cls(s.pool, s.rtt, sliding_window=W)
    q = torch.randn(1, H, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, KVH, D, device=dev, dtype=torch.bfloat16)
    shapes = {"q": ((H, D), q.dtype), "k": ((KVH, D), k.dtype), "v": ((KVH, D), k.dtype)}
    adapter = EagerAdapter() if dev != "cuda" else __import__("hwkv_cuda.graph", fromlist=["x"]).CUDAGraphAdapter()
    frontiers = torch.zeros(s.rtt.size, dtype=torch.int64, device=dev)
    frontiers[s.rows] = s.frontiers
    g = DecodeStepGraph(be, s.alloc, layers_fn(be, s.layers), [1], shapes, adapter, frontiers, W)
    g.capture()
    rows_cpu, seq = s.rows.cpu(), s.seq_cpu.clone()

    def step() -> None:
        seq.add_(1)
        g.step(rows_cpu, seq, seq)  # the inputs in the graph's buffers, as an engine leaves them

    out.append(dict(bench="profile", what="whole-step graph step, B=1", text=profile_text(step, dev, 200)))
    if dev == "cuda":  # the device time of the step's body, kernel by kernel (run eagerly, one live request)
        from torch.profiler import ProfilerActivity, profile
        seq.add_(1)
        g.rows_in[:1].copy_(s.rows)
        g.seq_in[:1].fill_(int(seq[0]))
        opens = int((int(seq[0]) - 1) % page_size == 0)
        g._set_ctl(1, opens, g._reserve(opens))  # (the graph's reserve: the op number staged with the heads)
        batch1, inputs1 = g._static_batch(1), g._static_inputs(1)
        sync(dev)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            g._refill_and_run(batch1, inputs1)
            sync(dev)
        out.append(dict(bench="profile", what="whole-step body's kernels, B=1 (eager, device us)",
                        text=prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)))
    batch = ForwardBatch(ForwardMode.DECODE, 1, s.rows, seq.to(dev), s.rtt.req_to_token[s.rows, seq.to(dev) - 1],
                         seq_lens_cpu=seq.clone())
    be.init_forward_metadata(batch)
    for what, fn in (("eager full layer (store + attention), B=1", lambda: be.forward(q, k, k, s.layers[1], batch)),
                     ("eager SWA layer, B=1", lambda: be.forward(q, k, k, s.layers[0], batch)),
                     ("eager metadata step, B=1", lambda: be.init_forward_metadata(batch))):
        before = _jit_counts()
        text = profile_text(fn, dev, 200)
        after = _jit_counts()
        jit = {k_: n - before.get(k_, 0) for k_, n in after.items() if n - before.get(k_, 0) > 0}
        text += "\nlaunches through the JIT per call, by planned kernel: " + (
            ", ".join(f"{k_} {n / 205:.2f}" for k_, n in jit.items()) or "none")
        out.append(dict(bench="profile", what=what, text=text))
    return out


def _jit_counts() -> Dict[str, int]:
    """Launches through Triton's JIT so far, per planned kernel (hwkv_cuda's launch tables, variants included)."""
    import importlib
    counts: Dict[str, int] = {}
    for mod in ("alloc", "decode", "extend", "index", "refill", "store", "tree"):
        table = getattr(importlib.import_module(f"hwkv_cuda.kernels.{mod}"), "_LAUNCHES", {})
        for plan in table.values():
            for p_ in (plan, *plan.variants.values()):
                name = f"{mod}.{getattr(getattr(p_.kernel, 'fn', None), '__name__', '?')}{'' if p_.direct else ' (no plan)'}"
                counts[name] = counts.get(name, 0) + p_.jit_calls
    return counts


def _forget_launches() -> None:
    """Drop every planned launch (hwkv_cuda's launch tables and the public decode plans that hold them)."""
    import importlib
    for mod in ("alloc", "decode", "extend", "index", "refill", "store", "tree"):
        getattr(importlib.import_module(f"hwkv_cuda.kernels.{mod}"), "_LAUNCHES", {}).clear()
    importlib.import_module("hwkv_cuda.kernels.decode")._PUBLIC_PLANS.clear()


def host_per_step(fn: Callable[[], object], dev: str, n: int = 50) -> float:
    """Host microseconds per step with the device caught up before each (an engine whose device runs one step
    behind it): each call timed alone, a sync after it, outside the timing; the median. Calls back to back would
    let the host run tens of steps ahead of a busy device, until the allocator's host bound of free pages (which
    sees the device's releases late) makes it read the device and wait."""
    for _ in range(5):
        fn()
    sync(dev)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        sync(dev)
    return statistics.median(times) * 1e6


def alternating_rounds(fns: Sequence[Callable[[], object]], dev: str, n: int = 50, rounds: int = 11,
                       warmup: int = 3, before: Optional[Sequence[Optional[Callable[[], object]]]] = None
                       ) -> List[List[float]]:
    """Each fn's wall microseconds per call over n calls issued back to back, the device synchronized after them
    (what an engine one step ahead of its device gets per step), in `rounds` rounds that take every fn in turn:
    per fn, its rounds. Alternating keeps slow drift (the layers' replay alone moves 2-6% between runs in one
    process on the H200) out of the ratios of rounds taken side by side. `before[i]` (untimed) runs ahead of each
    of fn i's rounds: a baseline replayed at fixed lengths is re-prepared at the lengths the steps have reached
    (a step graph's requests grow by a token a step: over 11 rounds of 50 steps at B=1, a decode's lists grow from
    4K to 4.6K keys, and its split kernels by about 5%)."""
    for _ in range(warmup):
        for f in fns:
            f()
    sync(dev)
    out: List[List[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for i, (f, times) in enumerate(zip(fns, out)):
            if before is not None and before[i] is not None:
                before[i]()
                sync(dev)
            t = time.perf_counter()
            for _ in range(n):
                f()
            sync(dev)
            times.append((time.perf_counter() - t) * 1e6 / n)
    return out


def pipelined_pair(fn: Callable[[], object], base: Callable[[], object], dev: str, n: int = 50,
                   rounds: int = 11, refresh: Optional[Callable[[], object]] = None) -> Tuple[float, float, float]:
    """fn and base pipelined in alternating rounds (`refresh` before each of base's): (fn's median, base's median,
    the median of the rounds' ratios)."""
    a, b = alternating_rounds((fn, base), dev, n, rounds, before=(None, refresh))
    return statistics.median(a), statistics.median(b), statistics.median(x / y for x, y in zip(a, b))


def host_per_call(fn: Callable[[], object], dev: str, n: int = 200) -> float:
    """Host microseconds per call: n calls back to back, timed until the last returns (the device, busy
    with small kernels, never makes the host wait), then one sync."""
    for _ in range(5):
        fn()
    sync(dev)
    t = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t) * 1e6 / n
    sync(dev)
    return us


def host_rows(dev: str, ctx: int, backend_cls) -> List[Dict]:
    """Host time of the eager per-layer path at B=1, with the kernels launched through their compiled
    launchers (direct) and through Triton's JIT dispatch (jit), in one run: the public decode_attention
    call (checks + plan + launches each call), a planned decode layer, one full layer (store + attention),
    one metadata step, and the eager 36-layer step (metadata + layers, device time included); a torch op
    and a 1-element Triton launch as the floor."""
    from hwkv_cuda.kernels import decode_attention
    from hwkv_cuda.kernels import launch as L
    convention = L._CONVENTION
    rows: List[Dict] = []
    for mode in ("jit", "direct"):
        L._CONVENTION = convention if mode == "direct" else None
        _forget_launches()  # plans made under the other mode would keep its path
        s = Setup(dev, 1, ctx)
        be = backend_cls(s.pool, s.rtt, sliding_window=W)
        batch = s.decode_batch()
        q = torch.randn(1, H, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, KVH, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        be.init_forward_metadata(batch)
        md = be.forward_metadata
        full, swa = s.layers[1], s.layers[0]
        out = torch.empty(1, H, D, device=dev, dtype=torch.bfloat16)
        kb, vb = s.pool.get_key_buffer(1), s.pool.get_value_buffer(1)
        lst = md.full

        def public() -> None:
            decode_attention(q, kb, vb, lst.indptr, lst.indices, lst.pos0, md.q_pos0, out, full.scaling,
                             None, 0.0, full.sinks, max_kv_len=lst.max_len)

        def layers() -> None:
            be.init_forward_metadata(batch)
            for layer in s.layers:
                be.forward(q, k, v, layer, batch)

        row = dict(bench="host", mode=mode, bs=1, ctx=ctx,
                   public_decode_call_host_us=round(host_per_call(public, dev), 1),
                   full_layer_host_us=round(host_per_call(lambda: be.forward(q, k, v, full, batch), dev), 1),
                   swa_layer_host_us=round(host_per_call(lambda: be.forward(q, k, v, swa, batch), dev), 1),
                   metadata_host_us=round(host_per_call(lambda: be.init_forward_metadata(batch), dev, 50), 1))
        host, done = wall(layers, dev, 20)
        row.update(step_36_layers_host_us=med(host), step_36_layers_us=med(done))
        if mode == "direct" and dev == "cuda":
            row.update(layer_ladder(be, q, k, v, full, batch, dev))
        x = torch.zeros(1, device=dev)
        row["torch_add_host_us"] = round(host_per_call(lambda: x.add_(1), dev), 1)
        rows.append(row)
        del s, be
    L._CONVENTION = convention
    return rows


def layer_ladder(be, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch,
                 dev: str) -> Dict[str, float]:
    """Where one eager full layer's host time goes, as a ladder of the same work entered at each level (host us per
    call): the two planned launches alone (store, decode split: the compiled launcher with the arguments the layer
    built), the device package's entry points (`store_kv_prechecked` + `decode_attention_planned`: their checks and
    argument tuples), the pool's store and the backend's `forward_decode` (routing, plan lookup), and the template's
    `forward` (shape checks, output)."""
    from hwkv import ops
    from hwkv_cuda.kernels import decode as dk
    from hwkv_cuda.kernels import launch as L
    md = be.forward_metadata
    kv = md.list_for(layer, be.is_swa_group(layer))
    k_buf, v_buf = be.kv_buffers(layer)
    out = torch.empty(q.shape[0], layer.num_heads, layer.v_head_dim, device=dev, dtype=q.dtype)
    be.forward(q, k, v, layer, batch)  # plans made
    recorded: List[Tuple[Any, Tuple[Any, ...]]] = []
    go = L.Launch._go

    def record(self, args):  # the launches one layer makes, with their arguments
        recorded.append((self, args))
        go(self, args)
    L.Launch._go = record
    try:
        be.forward(q, k, v, layer, batch)
    finally:
        L.Launch._go = go
    plan = be._plan(md, True, q, layer, kv, k_buf, v_buf, out)
    part = be._decode_layer(layer, k_buf, v_buf)
    # the template's rung as in a forward, where each layer takes its output view once (a layer called again in
    # one forward allocates its own: what `full_layer_host_us`, one layer called over and over, also pays)
    taken = md.outputs.taken if md.outputs is not None else set()
    loc = md.write_loc.loc
    pool = be.pool.full_kv_pool if be.hybrid else be.pool
    local = be.pool.layers_mapping[layer.layer_id][0] if be.hybrid else layer.layer_id

    def launches() -> None:
        for launch, args in recorded:
            go(launch, args)

    def entries() -> None:
        ops.store_kv_prechecked(pool.k_buffer[local], pool.v_buffer[local], loc, k, v)
        dk.decode_attention_planned(plan, q, k_buf, v_buf, kv.indptr, kv.indices, kv.pos0, md.q_pos0, out,
                                    layer.scaling, layer.window, layer.logit_cap, layer.sinks, layer.k_scale,
                                    layer.v_scale, part)

    def routed() -> None:
        be.pool.set_kv_buffer(layer, md.write_loc, k, v, layer.k_scale, layer.v_scale)
        be.forward_decode(q, layer, kv, md, out)

    return dict(ladder_launches=len(recorded),
                ladder_launches_us=round(host_per_call(launches, dev), 1),
                ladder_entry_points_us=round(host_per_call(entries, dev), 1),
                ladder_pool_and_forward_decode_us=round(host_per_call(routed, dev), 1),
                ladder_forward_us=round(host_per_call(lambda: (taken.clear(), be.forward(q, k, v, layer, batch)), dev), 1))


def tree_verify_rows(dev: str, batches: List[int], ctxs: List[int], backend_cls, drafts: int = 15) -> List[Dict]:
    """One tree verify forward per `tree_verify` mode over the same pools and batch (K/V random): the
    extend kernels with the tree mask, decode-like, and auto (with what it picked); eager and graph.
    `max_rel_diff`: the largest relative difference of any layer's output from the extend mode's."""
    from hwkv.spec import DraftTree
    par = [-1] + [(i - 1) // 2 for i in range(1, drafts)]
    adapter_cls = EagerAdapter if dev != "cuda" else __import__("hwkv_cuda.graph", fromlist=["x"]).CUDAGraphAdapter
    rows = []
    for ctx in ctxs:
        for bs in batches:
            s = Setup(dev, bs, ctx)
            for group in (s.pool.full_kv_pool, s.pool.swa_kv_pool):
                for buf in group.k_buffer + group.v_buffer:
                    buf.normal_()
            i64 = dict(dtype=torch.int64, device=dev)
            new = torch.full((bs,), drafts, **i64)
            last = s.rtt.req_to_token[s.rows, s.seq - 1]
            loc = s.alloc.alloc_extend(s.seq, s.seq + new, last, bs * drafts, prefix_lens_cpu=s.seq_cpu,
                                       seq_lens_cpu=s.seq_cpu + drafts)
            s.rtt.req_to_token[s.rows[:, None], s.seq[:, None] + torch.arange(drafts, device=dev)] = loc.view(bs, -1)
            batch = ForwardBatch(ForwardMode.TARGET_VERIFY, bs, s.rows, s.seq + new, loc, extend_prefix_lens=s.seq,
                                 extend_seq_lens=new, spec_info=DraftTree.from_parents([par] * bs, device=dev),
                                 seq_lens_cpu=s.seq_cpu + drafts, extend_seq_lens_cpu=torch.full((bs,), drafts))
            t = bs * drafts
            inputs = {"q": torch.randn(t, H, D, device=dev, dtype=torch.bfloat16),
                      "k": torch.randn(t, KVH, D, device=dev, dtype=torch.bfloat16),
                      "v": torch.randn(t, KVH, D, device=dev, dtype=torch.bfloat16)}
            shapes = {k: (tuple(v.shape[1:]), v.dtype) for k, v in inputs.items()}
            want = None
            for mode in ("extend", "decode", "auto"):
                be = backend_cls(s.pool, s.rtt, sliding_window=W, tree_verify=mode)

                def step(b, i, be=be):
                    return [be.forward(i["q"], i["k"], i["v"], layer, b) for layer in s.layers]

                def eager(be=be, step=step):
                    be.init_forward_metadata(batch)
                    return step(batch, inputs)

                outs = [o.float() for o in eager()]
                if want is None:
                    want = outs
                diff = max(((o - w).norm() / w.norm()).item() for o, w in zip(outs, want))
                us_eager = timeit(eager, dev, iters=10, warmup=2)
                runner = GraphRunner(be, lambda b, i, step=step: step(b, i)[-1], [bs], shapes, adapter_cls(),
                                     ForwardMode.TARGET_VERIFY, drafts, tree=True)
                runner.capture()
                us_graph = timeit(lambda: runner.run(batch, inputs), dev, iters=20, warmup=3)
                picked = mode if mode != "auto" else ("decode" if be.decode_like_verify_pays(bs, t) else "extend")
                rows.append(dict(bench="tree-verify", bs=bs, ctx=ctx, drafts=drafts, mode=mode, ran=picked,
                                 eager_us=round(us_eager, 1), graph_us=round(us_graph, 1),
                                 max_rel_diff=float(f"{diff:.3g}")))
                print(json.dumps(rows[-1]), flush=True)
                del runner, be
            del s
            if dev == "cuda":
                torch.cuda.empty_cache()
    return rows


def _ints(text: str) -> List[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def print_tables(res: Dict) -> None:
    print(f"copy bandwidth {res['copy_bw_TBps']} TB/s on {res['device']}")
    if res.get("kv_write"):
        print("| tokens | store | translate | mode | us | frac of copy bw |\n|---|---|---|---|---|---|")
        for r in res["kv_write"]:
            print(f"| {r['tokens']} | {r['store']} | {r['translate']} | {r['mode']} | {r['us']} | "
                  f"{r['frac_copy_bw']} |")
    if res.get("decode_step"):
        print("| bs | ctx | step eager us | step graph us (refill + replay) | replay only us | metadata refill us "
              "| 1 full layer eager us | SDPA dense 1 layer us |\n|---|---|---|---|---|---|---|---|")
        for r in res["decode_step"]:
            print(f"| {r['bs']} | {r['ctx']} | {r['eager_us']} | {r['graph_us']} | {r['graph_replay_only_us']} | "
                  f"{r['metadata_refill_us']} | {r['full_layer_eager_us']} | "
                  f"{r['sdpa_dense_full_layer_us']} |")
    if res.get("alloc"):
        print("allocator per decode step, W=128 (us, median; host = until the calls return, else until the "
              "device is done)")
        print("| page | ctx | bs | alloc+release us | host us | alloc us | alloc host us | release us | "
              "release host us | syncs alloc | syncs release |\n|---|---|---|---|---|---|---|---|---|---|---|")
        for r in res["alloc"]:
            print(f"| {r['page_size']} | {r['ctx']} | {r['bs']} | {r['step_us']} | {r['step_host_us']} | "
                  f"{r['alloc_us']} | {r['alloc_host_us']} | {r['release_us']} | {r['release_host_us']} | "
                  f"{r['syncs_alloc']} | {r['syncs_release']} |")
    if res.get("tree_verify"):
        print("| bs | ctx | tree_verify | ran | eager us | graph us | max rel diff vs extend |\n"
              "|---|---|---|---|---|---|---|")
        for r in res["tree_verify"]:
            print(f"| {r['bs']} | {r['ctx']} | {r['mode']} | {r['ran']} | {r['eager_us']} | {r['graph_us']} | "
                  f"{r['max_rel_diff']} |")
    if res.get("host"):
        keys = [k for k in res["host"][0] if k not in ("bench", "mode")]
        print("host time, eager path (us; launches through the JIT's dispatch vs the compiled launcher)")
        print("| mode | " + " | ".join(keys) + " |\n|" + "---|" * (len(keys) + 1))
        for r in res["host"]:
            print(f"| {r['mode']} | " + " | ".join(str(r.get(k)) for k in keys) + " |")
        for r in res["host"]:
            if "ladder_forward_us" in r:
                print(f"one eager full layer, entered at each level (host us per call): {r['ladder_launches']} planned "
                      f"launches alone {r['ladder_launches_us']}; the device package's entry points "
                      f"{r['ladder_entry_points_us']}; pool store + forward_decode "
                      f"{r['ladder_pool_and_forward_decode_us']}; the template's forward {r['ladder_forward_us']}")
    if res.get("whole_step"):
        print("whole decode step in one graph vs the 36 layers replayed alone (us, median)")
        print("| bs | ctx | page | host us/step | step us | layers replay us | ratio | pipelined step us | "
              "pipelined layers us | pipelined ratio | syncs/step |\n|---|---|---|---|---|---|---|---|---|---|---|")
        for r in res["whole_step"]:
            print(f"| {r['bs']} | {r['ctx']} | {r['page_size']} | {r['host_us']} | {r['step_us']} | "
                  f"{r['layers_replay_us']} | {r['ratio']} | {r['pipelined_step_us']} | {r['pipelined_layers_us']} | "
                  f"{r['pipelined_ratio']} | {r['syncs_per_step']} |")
    gap = [r for r in res.get("step_gap", []) if "ratio" in r]
    if gap:
        print("B=1, replayed back to back in alternating rounds (us per step, median; ratio to the layers alone)")
        print("| what | us | ratio |\n|---|---|---|")
        for r in gap:
            print(f"| {r['what']} | {r['us']} | {r['ratio']} |")
    for r in res.get("step_gap", []):
        if "span_us" in r:
            print(f"{r['what']}: span {r['span_us']} us = kernels {r['kernels_us']} + gaps inside {r['gaps_inside_us']} "
                  f"+ gap to the next {r['gap_between_us']}; per kernel {r['per_kernel_us']}")
    if res.get("verify_step"):
        print("linear verify (drafts + 1 tokens per request, every draft kept, release after), pipelined in "
              "alternating rounds (us per step, median; ratios to the 36 layers' replay alone)")
        print("| bs | drafts | ctx | page | tree_verify (graph ran) | graph host us | verify graph us | host path us "
              "| layers replay us | graph ratio | host path ratio | syncs/step |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in res["verify_step"]:
            print(f"| {r['bs']} | {r['drafts']} | {r['ctx']} | {r['page_size']} | {r['tree_verify']} ({r['graph_runs']}) "
                  f"| {r['graph_host_us']} | "
                  f"{r['graph_step_us']} | {r['host_path_us']} | {r['layers_replay_us']} | {r['graph_ratio']} | "
                  f"{r['host_path_ratio']} | {r['syncs_per_step']} |")
    if res.get("draft_step"):
        print("multi-step draft (k decode steps of the draft's layers, every draft kept, release after), pipelined in "
              "alternating rounds (us per draft, median; ratios to the DraftGraphRunner's replay alone)")
        print("| bs | steps | draft layers | ctx | page | graph host us | draft graph us | host path us | runner replay us "
              "| graph ratio | host path ratio | syncs/step |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in res["draft_step"]:
            print(f"| {r['bs']} | {r['steps']} | {r['draft_layers']} | {r['ctx']} | {r['page_size']} | "
                  f"{r['graph_host_us']} | {r['graph_step_us']} | {r['host_path_us']} | {r['runner_replay_us']} | "
                  f"{r['graph_ratio']} | {r['host_path_ratio']} | {r['syncs_per_step']} |")
    for r in res.get("profile", []):
        print(f"profile: {r['what']}\n{r['text']}")
    if res.get("engine_step"):
        print("| bs | ctx | page | engine step us | host us | replay only us | not replay | alloc us | prepare us "
              "| replay us | release us | syncs/step |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in res["engine_step"]:
            print(f"| {r['bs']} | {r['ctx']} | {r['page_size']} | {r['step_us']} | {r['step_host_us']} | "
                  f"{r['replay_only_us']} | {r['not_replay_frac']:.1%} | {r['alloc_us']} | {r['prepare_us']} | "
                  f"{r['replay_us']} | {r['release_us']} | {r['syncs_per_step']} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None, help="cuda (the default, needs a GPU) or cpu (a smoke run of the "
                   "same code: pass small sizes, see the module doc)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {', '.join(SECTIONS)}")
    p.add_argument("--tokens", default="1,8,64,256,2048,8192", help="kv-write: tokens per forward")
    p.add_argument("--batches", default="1,64", help="decode-step: batch sizes")
    p.add_argument("--ctx", type=int, default=4096, help="decode-step: context per request")
    p.add_argument("--alloc-batches", default="1,64,256", help="alloc: batch sizes")
    p.add_argument("--alloc-ctx", default="512,4096", help="alloc: contexts per request")
    p.add_argument("--pages", default="1,16", help="alloc: page sizes")
    p.add_argument("--step-bs", type=int, default=64, help="engine-step: batch size")
    p.add_argument("--step-ctx", type=int, default=4096, help="engine-step: context per request")
    p.add_argument("--step-page", type=int, default=16, help="engine-step: page size")
    p.add_argument("--iters", type=int, default=50, help="alloc, engine-step: timed steps")
    p.add_argument("--tree-batches", default="1,8,32", help="tree-verify: batch sizes")
    p.add_argument("--tree-ctx", default="4096,32768", help="tree-verify: contexts per request")
    p.add_argument("--host-ctx", type=int, default=4096, help="host: context of the one request")
    p.add_argument("--whole-batches", default="1,64,256", help="whole-step: batch sizes (context --step-ctx, "
                   "page --step-page)")
    p.add_argument("--verify-batches", default="1,16,64", help="verify-step: batch sizes (4 drafts, context "
                   "--step-ctx, page --step-page)")
    p.add_argument("--draft-batches", default="1,16,64", help="draft-step: batch sizes (3 steps of 2 layers, "
                   "context --step-ctx, page --step-page)")
    p.add_argument("--out", default="")
    a = p.parse_args()
    if a.device is None:
        if not torch.cuda.is_available():  # said at once, not after minutes of CPU runs at GPU sizes
            p.exit(2, f"{p.prog}: error: this benchmark measures a CUDA GPU and torch sees none; for a CPU smoke "
                      "run pass --device cpu with small sizes (see --help's example)\n")
        a.device = "cuda"
    dev, sections = a.device, set(a.sections.split(","))
    unknown = sections - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    if dev == "cuda":
        from hwkv_cuda.backend import TritonBackend as backend_cls
    else:
        from hwkv_cpu.backend import TorchCPUBackend as backend_cls
    bw = copy_bandwidth(dev)
    res = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu", copy_bw_TBps=round(bw / 1e12, 3),
               torch=torch.__version__)
    if "kv-write" in sections:
        res["kv_write"] = kv_write_rows(dev, _ints(a.tokens), bw)
    if "decode-step" in sections:
        res["decode_step"] = decode_step_rows(dev, _ints(a.batches), a.ctx, backend_cls)
    if "alloc" in sections:
        res["alloc"] = alloc_rows(dev, _ints(a.alloc_batches), _ints(a.alloc_ctx), _ints(a.pages), a.iters)
    if "engine-step" in sections:
        res["engine_step"] = engine_step_rows(dev, a.step_bs, a.step_ctx, a.step_page, backend_cls, a.iters)
    if "host" in sections:
        res["host"] = host_rows(dev, a.host_ctx, backend_cls)
    if "whole-step" in sections:
        res["whole_step"] = whole_step_rows(dev, _ints(a.whole_batches), a.step_ctx, a.step_page, backend_cls,
                                            a.iters)
    if "step-gap" in sections:
        res["step_gap"] = step_gap_rows(dev, a.step_ctx, a.step_page, backend_cls, a.iters)
    if "profile" in sections:
        res["profile"] = profile_rows(dev, a.host_ctx, a.step_page, backend_cls)
    if "verify-step" in sections:
        res["verify_step"] = verify_step_rows(dev, _ints(a.verify_batches), a.step_ctx, a.step_page, backend_cls,
                                              a.iters)
    if "draft-step" in sections:
        res["draft_step"] = draft_step_rows(dev, _ints(a.draft_batches), a.step_ctx, a.step_page, backend_cls, a.iters)
    if "tree-verify" in sections:
        res["tree_verify"] = tree_verify_rows(dev, _ints(a.tree_batches), _ints(a.tree_ctx), backend_cls)
    print_tables(res)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
