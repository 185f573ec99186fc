"""`hwkv bench`: time the attention stack per configuration and batch size, check it, compare KV memory.

Exit codes: 0 done; 1 an output differed from hwkv.reference (the run is invalid); 2 a bad value,
an unavailable device or another typed hwkv error.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

from hwkv.bench.presets import ModelShape, add_model_arguments, shape_from_args
from hwkv.engine.plan import check_flag_minimums
from hwkv.errors import ConfigError, HwkvError, ReferenceMismatchError

if TYPE_CHECKING:  # hwkv.bench.run imports torch: loaded only when `bench` runs
    from hwkv.bench.run import BenchResult, Target, Workload

DEFAULT_MODEL = "gpt-oss-20b"
# workload defaults: on CPU short prompts (the default run takes under a minute on 2 cores); on
# accelerators the contexts engines see (8K-token prompts), so the memory table shows the saving at
# real contexts, with the reference check sampled (2 requests, their last 16 queries) to stay cheap
DEFAULTS: Dict[str, Any] = dict(batch_sizes="1,4,16", prompt_len=256, chunk=512, steps=16, warmup=2, repeats=1,
                                check_every=8, check_requests=0, check_queries=0)
ACCELERATOR_DEFAULTS: Dict[str, Any] = dict(DEFAULTS, batch_sizes="1,16,64", prompt_len=8192, chunk=8192, steps=32,
                                            warmup=4, check_requests=2, check_queries=16)
QUICK: Dict[str, Any] = dict(DEFAULTS, batch_sizes="1,4", prompt_len=160, chunk=256, steps=4, warmup=1,
                             check_every=2)


# the chat workload's defaults: on CPU small enough to run in seconds on 2 cores (4 layers, fp32: 300 MiB of fp32 KV
# are 4,240 full-pool tokens); elsewhere hwkv.bench.chat.ChatWorkload's sizes (2 GiB, 64 conversations of a 2048-token
# system prompt), checked every 64th of its ~2,000 forwards (the reference recomputes two requests' contexts in every
# layer on the host)
_CHAT_ACCELERATOR: Dict[str, Any] = dict(conversations=64, turns=4, system=2048, user=256, reply=128, concurrency=16,
                                         memory="2GiB", chunk=512, check_every=64, check_requests=2, check_queries=4)
_CHAT_CPU: Dict[str, Any] = dict(_CHAT_ACCELERATOR, conversations=6, turns=4, system=512, user=128, reply=16,
                                 concurrency=3, memory="300MiB", chunk=256, check_every=16)
# the serve workload's defaults (the prompt length and new tokens: 64 and 32 on CPU, 1024 and 128 elsewhere)
_SERVE: Dict[str, Any] = dict(requests=32, rate=8.0, shared=0.5, running=16, chunk=512)


SEED_LIMIT = 2**63  # torch.Generator.manual_seed takes 64 bits; the workloads derive more seeds from it


def max_threads() -> int:
    """The most CPU threads `--threads` takes: 4 per core, at least 1024 (torch takes a C int, and far more
    threads than cores only time the operating system's scheduler)."""
    return max(1024, 4 * (os.cpu_count() or 1))


def _listing(values: Dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items())


def _model_flags() -> Tuple[str, ...]:
    """The dests of add_model_arguments (--model, the shape flags, --kv-dtype)."""
    p = argparse.ArgumentParser(add_help=False)
    add_model_arguments(p)
    return tuple(vars(p.parse_args([])))


DECODE, CHAT, SERVE = "decode", "chat", "serve"
# The flags only some workloads read (by argparse dest) and the workloads reading each; one given to another workload
# is refused before anything runs, naming it and its workloads. Each defaults to None (a switch to False), so a flag
# is given when it is neither: a given 0 counts. The model shape, its dtype, the layers run and the reference check
# are the synthetic workloads' (serve runs a transformers model: --serve-model, or random GPT-OSS weights, in its own
# dtype). Every workload reads the rest: --device, --threads, --seed, --page-size, --chunk, --json.
WORKLOAD_FLAGS: Dict[str, Tuple[str, ...]] = {
    **dict.fromkeys(("batch_sizes", "prompt_len", "steps", "warmup", "repeats", "quick", "configs", "no_graph",
                     "plot"), (DECODE,)),
    **dict.fromkeys(("check_every", "check_requests", "check_queries", "dtype", "run_layers", *_model_flags()),
                    (DECODE, CHAT)),
    **dict.fromkeys(("conversations", "turns", "system_len", "user_len", "reply_len", "concurrency", "memory"),
                    (CHAT,)),
    **dict.fromkeys(("serve_model", "serve_requests", "serve_rate", "serve_prompt_len", "serve_new", "serve_shared",
                     "serve_system_len", "serve_running", "no_baseline"), (SERVE,)),
}


def check_workload_flags(args: argparse.Namespace, workload: str) -> None:
    """ConfigError naming each given flag that `workload` does not read (WORKLOAD_FLAGS) and the workloads that do:
    a flag silently ignored would leave a run that is not the one asked for."""
    foreign: Dict[Tuple[str, ...], List[str]] = {}
    for dest, owners in WORKLOAD_FLAGS.items():
        value = getattr(args, dest, None)
        if workload not in owners and value is not None and value is not False:
            foreign.setdefault(owners, []).append("--" + dest.replace("_", "-"))
    if not foreign:
        return
    whose = "; ".join(f"{', '.join(flags)}: the {' and '.join(owners)} "
                      + ("workloads'" if len(owners) > 1 else "workload's") for owners, flags in foreign.items())
    n = sum(len(flags) for flags in foreign.values())
    raise ConfigError(f"{whose}; --workload {workload} does not read {'it' if n == 1 else 'them'}")


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """Add the `bench` flags to `p` (the form hwkv.cli's COMMANDS registry takes)."""
    p.epilog = ("examples: hwkv bench  |  hwkv bench --model gpt-oss-120b --device cuda --batch-sizes 1,16,64  |  "
                "hwkv bench --json --plot bench.png")
    add_model_arguments(p)
    accel = {k: v for k, v in ACCELERATOR_DEFAULTS.items() if DEFAULTS[k] != v}
    w = p.add_argument_group("workload", f"defaults on CPU: {_listing(DEFAULTS)}; on accelerators the same but "
                                         f"{_listing(accel)}")
    w.add_argument("--batch-sizes", help="decode batch sizes to sweep, comma-separated")
    w.add_argument("--prompt-len", type=int, help="longest prompt; prompts spread down to half of it")
    w.add_argument("--chunk", type=int, help="chunked prefill: new tokens per forward over the whole batch")
    w.add_argument("--steps", type=int, help="timed decode steps per configuration")
    w.add_argument("--warmup", type=int, help="untimed decode steps before them")
    w.add_argument("--repeats", type=int, help="rounds of fresh requests (prefill + decode); samples pool")
    w.add_argument("--check-every", type=int, metavar="K",
                   help="compare every K-th forward (and each round's last) with hwkv.reference; 0 = never")
    w.add_argument("--check-requests", type=int, metavar="N",
                   help="shadow and check only the first N requests of each batch; 0 = all (decode and chat)")
    w.add_argument("--check-queries", type=int, metavar="N",
                   help="check only each request's last N queries of a forward; 0 = all (decode and chat)")
    w.add_argument("--quick", action="store_true",
                   help=f"a smoke run: {_listing({k: v for k, v in QUICK.items() if DEFAULTS[k] != v})} "
                        "(flags still win)")
    r = p.add_argument_group("run")
    r.add_argument("--device", help="device plugin to run on (default: the detected one; see `hwkv info`)")
    r.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="KV and activation dtype "
                   "(default: fp32 on CPU, bf16 elsewhere; --kv-dtype is taken when --dtype is not given)")
    r.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    r.add_argument("--run-layers", type=int, metavar="N", help="run only the first N layers (default: all on "
                   "accelerators; on CPU the shortest prefix of >= 4 layers with both kinds); memory is for all")
    r.add_argument("--configs", help="comma-separated subset of: per-layer/eager, once/eager, per-layer/graph, "
                   "once/graph, once/step-graph (the whole decode step in one graph) (default: all the device "
                   "supports)")
    r.add_argument("--no-graph", action="store_true", help="skip the graph configurations")
    r.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")
    r.add_argument("--seed", type=int, default=0, help="random inputs seed (default 0)")
    c = p.add_argument_group("chat workload (--workload chat)", "multi-turn conversations sharing a system "
                             "prompt through the engine (prefix cache, attention of a synthetic model of the "
                             "model's shapes, checked against hwkv.reference every --check-every forwards) in one "
                             "KV memory budget: hybrid pools vs all-full. Defaults on CPU: "
                             f"{_listing(_CHAT_CPU)}, the first layers as --run-layers says and one thread (its "
                             "tensors are small: a second thread mostly waits, much longer on a shared machine; "
                             f"--threads wins); on accelerators: {_listing(_CHAT_ACCELERATOR)}, every layer")
    c.add_argument("--workload", choices=(DECODE, CHAT, SERVE), default=DECODE,
                   help="decode (default): time the attention stack; chat: prefix-cache hit rate, prefill "
                        "tokens saved, throughput and a step's phases, hybrid vs an all-full pool of the same "
                        "memory; serve: a request trace through a transformers model, hwkv's runner vs "
                        "transformers' continuous batching. A flag of another workload is an error (exit 2)")
    c.add_argument("--conversations", type=int, help="conversations")
    c.add_argument("--turns", type=int, help="turns per conversation")
    c.add_argument("--system-len", type=int, help="shared system prompt tokens")
    c.add_argument("--user-len", type=int, help="user tokens per turn")
    c.add_argument("--reply-len", type=int, help="generated tokens per turn")
    c.add_argument("--concurrency", type=int, help="turns running at once")
    c.add_argument("--memory", help="KV memory budget of the whole model, e.g. 2GiB (the pools' tokens; only the "
                   "layers run are allocated)")
    s = p.add_argument_group("serve workload (--workload serve)", "requests arriving at a rate, some sharing a "
                             "system prompt, through a transformers model: throughput, TTFT and TPOT p50/p99")
    s.add_argument("--serve-model", metavar="PATH", help="a local Hugging Face model folder (default: random "
                   "GPT-OSS weights, tiny on CPU, GPT-OSS-20B's attention shapes with 4 layers elsewhere)")
    s.add_argument("--serve-requests", type=int, help=f"requests in the trace (default {_SERVE['requests']})")
    s.add_argument("--serve-rate", type=float, help="arrivals per second, Poisson (0: all at once; default "
                   f"{_SERVE['rate']:g}); the trace may span at most a day: at least --serve-requests / 86400")
    s.add_argument("--serve-prompt-len", type=int, help="longest prompt; lengths uniform down to half of it, and "
                   "longer than --serve-system-len (default 64 on CPU, 1024 elsewhere)")
    s.add_argument("--serve-new", type=int, help="tokens generated per request (default 32 on CPU, 128 elsewhere)")
    s.add_argument("--serve-shared", type=float, help="share of requests starting with the common system prompt "
                   f"(default {_SERVE['shared']})")
    s.add_argument("--serve-system-len", type=int, help="system prompt tokens (default half the prompt length)")
    s.add_argument("--serve-running", type=int, help=f"requests running at once (default {_SERVE['running']})")
    s.add_argument("--no-baseline", action="store_true", help="skip transformers' continuous batching")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object (schema hwkv-bench/2; the chat and "
                   "serve workloads hwkv-bench-chat/2 and hwkv-bench-serve/1) instead of tables")
    o.add_argument("--plot", metavar="PATH", help="write a PNG: time per decode step vs batch size, KV memory, and "
                   "each step's phases stacked per configuration and batch size")


