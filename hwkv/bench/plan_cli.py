"""`hwkv plan`: print the pool sizes an engine would pick for a model, a KV memory budget and a context."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, List, Tuple

from hwkv.engine.plan import Plan, cache_lock_tokens, check_flag_minimums, format_bytes, parse_bytes, plan
from hwkv.engine.presets import ModelShape, add_model_arguments, shape_from_args
from hwkv.errors import ConfigError


PLAN_HELP = "size the full and SWA pools for a memory budget"


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `plan` on an argparse subparsers object (its `func` is run_plan)."""
    p = subparsers.add_parser("plan", help=PLAN_HELP, description=PLAN_HELP)
    add_plan_arguments(p)
    p.set_defaults(func=run_plan)
    return p


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """Add the `plan` flags to `p` (the form hwkv.cli's COMMANDS registry takes)."""
    p.epilog = "example: hwkv plan --model gemma-3-27b --memory 80GiB --context 32768"
    add_model_arguments(p)
    p.add_argument("--memory", required=True,
                   help="KV cache memory (what is left after weights), e.g. 80GiB, 80GB, 512MiB")
    p.add_argument("--context", type=int, required=True, help="tokens per request (prompt + output)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    p.add_argument("--max-running", type=int,
                   help="running requests to size the SWA pool for (default: as many as fit)")
    p.add_argument("--chunk", type=int, default=8192,
                   help="chunked-prefill budget: new tokens per forward (default 8192)")
    p.add_argument("--eviction-margin-pages", type=int, default=1,
                   help="pages the out-of-window release keeps behind the window (default 1, as hwkv's allocator)")
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="plan for an engine with a prefix cache (the default, as `hwkv generate` and HybridRunner "
                        "run): each request's SWA share also holds the window its cache lock keeps "
                        "(--no-prefix-cache: as `hwkv generate --no-prefix-cache`)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def run_plan(args: argparse.Namespace) -> int:
    """Run `hwkv plan`; a bad value prints the error to stderr and returns 2."""
    try:  # the flags first, named as typed (the planner's own errors name its parameters)
        check_flag_minimums((("--context", args.context, 1), ("--page-size", args.page_size, 1),
                             ("--max-running", args.max_running, 1), ("--chunk", args.chunk, 1),
                             ("--eviction-margin-pages", args.eviction_margin_pages, 0)))
        shape = shape_from_args(args)
        result = plan(shape, parse_bytes(args.memory), args.context, page_size=args.page_size,
                      max_running=args.max_running, chunk=args.chunk,
                      eviction_margin_pages=args.eviction_margin_pages, prefix_cache=args.prefix_cache)
    except ConfigError as e:
        print(f"hwkv plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        _print_table(shape, result)
    return 0


def _tokens_bytes(tokens: int, nbytes: int) -> str:
    return f"{tokens:,} tokens, {format_bytes(nbytes)}"


def _rows(shape: ModelShape, r: Plan) -> List[Tuple[str, str]]:
    saving = f"{r.saving_requests:.2f}x" if r.saving_requests is not None else "n/a (all-full fits no request)"
    lock = cache_lock_tokens(shape.window, r.page_size, r.context) if r.prefix_cache and shape.swa_layer_ids else 0
    swa = (f"SWA {r.swa_tokens_per_request:,} tokens ({r.swa_tokens_per_request - lock:,} its own + {lock:,} "
           f"prefix-cache lock; + {r.chunk_reserve_tokens:,} chunk tokens once)" if lock else
           f"SWA {r.swa_tokens_per_request:,} tokens (+ {r.chunk_reserve_tokens:,} chunk tokens once)")
    return [
        ("model", f"{r.model}: {shape.summary()}"),
        ("budget", f"{format_bytes(r.memory_bytes)}, context {r.context:,}, page {r.page_size}, chunk {r.chunk:,}, "
                   f"prefix cache {'on' if r.prefix_cache else 'off'}"),
        ("bytes / token", f"full group {r.full_bytes_per_token:,}, SWA group {r.swa_bytes_per_token:,}, "
                          f"all-full {r.all_full_bytes_per_token:,}"),
        ("per request", f"full {r.full_tokens_per_request:,} tokens, {swa}"),
        ("full pool", _tokens_bytes(r.full_pool_tokens, r.full_pool_bytes)),
        ("SWA pool", _tokens_bytes(r.swa_pool_tokens, r.swa_pool_bytes) + f" (sized for {r.max_running} running)"),
        ("unused", format_bytes(r.unused_bytes)),
        ("max concurrent", f"{r.max_concurrent_requests} requests at context {r.context:,}"),
        ("all-full pool", _tokens_bytes(r.all_full_pool_tokens, r.all_full_pool_bytes)
                          + f", {r.all_full_requests} requests"),
        ("saving", f"{saving} requests, {r.saving_bytes_per_request:.2f}x bytes per request "
                   f"(closed-form limit {r.saving_limit:.2f}x)"),
    ]


def _print_table(shape: ModelShape, r: Plan) -> None:
    rows = _rows(shape, r)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        width = max(len(k) for k, _ in rows)
        print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
        return
    table = Table(title="hwkv plan", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)
