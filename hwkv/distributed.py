"""Context parallelism over torch.distributed: each rank computes the K/V of its shard of one forward's
new tokens; the shards are all-gathered and every rank writes the full K/V into its own pool.

Three lifetimes, as everywhere in hwkv:
- per forward, the backend's metadata step translates the write locs once
  (`backend.forward_metadata.write_loc`, a KVWriteLoc); nothing here translates;
- per forward, `cp_plan` agrees on the shard sizes (one small collective, one host read);
- per layer, `cp_allgather_and_save_kv` gathers K and V in one collective and writes them through
  `pool.set_kv_buffer` with the pre-translated `swa_loc`.

Bad input: a rank that raised alone would leave the others blocked in the collective it skipped. So every
check is a row of ints that all ranks all-gather; each rank reads the same table, so all raise the same
typed error before any rank writes its pool.
"""
from __future__ import annotations

import enum
import functools
import re
import zlib
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from hwkv.errors import ConfigError, HwkvError, LocError, MissingSWALocError, ShapeError, ShardError
from hwkv.layer import AttentionLayer
from hwkv.loc import KVWriteLoc
from hwkv.pool import MHATokenToKVPool, SWAKVPool

Pool = Union[SWAKVPool, MHATokenToKVPool]

# The collective backend per device type, by name only: the core imports no vendor library. ROCm builds
# of torch use the "cuda" device type and name RCCL "nccl"; "rocm" is hwkv's device name for them.
BACKENDS: Dict[str, str] = {"cuda": "nccl", "rocm": "nccl", "npu": "hccl", "xpu": "xccl", "musa": "mccl",
                            "cpu": "gloo"}


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
    """One forward's shard layout, agreed by every rank (`cp_plan`, once per forward): rank r holds the
    forward's tokens [offsets[r], offsets[r + 1]) in write_loc order; sizes may differ, zero included."""

    rank: int
    sizes: Tuple[int, ...]
    # unequal sizes: the rows of the gather (padded to max_size per rank) that hold tokens, in token order
    row_index: Optional[torch.Tensor] = None

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
            group: Optional["dist.ProcessGroup"] = None, *,
            device: Union[None, str, torch.device] = None) -> CPShards:
    """Agree on one forward's shards: each rank's token count and shard size are all-gathered (one small
    collective and one host read, once per forward) and checked the same way on every rank.

    `write_loc_or_num_tokens`: this forward's KVWriteLoc, or its length. `local_num_tokens`: this rank's
    shard size; None splits evenly (the first T % world ranks take one token more). `device`: where the
    sizes travel, which must suit the group's backend (cuda for NCCL); default the write locs' device,
    else CPU. Raises on every rank: ShardError when ranks disagree on the token count or the shards do
    not add up to it, LocError when a rank's write_loc is neither a KVWriteLoc nor an int >= 0.
    """
    return _plan(write_loc_or_num_tokens, local_num_tokens, group, device, accept_int=True)


def _plan(x: object, local_num_tokens: Optional[int], group: Optional["dist.ProcessGroup"],
          device: Union[None, str, torch.device], accept_int: bool) -> CPShards:
    """`cp_plan`; the per-layer call's inline plan passes accept_int=False (it needs a KVWriteLoc)."""
    rank, world = _rank_and_world(group)
    if isinstance(x, KVWriteLoc):
        n: Optional[int] = len(x)
        device = x.loc.device if device is None else device
    elif accept_int and _is_int(x):
        n = int(x)
    else:
        n = None
    device = torch.device("cpu" if device is None else device)
    if n is None:
        row = _row(_Fail.LOC_TYPE, 0, 0, _name_code(type(x).__name__), int(accept_int))
    elif n < 0:
        row = _row(_Fail.TOKENS, 0, 0, n)
    elif local_num_tokens is None:
        base, extra = divmod(n, world)
        row = _row(_Fail.OK, 0, 0, n, base + (rank < extra))
    elif not _is_int(local_num_tokens) or not 0 <= local_num_tokens <= n:
        is_int = _is_int(local_num_tokens)
        row = _row(_Fail.LOCAL, 0, 0, n, int(local_num_tokens) if is_int else -1, int(is_int))
    else:
        row = _row(_Fail.OK, 0, 0, n, int(local_num_tokens))
    table = _agree(row, group, device)
    _raise_first(table)
    counts = [r[3] for r in table]
    if len(set(counts)) > 1:
        raise ShardError(f"ranks disagree on the forward's token count (len(write_loc)): {counts} in rank "
                         "order; every rank must write the same new tokens")
    sizes = tuple(r[4] for r in table)
    if sum(sizes) != counts[0]:
        raise ShardError(f"shards of {list(sizes)} tokens (rank order) add up to {sum(sizes)}, "
                         f"len(write_loc) is {counts[0]} on every rank")
    return CPShards(rank, sizes, _row_index(sizes, device))


