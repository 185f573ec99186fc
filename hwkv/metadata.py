"""Per-forward metadata: the write locs and the index lists, built once (eager or into graph buffers)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, NamedTuple, Optional, Sequence

import torch

from hwkv import ops
from hwkv.errors import CapacityError, ConfigError
from hwkv.loc import KVWriteLoc


@dataclass
class KVIndexList:
    """CSR list of key slots per request; key j of request b sits at position pos0[b] + j."""

    indptr: torch.Tensor   # int32 [bs + 1]
    indices: torch.Tensor  # int64 [capacity]: locs (full) or swa_locs (SWA layers of a hybrid pool)
    pos0: torch.Tensor     # int64 [bs]
    window: Optional[int]  # W the list was trimmed to, None for full layers
    max_len: int           # host-side bound on any request's list length (sizes kernel grids)
    is_swa_slots: bool = False
    min_len: int = 0       # host-side lower bound on any request's list length (eager lists: exact)
    # eager lists of backends that build them so (CPU): int64 [bs, max_len], row b = request b's slots, then
    # whatever its req_to_token row holds past its length (stale slots of the same pool, whose K/V may be anything:
    # a reader repeats a listed slot there, as plan_dense does); None elsewhere
    table: Optional[torch.Tensor] = None


class LayerOutputs:
    """An eager decode forward's attention outputs as one allocation (the plan's, not each layer's): the first call
    of each layer takes the next [T, H, Dv] view of it; a layer called again in the forward, or of another shape
    or dtype than the first, allocates its own. Made only while all of them fit in `MAX_BYTES`: a caller that keeps
    one layer's output keeps the whole allocation until it lets go."""

    MAX_BYTES = 16 << 20
    __slots__ = ("slots", "views", "key", "taken")

    def __init__(self, slots: int) -> None:
        self.slots, self.views, self.key, self.taken = slots, (), None, set()

    def take(self, layer_id: int, q: torch.Tensor, t: int, h: int, dv: int) -> torch.Tensor:
        if self.key is None:
            if not self.slots or self.slots * t * h * dv * q.element_size() > self.MAX_BYTES:
                self.slots = 0  # past the bound: every layer allocates its own
                return q.new_empty(t, h, dv)
            self.views = q.new_empty(self.slots, t, h, dv).unbind(0)  # every layer's view in one call
            self.key = (q.dtype, q.get_device(), t, h, dv)
        if (layer_id in self.taken or len(self.taken) >= self.slots
                or (q.dtype, q.get_device(), t, h, dv) != self.key):
            return q.new_empty(t, h, dv)
        self.taken.add(layer_id)
        return self.views[len(self.taken) - 1]


@dataclass
class ForwardMetadata:
    """Everything one forward's layers need; built by AttentionBackend.init_forward_metadata."""

    write_loc: KVWriteLoc
    swa_out_cache_loc: Optional[torch.Tensor]
    qo_indptr: torch.Tensor  # int32 [bs + 1]
    q_pos0: torch.Tensor     # int64 [bs]: position of each request's first query
    full: KVIndexList
    windows: Dict[int, KVIndexList]
    max_q_len: int
    batch_size: int
    is_decode: bool
    extra: Dict[str, Any] = field(default_factory=dict)
    seq_lens_cpu: Optional[torch.Tensor] = None     # host copies (eager only; None in graph mode)
    extend_lens_cpu: Optional[torch.Tensor] = None
    graph: bool = False  # built into the static graph buffers (what a layer allocates must outlive it)
    tree: Optional[Any] = None  # hwkv.spec.TreeMask of a tree verify (TARGET_VERIFY, top-k > 1), else None
    graph_step: int = 0  # graph mode: which static buffer set (draft step) the lists live in
    tree_decode: Optional["ForwardMetadata"] = None  # decode-like tree verify: one decode per draft token
    outputs: Optional[LayerOutputs] = None  # eager decode: the layers' outputs, one allocation

    def list_for(self, layer: Any, swa_group: bool) -> KVIndexList:
        """The index list a layer reads: its window's list when it has one, else the full list. A windowed layer of
        the full pool over a window list of SWA slots (a hybrid pool's) reads the full list: its slots are the full
        pool's, and the kernel's window mask trims it."""
        w = layer.window
        if w is None:
            if swa_group:
                raise ConfigError(f"layer {layer.layer_id} sits in the SWA pool but has no sliding_window")
            return self.full
        lst = self.windows.get(w)
        if lst is not None and lst.is_swa_slots and not swa_group:
            return self.full
        if lst is None:
            if swa_group:
                raise ConfigError(f"layer {layer.layer_id} has sliding_window={w} but the backend was built for "
                                  f"windows {sorted(self.windows)}; pass sliding_window= to make_backend")
            return self.full  # a windowed layer of the full pool: the kernel's window mask trims it
        return lst


