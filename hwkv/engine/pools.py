"""The engine's pools: their sizes from a KV memory budget by `hwkv plan`'s planner (`plan_pools`), and the
pools, allocator, request rows and backend of one model on one device (`build_cache`, `Cache`).

Model-agnostic: a `ModelShape` says what the layers need (the transformers integration reads one from a
Hugging Face config).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Sequence, Tuple, Union

import torch

from hwkv import make_backend
from hwkv.allocator import PagedTokenToKVPoolAllocator, SWATokenToKVPoolAllocator
from hwkv.req_to_token import ReqToTokenPool
from hwkv.engine.plan import bytes_needed, format_bytes, parse_bytes, plan, round_up
from hwkv.engine.presets import ModelShape
from hwkv.errors import ConfigError
from hwkv.checks import check_device, check_flag, check_int_option
from hwkv.pool import MHATokenToKVPool, SWAKVPool, device_free_bytes

# The default KV budget (no memory= given) is what the requests need, capped at a fraction of the device's free
# memory. An accelerator's memory holds little besides the weights, so most of it; the CPU's RAM is shared with
# the weights, activations and every other process, so a modest part and at most CPU_MEMORY_CAP bytes.
DEFAULT_MEMORY_FRACTION = 0.8
CPU_MEMORY_FRACTION = 0.25
CPU_MEMORY_CAP = 4 << 30
MEMINFO = "/proc/meminfo"


@dataclass(frozen=True)
class PoolPlan:
    """Pool sizes for one model and budget; bytes count each pool's padding page."""

    size: int                     # full-pool slots (for an all-SWA model: locs only, no K/V behind them)
    size_swa: int                 # SWA-pool slots (0 without SWA layers)
    page_size: int
    context: int                  # KV tokens one request may hold (its prompt + max_new_tokens - 1)
    max_running: int              # request rows: concurrent requests
    chunk: int                    # prefill tokens per forward (the SWA pool reserves them once)
    full_bytes_per_token: int
    swa_bytes_per_token: int
    memory_bytes: int             # the budget the plan was made for

    @property
    def pool_bytes(self) -> int:
        """K/V bytes the two pools allocate."""
        p = self.page_size
        swa = (self.size_swa + p) * self.swa_bytes_per_token if self.swa_bytes_per_token else 0
        full = (self.size + p) * self.full_bytes_per_token if self.full_bytes_per_token else 0
        return full + swa

    @property
    def chunk_reserve(self) -> int:
        """SWA slots kept for one forward's prefill chunk (plan's reserve; 0 without SWA layers)."""
        return round_up(self.chunk, self.page_size) if self.swa_bytes_per_token else 0


def kv_bytes_needed(shape: ModelShape, context: int, page_size: int, max_running: int, chunk: int,
                    prefix_cache: bool = False) -> int:
    """KV bytes that `max_running` requests of `context` tokens need under `hwkv plan`'s sizing, exactly the least
    budget `plan()` accepts for them (`hwkv.engine.plan.bytes_needed`)."""
    return bytes_needed(shape, context, page_size, max_running, chunk, prefix_cache=prefix_cache)


def available_ram_bytes(meminfo: str = MEMINFO) -> int:
    """RAM the kernel says can be allocated without swapping (`hwkv.pool.device_free_bytes` on the CPU)."""
    free = device_free_bytes("cpu", meminfo)
    if free is None:
        raise ConfigError("cannot read the available RAM (no /proc/meminfo MemAvailable, no "
                          "sysconf SC_AVPHYS_PAGES): give memory= explicitly")
    return free


def free_device_bytes(device: torch.device) -> int:
    """Free memory of `device`: the runtime's `mem_get_info` on accelerators (torch.cuda, torch.xpu, torch.npu,
    ... by device type), available RAM on the CPU."""
    if device.type == "cpu":
        return available_ram_bytes()
    mod = getattr(torch, device.type, None)
    info = getattr(mod, "mem_get_info", None)
    if info is None:
        raise ConfigError(f"torch.{device.type} reports no free memory (no mem_get_info): give memory= explicitly")
    return int(info(device)[0])


def default_memory_cap(device: torch.device) -> int:
    """The most KV memory a default budget takes on `device`: CPU_MEMORY_FRACTION of the available RAM, at
    most CPU_MEMORY_CAP, on the CPU; DEFAULT_MEMORY_FRACTION of the free memory elsewhere."""
    free = free_device_bytes(device)
    if device.type == "cpu":
        return min(int(CPU_MEMORY_FRACTION * free), CPU_MEMORY_CAP)
    return int(DEFAULT_MEMORY_FRACTION * free)


