"""`hwkv bench`'s loop: per batch size one shared pool, on which every configuration takes turns.

Per batch size a `hwkv.testing.Harness` is sized for the workload, and each configuration gets its
own backend (and graph runner) over that pool; allocation, req_to_token writes and release are the
engine's own step primitives (`hwkv.engine.forward.ForwardSlots`), which the harness calls. Requests of mixed prompt lengths are prefilled in
chunks (a token budget per forward), then decoded for warm-up + timed steps, the configurations
taking turns every step (same load, same drift), with out-of-window release after every forward.
Each timed decode step is timed in three phases (`PHASES`), the device synchronized around each;
the step is their sum. Sampled forwards are compared with `hwkv.reference` (outside the timed
phases); a mismatch raises, it is never averaged away. Translations are counted by wrapping
`pool.translate_loc_from_full_to_swa`; the calls a captured graph replays are counted once at
capture, in an extra eager run of the step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hwkv.batch import ForwardMode
from hwkv.bench.baseline import per_layer_backend
from hwkv.engine.dtypes import DTYPES, shape_in
from hwkv.bench.plan import round_up, swa_tokens_per_request
from hwkv.bench.presets import ModelShape
from hwkv.bench.spread import Spread
from hwkv.checks import is_int
from hwkv.errors import ConfigError, ReferenceMismatchError
from hwkv.loc import translations_of
from hwkv.testing.harness import Harness, ModelGeometry

# the phases of one timed decode step, in order (the JSON carries this table too)
PHASES: Dict[str, str] = {
    "alloc_release": "the engine's step primitives (hwkv.engine.forward.ForwardSlots): alloc_decode for the batch "
                     "(last locs gathered on the device, new locs written into req_to_token) plus "
                     "release_out_of_window_batch after the step, in the steps where some frontier moves",
    "metadata": "eager: backend.init_forward_metadata(batch); graph: the graph runner's prepare (copy into the "
                "static inputs, pad to the bucket, init_forward_metadata_graph refill)",
    "forward": "eager: every layer's K/V write and attention; graph: the replay; step-graph: the whole step (the "
               "host's one copy and one replay of allocation, req_to_token write, refill, layers and release: its "
               "alloc_release and metadata phases are 0)",
}
STEP = ("alloc_release + metadata + forward, summed per decode step; median/p10/p90/mean over the timed steps "
        "(percentiles interpolated linearly between the closest ranks)")


@dataclass(frozen=True)
class BenchConfig:
    """One configuration: where translation happens and whether decode replays graphs."""

    name: str
    per_layer: bool
    graph: bool
    whole_step: bool = False  # the whole decode step in one graph (hwkv.step_graph.DecodeStepGraph)


CONFIGS: Dict[str, BenchConfig] = {c.name: c for c in (
    BenchConfig("per-layer/eager", per_layer=True, graph=False),
    BenchConfig("once/eager", per_layer=False, graph=False),
    BenchConfig("per-layer/graph", per_layer=True, graph=True),
    BenchConfig("once/graph", per_layer=False, graph=True),
    BenchConfig("once/step-graph", per_layer=False, graph=True, whole_step=True),
)}


@dataclass(frozen=True)
class Workload:
    """What every (configuration, batch size) runs; prompts are spread over [prompt_len / 2, prompt_len]."""

    batch_sizes: Tuple[int, ...] = (1, 4, 16)
    prompt_len: int = 256
    chunk: int = 512             # prefill token budget per forward, over the whole batch
    steps: int = 16              # timed decode steps per repeat
    warmup: int = 2              # untimed decode steps before them
    repeats: int = 1             # rounds of fresh requests (prefill + decode)
    check_every: int = 8         # reference-check every k-th forward (and the last one); 0 = never
    check_requests: int = 0      # shadow and check only the first N requests of a batch; 0 = all
    check_queries: int = 0       # check only each request's last N queries of a forward; 0 = all
    page_size: int = 16
    dtype: str = "fp32"
    seed: int = 0

    def __post_init__(self) -> None:
        sizes = self.batch_sizes
        if not isinstance(sizes, (tuple, list)) or not sizes or not all(is_int(b) and b >= 1 for b in sizes):
            raise ConfigError(f"batch_sizes must be a tuple of integers >= 1, got {sizes!r}")
        object.__setattr__(self, "batch_sizes", tuple(sizes))
        for name, lo in (("prompt_len", 1), ("chunk", 1), ("steps", 1), ("warmup", 0), ("repeats", 1),
                         ("check_every", 0), ("check_requests", 0), ("check_queries", 0), ("page_size", 1)):
            if not is_int(getattr(self, name)) or getattr(self, name) < lo:
                raise ConfigError(f"{name} must be an integer >= {lo}, got {getattr(self, name)!r}")
        if not is_int(self.seed) or not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    def prompt_lens(self, bs: int) -> List[int]:
        """Mixed lengths: from prompt_len down to about half of it, evenly."""
        half = self.prompt_len // 2
        return [self.prompt_len - (half * i) // max(bs - 1, 1) for i in range(bs)]


@dataclass(frozen=True)
class Target:
    """What runs: a device plugin's name, backend class, torch device and graph adapter factory (None: none)."""

    name: str
    backend_cls: type
    torch_device: str
    adapter_factory: Optional[Callable[[], Any]] = None


