"""Size the full and SWA pools for a KV memory budget the way an engine would (`hwkv plan`).

Per running request the full pool holds every token: round_up(context, P) slots. The SWA pool
holds what `hwkv.release.release_out_of_window` leaves mapped at the worst decode step:

    swa_tokens_per_request = min(round_up(W + margin_pages * P + P, P), round_up(context, P))

the window, the page(s) of margin the release keeps behind it (it frees page-aligned, one page
behind the oldest visible token), and one page for the window's partially filled first/last page;
but never more than the request's own tokens: a request of context <= W releases nothing and holds
round_up(context, P) SWA slots, as many as full ones (the scheduler reserves
min(round_up(kv, P), the window bound) per request, the same rule). This bound is tight for hwkv's
allocator. A request being prefilled also holds its new chunk
until the step's release, round_up(chunk, P) more slots; the chunk budget (like SGLang's
chunked_prefill_size) bounds the new tokens of one forward over the whole batch, so it is
reserved once per pool, not once per request, and no forward carries more new tokens than the
running requests' whole contexts (the engine's rule too):

    size_swa = R * swa_tokens_per_request + round_up(min(chunk, R * context), P)

R (running requests) is --max-running or the largest R whose pools fit; the full pool then gets
all memory left, rounded down to pages. A model whose every layer slides keeps no K/V in the full
pool: it holds locs only, one context a request. Each pool's buffers carry P extra rows (slot 0 is the
padding slot, buffers are [size + P, H, D]), and those bytes are counted. The all-full baseline
puts every layer in one pool of the same budget, with the same padding.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any, Dict, Optional, Sequence, Tuple, Union

from hwkv.checks import as_int, check_flag, check_int_option, is_int
from hwkv.engine.presets import ModelShape
from hwkv.errors import BudgetError, ConfigError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def check_flag_minimums(flags: Sequence[Tuple[str, Optional[int], int]]) -> None:
    """Refuse a command-line value below its minimum, naming the flag as the user typed it: (flag, value or None
    when not given, minimum) -> ConfigError '--flag must be >= minimum, got value'."""
    for flag, value, lo in flags:
        if value is not None and value < lo:
            raise ConfigError(f"{flag} must be >= {lo}, got {value}")


def parse_bytes(value: Union[str, int]) -> int:
    """'80GiB' / '80GB' / '512MiB' / '1.5TiB' / '1234' (bytes) -> bytes, read exactly (a fraction of a byte rounds
    down); a number must be an integer (Python's or numpy's) below 2**63. ConfigError names a bad value: a bool or a
    float (1.5 would have read as 1 byte) is no size."""
    if isinstance(value, str):
        m = _BYTES_RE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ConfigError(f"cannot read memory size {value!r}: expected a number with an optional unit "
                              f"(B, KB, MB, GB, TB = powers of 1000; KiB, MiB, GiB, TiB = powers of 1024)")
        whole, _, decimals = m.group(1).partition(".")
        whole = whole.lstrip("0") or "0"
        # exact (float() rounds, and is inf past 309 digits); 20 digits are past 2**63 before the unit, and int()
        # refuses 4,300. The floor is decided by the first 40 decimals: k / unit never has more.
        n = 2**63 if len(whole) > 19 else int(Fraction(f"{whole}.{decimals[:40]}0") * _UNITS[unit])
    else:
        n = as_int(value)   # None for a float or a bool of any kind
    if n is None:
        raise ConfigError(f"memory size must be an integer number of bytes or a string like '80GiB' or '1.5GiB', "
                          f"got {value!r} ({type(value).__name__})")
    if n < 1:
        raise ConfigError(f"memory size must be at least 1 byte, got {value!r}")
    if n >= 2**63:
        raise ConfigError(f"memory size {value!r} is too large: at most 2**63 - 1 bytes (8 EiB)")
    return n


def format_bytes(n: int) -> str:
    """Bytes with a binary unit, e.g. '80.00 GiB'."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def round_up(x: int, multiple: int) -> int:
    """Smallest multiple of `multiple` (an integer >= 1) that is >= x."""
    if not is_int(x):
        raise ConfigError(f"round_up: x must be an integer, got {x!r}")
    check_int_option("round_up: multiple", multiple, 1)
    return -(-x // multiple) * multiple


def swa_tokens_per_request(window: int, page_size: int, eviction_margin_pages: int = 1,
                           context: Optional[int] = None) -> int:
    """SWA slots one decoding request holds at most: P * (ceil(W / P) + 1 + margin_pages), and with
    `context` never more than the request's own round_up(context, P) (a short request releases nothing)."""
    for name, value, lo in (("window", window, 0), ("page_size", page_size, 1),
                            ("eviction_margin_pages", eviction_margin_pages, 0)):
        check_int_option(name, value, lo)
    check_int_option("context", context, 0, none=True)
    bound = round_up(window + eviction_margin_pages * page_size + page_size, page_size)
    return bound if context is None else min(bound, round_up(context, page_size))


def cache_lock_tokens(window: int, page_size: int, context: int) -> int:
    """SWA slots a running request's prefix-cache lock can pin beyond its own window: the last window of its
    cached prompt, round_up(W, P) + P, never more than round_up(context, P)."""
    for name, value, lo in (("window", window, 0), ("page_size", page_size, 1), ("context", context, 0)):
        check_int_option(name, value, lo)
    return min(round_up(window, page_size) + page_size, round_up(context, page_size))


@dataclass(frozen=True)
class Plan:
    """Pool sizes for one model, budget and context; every *_bytes counts the pools' padding rows."""

    model: str
    memory_bytes: int
    context: int
    page_size: int
    chunk: int
    eviction_margin_pages: int
    full_bytes_per_token: int
    swa_bytes_per_token: int
    all_full_bytes_per_token: int
    full_tokens_per_request: int
    swa_tokens_per_request: int
    chunk_reserve_tokens: int
    max_running: int
    full_pool_tokens: int
    full_pool_bytes: int
    swa_pool_tokens: int
    swa_pool_bytes: int
    max_concurrent_requests: int
    all_full_pool_tokens: int
    all_full_pool_bytes: int
    all_full_requests: int
    saving_requests: Optional[float]    # hybrid / all-full concurrent requests; None if all-full fits none
    saving_bytes_per_request: float     # all-full / hybrid KV bytes of one request
    saving_limit: float                 # ModelShape.saving_limit(context)
    prefix_cache: bool = False          # planned for a prefix cache: each request's SWA share holds its lock's window

    @property
    def unused_bytes(self) -> int:
        return self.memory_bytes - self.full_pool_bytes - self.swa_pool_bytes

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready fields (schema 'hwkv-plan/1')."""
        return {"schema": "hwkv-plan/1", **asdict(self), "unused_bytes": self.unused_bytes}


def _check_inputs(shape: ModelShape, memory_bytes: int, context: int, page_size: int,
                  max_running: Optional[int], chunk: int, margin: int, prefix_cache: bool) -> None:
    if not isinstance(shape, ModelShape):
        raise ConfigError(f"shape must be a ModelShape, got {shape!r}")
    for name, value, lo in (("memory_bytes", memory_bytes, 1), ("context", context, 1), ("page_size", page_size, 1),
                            ("chunk", chunk, 1), ("eviction_margin_pages", margin, 0)):
        check_int_option(name, value, lo)
    check_int_option("max_running", max_running, 1, none=True)
    check_flag("prefix_cache", prefix_cache)


def _request_tokens(shape: ModelShape, context: int, page_size: int, margin: int,
                    prefix_cache: bool) -> Tuple[int, int]:
    """(full, SWA) slots one running request holds at worst (see the module doc)."""
    if not shape.swa_layer_ids:
        return round_up(context, page_size), 0
    swa = swa_tokens_per_request(shape.window, page_size, margin, context)
    return round_up(context, page_size), swa + (cache_lock_tokens(shape.window, page_size, context)
                                                 if prefix_cache else 0)


def chunk_reserve_tokens(shape: ModelShape, chunk: int, running: int, context: int, page_size: int) -> int:
    """SWA slots kept once for a forward's new tokens: the chunk, but no more than `running` requests' whole
    contexts (no forward carries more); none without SWA layers. Each count an integer >= 1 (ConfigError)."""
    check_int_option("running", running, 1)
    _check_inputs(shape, 1, context, page_size, running, chunk, 0, False)
    return _chunk_reserve(shape, chunk, running, context, page_size)


def _chunk_reserve(shape: ModelShape, chunk: int, running: int, context: int, page_size: int) -> int:
    return round_up(min(chunk, running * context), page_size) if shape.swa_layer_ids else 0


def bytes_needed(shape: ModelShape, context: int, page_size: int, running: int, chunk: int,
                 eviction_margin_pages: int = 1, prefix_cache: bool = False) -> int:
    """KV bytes `running` requests of `context` tokens need: the least budget `plan` accepts for them (the pools'
    padding rows, the chunk reserve once, each request's full and SWA slots). Checked as `plan` checks its inputs
    (ConfigError)."""
    check_int_option("running", running, 1)
    _check_inputs(shape, 1, context, page_size, running, chunk, eviction_margin_pages, prefix_cache)
    return _bytes_needed(shape, context, page_size, running, chunk, eviction_margin_pages, prefix_cache)


def _bytes_needed(shape: ModelShape, context: int, page_size: int, running: int, chunk: int,
                  eviction_margin_pages: int, prefix_cache: bool) -> int:
    p, full_b, swa_b = page_size, shape.bytes_per_token_full_group, shape.bytes_per_token_swa_group
    full, swa = _request_tokens(shape, context, p, eviction_margin_pages, prefix_cache)
    swa_pad = p if shape.swa_layer_ids else 0
    return (p * full_b + (_chunk_reserve(shape, chunk, running, context, p) + swa_pad) * swa_b
            + running * (full * full_b + swa * swa_b))


def plan(shape: ModelShape, memory_bytes: int, context: int, page_size: int = 16,
         max_running: Optional[int] = None, chunk: int = 8192, eviction_margin_pages: int = 1,
         prefix_cache: bool = False) -> Plan:
    """Size both pools for `memory_bytes` of KV memory and requests of `context` tokens (see module doc).
    `prefix_cache`: each request may also pin the window its prefix-cache lock keeps (`cache_lock_tokens`)."""
    _check_inputs(shape, memory_bytes, context, page_size, max_running, chunk, eviction_margin_pages, prefix_cache)
    P, full_b, swa_b = page_size, shape.bytes_per_token_full_group, shape.bytes_per_token_swa_group
    has_swa = bool(shape.swa_layer_ids)
    full_need, swa_need = _request_tokens(shape, context, P, eviction_margin_pages, prefix_cache)
    swa_pad = P if has_swa else 0
    per_request = full_need * full_b + swa_need * swa_b

    def reserve(running: int) -> int:
        return _chunk_reserve(shape, chunk, running, context, P)

    def need(running: int) -> int:
        return _bytes_needed(shape, context, P, running, chunk, eviction_margin_pages, prefix_cache)

    lo, hi = 0, max(0, (memory_bytes - P * full_b - swa_pad * swa_b) // per_request)
    while lo < hi:   # the most requests that fit (need grows with the count)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if need(mid) <= memory_bytes else (lo, mid - 1)
    fit = lo
    running = fit if max_running is None else max_running
    if running < 1 or running > fit:
        want = max(1, running)
        chunk_reserve, capped = reserve(want), chunk > want * context   # (capped: only a chunk below that frees)
        hint = (f" (the chunk of {chunk} tokens{f', at most {want} x {context} a forward,' if capped else ''} alone "
                f"holds {format_bytes(chunk_reserve * swa_b)} of SWA slots: a smaller chunk"
                f"{f', below {want * context},' if capped else ''} frees it)")
        raise BudgetError(
            f"{shape.name}: {want} request(s) of context {context} need {need(want)} bytes "
            f"({format_bytes(need(want))}) of KV memory, given {memory_bytes} "
            f"({format_bytes(memory_bytes)}); at most {fit} fit" + (hint if chunk_reserve * swa_b > per_request else ""))
    chunk_reserve = reserve(running)
    size_swa = running * swa_need + chunk_reserve
    swa_bytes = (size_swa + swa_pad) * swa_b
    if full_b:   # the full pool gets all memory left, rounded down to pages
        size = ((memory_bytes - swa_bytes) // full_b - P) // P * P
    else:        # every layer slides: the full pool holds only locs (no K/V), one context a request
        size = running * full_need
    concurrent = min(size // full_need, (size_swa - chunk_reserve) // swa_need if has_swa else size // full_need)
    all_b = shape.bytes_per_token_all_full
    all_size = max(0, (memory_bytes // all_b - P) // P * P)
    all_requests = all_size // full_need
    return Plan(
        model=shape.name, memory_bytes=memory_bytes, context=context, page_size=P, chunk=chunk,
        eviction_margin_pages=eviction_margin_pages, full_bytes_per_token=full_b, swa_bytes_per_token=swa_b,
        all_full_bytes_per_token=all_b, full_tokens_per_request=full_need, swa_tokens_per_request=swa_need,
        chunk_reserve_tokens=chunk_reserve, max_running=running, full_pool_tokens=size,
        full_pool_bytes=(size + P) * full_b if full_b else 0, swa_pool_tokens=size_swa, swa_pool_bytes=swa_bytes,
        max_concurrent_requests=concurrent, all_full_pool_tokens=all_size,
        all_full_pool_bytes=(all_size + P) * all_b if all_size else 0, all_full_requests=all_requests,
        saving_requests=concurrent / all_requests if all_requests else None,
        saving_bytes_per_request=full_need * all_b / per_request, saving_limit=shape.saving_limit(context),
        prefix_cache=prefix_cache)
