"""Context parallelism over torch.distributed: each rank computes the K/V of its shard of one forward's
new tokens; the shards are all-gathered and every rank writes the full K/V into its own pool.

Three lifetimes, as everywhere in hwkv:
- per forward, the backend's metadata step translates the write locs once
  (`backend.forward_metadata.write_loc`, a KVWriteLoc); nothing here translates;
- per forward, `cp_plan` agrees on everything that is rank-dependent but layer-independent: token
  count, shard sizes, the K/V dtype, the device type, the pool's layer groups and their geometry, the
  presence of `swa_loc`, and whether the layers check across ranks (one small collective, one host read);
- per layer, `cp_allgather_and_save_kv(..., shards=plan)` checks its inputs locally (shape tuples
  against the layer, the pool and the plan: no collective, no host read of device values), gathers K and
  V in one collective and writes them through `pool.set_kv_buffer` with the pre-translated `swa_loc`.

Bad input: a rank that raised alone would leave the others blocked in the collective it skipped. So every
per-forward check is a row of ints that all ranks all-gather in `cp_plan`; each rank reads the same
table, so all raise the same typed error before any rank writes its pool. A refusal only one rank can see
(its `device=`, its HWKV_DEBUG) travels in that rank's row as the error's type and message (the row on a
device the group's backend takes). Agreeing on per-layer inputs would cost one collective per layer: that
is opt-in (`check_ranks=True`, or `HWKV_DEBUG=1`); by default a per-layer check fails on the bad rank
only, before its gather (see `cp_allgather_and_save_kv`).
"""
from __future__ import annotations

import re
import zlib
from dataclasses import InitVar, dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from hwkv import cp_checks as cpc
from hwkv.checks import as_count, check_flag, items_of
from hwkv.cp_checks import Dims, Pool
from hwkv.env import HWKV_DEBUG
from hwkv.errors import ConfigError, DeviceError, HwkvError, MissingSWALocError, ShapeError, ShardError
from hwkv.layer import AttentionLayer
from hwkv.loc import KVWriteLoc
from hwkv.pool import check_device

# The collective backend per device type, by name only: the core imports no vendor library. ROCm builds
# of torch use the "cuda" device type and name RCCL "nccl"; "rocm" is hwkv's device name for them.
BACKENDS: Dict[str, str] = {"cuda": "nccl", "rocm": "nccl", "npu": "hccl", "xpu": "xccl", "musa": "mccl",
                            "cpu": "gloo"}
# the torch device types each collective backend moves tensors on (first: where a refused plan row travels)
_BACKEND_DEVICES: Dict[str, Tuple[str, ...]] = {"gloo": ("cpu", "cuda"), "nccl": ("cuda",), "hccl": ("npu",),
                                                "xccl": ("xpu",), "ccl": ("cpu", "xpu"), "mccl": ("musa",)}


def default_backend(device: Union[str, torch.device, Any]) -> str:
    """The torch.distributed backend for `device`: "nccl" (CUDA, RCCL on ROCm), "hccl" (Ascend, torch_npu),
    "xccl" (Intel XPU, torch >= 2.8), "mccl" (MUSA, torch_musa), "gloo" (CPU).

    `device`: a torch.device, a device string ("cuda:1"), an hwkv device name ("rocm") or a DeviceSpec.
    """
    if isinstance(device, torch.device):
        kind = device.type
    elif isinstance(device, str):
        kind = device.split(":", 1)[0]
    elif isinstance(getattr(device, "torch_device", None), str):
        kind = device.torch_device
    else:
        raise ConfigError(f"default_backend takes a torch.device, a device string or a DeviceSpec, "
                          f"got {type(device).__name__}")
    backend = BACKENDS.get(kind)
    if backend is None:
        raise ConfigError(f"no collective backend is known for device type {kind!r}; known: {sorted(BACKENDS)}")
    if backend == "xccl":
        found = re.match(r"(\d+)\.(\d+)", torch.__version__)
        if found is not None and (int(found.group(1)), int(found.group(2))) < (2, 8):
            raise ConfigError(f"xpu: torch {torch.__version__} has no 'xccl' backend (torch >= 2.8 has); "
                              "older stacks use oneCCL's 'ccl' after `import oneccl_bindings_for_pytorch`")
    return backend


