"""KV pools: one layer group (`MHATokenToKVPool`) and the hybrid full + SWA pair (`SWAKVPool`)."""
from __future__ import annotations

import os
import weakref
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple, Union

import torch

from hwkv import ops
from hwkv.checks import (as_int, as_layer_id, check_device, check_index_tensor, check_loc, check_scale, check_shape,
                         first_repeat, is_int, normal_tensors, values_checkable)
from hwkv.errors import CapacityError, ConfigError, EvictedSlotError, LocError, MissingSWALocError, ShapeError
from hwkv.loc import KVWriteLoc, ListRefill, LocRuns

DTYPES = (torch.float32, torch.float16, torch.bfloat16) + ops.FP8_DTYPES
# the dtypes models compute K/V in: writing them into any pool is an intended cast (downcast, fp8 quantization)
WORKING_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _lossless(src: torch.dtype, dst: torch.dtype) -> bool:
    """Every finite `src` value is exactly a `dst` value (both floating): finer steps, wider range."""
    if not (src.is_floating_point and dst.is_floating_point):
        return False
    a, b = torch.finfo(src), torch.finfo(dst)
    return b.eps <= a.eps and b.max >= a.max and b.smallest_normal <= a.smallest_normal


def writable_dtypes(dtype: torch.dtype) -> FrozenSet[torch.dtype]:
    """K/V dtypes a pool of `dtype` takes: its own, the working dtypes (fp32/fp16/bf16: an intended cast)
    and any dtype it holds losslessly (e.g. fp8 into bf16). float64 into a lower-precision pool, integer
    or complex K/V are refused: a silent lossy cast hides a caller bug."""
    candidates = (torch.float64,) + DTYPES
    return frozenset({dtype, *WORKING_DTYPES} | {d for d in candidates if _lossless(d, dtype)})


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def device_free_bytes(device: Union[str, torch.device], meminfo: str = "/proc/meminfo") -> Optional[int]:
    """Memory free for new buffers on `device`: MemAvailable on the CPU (free RAM plus reclaimable cache; else
    sysconf's free pages), the runtime's mem_get_info on accelerators; None when the device cannot say."""
    dev = torch.device(device)
    if dev.type == "cpu":
        try:
            with open(meminfo) as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    info = getattr(getattr(torch, dev.type, None), "mem_get_info", None)
    if info is None:
        return None
    try:
        return int(info(dev)[0])
    except Exception:  # a runtime that cannot answer: no check, the allocation itself decides
        return None


def check_memory_fits(what: str, nbytes: int, device: torch.device, holding: str = "its K/V buffers") -> None:
    """ConfigError before allocating `nbytes` on `device` when it has less free (what it needs vs has)."""
    free = device_free_bytes(device)
    if free is not None and nbytes > free:
        raise ConfigError(f"{what} needs {nbytes} bytes ({_fmt_bytes(nbytes)}) for {holding}; {device} has "
                          f"{free} bytes ({_fmt_bytes(free)}) free")


_NOT_A_LAYER = "layer must be an attention layer with a layer_id (hwkv.AttentionLayer), got {}"


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' bytes overlap (same storage, intersecting spans)."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t: torch.Tensor) -> Tuple[int, int]:
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def default_swa_v_head_dim(head_dim: int, v_head_dim: int, swa_head_dim: int) -> int:
    """The SWA layers' V head dim where none is given: the full layers' V head dim when the SWA layers keep the full
    layers' K head dim, else their own K head dim (one rule for the pool, ModelShape and a Hugging Face config)."""
    return v_head_dim if swa_head_dim == head_dim else swa_head_dim


def _group_bytes(size: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int, v_head_dim: int,
                 layer_num: int) -> int:
    return layer_num * (size + page_size) * head_num * (head_dim + v_head_dim) * dtype.itemsize


