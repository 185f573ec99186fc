"""`hwkv bench --workload chat`: multi-turn conversations sharing a system prompt, served by the engine with its
prefix cache in a fixed KV memory budget; the hybrid pools against one all-full pool of the same bytes.

Every conversation starts with the same system prompt; each turn appends user tokens to the conversation so far
and generates a reply (greedy) through `hwkv.engine.engine.Engine`, the one step loop: admission from the longest
cached prefix, chunked prefill beside the decoding turns, out-of-window release, caching on finish, eviction under
memory pressure. A turn arrives when the previous one of its conversation has finished and no other turn is
waiting or prefilling, so it is matched against everything cached before it (a server matching at prefill start).

The model is `hwkv.engine.synthetic.SyntheticModel`: the model's attention shapes (its first `run_layers` layers),
K/V a fixed function of the tokens, stored and attended by the device's backend in every layer. Every
`check_every`-th forward a few requests' last queries are recomputed densely by `hwkv.reference` from their token
ids (`ReferenceCheck`); a mismatch raises ReferenceMismatchError.

Pools are sized in tokens for the whole model in `memory` bytes of the dtype run (what the hit rate depends on), and
allocated for the layers run. Hybrid: the SWA pool holds each running turn's window and cache lock window, one chunk
and one cached window per conversation; the full pool the rest. All-full: every layer keeps every token, as one pool
of the same bytes would; on the engine that is a full and an SWA pool of equal sizes whose pages are paired and
never released (the engine's window is the whole context), so the prefix cache serves it the same way.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import torch

from hwkv.engine.dtypes import DTYPES, shape_in
from hwkv.bench.spread import percentile
from hwkv.checks import is_int
from hwkv.engine.engine import Engine
from hwkv.engine.plan import cache_lock_tokens, round_up, swa_tokens_per_request
from hwkv.engine.pools import Cache, PoolPlan, build_cache
from hwkv.engine.presets import ModelShape
from hwkv.engine.sampling import SamplingParams
from hwkv.engine.stats import RunnerStats
from hwkv.engine.synthetic import ReferenceCheck, SyntheticModel, engine_history
from hwkv.errors import ConfigError, OutOfSlotsError

VOCAB = 1024  # token ids of the conversations and the synthetic model's vocabulary
# the phases of a step, in the order they run; each call is timed exclusively (a phase nested in another counts
# once, in the inner one); "other" is the step's time outside every phase
PHASES: Dict[str, str] = {
    "admit": "admission: the scheduler, the prefix match, lock and acquire of each admitted turn",
    "allocate": "the allocator's one call for the forward's slots (alloc_extend / alloc_decode)",
    "metadata": "backend.init_forward_metadata: the write locs' translation and the index lists",
    "attention": "every layer's K/V write and attention (backend.forward)",
    "model": "the synthetic model outside attention: Q/K/V from its tables, the readout and logits",
    "release": "the out-of-window release of the batch",
    "prefix_cache": "caching prompt chunks and finished turns, eviction",
    "check": "the reference check (hwkv.reference on the picked requests; not counted in tokens/s)",
    "other": "the rest of the step: scheduling, req_to_token writes, sampling, reading tokens back, finishing",
}


@dataclass(frozen=True)
class ChatWorkload:
    """Conversations x turns; each turn adds `user` tokens and generates `reply` tokens. `check_every` 0 checks
    nothing; `check_requests` / `check_queries` 0 check every request of a checked forward / all its queries;
    `run_layers` None runs every layer of the model."""

    conversations: int = 64
    turns: int = 4
    system: int = 2048
    user: int = 256
    reply: int = 128
    concurrency: int = 16
    memory: int = 2 * 2**30
    page_size: int = 16
    chunk: int = 512
    seed: int = 0
    dtype: str = "bf16"
    run_layers: Optional[int] = None
    check_every: int = 8
    check_requests: int = 2
    check_queries: int = 4

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "system", "user", "reply", "concurrency", "memory", "page_size",
                     "chunk"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ConfigError(f"chat workload: {name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("check_requests", "check_queries"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise ConfigError(f"chat workload: {name} must be an integer >= 0 (0 = all), got "
                                  f"{getattr(self, name)!r}")
        if not is_int(self.check_every) or self.check_every < 0:
            raise ConfigError(f"chat workload: check_every must be an integer >= 0 (0 = never), got "
                              f"{self.check_every!r}")
        if self.run_layers is not None and (not is_int(self.run_layers) or self.run_layers < 1):
            raise ConfigError(f"chat workload: run_layers must be an integer >= 1, got {self.run_layers!r}")
        if not is_int(self.seed) or not 0 <= self.seed < 2**63:
            raise ConfigError(f"chat workload: seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"chat workload: dtype must be one of {', '.join(sorted(DTYPES))}, got {self.dtype!r}")

    @property
    def context(self) -> int:
        """Tokens of a conversation's last turn."""
        return self.system + self.turns * (self.user + self.reply)


