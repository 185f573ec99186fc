"""What a runner did: forwards by mode, tokens, time, and the KV memory it held against an all-full cache."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from hwkv.batch import ForwardMode
from hwkv.engine.plan import format_bytes
from hwkv.engine.pools import PoolPlan
from hwkv.engine.presets import ModelShape


@dataclass
class RunnerStats:
    """Counters of one runner. KV held is priced per slot in use (full slots x full-group bytes + SWA slots x
    SWA-group bytes); the all-full figure keeps every held token in every layer, as one pool would."""

    shape: ModelShape
    plan: PoolPlan
    forwards: Dict[str, int] = field(default_factory=lambda: {m.name: 0 for m in ForwardMode})
    seconds_by_mode: Dict[str, float] = field(default_factory=lambda: {m.name: 0.0 for m in ForwardMode})
    prefill_tokens: int = 0       # prompt tokens computed
    prompt_tokens: int = 0        # prompt tokens of the requests admitted
    reused_tokens: int = 0        # ... of which came from the prefix cache (not computed)
    decode_tokens: int = 0        # ... of the generated tokens, those decode-only forwards sampled
    graph_replays: int = 0        # decode forwards replayed through the graph runner
    graph_error: Optional[str] = None  # why decode runs eagerly although graphs were asked for ("auto")
    generated_tokens: int = 0     # tokens the requests' outputs hold, counted when the host reads them back
    dropped_tokens: int = 0       # sampled after their request's stop token, which the host read a step late
    verify_rows: int = 0          # speculative verify: requests verified (one per request per verify forward)
    draft_tokens: int = 0         # ... draft tokens checked ...
    accepted_tokens: int = 0      # ... and kept
    seconds: float = 0.0
    peak_held_bytes: int = 0
    peak_all_full_bytes: int = 0
    peak_full_slots: int = 0
    peak_swa_slots: int = 0

    def record_step(self, mode: ForwardMode, prefill_tokens: int, seconds: float) -> None:
        """A forward of `mode` computed `prefill_tokens` prompt tokens; its step took `seconds` on the host."""
        self.forwards[mode.name] += 1
        self.seconds_by_mode[mode.name] += seconds
        self.prefill_tokens += prefill_tokens
        self.seconds += seconds

    def record_tokens(self, mode: ForwardMode, kept: int, dropped: int = 0) -> None:
        """A forward of `mode`, read back: `kept` tokens appended to their requests' outputs, `dropped` sampled after
        their requests had stopped (read one step late, with overlap) and never counted as generated."""
        self.generated_tokens += kept
        if mode == ForwardMode.DECODE:
            self.decode_tokens += kept
        self.dropped_tokens += dropped

    def record_drafts(self, rows: int, drafted: int, accepted: int) -> None:
        """A verify forward of `rows` requests checked `drafted` draft tokens and kept `accepted` of them."""
        self.verify_rows += rows
        self.draft_tokens += drafted
        self.accepted_tokens += accepted

    def record_prompt(self, prompt_tokens: int, reused: int) -> None:
        """A request was admitted: its prompt, and how much of it the prefix cache gave."""
        self.prompt_tokens += prompt_tokens
        self.reused_tokens += reused

    def record_memory(self, held: Tuple[int, int]) -> None:
        """Slots in use after a step's release (before finished requests free theirs)."""
        full, swa = held
        full_b, swa_b = self.shape.bytes_per_token_full_group, self.shape.bytes_per_token_swa_group
        self.peak_held_bytes = max(self.peak_held_bytes, full * full_b + swa * swa_b)
        self.peak_all_full_bytes = max(self.peak_all_full_bytes, full * (full_b + swa_b))
        self.peak_full_slots = max(self.peak_full_slots, full)
        self.peak_swa_slots = max(self.peak_swa_slots, swa)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens of decode-only forwards per second of those forwards (steps wholly decode)."""
        secs = self.seconds_by_mode["DECODE"]
        return self.decode_tokens / secs if secs else 0.0

    @property
    def saving(self) -> float:
        """All-full bytes over held bytes at their peaks (1.0 without SWA layers)."""
        return self.peak_all_full_bytes / self.peak_held_bytes if self.peak_held_bytes else 1.0

    def as_dict(self) -> Dict[str, Any]:
        """JSON-ready counters, pool sizes and memory."""
        p = self.plan
        return {"forwards": dict(self.forwards), "seconds_by_mode": dict(self.seconds_by_mode),
                "graph_replays": self.graph_replays, "graph_error": self.graph_error,
                "prefill_tokens": self.prefill_tokens, "prompt_tokens": self.prompt_tokens,
                "reused_tokens": self.reused_tokens, "verify_rows": self.verify_rows, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens,
                "generated_tokens": self.generated_tokens, "seconds": self.seconds,
                "tokens_per_second": self.tokens_per_second,
                "pools": {"full_slots": p.size, "swa_slots": p.size_swa, "page_size": p.page_size,
                          "max_running": p.max_running, "context": p.context, "chunk": p.chunk,
                          "allocated_bytes": p.pool_bytes, "budget_bytes": p.memory_bytes},
                "kv_memory": {"peak_held_bytes": self.peak_held_bytes, "peak_all_full_bytes": self.peak_all_full_bytes,
                              "peak_full_slots": self.peak_full_slots, "peak_swa_slots": self.peak_swa_slots,
                              "saving": self.saving}}

    def prefix_line(self) -> str:
        """One line: prompt tokens taken from the prefix cache and prefill tokens computed."""
        share = self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return (f"prompt tokens {self.prompt_tokens:,}: {self.reused_tokens:,} reused from the prefix cache "
                f"({share:.0%}), {self.prefill_tokens:,} computed")

    def draft_line(self) -> str:
        """One line: draft tokens checked by verify forwards, the share kept, and tokens per request per verify
        forward (1 for a plain decode step)."""
        share = self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
        rows = self.verify_rows
        per = (self.accepted_tokens + rows) / rows if rows else 0.0
        return (f"speculative verify: {self.draft_tokens:,} draft tokens, {self.accepted_tokens:,} accepted "
                f"({share:.0%}); {per:.2f} tokens per request per verify forward over "
                f"{self.forwards['TARGET_VERIFY']:,} forwards")

    def memory_line(self) -> str:
        """One line: the peak KV held against an all-full cache holding the same tokens."""
        return (f"KV memory held at peak: {format_bytes(self.peak_held_bytes)} ({self.peak_full_slots:,} full + "
                f"{self.peak_swa_slots:,} SWA slots) vs {format_bytes(self.peak_all_full_bytes)} all-full "
                f"({self.saving:.2f}x); pools allocated {format_bytes(self.plan.pool_bytes)}")