class MHATokenToKVPool:
    """K/V buffers of one layer group: `k_buffer[i]`, `v_buffer[i]` are [size + page_size, H, D]."""

    @normal_tensors
    def __init__(self, size: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int,
                 layer_num: int, device: Union[str, torch.device], v_head_dim: Optional[int] = None,
                 _prechecked: bool = False) -> None:
        if dtype not in DTYPES:
            raise ConfigError(f"dtype {dtype} is not supported; use one of {[str(d) for d in DTYPES]}")
        v_head_dim = v_head_dim if v_head_dim is not None else head_dim
        for name, val, lo in (("size", size, 0), ("page_size", page_size, 1), ("head_num", head_num, 1),
                              ("head_dim", head_dim, 1), ("v_head_dim", v_head_dim, 1), ("layer_num", layer_num, 0)):
            if not is_int(val) or val < lo:
                raise ConfigError(f"{name}={val!r} must be an int >= {lo}")
        if size % page_size:
            raise ConfigError(f"size={size} must be a multiple of page_size={page_size}")
        self.size, self.page_size, self.dtype = size, page_size, dtype
        self.head_num, self.head_dim = head_num, head_dim
        self.v_head_dim = v_head_dim
        self.layer_num = layer_num
        self.device = check_device(device)
        if not _prechecked:
            check_memory_fits(f"MHATokenToKVPool(size={size}, {layer_num} layers)", _group_bytes(
                size, page_size, dtype, head_num, head_dim, self.v_head_dim, layer_num), self.device)
        self.kv_dtypes = writable_dtypes(dtype)
        rows = size + page_size  # slot 0 (page 0) is the padding slot
        self.k_buffer: List[torch.Tensor] = [
            torch.zeros(rows, head_num, head_dim, dtype=dtype, device=self.device) for _ in range(layer_num)]
        self.v_buffer: List[torch.Tensor] = [
            torch.zeros(rows, head_num, self.v_head_dim, dtype=dtype, device=self.device) for _ in range(layer_num)]
        self._buffer_device = self.k_buffer[0].device if layer_num else self.device  # with its index
        self._checked_loc: Optional[torch.Tensor] = None  # this forward's write locs, checked once
        self.loc_name = "loc"  # its write locs' name in errors ("swa_loc" for the SWA group of an SWAKVPool)

    def _layer(self, layer_id: int) -> int:
        if type(layer_id) is not int:  # (1.0 would be a bare TypeError at the list, True layer 1)
            if as_int(layer_id) is None:
                raise ConfigError(f"layer_id {layer_id!r} must be an integer, got {type(layer_id).__name__}")
            layer_id = as_int(layer_id)
        if not 0 <= layer_id < self.layer_num:
            raise ConfigError(f"layer_id {layer_id} out of range [0, {self.layer_num})")
        return layer_id

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[self._layer(layer_id)]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[self._layer(layer_id)]

    def get_kv_buffer(self, layer_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def bytes_per_token(self) -> int:
        """K + V bytes one token costs across this group's layers."""
        return self.layer_num * self.head_num * (self.head_dim + self.v_head_dim) * self.dtype.itemsize

    def check_write_loc(self, loc: Union[torch.Tensor, KVWriteLoc], name: str = "loc") -> None:
        """Check one forward's write locs once (the backend's metadata step calls this): the layers'
        `set_kv_buffer` calls then skip `check_loc` for exactly this tensor object, until the next
        forward's locs replace it. Values are checked where `check_loc` checks them (CPU, HWKV_DEBUG)."""
        if isinstance(loc, KVWriteLoc):
            loc = loc.loc
        check_loc(name, loc, self.size + self.page_size, self._buffer_device)
        self._checked_loc = loc

    def set_kv_buffer(self, layer: object, loc: Union[torch.Tensor, KVWriteLoc], cache_k: torch.Tensor,
                      cache_v: torch.Tensor, k_scale: Optional[float] = None, v_scale: Optional[float] = None,
                      layer_id_override: Optional[int] = None, swa_loc: Optional[torch.Tensor] = None) -> None:
        """Write the new tokens' K/V at `loc` (a KVWriteLoc's full locs); caller tensors are untouched.

        Per call this costs a layer-id check, host-attribute compares of K and V (type, shape, device,
        dtype), the scales' host check when there are scales, and the store launch: `loc` is checked here only
        when it is not the tensor `check_write_loc` checked for this forward. Every check runs before the
        store, so a refused call writes nothing (neither K nor V).
        """
        if isinstance(loc, KVWriteLoc):
            loc = loc.loc
        try:
            layer_id = self._layer(layer_id_override if layer_id_override is not None else layer.layer_id)
        except AttributeError:
            raise ConfigError(_NOT_A_LAYER.format(type(layer).__name__)) from None
        if torch.compiler.is_compiling() or loc is not self._checked_loc:
            check_loc(self.loc_name, loc, self.size + self.page_size, self._buffer_device)
        n, dev, dtypes = loc.shape[0], self._buffer_device, self.kv_dtypes
        if not (isinstance(cache_k, torch.Tensor) and isinstance(cache_v, torch.Tensor)) \
                or cache_k.shape != (n, self.head_num, self.head_dim) \
                or cache_v.shape != (n, self.head_num, self.v_head_dim) \
                or cache_k.device != dev or cache_v.device != dev \
                or cache_k.dtype not in dtypes or cache_v.dtype not in dtypes:
            self._refuse_kv(n, cache_k, cache_v)
        if k_scale is not None or v_scale is not None:
            check_scale("k_scale", k_scale)
            check_scale("v_scale", v_scale)
        ops.store_kv_prechecked(self.k_buffer[layer_id], self.v_buffer[layer_id], loc, cache_k, cache_v,
                                k_scale, v_scale)

    def _refuse_kv(self, n: int, cache_k: object, cache_v: object) -> None:
        """The ShapeError for K/V that `set_kv_buffer` cannot store (type, shape, device, then dtype)."""
        kv = (("cache_k", cache_k, self.head_dim), ("cache_v", cache_v, self.v_head_dim))
        for name, t, d in kv:
            if not isinstance(t, torch.Tensor):
                raise ShapeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            check_shape(name, t, (n, self.head_num, d))
        for name, t, _ in kv:
            if t.device != self._buffer_device:
                raise ShapeError(f"{name} is on {t.device}, the pool's buffers are on {self._buffer_device}: "
                                 "move it there first (hwkv does not copy K/V across devices)")
        for name, t, _ in kv:
            if t.dtype not in self.kv_dtypes:
                raise ShapeError(f"{name} is {t.dtype}, the pool stores {self.dtype}: a lossy cast hwkv does not "
                                 f"make silently; pass one of {', '.join(sorted(str(d) for d in self.kv_dtypes))}")

    def move_kv(self, src_loc: torch.Tensor, dst_loc: torch.Tensor) -> None:
        """Every layer's K/V at src_loc copied to dst_loc (gathered first, so overlaps are safe): speculative
        acceptance moves accepted draft tokens to the slots of their final positions."""
        self.check_move(src_loc, dst_loc)
        self.move_prechecked(src_loc, dst_loc)

    def check_move(self, src_loc: torch.Tensor, dst_loc: torch.Tensor) -> None:
        """`move_kv`'s argument checks alone (LocError naming the argument); moves nothing."""
        for name, t in (("src_loc", src_loc), ("dst_loc", dst_loc)):
            check_loc(name, t, self.size + self.page_size, self._buffer_device)
        if src_loc.shape != dst_loc.shape:
            raise LocError(f"move_kv: src_loc has {tuple(src_loc.shape)} entries, dst_loc {tuple(dst_loc.shape)}")
        if dst_loc.numel() > 1 and values_checkable(dst_loc):   # index_copy_ keeps one of a repeated dst's sources,
            flat = dst_loc.reshape(-1).cpu().numpy()              # which one unspecified on accelerators; the padding
            twice = first_repeat(flat[flat != 0])                 # slot 0 may repeat (a request left as it is moves
            if twice is not None:                                 # its cleared positions, 0, onto themselves)
                raise LocError(f"move_kv: dst_loc names slot {twice} twice (one source a slot)")

    def move_prechecked(self, src_loc: torch.Tensor, dst_loc: torch.Tensor) -> None:
        """`move_kv` for locs `check_move` accepted."""
        for buf in (*self.k_buffer, *self.v_buffer):
            if buf.is_floating_point() and buf.element_size() == 1:  # fp8: moved as bytes (the CPU's index_copy_
                buf = buf.view(torch.uint8)                           # has no float8 kernel)
            buf.index_copy_(0, dst_loc, buf.index_select(0, src_loc))

    def check_integrity(self) -> None:
        """Buffers keep their shapes and dtype (writes never reallocate them)."""
        for i, (k, v) in enumerate(zip(self.k_buffer, self.v_buffer)):
            assert k.shape == (self.size + self.page_size, self.head_num, self.head_dim), f"k_buffer[{i}] shape"
            assert v.shape == (self.size + self.page_size, self.head_num, self.v_head_dim), f"v_buffer[{i}] shape"
            assert k.dtype == v.dtype == self.dtype, f"layer {i} dtype changed"


def _layer_ids(name: str, ids: object) -> List[int]:
    """A pool's layer ids as ints >= 0, the ids `AttentionLayer` takes (ConfigError naming the bad one: a string
    would be iterated into characters, a bool or float id no layer can have)."""
    if (isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__")
            or (isinstance(ids, torch.Tensor) and ids.dim() == 0)):   # (a 0-d tensor has __iter__ but no items)
        raise ConfigError(f"{name}={ids!r} must be a sequence of layer ids (ints >= 0)")
    out = []
    for x in ids:
        i = as_layer_id(x)
        if i is None:
            raise ConfigError(f"{name} holds {x!r}: layer ids must be ints >= 0 (AttentionLayer's layer_id)")
        out.append(i)
    return out


class SWAKVPool:
    """Full-attention and SWA layer groups behind one address space of full-pool locs."""

    translates_lists = True  # translate_loc_from_full_to_swa takes lists= (a graph refill's one launch)

    @normal_tensors
    def __init__(self, size: int, size_swa: int, page_size: int, dtype: torch.dtype, head_num: int,
                 head_dim: int, swa_attention_layer_ids: Sequence[int], full_attention_layer_ids: Sequence[int],
                 device: Union[str, torch.device], swa_head_num: Optional[int] = None,
                 swa_head_dim: Optional[int] = None, swa_v_head_dim: Optional[int] = None,
                 v_head_dim: Optional[int] = None) -> None:
        swa_ids = _layer_ids("swa_attention_layer_ids", swa_attention_layer_ids)
        full_ids = _layer_ids("full_attention_layer_ids", full_attention_layer_ids)
        both = set(swa_ids) & set(full_ids)
        if both or len(set(swa_ids)) != len(swa_ids) or len(set(full_ids)) != len(full_ids):
            raise ConfigError(f"layer ids must be unique and in one group only; repeated: {sorted(both) or 'within a group'}")
        for name, val, or_none in (("swa_head_num", swa_head_num, "head_num"),
                                   ("swa_head_dim", swa_head_dim, "head_dim"),
                                   ("swa_v_head_dim", swa_v_head_dim, "its default"),
                                   ("v_head_dim", v_head_dim, "head_dim")):
            if val is not None and (not isinstance(val, int) or isinstance(val, bool) or val < 1):
                raise ConfigError(f"{name}={val!r} must be an int >= 1 (or None for {or_none})")
        self.size, self.size_swa, self.page_size, self.dtype = size, size_swa, page_size, dtype
        self.device = check_device(device)
        swa_h = head_num if swa_head_num is None else swa_head_num
        swa_d = swa_head_dim if swa_head_dim is not None else head_dim
        swa_vd = swa_v_head_dim if swa_v_head_dim is not None else default_swa_v_head_dim(
            head_dim, head_dim if v_head_dim is None else v_head_dim, swa_d)
        full_group = (size, page_size, dtype, head_num, head_dim, len(full_ids), device, v_head_dim)
        swa_group = (size_swa, page_size, dtype, swa_h, swa_d, len(swa_ids), device, swa_vd)
        try:  # sizes of both groups, checked against the device before either allocates
            nbytes = sum(_group_bytes(n, p, dt, h, d, d if vd is None else vd, layers)
                         for n, p, dt, h, d, layers, _, vd in (full_group, swa_group))
        except (TypeError, RuntimeError, AttributeError):
            nbytes = 0  # a bad argument: the group's own checks below name it
        if not isinstance(nbytes, int):   # e.g. a complex size multiplies through: the groups' checks name it
            nbytes = 0
        check_memory_fits(f"SWAKVPool(size={size}, size_swa={size_swa}, {len(full_ids)} full + {len(swa_ids)} SWA "
                          "layers)", nbytes, self.device)
        self.full_kv_pool = MHATokenToKVPool(*full_group, _prechecked=True)
        self.swa_kv_pool = MHATokenToKVPool(*swa_group, _prechecked=True)
        self.swa_kv_pool.loc_name = "swa_loc"
        self.layers_mapping: Dict[int, Tuple[int, bool]] = {}
        for local, gid in enumerate(full_ids):
            self.layers_mapping[gid] = (local, False)
        for local, gid in enumerate(swa_ids):
            self.layers_mapping[gid] = (local, True)
        self.full_to_swa_index_mapping: Optional[torch.Tensor] = None  # owned by the allocator
        self._mapping_owner: Optional[weakref.ref] = None

    @property
    def layer_num(self) -> int:
        return len(self.layers_mapping)

    def is_swa_layer(self, layer_id: int) -> bool:
        return self._route(layer_id)[1]

    def _route(self, layer_id: int) -> Tuple[int, bool]:
        if type(layer_id) is not int and as_int(layer_id) is None:  # True and 1.0 hash as 1: layer 1's buffers
            raise ConfigError(f"layer_id {layer_id!r} must be an integer, got {type(layer_id).__name__}")
        try:
            return self.layers_mapping[layer_id]
        except KeyError:
            raise ConfigError(f"layer_id {layer_id} is in neither group; known ids {sorted(self.layers_mapping)}") from None

    def register_mapping(self, mapping: torch.Tensor, owner: object = None) -> None:
        """Called by the allocator that owns `full_to_swa_index_mapping`. Another `owner` while the first still holds
        pages is refused (ConfigError, nothing changed): its table would replace the first's under live requests,
        whose SWA slots the layers would then miss. A first owner that holds none (or is gone) is replaced."""
        held = self._mapping_owner() if self._mapping_owner is not None else None
        if owner is not None and held is not None and held is not owner and held.holds_pages():
            raise ConfigError(f"this SWAKVPool's translation table belongs to another allocator that holds pages "
                              f"({type(held).__name__} at {id(held):#x}): one allocator per pool (free its requests "
                              "or clear() it first, or build a pool per allocator)")
        self.full_to_swa_index_mapping = mapping
        self._mapping_owner = weakref.ref(owner) if owner is not None else None

    def translate_loc_from_full_to_swa(self, loc: Union[torch.Tensor, LocRuns], out: Optional[torch.Tensor] = None,
                                       lists: Optional[ListRefill] = None) -> torch.Tensor:
        """Plain gather over the allocator's table: int64 SWA slots (0 = none).

        `out` (optional) receives them: as long as `loc`, or longer (a graph-static buffer: [:n] is
        translated and [n:] zeroed, in one launch where the device registered refill kernels).
        `loc` may also be a `LocRuns` (a CSR list of req_to_token runs; `out` required): the list is
        gathered and translated together. Either way this is one translation (a call with `lists` makes
        `lists.translations`).
        `lists` (with `out`, on a device with `GraphRefillKernels.fill_translated`): a graph refill's index
        lists, built in the same launch, their window lists translated: `lists.translations` in one call.
        """
        mapping = self.full_to_swa_index_mapping
        if mapping is None:
            raise ConfigError("SWAKVPool has no full_to_swa_index_mapping: build SWATokenToKVPoolAllocator on it")
        if lists is not None and (out is None or isinstance(loc, LocRuns)):
            raise ConfigError("translating with lists= needs the write locs as a tensor and out= (their buffer)")
        if out is not None:
            check_index_tensor("out", out, mapping.device)
        if isinstance(loc, LocRuns):
            if out is None:
                raise ConfigError("translating LocRuns needs out= (the list's static buffer)")
            ops.translate_runs(mapping, loc.req_to_token, loc.req_pool_indices, loc.pos0, loc.indptr, out)
            return out
        # -1 is the table's trailing entry (mapping[-1] == -1: "no loc"); values checked where checkable. This
        # forward's write locs were checked by check_write_loc (the metadata step), so they are not checked twice.
        # Without out= any shape is a gather (a backend's [bs, L] table of a window); with out=, 1-D locs.
        if torch.compiler.is_compiling() or loc is not self.full_kv_pool._checked_loc:
            check_loc("loc", loc, self.size + self.page_size, mapping.device, low=-1,
                      ndim=None if out is None else 1)
        if out is None:
            return mapping[loc]
        if not torch.compiler.is_compiling() and _overlap(loc, out):
            raise LocError("out= overlaps loc: the translation gathers from loc while it writes out (give a buffer of "
                           "its own)")
        n, cap = loc.shape[0], out.shape[0]
        if cap < n:
            raise CapacityError(f"{n} locs do not fit out= of {cap} entries")
        if lists is not None:
            ops.fill_translated(mapping, loc, out, lists)
        elif cap == n:   # take, as mapping[loc]: -1 ("no loc") reads mapping[-1] (-1), where index_select refuses it
            return torch.take(mapping, loc, out=out)
        else:
            ops.translate_into(mapping, loc, out)
        return out[:n]

    def check_write_loc(self, loc: Union[torch.Tensor, KVWriteLoc]) -> None:
        """Check one forward's full-pool write locs once (before they index the table); the full
        layers' writes then skip the check for this tensor (see MHATokenToKVPool.check_write_loc)."""
        self.full_kv_pool.check_write_loc(loc.loc if isinstance(loc, KVWriteLoc) else loc)

    def check_swa_loc(self, swa_loc: torch.Tensor) -> None:
        """The same for the translated `swa_loc`, against the SWA pool."""
        self.swa_kv_pool.check_write_loc(swa_loc, "swa_loc")

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        local, is_swa = self._route(layer_id)
        return (self.swa_kv_pool if is_swa else self.full_kv_pool).get_key_buffer(local)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        local, is_swa = self._route(layer_id)
        return (self.swa_kv_pool if is_swa else self.full_kv_pool).get_value_buffer(local)

    def get_kv_buffer(self, layer_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(self, layer: object, loc: Union[torch.Tensor, KVWriteLoc], cache_k: torch.Tensor,
                      cache_v: torch.Tensor, k_scale: Optional[float] = None, v_scale: Optional[float] = None,
                      swa_loc: Optional[torch.Tensor] = None) -> None:
        """SWA layers write the `swa_loc` they are handed (never translated here); full layers `loc`.

        Reads only `layers_mapping`, `full_kv_pool` and `swa_kv_pool` (bare-instance contract).
        """
        if isinstance(loc, KVWriteLoc):
            swa_loc = loc.swa_loc if swa_loc is None else swa_loc
            loc = loc.loc
        try:
            local, is_swa = self.layers_mapping[layer.layer_id]
        except AttributeError:
            raise ConfigError(_NOT_A_LAYER.format(type(layer).__name__)) from None
        except KeyError:
            raise ConfigError(f"layer_id {layer.layer_id!r} is in neither group of the pool; its layer ids are "
                              f"{sorted(self.layers_mapping)}") from None
        if not is_swa:
            self.full_kv_pool.set_kv_buffer(layer, loc, cache_k, cache_v, k_scale, v_scale,
                                            layer_id_override=local)
            return
        if swa_loc is None:
            raise MissingSWALocError(
                f"layer {layer.layer_id} is an SWA layer but no swa_loc was given; build a KVWriteLoc "
                "once per forward (SWALocCache) and pass it")
        if not (isinstance(loc, torch.Tensor) and isinstance(swa_loc, torch.Tensor)
                and loc.dim() == 1 and swa_loc.dim() == 1):
            check_index_tensor("loc", loc)  # the sub-pool checks swa_loc fully; loc gives only its length
            check_index_tensor("swa_loc", swa_loc)
        if swa_loc.shape[0] != loc.shape[0]:
            swa_loc = KVWriteLoc(loc, swa_loc).swa_loc
        self.swa_kv_pool.set_kv_buffer(layer, swa_loc, cache_k, cache_v, k_scale, v_scale,
                                       layer_id_override=local)

    def move_kv(self, src_loc: torch.Tensor, dst_loc: torch.Tensor) -> None:
        """Both groups' K/V at src_loc copied to dst_loc; the SWA group at the slots they map to
        (accepted draft tokens are recent, so both ends are mapped). Both groups' locs are checked (and
        the SWA ones translated) before either group moves, so a refused call moves nothing."""
        self.full_kv_pool.check_move(src_loc, dst_loc)
        full = torch.cat([src_loc, dst_loc])
        both = self.translate_loc_from_full_to_swa(full)
        n = src_loc.shape[0]
        swa_src, swa_dst = both[:n], both[n:]
        if values_checkable(both):   # a released SWA page maps to 0: its layers would move the padding slot's K/V
            gone = torch.nonzero((both <= 0) & (full > 0)).flatten()
            if gone.numel():
                i = int(gone[0])
                name, j = ("src_loc", i) if i < n else ("dst_loc", i - n)
                raise EvictedSlotError(f"move_kv: {name}[{j}] (full slot {int(full[i])}) has no SWA slot: its SWA "
                                       "page was released")
        self.swa_kv_pool.check_move(swa_src, swa_dst)
        self.full_kv_pool.move_prechecked(src_loc, dst_loc)
        self.swa_kv_pool.move_prechecked(swa_src, swa_dst)

    def bytes_per_token(self) -> Tuple[int, int]:
        """(full-group, SWA-group) K + V bytes per token."""
        return self.full_kv_pool.bytes_per_token(), self.swa_kv_pool.bytes_per_token()

    def check_integrity(self) -> None:
        self.full_kv_pool.check_integrity()
        self.swa_kv_pool.check_integrity()
        m = self.full_to_swa_index_mapping
        if m is not None:
            assert m.shape[0] == self.size + self.page_size + 1, "mapping length"
            assert int(m[-1]) == -1, "mapping[-1] must be -1"
