"""Where one forward's K/V go, and the one place that translates full locs to SWA slots."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from hwkv.checks import check_index_tensor
from hwkv.errors import CapacityError, LocError


class KVWriteLoc:
    """The new tokens' full-pool `loc` and their `swa_loc`, built once per forward."""

    __slots__ = ("loc", "swa_loc")

    def __init__(self, loc: torch.Tensor, swa_loc: Optional[torch.Tensor] = None) -> None:
        check_index_tensor("KVWriteLoc.loc", loc)  # host attributes only: values are the pool's to check
        if swa_loc is not None:
            check_index_tensor("KVWriteLoc.swa_loc", swa_loc)
            n, m = loc.shape[0], swa_loc.shape[0]
            if m < n:
                raise LocError(f"KVWriteLoc.swa_loc has {m} entries, shorter than loc's {n}")
            if m > n:
                swa_loc = swa_loc[:n]  # graph buffers are longer: write exactly the live prefix
        self.loc = loc
        self.swa_loc = swa_loc

    def __len__(self) -> int:
        return int(self.loc.shape[0])

    def __repr__(self) -> str:
        return f"KVWriteLoc(n={len(self)}, swa={'yes' if self.swa_loc is not None else 'no'})"


class LocRuns(NamedTuple):
    """Full-pool locs given as runs of `req_to_token` rows, laid out as a CSR list: entry
    indptr[b] + j is req_to_token[req_pool_indices[b], pos0[b] + j], for j < indptr[b+1] - indptr[b].

    `SWAKVPool.translate_loc_from_full_to_swa(runs, out=...)` gathers and translates such a list in
    one kernel (where the device registered one), so a window list never exists in full-pool locs.
    """

    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    pos0: torch.Tensor
    indptr: torch.Tensor


class ListRefill(NamedTuple):
    """A graph refill's index lists, built in the launch that translates its write locs (where the device has
    `GraphRefillKernels.fill_translated`): the fields are `fill_lists`' arguments in order (`windows[0]` is 0,
    the full list; list 1 + i is window i), then `window_indices`, window i's list in row i, already in SWA slots.

    `SWAKVPool.translate_loc_from_full_to_swa(loc, out=..., lists=...)` takes it: one call that makes
    `translations` translations, the write locs' and one per window list.
    """

    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    extend_lens: Optional[torch.Tensor]  # None: DECODE, one new token per request
    windows: torch.Tensor
    lens: torch.Tensor
    q_pos0: torch.Tensor
    qo_indptr: torch.Tensor
    list_indptr: torch.Tensor
    list_pos0: torch.Tensor
    full_indices: torch.Tensor
    window_indices: torch.Tensor

    @property
    def translations(self) -> int:
        """The write locs' translation and one per window list."""
        return 1 + int(self.window_indices.shape[0])


def translations_of(*args: object, **kwargs: object) -> int:
    """How many translations one call `translate_loc_from_full_to_swa(*args, **kwargs)` makes (for wrappers that
    count them): one, or a `ListRefill`'s (`lists=`)."""
    lists = kwargs.get("lists", args[2] if len(args) > 2 else None)
    return lists.translations if isinstance(lists, ListRefill) else 1


class SWALocCache:
    """Translates one forward's write locs exactly once; in graph mode into a static int64 buffer.

    Eager: `translate(loc)` returns a fresh tensor and holds it as `current`.
    Graph: `refill(loc)` writes the translation into `buffer[:n]`, zeros `buffer[n:]` (so a
    padded replay never writes a stale live slot) and returns the `[:n]` view.
    """

    def __init__(self, pool: object) -> None:
        self.pool = pool
        self.buffer: Optional[torch.Tensor] = None
        self.current: Optional[torch.Tensor] = None
        self.translations = 0

    @property
    def hybrid(self) -> bool:
        return hasattr(self.pool, "translate_loc_from_full_to_swa")

    def translate(self, loc: torch.Tensor, out: Optional[torch.Tensor] = None,
                  lists: Optional[ListRefill] = None) -> Optional[torch.Tensor]:
        """Eager translation (None for a plain, non-hybrid pool: there is nothing to translate). `out` and `lists`:
        into `out` (as long as `loc`), the forward's lists built in the same launch (the caller counts those)."""
        if not self.hybrid:
            self.current = None
            return None
        self.translations += 1
        if lists is None:   # (a pool without a list refill need not take `lists=`)
            self.current = (self.pool.translate_loc_from_full_to_swa(loc) if out is None else
                            self.pool.translate_loc_from_full_to_swa(loc, out=out))
        else:
            self.current = self.pool.translate_loc_from_full_to_swa(loc, out=out, lists=lists)
        return self.current

    def alloc_graph_buffer(self, max_num_tokens: int, device: torch.device) -> None:
        """Pre-allocate the static `swa_out_cache_loc` buffer (once, before capture)."""
        self.buffer = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)

    def refill(self, loc: torch.Tensor, lists: Optional[ListRefill] = None) -> Optional[torch.Tensor]:
        """Graph translation into the static buffer; raises CapacityError when it does not fit. `lists`: the
        refill's index lists, built (window lists translated) in the same launch; the caller counts those."""
        if not self.hybrid:
            self.current = None
            return None
        if self.buffer is None:
            raise CapacityError("SWALocCache.refill called before alloc_graph_buffer")
        n, cap = int(loc.shape[0]), int(self.buffer.shape[0])
        if n > cap:
            raise CapacityError(f"{n} tokens do not fit the graph buffer of {cap} tokens; run eagerly")
        self.translations += 1
        # one call: [:n] translated, [n:] zeroed (one launch where the device has a refill kernel)
        if lists is None:
            self.pool.translate_loc_from_full_to_swa(loc, out=self.buffer)
        else:
            self.pool.translate_loc_from_full_to_swa(loc, out=self.buffer, lists=lists)
        self.current = self.buffer[:n]
        return self.current
