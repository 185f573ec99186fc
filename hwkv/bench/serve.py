"""`hwkv bench --workload serve`: a seeded request trace through a transformers model, served by hwkv's
`HybridRunner` (continuous batching, prefix cache, overlapped loop) and by transformers' own continuous
batching on the same trace.

Requests arrive as a Poisson process (`rate` per second; 0: all at once; `check_trace_fits` refuses a trace
spanning more than a day, `MAX_TRACE_S`). Prompts draw their lengths uniformly from
[max(system_len + 1, prompt_len * (1 - spread)), prompt_len] (`ServeWorkload.prompt_range`); a `shared` share of
them starts with one common system prompt of `system_len` tokens; each generates `new_tokens` tokens (no stop
token). Reported per method: output tokens per second over the whole run, time to first token (arrival to the host
seeing the first token) and time per output token after it (p50 and p99, interpolated linearly between the closest
ranks as the decode workload's percentiles: `hwkv.bench.spread`), the prompt tokens reused from a prefix cache
(hwkv) and the wall time. transformers is imported only when this runs.
"""
from __future__ import annotations

import inspect
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from hwkv.bench.spread import percentile
from hwkv.checks import is_int
from hwkv.errors import ConfigError


MAX_TRACE_S = 86400.0  # the longest a trace's arrivals may span at its rate (requests / rate): a day
MAX_SLEEP_S = 1.0  # the longest one wait for the next arrival sleeps before the loop looks at the clock again


def wait(delay: float) -> None:
    """Sleep until about `delay` seconds from now, at most MAX_SLEEP_S (the caller's loop looks again); never
    raises, whatever the delay (time.sleep raises OverflowError past the platform's time_t)."""
    time.sleep(min(delay, MAX_SLEEP_S) if delay > 0 else 0.0)