# `hwkv bench --workload chat` on the CPU: sizes that run in seconds on 2 cores (4 layers), still memory bound
# for the all-full pool; accelerators take ChatWorkload's defaults
CPU_WORKLOAD = dict(conversations=8, turns=3, system=512, user=64, reply=16, concurrency=4, memory=200 * 2**20,
                    chunk=256, dtype="fp32")


@dataclass
class ChatRow:
    """One variant's run: pools, what was prefilled and reused, evictions, throughput, a step's phases."""

    variant: str
    full_pool_tokens: int
    swa_pool_tokens: int
    pool_bytes: int               # the model's pools in the budget (every layer)
    allocated_bytes: int          # the pools of the layers run
    max_running: int
    turns_done: int
    prompt_tokens: int
    reused_tokens: int
    prefill_tokens: int
    hit_rate: float
    evicted_full_tokens: int
    evicted_swa_tokens: int
    forwards: int
    generated_tokens: int
    tokens_per_s: float           # generated tokens per second of steps, the reference check's time left out
    prefill_tokens_per_s: float   # prompt tokens computed per second of the same
    step_ms_median: float
    phase_ms: Dict[str, float]    # mean milliseconds per step of each phase (they add up to the mean step)
    checked_forwards: int
    checked_requests: int
    max_err: float
    wall_s: float


@dataclass
class ChatResult:
    model: str
    device: str
    workload: ChatWorkload
    layers: int
    rows: List[ChatRow] = field(default_factory=list)
    warm_up: Dict[str, Any] = field(default_factory=dict)  # the untimed pass before the variants (see run_chat)

    def to_dict(self) -> Dict[str, Any]:
        return {"schema": "hwkv-bench-chat/2", "model": self.model, "device": self.device, "layers_run": self.layers,
                "workload": asdict(self.workload), "phases": dict(PHASES), "warm_up": dict(self.warm_up),
                "rows": [asdict(r) for r in self.rows]}


# ---- pools ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Sizes:
    """One variant's pools in tokens and the model's bytes for them."""

    variant: str
    size: int
    size_swa: int   # the SWA pool's slots (the all-full variant's mirror: as many as the full pool)
    pool_bytes: int
    mirrored: bool  # all-full: the SWA pool mirrors the full pool, nothing is released


def _check_hybrid(shape: ModelShape) -> None:
    """The chat workload compares a hybrid model with its all-full twin: it needs both kinds of layer."""
    if not shape.swa_layer_ids:
        raise ConfigError(f"{shape.name} has no SWA layers: the chat workload compares hybrid with all-full")
    if not shape.full_layer_ids:
        raise ConfigError(f"{shape.name} has no full-attention layers: the chat workload compares hybrid with all-full "
                          "(the full pool holds the locs)")