def cp_allgather_and_save_kv(pool: Pool, layer: AttentionLayer, write_loc: KVWriteLoc, k: torch.Tensor, v: torch.Tensor,
                             group: Optional["dist.ProcessGroup"] = None, *,
                             shards: Optional[CPShards] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gather every rank's shard of one layer's K/V and write the full K/V into this rank's pool.

    k [n_r, KVH, D], v [n_r, KVH, Dv]: this rank's shard (`shards.local_slice` of the forward's tokens),
    never modified. `write_loc`: the metadata step's KVWriteLoc; an SWA layer writes its `swa_loc` as
    is (never translated here), a full layer ignores it. `shards`: this forward's `cp_plan`; without it
    the plan is made here (one more small collective per call). Per call: one small all-gather of the
    checks (one host read: eager only), one of K and V together, one pool write.

    Returns (k_full, v_full) [T, KVH, D] / [T, KVH, Dv] in token order for a caller that also attends
    with them: views into one gathered buffer (row stride KVH * (D + Dv), last dim contiguous).
    Bad input on any rank raises the same typed error on every rank, and no rank writes.
    """
    pool_device = torch.device(getattr(pool, "device", "cpu"))
    if shards is None:
        local = k.shape[0] if isinstance(k, torch.Tensor) and k.dim() == 3 else None
        shards = _plan(write_loc, local, group, pool_device, accept_int=False)
    rank, world = _rank_and_world(group)
    table = _agree(_layer_row(pool, layer, write_loc, k, v, shards, rank, world, pool_device), group, pool_device)
    _raise_first(table)
    layer_ids = [r[1] for r in table]
    if len(set(layer_ids)) > 1:
        raise ShardError(f"ranks save different layers in one call: layer ids {layer_ids} in rank order")
    dtypes = [r[2] for r in table]
    if len(set(dtypes)) > 1:
        raise ShapeError(f"ranks' K/V dtypes differ: {[_name(c) for c in dtypes]} in rank order; "
                         "the gather needs one dtype")
    k_full, v_full = _gather_kv(k, v, shards, group)
    pool.set_kv_buffer(layer, write_loc, k_full, v_full, layer.k_scale, layer.v_scale)
    return k_full, v_full


# ---- the gather ----------------------------------------------------------------------------------------

def _gather_kv(k: torch.Tensor, v: torch.Tensor, shards: CPShards,
               group: Optional["dist.ProcessGroup"]) -> Tuple[torch.Tensor, torch.Tensor]:
    """K and V side by side in one [max_size, KVH * (D + Dv)] send buffer per rank (padded rows zeroed),
    one all-gather, then the padded rows dropped with one index_select (only for unequal shards)."""
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
    _all_gather_single(rows, send, group)
    if shards.row_index is not None:
        rows = rows.index_select(0, shards.row_index.to(rows.device, non_blocking=True))
    return rows[:, :ck].view(t, kvh, d), rows[:, ck:].view(t, kvh, dv)


def _all_gather_single(out: torch.Tensor, inp: torch.Tensor, group: Optional["dist.ProcessGroup"]) -> None:
    """`all_gather_single` (torch >= 2.13) or its older name `all_gather_into_tensor`."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _row_index(sizes: Sequence[int], device: torch.device) -> Optional[torch.Tensor]:
    """For unequal shards, the gathered rows that hold tokens (rank r's at r * max_size + [0, sizes[r]))."""
    m = max(sizes, default=0)
    if all(s == m for s in sizes):
        return None
    rows = torch.arange(len(sizes) * m).view(len(sizes), m)
    keep = torch.arange(m) < torch.tensor(list(sizes)).unsqueeze(1)
    return rows[keep].to(device)


