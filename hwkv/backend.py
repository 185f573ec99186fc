"""AttentionBackend: the template every device fills in.

The base class owns everything location-related: it translates the write locs once per
forward (`SWALocCache`), builds the full and window index lists once (window lists already
hold SWA slots), refills graph buffers before replay, and writes K/V through the pool. A
subclass supplies only kernels: `forward_decode`, `forward_extend` and optionally
`init_kernel_metadata` (with `alloc_graph_tables` for graph-mode tables of its own, one set per
static buffer set).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Tuple, Type

import numpy as np
import torch

from hwkv import ops
from hwkv.batch import ForwardBatch, ForwardMode, check_seq_lens
from hwkv.checks import (as_int, check_flag, check_rows, check_shape, check_sink_values, is_bool, normal_tensors,
                         values_checkable)
from hwkv.csr_checks import check_slots
from hwkv.draft import DraftMetadataMixin
from hwkv.env import HWKV_DEBUG
from hwkv.errors import CapacityError, ConfigError, EvictedSlotError, MissingSWALocError, ShapeError
from hwkv.layer import AttentionLayer, storage_key
from hwkv.loc import KVWriteLoc, ListRefill, LocRuns, SWALocCache
from hwkv.pool import check_memory_fits
from hwkv.metadata import (ForwardMetadata, GraphViews, KeptRange, KVIndexList, LayerOutputs, StaticBuffers,
                           aligned_width, alloc_static, check_fits, cumsum_into, fill_list, window_pos0)
from hwkv.spec_plan import TreePlanner


TABLE_SLACK = 1 << 16  # table entries beyond twice the list's that a dense_list_tables list may take to be one gather


@dataclass(frozen=True)
class BackendOptions:
    """Options of every backend, validated once. `sliding_window`: the model's SWA window(s) W."""

    sliding_window: Tuple[int, ...] = ()
    debug: Optional[bool] = None  # None: follow HWKV_DEBUG
    # a verify tree through the extend kernels (its ancestor mask), or "decode": one decode query per draft
    # token over its own list (hwkv.spec.tree_decode_list; split-K over long prefixes at small batches), or
    # "auto": per forward, whichever the backend's `decode_like_verify_pays` picks for the batch
    tree_verify: str = "extend"

    def __post_init__(self) -> None:
        for name, none in _switches(type(self)):  # every on/off option, a subclass's too: "no" would read as on
            check_flag(name, getattr(self, name), none=none)
        if self.tree_verify not in ("extend", "decode", "auto"):
            raise ConfigError(f"tree_verify={self.tree_verify!r} must be 'extend', 'decode' or 'auto'")
        object.__setattr__(self, "sliding_window", _windows(self.sliding_window))


# a switch's declared type (as written, or as a string under postponed annotations) -> whether None is allowed
_SWITCH_TYPES = {bool: False, "bool": False, Optional[bool]: True, "Optional[bool]": True, "bool | None": True}


@functools.lru_cache(maxsize=None)
def _switches(cls: type) -> Tuple[Tuple[str, bool], ...]:
    """(name, None allowed) of each on/off option of an options class (a device's too): its fields declared bool or
    Optional[bool], read from the declarations without evaluating them."""
    return tuple((f.name, _SWITCH_TYPES[f.type]) for f in dataclasses.fields(cls) if f.type in _SWITCH_TYPES)


def _windows(given: Any) -> Tuple[int, ...]:
    """The `sliding_window` option as sorted distinct ints: None, one window or several, each an integer (Python,
    numpy or 0-d tensor; a bool is none: True had been W=1) >= 1 and below 2**63, as layers take it."""
    if given is None:
        return ()
    ws: List[Optional[int]] = [as_int(given)]
    if ws[0] is None and not isinstance(given, (str, bytes)) and not is_bool(given):
        try:
            ws = [as_int(w) for w in given]
        except TypeError:  # no sequence (a float, a 0-d float tensor)
            pass
    if any(w is None or not 1 <= w < 2 ** 63 for w in ws):
        raise ConfigError(f"sliding_window={given!r} must be integers >= 1 and below 2**63 (the model's SWA window "
                          "W, or a sequence of its windows)")
    return tuple(sorted(set(ws)))


