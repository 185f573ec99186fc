"""A small hybrid model driven through real allocation, forwards and release, checked against the reference.

Used by the contract suite and by `hwkv bench`. It keeps a shadow copy of every stored K/V
(as stored: quantized values read back) so output errors are kernel errors, not storage errors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hwkv import reference
from hwkv.allocator import PagedTokenToKVPoolAllocator, ReqToTokenPool, SWATokenToKVPoolAllocator, release_out_of_window
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.errors import ReferenceMismatchError
from hwkv.graph import GraphRunner
from hwkv.layer import AttentionLayer
from hwkv.ops import quantize
from hwkv.pool import MHATokenToKVPool, SWAKVPool

BackendFactory = Callable[..., Any]


@dataclass(frozen=True)
class ModelGeometry:
    """Layers, heads and window of a (small) hybrid model."""

    num_layers: int = 4
    swa_every: int = 2            # layer i is SWA unless (i + 1) % swa_every == 0; 0 = no SWA layers
    window: int = 8
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    v_head_dim: Optional[int] = None
    swa_num_kv_heads: Optional[int] = None
    swa_head_dim: Optional[int] = None
    logit_cap: float = 0.0
    sinks: bool = False

    def is_swa(self, i: int) -> bool:
        return self.swa_every > 0 and (i + 1) % self.swa_every != 0

    @property
    def swa_layer_ids(self) -> List[int]:
        return [i for i in range(self.num_layers) if self.is_swa(i)]

    @property
    def full_layer_ids(self) -> List[int]:
        return [i for i in range(self.num_layers) if not self.is_swa(i)]


@dataclass
class Request:
    row: int
    seq_len: int = 0
    frontier: int = 0
    locs: List[torch.Tensor] = field(default_factory=list)
    k: Dict[int, List[torch.Tensor]] = field(default_factory=dict)   # shadow K per layer (fp32, as stored)
    v: Dict[int, List[torch.Tensor]] = field(default_factory=dict)


class Harness:
    """Pool + allocator + backend + shadow K/V for one model geometry on one device."""

    def __init__(self, backend_factory: BackendFactory, device: str = "cpu", geometry: ModelGeometry = ModelGeometry(),
                 size: int = 512, size_swa: Optional[int] = 128, page_size: int = 1, dtype: torch.dtype = torch.float32,
                 max_reqs: int = 16, max_context_len: int = 512, seed: int = 0, kv_scale: Optional[float] = None,
                 **backend_options: Any) -> None:
        g = geometry
        self.g, self.device, self.dtype, self.page_size = g, torch.device(device), dtype, page_size
        self.gen = torch.Generator().manual_seed(seed)
        self.hybrid = size_swa is not None and bool(g.swa_layer_ids)
        if self.hybrid:
            self.pool = SWAKVPool(size, size_swa, page_size, dtype, g.num_kv_heads, g.head_dim, g.swa_layer_ids,
                                  g.full_layer_ids, device, swa_head_num=g.swa_num_kv_heads,
                                  swa_head_dim=g.swa_head_dim, v_head_dim=g.v_head_dim)
            self.allocator = SWATokenToKVPoolAllocator(size, size_swa, page_size, device, self.pool)
        else:
            self.pool = MHATokenToKVPool(size, page_size, dtype, g.num_kv_heads, g.head_dim, g.num_layers, device,
                                         v_head_dim=g.v_head_dim)
            self.allocator = PagedTokenToKVPoolAllocator(size, page_size, device)
        self.rtt = ReqToTokenPool(max_reqs, max_context_len, device)
        windows = (g.window,) if g.swa_layer_ids else ()
        self.backend = backend_factory(self.pool, self.rtt, sliding_window=windows, **backend_options)
        self.layers = [self._layer(i, kv_scale) for i in range(g.num_layers)]
        self.requests: Dict[int, Request] = {}
        self.max_err = 0.0
        self.runner: Optional[GraphRunner] = None

    def _layer(self, i: int, kv_scale: Optional[float]) -> AttentionLayer:
        g = self.g
        swa = g.is_swa(i)
        kvh = g.swa_num_kv_heads if (swa and g.swa_num_kv_heads) else g.num_kv_heads
        d = g.swa_head_dim if (swa and g.swa_head_dim) else g.head_dim
        vd = d if (swa and g.swa_head_dim) else (g.v_head_dim or d)
        sinks = torch.randn(g.num_heads, generator=self.gen).to(self.device) if g.sinks else None
        return AttentionLayer(i, g.num_heads, kvh, d, v_head_dim=vd, sliding_window=g.window if swa else None,
                              logit_cap=g.logit_cap, sinks=sinks, k_scale=kv_scale, v_scale=kv_scale)

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self) -> int:
        row = self.rtt.alloc(1)[0]
        self.requests[row] = Request(row, k={i: [] for i in range(self.g.num_layers)},
                                     v={i: [] for i in range(self.g.num_layers)})
        return row

    def finish(self, rid: int) -> None:
        r = self.requests.pop(rid)
        if r.seq_len:  # released SWA pages are skipped by free(); full pages all go back
            self.allocator.free(self.rtt.req_to_token[rid, :r.seq_len].clone())
        self.rtt.free(rid)

    def release(self) -> None:
        """Out-of-window release for every request (after each step, as an engine does)."""
        if not self.hybrid:
            return
        for r in self.requests.values():
            r.frontier = release_out_of_window(self.allocator, self.rtt.req_to_token[r.row], r.seq_len,
                                               r.frontier, self.g.window)

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
        self.pool.check_integrity()
        self.rtt.check_integrity()

    # ---- one forward ------------------------------------------------------------------------------
    def make_batch(self, rids: Sequence[int], new_lens: Sequence[int], mode: ForwardMode) -> ForwardBatch:
        """Allocate the new tokens, write them into req_to_token, build the ForwardBatch."""
        reqs = [self.requests[i] for i in rids]
        prefix = [r.seq_len for r in reqs]
        seq = [p + n for p, n in zip(prefix, new_lens)]
        last = [int(self.rtt.req_to_token[r.row, r.seq_len - 1]) if r.seq_len else 0 for r in reqs]
        if mode == ForwardMode.DECODE:
            loc = self.allocator.alloc_decode(seq, last)
        else:
            loc = self.allocator.alloc_extend(prefix, seq, last, sum(new_lens))
        start = 0
        for r, p, n in zip(reqs, prefix, new_lens):
            self.rtt.write(r.row, p, loc[start:start + n])
            r.seq_len = p + n
            start += n
        dev = dict(dtype=torch.int64, device=self.device)
        return ForwardBatch(mode, len(reqs), torch.tensor([r.row for r in reqs], **dev), torch.tensor(seq, **dev),
                            loc, torch.tensor(prefix, **dev), torch.tensor(list(new_lens), **dev),
                            seq_lens_cpu=torch.tensor(seq))

    def random_inputs(self, n: int) -> Dict[str, torch.Tensor]:
        """q, k, v per layer for n new tokens (in the pool's dtype, as an engine would hand them)."""
        dt = self.dtype if self.dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.bfloat16
        out = {}
        for l in self.layers:
            out[f"q{l.layer_id}"] = torch.randn(n, l.num_heads, l.head_dim, generator=self.gen).to(self.device, dt)
            out[f"k{l.layer_id}"] = torch.randn(n, l.num_kv_heads, l.head_dim, generator=self.gen).to(self.device, dt)
            out[f"v{l.layer_id}"] = torch.randn(n, l.num_kv_heads, l.v_head_dim, generator=self.gen).to(self.device, dt)
        return out

    def model_step(self, batch: ForwardBatch, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        """All layers: write K/V + attend; outputs flattened and concatenated per token."""
        outs = []
        for l in self.layers:
            i = l.layer_id
            o = self.backend.forward(inputs[f"q{i}"], inputs[f"k{i}"], inputs[f"v{i}"], l, batch)
            outs.append(o.reshape(o.shape[0], -1))
        return torch.cat(outs, dim=1)

    def split_outputs(self, flat: torch.Tensor) -> List[torch.Tensor]:
        res, c = [], 0
        for l in self.layers:
            w = l.num_heads * l.v_head_dim
            res.append(flat[:, c:c + w].reshape(-1, l.num_heads, l.v_head_dim))
            c += w
        return res

    def forward(self, rids: Sequence[int], new_lens: Sequence[int], mode: Optional[ForwardMode] = None,
                check: bool = True, atol: Optional[float] = None) -> List[torch.Tensor]:
        """One forward over all layers (eager, or through the graph runner when one is set)."""
        if mode is None:
            mode = ForwardMode.DECODE if all(n == 1 for n in new_lens) and all(
                self.requests[i].seq_len for i in rids) else ForwardMode.EXTEND
        batch = self.make_batch(rids, new_lens, mode)
        inputs = self.random_inputs(batch.num_tokens)
        if self.runner is not None and mode == ForwardMode.DECODE:
            flat = self.runner.run(batch, inputs)
        else:
            self.backend.init_forward_metadata(batch)
            flat = self.model_step(batch, inputs)
        outs = self.split_outputs(flat)
        self._record(rids, new_lens, inputs)
        if check:
            self.check_outputs(rids, new_lens, inputs, outs, atol)
        return outs

    def _record(self, rids: Sequence[int], new_lens: Sequence[int], inputs: Dict[str, torch.Tensor]) -> None:
        """Shadow the stored K/V: read back exactly what the pool holds (quantized), dequantized."""
        start = 0
        for rid, n in zip(rids, new_lens):
            r = self.requests[rid]
            for l in self.layers:
                i = l.layer_id
                r.k[i].append(_as_stored(inputs[f"k{i}"][start:start + n], self.dtype, l.k_scale))
                r.v[i].append(_as_stored(inputs[f"v{i}"][start:start + n], self.dtype, l.v_scale))
            start += n

    def check_outputs(self, rids: Sequence[int], new_lens: Sequence[int], inputs: Dict[str, torch.Tensor],
                      outs: List[torch.Tensor], atol: Optional[float] = None) -> float:
        """Compare every layer's output with hwkv.reference; raise ReferenceMismatchError beyond tolerance."""
        tol = atol if atol is not None else (2e-3 if self.dtype == torch.float32 else 3e-2)
        worst = 0.0
        reqs = [self.requests[i] for i in rids]
        for l, out in zip(self.layers, outs):
            i = l.layer_id
            keys = [torch.cat(r.k[i]) for r in reqs]
            vals = [torch.cat(r.v[i]) for r in reqs]
            q = inputs[f"q{i}"].float().cpu()
            ref = reference.batch_attention(q, keys, vals, [r.seq_len for r in reqs], list(new_lens), l.scaling,
                                            l.window, l.logit_cap, l.sinks.cpu() if l.sinks is not None else None)
            err = (out.float().cpu() - ref).abs().max().item() if ref.numel() else 0.0
            if not math.isfinite(err) or err > tol:
                raise ReferenceMismatchError(f"layer {i} ({'SWA W=' + str(l.window) if l.window else 'full'}): "
                                             f"max |out - reference| = {err:.3g} > tolerance {tol}")
            worst = max(worst, err)
        self.max_err = max(self.max_err, worst)
        return worst

    def enable_graphs(self, batch_sizes: Sequence[int], adapter: Any = None) -> GraphRunner:
        """Decode through a GraphRunner with these buckets (captured now)."""
        shapes = {}
        dt = self.dtype if self.dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.bfloat16
        for l in self.layers:
            shapes[f"q{l.layer_id}"] = ((l.num_heads, l.head_dim), dt)
            shapes[f"k{l.layer_id}"] = ((l.num_kv_heads, l.head_dim), dt)
            shapes[f"v{l.layer_id}"] = ((l.num_kv_heads, l.v_head_dim), dt)
        self.runner = GraphRunner(self.backend, self.model_step, batch_sizes, shapes, adapter)
        self.runner.capture()
        return self.runner


def _as_stored(x: torch.Tensor, dtype: torch.dtype, scale: Optional[float]) -> torch.Tensor:
    """What the pool holds for x, read back in fp32 (quantized, then scaled back)."""
    return quantize(x, dtype, scale).float().cpu() * (scale if scale is not None else 1.0)


def run_scenario(h: Harness, steps: int = 12, prompt_lens: Sequence[int] = (5, 13, 9), chunk: int = 8,
                 churn: bool = True, finish: bool = True) -> float:
    """Chunked prefill of a few requests, then decode steps with release every step; with churn,
    requests finish and new ones start mid-way so released SWA slots are reused."""
    rids = [h.add_request() for _ in prompt_lens]
    remaining = dict(zip(rids, prompt_lens))
    while any(remaining.values()):
        live = [r for r in rids if remaining[r]]
        lens = [min(chunk, remaining[r]) for r in live]
        h.forward(live, lens, ForwardMode.EXTEND)
        for r, n in zip(live, lens):
            remaining[r] -= n
        h.release()
        h.check_integrity()
    for s in range(steps):
        if churn and s == steps // 2 and len(rids) > 1:
            h.finish(rids.pop(0))
            new = h.add_request()
            h.forward([new], [prompt_lens[0] + 3], ForwardMode.EXTEND)
            rids.append(new)
            h.release()
        h.forward(rids, [1] * len(rids), ForwardMode.DECODE)
        h.release()
        h.check_integrity()
    if finish:
        for r in rids:
            h.finish(r)
        h.check_integrity()
    return h.max_err
