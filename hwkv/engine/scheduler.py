"""The runner's host-side scheduler: requests, admission by reservation, and each forward's rows.

A request is admitted only when its worst case fits beside every running request's worst case:
round_up(kv, P) full slots (kv = prompt + max_new_tokens - 1, the tokens whose K/V is ever stored) and
min(that, `hwkv plan`'s per-request SWA bound) SWA slots, with the plan's chunk reserve kept aside for
one forward's prefill pages. So an allocation never fails mid-run and nothing waits forever: a request
whose worst case exceeds the pools on their own is refused when it is added (OutOfSlotsError), and every
other one is admitted once enough running requests finish. Every running request that has finished its
prompt decodes in every forward; prompts are chunked in admission order under the token and page budget.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from hwkv.engine.plan import swa_tokens_per_request
from hwkv.engine.pools import PoolPlan
from hwkv.engine.sampling import SamplingParams
from hwkv.errors import ConfigError, OutOfSlotsError


def _pages(tokens: Any, page_size: int) -> Any:
    """Pages of `tokens` (an int, or element-wise over an array)."""
    return -(-tokens // page_size)


@dataclass(eq=False)
class Request:
    """One request: its prompt, parameters, output so far and where it stands in the cache."""

    rid: int
    prompt: List[int]
    params: SamplingParams
    output: List[int] = field(default_factory=list)
    row: int = -1                  # its ReqToTokenPool row while running
    kv_len: int = 0                # tokens whose K/V the pools hold
    full_pages: int = 0            # reserved worst case
    swa_pages: int = 0
    finish_reason: Optional[str] = None  # "stop" (a stop token), "length" (max_new_tokens) or "abort" (`abort`)
    pending: int = 0               # tokens sampled on the device that the host has not read yet (overlap)
    lock: Any = None               # its HybridPrefixCache lock (prefix caching)
    reused: int = 0                # prompt tokens it took from the prefix cache
    stale: int = 0                 # cached full tokens its prompt's caching may still lock as a second copy (a bound)
    prompt_np: Optional[np.ndarray] = field(default=None, repr=False)  # the prompt as int64, made at its first chunk
    history: Any = field(default=None, repr=False)  # its TokenHistory (prompt + output) for a drafter, made once

    @property
    def kv_needed(self) -> int:
        """Tokens whose K/V is ever stored: the prompt and every output token but the last."""
        return len(self.prompt) + self.params.max_new_tokens - 1

    @property
    def prefilling(self) -> bool:
        return self.kv_len < len(self.prompt)

    @property
    def sampled(self) -> int:
        """Output tokens sampled so far, read by the host or not."""
        return len(self.output) + self.pending

    @property
    def decodes(self) -> bool:
        """Whether it feeds a token next forward: prompt done, no stop seen, max_new_tokens not yet sampled."""
        return (self.kv_len >= len(self.prompt) and self.finish_reason is None
                and self.sampled < self.params.max_new_tokens)

    def next_tokens(self, n: int) -> List[int]:
        """The n prompt token ids this request feeds next; a decoding request's next token is its last sampled
        one, which stays on the device (the runner's next_ids): -1 stands for it here."""
        p = len(self.prompt)
        if self.kv_len < p:
            return self.prompt[self.kv_len:self.kv_len + n]
        return [-1] * n

    def next_ids(self, n: int) -> np.ndarray:
        """`next_tokens(n)` as an int64 array: a prompt chunk is a slice of the prompt converted once (no Python per
        token for a chunk)."""
        if self.kv_len < len(self.prompt):
            if self.prompt_np is None:
                self.prompt_np = np.asarray(self.prompt, dtype=np.int64)
            return self.prompt_np[self.kv_len:self.kv_len + n]
        return np.full(n, -1, dtype=np.int64)

    def tokens_to_finish(self, tokens: List[int]) -> List[int]:
        """The first of `tokens` that `add_token` would take: all, or up to the one that finishes the request (a
        stop token, max_new_tokens). Nothing changes."""
        room = self.params.max_new_tokens - len(self.output)
        stops = self.params.stop_token_ids
        for i, t in enumerate(tokens):
            if t in stops or i + 1 >= room:
                return tokens[:i + 1]
        return tokens

    def add_token(self, token: int) -> bool:
        """Append a sampled token; True when the request is now finished."""
        self.output.append(token)
        if token in self.params.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.output) >= self.params.max_new_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None


