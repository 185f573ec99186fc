"""TreePlanner: a verify tree's metadata, beside the AttentionBackend template.

The template builds the plain modes' metadata (write locs, the full and window lists); for a TARGET_VERIFY
forward with a `DraftTree` it hands the tree to its planner once: the tree's kernel form (mask offsets and
query positions, `hwkv.spec.build_tree_mask`) and, with `tree_verify="decode"` (or "auto" where the backend
says it pays), one decode list per draft token (`hwkv.spec.tree_decode_list`) as `md.tree_decode`. The
planner keeps the graph mode's static buffers for both. Its `check` runs first, before the template builds or
refills anything: it refuses a tree that does not fit the batch, and any spec_info the plain modes cannot take (a
`MultiStepDraft` runs through `init_draft_metadata`; an unknown type is a ConfigError, never silently ignored).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.checks import value_range, values_checkable
from hwkv.errors import ConfigError, ShapeError
from hwkv.metadata import ForwardMetadata, KVIndexList
from hwkv.spec import (DraftTree, MultiStepDraft, TreeDecodeBuffers, TreeMask, alloc_tree_decode, build_tree_mask,
                       check_draft_tree, check_tree, tree_decode_list)


class TreePlanner:
    """One backend's verify-tree metadata (see module doc); `backend` gives the device, options and lists."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._tree_static: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # (mask_indptr, q_positions)
        self._tree_decode_static: Dict[Optional[int], TreeDecodeBuffers] = {}  # decode-like verify graphs' lists
        self._token_arange: Optional[torch.Tensor] = None  # int32 [max_num_tokens + 1]: its qo_indptr

    def init_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """The graph mode's tree buffers (the backend's init_graph_state calls it)."""
        dev = self.backend.device
        self._tree_static = (torch.zeros(max_bs + 1, dtype=torch.int64, device=dev),
                             torch.zeros(max_num_tokens, dtype=torch.int64, device=dev))

    def check(self, batch: ForwardBatch, ext_cpu: Optional[torch.Tensor]) -> Optional[int]:
        """What the batch's spec_info asks of the plain metadata step, checked before anything is built or refilled:
        None (returns None), or a DraftTree of a TARGET_VERIFY forward on the pool's device whose mask fits the
        batch (returns the mask's length). ext_cpu: the host extend lengths (eager), or None (graph mode: the
        batch's own host copy when it has one, checked as eager; else equal draft counts per request, the mask's
        length static, the lengths read where values are checkable: CPU, HWKV_DEBUG). A MultiStepDraft takes the
        draft metadata step; any other spec_info is refused (ConfigError)."""
        info = batch.spec_info
        if info is None:
            return None
        if isinstance(info, MultiStepDraft):
            raise ConfigError("a MultiStepDraft batch runs through init_draft_metadata (graphs: "
                              "init_draft_metadata_graph, hwkv.draft.DraftGraphRunner), not init_forward_metadata")
        if not isinstance(info, DraftTree):
            raise ConfigError(f"batch.spec_info is a {type(info).__name__}: the metadata step takes None or a "
                              "hwkv.spec.DraftTree (TARGET_VERIFY); a hwkv.spec.MultiStepDraft runs through "
                              "init_draft_metadata")
        if batch.forward_mode != ForwardMode.TARGET_VERIFY:
            raise ConfigError(f"a DraftTree belongs to a TARGET_VERIFY forward, not {batch.forward_mode.name}")
        check_draft_tree(info, self.backend.device)
        if ext_cpu is not None:
            return check_tree(info, ext_cpu, self.backend.debug)
        if batch.extend_seq_lens_cpu is not None:  # graph mode with the host lengths: the eager step's exact check
            return check_tree(info, batch.extend_seq_lens_cpu, self.backend.debug and values_checkable(info.mask))
        total = int(info.mask.shape[0])
        bs = batch.batch_size
        per = batch.num_tokens // max(bs, 1)
        ext = batch.extend_seq_lens
        if bs and ext is not None and values_checkable(ext) and (
                batch.num_tokens != bs * per or value_range(ext) != (per, per)):
            raise ShapeError(f"a graph verify takes equal draft counts per request: extend_seq_lens are "
                             f"{ext.tolist()}, {batch.num_tokens} tokens over {bs} requests")
        if total != batch.batch_size * per * per:
            raise ShapeError(f"DraftTree.mask has {total} entries; {batch.batch_size} requests of {per} draft "
                             f"tokens need {batch.batch_size * per * per}")
        return total

    def mask(self, batch: ForwardBatch, ext: torch.Tensor, qo_indptr: torch.Tensor, q_pos0: torch.Tensor,
             total: Optional[int], graph: bool = False) -> Optional[TreeMask]:
        """The verify tree's kernel form (mask offsets, query positions), once per forward; None without one.
        `total`: what `check` returned for the batch."""
        if total is None:
            return None
        indptr, positions = self._tree_static if graph else (None, None)
        return build_tree_mask(batch.spec_info, ext, qo_indptr, q_pos0, total, batch.num_tokens, indptr, positions)

    def decode_like(self, requests: int, tokens: int, chain: bool) -> bool:
        """Whether a verify of `requests` requests and `tokens` draft tokens runs decode-like: the one rule that
        `decode_lists` and VerifyStepGraph's buckets follow. tree_verify "decode": always; "extend": never; "auto":
        where the backend says it pays, by `decode_like_chain_pays` for a chain (`DraftTree.chain`: its extend
        verify needs no mask, so it stays ahead to smaller batches) and `decode_like_verify_pays` for a tree."""
        mode = self.backend.options.tree_verify
        if mode != "auto":
            return mode == "decode"
        pays = self.backend.decode_like_chain_pays if chain else self.backend.decode_like_verify_pays
        return bool(pays(requests, tokens))

    def decode_lists(self, md: ForwardMetadata, ext: torch.Tensor, batch: ForwardBatch) -> None:
        """Where `decode_like` says so (tree_verify="decode", or "auto" where it pays): md.tree_decode, the verify
        as a decode forward of one query per draft token over its own lists. Eager: the backend's kernel
        metadata for it too (vendor decode ops that plan from the lists alone take it); graph mode writes the
        static lists and builds no vendor tables (theirs are sized for the graph's own lists), so those
        layers run the portable kernels."""
        be = self.backend
        num_tokens, rows, mode = batch.num_tokens, batch.req_pool_indices, be.options.tree_verify
        if md.tree is None or not self.decode_like(batch.batch_size, num_tokens, batch.spec_info.chain):
            return
        static = self._tree_decode_static if md.graph else {}
        if md.graph and not static:  # the first decode-like graph verify: its capture's warm-up refill, not a replay
            # "decode": every bucket takes these lists; "auto": only small ones do, and GraphRunner captures its
            # largest bucket first, so this one is the largest (a later, larger one is a CapacityError)
            st, ctx = be.static, be.graph_max_context_len
            tokens = st.max_num_tokens if mode == "decode" else num_tokens
            with torch.inference_mode(False):   # kept by the graphs: normal tensors, refilled in any grad mode
                static.update({w: alloc_tree_decode(tokens, ctx if w is None else min(ctx, w), be.device)
                               for w in [None, *be.windows]})
                self._token_arange = torch.arange(st.max_num_tokens + 1, dtype=torch.int32, device=be.device)

        def one(lst: KVIndexList) -> KVIndexList:
            buf = static.get(lst.window)
            cap = buf.row_cap if buf is not None else (min(lst.max_len, lst.window) if lst.window else lst.max_len)
            return tree_decode_list(md.tree, lst, md.qo_indptr, md.q_pos0, ext, num_tokens, max(cap, 1), buf,
                                    (be.req_to_token_pool.req_to_token, rows))

        qo = (self._token_arange[:num_tokens + 1] if md.graph
              else torch.arange(num_tokens + 1, dtype=torch.int32, device=be.device))
        md.tree_decode = ForwardMetadata(md.write_loc, md.swa_out_cache_loc, qo, md.tree.q_positions, one(md.full),
                                         {w: one(lst) for w, lst in md.windows.items()}, 1, num_tokens, True,
                                         graph=md.graph)
        if not md.graph:  # no host lengths of its lists (tree depths live on the device): None
            be.init_kernel_metadata(md.tree_decode, batch, graph=False)