@dataclass
class StaticBuffers:
    """Graph-mode buffers, allocated once by init_graph_state and refilled before every replay.

    The lists' indptr and pos0 rows live in one tensor each (row 0: the full list, row 1 + i: the
    i-th window of `windows`), and the window lists in the rows of one more, so a fused refill writes
    them all in one launch; `full_*` and `win_*` are views of those rows.
    """

    max_bs: int
    max_num_tokens: int
    arange: torch.Tensor  # int32 [max_bs + 1]: decode's qo_indptr, written once
    qo_indptr: torch.Tensor
    q_pos0: torch.Tensor
    lens: torch.Tensor
    full_indptr: torch.Tensor
    full_pos0: torch.Tensor
    full_indices: torch.Tensor
    win_indptr: Dict[int, torch.Tensor]
    win_pos0: Dict[int, torch.Tensor]
    win_indices: Dict[int, torch.Tensor]
    win_scratch: Dict[int, torch.Tensor]
    list_indptr: Optional[torch.Tensor] = None   # int32 [1 + len(windows), max_bs + 1]
    list_pos0: Optional[torch.Tensor] = None     # int64 [1 + len(windows), max_bs]
    list_windows: Optional[torch.Tensor] = None  # int64 [1 + len(windows)]: 0 (full), then each W
    win_rows: Optional[torch.Tensor] = None      # int64 [len(windows), cap]: row i holds win_indices of window i


class GraphViews(NamedTuple):
    """One batch size's views of the static buffers, as the forward metadata hands them to layers."""

    qo_indptr: torch.Tensor
    q_pos0: torch.Tensor
    full: KVIndexList
    windows: Dict[int, KVIndexList]


