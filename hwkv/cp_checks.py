"""The rows context parallelism agrees on across ranks (`hwkv.distributed`): check codes, one int64 row per
rank and check, and the typed error every rank raises from the gathered table.

A rank that raised alone would leave the others blocked in the collective it skipped, so every check's verdict
is a row of `WIDTH` ints ([code, layer id, dtype code, payload]) that all ranks all-gather; each reads the same
table and raises the same error (`raise_first`, `error_of`). Names (dtypes, device types, Python types) travel
as process-independent codes (`name_code`).
"""
from __future__ import annotations

import enum
import functools
import zlib
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple, Union

import torch

from hwkv.checks import is_int
from hwkv.errors import ConfigError, DeviceError, HwkvError, LocError, MissingSWALocError, ShapeError, ShardError
from hwkv.layer import AttentionLayer
from hwkv.loc import KVWriteLoc
from hwkv.pool import MHATokenToKVPool, SWAKVPool

if TYPE_CHECKING:
    from hwkv.distributed import CPShards

Pool = Union[SWAKVPool, MHATokenToKVPool]
Dims = Tuple[int, int, int]  # one layer group's (KVH, D, Dv)
# torch device types a row may name (besides dtypes and a few Python types)
_DEVICE_TYPES = ("cpu", "cuda", "npu", "xpu", "musa", "meta", "mps", "hpu", "privateuseone")




def is_pool(x: object) -> bool:
    """A KV pool the layers can write (`Pool`): what `pool=` must be."""
    return isinstance(x, (SWAKVPool, MHATokenToKVPool))


def dims_of(sub: object) -> Optional[Dims]:
    dims = tuple(getattr(sub, a, None) for a in ("head_num", "head_dim", "v_head_dim"))
    return dims if all(is_int(d) for d in dims) else None  # type: ignore[return-value]




# ---- rows --------------------------------------------------------------------------------------------

class Fail(enum.IntEnum):
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
    PLAN_DTYPE = 12
    PLAN_DEVICE = 13
    PLAN_POOL = 14
    NO_DTYPE = 15
    RAISED = 16
    NOT_POOL = 17
    NOT_LAYER = 18


# one check's row: [code, layer_id, dtype code, payload x 13]; a plan row's payload: token count, shard
# size, has swa_loc (-1 unknown), check_ranks, device type, pool given, full (KVH, D, Dv), SWA (KVH, D, Dv),
# SWA-layer checksum; a layer row's, when OK: the layer's (KVH, D, Dv)
WIDTH = 16
Failure = Tuple[Fail, Tuple[int, ...]]
I64_MAX = 2**63 - 1
OUTSIDE = -2**63  # what a row carries for an int outside [-2**63 + 1, 2**63 - 1] (a caller's count, a layer's id)
# the refusals a rank raises from its own state, carried to every rank as their type and message (`carried_row`)
CARRIED = {zlib.crc32(e.__name__.encode()): e for e in (ConfigError, DeviceError)}


def row(code: Fail, layer_id: int, dtype: int, *payload: int) -> List[int]:
    values = [int(code), layer_id, dtype, *payload] + [0] * (WIDTH - 3 - len(payload))
    return [x if -I64_MAX <= x <= I64_MAX else OUTSIDE for x in values]


def show(x: int) -> str:
    return "an int outside [-2**63 + 1, 2**63 - 1]" if x == OUTSIDE else str(x)


def carried_row(e: HwkvError) -> List[int]:
    """A refusal only this rank can see, as a row: its type and the first 96 bytes of its message."""
    room = 8 * (WIDTH - 4)
    text = str(e).encode()
    text = (text if len(text) <= room else text[:room - 3] + b"...").ljust(room, b"\0")
    words = [int.from_bytes(text[i:i + 8], "little", signed=True) for i in range(0, room, 8)]
    return row(Fail.RAISED, 0, 0, name_code(type(e).__name__), *words)


def name_code(name: str) -> int:
    """A process-independent int for a dtype, device or type name (Python's str hash is salted per process)."""
    return zlib.crc32(name.encode())


@functools.lru_cache(maxsize=None)
def _names() -> Dict[int, str]:
    names = {str(v) for v in vars(torch).values() if isinstance(v, torch.dtype)}
    names |= set(_DEVICE_TYPES) | {"rocm", "Tensor", "NoneType", "int", "float", "bool", "tuple", "list", "dict",
                                   "str", "bytes", "object"}
    return {name_code(n): n for n in names}


def type_name(code: int) -> str:
    return _names().get(code, "another type")


def pool_group(pool: Pool, layer_id: int) -> Tuple[bool, Optional[Dims], bool]:
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
    return True, dims_of(sub), is_swa