@dataclass(frozen=True, eq=False)
class CPShards:
    """One forward's shard layout and per-forward agreement (`cp_plan`, once per forward): rank r holds the
    forward's tokens [offsets[r], offsets[r + 1]) in write_loc order; sizes may differ, zero included.

    What every rank agreed on, for the per-layer calls' local checks (None: not fixed by the plan):
    `dtype` of every layer's k and v, `device_type` of the pool (else of the write locs), `groups` the
    pool's (full, SWA) layer-group geometry (KVH, D, Dv), None for a group the pool lacks; `check_ranks`:
    the per-layer calls agree across ranks too (one more collective per layer).

    Built by hand (tests do), it is checked (ShardError) and, for unequal sizes, derives `row_index` on the
    CPU from `sizes` (each call then copies it to the gather's device; `cp_plan` builds it there once). A
    `row_index` given by hand must be the int64 tensor `sizes` gives (for equal sizes: None, or every row in
    order), compared on the host once, here; `cp_plan`'s own (`_planned`) is taken as built.
    """

    rank: int
    sizes: Tuple[int, ...]
    # unequal sizes: the rows of the gather (padded to max_size per rank) that hold tokens, in token order
    row_index: Optional[torch.Tensor] = None
    dtype: Optional[torch.dtype] = None
    device_type: Optional[str] = None
    groups: Optional[Tuple[Optional[Dims], Optional[Dims]]] = None
    check_ranks: bool = False
    # `_shards_from` only: row_index is the one `cp_plan` built from the agreed sizes (no host check per forward)
    _planned: InitVar[bool] = False

    def __post_init__(self, _planned: bool) -> None:
        items = items_of(self.sizes)
        sizes = None if items is None else [as_count(s) for s in items]   # numpy integers taken, as everywhere
        if sizes is None or not all(s is not None and s >= 0 for s in sizes):
            raise ShardError(f"CPShards: sizes must be ints >= 0, got {items if items is not None else self.sizes!r}")
        world, rank = len(sizes), as_count(self.rank)
        if rank is None or not 0 <= rank < world:
            raise ShardError(f"CPShards: rank {self.rank!r} is outside [0, {world}) (one per shard size)")
        check_flag("CPShards.check_ranks", self.check_ranks)   # read by truth per layer: "no" would run a collective
        object.__setattr__(self, "sizes", tuple(sizes))
        object.__setattr__(self, "rank", rank)
        if self.row_index is None:
            if not _planned:
                object.__setattr__(self, "row_index", _row_index(self.sizes, torch.device("cpu")))
        elif not _planned:
            _checked_row_index(self.sizes, self.row_index)

    @property
    def world_size(self) -> int:
        return len(self.sizes)

    @property
    def num_tokens(self) -> int:
        return sum(self.sizes)

    @property
    def max_size(self) -> int:
        return max(self.sizes, default=0)

    @property
    def offsets(self) -> Tuple[int, ...]:
        out = [0]
        for s in self.sizes:
            out.append(out[-1] + s)
        return tuple(out)

    @property
    def local_size(self) -> int:
        return self.sizes[self.rank]

    @property
    def local_slice(self) -> slice:
        """This rank's tokens within the forward (index a [T, ...] tensor with it)."""
        start = sum(self.sizes[:self.rank])
        return slice(start, start + self.sizes[self.rank])