def _ints(flag: str, text: str) -> Tuple[int, ...]:
    """`text` as comma-separated integers (duplicates dropped); an empty item such as `1,,4` is an error."""
    items = [x.strip() for x in text.split(",")]
    if not any(items):
        raise ConfigError(f"{flag} is empty")
    if "" in items:
        raise ConfigError(f"{flag} has an empty item in {text!r}; give comma-separated integers like 1,4,16")
    try:
        return tuple(dict.fromkeys(int(x) for x in items))
    except ValueError:
        raise ConfigError(f"{flag} takes comma-separated integers, got {text!r}") from None


def _check_plot_path(path: Optional[str]) -> None:
    """Fail before the run when the --plot file cannot be written: a format matplotlib cannot write (by the
    extension), or a path that cannot be created (created and removed again; an existing file is only opened
    for appending, so it stays as it is)."""
    if path is None:
        return
    import importlib.util
    import os

    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("--plot needs matplotlib: pip install 'hwkv[bench]'")
    from hwkv.bench.report import plot_format

    plot_format(path)
    existed = os.path.exists(path)
    try:
        with open(path, "ab" if existed else "xb"):
            pass
        if not existed:
            os.remove(path)
    except OSError as e:
        raise ConfigError(f"--plot cannot write {path!r}: {e.strerror or e}") from None


