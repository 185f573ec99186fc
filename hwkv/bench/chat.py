"""`hwkv bench --workload chat`: multi-turn conversations sharing a system prompt, with a prefix cache,
in a fixed KV memory budget; the hybrid pools against one all-full pool of the same bytes.

Every conversation starts with the same system prompt; each turn appends user tokens, is prefilled
in chunks (a token budget per forward, beside the decoding turns) from the longest reusable cached
prefix, is cached when its prompt is in, generates its reply token by token (out-of-window release
after every forward) and is cached again when it finishes, so the next turn continues from it. The
scheduler admits turns up to a concurrency while each one's worst case fits beside the running ones'
(so no forward runs out of slots; a turn too large for the pools on their own is refused before
anything runs), and evicts cached KV (full or SWA, least recently used, unlocked) when a forward's
allocation needs it.

This measures the cache, not attention: allocation, matching, eviction and release run for real on
the device (the allocator's kernels), no K/V is computed. Pools come from `hwkv.engine.plan` for the
budget, with room in the SWA pool for the windows the cache keeps; the all-full run puts every layer
in one pool of the same budget (its SWA layers keep every token, so no window is ever missing).
"""
from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Deque, Dict, List, Optional, Tuple

import torch

from hwkv.allocator import SWATokenToKVPoolAllocator, ReqToTokenPool, release_out_of_window_batch
from hwkv.cache import HybridPrefixCache
from hwkv.engine.plan import plan, round_up, swa_tokens_per_request
from hwkv.engine.presets import ModelShape
from hwkv.errors import ConfigError, OutOfSlotsError


@dataclass(frozen=True)
class ChatWorkload:
    """Conversations x turns; each turn adds `user` tokens and generates `reply` tokens."""

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

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "system", "user", "reply", "concurrency", "memory", "page_size",
                     "chunk"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"chat workload: {name} must be an integer >= 1, got {getattr(self, name)!r}")

    @property
    def context(self) -> int:
        """Tokens of a conversation's last turn."""
        return self.system + self.turns * (self.user + self.reply)


@dataclass
class ChatRow:
    """One variant's run: pools, what was prefilled and reused, evictions, cache op times."""

    variant: str
    full_pool_tokens: int
    swa_pool_tokens: int
    pool_bytes: int
    turns_done: int
    prompt_tokens: int
    reused_tokens: int
    prefill_tokens: int
    hit_rate: float
    evicted_full_tokens: int
    evicted_swa_tokens: int
    queued_admissions: int
    steps: int
    match_us_median: float
    insert_us_median: float
    wall_s: float


@dataclass
class ChatResult:
    model: str
    device: str
    workload: ChatWorkload
    rows: List[ChatRow] = field(default_factory=list)

    def to_dict(self) -> Dict[str, Any]:
        return {"schema": "hwkv-bench-chat/1", "model": self.model, "device": self.device,
                "workload": asdict(self.workload), "rows": [asdict(r) for r in self.rows]}


@dataclass
class _Turn:
    conv: int
    ids: List[int]
    prompt: List[int] = field(default_factory=list)
    row: int = -1
    seq: int = 0
    frontier: int = 0
    lock: Any = None
    generated: int = 0