def chat_sizes(shape: ModelShape, w: ChatWorkload) -> Tuple[_Sizes, _Sizes]:
    """(hybrid, all-full) pools of `shape` (the whole model) in `w.memory` bytes, priced in `w.dtype` (the bytes
    the pools allocate, whatever `shape.dtype_bytes` says). Hybrid: the SWA pool holds each running turn's own
    window and cache lock window, one cached window per conversation and one prefill chunk; the full pool the
    rest. All-full: every layer in one pool of the same bytes (`hwkv.engine.plan`'s rounding and padding page).
    ConfigError when the budget leaves the full pool nothing, or the model lacks either kind of layer."""
    _check_hybrid(shape)
    shape = shape_in(shape, w.dtype)
    p = w.page_size
    own = swa_tokens_per_request(shape.window, p)
    lock = cache_lock_tokens(shape.window, p, w.context)
    size_swa = w.concurrency * (own + lock) + w.conversations * own + round_up(w.chunk, p)
    swa_bytes = (size_swa + p) * shape.bytes_per_token_swa_group
    size = ((w.memory - swa_bytes) // shape.bytes_per_token_full_group - p) // p * p
    if size < p:
        raise ConfigError(f"chat workload: {w.memory} bytes leave no full pool beside an SWA pool of {size_swa} "
                          f"tokens ({swa_bytes} bytes in {w.dtype}): raise --memory or lower --concurrency / "
                          "--conversations")
    hybrid = _Sizes("hybrid", size, size_swa, (size + p) * shape.bytes_per_token_full_group + swa_bytes, False)
    all_b = shape.bytes_per_token_all_full
    all_size = max(0, (w.memory // all_b - p) // p * p)
    return hybrid, _Sizes("all-full", all_size, all_size, (all_size + p) * all_b, True)


def _check_fits(s: _Sizes, shape: ModelShape, w: ChatWorkload) -> None:
    """OutOfSlotsError when the longest turn cannot fit the variant's pools on their own (said before any run)."""
    p = w.page_size
    turn = f"a turn of {w.context} tokens (system {w.system} + {w.turns} x (user {w.user} + reply {w.reply}))"
    full = round_up(w.context, p)
    if s.mirrored:
        if full > s.size:
            raise OutOfSlotsError(f"chat workload ({s.variant}): {turn} needs {full} slots; the pool has {s.size} "
                                  f"for {w.memory} bytes: raise --memory or shorten the conversations")
        return
    own = swa_tokens_per_request(shape.window, p, context=w.context)
    lock = cache_lock_tokens(shape.window, p, w.context - w.reply)
    swa, chunk = own + lock, round_up(w.chunk, p)
    if full > s.size or swa + chunk > s.size_swa:
        raise OutOfSlotsError(f"chat workload ({s.variant}): {turn} needs {full} full-pool slots and {swa} SWA slots "
                              f"beside a prefill chunk of {chunk}; the pools have {s.size} full / {s.size_swa} SWA: "
                              "raise --memory or shorten the conversations")


def _build(s: _Sizes, run: ModelShape, w: ChatWorkload, device: torch.device, backend_device: Any) -> Cache:
    """The variant's pools for the layers run (`run`), allocator, request rows and backend. The all-full variant's
    SWA pool pairs a page with every full page and nothing is released, so the plan the engine schedules by
    reserves nothing for it (`size_swa` 0: the scheduler's SWA bound would count each turn's pages twice); the
    slots held are counted from the allocator's own pool sizes (`Cache.held_slots`)."""
    p, context = w.page_size, round_up(w.context, w.page_size)
    plan = PoolPlan(s.size, 0 if s.mirrored else s.size_swa, p, context, w.concurrency, w.chunk,
                    run.bytes_per_token_full_group, run.bytes_per_token_swa_group, w.memory)
    cache = build_cache(run, replace(plan, size_swa=s.size_swa), DTYPES[w.dtype], device,
                        backend_device=backend_device)
    return replace(cache, plan=plan) if s.mirrored else cache


# ---- phases -------------------------------------------------------------------------------------------------
class _Clock:
    """Exclusive time per phase: methods of the engine's objects wrapped on their instances (the device is
    synchronized around each call on accelerators, so a phase holds its own device work)."""

    def __init__(self, device: torch.device) -> None:
        self.seconds: Dict[str, float] = {name: 0.0 for name in PHASES}
        self.counts: Dict[str, int] = {}
        self._stack: List[float] = []  # time spent in nested phases, per open call
        mod = getattr(torch, device.type, None) if device.type != "cpu" else None
        self._sync: Callable[[], None] = mod.synchronize if mod is not None else (lambda: None)

    def wrap(self, obj: Any, method: str, phase: str, count: Optional[str] = None) -> None:
        """Time `obj.method` as `phase`; with `count`, add up the ints it returns under that name."""
        inner = getattr(obj, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._sync()
            t0 = time.perf_counter()
            self._stack.append(0.0)
            try:
                out = inner(*args, **kwargs)
                self._sync()
            finally:
                spent = time.perf_counter() - t0
                nested = self._stack.pop()
                self.seconds[phase] += spent - nested
                if self._stack:
                    self._stack[-1] += spent
            if count is not None:
                self.counts[count] = self.counts.get(count, 0) + int(out)
            return out

        setattr(obj, method, timed)


def _instrument(engine: Engine, model: SyntheticModel, clock: _Clock) -> None:
    c = engine.cache
    clock.wrap(engine.scheduler, "admit", "admit")
    for name in ("alloc_extend", "alloc_decode"):
        clock.wrap(c.allocator, name, "allocate")
    clock.wrap(c.backend, "init_forward_metadata", "metadata")
    clock.wrap(c.backend, "forward", "attention")
    clock.wrap(engine, "model_step", "model")
    clock.wrap(engine.slots, "release", "release")
    if engine.prefix is not None:
        for name in ("insert", "cache_running", "release_requests"):
            clock.wrap(engine.prefix, name, "prefix_cache")
        clock.wrap(engine.prefix, "evict", "prefix_cache", count="evicted_full")
        clock.wrap(engine.prefix, "evict_swa", "prefix_cache", count="evicted_swa")
    if model.check is not None:
        clock.wrap(model.check, "pick", "check")
        clock.wrap(model.check, "run", "check")


# ---- one variant ----------------------------------------------------------------------------------------------
def run_variant(s: _Sizes, shape: ModelShape, w: ChatWorkload, device: str = "cpu", backend_device: Any = None,
                on_step: Optional[Callable[[Engine], None]] = None) -> ChatRow:
    """Every conversation through one engine over the variant's pools; `on_step(engine)` after every step."""
    run = run_shape(shape, w)
    dev = torch.device(device)
    cache = _build(s, run, w, dev, backend_device if backend_device is not None else dev.type)
    model = SyntheticModel(run, cache.backend, vocab_size=VOCAB, dtype=DTYPES[w.dtype], device=dev,
                           positions=cache.rtt.max_context_len, seed=w.seed)
    window = w.context if s.mirrored else shape.window  # mirrored: nothing is ever out of the engine's window
    engine = Engine(cache, model, stats=RunnerStats(run, cache.plan), vocab_size=VOCAB, window=window,
                    prefix_cache=True)
    _warm_up(engine, model, w)
    if w.check_every:
        # 0 = all: no batch holds more requests than conversations, no request more new tokens than its context
        model.check = ReferenceCheck(model, engine_history(engine), every=w.check_every,
                                     requests=w.check_requests or w.conversations,
                                     queries=w.check_queries or w.context)
    clock = _Clock(dev)
    _instrument(engine, model, clock)
    step_s: List[float] = []
    done = _converse(engine, w, step_s, on_step)
    engine.check_integrity()
    st = engine.stats
    total = sum(step_s)
    clock.seconds["other"] = max(0.0, total - sum(clock.seconds.values()))
    busy = max(total - clock.seconds["check"], 1e-9)
    n = max(len(step_s), 1)
    check = model.check
    p = w.page_size
    return ChatRow(
        s.variant, s.size, 0 if s.mirrored else s.size_swa, s.pool_bytes,
        (s.size + p) * run.bytes_per_token_full_group + (s.size_swa + p) * run.bytes_per_token_swa_group,
        w.concurrency, done, st.prompt_tokens, st.reused_tokens, st.prefill_tokens,
        st.reused_tokens / st.prompt_tokens if st.prompt_tokens else 0.0,
        clock.counts.get("evicted_full", 0), clock.counts.get("evicted_swa", 0), len(step_s), st.generated_tokens,
        round(st.generated_tokens / busy, 1), round(st.prefill_tokens / busy, 1),
        round(percentile(step_s, 0.5) * 1e3, 3) if step_s else 0.0,
        {k: round(v / n * 1e3, 3) for k, v in clock.seconds.items()},
        check.forwards_checked if check else 0, check.requests_checked if check else 0,
        check.max_err if check else 0.0, round(total, 3))


def _warm_up(engine: Engine, model: SyntheticModel, w: ChatWorkload) -> None:
    """One short request (a prefill of a few pages, two decode steps) before the run: lazy imports and kernel
    compilation stay out of its times. Its KV leaves the cache and the counters start again."""
    n = min(w.context - 2, 3 * w.page_size + 1)
    engine.generate([[VOCAB - 1 - i % 7 for i in range(n)]], SamplingParams(max_new_tokens=2))
    engine.clear_prefix_cache()
    engine.check_integrity()
    held = engine.cache.held_slots()
    if held != (0, 0):
        raise OutOfSlotsError(f"chat workload: the warm-up request left {held} (full, SWA) slots held")
    engine.stats = RunnerStats(engine.stats.shape, engine.stats.plan)
    model.forwards = 0


def run_shape(shape: ModelShape, w: ChatWorkload) -> ModelShape:
    """The layers run: the first `w.run_layers` of `shape` (all by default), in the workload's dtype."""
    n = shape.num_layers if w.run_layers is None else w.run_layers
    if n > shape.num_layers:
        raise ConfigError(f"chat workload: run_layers must be in [1, {shape.num_layers}] for {shape.name}, got {n}")
    return shape_in(shape, w.dtype, layers=n)


def _user_tokens(w: ChatWorkload, conv: int, turn: int) -> List[int]:
    # wrapped into the 64 bits manual_seed takes (a seed near 2**63 would overflow it)
    gen = torch.Generator(device="cpu").manual_seed((w.seed * 1_000_003 + conv * 101 + turn) % 2**64)
    return torch.randint(0, VOCAB, (w.user,), generator=gen, device="cpu").tolist()


def _converse(engine: Engine, w: ChatWorkload, step_s: List[float],
              on_step: Optional[Callable[[Engine], None]]) -> int:
    """Run every conversation's turns; returns the turns finished. A turn is added when none waits or prefills."""
    gen = torch.Generator(device="cpu").manual_seed(w.seed)
    system = torch.randint(0, VOCAB, (w.system,), generator=gen, device="cpu").tolist()
    history = {c: list(system) for c in range(w.conversations)}
    turn_no = {c: 0 for c in range(w.conversations)}
    ready: Deque[int] = deque(range(w.conversations))
    conv_of: Dict[int, int] = {}
    params = SamplingParams(max_new_tokens=w.reply)
    sched, done = engine.scheduler, 0
    while ready or engine.has_work():
        if ready and not sched.waiting and len(sched.running) < w.concurrency and \
                not any(r.prefilling for r in sched.running):
            c = ready.popleft()
            conv_of[engine.add_request(history[c] + _user_tokens(w, c, turn_no[c]), params)] = c
        t0 = time.perf_counter()
        finished = engine.step()
        step_s.append(time.perf_counter() - t0)
        for res in finished:
            if res.error is not None:
                raise res.error
            c = conv_of.pop(res.rid)
            history[c] = res.prompt + res.tokens
            turn_no[c] += 1
            done += 1
            if turn_no[c] < w.turns:
                ready.append(c)
        if on_step is not None:
            on_step(engine)
    return done


def run_chat(shape: ModelShape, w: ChatWorkload, device: str = "cpu", backend_device: Any = None) -> ChatResult:
    """Both variants over the same conversations (same token ids, same order), after one untimed pass of the first
    variant over a few of them; both variants' pools are checked for the longest turn before anything runs."""
    _check_hybrid(shape)
    run = run_shape(shape, w)
    if not run.swa_layer_ids:
        raise ConfigError(f"chat workload: the first {run.num_layers} layer(s) of {shape.name} hold no SWA layer; "
                          f"its first is layer {shape.swa_layer_ids[0]}: run more layers")
    sizes = chat_sizes(shape, w)
    for s in sizes:
        _check_fits(s, shape, w)
    res = ChatResult(shape.name, device, w, run.num_layers)
    # an untimed pass first, so neither variant pays the kernels' compilation for the shapes a conversation makes
    # (prompt chunks, prefix hits, decode batches up to the concurrency): on the H200 the variant run first paid ~20
    # compiles, which read as a slower hybrid
    warm = replace(w, conversations=min(w.conversations, w.concurrency), turns=min(w.turns, 2), check_every=0)
    t0 = time.perf_counter()
    run_variant(sizes[0], shape, warm, device, backend_device)
    res.warm_up = {"variant": sizes[0].variant, "conversations": warm.conversations, "turns": warm.turns,
                   "wall_s": round(time.perf_counter() - t0, 3)}
    for s in sizes:
        res.rows.append(run_variant(s, shape, w, device, backend_device))
    return res