def memory_needed(shape: ModelShape, run_layers: int, w: Workload, bs: int, n_configs: int) -> int:
    """Bytes one batch size's run allocates at least: the Harness pools as `hwkv.bench.run._harness` sizes them
    (every token in the full pool, the windows and one chunk in the SWA pool, each with its padding page) and,
    when outputs are checked, the reference's copy of the checked requests' K/V."""
    from hwkv.engine.dtypes import shape_in
    from hwkv.bench.plan import round_up, swa_tokens_per_request

    p, lens = w.page_size, w.prompt_lens(bs)
    decode = (w.warmup + w.steps) * n_configs
    size = sum(round_up(n + decode, p) + p for n in lens)
    sub = shape_in(shape, w.dtype, layers=run_layers)
    if sub.swa_layer_ids:
        size_swa = min(size, bs * (swa_tokens_per_request(sub.window, p) + 2 * p) + round_up(w.chunk, p) + p)
        pools = (size + p) * sub.bytes_per_token_full_group + (size_swa + p) * sub.bytes_per_token_swa_group
    else:
        pools = (size + p) * sub.bytes_per_token_all_full
    shadow = 0
    if w.check_every > 0:
        checked = lens[:min(bs, w.check_requests or bs)]
        shadow = (sum(checked) + len(checked) * decode) * sub.bytes_per_token_all_full
    return pools + shadow


