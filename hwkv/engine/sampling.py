"""Per-request generation parameters and the batched sampler (greedy, temperature, top-p, seeded).

Sampling is a Gumbel-max race whose noise is a hash of (seed, output index, token id), computed on the
device in a few integer ops for the whole batch: a request's tokens depend only on its own logits and
seed, never on which requests share its forward, the batch order or the device's RNG state.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence, Tuple

import torch

from hwkv.errors import ConfigError

_M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates: temperature 0 is greedy; `stop_token_ids` end it (the stop token is kept).

    `seed` None (the default) lets the runner give each request its own (`with_seed`): `generate` uses the
    prompt's index, `add_request` the request id. One SamplingParams with a seed, given to `generate` for many
    prompts, is a base: prompt i samples with seed + i. Only per-request SamplingParams pin each seed as given."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop_token_ids: Tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed <= _M32):
            raise ConfigError(f"seed must be None or an integer in [0, 2**32), got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_seed(self, offset: int) -> "SamplingParams":
        """These parameters with seed (seed or 0) + offset, wrapped into [0, 2**32)."""
        return replace(self, seed=((self.seed or 0) + offset) & _M32)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) of int64 values in [0, 2**32); every product
    stays below 2**63, so no step overflows."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), [K, V], one per (request seed, output index, token id): float32, 24 random bits."""
    row = _mix(_mix(seeds & _M32) ^ (steps & _M32))
    h = _mix(row[:, None] ^ ((token_ids * 0x61C88647) & _M32))
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, seeds: torch.Tensor,
           steps: torch.Tensor, any_sampled: bool) -> torch.Tensor:
    """Next token per row of `logits` [K, V]: argmax where temperature is 0, else a draw from the softmax
    at that temperature restricted to the top-p nucleus (at least the most likely token). `any_sampled`
    (known on the host) skips the sampling ops for all-greedy batches."""
    greedy = logits.argmax(dim=-1)
    if not any_sampled:
        return greedy
    t = temperature.to(torch.float32).clamp(min=1e-6)[:, None]
    logp = torch.log_softmax(logits.to(torch.float32) / t, dim=-1)
    sorted_lp, order = logp.sort(dim=-1, descending=True)
    probs = sorted_lp.exp()
    outside = (probs.cumsum(dim=-1) - probs) >= top_p.to(torch.float32)[:, None]  # mass before it reached top_p
    sorted_lp = sorted_lp.masked_fill(outside, float("-inf"))
    u = uniform_noise(seeds, steps, order)  # keyed by token id, so the sort order does not matter
    pick = order.gather(-1, (sorted_lp - torch.log(-torch.log(u))).argmax(dim=-1, keepdim=True))[:, 0]
    return torch.where(temperature > 0, pick, greedy)


def params_tensors(params: Sequence[SamplingParams], steps: Sequence[int],
                   device: torch.device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(temperature, top_p, seeds, steps) of the sampled rows, on `device` (two host-to-device copies, from
    pinned memory: the host does not wait)."""
    floats = torch.tensor([[p.temperature for p in params], [p.top_p for p in params]], dtype=torch.float32,
                          device="cpu")
    ints = torch.tensor([[p.seed or 0 for p in params], list(steps)], dtype=torch.int64, device="cpu")
    if torch.device(device).type != "cpu":
        floats, ints = floats.pin_memory().to(device, non_blocking=True), ints.pin_memory().to(device, non_blocking=True)
    return floats[0], floats[1], ints[0], ints[1]