@dataclass
class Row:
    """Timing of one (configuration, batch size) over its timed decode steps: the whole step
    (median_ms, p10_ms, p90_ms, mean_ms; see STEP) and each of its `PHASES`."""

    config: str
    batch_size: int
    forwards: int                # timed decode steps
    median_ms: float
    p10_ms: float
    p90_ms: float
    tokens_per_s: float          # batch_size / median step
    translations_per_forward: float
    checked_forwards: int
    max_abs_err: Optional[float]
    mean_ms: float = 0.0
    phases: Dict[str, Spread] = field(default_factory=dict)


@dataclass
class MemoryRow:
    """KV bytes held at the end of a run, for the whole model: hybrid pools vs one all-full pool."""

    batch_size: int
    live_tokens: int
    full_slots: int
    swa_slots: int
    hybrid_bytes: int
    all_full_bytes: int
    saving: float  # all_full_bytes / hybrid_bytes


@dataclass
class BenchResult:
    """Everything `hwkv bench` reports."""

    target: str
    backend: str
    torch_device: str
    model: ModelShape
    run_layers: int
    workload: Workload
    configs: List[str]
    rows: List[Row] = field(default_factory=list)
    memory: List[MemoryRow] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    wall_s: float = 0.0
    threads: int = 0  # torch's CPU threads during the run


# ---- counting translations ---------------------------------------------------------------------
class TranslationCounter:
    """Replaces `pool.translate_loc_from_full_to_swa` with a wrapper counting the translations of its calls (a
    fused refill's call makes several: `hwkv.loc.translations_of`), paused inside graphs."""

    def __init__(self, pool: Any) -> None:
        self.inner = getattr(pool, "translate_loc_from_full_to_swa", None)  # None: not a hybrid pool
        self.calls = 0
        self.paused = False
        if self.inner is not None:
            pool.translate_loc_from_full_to_swa = self

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not self.paused:
            self.calls += translations_of(*args, **kwargs)
        return self.inner(*args, **kwargs)


class CountingAdapter:
    """Wraps a device graph adapter: counts the translations one replay runs (an eager run at capture)."""

    def __init__(self, inner: Any, counter: TranslationCounter) -> None:
        self.inner, self.counter = inner, counter
        # a device graph records the metadata refill with the layers (GraphRunner.metadata_in_graph) as the
        # adapter it wraps would: the bench measures what an engine runs
        self.records_device_work = bool(getattr(inner, "records_device_work", False))
        self.calls_step = bool(getattr(inner, "calls_step", False))

    def capture(self, fn: Callable[[], torch.Tensor]) -> Tuple[Any, torch.Tensor]:
        before = self.counter.calls
        fn()  # eager, counted: exactly the calls the graph records
        in_graph = self.counter.calls - before
        self.counter.calls = before
        self.counter.paused = True
        try:
            graph, out = self.inner.capture(fn)
        finally:
            self.counter.paused = False
        return (graph, in_graph), out

    def replay(self, graph: Any) -> torch.Tensor:
        inner_graph, in_graph = graph
        self.counter.paused = True
        try:
            out = self.inner.replay(inner_graph)
        finally:
            self.counter.paused = False
        self.counter.calls += in_graph
        return out

    def pre_replay(self, graph: Any) -> None:
        self.inner.pre_replay(graph[0])