def cp_plan(write_loc_or_num_tokens: Union[KVWriteLoc, int], local_num_tokens: Optional[int] = None,
            group: Optional["dist.ProcessGroup"] = None, *, device: Union[None, str, torch.device] = None,
            pool: Optional[Pool] = None, dtype: Optional[torch.dtype] = None,
            check_ranks: Optional[bool] = None) -> CPShards:
    """Agree on one forward, once per forward: one small all-gather of a row of ints per rank and one host
    read; every rank checks the same table the same way, so a bad value on any rank raises the same typed
    error on every rank before anything is written.

    Agreed: the token count (len(write_loc)) and each rank's shard size; with `pool`, its device type, its
    layer groups (which layer ids are SWA) and each group's (KVH, D, Dv); the K/V `dtype` (default the
    pool's dtype; an fp8 pool's K/V arrive in a compute dtype only the caller knows, so `pool=` of an fp8
    pool without `dtype=` is refused); whether the write locs carry a `swa_loc`; `check_ranks` (default
    `HWKV_DEBUG`; on if any rank has it on, so all ranks run the same collectives). The per-layer calls
    then check their inputs against the plan locally.

    `write_loc_or_num_tokens`: this forward's KVWriteLoc, or its length. `local_num_tokens`: this rank's
    shard size; None splits evenly (the first T % world ranks take one token more). `pool`: the pool the
    layers will write (recommended: without it, and without `dtype`, the default per-layer calls cannot see
    that ranks' layers, pools or K/V dtypes differ; see `cp_allgather_and_save_kv`). `device`: where the
    row travels, a present device of a type the group's backend moves (cuda for NCCL); default the write
    locs' device, else the pool's, else the first present device the backend moves (CPU where it moves any).

    Raises on every rank, naming the rank: ShardError when ranks disagree on the token count, the shards do
    not add up to it, or a count is outside [0, 2**63 - 1]; LocError when a rank's write_loc is neither a
    KVWriteLoc nor an int; ShapeError when the ranks' dtypes or pools' geometry differ; ConfigError when
    their device types differ, pool= is given on some ranks only, an fp8 pool comes without dtype=, a
    rank's HWKV_DEBUG does not parse, or a rank's pool= is no KV pool, its dtype= no floating torch dtype or its
    check_ranks not True, False or None; DeviceError when a rank's `device` is no torch device, is absent, or
    is of a type its group's backend does not move (that rank's row then travels on one it does, so the
    others hear of it; only where the backend is unknown or none of its device types is present does the
    DeviceError stay on that rank, whose peers then wait in the plan's gather until the group's timeout);
    MissingSWALocError when some ranks' write locs carry a swa_loc and others' do not.
    """
    refusal: Optional[HwkvError] = None
    try:
        check_flag("check_ranks", check_ranks, none=True)
    except ConfigError as e:  # this rank's argument: every rank raises it, from the plan's table
        check_ranks, refusal = False, e
    if check_ranks is None:
        try:
            check_ranks = HWKV_DEBUG.get()
        except ConfigError as e:  # this rank's environment: every rank raises it, from the plan's table
            check_ranks, refusal = False, e
    return _plan(write_loc_or_num_tokens, local_num_tokens, group, device, pool, dtype, bool(check_ranks),
                 accept_int=True, refusal=refusal)


