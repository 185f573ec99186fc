"""Per-request generation parameters and the batched sampler (greedy, temperature, top-p, seeded).

Sampling is a Gumbel-max race whose noise is a hash of (seed, output index, token id), computed on the
device in a few integer ops for the whole batch: a request's tokens depend only on its own logits and
seed, never on which requests share its forward, the batch order or the device's RNG state. The engine keeps
each request row's constants on the device (`RowSampling`), written once when the request is admitted.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence, Tuple

import numpy as np
import torch

from hwkv.checks import as_int
from hwkv.errors import ConfigError

_M32 = 0xFFFFFFFF
F32_MAX = float(torch.finfo(torch.float32).max)  # the largest temperature the float32 sampler holds


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
        max_new = _check_int("max_new_tokens", self.max_new_tokens, 1, None, "an integer >= 1")
        temperature = _check_real("temperature", self.temperature, f"a number in [0, {F32_MAX!r}] (0 = greedy; the "
                                  "sampler reads it as float32, where a larger one is inf)",
                                  lambda t: 0 <= t <= F32_MAX)
        top_p = _check_real("top_p", self.top_p, "a number in (0, 1]", lambda p: 0 < p <= 1)
        seed = None if self.seed is None else _check_int("seed", self.seed, 0, _M32, "None or an integer in [0, 2**32)")
        object.__setattr__(self, "max_new_tokens", max_new)  # numpy or torch integers become ints
        object.__setattr__(self, "seed", seed)
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "stop_token_ids", _stop_ids(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_seed(self, offset: int) -> "SamplingParams":
        """These parameters with seed (seed or 0) + offset, wrapped into [0, 2**32)."""
        return replace(self, seed=((self.seed or 0) + offset) & _M32)


_RANGE_STOP = "a sequence of integer token ids >= 0"


def _check_int(name: str, value: object, lo: int, hi: Optional[int], allowed: str) -> int:
    """`value` as an int in [lo, hi] (hi None: unbounded); a bool, a float or anything else is refused."""
    v = as_int(value)
    if v is None or v < lo or (hi is not None and v > hi):
        raise ConfigError(f"{name} must be {allowed}, got {value!r}")
    return v


def _check_real(name: str, value: object, allowed: str, ok: Callable[[float], bool]) -> float:
    """`value` as a float for which `ok` holds (NaN never does); a bool, a string, None or a number past float's
    range (10**400) is refused."""
    try:
        f = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else math.nan
    except OverflowError:
        f = math.nan
    if not ok(f):
        raise ConfigError(f"{name} must be {allowed}, got {value!r}")
    return f


def _stop_ids(value: object) -> Tuple[int, ...]:
    """`stop_token_ids` as a tuple of ints: any iterable of integers >= 0 (numpy or torch integers included)."""
    try:
        items = list(value) if not isinstance(value, (str, bytes)) else None
    except TypeError:  # not iterable (an int, None, a 0-d tensor)
        items = None
    if items is None:
        raise ConfigError(f"stop_token_ids must be {_RANGE_STOP}, got {value!r}")
    ids = []
    for t in items:
        i = as_int(t)  # a bool of any kind is None
        if i is None or i < 0:
            raise ConfigError(f"stop_token_ids must be {_RANGE_STOP}, got {value!r} (element {t!r})")
        ids.append(i)
    return tuple(ids)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) of int64 values in [0, 2**32); every product
    stays below 2**63, so no step overflows."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Uniforms strictly inside (0, 1), [K, V], one per (request seed, output index, token id): float32, 23
    random bits. (m + 0.5) * 2**-23 for m < 2**23 needs 24 significant bits, so float32 holds it exactly: the
    largest is 1 - 2**-24, never 1.0 (whose Gumbel noise would be +inf), the smallest 2**-24."""
    row = _mix(_mix(seeds & _M32) ^ (steps & _M32))
    h = _mix(row[:, None] ^ ((token_ids * 0x61C88647) & _M32))
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def _outside_nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which tokens of `probs` [K, V] (each row sorted ascending) lie outside the row's top-p nucleus, the
    smallest set of most likely tokens whose mass reaches top_p. A token stays while the mass of the more likely
    ones is below top_p, that is while its own mass plus the less likely ones' exceeds 1 - top_p (the rule of
    transformers' top-p warper): the token that crosses top_p stays, and so does the most likely. The ascending
    sum adds the small tail first, so it keeps float32's precision where descending sums lose it; rows with
    top_p >= 1 keep every token exactly."""
    p = top_p.to(torch.float32)[:, None]
    outside = (probs.cumsum(dim=-1) <= 1 - p) & (p < 1)
    outside[:, -1] = False
    return outside


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, seeds: torch.Tensor,
           steps: torch.Tensor, any_sampled: bool) -> torch.Tensor:
    """Next token per row of `logits` [K, V]: argmax where temperature is 0, else a draw from the softmax
    at that temperature restricted to the top-p nucleus (at least the most likely token). `any_sampled`
    (known on the host) skips the sampling ops for all-greedy batches.

    Non-finite logits (an fp16/bf16 LM head that overflowed) get the softmax's limit, decided per row on the
    device: a row holding +inf draws among its +inf tokens, and NaN counts as +inf (argmax, greedy's pick, ranks NaN
    highest too), so a row with one such token draws greedy's answer; a row of nothing but -inf draws from the whole
    row. Other rows are untouched."""
    greedy = logits.argmax(dim=-1)
    if not any_sampled:
        return greedy
    temperature = temperature.to(torch.float32)  # the sampler's precision: a T that is 0 in float32 is greedy
    return torch.where(temperature > 0, _draw(_scaled(logits, temperature), top_p, seeds, steps), greedy)


def _scaled(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """`logits` / T in float32, with no entry +inf or NaN. A row whose largest entry is not finite becomes 0 at its
    largest entries (NaN counted as +inf) and -inf elsewhere. Rows colder than 1e-6, or whose max / T overflows,
    subtract their max before dividing by their exact T (every entry <= 0, differences exact); the others divide
    their logits as they are, as the sampler always has (log_softmax subtracts the max itself), so their draws stay
    bit for bit. T = 0 (greedy) rows divide by 1."""
    x = logits.to(torch.float32).nan_to_num(nan=math.inf, posinf=math.inf, neginf=-math.inf)
    top = x.amax(dim=-1, keepdim=True)  # +inf (or -inf: all -inf) where the row is not finite
    t = torch.where(temperature > 0, temperature, 1.0)[:, None]  # (float32: `sample` read it so)
    shift = torch.where((t < 1e-6) | (top / t).isinf(), top, 0.0)
    # a row shifted by an infinite top: NaN (inf - inf) at its top entries, made 0 here, -inf elsewhere
    return (x - shift).nan_to_num(nan=0.0, posinf=math.inf, neginf=-math.inf) / t


def _draw(scaled: torch.Tensor, top_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """The Gumbel-max draw per row from softmax(`scaled`) within the row's top-p nucleus."""
    logp = torch.log_softmax(scaled, dim=-1)
    sorted_lp, order = logp.sort(dim=-1)  # ascending: see _outside_nucleus
    sorted_lp = sorted_lp.masked_fill(_outside_nucleus(sorted_lp.exp(), top_p), float("-inf"))
    u = uniform_noise(seeds, steps, order)  # keyed by token id, so the sort order does not matter
    return order.gather(-1, (sorted_lp - torch.log(-torch.log(u))).argmax(dim=-1, keepdim=True))[:, 0]