@dataclass(frozen=True)
class ServeWorkload:
    """The trace's parameters (see module doc)."""

    requests: int = 32
    rate: float = 8.0
    prompt_len: int = 64
    spread: float = 0.5
    new_tokens: int = 32
    shared: float = 0.5
    system_len: int = 32
    max_running: int = 16
    chunk: int = 512
    page_size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("requests", "prompt_len", "new_tokens", "max_running", "chunk", "page_size"):
            if not is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ConfigError(f"serve workload: {name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not is_int(self.system_len) or not 0 <= self.system_len < self.prompt_len:
            raise ConfigError(f"serve workload: system_len must be in [0, prompt_len={self.prompt_len}), got "
                              f"{self.system_len!r}")
        for name, lo, hi in (("rate", 0.0, float("inf")), ("spread", 0.0, 1.0), ("shared", 0.0, 1.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                raise ConfigError(f"serve workload: {name} must be in [{lo}, {hi}], got {v!r}")
        if not is_int(self.seed) or not 0 <= self.seed < 2**63:
            raise ConfigError(f"serve workload: seed must be an integer in [0, 2**63), got {self.seed!r}")

    @property
    def context(self) -> int:
        return self.prompt_len + self.new_tokens

    @property
    def prompt_range(self) -> Tuple[int, int]:
        """The shortest and longest prompt `make_trace` draws: down to prompt_len * (1 - spread), and always longer
        than the system prompt (a request behind it has a token of its own)."""
        return max(self.system_len + 1, int(self.prompt_len * (1 - self.spread))), self.prompt_len


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    prompt: List[int]


TOKEN_ID_BYTES = 8  # the least a prompt token costs the trace on the host: its slot in a Python list


def check_trace_fits(w: ServeWorkload, free: Optional[int] = None) -> None:
    """ConfigError when the trace's prompts cannot fit in the host's free memory (`free`, default MemAvailable):
    drawing them would take minutes before any check ran; or when its arrivals would span more than MAX_TRACE_S
    at its rate (requests / rate: a tiny rate would wait for decades, or past what time.sleep takes)."""
    from hwkv.engine.plan import format_bytes
    from hwkv.pool import device_free_bytes

    free = device_free_bytes("cpu") if free is None else free
    tokens = w.requests * w.prompt_len + w.system_len
    if free is not None and tokens * TOKEN_ID_BYTES > free:
        raise ConfigError(f"serve workload: {w.requests:,} requests of up to {w.prompt_len:,} tokens are up to "
                          f"{tokens:,} prompt tokens, at least {format_bytes(tokens * TOKEN_ID_BYTES)} on the host, "
                          f"which has {format_bytes(free)} free; give fewer requests or shorter prompts")
    if w.rate > 0 and w.requests / w.rate > MAX_TRACE_S:  # a subnormal rate's span is inf
        raise ConfigError(f"serve workload: rate={w.rate!r} arrivals per second (--serve-rate) spreads {w.requests:,} "
                          f"requests over about {w.requests / w.rate:.3g} s, past the {MAX_TRACE_S:,.0f} s (a day) "
                          f"a trace may span: give at least {w.requests / MAX_TRACE_S:.3g} per second, or 0 for all "
                          "at once")


def check_pools_fit(model: Any, w: ServeWorkload) -> None:
    """ConfigError (hwkv.engine.pools.plan_pools') when hwkv's pools cannot hold one request of the workload's
    context on the model's device, before the trace is drawn."""
    from hwkv.engine.pools import plan_pools
    from hwkv.integrations.hf_model import model_shape

    shape = model_shape(model.config, model.dtype)
    plan_pools(shape, context=w.context, max_running=w.max_running, chunk=w.chunk, page_size=w.page_size,
               memory=None, device=next(model.parameters()).device, prefix_cache=bool(shape.swa_layer_ids))


def make_trace(w: ServeWorkload, vocab: int) -> List[TraceRequest]:
    """The seeded trace: arrival times, prompts (a `shared` share behind the common system prompt)."""
    rng = random.Random(w.seed)
    system = [rng.randrange(1, vocab) for _ in range(w.system_len)]
    t, out = 0.0, []
    for _ in range(w.requests):
        if w.rate > 0:
            t += rng.expovariate(w.rate)
        n = rng.randint(*w.prompt_range)
        head = system if rng.random() < w.shared else []
        out.append(TraceRequest(t, head + [rng.randrange(1, vocab) for _ in range(n - len(head))]))
    return out


@dataclass
class ServeRow:
    """One method over the trace."""

    method: str
    requests: int
    output_tokens: int = 0
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    ttft_p50_ms: Optional[float] = None
    ttft_p99_ms: Optional[float] = None
    tpot_p50_ms: Optional[float] = None
    tpot_p99_ms: Optional[float] = None
    # prompt tokens prefilled / reused from the prefix cache: hwkv's own counts; None where a method does not count
    # them (transformers' row)
    prompt_tokens: Optional[int] = 0
    reused_tokens: Optional[int] = 0
    error: Optional[str] = None


@dataclass
class ServeResult:
    model: str
    device: str
    workload: ServeWorkload
    rows: List[ServeRow] = field(default_factory=list)
    # what a reader needs to read the rows (a value that is null, and why)
    notes: List[str] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        """The result as JSON values: a rate of inf (every arrival at once, as 0) is written 0, since JSON has no
        Infinity."""
        workload = asdict(self.workload)
        if workload["rate"] == float("inf"):
            workload["rate"] = 0.0
        return {"schema": "hwkv-bench-serve/1", "model": self.model, "device": self.device,
                "workload": workload, "rows": [asdict(r) for r in self.rows],
                "notes": list(self.notes)}


def _pct(xs: List[float], q: float) -> Optional[float]:
    """The q-quantile of `xs` seconds in milliseconds, as the decode workload's p10/p50/p90
    (`hwkv.bench.spread.percentile`: linear between the closest ranks); None without values."""
    return round(percentile(xs, q) * 1e3, 3) if xs else None


def _row(method: str, w: ServeWorkload, times: List[Tuple[float, float, float, int]], wall: float) -> ServeRow:
    """times: per request (arrival, first token, finish, output tokens), seconds from the run's start."""
    ttft = [f - a for a, f, _, _ in times]
    tpot = [(e - f) / (n - 1) for _, f, e, n in times if n > 1]
    tokens = sum(n for *_, n in times)
    return ServeRow(method, len(times), tokens, round(wall, 3), round(tokens / wall, 1) if wall else 0.0,
                    _pct(ttft, 0.5), _pct(ttft, 0.99), _pct(tpot, 0.5), _pct(tpot, 0.99))


def _warm_up(trace: List[TraceRequest], w: ServeWorkload) -> List[TraceRequest]:
    """The untimed requests both methods run first: the trace's first max_running, then two of them again."""
    return trace[:w.max_running] + trace[:2]


def serve_hwkv(model: Any, trace: List[TraceRequest], w: ServeWorkload, prefix_cache: bool = True,
               memory: Any = None, **runner_options: Any) -> ServeRow:
    """The trace through one HybridRunner (`runner_options`: more of its keywords, e.g. whole_step): requests
    join at their arrival, one `step()` at a time."""
    from hwkv.engine.sampling import SamplingParams
    from hwkv.integrations.transformers import HybridRunner

    name = "hwkv" if prefix_cache else "hwkv (no prefix cache)"
    params = SamplingParams(max_new_tokens=w.new_tokens)
    with HybridRunner(model, max_running=w.max_running, context=w.context, chunk=w.chunk, page_size=w.page_size,
                      memory=memory, prefix_cache=prefix_cache, **runner_options) as runner:
        # untimed: the trace's first max_running prompts at once, then two of them again (from the cache), so
        # every kernel the trace runs (chunked and cached prefill, mixed and graph decode at full batch) is
        # compiled and the device allocator holds the trace's largest activations before the clock starts
        warm = [r.prompt for r in _warm_up(trace, w)]
        for res in runner.generate(warm, SamplingParams(max_new_tokens=min(4, w.new_tokens))):
            if res.error is not None:
                raise res.error
        runner.clear_prefix_cache()
        base = (runner.stats.prompt_tokens, runner.stats.reused_tokens)
        arrival: Dict[int, float] = {}
        first: Dict[int, float] = {}
        done: List[Tuple[float, float, float, int]] = []
        i, t0 = 0, time.perf_counter()
        while i < len(trace) or runner.has_work():
            now = time.perf_counter() - t0
            while i < len(trace) and trace[i].arrival_s <= now:
                arrival[runner.add_request(trace[i].prompt, params)] = trace[i].arrival_s
                i += 1
            if not runner.has_work():
                wait(trace[i].arrival_s - now)
                continue
            finished = runner.step()
            now = time.perf_counter() - t0
            for rid, req in runner.requests.items():
                if rid not in first and req.output:
                    first[rid] = now
            for res in finished:
                if res.error is not None:
                    raise res.error
                first.setdefault(res.rid, now)
                done.append((arrival[res.rid], first[res.rid], now, len(res.tokens)))
        row = _row(name, w, done, time.perf_counter() - t0)
        row.prompt_tokens = runner.stats.prompt_tokens - base[0]
        row.reused_tokens = runner.stats.reused_tokens - base[1]
    return row


RESULT_STALL_S = 600.0  # transformers' baseline fails when no result arrives for this long


def collect_results(manager: Any, ids: List[str], what: str) -> Dict[str, Any]:
    """The result of each of `ids` from transformers' continuous batching manager, in the order they finish.

    Results are taken from the head of its output queue (`get_result()` without an id): with an id,
    transformers (5.25) puts another request's result back and returns None, which is "not this one yet",
    not a failure; None from an empty queue is "none finished yet". RuntimeError (`what`: how the ids are
    named) on a request's own error, the manager's fatal error, its loop ending with results missing, or
    no result for RESULT_STALL_S seconds.
    """
    want = set(ids)
    got: Dict[str, Any] = {}

    def missing() -> str:
        left = [i for i in ids if i not in got]
        return f"{len(left)} of {len(ids)} {what}s missing (first {left[0]})"

    last = time.monotonic()
    while len(got) < len(want):
        left = RESULT_STALL_S - (time.monotonic() - last)
        if left <= 0:
            raise RuntimeError(f"transformers gave no result for {RESULT_STALL_S:g} s: {missing()}")
        out = manager.get_result(timeout=min(left, 1.0))
        if out is None:
            fatal = getattr(getattr(manager, "background_thread_status", None), "fatal_error", None)
            if fatal is not None:
                raise RuntimeError(f"transformers' generation loop failed: {fatal!r}") from fatal
            if not manager.is_running():
                raise RuntimeError(f"transformers' generation loop stopped: {missing()}")
            continue
        if out.request_id not in want or out.request_id in got:
            raise RuntimeError(f"transformers returned an unexpected result for {out.request_id!r} (not awaited, "
                               f"or a second one) while {missing()}")
        if out.error:
            raise RuntimeError(f"{what} {out.request_id}: {out.error}")
        got[out.request_id] = out
        last = time.monotonic()
    return got


def continuous_batching_config(config_class: Any, page_size: int, **fields: Any) -> Any:
    """transformers' ContinuousBatchingConfig with pages of `page_size` tokens: 5.17 names the page `block_size`,
    later releases `page_size` (the serve and bench_transformers baselines both build one)."""
    size = "page_size" if "page_size" in inspect.signature(config_class).parameters else "block_size"
    return config_class(**{size: page_size}, **fields)


def serve_transformers(model: Any, trace: List[TraceRequest], w: ServeWorkload) -> ServeRow:
    """The trace through transformers' continuous batching manager (paged cache), requests added at their
    arrival, results collected as they finish (`collect_results`, the warm-up's too); token times from its
    own timestamps."""
    import transformers
    from transformers import GenerationConfig
    ContinuousBatchingConfig = getattr(transformers, "ContinuousBatchingConfig", None)
    if ContinuousBatchingConfig is None:   # the hwkv[transformers] floor (4.56) runs hwkv, not this baseline
        raise ImportError(f"this baseline needs transformers >= 5.5 (its ContinuousBatchingConfig; 5.3 has none), "
                          f"installed: {getattr(transformers, '__version__', 'unknown')}")

    cfg = GenerationConfig(max_new_tokens=w.new_tokens, min_new_tokens=w.new_tokens, do_sample=False,
                           eos_token_id=-1, pad_token_id=0)
    # its cache sized as hwkv's pools are, for max_running requests of the longest context (by default it takes
    # most of the free memory: 8 GiB of this machine's RAM for the tiny model)
    pages = -(-w.context // w.page_size) + 1
    cbc = continuous_batching_config(ContinuousBatchingConfig, w.page_size, num_blocks=w.max_running * pages,
                                     max_batch_tokens=max(w.chunk, w.prompt_len))
    manager = model.init_continuous_batching(generation_config=cfg, continuous_batching_config=cbc)
    manager.start()
    try:
        warm = _warm_up(trace, w)  # untimed, as hwkv's warm-up, and over before the clock starts
        for k, r in enumerate(warm):
            manager.add_request(r.prompt, request_id=f"warm-up-{k}", max_new_tokens=min(4, w.new_tokens))
        collect_results(manager, [f"warm-up-{k}" for k in range(len(warm))], "warm-up request")
        i, t0 = 0, time.perf_counter()
        while i < len(trace):
            now = time.perf_counter() - t0
            if trace[i].arrival_s > now:
                wait(trace[i].arrival_s - now)
                continue
            manager.add_request(trace[i].prompt, request_id=str(i), max_new_tokens=w.new_tokens,
                                record_timestamps=True)
            i += 1
        done = []
        results = collect_results(manager, [str(k) for k in range(len(trace))], "request")
        for k in range(len(trace)):
            out = results[str(k)]
            stamps = out.timestamps or [out.lifespan[1]]
            done.append((trace[k].arrival_s, stamps[0] - t0, stamps[-1] - t0, len(out.generated_tokens)))
        wall = max(e for _, _, e, _ in done)
    finally:
        manager.stop(block=True)
        model.destroy_cached_continuous_batching_manager()
    row = _row("transformers generate_batch (continuous batching)", w, done, wall)
    row.prompt_tokens = row.reused_tokens = None   # not counted there (null in --json, "-" in the table)
    return row


def random_gpt_oss(device: str, tiny: bool, layers: int = 4, experts: int = 32) -> Any:
    """A random-weight GPT-OSS causal LM: tiny, or GPT-OSS-20B's attention shapes with `layers` layers (half
    sliding, W=128) and `experts` experts per MoE layer; fp32 on the CPU, bf16 elsewhere."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    rope = {"rope_type": "default", "rope_theta": 150000.0}
    if tiny:
        cfg = GptOssConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                           num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=4096,
                           rope_parameters=rope, eos_token_id=None, pad_token_id=None, bos_token_id=None)
    else:
        cfg = GptOssConfig(num_hidden_layers=layers, num_local_experts=experts, sliding_window=128,
                           max_position_embeddings=131072, rope_parameters=rope, eos_token_id=None,
                           pad_token_id=None, bos_token_id=None)
    cfg.layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="eager")
    return model.eval()


def run_serve(model: Any, w: ServeWorkload, device: str, model_name: str, baseline: bool = True,
              compare_no_cache: bool = False) -> ServeResult:
    """hwkv (and, on request, hwkv without its prefix cache), then transformers on the same trace."""
    check_trace_fits(w)
    check_pools_fit(model, w)
    trace = make_trace(w, int(model.config.get_text_config().vocab_size))
    res = ServeResult(model_name, device, w)
    res.rows.append(serve_hwkv(model, trace, w, device=device))   # the plugin --device named, not the detected one
    if compare_no_cache:
        res.rows.append(serve_hwkv(model, trace, w, prefix_cache=False, device=device))
    if baseline:
        try:
            res.rows.append(serve_transformers(model, trace, w))
        except Exception as e:  # reported in its row: an API this transformers lacks, or its own failure
            res.rows.append(ServeRow("transformers generate_batch (continuous batching)", len(trace),
                                     prompt_tokens=None, reused_tokens=None,
                                     error=f"{type(e).__name__}: {str(e)[:300]}"))
    no_tpot = [r.method for r in res.rows if r.error is None and r.tpot_p50_ms is None]
    if no_tpot:
        res.notes.append(f"TPOT n/a for {', '.join(no_tpot)}: no request generated more than one token (new tokens "
                         f"per request: {w.new_tokens}), so there is no time between output tokens to measure "
                         "(null in --json)")
    return res
