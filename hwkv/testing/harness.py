"""A small hybrid model run on the engine's step primitives, checked against the reference.

Used by the contract suite and by `hwkv bench`. The slots of a forward, req_to_token, the ForwardBatch, the
out-of-window release and a finished request's free are the engine's own (`hwkv.engine.forward.ForwardSlots`,
what `hwkv.engine.engine.Engine` steps on); the harness adds what checks them: random q/k/v per layer, a shadow
copy of every stored K/V (as stored: quantized values read back, so output errors are kernel errors, not storage
errors) and the comparison with `hwkv.reference`. Long runs can shadow (and check) only a few requests and only
the last queries of each.

A forward is split the way the engine splits it, so each part can be timed on its own:
`step_lens` (the scheduler's host lengths, one copy to the device), `allocate` (slots, req_to_token, the
ForwardBatch), `init_metadata` and `run_layers` (the backend: eager, or a graph runner's
`prepare` and `replay`), then `release` (out-of-window, one batched call where a frontier moves).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hwkv import reference
from hwkv.allocator import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator
from hwkv.req_to_token import ReqToTokenPool
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.checks import as_int, check_int_option, is_bool
from hwkv.engine.forward import ForwardSlots, StepLens
from hwkv.errors import ConfigError, ReferenceMismatchError, ShapeError
from hwkv.graph import GraphRunner, PreparedStep
from hwkv.layer import AttentionLayer
from hwkv.ops import quantize
from hwkv.pool import MHATokenToKVPool, SWAKVPool

BackendFactory = Callable[..., Any]

# the largest |out - reference| an fp32 run accepts: fp32 kernels err ~5e-7 here, and half-precision math (q rounded
# to fp16) ~6e-4; a target that needs more sets `fp32_tolerance` (e.g. a ContractTarget subclass with that field).
# The contract suites (hwkv.testing.contract, contract_spec) build their fp32 harnesses with it.
FP32_TOLERANCE = 1e-4


def _check_tolerance(name: str, value: Any) -> None:
    """ConfigError unless `value` is a finite real >= 0 (a bool is none): a NaN tolerance passes every output (err >
    nan is False), a string breaks the comparison."""
    if is_bool(value) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"harness: {name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class ModelGeometry:
    """Layers, heads and window of a (small) hybrid model; `swa_*` fields left None follow the full layers."""

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
    layer_is_swa: Optional[Tuple[bool, ...]] = None  # explicit per-layer kinds (overrides swa_every)
    swa_num_heads: Optional[int] = None
    swa_v_head_dim: Optional[int] = None
    swa_sinks: Optional[bool] = None  # None: same as `sinks`
    scaling: Optional[float] = None   # None: head_dim ** -0.5
    swa_windows: Optional[Tuple[int, ...]] = None  # the SWA layers' windows in order (cycled); None: all `window`.
    # `window` (the release's) must then be their largest

    def layer_window(self, i: int) -> Optional[int]:
        """Layer i's window (None for a full layer)."""
        if not self.is_swa(i):
            return None
        if not self.swa_windows:
            return self.window
        return self.swa_windows[self.swa_layer_ids.index(i) % len(self.swa_windows)]

    @property
    def windows(self) -> Tuple[int, ...]:
        """The distinct windows of the SWA layers, ascending (a backend's `sliding_window`)."""
        return tuple(sorted({self.layer_window(i) for i in self.swa_layer_ids}))

    def __post_init__(self) -> None:
        if self.layer_is_swa is not None:
            object.__setattr__(self, "layer_is_swa", tuple(bool(x) for x in self.layer_is_swa))
            object.__setattr__(self, "num_layers", len(self.layer_is_swa))
        check_int_option("ModelGeometry: num_layers" + (" (layer_is_swa's length)" if self.layer_is_swa is not None
                                                        else ""), self.num_layers, 1)
        if self.swa_windows is not None:
            object.__setattr__(self, "swa_windows", tuple(int(w) for w in self.swa_windows))
            if self.swa_windows and max(self.swa_windows) != self.window:
                raise ConfigError(f"ModelGeometry: window {self.window} must be the largest of swa_windows "
                                  f"{self.swa_windows} (the release keeps the largest window)")

    def is_swa(self, i: int) -> bool:
        if self.layer_is_swa is not None:
            return self.layer_is_swa[i]
        return self.swa_every > 0 and (i + 1) % self.swa_every != 0

    @property
    def swa_layer_ids(self) -> List[int]:
        return [i for i in range(self.num_layers) if self.is_swa(i)]

    @property
    def full_layer_ids(self) -> List[int]:
        return [i for i in range(self.num_layers) if not self.is_swa(i)]