# ---- one batch size, every configuration ---------------------------------------------------------
def default_run_layers(shape: ModelShape, torch_device: str) -> int:
    """All layers on accelerators; on CPU the shortest prefix of >= 4 layers holding both kinds."""
    if torch_device != "cpu":
        return shape.num_layers
    need = 4
    for ids in (shape.swa_layer_ids, shape.full_layer_ids):
        if ids:
            need = max(need, ids[0] + 1)
    return min(need, shape.num_layers)


def geometry(shape: ModelShape, run_layers: int) -> ModelGeometry:
    """The Harness geometry of the first `run_layers` layers of `shape` (its layer pattern kept)."""
    if not 1 <= run_layers <= shape.num_layers:
        raise ConfigError(f"run_layers must be in [1, {shape.num_layers}] for {shape.name}, got {run_layers}")
    if not any(shape.layer_is_swa[:run_layers]):
        first = f"; its first SWA layer is layer {shape.swa_layer_ids[0]}" if shape.swa_layer_ids else ""
        raise ConfigError(f"the first {run_layers} layer(s) of {shape.name} hold no SWA layer: nothing hybrid to "
                          f"benchmark{first}")
    return ModelGeometry(layer_is_swa=shape.layer_is_swa[:run_layers], window=shape.window,
                         num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                         v_head_dim=shape.v_head_dim, swa_num_heads=shape.swa_num_heads,
                         swa_num_kv_heads=shape.swa_num_kv_heads, swa_head_dim=shape.swa_head_dim,
                         swa_v_head_dim=shape.swa_v_head_dim, logit_cap=shape.logit_cap, sinks=shape.sinks,
                         swa_sinks=shape.swa_sinks, scaling=shape.scaling)


def _harness(target: Target, g: ModelGeometry, w: Workload, bs: int, n_configs: int) -> Harness:
    """A Harness whose pools hold this workload: every token in the full pool, the window in the SWA pool."""
    p, lens = w.page_size, w.prompt_lens(bs)
    decode = (w.warmup + w.steps) * n_configs  # the configurations take turns decoding the same requests
    size = sum(round_up(n + decode, p) + p for n in lens)
    size_swa = size
    if g.swa_layer_ids:
        size_swa = min(size, bs * (swa_tokens_per_request(g.window, p) + 2 * p) + round_up(w.chunk, p) + p)
    return Harness(target.backend_cls, target.torch_device, g, size=size, size_swa=size_swa, page_size=p,
                   dtype=DTYPES[w.dtype], max_reqs=bs + 1, max_context_len=round_up(max(lens) + decode, p),
                   seed=w.seed, device_inputs=True, shadow=w.check_every > 0,
                   shadow_requests=w.check_requests or None, check_queries=w.check_queries or None)


@dataclass
class _Arm:
    """One configuration's backend (and graph runner) over the shared harness, and what it measured."""

    config: BenchConfig
    backend: Any
    runner: Any
    step_graph: Any = None
    phases: Dict[str, List[float]] = field(default_factory=lambda: {p: [] for p in PHASES})  # seconds per step
    translations: int = 0
    forwards: int = 0    # every forward it ran (its reference sampling counts these)
    checked: int = 0
    max_err: float = 0.0

    def due(self, every: int, last: bool = False) -> bool:
        hit = every > 0 and (self.forwards % every == 0 or last)
        self.forwards += 1
        return hit


def _arms(h: Harness, target: Target, configs: Sequence[BenchConfig], counter: TranslationCounter,
          bs: int) -> List[_Arm]:
    """Build each configuration's backend over `h`'s pool; graph ones capture their bucket now."""
    torch.compiler.reset()  # earlier batch sizes' traces are dead (torch.compile-based adapters)
    arms = []
    for c in configs:
        h.runner = h.step_graph = None
        h.backend = h.build_backend(per_layer_backend(target.backend_cls) if c.per_layer else target.backend_cls)
        if c.whole_step:
            h.enable_step_graph([bs], CountingAdapter(target.adapter_factory(), counter))
        elif c.graph:
            h.enable_graphs([bs], CountingAdapter(target.adapter_factory(), counter))
        arms.append(_Arm(c, h.backend, h.runner, h.step_graph))
    return arms