def alloc_static(max_bs: int, max_num_tokens: int, max_context_len: int, windows: Sequence[int],
                 device: torch.device) -> StaticBuffers:
    """Buffers large enough for any batch of <= max_bs requests and <= max_num_tokens tokens."""
    i32 = dict(dtype=torch.int32, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    windows = list(windows)
    full_cap = max_bs * max_context_len
    win_cap = {w: min(full_cap, max_num_tokens + max_bs * (w - 1)) for w in windows}
    list_indptr = torch.zeros(1 + len(windows), max_bs + 1, **i32)
    list_pos0 = torch.zeros(1 + len(windows), max_bs, **i64)
    # every row starts 16-byte aligned, as a separate buffer would (Triton compiles a variant per alignment)
    win_rows = torch.zeros(len(windows), aligned_width(max(win_cap.values(), default=0), torch.int64), **i64)
    return StaticBuffers(
        max_bs, max_num_tokens, torch.arange(max_bs + 1, **i32),
        torch.zeros(max_bs + 1, **i32), torch.zeros(max_bs, **i64), torch.zeros(max_bs, **i64),
        list_indptr[0], list_pos0[0], torch.zeros(full_cap, **i64),
        {w: list_indptr[1 + i] for i, w in enumerate(windows)},
        {w: list_pos0[1 + i] for i, w in enumerate(windows)},
        {w: win_rows[i, :win_cap[w]] for i, w in enumerate(windows)},
        {w: torch.zeros(win_cap[w], **i64) for w in windows},
        list_indptr, list_pos0, torch.tensor([0] + windows, **i64), win_rows)


def aligned_width(n: int, dtype: torch.dtype) -> int:
    """n rounded up so that rows of that many `dtype` elements start at 16-byte boundaries: Triton compiles a kernel
    variant per pointer alignment, so lists handed to kernels as rows of one buffer must not let the batch size
    pick their alignment."""
    per = max(1, 16 // dtype.itemsize)
    return -(-n // per) * per


class KeptRange:
    """arange(n) (or zeros(n), `zeros=True`) of one dtype as a view of one kept tensor, grown by doubling: the
    read-only constants a forward's metadata slices every step (decode's qo_indptr, lists' zero pos0, column
    indices) without allocating them. Views are never written."""

    def __init__(self, dtype: torch.dtype, device: torch.device, start: int = 64, zeros: bool = False) -> None:
        self.dtype, self.device, self.zeros = dtype, device, zeros
        self._t = self._make(start)

    def _make(self, n: int) -> torch.Tensor:
        if self.zeros:
            return torch.zeros(n, dtype=self.dtype, device=self.device)
        return torch.arange(n, dtype=self.dtype, device=self.device)

    def __call__(self, n: int) -> torch.Tensor:
        t = self._t
        if t.shape[0] < n:
            t = self._t = self._make(max(n, 2 * t.shape[0]))
        return t[:n]


def cumsum_into(lens: torch.Tensor, indptr: torch.Tensor) -> torch.Tensor:
    """indptr[0] = 0, indptr[1:] = cumsum(lens), written in place (int32); no host sync."""
    indptr[:1].zero_()
    torch.cumsum(lens, 0, dtype=indptr.dtype, out=indptr[1:])
    return indptr


def window_pos0(q_pos0: torch.Tensor, window: int) -> torch.Tensor:
    """First visible key of each request's first query: max(0, q_pos0 - W + 1)."""
    return (q_pos0 - (window - 1)).clamp_(min=0)


def fill_list(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
              pos0: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor) -> None:
    """Fill a CSR list of each request's locs from pos0 to seq_len (in place, no host sync)."""
    cumsum_into(seq_lens - pos0, indptr)
    ops.fill_kv_indices(req_to_token, req_pool_indices, pos0, indptr, indices)


def check_fits(name: str, need: int, cap: int) -> None:
    if need > cap:
        raise CapacityError(f"{name} needs {need} entries, the graph buffer holds {cap}; run this batch eagerly")


def block_table_from_csr(indptr: torch.Tensor, indices: torch.Tensor, pos0: torch.Tensor, page_size: int,
                         max_pages: int) -> torch.Tensor:
    """int32 [bs, max_pages]: entry i of request b is the page (slot // page_size) holding positions
    a_b + i * P .. a_b + (i + 1) * P - 1, where a_b is pos0[b] rounded down to a page; 0 past the list.

    Valid because allocations keep a token's in-page offset equal to its position's (full and SWA
    pools alike), so the listed slot of the first listed key of each page names its page.
    """
    bs = pos0.shape[0]
    dev = indices.device
    if bs == 0 or max_pages <= 0 or indices.numel() == 0:
        return torch.zeros(bs, max(max_pages, 0), dtype=torch.int32, device=dev)
    i64 = torch.int64
    off = pos0.to(i64) % page_size
    j = (torch.arange(max_pages, device=dev, dtype=i64)[None, :] * page_size - off[:, None]).clamp_(min=0)
    start = indptr[:-1].to(i64)
    valid = j < (indptr[1:].to(i64) - start)[:, None]
    flat = (start[:, None] + j).clamp_(max=indices.numel() - 1)
    pages = torch.div(indices[flat], page_size, rounding_mode="floor")
    return torch.where(valid, pages, torch.zeros_like(pages)).to(torch.int32)