def cp_allgather_and_save_kv(pool: Pool, layer: AttentionLayer, write_loc: KVWriteLoc, k: torch.Tensor, v: torch.Tensor,
                             group: Optional["dist.ProcessGroup"] = None, *, shards: Optional[CPShards] = None,
                             check_ranks: Optional[bool] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gather every rank's shard of one layer's K/V and write the full K/V into this rank's pool.

    k [n_r, KVH, D], v [n_r, KVH, Dv]: this rank's shard (`shards.local_slice` of the forward's tokens),
    never modified. `write_loc`: the metadata step's KVWriteLoc; an SWA layer writes its `swa_loc` as
    is (never translated here), a full layer ignores it.

    `shards`: this forward's `cp_plan` (engines pass it). Per call then: local checks only (shape tuples
    and dtypes against the layer, the pool and the plan; no collective, no host read of device values),
    one all-gather of K and V together (as bytes: fp8 travels too), one pool write. Precondition: every rank
    of the group calls this for the same layers, in the same order, with the same shapes and the same
    `check_ranks` (as any engine does; agreeing on per-layer inputs would cost a collective per layer). A
    plan made without `pool=` fixes no geometry, and without `dtype=` no K/V dtype (its `groups` / `dtype`
    are None): then the ranks' layers, pools and dtypes must match too, which no local check can see, and
    a mismatch gathers rows of another layout (the backend aborts on a size mismatch; same-size dtypes are
    silently reinterpreted), so plan with `pool=` or use `check_ranks`. A rank whose local check fails
    raises its typed error before its gather and writes nothing; the other ranks have entered that
    gather and wait in it until the group's timeout (`init_process_group(timeout=...)`), when the
    collective raises the backend's error (gloo: a RuntimeError "Timed out waiting ..."; NCCL's watchdog
    may tear the process down instead). The forward is lost on every rank: the raising rank must not issue more
    collectives on the group for it (its next one would be matched with the others' pending gather; gloo
    aborts the process when their sizes differ).
    `check_ranks=True` (default the plan's: on with `HWKV_DEBUG=1`) restores the agreement per call: one
    more small all-gather and one host read per layer, and any rank's bad input raises the same typed
    error on every rank (ranks saving different layers, or layers of different (KVH, D, Dv) or K/V dtypes,
    included) with no pool written.

    Without `shards` (the public `cp_allgather_and_save_kv(pool, layer, write_loc, k, v, group)`) the
    call plans itself: one agreement per call (plan and this layer's checks in one small all-gather, one
    host read) before the K/V gather, so bad input on any rank raises on every rank. Engines should plan
    once per forward and pass `shards=`.

    Returns (k_full, v_full) [T, KVH, D] / [T, KVH, Dv] in token order for a caller that also attends
    with them: views into one gathered buffer (row stride KVH * (D + Dv), last dim contiguous).

    ConfigError, before any collective, when `shards` is neither None nor a CPShards or `check_ranks` is not
    True, False or None (on this rank); `pool` that is no KV pool and `layer` that is no AttentionLayer are
    refused as the other per-layer inputs are (every rank with `check_ranks` or without `shards`).
    """
    if shards is not None and not isinstance(shards, CPShards):
        raise ConfigError(f"shards= must be this forward's CPShards (cp_plan's) or None (the call plans itself), "
                          f"got {type(shards).__name__}")
    check_flag("check_ranks", check_ranks, none=True)
    pool_device = torch.device(getattr(pool, "device", "cpu") if cpc.is_pool(pool) else "cpu")
    rank, world = _rank_and_world(group)
    if shards is None:
        shards = _self_planned(pool, layer, write_loc, k, v, group, rank, world, pool_device)
    elif check_ranks if check_ranks is not None else shards.check_ranks:
        fail = cpc.layer_fail(pool, layer, write_loc, k, v, None, shards, rank, world, pool_device)
        table = _agree(cpc.layer_row(layer, k, fail), group, pool_device)
        cpc.raise_first(table)
        cpc.check_layer_table(table)
    else:
        fail = cpc.layer_fail(pool, layer, write_loc, k, v, None, shards, rank, world, pool_device)
        if fail is not None:
            e = cpc.error_of(rank, cpc.layer_row(layer, k, fail))
            raise type(e)(f"{e} [raised on this rank only, before its K/V gather: the other ranks wait in "
                          "theirs until the group's timeout; check_ranks=True or HWKV_DEBUG=1 makes every "
                          "rank raise it]") from None
    k_full, v_full = _gather_kv(k, v, shards, group)
    pool.set_kv_buffer(layer, write_loc, k_full, v_full, layer.k_scale, layer.v_scale)
    return k_full, v_full


# ---- planning ------------------------------------------------------------------------------------------

def _plan(x: object, local_num_tokens: Optional[int], group: Optional["dist.ProcessGroup"],
          device: Union[None, str, torch.device], pool: Optional[Pool], dtype: Optional[torch.dtype],
          check_ranks: bool, accept_int: bool, refusal: Optional[HwkvError] = None) -> CPShards:
    rank, world = _rank_and_world(group)
    row, device, info = _plan_row(x, local_num_tokens, rank, world, group, device, pool, dtype, check_ranks,
                                  accept_int)
    if refusal is not None and row[0] == cpc.Fail.OK:
        row = cpc.carried_row(refusal)
    extra, tail = _value_checks(x, row, pool, info["dtype"], device)
    table = _agree(row + extra, group, device, tail)
    checked = [r[cpc.WIDTH:] for r in table]
    table = [r[:cpc.WIDTH] for r in table]
    cpc.raise_first(table)
    shards = _shards_from(table, rank, device, info)
    _raise_value_checks(checked, info["dtype"])
    return shards


def _value_checks(x: object, row: List[int], pool: Optional[Pool], dtype: Optional[torch.dtype],
                  device: torch.device) -> Tuple[List[int], Optional[torch.Tensor]]:
    """What joins this rank's plan row: whether it holds write locs and a checksum of them (computed where they are,
    read with the table: the ranks agree on their values, not only their count, else another forward's locs of the
    same length were saved silently), and whether its pool stores the K/V dtype (else one rank's pool refused the
    gathered K/V while the others wrote theirs). Host values, and the device checksum as the row's tail (a 0 where
    this rank has no locs)."""
    has = isinstance(x, KVWriteLoc) and row[0] == cpc.Fail.OK
    writes = not cpc.is_pool(pool) or dtype is None or _writable(pool, dtype)
    return [int(has), int(writes)] + ([] if has else [0]), (_loc_checksum(x).to(device) if has else None)


def _raise_value_checks(checked: List[List[int]], dtype: Optional[torch.dtype]) -> None:
    """The same refusal on every rank where `_value_checks`' columns (has locs, pool takes the dtype, checksum)
    disagree."""
    held = [c for h, _, c in checked if h]
    if len(set(held)) > 1:
        raise ShardError(f"ranks' write locs differ in value (ranks {[i for i, c in enumerate(checked) if c[0]]} "
                         "compared by a checksum of loc and swa_loc): every rank must write the same new tokens "
                         "(this forward's backend.forward_metadata.write_loc)")
    refused = [i for i, c in enumerate(checked) if not c[1]]
    if refused:
        raise ConfigError(f"the pools of ranks {refused} cannot store K/V of {dtype} (the ranks' agreed "
                          "dtype): give every rank a pool of one dtype")


def _loc_checksum(wl: KVWriteLoc) -> torch.Tensor:
    """A position-weighted sum of a forward's write locs (and SWA locs), int64 wrapping, on their device: equal
    on every rank that holds the same locs; no host read."""
    n = len(wl)
    weight = torch.arange(1, n + 1, dtype=torch.int64, device=wl.loc.device) * 2654435761 + 1
    total = (wl.loc.to(torch.int64) * weight).sum(0, keepdim=True)
    if wl.swa_loc is not None:
        total = total + (wl.swa_loc.to(torch.int64) * (weight * 3 + 7)).sum(0, keepdim=True) * 31
    return total


def _self_planned(pool: Pool, layer: AttentionLayer, write_loc: object, k: object, v: object,
                  group: Optional["dist.ProcessGroup"], rank: int, world: int,
                  pool_device: torch.device) -> CPShards:
    """The plan-less call: this forward's plan and this layer's checks in one agreement."""
    local = k.shape[0] if isinstance(k, torch.Tensor) and k.dim() == 3 else None
    dtype = k.dtype if isinstance(k, torch.Tensor) else None
    prow, device, info = _plan_row(write_loc, local, rank, world, group, pool_device, pool, dtype, False,
                                   accept_int=False)
    if not cpc.is_pool(pool):  # None too: a save has a pool to write (cp_plan's pool=None means "not agreed")
        prow = cpc.row(cpc.Fail.NOT_POOL, 0, 0, cpc.name_code(type(pool).__name__))
    n_local = prow[4] if prow[0] == cpc.Fail.OK else 0
    fail = cpc.layer_fail(pool, layer, write_loc, k, v, n_local, None, rank, world, pool_device)
    lrow = cpc.layer_row(layer, k, fail)
    extra, tail = _value_checks(write_loc, prow, pool, info["dtype"], device)   # as cp_plan's agreement
    table = _agree(prow + lrow + extra, group, device, tail)
    end = cpc.WIDTH + len(lrow)
    plan_table, layer_table = [r[:cpc.WIDTH] for r in table], [r[cpc.WIDTH:end] for r in table]
    cpc.raise_first(plan_table)
    shards = _shards_from(plan_table, rank, device, info)
    cpc.raise_first(layer_table)
    cpc.check_layer_table(layer_table)
    _raise_value_checks([r[end:] for r in table], info["dtype"])
    return shards


def _plan_row(x: object, local_num_tokens: Optional[int], rank: int, world: int,
              group: Optional["dist.ProcessGroup"], device: Union[None, str, torch.device], pool: Optional[Pool],
              dtype: Optional[torch.dtype], check_ranks: bool,
              accept_int: bool) -> Tuple[List[int], torch.device, Dict[str, Any]]:
    """This rank's plan row, where it travels, and the local values the agreed codes stand for.
    `accept_int`: cp_plan's row (an int count allowed, an fp8 pool needs `dtype`); else the plan-less
    call's, whose dtype is k's. A `pool` that is no KV pool is read as none (its refusal: cp_plan's row here, the
    plan-less call's its own)."""
    given, pool = pool, pool if cpc.is_pool(pool) else None
    if not isinstance(x, KVWriteLoc) and as_count(x) is not None:   # numpy and 0-d tensor integers, as everywhere
        x = as_count(x)
    if local_num_tokens is not None and as_count(local_num_tokens) is not None:
        local_num_tokens = as_count(local_num_tokens)
    pool_device = None if pool is None else torch.device(getattr(pool, "device", "cpu"))
    if isinstance(x, KVWriteLoc):
        n: Optional[int] = len(x)
        has_swa = int(x.swa_loc is not None)
        device = x.loc.device if device is None else device
    elif accept_int and cpc.is_int(x):
        n, has_swa = int(x), -1
    else:
        n, has_swa = None, -1
    device, bad_device = _travel(device if device is not None else pool_device, group)
    pool_dtype = getattr(pool, "dtype", None)
    if dtype is None and pool is not None:
        if isinstance(pool_dtype, torch.dtype) and pool_dtype.is_floating_point and pool_dtype.itemsize > 1:
            dtype = pool_dtype
    device_type = (pool_device if pool_device is not None else device).type
    groups = None if pool is None else _pool_groups(pool)
    info = {"dtype": dtype, "device_type": device_type, "groups": None if groups is None else groups[:2]}
    if n is None:
        row = cpc.row(cpc.Fail.LOC_TYPE, 0, 0, cpc.name_code(type(x).__name__), int(accept_int))
    elif not 0 <= n <= cpc.I64_MAX:
        row = cpc.row(cpc.Fail.TOKENS, 0, 0, n)
    elif local_num_tokens is not None and (not cpc.is_int(local_num_tokens) or not 0 <= local_num_tokens <= n):
        is_int = cpc.is_int(local_num_tokens)
        row = cpc.row(cpc.Fail.LOCAL, 0, 0, n, int(local_num_tokens) if is_int else -1, int(is_int))
    elif bad_device is not None:
        row = cpc.carried_row(bad_device)
    elif accept_int and given is not None and pool is None:
        row = cpc.row(cpc.Fail.NOT_POOL, 0, 0, cpc.name_code(type(given).__name__))
    elif accept_int and dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        row = cpc.carried_row(ConfigError(f"dtype= must be a floating torch dtype (every layer's k and v), "
                                          f"got {dtype!r}"))
    elif dtype is None and pool is not None and accept_int:
        code = cpc.name_code(str(pool_dtype)) if isinstance(pool_dtype, torch.dtype) else 0
        row = cpc.row(cpc.Fail.NO_DTYPE, 0, 0, code)
    else:
        if local_num_tokens is None:
            base, extra = divmod(n, world)
            local_num_tokens = base + (rank < extra)
        if groups is None:
            geometry = [0, -1, -1, -1, -1, -1, -1, 0]
        else:
            full, swa, crc = groups
            geometry = [1, *(full or (-1, -1, -1)), *(swa or (-1, -1, -1)), crc]
        dtype_code = 0 if dtype is None else cpc.name_code(str(dtype))
        row = cpc.row(cpc.Fail.OK, 0, dtype_code, n, int(local_num_tokens), has_swa, int(check_ranks),
                      cpc.name_code(device_type), *geometry)
    return row, device, info


def _shards_from(table: List[List[int]], rank: int, device: torch.device, info: Dict[str, Any]) -> CPShards:
    """The plan every rank reads from the same table (already free of failing rows)."""
    counts = [r[3] for r in table]
    if len(set(counts)) > 1:
        raise ShardError(f"ranks disagree on the forward's token count (len(write_loc)): {counts} in rank "
                         "order; every rank must write the same new tokens")
    sizes = tuple(r[4] for r in table)
    if sum(sizes) != counts[0]:
        raise ShardError(f"shards of {list(sizes)} tokens (rank order) add up to {sum(sizes)}, "
                         f"len(write_loc) is {counts[0]} on every rank")
    pooled = [r[8] for r in table]
    if len(set(pooled)) > 1:
        raise ConfigError(f"cp_plan got pool= on ranks {[i for i, p in enumerate(pooled) if p]} only: pass it "
                          "on every rank or on none")
    devices = [r[7] for r in table]
    if len(set(devices)) > 1:
        raise ConfigError(f"ranks' pools are on different device types: {[cpc.type_name(c) for c in devices]} in rank "
                          "order")
    geometry = [tuple(r[9:16]) for r in table]
    if len(set(geometry)) > 1:
        def show(g: Tuple[int, ...]) -> str:
            full, swa = [d if d[0] >= 0 else None for d in (list(g[:3]), list(g[3:6]))]
            return f"full {full} swa {swa} layers #{g[6]:08x}"
        raise ShapeError("ranks' pools differ (layer groups' [KVH, D, Dv] and which layer ids are SWA): "
                         + "; ".join(f"rank {i}: {show(g)}" for i, g in enumerate(geometry))
                         + ": every rank must hold the same pool layout to write the gathered K/V")
    dtypes = [r[2] for r in table]
    if len(set(dtypes)) > 1:
        raise ShapeError(f"ranks' K/V dtypes differ: {[cpc.type_name(c) if c else 'unfixed' for c in dtypes]} in rank "
                         "order; the gather needs one dtype (cp_plan's dtype=, default the pool's)")
    has_swa = [r[5] for r in table]
    if 0 in has_swa and 1 in has_swa:
        raise MissingSWALocError(f"the write locs of ranks {[i for i, h in enumerate(has_swa) if h == 0]} have no "
                                 f"swa_loc, those of ranks {[i for i, h in enumerate(has_swa) if h == 1]} have "
                                 "one: every rank passes its metadata step's KVWriteLoc")
    return CPShards(rank, sizes, _row_index(sizes, device), dtype=info["dtype"], device_type=info["device_type"],
                    groups=info["groups"], check_ranks=any(r[6] for r in table), _planned=True)


def _writable(pool: Pool, dtype: torch.dtype) -> bool:
    """Whether every group of `pool` stores K/V of `dtype` (`kv_dtypes`; a pool that does not say is taken at its
    word)."""
    groups = [getattr(pool, name, None) for name in ("full_kv_pool", "swa_kv_pool")] if \
        hasattr(pool, "layers_mapping") else [pool]
    return all(dtype in g.kv_dtypes for g in groups if g is not None and hasattr(g, "kv_dtypes"))


def _pool_groups(pool: Pool) -> Tuple[Optional[Dims], Optional[Dims], int]:
    """(full group's (KVH, D, Dv), SWA group's, a checksum of which layer ids are SWA), None for a group the
    pool lacks or does not describe."""
    mapping = getattr(pool, "layers_mapping", None)
    if mapping is not None:
        layout = sorted((int(lid), bool(m[1])) for lid, m in mapping.items())
        return (cpc.dims_of(getattr(pool, "full_kv_pool", None)), cpc.dims_of(getattr(pool, "swa_kv_pool", None)),
                zlib.crc32(repr(layout).encode()))
    return cpc.dims_of(pool), None, zlib.crc32(f"layers {getattr(pool, 'layer_num', None)}".encode())


def _travel(wanted: Union[None, str, torch.device], group: Optional["dist.ProcessGroup"]
            ) -> Tuple[torch.device, Optional[DeviceError]]:
    """Where this rank's plan row travels: `wanted` when it is a present device of a type the group's backend
    moves; else a present one that is (the DeviceError saying why not `wanted` goes in the row, so every rank
    raises it). Only when there is none (or the backend is unknown) is it raised here, on this rank alone.
    `wanted` None (the caller named no device): the first present one the backend moves, CPU first, no refusal
    (NCCL's row had been sent to the CPU, which it refuses)."""
    backend = str(dist.get_backend(group))
    kinds: Optional[List[str]] = []
    for part in backend.split(","):  # "gloo", or per device type: "cpu:gloo,cuda:nccl"
        kind, _, name = part.strip().rpartition(":")
        found = (kind,) if kind else _BACKEND_DEVICES.get(name)
        kinds = None if kinds is None or found is None else kinds + list(found)
    if wanted is None:
        for kind in sorted(kinds or ("cpu",), key=lambda k: k != "cpu"):
            try:
                return check_device(kind), None
            except DeviceError:
                continue
        wanted = "cpu"
    try:
        dev = check_device(wanted)
        if kinds is not None and dev.type not in kinds:
            raise DeviceError(f"device={str(wanted)!r}: the group's backend {backend!r} moves {kinds} only")
        return dev, None
    except DeviceError as e:
        refusal = e
    for kind in kinds or ():
        try:
            return check_device(kind), refusal
        except DeviceError:
            continue
    raise DeviceError(f"cp_plan: {refusal} [raised on this rank only, before the plan's gather: no device of the "
                      f"group's backend {backend!r} is present to tell the other ranks, which wait in theirs until "
                      "the group's timeout]")


# ---- the gather ----------------------------------------------------------------------------------------

def _gather_kv(k: torch.Tensor, v: torch.Tensor, shards: CPShards,
               group: Optional["dist.ProcessGroup"]) -> Tuple[torch.Tensor, torch.Tensor]:
    """K and V side by side in one [max_size, KVH * (D + Dv)] send buffer per rank (padded rows zeroed),
    one all-gather of its bytes (any K/V dtype travels, fp8 included, which collectives may not take), then
    the padded rows dropped with one index_select (only for unequal shards)."""
    n, kvh, d = k.shape
    dv = v.shape[2]
    ck, cv, m, t = kvh * d, kvh * dv, shards.max_size, shards.num_tokens
    if t == 0:  # every rank knows it from the plan: no collective on any rank
        return k.new_empty(0, kvh, d), v.new_empty(0, kvh, dv)
    send = k.new_empty(m, ck + cv)
    send[:n, :ck].copy_(k.reshape(n, ck))
    send[:n, ck:].copy_(v.reshape(n, cv))
    if n < m:
        send[n:].zero_()
    rows = k.new_empty(shards.world_size * m, ck + cv)
    _all_gather_single(rows.view(torch.uint8), send.view(torch.uint8), group)
    if shards.row_index is not None:
        index = shards.row_index.to(rows.device, non_blocking=True)
        rows = rows.view(torch.uint8).index_select(0, index).view(k.dtype)
    return rows[:, :ck].view(t, kvh, d), rows[:, ck:].view(t, kvh, dv)


def _all_gather_single(out: torch.Tensor, inp: torch.Tensor, group: Optional["dist.ProcessGroup"]) -> None:
    """`all_gather_single` (torch >= 2.13) or its older name `all_gather_into_tensor`."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _row_index(sizes: Sequence[int], device: torch.device) -> Optional[torch.Tensor]:
    """For unequal shards, the gathered rows that hold tokens (rank r's at r * max_size + [0, sizes[r])): built
    on the host (whatever torch's default device), then copied to `device`."""
    m = max(sizes, default=0)
    if all(s == m for s in sizes):
        return None
    cpu = torch.device("cpu")
    rows = torch.arange(len(sizes) * m, device=cpu).view(len(sizes), m)
    keep = torch.arange(m, device=cpu) < torch.tensor(list(sizes), device=cpu).unsqueeze(1)
    return rows[keep].to(device)


def _checked_row_index(sizes: Sequence[int], row_index: object) -> None:
    """ShardError unless a hand-built `row_index` is the int64 tensor `sizes` gives (`_row_index`; for equal
    sizes, every row in order), naming both; compared on the host, once per CPShards."""
    if not isinstance(row_index, torch.Tensor) or row_index.dtype != torch.int64:
        got = f"a {str(row_index.dtype).replace('torch.', '')} tensor" if isinstance(row_index, torch.Tensor) \
            else type(row_index).__name__
        raise ShardError(f"CPShards: row_index must be an int64 tensor, got {got} (the gathered row of each token, "
                         f"sizes {list(sizes)}; leave it None to derive it)")
    if row_index.device.type == "meta":
        raise ShardError(f"CPShards: row_index is on the meta device, which holds no values (sizes {list(sizes)}; "
                         "leave it None to derive it)")
    t = sum(sizes)
    if tuple(row_index.shape) != (t,):
        raise ShardError(f"CPShards: row_index has shape {list(row_index.shape)}, expected "
                         f"[{t}] (the gathered row of each token, sizes {list(sizes)})")
    cpu = torch.device("cpu")
    want = _row_index(sizes, cpu)
    want = torch.arange(t, device=cpu) if want is None else want
    have = row_index.to(cpu)
    if not torch.equal(have, want):
        raise ShardError(f"CPShards: row_index {_show(have)} is not the gathered row of each token for sizes "
                         f"{list(sizes)} (expected {_show(want)}); leave it None to derive it")


def _show(index: torch.Tensor, most: int = 16) -> str:
    """An index as a list, its head only when long."""
    items = index[:most].tolist()
    return str(items) if index.numel() <= most else f"{str(items)[:-1]}, ... ({index.numel()} in all)]"


def _rank_and_world(group: Optional["dist.ProcessGroup"]) -> Tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("torch.distributed is not initialized: call "
                          "init_process_group(hwkv.distributed.default_backend(device), ...) first")
    try:
        rank = dist.get_rank(group)
    except ValueError:  # torch's "Group 5 is not registered, ..."
        raise ConfigError(f"group={group!r} is not a process group of this process: pass None (the default group) "
                          "or one that torch.distributed.new_group made and did not destroy") from None
    if rank < 0:
        raise ConfigError("this process is not a member of the context-parallel group")
    return rank, dist.get_world_size(group)




def _agree(row: Sequence[int], group: Optional["dist.ProcessGroup"], device: torch.device,
           tail: Optional[torch.Tensor] = None) -> List[List[int]]:
    """All-gather one int64 row per rank and read the table on the host: every rank gets the same verdict. `tail`:
    int64 values computed on the device, appended to the row (every rank's row must be as wide)."""
    if tail is None:
        mine = torch.tensor(list(row), dtype=torch.int64, device=device)
    else:
        mine = torch.cat([torch.tensor(list(row), dtype=torch.int64, device=device), tail])
    table = torch.empty(dist.get_world_size(group) * mine.numel(), dtype=torch.int64, device=device)
    _all_gather_single(table, mine, group)
    return table.view(-1, mine.numel()).tolist()