def _use(h: Harness, arm: _Arm) -> None:
    h.backend, h.runner, h.step_graph = arm.backend, arm.runner, arm.step_graph


def _check(h: Harness, arm: _Arm, rids: Sequence[int], lens: Sequence[int], inputs: Dict[str, Any],
           flat: torch.Tensor, check: bool, where: str) -> None:
    """Shadow the forward's K/V and, when due, compare its outputs with the reference (never timed)."""
    outs = h.complete(rids, lens, inputs, flat, check=False)
    if check and h.checks_any(rids):
        try:
            arm.max_err = max(arm.max_err, h.check_outputs(rids, lens, inputs, outs))
        except ReferenceMismatchError as e:
            raise ReferenceMismatchError(f"{arm.config.name}, batch size {len(h.requests)}, {where}: {e}") from e
        arm.checked += 1


def _prefill(h: Harness, arms: Sequence[_Arm], rids: Sequence[int], w: Workload) -> None:
    """Chunked prefill (up to `chunk` new tokens per forward, requests in order), configurations in turn."""
    remaining = dict(zip(rids, w.prompt_lens(len(rids))))
    i = 0
    while any(remaining.values()):
        budget, live, new = w.chunk, [], []
        for rid in rids:
            if remaining[rid] and budget:
                live.append(rid)
                new.append(min(remaining[rid], budget))
                budget -= new[-1]
        arm = arms[i % len(arms)]
        _use(h, arm)
        batch, inputs = h.prepare(live, new, ForwardMode.EXTEND)
        flat = h.step(batch, inputs)
        _check(h, arm, live, new, inputs, flat, arm.due(w.check_every), f"prefill forward {i}")
        h.release(batch)
        for rid, n in zip(live, new):
            remaining[rid] -= n
        i += 1


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cpu":
        return lambda: None
    return getattr(torch, device.type).synchronize


def _timed(sync: Callable[[], None], fn: Callable[..., Any], *args: Any) -> Tuple[Any, float]:
    """fn(*args) and its seconds, the device synchronized before and after."""
    sync()
    t0 = time.perf_counter()
    out = fn(*args)
    sync()
    return out, time.perf_counter() - t0


def _decode(h: Harness, arms: Sequence[_Arm], rids: Sequence[int], w: Workload, counter: TranslationCounter,
            tick: Callable[[], None]) -> None:
    """Warm-up + timed decode steps, the configurations taking turns every step (same load, same drift).

    A step: the scheduler's lengths and the inputs (untimed), allocation, metadata, forward, the
    reference check (untimed), release; allocation and release form one phase."""
    sync, ones, n = _synchronizer(h.device), [1] * len(rids), w.warmup + w.steps
    for s in range(n):
        for arm in arms:
            _use(h, arm)
            if arm.step_graph is not None:  # one call: the host's copy and the replay of the whole step
                inputs = h.random_inputs(len(rids), arm.step_graph.inputs)
                calls = counter.calls
                h.check_live(rids)   # untimed, as the eager steps' checks
                flat, t_step = _timed(sync, h.step_graph_decode, rids, None, False)  # the inputs are in its buffers
                translations = counter.calls - calls
                _check(h, arm, rids, ones, inputs, flat, arm.due(w.check_every, last=s == n - 1), f"decode step {s}")
                if s >= w.warmup:
                    for phase, t in zip(PHASES, (0.0, 0.0, t_step)):
                        arm.phases[phase].append(t)
                    arm.translations += translations
                tick()
                continue
            lens = h.step_lens(rids, ones, ForwardMode.DECODE)
            batch, t_alloc = _timed(sync, h.allocate, lens)
            # graph arms: the inputs land in the runner's static buffers, as an engine's layers write them
            inputs = h.random_inputs(batch.num_tokens, h.runner.inputs if h.runner is not None else None)
            calls = counter.calls
            prepared, t_meta = _timed(sync, h.init_metadata, batch, inputs)
            flat, t_fwd = _timed(sync, h.run_layers, batch, inputs, prepared)
            translations = counter.calls - calls
            _check(h, arm, rids, ones, inputs, flat, arm.due(w.check_every, last=s == n - 1), f"decode step {s}")
            _, t_release = _timed(sync, h.release, batch)
            if s >= w.warmup:
                for phase, t in zip(PHASES, (t_alloc + t_release, t_meta, t_fwd)):
                    arm.phases[phase].append(t)
                arm.translations += translations
            tick()