class _Sim:
    """One variant: allocator + cache + scheduler (chunked prefill beside decode) over the pools.

    Admission reserves each turn's worst case, so a forward never runs out of slots (as the runner's
    `hwkv.engine.scheduler` does; every page a running turn can pin is counted, and whatever no running
    turn pins is the cache's alone, unlocked, and freed by evicting it):
    - full: the turn's whole context, round_up(prompt + reply, P) slots, of which the matched prefix is
      already held: a turn is admitted while the running turns' remaining pages and its own new pages fit in
      the free slots plus what the cache can evict (its match locked first, so that is not counted);
    - SWA (hybrid): its own window, `swa_tokens_per_request(W, P)` (window + eviction margin + the page being
      written), plus the window its cache lock keeps (the SWA it held when its prompt was last cached,
      round_up(W, P) + P at most), each at most what the turn has; and one prefill chunk for all turns. The
      running turns' bounds and the chunk must fit in the SWA pool.
    Every forward evicts (least recently used, unlocked) what its new pages need beyond the free slots.
    """

    def __init__(self, name: str, w: ChatWorkload, size: int, size_swa: int, window: Optional[int],
                 device: str) -> None:
        self.name, self.w, self.device, self.window = name, w, torch.device(device), window
        self.size, self.size_swa = size, size_swa
        p = w.page_size
        self.swa_own = swa_tokens_per_request(window, p) if window else 0
        self.swa_locked = round_up(window, p) + p if window else 0
        self.chunk_reserve = round_up(w.chunk, p) if window else 0
        # the largest turn (a conversation's last) must fit on its own: said before anything runs
        full, swa = round_up(w.context, p), self._swa_bound(w.context - w.reply)
        turn = f"a turn of {w.context} tokens (system {w.system} + {w.turns} x (user {w.user} + reply {w.reply}))"
        if window and (full > size or swa + self.chunk_reserve > size_swa):
            raise OutOfSlotsError(f"chat workload ({name}): {turn} needs {full} full-pool slots and {swa} SWA slots "
                                  f"beside a prefill chunk of {self.chunk_reserve}; the pools have {size} full / "
                                  f"{size_swa} SWA: raise --memory or shorten the conversations")
        if not window and full > size:
            raise OutOfSlotsError(f"chat workload ({name}): {turn} needs {full} slots; the pool has {size} for "
                                  f"{w.memory} bytes: raise --memory or shorten the conversations")
        self.alloc = SWATokenToKVPoolAllocator(size, size_swa, p, device, None)
        # all-full: no window (the cache's window spans every context, so a match needs no SWA cut)
        self.cache = HybridPrefixCache(self.alloc, window or (w.context + 1))
        self.rtt = ReqToTokenPool(w.concurrency, round_up(w.context + w.page_size, w.page_size), device)
        self.frontiers = torch.zeros(w.concurrency, dtype=torch.int64, device=device)
        self.stats = dict(prompt=0, reused=0, evicted_full=0, evicted_swa=0, queued=0, steps=0, done=0)
        self.match_us: List[float] = []
        self.insert_us: List[float] = []

    def _swa_bound(self, prompt: int) -> int:
        """SWA slots a turn of `prompt` tokens (and its reply) can pin at once, its prefill chunk aside."""
        if not self.window:
            return 0
        p = self.w.page_size
        return min(self.swa_own, round_up(prompt + self.w.reply, p)) + min(self.swa_locked, round_up(prompt, p))

    def _full_left(self, t: _Turn) -> int:
        """Full slots a running turn will still allocate (its last page may be partly filled)."""
        p = self.w.page_size
        return round_up(len(t.prompt) + self.w.reply, p) - round_up(t.seq, p)

    def _room(self, full_tokens: int, swa_tokens: int) -> bool:
        """Evict cached KV until both pools have room; False if they cannot. Evicted tokens free memory only
        where no running turn holds the pages: the pools are read again after each round."""
        a, c = self.alloc, self.cache
        if full_tokens > a.full_available_size() + c.evictable_full or \
                swa_tokens > a.swa_available_size() + c.evictable_swa:
            return False
        for need, free, evictable, evict, key in (
                (full_tokens, a.full_available_size, lambda: c.evictable_full, c.evict, "evicted_full"),
                (swa_tokens, a.swa_available_size, lambda: c.evictable_swa, c.evict_swa, "evicted_swa")):
            short = need - free()
            while short > 0:
                if evictable() == 0:
                    return False
                self.stats[key] += evict(min(short, evictable()))
                short = need - free()
        return True

    def admit(self, t: _Turn, running: List[_Turn]) -> bool:
        """Acquire the turn's cached prefix if its worst case fits beside the running turns' (class doc).
        Nothing is evicted between the match and the acquire: the match stays valid."""
        p, a, c = self.w.page_size, self.alloc, self.cache
        t0 = time.perf_counter()
        m = c.match_prefix(t.prompt[:-1])
        self.match_us.append((time.perf_counter() - t0) * 1e6)
        held = c.lock(m)  # what the match names is not the cache's to evict any more
        full = sum(self._full_left(r) for r in running) + round_up(len(t.prompt) + self.w.reply, p) - m.length
        swa = sum(self._swa_bound(len(r.prompt)) for r in running) + self._swa_bound(len(t.prompt))
        free, evictable = a.full_available_size(), c.evictable_full
        if full > free + evictable or (self.window and swa + self.chunk_reserve > self.size_swa):
            c.unlock(held)
            return False
        # The cache may still hold this prompt's history past the match (its window evicted, so the match was
        # cut back): the turn recomputes it, and caching the turn's prompt locks those old nodes beside the
        # turn's own pages. Make the room now, with the match locked, so that lock cannot take what the running
        # turns and this one still need.
        stale = max(0, (len(t.prompt) - self.w.user) // p * p - m.length)
        if full + min(stale, evictable) > free + evictable:
            self._room(full, 0)
        t.row = self.rtt.alloc(1)[0]
        try:
            t.lock, t.frontier = c.acquire(m, self.rtt, t.row)
        finally:
            c.unlock(held)
        t.seq = m.length
        self.frontiers[t.row] = t.frontier
        self.stats["prompt"] += len(t.prompt)
        self.stats["reused"] += m.length
        return True

    def _drop(self, t: _Turn, cache: bool) -> None:
        t.frontier = int(self.frontiers[t.row])
        self.cache.release_request(t.ids, self.rtt, t.row, t.seq, t.frontier, t.lock, cache=cache)
        self.rtt.free(t.row)

    def step(self, running: List[_Turn]) -> List[_Turn]:
        """One forward: prompt chunks (up to `chunk` new tokens) beside one token for every decoding
        turn, then out-of-window release; returns the turns that finished."""
        if not running:
            return []
        w, p, dev = self.w, self.w.page_size, self.device
        self.stats["steps"] += 1
        budget, batch = w.chunk, []
        for t in running:
            if t.seq < len(t.prompt):
                n = min(len(t.prompt) - t.seq, budget)
                if n:
                    batch.append((t, n))
                    budget -= n
            else:
                batch.append((t, 1))
        need = sum(round_up(t.seq + n, p) - round_up(t.seq, p) for t, n in batch)  # new pages (pairs)
        if not self._room(need, need if self.window else 0):  # admission reserved them: a bug if it happens
            a, c = self.alloc, self.cache
            raise OutOfSlotsError(f"chat workload ({self.name}): {len(running)} running turns need {need} more slots; "
                                  f"free {a.full_available_size()} full / {a.swa_available_size()} SWA, cache "
                                  f"evictable {c.evictable_full} / {c.evictable_swa}: admission reserved less than "
                                  "they take (a bug); lower --concurrency or raise --memory")
        prefix_cpu = torch.tensor([t.seq for t, _ in batch], dtype=torch.int64)
        seq_cpu = prefix_cpu + torch.tensor([n for _, n in batch], dtype=torch.int64)
        rows = torch.tensor([t.row for t, _ in batch], dtype=torch.int64, device=dev)
        prefix, seq = prefix_cpu.to(dev), seq_cpu.to(dev)
        last = self.rtt.req_to_token[rows, (prefix - 1).clamp(min=0)]
        loc = self.alloc.alloc_extend(prefix, seq, last, int((seq_cpu - prefix_cpu).sum()),
                                      prefix_lens_cpu=prefix_cpu, seq_lens_cpu=seq_cpu)
        start = 0
        for t, n in batch:  # the engine's req_to_token rows (a host loop here: this is the simulator)
            self.rtt.req_to_token[t.row, t.seq:t.seq + n] = loc[start:start + n]
            start += n
            if t.seq >= len(t.prompt):
                t.generated += 1
                t.ids.append(1_000_000 + t.conv * 10_000 + t.seq)  # the reply's tokens (deterministic)
            t.seq += n
        if self.window:
            f = self.frontiers[rows]
            release_out_of_window_batch(self.alloc, self.rtt.req_to_token, rows, seq, f, self.window)
            self.frontiers[rows] = f
        for t, n in batch:
            if t.generated == 0:  # a prompt chunk went in: cache it (its SWA window at the chunk's end too,
                # which the request's own release would drop: shared system prompts keep their window)
                t.frontier = int(self.frontiers[t.row])
                t0 = time.perf_counter()
                t.lock = self.cache.cache_running(t.ids, self.rtt, t.row, t.seq, t.frontier, t.lock)
                self.insert_us.append((time.perf_counter() - t0) * 1e6)
        done = [t for t in running if t.generated >= w.reply]
        for t in done:
            self._drop(t, cache=True)
            self.stats["done"] += 1
        return done


def _sizes(shape: ModelShape, w: ChatWorkload) -> Tuple[int, int, int, int]:
    """(full, SWA) pool tokens of the hybrid pools for the budget, and the all-full pool's tokens and bytes.

    The SWA pool holds the running turns' windows, one prefill chunk (released after each forward),
    and one cached window per conversation (what its next turn needs to continue from the cache);
    the full pool gets the rest. The
    all-full pool comes from `hwkv.engine.plan` (every layer in one pool, the same padding rules).
    """
    p = w.page_size
    swa_need = swa_tokens_per_request(shape.window, p)
    size_swa = (w.concurrency + w.conversations) * swa_need + round_up(w.chunk, p) + w.concurrency * p
    swa_bytes = (size_swa + p) * shape.bytes_per_token_swa_group
    size = ((w.memory - swa_bytes) // shape.bytes_per_token_full_group - p) // p * p
    if size < round_up(w.context, p) * w.concurrency:
        raise ConfigError(f"chat workload: {w.memory} bytes leave {max(size, 0)} full-pool tokens beside an SWA "
                          f"pool of {size_swa}; {w.concurrency} turns of {w.context} tokens need "
                          f"{round_up(w.context, p) * w.concurrency}: raise --memory or lower --concurrency")
    pl = plan(shape, w.memory, w.context, p, max_running=None, chunk=w.system + w.user)
    return size, size_swa, pl.all_full_pool_tokens, pl.all_full_pool_bytes


def run_chat(shape: ModelShape, w: ChatWorkload, device: str = "cpu") -> ChatResult:
    """Both variants over the same conversations (same token ids, same order)."""
    if not shape.swa_layer_ids:
        raise ConfigError(f"{shape.name} has no SWA layers: the chat workload compares hybrid with all-full")
    full, swa, all_full, all_bytes = _sizes(shape, w)
    res = ChatResult(shape.name, device, w)
    hybrid_bytes = (full + w.page_size) * shape.bytes_per_token_full_group + \
        (swa + w.page_size) * shape.bytes_per_token_swa_group
    # both variants' pools first: a turn that fits neither's is refused before anything runs
    sims = [(_Sim("hybrid", w, full, swa, shape.window, device), hybrid_bytes),
            (_Sim("all-full", w, all_full, all_full, None, device), all_bytes)]
    for sim, nbytes in sims:
        res.rows.append(_run_variant(sim, nbytes))
    return res


def _run_variant(sim: _Sim, nbytes: int) -> ChatRow:
    w, name, size, size_swa, window = sim.w, sim.name, sim.size, sim.size_swa, sim.window
    gen = torch.Generator().manual_seed(w.seed)
    system = torch.randint(0, 50_000, (w.system,), generator=gen).tolist()
    history = {c: list(system) for c in range(w.conversations)}
    turn_no = {c: 0 for c in range(w.conversations)}
    ready: Deque[int] = deque(range(w.conversations))
    running: List[_Turn] = []
    t0 = time.perf_counter()
    while ready or running:
        # like an engine, a turn is matched when its prefill can start: after the one prefilling now
        while ready and len(running) < w.concurrency and all(t.seq >= len(t.prompt) for t in running):
            c = ready[0]
            user = torch.randint(0, 50_000, (w.user,), generator=torch.Generator().manual_seed(
                w.seed * 1_000_003 + c * 101 + turn_no[c])).tolist()
            t = _Turn(c, history[c] + user, history[c] + user)
            if not sim.admit(t, running):
                sim.stats["queued"] += 1
                if not running:  # the largest turn was checked against the pools: a bug if it happens
                    raise OutOfSlotsError(f"chat workload ({name}): a turn of {len(t.ids)} tokens does not fit "
                                          f"{size} full / {size_swa} SWA slots even with an empty cache")
                break
            ready.popleft()
            running.append(t)
        for t in sim.step(running):
            running.remove(t)
            history[t.conv] = t.ids[:t.seq]
            turn_no[t.conv] += 1
            if turn_no[t.conv] < w.turns:
                ready.append(t.conv)
    sim.cache.check_integrity()
    sim.alloc.check_integrity()
    st = sim.stats
    return ChatRow(name, size, size_swa if window else 0, nbytes, st["done"], st["prompt"], st["reused"],
                   st["prompt"] - st["reused"], st["reused"] / st["prompt"] if st["prompt"] else 0.0,
                   st["evicted_full"], st["evicted_swa"], st["queued"], st["steps"],
                   round(statistics.median(sim.match_us), 1), round(statistics.median(sim.insert_us), 1),
                   round(time.perf_counter() - t0, 3))