def request_bytes_floor(shape: ModelShape, run_layers: int, w: Workload, n_configs: int) -> int:
    """A floor of what each request adds to `memory_needed` (its shortest prompt and the decode steps in the full
    pool, at most its window in the SWA pool), so that bs * floor <= memory_needed(bs): no batch size above
    free // floor fits, found without the estimate's list of bs prompt lengths."""
    from hwkv.engine.dtypes import shape_in
    from hwkv.bench.plan import swa_tokens_per_request

    p = w.page_size
    tokens = w.prompt_len - w.prompt_len // 2 + (w.warmup + w.steps) * n_configs + p
    sub = shape_in(shape, w.dtype, layers=run_layers)
    if not sub.swa_layer_ids:
        return tokens * sub.bytes_per_token_all_full
    swa = min(tokens, swa_tokens_per_request(sub.window, p) + 2 * p)
    return tokens * sub.bytes_per_token_full_group + swa * sub.bytes_per_token_swa_group


def _check_memory(shape: ModelShape, run_layers: int, w: Workload, n_configs: int, torch_device: str) -> None:
    """ConfigError before the run when a batch size's pools (and reference copies) exceed the device's free
    memory, naming the largest batch size that fits. The exact estimate is asked only about batch sizes up to
    the floor's bound (it lists every request's prompt length)."""
    from hwkv.bench.plan import format_bytes
    from hwkv.pool import device_free_bytes

    free = device_free_bytes(torch_device)
    if free is None:
        return
    floor = request_bytes_floor(shape, run_layers, w, n_configs)
    most = free // floor  # no batch size above it fits
    for bs in w.batch_sizes:
        need = bs * floor if bs > most else memory_needed(shape, run_layers, w, bs, n_configs)
        if need <= free:
            continue
        lo, hi = 0, min(bs, most + 1)  # the largest batch size whose estimate fits: lo fits (0 trivially), hi not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if memory_needed(shape, run_layers, w, mid, n_configs) <= free else (lo, mid)
        fits = f"at most batch size {lo} fits" if lo else (
            f"no batch size fits: a request holds --prompt-len {w.prompt_len} tokens and (--warmup {w.warmup} + "
            f"--steps {w.steps}) x {n_configs} configurations of decode tokens in pages of --page-size "
            f"{w.page_size}: lower one of them")
        raise ConfigError(f"--batch-sizes: batch size {bs} needs at least {format_bytes(need)} (KV pools of "
                          f"{run_layers} layers and the reference's K/V copies) and {torch_device} has "
                          f"{format_bytes(free)} free; {fits}")