I64 = torch.int64


@dataclass
class Request:
    row: int
    seq_len: int = 0
    shadowed: bool = True  # its K/V is shadowed and its outputs are checked
    k: Dict[int, List[torch.Tensor]] = field(default_factory=dict)   # shadow K per layer (fp32, as stored)
    v: Dict[int, List[torch.Tensor]] = field(default_factory=dict)


class Harness:
    """Pool + allocator + backend + shadow K/V for one model geometry on one device."""

    def __init__(self, backend_factory: BackendFactory, device: str = "cpu", geometry: ModelGeometry = ModelGeometry(),
                 size: int = 512, size_swa: Optional[int] = 128, page_size: int = 1, dtype: torch.dtype = torch.float32,
                 max_reqs: int = 16, max_context_len: int = 512, seed: int = 0, kv_scale: Optional[float] = None,
                 device_inputs: bool = False, shadow: bool = True, shadow_requests: Optional[int] = None,
                 check_queries: Optional[int] = None, k_scale: Optional[float] = None,
                 v_scale: Optional[float] = None, tolerance: Optional[float] = None,
                 **backend_options: Any) -> None:
        """`kv_scale` gives K and V one scale; `k_scale` / `v_scale` (each defaulting to `kv_scale`) set them apart.
        `tolerance`: the largest |out - reference| a check accepts (None: the dtype's default, `tolerance`);
        `backend_options` go to the backend (`sliding_window` defaults to the geometry's windows)."""
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ConfigError(f"harness: seed must be an integer in [0, 2**63), got {seed!r}")
        if tolerance is not None:
            _check_tolerance("tolerance", tolerance)
        for name, value in (("shadow_requests", shadow_requests), ("check_queries", check_queries)):
            check_int_option(f"harness: {name}", value, 1, none=True)   # (0 would check nothing)
        g = geometry
        self.g, self.device, self.dtype, self.page_size = g, torch.device(device), dtype, page_size
        self.gen = torch.Generator().manual_seed(seed)
        # device_inputs: draw q/k/v with a generator on the device (fast for large runs; not CPU-reproducible)
        self.input_gen = torch.Generator(device=self.device).manual_seed(seed) if device_inputs else None
        self.shadow = shadow  # False: no shadow K/V (and so no reference checks), for long benchmark runs
        self.shadow_requests = shadow_requests  # shadow (and check) at most this many live requests; None: all
        self.check_queries = check_queries      # check only each request's last N queries of a forward; None: all
        self._tolerance = tolerance
        self.hybrid = size_swa is not None and bool(g.swa_layer_ids)
        if self.hybrid:
            self.pool = SWAKVPool(size, size_swa, page_size, dtype, g.num_kv_heads, g.head_dim, g.swa_layer_ids,
                                  g.full_layer_ids, device, swa_head_num=g.swa_num_kv_heads,
                                  swa_head_dim=g.swa_head_dim, swa_v_head_dim=g.swa_v_head_dim,
                                  v_head_dim=g.v_head_dim)
            self.allocator = SWATokenToKVPoolAllocator(size, size_swa, page_size, device, self.pool)
        else:
            self.pool = MHATokenToKVPool(size, page_size, dtype, g.num_kv_heads, g.head_dim, g.num_layers, device,
                                         v_head_dim=g.v_head_dim)
            self.allocator = PagedTokenToKVPoolAllocator(size, page_size, device)
        self.rtt = ReqToTokenPool(max_reqs, max_context_len, device)
        # the engine's step primitives over these pools: slots, req_to_token, batches, release, frees
        self.slots = ForwardSlots(self.allocator, self.rtt, g.window if self.hybrid else None)
        self._last: Optional[Tuple[ForwardBatch, StepLens]] = None  # the last batch `allocate` made, its lens
        self.backend_options = dict(sliding_window=g.windows if g.swa_layer_ids else ())
        self.backend_options.update(backend_options)  # e.g. sliding_window=(): window layers over the full list
        self.backend = self.build_backend(backend_factory)
        ks = k_scale if k_scale is not None else kv_scale
        vs = v_scale if v_scale is not None else kv_scale
        self.layers = [self._layer(i, ks, vs) for i in range(g.num_layers)]
        self.requests: Dict[int, Request] = {}
        self.max_err = 0.0
        self.runner: Optional[GraphRunner] = None
        self.step_graph: Any = None  # a DecodeStepGraph (enable_step_graph)

    @property
    def frontiers(self) -> torch.Tensor:
        """Each request row's out-of-window release frontier, on the device (the engine's `ForwardSlots`)."""
        return self.slots.frontiers

    def _layer(self, i: int, k_scale: Optional[float], v_scale: Optional[float]) -> AttentionLayer:
        g = self.g
        swa = g.is_swa(i)
        kvh = g.swa_num_kv_heads if (swa and g.swa_num_kv_heads) else g.num_kv_heads
        d = g.swa_head_dim if (swa and g.swa_head_dim) else g.head_dim
        vd = d if (swa and g.swa_head_dim) else (g.v_head_dim or d)
        vd = g.swa_v_head_dim if (swa and g.swa_v_head_dim) else vd
        h = g.swa_num_heads if (swa and g.swa_num_heads) else g.num_heads
        has_sinks = g.swa_sinks if (swa and g.swa_sinks is not None) else g.sinks
        sinks = torch.randn(h, generator=self.gen, device="cpu").to(self.device) if has_sinks else None
        return AttentionLayer(i, h, kvh, d, scaling=g.scaling, v_head_dim=vd,
                              sliding_window=g.layer_window(i), logit_cap=g.logit_cap, sinks=sinks,
                              k_scale=k_scale, v_scale=v_scale)

    def build_backend(self, backend_factory: BackendFactory) -> Any:
        """A backend over this harness's pool and req_to_token, with its window and options."""
        return backend_factory(self.pool, self.rtt, **self.backend_options)

    # ---- requests -----------------------------------------------------------------------------
    def check_live(self, rids: Sequence[int]) -> None:
        """ConfigError unless every id of `rids` is a live request (handed out by `add_request`, not finished) and
        none is named twice: called before a step or a finish allocates or frees anything."""
        seen = set()
        for rid in rids:
            if as_int(rid) is None or rid not in self.requests:
                raise ConfigError(f"request {rid!r} is not live; live ids: {sorted(self.requests)}")
            if rid in seen:
                raise ConfigError(f"request {rid} is named twice in one step (ids {list(rids)}); each at most once")
            seen.add(rid)

    def add_request(self) -> int:
        """A new empty request (its row and frontier from the step primitives); returns its id, its row."""
        row = self.slots.new_rows(1)[0]
        shadowed = self.shadow and (self.shadow_requests is None or
                                    sum(r.shadowed for r in self.requests.values()) < self.shadow_requests)
        self.requests[row] = Request(row, shadowed=shadowed, k={i: [] for i in range(self.g.num_layers)},
                                     v={i: [] for i in range(self.g.num_layers)})
        return row

    def finish(self, rid: int) -> None:
        """The request leaves: its slots (released SWA slots are skipped) and its row go back."""
        self.check_live([rid])
        r = self.requests.pop(rid)
        self.slots.free([rid], [r.seq_len])

    def release(self, batch: Optional[ForwardBatch] = None) -> None:
        """Out-of-window release after a step, as the engine does (`ForwardSlots.release`: one batched call where
        some frontier moves): for the requests of `batch` (its rows and lengths), or for every live request when
        no batch is given."""
        if not self.hybrid or not self.requests:
            return
        if batch is None:
            rows = list(self.requests)
            self.slots.release(rows, [self.requests[r].seq_len for r in rows])
            return
        if self._last is not None and self._last[0] is batch:  # its host lists, as the engine keeps them
            rows, seq = self._last[1].rows, self._last[1].seq
        else:  # a batch made elsewhere: its host values read back
            rows, seq = batch.req_pool_indices.tolist(), batch.host_lens()[0].tolist()
        self.slots.release(rows, seq, batch.req_pool_indices, batch.seq_lens)

    def check_integrity(self) -> None:
        """Allocator, pools and request rows are consistent (tests call it after every step)."""
        self.allocator.check_integrity()
        self.pool.check_integrity()
        self.rtt.check_integrity()

    # ---- one forward ------------------------------------------------------------------------------
    def make_batch(self, rids: Sequence[int], new_lens: Sequence[int], mode: ForwardMode) -> ForwardBatch:
        """Allocate the new tokens, write them into req_to_token, build the ForwardBatch."""
        return self.allocate(self.step_lens(rids, new_lens, mode))

    def step_lens(self, rids: Sequence[int], new_lens: Sequence[int], mode: ForwardMode) -> StepLens:
        """The scheduler's part: rows, prefix, sequence and new lengths on the host and (one copy) on the device.
        ShapeError for a DECODE whose requests do not add one token each; ConfigError for an id not live, or named
        twice."""
        self.check_live(rids)
        prefix = [self.requests[i].seq_len for i in rids]
        new = [int(n) for n in new_lens]
        if len(new) != len(prefix):
            raise ShapeError(f"{len(new)} new lengths for {len(prefix)} requests")
        if mode == ForwardMode.DECODE:
            if any(n != 1 for n in new):
                raise ShapeError(f"DECODE adds one token per request, got new lengths {new}")
            return self.slots.plan_decode(list(rids), prefix)
        return self.slots.plan_extend(mode, list(rids), prefix, new)

    def allocate(self, s: StepLens) -> ForwardBatch:
        """The engine's allocation (`ForwardSlots.allocate`): each request's last loc gathered on the device, the
        allocator's one batched call, one req_to_token scatter, the ForwardBatch; no per-request device read.
        The host lengths move here (the shadow and the reference read them)."""
        batch = self.slots.allocate(s)
        for rid, n in zip(s.rows, s.seq):
            self.requests[rid].seq_len = n
        self._last = (batch, s)
        return batch

    def random_inputs(self, n: int, into: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
        """q, k, v per layer for n new tokens (in the pool's dtype, as an engine would hand them). With
        `into` (a graph runner's static inputs) they are drawn in place there, as an engine's layers
        would write them, so the runner copies nothing."""
        dt = self.dtype if self.dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.bfloat16
        if self.input_gen is not None:
            def rand(*shape: int) -> torch.Tensor:
                return torch.randn(*shape, generator=self.input_gen, device=self.device, dtype=dt)
        else:
            def rand(*shape: int) -> torch.Tensor:
                return torch.randn(*shape, generator=self.gen, device="cpu").to(self.device, dt)
        out = {}
        for l in self.layers:
            for name, shape in ((f"q{l.layer_id}", (n, l.num_heads, l.head_dim)),
                                (f"k{l.layer_id}", (n, l.num_kv_heads, l.head_dim)),
                                (f"v{l.layer_id}", (n, l.num_kv_heads, l.v_head_dim))):
                buf = into.get(name) if into is not None else None
                if buf is not None and buf.shape[0] >= n and tuple(buf.shape[1:]) == shape[1:]:
                    out[name] = buf[:n]
                    if self.input_gen is not None:
                        out[name].normal_(generator=self.input_gen)
                    else:
                        out[name].copy_(rand(*shape))
                else:
                    out[name] = rand(*shape)
        return out

    def model_step(self, batch: ForwardBatch, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        """All layers: write K/V + attend; outputs flattened and concatenated per token."""
        outs = []
        for l in self.layers:
            i = l.layer_id
            q = inputs[f"q{i}"]
            o = self.backend.forward(q, inputs[f"k{i}"], inputs[f"v{i}"], l, batch)
            # the output contract (`out = q.new_empty(T, H, Dv)`): q's dtype and device, (T, H, Dv); checked here
            # because the comparison reads got.float() and torch.cat would promote a stray dtype
            if o.dtype != q.dtype or o.device != q.device or tuple(o.shape) != (q.shape[0], l.num_heads,
                                                                                 l.v_head_dim):
                raise ShapeError(f"layer {i}: forward returned {o.dtype} {tuple(o.shape)} on {o.device}, expected "
                                 f"{q.dtype} {(q.shape[0], l.num_heads, l.v_head_dim)} on {q.device} (q's)")
            outs.append(o.reshape(o.shape[0], l.num_heads * l.v_head_dim))  # (-1 is ambiguous for 0 tokens)
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
        if atol is not None:
            _check_tolerance("atol", atol)
        batch, inputs = self.prepare(rids, new_lens, mode)
        flat = self.step(batch, inputs)
        return self.complete(rids, new_lens, inputs, flat, check, atol)

    def prepare(self, rids: Sequence[int], new_lens: Sequence[int],
                mode: Optional[ForwardMode] = None) -> Tuple[ForwardBatch, Dict[str, torch.Tensor]]:
        """The engine's part of a forward: allocate, build the batch, draw the inputs."""
        self.check_live(rids)
        if mode is None:
            mode = ForwardMode.DECODE if all(n == 1 for n in new_lens) and all(
                self.requests[i].seq_len for i in rids) else ForwardMode.EXTEND
        batch = self.make_batch(rids, new_lens, mode)
        return batch, self.random_inputs(batch.num_tokens)

    def step(self, batch: ForwardBatch, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The backend's part: metadata once, then every layer (a graph replay for the runner's mode)."""
        return self.run_layers(batch, inputs, self.init_metadata(batch, inputs))

    def init_metadata(self, batch: ForwardBatch, inputs: Dict[str, torch.Tensor]) -> Optional[PreparedStep]:
        """The metadata step: eager `init_forward_metadata`, or for the runner's mode its `prepare`
        (copy into the static inputs, pad, refill the static metadata), whose result `run_layers` takes."""
        if self.runner is not None and batch.forward_mode == self.runner.mode:
            return self.runner.prepare(batch, inputs)
        self.backend.init_forward_metadata(batch)
        return None

    def run_layers(self, batch: ForwardBatch, inputs: Dict[str, torch.Tensor],
                   prepared: Optional[PreparedStep] = None) -> torch.Tensor:
        """Every layer after `init_metadata`: the graph replay when it prepared one, else eagerly."""
        if prepared is not None:
            return self.runner.replay(prepared)
        return self.model_step(batch, inputs)

    def complete(self, rids: Sequence[int], new_lens: Sequence[int], inputs: Dict[str, torch.Tensor],
                 flat: torch.Tensor, check: bool = True, atol: Optional[float] = None) -> List[torch.Tensor]:
        """After the step: shadow the stored K/V and (with `check`) compare every layer with the reference."""
        outs = self.split_outputs(flat)
        if self.shadow:
            self._record(rids, new_lens, inputs)
        elif check:
            raise ConfigError("check=True needs the shadow K/V: build the Harness with shadow=True")
        if check:
            self.check_outputs(rids, new_lens, inputs, outs, atol)
        return outs

    def _spans(self, rids: Sequence[int], new_lens: Sequence[int]) -> List[Tuple[Request, int, int]]:
        """(request, first token, tokens) of each shadowed request in the forward's token order."""
        out, start = [], 0
        for rid, n in zip(rids, new_lens):
            r = self.requests[rid]
            if r.shadowed:
                out.append((r, start, n))
            start += n
        return out

    def checks_any(self, rids: Sequence[int]) -> bool:
        """Whether a check of a forward over `rids` compares anything (some request is shadowed)."""
        return self.shadow and any(self.requests[i].shadowed for i in rids)

    @staticmethod
    def _take(x: torch.Tensor, spans: Sequence[Tuple[int, int]], everything: bool) -> torch.Tensor:
        """Rows [start, start + n) of x for each span, concatenated (x itself when that is everything)."""
        if everything:
            return x
        idx = torch.cat([torch.arange(a, a + n, device="cpu") for a, n in spans]) if spans else \
            torch.zeros(0, dtype=I64, device="cpu")
        return x[idx.to(x.device)]

    def _record(self, rids: Sequence[int], new_lens: Sequence[int], inputs: Dict[str, torch.Tensor]) -> None:
        """Shadow the stored K/V: read back exactly what the pool holds (quantized), dequantized."""
        spans = self._spans(rids, new_lens)
        if not spans:
            return
        everything = len(spans) == len(rids)
        pos = [(a, n) for _, a, n in spans]
        for l in self.layers:
            i = l.layer_id
            # one host copy per layer and forward, of the shadowed requests' tokens only
            k = _as_stored(self._take(inputs[f"k{i}"], pos, everything), self.dtype, l.k_scale)
            v = _as_stored(self._take(inputs[f"v{i}"], pos, everything), self.dtype, l.v_scale)
            start = 0
            for r, _, n in spans:
                r.k[i].append(k[start:start + n])
                r.v[i].append(v[start:start + n])
                start += n

    def check_outputs(self, rids: Sequence[int], new_lens: Sequence[int], inputs: Dict[str, torch.Tensor],
                      outs: List[torch.Tensor], atol: Optional[float] = None) -> float:
        """Compare every layer's output with hwkv.reference (the shadowed requests, each one's last
        `check_queries` queries); raise ReferenceMismatchError beyond tolerance."""
        if atol is not None:
            _check_tolerance("atol", atol)
        tol = atol if atol is not None else self.tolerance
        spans = self._spans(rids, new_lens)
        if not spans:
            return 0.0
        m = [n if self.check_queries is None else min(n, self.check_queries) for _, _, n in spans]
        pos = [(a + n - k, k) for (_, a, n), k in zip(spans, m)]  # the last k queries of each request
        everything = len(spans) == len(rids) and m == [n for _, _, n in spans]
        reqs = [r for r, _, _ in spans]
        worst = 0.0
        for l, out in zip(self.layers, outs):
            i = l.layer_id
            keys = [torch.cat(r.k[i]) for r in reqs]
            vals = [torch.cat(r.v[i]) for r in reqs]
            q = self._take(inputs[f"q{i}"], pos, everything).float().cpu()
            ref = reference.batch_attention(q, keys, vals, [r.seq_len for r in reqs], m, l.scaling,
                                            l.window, l.logit_cap, l.sinks.cpu() if l.sinks is not None else None)
            got = self._take(out, pos, everything).float().cpu()
            worst = max(worst, self.compare(l, got, ref, "", tol))
        return worst

    @property
    def tolerance(self) -> float:
        """Largest |out - reference| a check accepts for this harness's dtype."""
        if self._tolerance is not None:
            return self._tolerance
        return 2e-3 if self.dtype == torch.float32 else 3e-2

    def compare(self, layer: AttentionLayer, got: torch.Tensor, ref: torch.Tensor, what: str = "",
                tol: Optional[float] = None) -> float:
        """max |got - ref| for one layer (recorded in max_err); ReferenceMismatchError beyond `tol`, ShapeError where
        the shapes differ (an output against an empty reference included)."""
        if tol is not None:
            _check_tolerance("tol", tol)
        tol = self.tolerance if tol is None else tol
        if tuple(got.shape) != tuple(ref.shape):  # no broadcast, and nothing passes against an empty reference
            raise ShapeError(f"{what + ', ' if what else ''}layer {layer.layer_id}: the output has shape "
                             f"{list(got.shape)}, the reference {list(ref.shape)}")
        err = (got.float().cpu() - ref).abs().max().item() if ref.numel() else 0.0
        if not math.isfinite(err) or err > tol:
            kind = "SWA W=" + str(layer.window) if layer.window else "full"
            raise ReferenceMismatchError(f"{what + ', ' if what else ''}layer {layer.layer_id} ({kind}): "
                                         f"max |out - reference| = {err:.3g} > tolerance {tol}")
        self.max_err = max(self.max_err, err)
        return err

    def enable_graphs(self, batch_sizes: Sequence[int], adapter: Any = None, mode: ForwardMode = ForwardMode.DECODE,
                      tokens_per_req: int = 1, tree: bool = False) -> GraphRunner:
        """Run `mode` forwards (decode, or e.g. TARGET_VERIFY with a fixed draft length) through a
        GraphRunner with these buckets (captured now)."""
        self.runner = GraphRunner(self.backend, self.model_step, batch_sizes, self._input_shapes(), adapter, mode,
                                  tokens_per_req, tree=tree)
        self.runner.capture()
        return self.runner

    def _input_shapes(self) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
        """Each layer's q/k/v per token: what a graph's static inputs hold."""
        dt = self.dtype if self.dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.bfloat16
        shapes = {}
        for l in self.layers:
            shapes[f"q{l.layer_id}"] = ((l.num_heads, l.head_dim), dt)
            shapes[f"k{l.layer_id}"] = ((l.num_kv_heads, l.head_dim), dt)
            shapes[f"v{l.layer_id}"] = ((l.num_kv_heads, l.v_head_dim), dt)
        return shapes

    def enable_step_graph(self, batch_sizes: Sequence[int], adapter: Any = None) -> Any:
        """Run decode steps whole through a `hwkv.step_graph.DecodeStepGraph` (allocation, req_to_token write,
        refill, every layer and the release in one replay), over this harness's rows and frontiers; captured
        now. It takes one request row for its padding: build the Harness with a spare row."""
        from hwkv.step_graph import DecodeStepGraph
        hybrid = self.hybrid
        self.step_graph = DecodeStepGraph(self.backend, self.allocator, self.model_step, batch_sizes,
                                          self._input_shapes(), adapter, self.slots.frontiers if hybrid else None,
                                          self.g.window if hybrid else None)
        self.step_graph.capture()
        return self.step_graph

    def step_graph_decode(self, rids: Sequence[int], inputs: Optional[Dict[str, torch.Tensor]] = None,
                          check: bool = True) -> torch.Tensor:
        """One decode step of `rids` through the step graph (`enable_step_graph`); the flat outputs. `inputs`
        None: drawn into the graph's buffers already. The host lengths move here, as `allocate` moves them; the
        host frontiers follow the graph's release (`ForwardSlots.replay_decode`). `check=False`: the caller ran
        `check_live(rids)` (a benchmark timing the step alone, as its eager steps' checks are not timed)."""
        if check:
            self.check_live(rids)
        out, _ = self.slots.replay_decode(self.step_graph, list(rids), [self.requests[i].seq_len for i in rids],
                                          inputs)
        for rid in rids:
            self.requests[rid].seq_len += 1
        return out


def _as_stored(x: torch.Tensor, dtype: torch.dtype, scale: Optional[float]) -> torch.Tensor:
    """What the pool holds for x, read back in fp32 (quantized, then scaled back)."""
    return quantize(x, dtype, scale).float().cpu() * (scale if scale is not None else 1.0)


def run_scenario(h: Harness, steps: int = 12, prompt_lens: Sequence[int] = (5, 13, 9), chunk: int = 8,
                 churn: bool = True, finish: bool = True, mixed: bool = False) -> float:
    """Chunked prefill of a few requests, then decode steps with release every step; with churn,
    requests finish and new ones start mid-way so released SWA slots are reused. With `mixed`, the new
    request's prompt rides in two ForwardMode.MIXED forwards (the engine's chunked prefill beside decoding
    rows: the decoding rows first, then the prompt chunk; then the continuing chunk) instead of one EXTEND."""
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
            n = prompt_lens[0] + 3
            if mixed:
                first = max(2, n // 2)
                h.forward(rids + [new], [1] * len(rids) + [first], ForwardMode.MIXED)
                h.release()
                h.check_integrity()
                h.forward(rids + [new], [1] * len(rids) + [n - first], ForwardMode.MIXED)
            else:
                h.forward([new], [n], ForwardMode.EXTEND)
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