# ---- checks every rank agrees on -----------------------------------------------------------------------

class _Fail(enum.IntEnum):
    OK = 0
    LOC_TYPE = 1
    TOKENS = 2
    LOCAL = 3
    PLAN = 4
    LAYER = 5
    NOT_TENSOR = 6
    SHAPE = 7
    DTYPE = 8
    DEVICE = 9
    GEOMETRY = 10
    NO_SWA_LOC = 11


_WIDTH = 12  # one check's row: [code, layer_id, dtype code, payload x 9]


def _row(code: _Fail, layer_id: int, dtype: int, *payload: int) -> List[int]:
    return [int(code), layer_id, dtype, *payload] + [0] * (_WIDTH - 3 - len(payload))


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _rank_and_world(group: Optional["dist.ProcessGroup"]) -> Tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("torch.distributed is not initialized: call "
                          "init_process_group(hwkv.distributed.default_backend(device), ...) first")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ConfigError("this process is not a member of the context-parallel group")
    return rank, dist.get_world_size(group)


def _agree(row: Sequence[int], group: Optional["dist.ProcessGroup"], device: torch.device) -> List[List[int]]:
    """All-gather one int64 row per rank and read the table on the host: every rank gets the same verdict."""
    mine = torch.tensor(list(row), dtype=torch.int64).to(device)
    table = torch.empty(dist.get_world_size(group) * len(row), dtype=torch.int64, device=device)
    _all_gather_single(table, mine, group)
    return table.view(-1, len(row)).tolist()


def _name_code(name: str) -> int:
    """A process-independent int for a dtype, device or type name (Python's str hash is salted per process)."""
    return zlib.crc32(name.encode())


@functools.lru_cache(maxsize=None)
def _names() -> Dict[int, str]:
    names = {str(v) for v in vars(torch).values() if isinstance(v, torch.dtype)}
    names |= set(BACKENDS) | {"meta", "mps", "hpu", "privateuseone", "Tensor", "NoneType", "int", "float",
                              "bool", "tuple", "list", "dict"}
    return {_name_code(n): n for n in names}


def _name(code: int) -> str:
    return _names().get(code, "another type")


def _pool_group(pool: Pool, layer_id: int) -> Tuple[bool, Optional[Tuple[int, int, int]], bool]:
    """(the pool holds layer_id, its group's (KVH, D, Dv) when the pool says, is an SWA layer)."""
    mapping = getattr(pool, "layers_mapping", None)
    if mapping is not None:
        if layer_id not in mapping:
            return False, None, False
        is_swa = bool(mapping[layer_id][1])
        sub = pool.swa_kv_pool if is_swa else pool.full_kv_pool
    else:
        num = getattr(pool, "layer_num", None)
        if num is not None and not 0 <= layer_id < num:
            return False, None, False
        is_swa, sub = False, pool
    dims = tuple(getattr(sub, a, None) for a in ("head_num", "head_dim", "v_head_dim"))
    return True, (dims if None not in dims else None), is_swa


def _layer_row(pool: Pool, layer: AttentionLayer, write_loc: object, k: object, v: object, shards: CPShards, rank: int,
               world: int, pool_device: torch.device) -> List[int]:
    """This rank's verdict on one call's inputs, as a row (code OK carries the layer id and dtype that
    the ranks must also agree on)."""
    lid = int(layer.layer_id)
    dtype = _name_code(str(k.dtype)) if isinstance(k, torch.Tensor) else 0

    def row(code: _Fail, *payload: int) -> List[int]:
        return _row(code, lid, dtype, *payload)

    if not isinstance(write_loc, KVWriteLoc):
        return row(_Fail.LOC_TYPE, _name_code(type(write_loc).__name__), 0)
    if (shards.world_size, shards.rank, shards.num_tokens) != (world, rank, len(write_loc)):
        return row(_Fail.PLAN, shards.world_size, world, shards.rank, rank, shards.num_tokens, len(write_loc))
    held, group_dims, is_swa = _pool_group(pool, lid)
    if not held:
        return row(_Fail.LAYER)
    for which, t in ((0, k), (1, v)):
        if not isinstance(t, torch.Tensor):
            return row(_Fail.NOT_TENSOR, which, _name_code(type(t).__name__))
    n, kvh, d, dv = shards.local_size, layer.num_kv_heads, layer.head_dim, layer.v_head_dim
    for which, t, want in ((0, k, (n, kvh, d)), (1, v, (n, kvh, dv))):
        if tuple(t.shape) != want:
            dims = list(t.shape[:3]) + [-1] * (3 - min(t.dim(), 3))
            return row(_Fail.SHAPE, which, t.dim(), *dims, *want)
    if k.dtype != v.dtype:
        return row(_Fail.DTYPE, _name_code(str(k.dtype)), _name_code(str(v.dtype)))
    for which, t in ((0, k), (1, v)):
        if t.device.type != pool_device.type:
            return row(_Fail.DEVICE, which, _name_code(t.device.type), _name_code(pool_device.type))
    if group_dims is not None and group_dims != (kvh, d, dv):
        return row(_Fail.GEOMETRY, kvh, d, dv, *group_dims)
    if is_swa and write_loc.swa_loc is None:
        return row(_Fail.NO_SWA_LOC)
    return row(_Fail.OK)