def _shape(args: argparse.Namespace) -> ModelShape:
    custom = ("layers", "window", "heads", "kv_heads", "head_dim")
    if args.model is None and all(getattr(args, n, None) is None for n in custom):
        args.model = DEFAULT_MODEL
    return shape_from_args(args)


def _dtype(args: argparse.Namespace, torch_device: str) -> str:
    kv = getattr(args, "kv_dtype", None)
    if kv is not None and kv not in ("bf16", "fp16", "fp32"):
        raise ConfigError(f"bench runs the KV cache in bf16, fp16 or fp32; --kv-dtype {kv} is for `hwkv plan`")
    if args.dtype and kv and args.dtype != kv:
        raise ConfigError(f"--dtype {args.dtype} and --kv-dtype {kv} disagree; give one")
    return args.dtype or kv or ("fp32" if torch_device == "cpu" else "bf16")


def _workload(args: argparse.Namespace, dtype: str, torch_device: str) -> Workload:
    from hwkv.bench.run import Workload

    base = QUICK if args.quick else DEFAULTS if torch_device == "cpu" else ACCELERATOR_DEFAULTS
    v = {k: getattr(args, k) if getattr(args, k) is not None else d for k, d in base.items()}
    text = str(v.pop("batch_sizes"))
    sizes = _ints("--batch-sizes", text)
    if min(sizes) < 1:
        raise ConfigError(f"--batch-sizes must be integers >= 1, got {text!r}")
    return Workload(batch_sizes=sizes, page_size=args.page_size, dtype=dtype, seed=args.seed, **v)


def _target(name: Optional[str]) -> Target:
    from hwkv.bench.run import Target
    from hwkv.integrations.device_choice import available_spec

    spec = available_spec(name)
    return Target(spec.name, spec.load_backend_class(), spec.torch_device, spec.load_graph_adapter())


def _configs(args: argparse.Namespace, has_graphs: bool, device: str, torch_device: str = "cpu") -> List[str]:
    from hwkv.bench.run import CONFIGS
    from hwkv.pages import page_ops_for

    if args.configs is not None:  # an empty item is refused, as --batch-sizes refuses one
        names = [c.strip() for c in args.configs.split(",")]
        if not all(names):
            raise ConfigError(f"--configs {args.configs!r} has an empty item; give a comma-separated subset of: "
                              f"{', '.join(CONFIGS)}")
    else:
        names = list(CONFIGS)
    names = list(dict.fromkeys(names))   # a repeat is dropped (the first keeps its place), as --batch-sizes' are
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        raise ConfigError(f"unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}")
    if args.no_graph or (not has_graphs and not args.configs):
        names = [c for c in names if not CONFIGS[c].graph]
    if not has_graphs and any(CONFIGS[c].graph for c in names):
        raise ConfigError(f"device {device!r} has no graph adapter; drop the graph configurations")
    if page_ops_for(torch_device) is None:  # the whole step in a graph allocates on the device: its page-op kernels
        if args.configs and any(CONFIGS[c].whole_step for c in names):
            raise ConfigError(f"once/step-graph needs device page-op kernels (hwkv.pages.register_page_ops), which "
                              f"{device!r} has not registered; drop it")
        names = [c for c in names if not CONFIGS[c].whole_step]
    if not names:
        why = "--no-graph with only graph --configs" if args.no_graph else "--configs has none this device runs"
        raise ConfigError(f"no configuration left to run ({why})")
    return names


def _progress(enabled: bool, total: int) -> Tuple[Any, Callable[[str], None]]:
    """A rich progress bar over the decode forwards (a no-op when disabled or rich is missing)."""
    if not enabled:
        return None, lambda label: None
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        return None, lambda label: None
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   transient=True)
    task = bar.add_task("prefill and graph capture", total=total)
    return bar, lambda label: bar.update(task, advance=1, description=label)