def layer_fail(pool: Pool, layer: AttentionLayer, write_loc: object, k: object, v: object, n: Optional[int],
                plan: Optional["CPShards"], rank: int, world: int, pool_device: torch.device) -> Optional[Failure]:
    """This rank's verdict on one call's inputs, from local values only (shape tuples, dtypes, device
    types, the pool's attributes and the plan): None when they are fine. `n`: the expected shard size
    (None: the plan's); `plan`: the forward's plan to check against (None: the plan-less call, which
    agrees on it in the same collective)."""
    if not is_pool(pool):
        return Fail.NOT_POOL, (name_code(type(pool).__name__),)
    if not isinstance(layer, AttentionLayer):
        return Fail.NOT_LAYER, (name_code(type(layer).__name__),)
    if not isinstance(write_loc, KVWriteLoc):
        return Fail.LOC_TYPE, (name_code(type(write_loc).__name__), 0)
    if plan is not None and (plan.world_size, plan.rank, plan.num_tokens) != (world, rank, len(write_loc)):
        return Fail.PLAN, (plan.world_size, world, plan.rank, rank, plan.num_tokens, len(write_loc))
    if n is None:
        n = plan.local_size if plan is not None else 0
    held, group_dims, is_swa = pool_group(pool, int(layer.layer_id))
    if not held:
        return Fail.LAYER, ()
    for which, t in ((0, k), (1, v)):
        if not isinstance(t, torch.Tensor):
            return Fail.NOT_TENSOR, (which, name_code(type(t).__name__))
    kvh, d, dv = layer.num_kv_heads, layer.head_dim, layer.v_head_dim
    for which, t, want in ((0, k, (n, kvh, d)), (1, v, (n, kvh, dv))):
        if t.shape != want:
            dims = list(t.shape[:3]) + [-1] * (3 - min(t.dim(), 3))
            return Fail.SHAPE, (which, t.dim(), *dims, *want)
    if k.dtype != v.dtype:
        return Fail.DTYPE, (name_code(str(k.dtype)), name_code(str(v.dtype)))
    if plan is not None and plan.dtype is not None and k.dtype != plan.dtype:
        return Fail.PLAN_DTYPE, (name_code(str(k.dtype)), name_code(str(plan.dtype)))
    for which, t in ((0, k), (1, v)):
        if plan is not None and plan.device_type is not None and t.device.type != plan.device_type:
            return Fail.PLAN_DEVICE, (which, name_code(t.device.type), name_code(plan.device_type))
        if t.device.type != pool_device.type:
            return Fail.DEVICE, (which, name_code(t.device.type), name_code(pool_device.type))
    if group_dims is not None and group_dims != (kvh, d, dv):
        return Fail.GEOMETRY, (kvh, d, dv, *group_dims)
    if plan is not None and plan.groups is not None:
        agreed = plan.groups[is_swa]
        if group_dims != agreed:
            return Fail.PLAN_POOL, (int(is_swa), *(group_dims or (-1, -1, -1)), *(agreed or (-1, -1, -1)))
    if is_swa and write_loc.swa_loc is None:
        return Fail.NO_SWA_LOC, ()
    return None


def layer_row(layer: AttentionLayer, k: object, fail: Optional[Failure]) -> List[int]:
    """A verdict as a row; code OK carries what the ranks must also agree on: the layer id, the K/V dtype and
    the layer's (KVH, D, Dv) (which the local checks matched to k, v and the pool's group). A `layer` that is no
    AttentionLayer (a NOT_LAYER verdict) travels as layer id 0."""
    dtype = name_code(str(k.dtype)) if isinstance(k, torch.Tensor) else 0
    if fail is not None:
        return row(fail[0], int(layer.layer_id) if isinstance(layer, AttentionLayer) else 0, dtype, *fail[1])
    return row(Fail.OK, int(layer.layer_id), dtype, layer.num_kv_heads, layer.head_dim, layer.v_head_dim)


def check_layer_table(table: List[List[int]]) -> None:
    """What only the ranks together can tell about one call (rows already free of failures)."""
    layer_ids = [r[1] for r in table]
    if len(set(layer_ids)) > 1:
        raise ShardError(f"ranks save different layers in one call: layer ids {[show(i) for i in layer_ids]} in "
                         "rank order")
    dtypes = [r[2] for r in table]
    if len(set(dtypes)) > 1:
        raise ShapeError(f"ranks' K/V dtypes differ: {[type_name(c) for c in dtypes]} in rank order; "
                         "the gather needs one dtype")
    dims = [r[3:6] for r in table]
    if any(d != dims[0] for d in dims):
        raise ShapeError(f"ranks save layers of different geometry: [KVH, D, Dv] {dims} in rank order; the "
                         "gather needs one row size (cp_plan's pool= compares the pools once per forward)")


def raise_first(table: List[List[int]]) -> None:
    """Raise the first failing rank's error (rank order), identically on every rank."""
    for rank, r in enumerate(table):
        if r[0] != Fail.OK:
            raise error_of(rank, r)