def _raise_first(table: List[List[int]]) -> None:
    """Raise the first failing rank's error (rank order), identically on every rank."""
    for rank, r in enumerate(table):
        if r[0] != _Fail.OK:
            raise _error(rank, r)


def _error(rank: int, r: List[int]) -> HwkvError:
    code, lid, p = _Fail(r[0]), r[1], r[3:]
    kv = ("k", "v")
    at = f"rank {rank}: layer {lid}:"
    if code == _Fail.LOC_TYPE:
        what = "a KVWriteLoc or an int token count" if p[1] else "a KVWriteLoc"
        return LocError(f"rank {rank}: write_loc must be {what} (backend.forward_metadata.write_loc, built "
                        f"once per forward), got {_name(p[0])}")
    if code == _Fail.TOKENS:
        return ShardError(f"rank {rank}: the forward's token count must be >= 0, got {p[0]}")
    if code == _Fail.LOCAL:
        got = p[1] if p[2] else "a non-int"
        return ShardError(f"rank {rank}: local_num_tokens must be an int in [0, {p[0]}] (the forward's "
                          f"tokens), got {got}")
    if code == _Fail.PLAN:
        return ShardError(f"{at} the CPShards plan is for rank {p[2]} of {p[0]} and {p[4]} tokens, this call is "
                          f"rank {p[3]} of {p[1]} with len(write_loc)={p[5]}: plan once per forward, from "
                          "this forward's write_loc and group")
    if code == _Fail.LAYER:
        return ConfigError(f"rank {rank}: layer_id {lid} is in none of the pool's layer groups")
    if code == _Fail.NOT_TENSOR:
        return ShapeError(f"{at} {kv[p[0]]} must be a torch.Tensor, got {_name(p[1])}")
    if code == _Fail.SHAPE:
        ndim, dims, want = p[1], [x for x in p[2:5] if x >= 0], p[5:8]
        shape = f"{dims}" if ndim <= 3 else f"{ndim}-D {dims[:3]}..."
        dim_name = "head_dim" if p[0] == 0 else "v_head_dim"
        return ShapeError(f"{at} {kv[p[0]]} has shape {shape}, expected {list(want)} (the shard of rank {rank} "
                          f"holds {want[0]} tokens; the layer's num_kv_heads={want[1]}, {dim_name}={want[2]})")
    if code == _Fail.DTYPE:
        return ShapeError(f"{at} k is {_name(p[0])}, v is {_name(p[1])}: one gather carries both, so they "
                          "must share a dtype")
    if code == _Fail.DEVICE:
        return ShapeError(f"{at} {kv[p[0]]} is on {_name(p[1])}, the pool is on {_name(p[2])}")
    if code == _Fail.GEOMETRY:
        return ShapeError(f"{at} num_kv_heads={p[0]}, head_dim={p[1]}, v_head_dim={p[2]} do not match its pool "
                          f"group's [{p[3]}, {p[4]}, {p[5]}]")
    if code == _Fail.NO_SWA_LOC:
        return MissingSWALocError(f"{at} an SWA layer, but write_loc has no swa_loc: pass the metadata "
                                  "step's KVWriteLoc (backend.forward_metadata.write_loc), translated once "
                                  "per forward")
    raise AssertionError(f"unhandled check code {code!r}")