def _run(args: argparse.Namespace) -> BenchResult:
    import torch

    from hwkv.bench.run import default_run_layers, geometry, run_benchmark

    _check_plot_path(args.plot)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    shape = _shape(args)
    target = _target(args.device)
    w = _workload(args, _dtype(args, target.torch_device), target.torch_device)
    configs = _configs(args, target.adapter_factory is not None, target.name, target.torch_device)
    if args.run_layers is not None:
        geometry(shape, args.run_layers)  # ConfigError naming the allowed range (0 is not "the default")
    layers = args.run_layers if args.run_layers is not None else default_run_layers(shape, target.torch_device)
    _check_memory(shape, layers, w, len(configs), target.torch_device)
    total = len(w.batch_sizes) * w.repeats * (w.warmup + w.steps) * len(configs)
    bar, tick = _progress(sys.stdout.isatty() and not args.json, total)
    if bar is None:
        res = run_benchmark(target, shape, configs, w, layers, tick)
    else:
        with bar:
            res = run_benchmark(target, shape, configs, w, layers, tick)
    if target.adapter_factory is None:
        res.notes.append(f"device {target.name!r} has no graph adapter: graph configurations not run")
    return res


def _run_chat(args: argparse.Namespace) -> int:
    import torch

    target = _target(args.device)
    dev = target.torch_device
    threads = args.threads if args.threads is not None else (1 if dev == "cpu" else None)
    before = torch.get_num_threads()
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        return _chat(args, target, dev)
    finally:
        torch.set_num_threads(before)


def _chat(args: argparse.Namespace, target: Target, dev: str) -> int:
    """The chat workload on `target` with the flags' values (CPU threads already set), its table or JSON."""
    import torch

    from hwkv.bench.chat import PHASES, ChatWorkload, run_chat
    from hwkv.bench.plan import parse_bytes
    from hwkv.bench.run import default_run_layers

    base = _CHAT_CPU if dev == "cpu" else _CHAT_ACCELERATOR
    v = {k: getattr(args, k) for k in ("conversations", "turns", "concurrency", "chunk")}
    v.update(system=args.system_len, user=args.user_len, reply=args.reply_len, memory=args.memory,
             check_every=args.check_every, check_requests=args.check_requests, check_queries=args.check_queries)
    v = {k: (x if x is not None else base[k]) for k, x in v.items()}
    shape = _shape(args)
    layers = args.run_layers if args.run_layers is not None else default_run_layers(shape, dev)
    memory = v.pop("memory")
    w = ChatWorkload(memory=parse_bytes(memory), page_size=args.page_size, seed=args.seed,
                     dtype=_dtype(args, dev), run_layers=layers, **v)
    res = run_chat(shape, w, dev, backend_device=target.name)
    where = f"{target.name}, {torch.get_num_threads()} thread(s)" if dev == "cpu" else target.name
    title = (f"hwkv bench --workload chat on {where}: {res.model} ({res.layers} of {shape.num_layers} layers "
             f"run, {w.dtype}), {w.conversations} conversations x {w.turns} turns (system {w.system}, user {w.user}, "
             f"reply {w.reply} tokens), {w.concurrency} at once, {memory} of KV memory for the "
             f"model, page {w.page_size}, chunk {w.chunk}")
    cols = ("variant", "full pool", "SWA pool", "hit rate", "reused", "prefilled", "evicted full", "evicted SWA",
            "forwards", "tokens/s", "prefill tok/s", "step ms p50", "wall s")
    lines = [f"| {r.variant} | {r.full_pool_tokens:,} | {r.swa_pool_tokens:,} | {r.hit_rate:.3f} | "
             f"{r.reused_tokens:,} | {r.prefill_tokens:,} | {r.evicted_full_tokens:,} | {r.evicted_swa_tokens:,} | "
             f"{r.forwards:,} | {r.tokens_per_s:,.1f} | {r.prefill_tokens_per_s:,.1f} | {r.step_ms_median} | "
             f"{r.wall_s} |" for r in res.rows]
    if _emit(args, res.to_dict(), title, cols, lines):
        return 0
    hybrid, full = res.rows
    print(f"prefill tokens saved by the cache: hybrid {hybrid.reused_tokens:,}, all-full {full.reused_tokens:,} "
          f"({hybrid.reused_tokens / max(full.reused_tokens, 1):.2f}x)")
    print("\nphases of a step (mean ms per step; they add up to the mean step)")
    print("| phase | " + " | ".join(r.variant for r in res.rows) + " | what |\n|---|" + "---|" * len(res.rows) + "---|")
    for name, what in PHASES.items():
        print(f"| {name} | " + " | ".join(f"{r.phase_ms[name]:.3f}" for r in res.rows) + f" | {what} |")
    if w.check_every:
        for r in res.rows:
            queries = f"their last {w.check_queries} queries" if w.check_queries else "all their queries"
            print(f"reference check ({r.variant}): {r.checked_forwards} forwards (every {w.check_every}), "
                  f"{r.checked_requests} request checks of {queries} in {res.layers} layers, max |out - reference| "
                  f"{r.max_err:.3g}")
    else:
        print("reference check: off (--check-every 0)")
    return 0