def error_of(rank: int, r: List[int]) -> HwkvError:
    code, lid, p = Fail(r[0]), r[1], r[3:]
    kv = ("k", "v")
    at = f"rank {rank}: layer {show(lid)}:"
    if code == Fail.LOC_TYPE:
        what = "a KVWriteLoc or an int token count" if p[1] else "a KVWriteLoc"
        return LocError(f"rank {rank}: write_loc must be {what} (backend.forward_metadata.write_loc, built "
                        f"once per forward), got {type_name(p[0])}")
    if code == Fail.TOKENS:
        return ShardError(f"rank {rank}: the forward's token count must be in [0, 2**63 - 1], got {show(p[0])}")
    if code == Fail.LOCAL:
        got = show(p[1]) if p[2] else "a non-int"
        return ShardError(f"rank {rank}: local_num_tokens must be an int in [0, {p[0]}] (the forward's "
                          f"tokens), got {got}")
    if code == Fail.PLAN:
        return ShardError(f"{at} the CPShards plan is for rank {p[2]} of {p[0]} and {p[4]} tokens, this call is "
                          f"rank {p[3]} of {p[1]} with len(write_loc)={p[5]}: plan once per forward, from "
                          "this forward's write_loc and group")
    if code == Fail.NOT_POOL:
        return ConfigError(f"rank {rank}: pool= must be a KV pool (an SWAKVPool or MHATokenToKVPool: the pool the "
                           f"layers write), got {type_name(p[0])}")
    if code == Fail.NOT_LAYER:
        return ConfigError(f"rank {rank}: layer must be an hwkv.layer.AttentionLayer (the layer whose K/V are "
                           f"saved), got {type_name(p[0])}")
    if code == Fail.LAYER:
        return ConfigError(f"rank {rank}: layer_id {show(lid)} is in none of the pool's layer groups")
    if code == Fail.NOT_TENSOR:
        return ShapeError(f"{at} {kv[p[0]]} must be a torch.Tensor, got {type_name(p[1])}")
    if code == Fail.SHAPE:
        ndim, dims, want = p[1], [x for x in p[2:5] if x >= 0], [show(x) for x in p[5:8]]
        shape = f"{dims}" if ndim <= 3 else f"{ndim}-D {dims[:3]}..."
        dim_name = "head_dim" if p[0] == 0 else "v_head_dim"
        return ShapeError(f"{at} {kv[p[0]]} has shape {shape}, expected [{', '.join(want)}] (the shard of rank "
                          f"{rank} holds {want[0]} tokens; the layer's num_kv_heads={want[1]}, {dim_name}={want[2]})")
    if code == Fail.DTYPE:
        return ShapeError(f"{at} k is {type_name(p[0])}, v is {type_name(p[1])}: one gather carries both, so they "
                          "must share a dtype")
    if code == Fail.PLAN_DTYPE:
        return ShapeError(f"{at} k and v are {type_name(p[0])}, the plan agreed on {type_name(p[1])} "
                          "(cp_plan's dtype=, default the pool's)")
    if code == Fail.DEVICE:
        return ShapeError(f"{at} {kv[p[0]]} is on {type_name(p[1])}, the pool is on {type_name(p[2])}")
    if code == Fail.PLAN_DEVICE:
        return ShapeError(f"{at} {kv[p[0]]} is on {type_name(p[1])}, the plan agreed on {type_name(p[2])}")
    if code == Fail.GEOMETRY:
        return ShapeError(f"{at} num_kv_heads={show(p[0])}, head_dim={show(p[1])}, v_head_dim={show(p[2])} do "
                          f"not match its pool group's [{p[3]}, {p[4]}, {p[5]}]")
    if code == Fail.PLAN_POOL:
        groups = [None if x[0] < 0 else list(x) for x in (p[1:4], p[4:7])]
        return ShapeError(f"{at} its pool's {'SWA' if p[0] else 'full'} group is {groups[0]} [KVH, D, Dv], the "
                          f"plan agreed on {groups[1]}: plan with the pool the layers write (cp_plan's pool=)")
    if code == Fail.NO_SWA_LOC:
        return MissingSWALocError(f"{at} an SWA layer, but write_loc has no swa_loc: pass the metadata "
                                  "step's KVWriteLoc (backend.forward_metadata.write_loc), translated once "
                                  "per forward")
    if code == Fail.NO_DTYPE:
        return ConfigError(f"rank {rank}: cp_plan(pool=) of a {type_name(p[0]) if p[0] else 'dtype-less'} pool needs "
                           "dtype=, the dtype of every layer's k and v: an fp8 pool stores K/V quantized from a "
                           "compute dtype only the caller knows, and the ranks must agree on it")
    if code == Fail.RAISED:
        text = b"".join(w.to_bytes(8, "little", signed=True) for w in p[1:WIDTH - 3]).rstrip(b"\0")
        return CARRIED.get(p[0], HwkvError)(f"rank {rank}: cp_plan: {text.decode(errors='ignore')}")
    raise AssertionError(f"unhandled check code {code!r}")