def params_tensors(params: Sequence[SamplingParams], steps: Sequence[int],
                   device: torch.device) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(temperature, top_p, seeds, steps) of the sampled rows, on `device` (two host-to-device copies, from
    pinned memory: the host does not wait). For a one-off batch: the engine's steps gather them per request row
    (`RowSampling`), with no Python per row."""
    floats = torch.tensor([[p.temperature for p in params], [p.top_p for p in params]], dtype=torch.float32,
                          device="cpu")
    ints = torch.tensor([[p.seed or 0 for p in params], list(steps)], dtype=torch.int64, device="cpu")
    if torch.device(device).type != "cpu":
        floats, ints = floats.pin_memory().to(device, non_blocking=True), ints.pin_memory().to(device, non_blocking=True)
    return floats[0], floats[1], ints[0], ints[1]


class RowSampling:
    """Each request row's sampling constants on the device, so that a step samples with no Python per row: the
    temperature and top_p (float32), the seed and the tokens drawn so far (int64, the noise's output index).
    `admit` writes a sampling request's row once (one copy for all the step admits); a greedy request needs its
    row's temperature to be 0, written only where a sampling request left that row (the host keeps which rows
    those are), so greedy runs never copy anything. `sample` gathers the forward's rows on the device and moves
    nothing; `advance` moves their draw counts on. A free row's values are never read (no forward holds it)."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.device = device
        self.floats = torch.zeros(rows, 2, dtype=torch.float32, device=device)  # temperature, top_p
        self.floats[:, 1] = 1.0
        self.ints = torch.zeros(rows, 2, dtype=torch.int64, device=device)  # seed, tokens drawn
        self._hot = np.zeros(rows, dtype=bool)  # rows whose temperature is not 0 (host)

    def admit(self, rows: Sequence[int], params: Sequence[SamplingParams]) -> None:
        """Requests start in `rows` with `params`: a sampling one's constants and a draw count of 0 written to its
        row, a greedy one's temperature 0 where its row's was not."""
        todo = [(r, p) for r, p in zip(rows, params) if not p.greedy or self._hot[r]]
        if not todo:
            return
        at = [r for r, _ in todo]
        floats = torch.tensor([[p.temperature, p.top_p] for _, p in todo], dtype=torch.float32, device="cpu")
        ints = torch.tensor([[r, p.seed or 0, 0] for r, p in todo], dtype=torch.int64, device="cpu")
        if self.device.type != "cpu":  # pinned, no wait
            floats = floats.pin_memory().to(self.device, non_blocking=True)
            ints = ints.pin_memory().to(self.device, non_blocking=True)
        self.floats[ints[:, 0]] = floats
        self.ints[ints[:, 0]] = ints[:, 1:]
        self._hot[at] = [not p.greedy for _, p in todo]

    def sample(self, logits: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        """The next token of each row of `logits` [K, V], whose request rows are `where` (device, K distinct rows):
        `sample` with each row's constants (argmax where its temperature is 0). Their draw counts stay: `advance`
        moves them once the step's tokens are sent (a step undone after sampling reruns the same draw)."""
        f, i = self.floats[where], self.ints[where]
        return sample(logits, f[:, 0], f[:, 1], i[:, 0], i[:, 1], True)

    def advance(self, where: torch.Tensor) -> None:
        """The rows `where` (device, distinct) drew a token: their draw counts move on by one."""
        self.ints[where, 1] += 1