def _check_serve_flags(rate: float, shared: float, system_len: Optional[int], prompt_len: int) -> None:
    """The serve workload's float flags and its system prompt, named as typed (the workload's own checks name its
    fields)."""
    if not 0 <= rate < math.inf:   # (NaN too; inf would be JSON's Infinity, no JSON: 0 is "all at once")
        raise ConfigError(f"--serve-rate must be a finite number >= 0 requests a second (0: all at once), got {rate}")
    if not 0 <= shared <= 1:
        raise ConfigError(f"--serve-shared must be in [0, 1], got {shared}")
    if system_len is not None and system_len >= prompt_len:
        raise ConfigError(f"--serve-system-len must be below the prompt length ({prompt_len}, --serve-prompt-len), "
                          f"got {system_len}")


def _run_serve(args: argparse.Namespace) -> int:
    from hwkv.bench.serve import ServeWorkload, check_trace_fits, random_gpt_oss, run_serve

    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ConfigError("the serve workload runs a transformers model: pip install 'hwkv[transformers]'") from None
    from hwkv.integrations.generate_cli import check_model_path, load_local_model

    if args.serve_model:
        check_model_path(args.serve_model)
    target = _target(args.device)
    dev = target.torch_device
    cpu = dev == "cpu"
    v = {k: getattr(args, f"serve_{k}") for k in ("requests", "rate", "shared", "running")}
    v = {k: x if x is not None else _SERVE[k] for k, x in v.items()}
    prompt_len = args.serve_prompt_len if args.serve_prompt_len is not None else 64 if cpu else 1024
    _check_serve_flags(v["rate"], v["shared"], args.serve_system_len, prompt_len)
    w = ServeWorkload(requests=v["requests"], rate=v["rate"], prompt_len=prompt_len,
                      new_tokens=args.serve_new if args.serve_new is not None else 32 if cpu else 128,
                      shared=v["shared"],
                      system_len=args.serve_system_len if args.serve_system_len is not None else prompt_len // 2,
                      max_running=v["running"], chunk=args.chunk if args.chunk is not None else _SERVE["chunk"],
                      page_size=args.page_size, seed=args.seed)
    check_trace_fits(w)  # before the model loads: a trace too large for the host (minutes to draw) or too slow
    if args.threads is not None:
        import torch
        torch.set_num_threads(args.threads)
    if args.serve_model:
        model, _ = load_local_model(args.serve_model, dev)
        name = args.serve_model
    else:
        model = random_gpt_oss(dev, tiny=cpu)
        name = "random GPT-OSS (tiny)" if cpu else "random GPT-OSS-20B attention shapes, 4 layers"
    res = run_serve(model, w, target.name, name, baseline=not args.no_baseline)
    lo, hi = w.prompt_range
    title = (f"hwkv bench --workload serve on {target.name}: {name}; {w.requests} requests "
             f"{f'at {w.rate:g}/s' if w.rate > 0 else 'all at once'}, prompts "
             f"{lo}-{hi} tokens ({w.shared:.0%} behind a {w.system_len}-token system prompt), {w.new_tokens} new "
             f"tokens each, {w.max_running} at once, page {w.page_size}")
    cols = ("method", "tokens/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "prompt reused",
            "wall s")
    lines = []
    for r in res.rows:
        if r.error:
            lines.append(f"| {r.method} | failed: {r.error} |")
            continue
        reused = "-" if r.prompt_tokens is None else f"{r.reused_tokens:,} of {r.prompt_tokens:,}"
        ms = [_or_na(x) for x in (r.ttft_p50_ms, r.ttft_p99_ms, r.tpot_p50_ms, r.tpot_p99_ms)]
        lines.append(f"| {r.method} | {r.tokens_per_s:,.1f} | {' | '.join(ms)} | {reused} | {r.wall_s} |")
    _emit(args, res.to_dict(), title, cols, lines, res.notes)
    return 0