def memory_row(h: Harness, shape: ModelShape, bs: int) -> MemoryRow:
    """Slots in use now, priced at the whole model's bytes per token (hybrid vs all-full)."""
    a = h.allocator
    full = a.size - (a.full_available_size() if h.hybrid else a.available_size())
    swa = a.size_swa - a.swa_available_size() if h.hybrid else 0
    all_full = full * shape.bytes_per_token_all_full
    hybrid = full * shape.bytes_per_token_full_group + swa * shape.bytes_per_token_swa_group if h.hybrid else all_full
    live = sum(r.seq_len for r in h.requests.values())
    return MemoryRow(bs, live, full, swa, hybrid, all_full, all_full / hybrid if hybrid else 1.0)


def _row(arm: _Arm, bs: int) -> Row:
    steps = [sum(ts) for ts in zip(*arm.phases.values())]
    total = Spread.of(steps)
    return Row(arm.config.name, bs, len(steps), total.median_ms, total.p10_ms, total.p90_ms,
               bs / (total.median_ms / 1e3), arm.translations / len(steps), arm.checked,
               arm.max_err if arm.checked else None, total.mean_ms,
               {p: Spread.of(ts) for p, ts in arm.phases.items()})


def run_batch_size(target: Target, configs: Sequence[BenchConfig], shape: ModelShape, g: ModelGeometry,
                   w: Workload, bs: int, tick: Callable[[], None] = lambda: None) -> Tuple[List[Row], MemoryRow]:
    """Every configuration at one batch size over one shared pool; raises ReferenceMismatchError loudly."""
    h = _harness(target, g, w, bs, len(configs))
    counter = TranslationCounter(h.pool)
    arms = _arms(h, target, configs, counter, bs)
    mem = None
    for _ in range(w.repeats):
        rids = [h.add_request() for _ in range(bs)]
        _prefill(h, arms, rids, w)
        _decode(h, arms, rids, w, counter, tick)
        mem = memory_row(h, shape, bs)
        for rid in rids:
            h.finish(rid)
        h.check_integrity()
    return [_row(a, bs) for a in arms], mem


def run_benchmark(target: Target, shape: ModelShape, configs: Sequence[str], w: Workload,
                  run_layers: Optional[int] = None, tick: Callable[[str], None] = lambda label: None) -> BenchResult:
    """Every configuration at every batch size (rows grouped by configuration)."""
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        raise ConfigError(f"unknown or no configuration(s) {unknown}; known: {', '.join(CONFIGS)}")
    if any(CONFIGS[c].graph for c in configs) and target.adapter_factory is None:
        raise ConfigError(f"device {target.name!r} has no graph adapter: drop the graph configurations")
    layers = run_layers or default_run_layers(shape, target.torch_device)
    shape = shape_in(shape, w.dtype)
    res = BenchResult(target.name, target.backend_cls.__name__, target.torch_device, shape, layers, w, list(configs),
                      threads=torch.get_num_threads())
    g, t0, rows = geometry(shape, layers), time.perf_counter(), []
    for bs in w.batch_sizes:
        got, mem = run_batch_size(target, [CONFIGS[c] for c in configs], shape, g, w, bs,
                                  lambda b=bs: tick(f"batch size {b}"))
        rows += got
        res.memory.append(mem)
    res.rows = sorted(rows, key=lambda r: (list(configs).index(r.config), w.batch_sizes.index(r.batch_size)))
    res.wall_s = time.perf_counter() - t0
    return res