def plan_pools(shape: ModelShape, *, context: int, max_running: int, chunk: int, page_size: int,
               memory: Union[None, int, str], device: Union[str, torch.device],
               prefix_cache: bool = False) -> PoolPlan:
    """Size the pools: `memory` (bytes or '2GiB'; more than the device has free is a ConfigError), or by default
    what `max_running` requests of `context` tokens need, capped by `default_memory_cap`; fewer rows when fewer
    fit. `prefix_cache`: room for each request's cache lock window in the SWA pool too. `device`: a torch.device
    or its name, as the pools take it (DeviceError when it is none, or its runtime is absent). The sizes and
    `prefix_cache` are checked by `plan`'s rules (ConfigError naming the value: a bool is no size, a truthy
    string no switch) before anything is read from the device."""
    for label, value in (("context", context), ("max_running", max_running), ("chunk", chunk),
                         ("page_size", page_size)):
        check_int_option(label, value, 1)
    chunk = min(chunk, max_running * context)  # no forward carries more new tokens than every row's whole context
    check_flag("prefix_cache", prefix_cache)
    device = check_device(device)
    if memory is None:
        need = kv_bytes_needed(shape, context, page_size, max_running, chunk, prefix_cache)
        budget = min(need, default_memory_cap(device))
    else:
        budget = parse_bytes(memory)
        try:
            free = free_device_bytes(device)
        except ConfigError:  # the device cannot say: the caller's budget stands
            free = None
        if free is not None and budget > free:
            raise ConfigError(f"memory={memory!r} ({format_bytes(budget)}) is more than the {format_bytes(free)} "
                              f"{device.type} has free: give a smaller budget, or none to size it from the requests")
    fit = plan(shape, budget, context, page_size=page_size, chunk=chunk, prefix_cache=prefix_cache).max_running
    result = plan(shape, budget, context, page_size=page_size, chunk=chunk, max_running=min(fit, max_running),
                  prefix_cache=prefix_cache)
    # the chunk the running rows can carry, which is what the SWA pool reserves for it (the scheduler's chunk_pages)
    return PoolPlan(result.full_pool_tokens, result.swa_pool_tokens, page_size, context, result.max_running,
                    min(chunk, result.max_running * context), shape.bytes_per_token_full_group,
                    shape.bytes_per_token_swa_group, budget)


@dataclass
class Cache:
    """The pools, allocator, request rows and backend of one model on one device."""

    pool: Any
    allocator: Any
    rtt: ReqToTokenPool
    backend: Any
    plan: PoolPlan
    shape: ModelShape

    @property
    def hybrid(self) -> bool:
        return isinstance(self.pool, SWAKVPool)

    def held_slots(self) -> Tuple[int, int]:
        """(full, SWA) slots in use now (reads the allocator's free counts). The pools' sizes are the allocator's:
        a plan may count them otherwise (the chat bench's all-full variant plans no SWA pool for its scheduler)."""
        a = self.allocator
        if not self.hybrid:
            return a.size - a.available_size(), 0
        return a.size - a.full_available_size(), a.size_swa - a.swa_available_size()

    def free_counts_async(self) -> "Tuple[torch.Tensor, List[int]]":
        """The rings' tails as a device tensor (no wait: copy it to the host with the step's results) and their
        host heads now; `held_from` turns both into `held_slots`' answer for that moment."""
        rings = self.allocator._rings()
        return torch.cat([r.tail for r in rings]), [r.head for r in rings]

    def held_from(self, tails: Sequence[int], heads: Sequence[int]) -> Tuple[int, int]:
        """(full, SWA) slots in use, from `free_counts_async`'s tails (read back) and heads (`held_slots`' sizes)."""
        a, p = self.allocator, self.plan.page_size
        full = a.size - (tails[0] - heads[0]) * p
        return (full, 0) if len(tails) == 1 else (full, a.size_swa - (tails[1] - heads[1]) * p)

    def check_integrity(self) -> None:
        """Allocator, pools and request rows are consistent (tests call it after every step)."""
        self.allocator.check_integrity()
        self.pool.check_integrity()
        self.rtt.check_integrity()


def build_cache(shape: ModelShape, pool_plan: PoolPlan, dtype: torch.dtype, device: torch.device,
                backend_device: Any = None, **backend_options: Any) -> Cache:
    """Pools (hybrid when the model has SWA layers), allocator, ReqToTokenPool and the device's backend."""
    p = pool_plan
    kw = dict(head_num=shape.num_kv_heads, head_dim=shape.head_dim, v_head_dim=shape.v_head_dim)
    if shape.swa_layer_ids:
        pool = SWAKVPool(p.size, p.size_swa, p.page_size, dtype, swa_attention_layer_ids=list(shape.swa_layer_ids),
                         full_attention_layer_ids=list(shape.full_layer_ids), device=device,
                         swa_head_num=shape.swa_num_kv_heads, swa_head_dim=shape.swa_head_dim,
                         swa_v_head_dim=shape.swa_v_head_dim, **kw)
        allocator: Any = SWATokenToKVPoolAllocator(p.size, p.size_swa, p.page_size, device, pool)
        backend_options.setdefault("sliding_window", shape.window)
    else:
        pool = MHATokenToKVPool(p.size, p.page_size, dtype, layer_num=shape.num_layers, device=device, **kw)
        allocator = PagedTokenToKVPoolAllocator(p.size, p.page_size, device)
    # one row more than requests run: padded requests of a whole-step decode graph write there
    rtt = ReqToTokenPool(p.max_running + 1, p.context, device)
    backend = make_backend(pool, rtt, device=backend_device, **backend_options)
    return Cache(pool, allocator, rtt, backend, p, shape)