def _or_na(value: Optional[float]) -> str:
    """A table cell: the value, or "n/a" where there is none (the table's notes say why)."""
    return "n/a" if value is None else str(value)


def _emit(args: argparse.Namespace, data: dict, title: str, cols: Sequence[str], lines: List[str],
          notes: Sequence[str] = ()) -> bool:
    """A workload's result: its JSON with --json (returns True), else the title, a markdown table and its
    notes."""
    import json

    if args.json:
        print(json.dumps(data, indent=1))
        return True
    print(title)
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for line in lines:
        print(line)
    for note in notes:
        print(f"note: {note}")
    return False


def check_shared_flags(args: argparse.Namespace) -> None:
    """The flags every workload takes, refused before any work: --threads in [1, max_threads()] and --seed in
    [0, 2**63), each naming the value and the limit (torch would raise on either, or overflow)."""
    limit = max_threads()
    if args.threads is not None and not 1 <= args.threads <= limit:
        raise ConfigError(f"--threads must be in [1, {limit}] (4 per CPU core, at least 1024), got {args.threads}")
    if not 0 <= args.seed < SEED_LIMIT:
        raise ConfigError(f"--seed must be in [0, 2**63 - 1 = {SEED_LIMIT - 1}], got {args.seed}")


# each integer flag's least value, as its workload's own check has it (there under the field's name)
_FLAG_MINIMUMS = (("--prompt-len", 1), ("--chunk", 1), ("--steps", 1), ("--warmup", 0), ("--repeats", 1),
                  ("--check-every", 0), ("--check-requests", 0), ("--check-queries", 0), ("--page-size", 1),
                  ("--conversations", 1), ("--turns", 1), ("--system-len", 1), ("--user-len", 1), ("--reply-len", 1),
                  ("--concurrency", 1), ("--serve-requests", 1), ("--serve-prompt-len", 1), ("--serve-new", 1),
                  ("--serve-system-len", 0), ("--serve-running", 1))


def check_flag_values(args: argparse.Namespace) -> None:
    """Refuse an integer flag below its least value before any work, naming the flag as typed (the workloads'
    own checks name their fields, which no command-line user gives)."""
    check_flag_minimums([(flag, getattr(args, flag[2:].replace("-", "_"), None), lo) for flag, lo in _FLAG_MINIMUMS])


def _out_of_memory(e: BaseException) -> bool:
    """Whether an error is an allocation that failed (host or device): what the memory checks, which price the pools,
    did not foresee (a forward's q of 10**12 heads), reported as a bad size rather than a traceback."""
    text = str(e).lower()
    return (isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError"
            or "can't allocate memory" in text or "out of memory" in text)


def run_bench(args: argparse.Namespace) -> int:
    """Run `hwkv bench`: tables or JSON on stdout, the plot on request; exit code as the module says."""
    from hwkv.bench import report

    workload = getattr(args, "workload", DECODE)
    try:
        check_shared_flags(args)
        check_workload_flags(args, workload)
        check_flag_values(args)
        if workload == CHAT:
            return _run_chat(args)
        if workload == SERVE:
            return _run_serve(args)
        res = _run(args)
    except ReferenceMismatchError as e:
        print(f"hwkv bench: FAILED: output differs from hwkv.reference: {e}", file=sys.stderr)
        return 1
    except HwkvError as e:
        print(f"hwkv bench: error: {e}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as e:   # torch.OutOfMemoryError is a RuntimeError
        if not _out_of_memory(e):
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"hwkv bench: error: out of memory ({first[:200]}): the run's tensors do not fit; give smaller sizes "
              "(--heads, --head-dim, --batch-sizes, --prompt-len, --chunk, --memory)", file=sys.stderr)
        return 2
    if args.json:
        print(report.to_json(res))
    else:
        try:
            report.print_rich(res)
        except ImportError:
            report.print_plain(res)
    if args.plot:
        try:
            report.plot(res, args.plot)
        except HwkvError as e:  # the tables are out; writing the plot failed (a full disk, a missing program)
            print(f"hwkv bench: error: {e}", file=sys.stderr)
            return 2
        print(f"hwkv bench: wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0