class Row(NamedTuple):
    """One request's part of a forward: `n` new tokens after its `prefix`; `samples` when the chunk ends
    at its last known token, so the forward's logits there give its next token. A named tuple: the scheduler makes
    one per running request every step (a frozen dataclass took ~1 us each to build)."""

    req: Request
    prefix: int
    n: int
    samples: bool


class Scheduler:
    """Waiting and running requests, reservations, and the rows of each forward (host values only)."""

    def __init__(self, plan: PoolPlan, window: Optional[int], cached: bool = False) -> None:
        p = plan.page_size
        self.plan, self.page_size = plan, p
        # with a prefix cache, the full pool's room is settled per admission on what is free or evictable (the
        # runner's `start`), and a request's SWA bound includes the window its cache lock keeps
        self.cached = cached
        self.window = window
        self.swa_locked = ((window + p - 1) // p + 1) if cached and window else 0
        self.full_capacity = plan.size // p
        self.hybrid = window is not None and plan.size_swa > 0
        self.swa_bound = swa_tokens_per_request(window, p) // p if self.hybrid else 0
        self.chunk_pages = plan.chunk_reserve // p if self.hybrid else 0
        self.swa_capacity = plan.size_swa // p - self.chunk_pages if self.hybrid else 0
        self.rows_capacity = plan.max_running
        self.waiting: Deque[Request] = deque()
        self.running: List[Request] = []
        self.reserved_full = self.reserved_swa = 0
        self.stale = 0  # the running requests' `stale`: cached tokens admission does not count as evictable
        self.non_greedy = 0  # running requests that sample at a temperature (0: a forward's tokens are argmaxes)
        # of the last `schedule`: its decoding rows (they come first, one token each) and its prompt tokens
        self.decoding = self.prefill_tokens = 0

    def reserve(self, req: Request) -> None:
        """Set the request's worst-case pages; OutOfSlotsError when the pools can never hold it."""
        if not req.prompt:
            raise ConfigError(f"request {req.rid}: the prompt is empty")
        kv = req.kv_needed
        req.full_pages = _pages(kv, self.page_size)
        req.swa_pages = min(req.full_pages, self.swa_bound) if self.hybrid else 0
        if self.hybrid and self.swa_locked:  # the window its cache lock keeps (at most its prompt)
            req.swa_pages += min(self.swa_locked, _pages(len(req.prompt), self.page_size))
        if kv > self.plan.context or req.full_pages > self.full_capacity:
            raise OutOfSlotsError(
                f"request {req.rid}: prompt {len(req.prompt)} + max_new_tokens {req.params.max_new_tokens} needs "
                f"{kv} KV slots; the cache holds at most {self.plan.context} per request (context) in a full pool "
                f"of {self.plan.size} slots and an SWA pool of {self.plan.size_swa}: size it for a longer context")
        if req.swa_pages > self.swa_capacity:  # within context: the SWA pool is short of what this window keeps
            lock = f", its cache lock up to {self.swa_locked} more" if self.swa_locked else ""
            raise OutOfSlotsError(
                f"request {req.rid}: needs {req.swa_pages} SWA pages of {self.page_size} slots (window {self.window} "
                f"keeps up to {self.swa_bound}{lock}), past the {self.swa_capacity} that an SWA pool of "
                f"{self.plan.size_swa} slots leaves a request beside a chunk: plan the pools for this window (one "
                "wider than the model's keeps more than they were planned for)")

    def add(self, req: Request) -> None:
        self.reserve(req)
        self.waiting.append(req)

    def admit(self, start: Optional[Callable[[Request], bool]] = None,
              admitted: Optional[List[Request]] = None) -> List[Request]:
        """Move waiting requests to running, first come first served, while their reservations fit. With a
        prefix cache, `start(req)` settles the full pool's room (free plus evictable) and starts the request
        from its cached prefix; False leaves it waiting. `admitted`: the list each one joins as it is admitted, so
        a `start` that raises (Ctrl-C in its device read) leaves the caller those admitted before it."""
        admitted = [] if admitted is None else admitted
        while self.can_admit():
            req = self.waiting[0]
            if start is not None and not start(req):
                break
            self.waiting.popleft()
            self.reserved_full += req.full_pages
            self.reserved_swa += req.swa_pages
            self.stale += req.stale
            self.non_greedy += not req.params.greedy
            self.running.append(req)
            admitted.append(req)
        if self.waiting and not self.running:
            raise OutOfSlotsError(f"request {self.waiting[0].rid} fits no empty cache: its reservation was checked "
                                  "when it was added, so this is a scheduler bug")
        return admitted

    def can_admit(self) -> bool:
        """Whether the queue's head fits a row and its reservations now (with a prefix cache, `start` settles the
        full pool's room)."""
        if not self.waiting:
            return False
        req = self.waiting[0]
        return (len(self.running) < self.rows_capacity and self.reserved_swa + req.swa_pages <= self.swa_capacity
                and (self.cached or self.reserved_full + req.full_pages <= self.full_capacity))

    def full_pages_left(self) -> int:
        """Full pages the running requests will still allocate (each one's worst case, less what it holds)."""
        return sum(r.full_pages - _pages(r.kv_len, self.page_size) for r in self.running)

    def schedule(self) -> List[Row]:
        """This forward's rows: every decoding request, then prompt chunks under the token and page budget."""
        rows = [Row(r, r.kv_len, 1, True) for r in self.running if r.decodes]
        self.decoding = len(rows)
        tokens_left, pages_left = self.plan.chunk, self.chunk_pages
        for r in self.running:
            if not r.prefilling or tokens_left <= 0:
                continue
            n = min(len(r.prompt) - r.kv_len, tokens_left)
            if self.hybrid:  # the chunk's new pages come out of the plan's chunk reserve
                n = min(n, (_pages(r.kv_len, self.page_size) + pages_left) * self.page_size - r.kv_len)
                if n <= 0:
                    break
                pages_left -= _pages(r.kv_len + n, self.page_size) - _pages(r.kv_len, self.page_size)
            tokens_left -= n
            rows.append(Row(r, r.kv_len, n, r.kv_len + n == len(r.prompt)))
        self.prefill_tokens = self.plan.chunk - tokens_left
        return rows

    def new_pages(self, prefix: Sequence[int], n: Union[int, Sequence[int]]) -> int:
        """Pages a forward takes in each pool: each row's pages past its `prefix` after its `n` new tokens (arrays,
        or one `n` for every row)."""
        pre, p = np.asarray(prefix, dtype=np.int64), self.page_size
        return int((_pages(pre + np.asarray(n, dtype=np.int64), p) - _pages(pre, p)).sum())

    def drop(self, req: Request) -> None:
        """A waiting request leaves the queue (aborted before admission): it holds no reservation or row yet."""
        self.waiting.remove(req)

    def finish(self, req: Request) -> None:
        """The request left the cache: its reservation and row are free again."""
        self.running.remove(req)
        self.reserved_full -= req.full_pages
        self.reserved_swa -= req.swa_pages
        self.stale -= req.stale
        self.non_greedy -= not req.params.greedy

    def set_stale(self, req: Request, tokens: int) -> None:
        """A running request's `stale` bound is now `tokens` (prefix caching: its prompt cached further)."""
        self.stale += tokens - req.stale
        req.stale = tokens

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def check_integrity(self, rows_in_use: int) -> None:
        """Reservations and stale bounds add up, reservations stay within the pools; one row per running request."""
        assert self.reserved_full == sum(r.full_pages for r in self.running), "full reservations"
        assert self.cached or self.reserved_full <= self.full_capacity, "full reservations beyond the pool"
        swa = sum(r.swa_pages for r in self.running)
        assert self.reserved_swa == swa <= max(self.swa_capacity, 0), "SWA reservations"
        assert self.stale == sum(r.stale for r in self.running), "stale stretches"
        assert rows_in_use == len(self.running) <= self.rows_capacity, "request rows"
        assert len({r.row for r in self.running}) == len(self.running), "two running requests share a row"


def split_rows(rows: Sequence[Row]) -> Tuple[List[int], List[int], List[int]]:
    """Host lists of a forward: (token ids, positions, request row per token), in row order; -1 for a decoding
    request's token, which the device holds."""
    ids: List[int] = []
    pos: List[int] = []
    row_of: List[int] = []
    for row in rows:
        ids += row.req.next_tokens(row.n)
        pos += range(row.prefix, row.prefix + row.n)
        row_of += [row.req.row] * row.n
    return ids, pos, row_of