def make_options(cls: Type[BackendOptions], options: Dict[str, Any]) -> BackendOptions:
    """Build the frozen options object; unknown names raise ConfigError listing the known ones."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"unknown backend option(s) {unknown}; known options: {sorted(known)}")
    return cls(**options)


class AttentionBackend(DraftMetadataMixin):
    """Template: metadata once per forward in the base class, kernels in the subclass."""

    name: ClassVar[str] = "base"
    Options: ClassVar[Type[BackendOptions]] = BackendOptions
    # the kernels read each list as a dense [bs, L] table too (the CPU's dense kernels): where the table costs little
    # more than the list, the eager lists are one gather of req_to_token into it (`_table_list`), on the CPU
    dense_list_tables: ClassVar[bool] = False
    # the kernels read q of any strides; False: a q whose last dim is strided is refused before the K/V store
    strided_query: ClassVar[bool] = True

    def __init__(self, pool: Any, req_to_token_pool: Any, **options: Any) -> None:
        for name, value, needs in (("pool", pool, ("device", "get_key_buffer")),
                                   ("req_to_token_pool", req_to_token_pool, ("req_to_token",))):
            if not all(hasattr(value, a) for a in needs):  # (else a bare AttributeError, here or at the first forward)
                raise ConfigError(f"{name}={value!r:.60} ({type(value).__name__}) is not a "
                                  f"{'KV pool (MHATokenToKVPool, SWAKVPool)' if name == 'pool' else 'ReqToTokenPool'}")
        self.options = make_options(self.Options, options)
        self.pool = pool
        self.req_to_token_pool = req_to_token_pool
        self.device = torch.device(pool.device)
        self.hybrid = hasattr(pool, "translate_loc_from_full_to_swa")
        if self.dense_list_tables:
            self._columns = KeptRange(torch.int64, self.device, 256)  # column indices of a dense table
            self._kept_zeros = KeptRange(torch.int64, self.device, zeros=True)  # pos0 of lists starting at 0
        self.windows = self.options.sliding_window
        if self.hybrid and not self.windows:
            raise ConfigError("a hybrid SWAKVPool needs the model's window: make_backend(..., sliding_window=W)")
        self.debug = HWKV_DEBUG.get() if self.options.debug is None else self.options.debug
        self.loc_cache = SWALocCache(pool)
        self.window_translations = 0
        self.forward_metadata: Optional[ForwardMetadata] = None
        self.static: Optional[StaticBuffers] = None
        self.graph_stagings = 0  # batches staged into the static buffers (GraphRunner.prepare): the last replays
        self._views: Dict[Tuple[int, int], GraphViews] = {}
        self.tree_planner = TreePlanner(self)  # a verify tree's metadata (mask, decode-like lists)
        self.draft_static = None  # hwkv.draft.DraftStatic, made by init_draft_graph_state
        self._graph_tables: List[Any] = []  # alloc_graph_tables per static buffer set (index: md.graph_step)
        self._list_windows: Optional[torch.Tensor] = None  # [0, *windows] on the device, for the fused eager lists
        self._arange32 = KeptRange(torch.int32, self.device, 65)  # decode's qo_indptr, no allocation per forward
        # the pool's layers (an eager decode allocates their outputs at once: LayerOutputs); 0: not known
        self._layer_count = len(getattr(pool, "layers_mapping", ())) or int(getattr(pool, "layer_num", 0) or 0)
        # per layer id: its pool group's (KV heads, head_dim, v_head_dim), the buffers' device and whether the group
        # is the SWA one, read once
        self._layer_geometry: Dict[int, Tuple[Tuple[int, int, int], torch.device, bool]] = {}

    # ---- subclass hooks -------------------------------------------------------------------
    def alloc_graph_tables(self, static: StaticBuffers) -> Any:
        """A backend's own graph-mode kernel tables for one set of static buffers (sized by them), made once
        beside them: the graph state's set and one per further draft step. None: the backend keeps none."""
        return None

    def graph_tables(self, md: ForwardMetadata) -> Any:
        """The `alloc_graph_tables` set of the static buffers a graph forward's metadata was built in."""
        return self._graph_tables[md.graph_step]

    def init_kernel_metadata(self, md: ForwardMetadata, batch: ForwardBatch, graph: bool) -> None:
        """Kernel-specific fields into `md.extra` (graph=True: only into pre-allocated buffers, e.g. the
        backend's `graph_tables(md)`)."""

    def decode_like_verify_pays(self, num_requests: int, num_tokens: int) -> bool:
        """tree_verify="auto": whether this tree verify runs decode-like rather than through the extend
        kernels. Host ints only (graph mode: the captured bucket's). Default: never, the extend kernels."""
        return False

    def decode_like_chain_pays(self, num_requests: int, num_tokens: int) -> bool:
        """tree_verify="auto" for a linear verify (a chain of drafts, `hwkv.step_graph.VerifyStepGraph`): whether
        it runs decode-like rather than through the extend kernels' causal verify, which a chain keeps (no mask).
        Host ints only. Default: never."""
        return False

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList,
                       md: ForwardMetadata, out: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no decode kernel")

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList,
                       md: ForwardMetadata, out: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no extend kernel")

    # ---- helpers for subclasses --------------------------------------------------------------
    def kv_buffers(self, layer: AttentionLayer) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.pool.get_key_buffer(layer.layer_id), self.pool.get_value_buffer(layer.layer_id)

    def is_swa_group(self, layer: AttentionLayer) -> bool:
        if not self.hybrid:
            return False
        group = self.pool.layers_mapping.get(layer.layer_id)
        if group is None:
            raise ConfigError(f"layer {layer.layer_id} is in neither group of the pool; its layer ids are "
                              f"{sorted(self.pool.layers_mapping)}")
        return group[1]

    # ---- eager metadata ----------------------------------------------------------------------
    def init_forward_metadata(self, batch: ForwardBatch) -> ForwardMetadata:
        """Translate the write locs once and build every index list once, for any forward mode."""
        if not isinstance(batch, ForwardBatch):
            raise ConfigError(f"batch must be a ForwardBatch, got {type(batch).__name__}")
        batch.check_devices(self.device)
        if not isinstance(batch.forward_mode, ForwardMode):  # e.g. "decode": its methods are missing below
            members = ", ".join(f"ForwardMode.{m}" for m in ForwardMode.__members__)
            raise ConfigError(f"batch.forward_mode is {batch.forward_mode!r} ({type(batch.forward_mode).__name__}), "
                              f"not a ForwardMode; use one of {members}")
        bs, decode = batch.batch_size, batch.forward_mode.is_decode_or_idle()  # IDLE: a DECODE of no requests
        seq_cpu, ext_cpu = batch.host_lens()
        # sizes from the host lengths, as Python ints: one read each, then host arithmetic only
        seq_h = seq_cpu.tolist()
        ext_h = [1] * bs if decode else ext_cpu.tolist()
        batch.check_lens(seq_h, ext_h, *self.req_to_token_pool.req_to_token.shape)  # before anything is built
        tree_size = self.tree_planner.check(batch, ext_cpu)  # spec_info: None, or a verify tree that fits
        # each window list's lengths, by window_pos0's rule on the host lengths: seq - max(0, seq - ext - W + 1), which
        # is min(seq, ext + W - 1); one numpy op per window over the host tensors read above, nothing per request in
        # Python. W - 1 is capped at the context (seq <= context: the same lengths, and no int64 overflow)
        seq_np, ext_np, ctx = seq_cpu.numpy(), ext_cpu.numpy(), self.req_to_token_pool.req_to_token.shape[1]
        win_lens = {w: np.minimum(seq_np, ext_np + min(w - 1, ctx)).tolist() for w in self.windows}
        ext = None if decode else batch.extend_lens().to(torch.int64)
        kernels = ops.graph_refill_kernels(self.device.type) if self._fusable_refill and not self.debug else None
        if kernels is not None and bs and batch.spec_info is None:  # the graph refill's launches, buffers sized here
            write_loc, q_pos0, qo_indptr, full, windows = self._eager_fused(batch, kernels, ext, seq_h, win_lens)
        else:
            write_loc = self._write_loc(batch.out_cache_loc, graph=False)
            seq = batch.seq_lens.to(torch.int64)
            if decode:  # one query per request: no extend lengths to sum on the device
                q_pos0 = seq - 1
                qo_indptr = self._arange32(bs + 1)
            else:
                q_pos0 = seq - ext
                qo_indptr = cumsum_into(ext, torch.empty(bs + 1, dtype=torch.int32, device=self.device))
            full, windows = self._eager_lists(batch, seq, q_pos0, seq_h, win_lens)
        self._check_full_list(full.indices)
        md = ForwardMetadata(write_loc, write_loc.swa_loc, qo_indptr, q_pos0, full, windows, max(ext_h, default=0),
                             bs, decode, seq_lens_cpu=seq_cpu, extend_lens_cpu=ext_cpu,
                             outputs=LayerOutputs(self._layer_count) if decode and self._layer_count else None)
        if tree_size is not None:  # a verify tree (DraftTree)
            md.tree = self.tree_planner.mask(batch, ext, qo_indptr, q_pos0, tree_size)
            self.tree_planner.decode_lists(md, ext, batch)
        self.init_kernel_metadata(md, batch, graph=False)
        self.forward_metadata = md
        return md

    def _eager_fused(self, batch: ForwardBatch, kernels: ops.GraphRefillKernels, ext: Optional[torch.Tensor],
                     seq_h: List[int], win_lens: Dict[int, List[int]]
                     ) -> Tuple[KVWriteLoc, torch.Tensor, torch.Tensor, KVIndexList, Dict[int, KVIndexList]]:
        """The write locs' translation and the eager lists through the device's fused refill kernels, into buffers
        sized from the host lengths: one launch for a pool whose translate takes `lists=` where the device has
        `fill_translated` (as the graph refill), else 2 + len(windows) (positions, qo_indptr, every indptr/pos0 and
        the full list; one per window list, gathered and translated at once), instead of a dozen torch ops per
        list. The write locs are checked before any list is built."""
        bs, dev, nl = batch.batch_size, self.device, 1 + len(self.windows)
        loc = batch.out_cache_loc
        one_launch = self._refills_in_one(kernels)
        if self._list_windows is None:
            self._list_windows = torch.tensor([0] + list(self.windows), dtype=torch.int64, device=dev)
        # every buffer of the forward's lists is a view of one int64 allocation (one allocator call, not 6 + one
        # per window); each starts at a 16-byte boundary, and so does each list's indptr and pos0 row, whatever
        # the batch (Triton compiles a variant per pointer alignment)
        w64, w32 = aligned_width(bs, torch.int64), aligned_width(bs + 1, torch.int32) // 2
        totals = [sum(wl) for wl in win_lens.values()]
        # window lists: one region each, or (one launch) rows of one [windows, widest] block; then the SWA write locs
        cap = aligned_width(max(totals), torch.int64) if one_launch else 0
        at = [0]  # where lens, q_pos0, qo_indptr, the indptr rows, the pos0 rows, the full list, each window start
        for n in (w64, w64, w32, nl * w32, nl * w64, aligned_width(sum(seq_h), torch.int64),
                  *((cap,) * len(totals) if one_launch else (aligned_width(t, torch.int64) for t in totals)),
                  aligned_width(loc.shape[0], torch.int64) if one_launch else 0):
            at.append(at[-1] + n)
        arena = torch.empty(at[-1], dtype=torch.int64, device=dev)
        lens, q_pos0 = arena[:bs], arena[at[1]:at[1] + bs]
        qo_indptr = arena[at[2]:at[3]].view(torch.int32)[:bs + 1]
        list_indptr = arena[at[3]:at[4]].view(torch.int32).view(nl, 2 * w32)[:, :bs + 1]
        list_pos0 = arena[at[4]:at[5]].view(nl, w64)[:, :bs]
        full_indices = arena[at[5]:at[5] + sum(seq_h)]
        rtt = self.req_to_token_pool.req_to_token
        if one_launch:  # checked, translated and every list built in the translation's launch
            rows = arena[at[6]:at[6] + cap * len(totals)].view(len(totals), cap)
            lists = ListRefill(rtt, batch.req_pool_indices, batch.seq_lens, ext, self._list_windows, lens, q_pos0,
                               qo_indptr, list_indptr, list_pos0, full_indices, rows)
            write_loc = self._write_loc(loc, graph=False, lists=lists, out=arena[at[-2]:at[-2] + loc.shape[0]])
        else:
            write_loc = self._write_loc(loc, graph=False)
            kernels.fill_lists(rtt, batch.req_pool_indices, batch.seq_lens, ext, self._list_windows, lens, q_pos0,
                               qo_indptr, list_indptr, list_pos0, full_indices)
        full = KVIndexList(list_indptr[0], full_indices, list_pos0[0], None, max(seq_h), False, min(seq_h))
        windows = {}
        for i, (w, wl) in enumerate(win_lens.items()):
            indptr, pos0 = list_indptr[1 + i], list_pos0[1 + i]
            indices = arena[at[6 + i]:at[6 + i] + totals[i]]
            if not one_launch:  # (else built and translated in the write locs' launch)
                if self.hybrid:
                    self._translate_window(LocRuns(rtt, batch.req_pool_indices, pos0, indptr), out=indices)
                else:
                    ops.fill_kv_indices(rtt, batch.req_pool_indices, pos0, indptr, indices)
            windows[w] = KVIndexList(indptr, indices, pos0, w, max(wl), self.hybrid, min(wl))
        return write_loc, q_pos0, qo_indptr, full, windows

    def _eager_lists(self, batch: ForwardBatch, seq: torch.Tensor, q_pos0: torch.Tensor, seq_h: List[int],
                     win_lens: Dict[int, List[int]]) -> Tuple[KVIndexList, Dict[int, KVIndexList]]:
        """The forward's full list and one list per window (eager, torch path): `seq_h` and `win_lens` are the
        lists' lengths per request on the host. A backend whose kernels read dense tables (`dense_list_tables`)
        takes them from one gather where that fits (`_table_lists`)."""
        if self.dense_list_tables:
            return self._table_lists(batch, seq, q_pos0, seq_h, win_lens)
        return self._csr_lists(batch, seq, q_pos0, seq_h, win_lens)

    def _csr_lists(self, batch: ForwardBatch, seq: torch.Tensor, q_pos0: torch.Tensor, seq_h: List[int],
                   win_lens: Dict[int, List[int]]) -> Tuple[KVIndexList, Dict[int, KVIndexList]]:
        """`_eager_lists` as CSR lists, each filled on its own (`_eager_list`)."""
        full = self._eager_list(batch, seq, torch.zeros_like(seq), sum(seq_h), None, max(seq_h, default=0),
                                min_len=min(seq_h, default=0))
        windows = {}
        for w, lens in win_lens.items():
            windows[w] = self._eager_list(batch, seq, window_pos0(q_pos0, w), sum(lens), w, max(lens, default=0),
                                          min_len=min(lens, default=0))
        return full, windows

    def _eager_list(self, batch: ForwardBatch, seq: torch.Tensor, pos0: torch.Tensor, total: int,
                    window: Optional[int], max_len: int, min_len: int = 0) -> KVIndexList:
        """One eager index list: request b's locs from pos0[b] to seq[b] (a window list translated to SWA
        slots once); total, max_len and min_len are host sizes (the sum, largest and smallest length). With
        `dense_list_tables`, built from its table where that fits (`_table_list`)."""
        if self.dense_list_tables:
            return self._table_list(batch, seq, pos0, total, window, max_len, min_len)
        return self._csr_list(batch, seq, pos0, total, window, max_len, min_len)

    def _csr_list(self, batch: ForwardBatch, seq: torch.Tensor, pos0: torch.Tensor, total: int,
                  window: Optional[int], max_len: int, min_len: int = 0) -> KVIndexList:
        """`_eager_list` filled as CSR entries (no table)."""
        indptr = torch.zeros(batch.batch_size + 1, dtype=torch.int32, device=self.device)
        indices = torch.empty(total, dtype=torch.int64, device=self.device)
        fill_list(self.req_to_token_pool.req_to_token, batch.req_pool_indices, seq, pos0, indptr, indices)
        swa_slots = False
        if window is not None and self.hybrid:
            indices = self._translate_window(indices)
            swa_slots = True
            if self.debug:
                self._check_not_evicted(indices, window)
        return KVIndexList(indptr, indices, pos0, window, max_len, swa_slots, min_len)

    def _table_lists(self, batch: ForwardBatch, seq: torch.Tensor, q_pos0: torch.Tensor, seq_h: List[int],
                     win_lens: Dict[int, List[int]]) -> Tuple[KVIndexList, Dict[int, KVIndexList]]:
        """Where every request lists as many keys as the others, in the full list and in each window's (one
        request; a batch of equal lengths), every list comes from one gather of req_to_token: the full table
        [bs, L] (the first L columns of the requests' rows), each window's the last columns of it, translated
        once for a hybrid pool. Other batches build each list on its own (`_eager_list`)."""
        bs, rtt = batch.batch_size, self.req_to_token_pool.req_to_token
        n = max(seq_h, default=0)
        if (bs == 0 or n <= 0 or min(seq_h) != n or n > rtt.shape[1] or self.device.type != "cpu"
                or any(min(lens) != max(lens) or not lens[0] for lens in win_lens.values())):   # (empty windows:
            # no equal-length table; W = 1 over no new token lists nothing)
            return self._csr_lists(batch, seq, q_pos0, seq_h, win_lens)
        i32, i64 = dict(dtype=torch.int32, device=self.device), dict(dtype=torch.int64, device=self.device)
        table = self._full_table(batch, n)
        indptr = torch.arange(0, (bs + 1) * n, n, **i32)
        zeros = self._kept_zeros(bs)
        full = KVIndexList(indptr, table.view(-1), zeros, None, n, False, n, table)
        windows = {}
        for w, lens in win_lens.items():
            wl = lens[0]  # keys [n - wl, n) of every request: window_pos0 of the equal lengths
            wt = table.narrow(1, n - wl, wl)
            if self.hybrid:
                wt = self._translate_window(wt)
                if self.debug:
                    self._check_not_evicted(wt.view(-1), w)
            w_indptr = indptr if wl == n else torch.arange(0, (bs + 1) * wl, wl, **i32)
            pos0 = zeros if wl == n else torch.full((bs,), n - wl, **i64)
            windows[w] = KVIndexList(w_indptr, wt.reshape(-1), pos0, w, wl, self.hybrid, wl, wt)
        return full, windows

    def _full_table(self, batch: ForwardBatch, n: int) -> torch.Tensor:
        """The first n columns of the batch's req_to_token rows, [bs, n]: every full list starts at column 0, so a
        row gather (one contiguous copy per row; 6.8x the element-wise gather at 256 x 440 on one thread)."""
        rtt = self.req_to_token_pool.req_to_token
        return rtt.narrow(1, 0, n).index_select(0, batch.req_pool_indices.to(torch.int64))

    def _table_list(self, batch: ForwardBatch, seq: torch.Tensor, pos0: torch.Tensor, total: int,
                    window: Optional[int], max_len: int, min_len: int = 0) -> KVIndexList:
        """On the CPU a list is one gather of req_to_token into a [bs, max_len] table (translated at once for
        a window of a hybrid pool: still the list's one translation), the CSR entries its valid part; the
        table stays on the list for the dense kernels. Tables much larger than the list (lengths far apart,
        long contexts) take the core's CSR fill."""
        bs = batch.batch_size
        if bs == 0 or max_len <= 0 or bs * max_len > 2 * total + TABLE_SLACK or self.device.type != "cpu":
            return self._csr_list(batch, seq, pos0, total, window, max_len, min_len)
        rtt = self.req_to_token_pool.req_to_token
        uniform = min_len == max_len  # every request lists max_len keys: no padding, no clamping
        col = self._columns(max_len)
        if window is None and max_len <= rtt.shape[1]:
            table = self._full_table(batch, max_len)
        else:  # each request's own columns (a window's start differs per request): one gather of flat offsets,
            # 4x faster than indexing req_to_token by (row, column) pairs at 256 x 128 on one thread
            pos = col if window is None else pos0[:, None] + col
            if not uniform:
                pos = pos.clamp(max=rtt.shape[1] - 1)
            flat = batch.req_pool_indices.to(torch.int64)[:, None] * rtt.shape[1] + pos
            table = rtt.reshape(-1).index_select(0, flat.view(-1)).view(bs, max_len)
        swa_slots = window is not None and self.hybrid
        if swa_slots:
            table = self._translate_window(table)
        if uniform:
            indices = table.view(-1)
            indptr = torch.arange(0, (bs + 1) * max_len, max_len, dtype=torch.int32, device=self.device)
        else:
            lens = seq - pos0
            # the table's valid part through numpy's boolean index: torch's took 10x as long at 256 x 250
            indices = torch.from_numpy(table.numpy()[col.numpy() < lens.numpy()[:, None]])
            indptr = cumsum_into(lens, torch.empty(bs + 1, dtype=torch.int32, device=self.device))
        if swa_slots and self.debug:
            self._check_not_evicted(indices, window)
        return KVIndexList(indptr, indices, pos0, window, max_len, swa_slots, min_len, table)

    def _translate_window(self, locs: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The one translation of a window list per forward (counted, like SWALocCache's)."""
        self.window_translations += 1
        if out is None:
            return self.pool.translate_loc_from_full_to_swa(locs)
        return self.pool.translate_loc_from_full_to_swa(locs, out=out)

    def _check_full_list(self, indices: torch.Tensor) -> None:
        """The rows' history, where values are checkable (CPU tensors; debug mode): a slot outside the pool (-1, the
        table's "no loc") is refused before any layer stores (a window list's is refused by its translation)."""
        check_slots("the full list (req_to_token)", indices, self.pool.size + self.pool.page_size)

    def _check_list_values(self, full: Optional[KVIndexList], windows: Dict[int, KVIndexList], write0: torch.Tensor
                           ) -> None:
        """A graph refill's lists, where values are checkable: the full list's slots in the pool, and in debug mode
        no window entry on an evicted SWA slot (what the eager lists check as they are built). `write0`: each row's
        first write loc; a padding row writes to the padding slot 0, and its entries (another row's) are skipped."""
        bs = write0.shape[0]
        live = write0 != 0
        if full is not None:
            self._check_full_list(self._live_entries(full, live, bs))
        if self.debug and self.hybrid:
            for w, lst in windows.items():
                self._check_not_evicted(self._live_entries(lst, live, bs), w)

    @staticmethod
    def _first_write_locs(batch: ForwardBatch, qo_indptr: torch.Tensor) -> torch.Tensor:
        """Each row's first write loc for `_check_list_values` (values checkable: no sync). A request with no new
        tokens writes none: it reads 1, a live row (padding rows write to slot 0, and take tokens)."""
        bs, n = batch.batch_size, batch.num_tokens
        qo = qo_indptr[:bs + 1].long()
        if n == 0:
            return torch.ones(bs, dtype=batch.out_cache_loc.dtype, device=batch.out_cache_loc.device)
        first = batch.out_cache_loc[qo[:-1].clamp(max=n - 1)]
        return torch.where(qo[1:] > qo[:-1], first, torch.ones_like(first))

    @staticmethod
    def _live_entries(lst: KVIndexList, live: torch.Tensor, bs: int) -> torch.Tensor:
        """The entries of `lst`'s first bs rows whose row is live."""
        counts = (lst.indptr[1:bs + 1] - lst.indptr[:bs]).to(torch.int64)
        return lst.indices[:int(lst.indptr[bs])][live.repeat_interleave(counts)]

    @staticmethod
    def _check_not_evicted(swa_slots: torch.Tensor, window: int) -> None:
        bad = torch.nonzero(swa_slots <= 0)
        if bad.numel():
            raise EvictedSlotError(f"window list (W={window}) entry {int(bad[0])} translates to SWA slot "
                                   f"{int(swa_slots[bad[0]])}: an in-window token was released")

    # ---- graph metadata ----------------------------------------------------------------------
    @normal_tensors
    def init_graph_state(self, max_bs: int, max_num_tokens: int, max_context_len: Optional[int] = None) -> None:
        """Pre-allocate every static buffer (the int64 swa_out_cache_loc buffer included). `max_context_len`: the
        keys a request's static lists hold (None: req_to_token's width); graph metadata for longer requests is a
        CapacityError."""
        bs, tokens = as_int(max_bs), as_int(max_num_tokens)
        if bs is None or tokens is None or bs < 1 or tokens < bs:
            raise ConfigError(f"max_bs={max_bs!r} must be an integer >= 1 and max_num_tokens={max_num_tokens!r} an "
                              "integer >= max_bs")
        ctx = self.req_to_token_pool.max_context_len if max_context_len is None else as_int(max_context_len)
        if ctx is None or ctx < 1:  # (0 had meant req_to_token's width, a negative one a bare error)
            raise ConfigError(f"max_context_len={max_context_len!r} must be an integer >= 1 (the keys a request's "
                              "static lists hold) or None (req_to_token's width)")
        max_bs, max_num_tokens = bs, tokens
        st = self.static
        if st is None:   # the full list alone is max_bs x context int64s: sized before anything is allocated
            check_memory_fits(f"graph state (max_bs={bs}, max_num_tokens={tokens}, context {ctx})",
                              8 * (bs * ctx + 4 * tokens), self.device, "its static lists")
        if st is not None:
            # graphs already captured point into these buffers: reallocating them would leave
            # those graphs reading freed memory, so a second runner (e.g. verify beside decode) shares them
            if max_bs <= st.max_bs and max_num_tokens <= st.max_num_tokens and ctx <= self.graph_max_context_len:
                return
            raise ConfigError(f"graph state exists for max_bs={st.max_bs}, max_num_tokens={st.max_num_tokens}, "
                              f"context {self.graph_max_context_len}; asked for {max_bs}/{max_num_tokens}/{ctx}: "
                              "call init_graph_state once with the largest sizes before capturing any graph")
        self.static = alloc_static(max_bs, max_num_tokens, ctx, self.windows, self.device)
        self._views = {}
        self.loc_cache.alloc_graph_buffer(max_num_tokens, self.device)
        self.graph_max_context_len = ctx
        self.tree_planner.init_graph_state(max_bs, max_num_tokens)
        self._graph_tables = [self.alloc_graph_tables(self.static)]

    def init_forward_metadata_graph(self, batch: ForwardBatch, max_q_len: Optional[int] = None) -> ForwardMetadata:
        """Refill the static buffers in place for a (padded) batch: no allocation of index storage,
        no host sync. Used at capture and before every replay; raises CapacityError when too big.
        `max_q_len`: a bound on any request's new tokens that holds for every replay of the graph (GraphRunner
        passes its tokens per request); it sizes the extend kernels' grids, which otherwise take the
        batch's whole token count (a verify of 32 x 15 drafts would launch 30 token blocks per request).

        On devices that registered fused refill kernels (`hwkv.ops.register_graph_refill`) a hybrid pool's
        refill is one launch, whatever the mode and the number of windows (`fill_translated`: the write locs
        translated, tail zeroed; positions, qo_indptr, every indptr, the full list and each window list,
        gathered and translated together); without `fill_translated`, or for a plain pool, 2 + len(windows)
        (1 + len(windows)) launches. Elsewhere the torch path below builds the same buffers."""
        st = self.static
        if st is None:
            raise ConfigError("init_graph_state(max_bs, max_num_tokens) must run before graph metadata")
        if not isinstance(batch, ForwardBatch):
            raise ConfigError(f"batch must be a ForwardBatch, got {type(batch).__name__}")
        bs, n = batch.batch_size, batch.num_tokens
        tree_size = self.tree_planner.check(batch, None)  # before the refill: a refused tree changes no buffer
        check_fits("batch size", bs, st.max_bs)
        check_fits("tokens", n, st.max_num_tokens)
        if max_q_len is not None:   # numpy and 0-d tensor integers taken as ints, as sizes are elsewhere
            bound = as_int(max_q_len)
            if bound is None or bound < 1:
                raise ConfigError(f"max_q_len={max_q_len!r} must be an int >= 1")
            max_q_len = bound
        self._check_graph_context(batch.checkable_seq_lens())
        self._check_graph_lens(batch, max_q_len)
        batch.check_devices(self.device)   # (after the host-copy checks, which read no batch tensor)
        decode = batch.forward_mode.is_decode_or_idle()
        kernels = ops.graph_refill_kernels(self.device.type) if self._fusable_refill else None
        one_launch = kernels is not None and self._refills_in_one(kernels)
        write_loc = self._write_loc(batch.out_cache_loc, graph=True, lists=self._list_refill(batch) if one_launch
                                    else None)
        swa = write_loc.swa_loc
        max_q = 1 if decode else min(n, max_q_len or n)  # static bounds: no sync on the replay path
        if kernels is not None:
            views = self._graph_views(bs, max_q)
            if not one_launch:
                self._refill_fused(batch, kernels, views)
        else:
            views = self._refill_torch(batch, max_q)
        if values_checkable(views.full.indptr):  # (CPU tensors; debug mode outside a capture) as the eager lists
            self._check_list_values(views.full, views.windows, self._first_write_locs(batch, views.qo_indptr))
        ext = None if decode else batch.extend_seq_lens
        tree = self.tree_planner.mask(batch, ext, views.qo_indptr, views.q_pos0, tree_size, graph=True)
        md = ForwardMetadata(write_loc, swa, views.qo_indptr, views.q_pos0, views.full, views.windows, max_q, bs,
                             decode, graph=True, tree=tree)
        if tree is not None:
            self.tree_planner.decode_lists(md, ext, batch)
        self.init_kernel_metadata(md, batch, graph=True)
        self.forward_metadata = md
        return md

    def _check_graph_lens(self, batch: ForwardBatch, max_q_len: Optional[int] = None) -> None:
        """The eager step's checks (`ForwardBatch.check_lens`: 1 <= seq_lens, 0 <= extend lens <= seq_lens summing to
        the write locs, rows inside req_to_token) on what the host reads with no sync, before any static buffer is
        written: a few numpy reductions over the host copies, and the lists `check_lens` names the request from only
        where one of them fails. Then no request's new tokens past `max_q_len` (the extend grids' bound)."""
        rows, ctx = self.req_to_token_pool.req_to_token.shape
        seq = batch.checkable_seq_lens()
        if seq is not None and seq.numel() and not torch.compiler.is_compiling():
            s = seq.numpy() if seq.is_cpu else seq.cpu().numpy()   # (a device tensor only in debug mode)
            ext = None
            if not batch.forward_mode.is_decode_or_idle():
                e = batch.extend_seq_lens_cpu
                if e is None and batch.extend_seq_lens is not None and values_checkable(batch.extend_seq_lens):
                    e = batch.extend_seq_lens
                ext = None if e is None else (e.numpy() if e.is_cpu else e.cpu().numpy())
            bad = s.min() < 1 or (ext is not None and (ext.size != s.size or ext.min() < 0 or (s - ext).min() < 0
                                                       or ext.sum() != batch.num_tokens))
            if bad:
                batch.check_lens(s.tolist(), [1] * s.size if ext is None else ext.tolist(), rows, ctx)
            if ext is not None and max_q_len is not None and ext.max() > max_q_len:
                i = int(ext.argmax())
                raise CapacityError(f"request {i} extends by {int(ext[i])} new tokens; the graph's max_q_len "
                                    f"(the extend kernels' bound on a request's new tokens) is {max_q_len}")
        check_rows(batch.req_pool_indices, rows)

    def _check_graph_context(self, seq: Optional[torch.Tensor], steps: int = 1) -> None:
        """Each request's length after `steps` steps (`seq`: its host-readable lengths, `checkable_seq_lens`; None:
        not checkable here) within the graph state's max_context_len, whose static lists hold that many keys a request
        (past it a refill clips them: wrong attention): a CapacityError naming the length and the limit (eagerly the
        batch runs), before any static buffer is written; a length past req_to_token's width too is the ShapeError
        the eager step gives (a draft's lengths met that check already). Lengths only on the device are the caller's
        to keep within it (GraphRunner sizes the state to req_to_token's width and checks the lengths against that).
        Not while torch.compile traces (a CPU whole-step graph: a value read would specialize the graph; the step
        checked its lengths before)."""
        if seq is None or not seq.numel() or torch.compiler.is_compiling():
            return
        ctx, table = self.graph_max_context_len, self.req_to_token_pool.req_to_token.shape[1]
        # one reduction, nothing per request: numpy over the host copy (no torch op on the refill's path, no device
        # read); a device tensor only in debug mode
        top = int(seq.numpy().max() if seq.is_cpu else seq.max()) + steps - 1
        if top <= min(ctx, table):  # (a graph state may be wider than the table: the table bounds first)
            return
        seq_h = seq.tolist()  # refused: name the first request past the limit
        if top > table:
            check_seq_lens(seq_h, table)
        i = next(i for i, n in enumerate(seq_h) if n + steps - 1 > ctx)
        reach = "" if steps == 1 else f": its {steps} draft steps reach length {seq_h[i] + steps - 1}"
        raise CapacityError(f"seq_lens[{i}] is {seq_h[i]}{reach}, past the graph state's max_context_len {ctx} "
                            f"(init_graph_state): run this batch eagerly, or size the graph state for it")

    def _refills_in_one(self, kernels: ops.GraphRefillKernels) -> bool:
        """Whether a forward's metadata (eager or graph) is one launch: the device has `fill_translated` and the
        pool is hybrid, has windows and translates with `lists=`."""
        return (kernels.fill_translated is not None and self.hybrid and bool(self.windows)
                and getattr(self.pool, "translates_lists", False))

    @property
    def _fusable_refill(self) -> bool:
        """A subclass that changes how window lists are translated (the per-layer baseline) keeps the
        torch path, which hands its hook the lists in full-pool locs."""
        return type(self)._translate_window is AttentionBackend._translate_window

    def _graph_views(self, bs: int, max_q: int) -> GraphViews:
        """The static buffers' [:bs] views and index lists, made once per (batch size, query bound)."""
        views = self._views.get((bs, max_q))
        if views is None:
            st, ctx = self.static, self.graph_max_context_len
            full = KVIndexList(st.full_indptr[:bs + 1], st.full_indices, st.full_pos0[:bs], None, ctx)
            windows = {w: KVIndexList(st.win_indptr[w][:bs + 1], st.win_indices[w], st.win_pos0[w][:bs], w,
                                      min(ctx, w + max_q - 1), self.hybrid) for w in self.windows}
            views = GraphViews(st.qo_indptr[:bs + 1], st.q_pos0[:bs], full, windows)
            self._views[(bs, max_q)] = views
        return views

    def _list_refill(self, batch: ForwardBatch) -> ListRefill:
        """The static lists a graph refill builds in its write locs' launch (`fill_translated`)."""
        st = self.static
        ext = None if batch.forward_mode.is_decode_or_idle() else batch.extend_seq_lens
        return ListRefill(self.req_to_token_pool.req_to_token, batch.req_pool_indices, batch.seq_lens, ext,
                          st.list_windows, st.lens, st.q_pos0, st.qo_indptr, st.list_indptr, st.list_pos0,
                          st.full_indices, st.win_rows)

    def _refill_fused(self, batch: ForwardBatch, kernels: ops.GraphRefillKernels, views: GraphViews) -> None:
        """One launch for positions, qo_indptr, every list's indptr/pos0 and the full list, then one
        per window: its list gathered and translated at once (still one counted translation)."""
        st, rtt = self.static, self.req_to_token_pool.req_to_token
        ext = None if batch.forward_mode.is_decode_or_idle() else batch.extend_seq_lens
        kernels.fill_lists(rtt, batch.req_pool_indices, batch.seq_lens, ext, st.list_windows, st.lens, st.q_pos0,
                           st.qo_indptr, st.list_indptr, st.list_pos0, st.full_indices)
        for w, lst in views.windows.items():
            if self.hybrid:
                self._translate_window(LocRuns(rtt, batch.req_pool_indices, lst.pos0, lst.indptr), out=lst.indices)
            else:
                ops.fill_kv_indices(rtt, batch.req_pool_indices, lst.pos0, lst.indptr, lst.indices)

    def _refill_torch(self, batch: ForwardBatch, max_q: int) -> GraphViews:
        """The device-free refill: a few torch ops per list (CPU, and devices without refill kernels)."""
        st = self.static
        bs = batch.batch_size
        rtt = self.req_to_token_pool.req_to_token
        seq = st.lens[:bs]
        seq.copy_(batch.seq_lens)
        qo_indptr = st.qo_indptr[:bs + 1]
        if batch.forward_mode.is_decode_or_idle():  # one query per request: nothing to sum
            q_pos0 = torch.sub(seq, 1, out=st.q_pos0[:bs])
            qo_indptr.copy_(st.arange[:bs + 1])
        else:
            q_pos0 = torch.sub(seq, batch.extend_seq_lens, out=st.q_pos0[:bs])
            cumsum_into(batch.extend_seq_lens, qo_indptr)
        full_pos0 = st.full_pos0[:bs]
        full_pos0.zero_()
        fill_list(rtt, batch.req_pool_indices, seq, full_pos0, st.full_indptr[:bs + 1], st.full_indices)
        full = KVIndexList(st.full_indptr[:bs + 1], st.full_indices, full_pos0, None, self.graph_max_context_len)
        windows = {}
        for w in self.windows:
            pos0 = st.win_pos0[w][:bs]
            pos0.copy_(window_pos0(q_pos0, w))
            target = st.win_scratch[w] if self.hybrid else st.win_indices[w]
            fill_list(rtt, batch.req_pool_indices, seq, pos0, st.win_indptr[w][:bs + 1], target)
            if self.hybrid:
                self._translate_window(target, out=st.win_indices[w])
            windows[w] = KVIndexList(st.win_indptr[w][:bs + 1], st.win_indices[w], pos0, w,
                                     min(self.graph_max_context_len, w + max_q - 1), self.hybrid)
        return GraphViews(qo_indptr, q_pos0, full, windows)

    def _write_loc(self, loc: torch.Tensor, graph: bool, lists: Optional[ListRefill] = None,
                   out: Optional[torch.Tensor] = None) -> KVWriteLoc:
        """This forward's KVWriteLoc: locs checked (before they index the table), translated once
        (into the static buffer in graph mode), swa_locs checked. These checks are the only ones of
        the write locs this forward: the layers' writes skip them (pool.check_write_loc). `lists` (graph,
        hybrid pool): the refill's lists, built in the translation's launch, each window list counted once (eager:
        the translation goes into `out`, as long as `loc`)."""
        check_loc, check_swa = (getattr(self.pool, "check_write_loc", None),
                                getattr(self.pool, "check_swa_loc", None))
        if check_loc is not None:
            check_loc(loc)
        if lists is not None:
            swa = self.loc_cache.refill(loc, lists) if graph else self.loc_cache.translate(loc, out=out, lists=lists)
            self.window_translations += lists.translations - 1
        else:
            swa = self.loc_cache.refill(loc) if graph else self.loc_cache.translate(loc)
        write_loc = KVWriteLoc(loc, swa)
        if check_swa is not None and write_loc.swa_loc is not None:
            check_swa(write_loc.swa_loc)
        return write_loc

    # ---- per layer ----------------------------------------------------------------------------
    def forward(self, q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                layer: AttentionLayer, batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        """Write this layer's K/V through the pool, then attend: q [T, H, D] -> out [T, H, Dv].

        Everything per forward (translation, index lists, the write locs' check) happened in the
        metadata step; a layer compares shapes (tuples), picks its list (a dict lookup), then stores and
        launches its attention: every refusal comes before the store.
        """
        md = self.forward_metadata
        if md is None:
            raise ConfigError("init_forward_metadata(batch) must run before forward")
        if batch.out_cache_loc is not md.write_loc.loc:   # (one identity compare a layer; a graph's static batch too)
            raise ConfigError("this batch is not the one the last metadata step took (its out_cache_loc differs): "
                              "run init_forward_metadata(batch) for it first (a layer would store its K/V at that "
                              "forward's slots)")
        if save_kv_cache is not True and save_kv_cache is not False:   # a truthy "no" would write
            check_flag("save_kv_cache", save_kv_cache)
        t = batch.num_tokens
        try:   # (attribute reads: a try costs nothing where they succeed)
            h, kvh, d, dv = layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.v_head_dim
        except AttributeError:
            raise ConfigError(f"layer must be an AttentionLayer, got {type(layer).__name__}") from None
        # every check before the K/V write: attribute compares only (the group's geometry read once per layer id)
        geo = self._layer_geometry.get(layer.layer_id) or self._read_geometry(layer)
        if (kvh, d, dv) != geo[0]:
            self._refuse_geometry(layer, geo[0])
        try:
            q_dim = q.dim()
        except AttributeError:
            raise ShapeError(f"q must be a torch.Tensor, got {type(q).__name__}") from None
        if q_dim == 2:
            if q.shape != (t, h * d):
                check_shape("q", q, (t, h * d))
            q = q.view(t, h, d)
        elif q.shape != (t, h, d):
            check_shape("q", q, (t, h, d))
        if not q.is_floating_point() or q.device != geo[1]:
            self._refuse_query(q, geo[1])
        if not self.strided_query and q.stride(-1) != 1 and d > 1 and t:   # (the kernels' own check comes after
            raise ShapeError(f"q must have a contiguous last dimension, got strides {q.stride()}")   # the store)
        sinks = layer.sinks  # (checked at construction; again here, as a caller may assign another tensor since)
        if sinks is not None:
            if (sinks.device != geo[1] or not sinks.is_floating_point() or sinks.shape != (h,)
                    or not sinks.is_contiguous()):
                self._refuse_sinks(layer, geo[1])
            if not md.graph:   # values too, of sinks assigned (or a storage swapped in) since: eager forwards only
                at = storage_key(sinks)  # (what a graph captures may not read anything more at a replay)
                if layer.sinks_checked != at:
                    check_sink_values(sinks, f"layer {layer.layer_id}: ")
                    layer.sinks_checked = at
        # the list it reads (a tree verify run decode-like: one decode query per draft token over its own lists):
        # picking it refuses an SWA-group layer whose window the backend was not built for, before the store
        kmd = md if md.tree_decode is None else md.tree_decode
        try:
            kv = kmd.list_for(layer, geo[2])
        except ConfigError:
            self._refuse_list(layer, md, save_kv_cache and geo[2])
            raise
        if save_kv_cache:
            try:
                k_dim, v_dim = k.dim(), v.dim()
            except AttributeError:
                raise ShapeError(f"layer {layer.layer_id}: save_kv_cache=True needs k and v tensors, got "
                                 f"{type(k).__name__} and {type(v).__name__}") from None
            if k_dim == 2:
                if k.shape != (t, kvh * d):
                    check_shape("k", k, (t, kvh * d))
                k = k.view(t, kvh, d)
            if v_dim == 2:
                if v.shape != (t, kvh * dv):
                    check_shape("v", v, (t, kvh * dv))
                v = v.view(t, kvh, dv)
            self.pool.set_kv_buffer(layer, md.write_loc, k, v, layer.k_scale, layer.v_scale)
        out = q.new_empty(t, h, dv) if md.outputs is None else md.outputs.take(layer.layer_id, q, t, h, dv)
        if t == 0:
            return out
        if kmd.is_decode:  # (a tree verify's decode-like metadata is a decode)
            self.forward_decode(q, layer, kv, kmd, out)
        else:
            self.forward_extend(q, layer, kv, kmd, out)
        return out

    def _read_geometry(self, layer: AttentionLayer) -> Tuple[Tuple[int, int, int], torch.device, bool]:
        """The pool group's (KV heads, head_dim, v_head_dim), device and SWA-ness for this layer id (kept: a pool's
        geometry never changes); a layer id the pool lacks is a ConfigError naming its ids."""
        swa = self.is_swa_group(layer)
        k_buf, v_buf = self.kv_buffers(layer)
        geo = self._layer_geometry[layer.layer_id] = ((k_buf.shape[1], k_buf.shape[2], v_buf.shape[2]), k_buf.device,
                                                      swa)
        return geo

    @staticmethod
    def _refuse_geometry(layer: AttentionLayer, group: Tuple[int, int, int]) -> None:
        got = (layer.num_kv_heads, layer.head_dim, layer.v_head_dim)
        name, mine, theirs = next(f for f in zip(("num_kv_heads", "head_dim", "v_head_dim"), got, group)
                                  if f[1] != f[2])
        raise ShapeError(f"layer {layer.layer_id}: {name}={mine} but the pool's group holds {theirs} (KV heads, "
                         f"head_dim, v_head_dim of the group: {group})")

    @staticmethod
    def _refuse_query(q: torch.Tensor, device: torch.device) -> None:
        if not q.is_floating_point():
            raise ShapeError(f"q is {q.dtype}, not a floating-point dtype: attention needs a float query")
        raise ShapeError(f"q lives on {q.device}, the pool on {device}")

    @staticmethod
    def _refuse_list(layer: AttentionLayer, md: ForwardMetadata, writes_swa: bool) -> None:
        """An SWA-group layer to be stored through metadata that writes no SWA slots (a draft of full layers only)
        is a MissingSWALocError, as the store would raise it; any other layer without its list keeps the
        ConfigError `list_for` raised."""
        if writes_swa and md.write_loc.swa_loc is None:
            raise MissingSWALocError(f"layer {layer.layer_id} is an SWA layer but this forward's metadata has no "
                                     "swa_loc and no window list (it was built for full layers only, e.g. a draft "
                                     "without SWA layers); nothing was written") from None

    @staticmethod
    def _refuse_sinks(layer: AttentionLayer, device: torch.device) -> None:
        sinks = layer.sinks
        if sinks.device != device:
            raise ShapeError(f"layer {layer.layer_id}: sinks live on {sinks.device}, the pool on {device}")
        if not sinks.is_floating_point():
            raise ShapeError(f"layer {layer.layer_id}: sinks are {sinks.dtype}, not floating point")
        if sinks.shape != (layer.num_heads,):
            raise ShapeError(f"layer {layer.layer_id}: sinks have shape {tuple(sinks.shape)}, expected "
                             f"({layer.num_heads},) (one per query head)")
        raise ShapeError(f"layer {layer.layer_id}: sinks have strides {tuple(sinks.stride())}; they must be "
                         "contiguous (pass sinks.contiguous(), not a strided view)")


class KernelSetBackend(AttentionBackend):
    """A backend whose kernels follow the standard interface of docs/architecture.md.

    Subclasses set `kernels` to an object with `decode_attention` and `extend_attention`.
    """

    kernels: ClassVar[Any] = None

    def forward_decode(self, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList,
                       md: ForwardMetadata, out: torch.Tensor) -> None:
        k_buf, v_buf = self.kv_buffers(layer)
        self.kernels.decode_attention(q, k_buf, v_buf, kv.indptr, kv.indices, kv.pos0, md.q_pos0, out,
                                      layer.scaling, layer.window, layer.logit_cap, layer.sinks,
                                      layer.k_scale, layer.v_scale, max_kv_len=kv.max_len)

    def forward_extend(self, q: torch.Tensor, layer: AttentionLayer, kv: KVIndexList,
                       md: ForwardMetadata, out: torch.Tensor) -> None:
        k_buf, v_buf = self.kv_buffers(layer)
        tree = {} if md.tree is None else {"tree": md.tree}  # kernels without tree support still run the rest
        self.kernels.extend_attention(q, k_buf, v_buf, kv.indptr, kv.indices, kv.pos0, md.qo_indptr,
                                      md.q_pos0, out, md.max_q_len, layer.scaling, layer.window,
                                      layer.logit_cap, layer.sinks, layer.k_scale, layer.v_scale, **tree)
