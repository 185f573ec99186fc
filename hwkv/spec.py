"""Speculative decoding with the hybrid pool: the verify tree, multi-step drafts, accept/reject.

Tree verify (TARGET_VERIFY with top-k > 1): request b's n_b draft tokens sit in its row at positions
q_pos0[b] .. q_pos0[b] + n_b - 1 (written by the forward, like any extend), in an order where a
token's ancestors come before it. `DraftTree.mask` says which draft tokens each draft token sees:
mask[i, j] is True iff j is i or an ancestor of i. A draft token's position is q_pos0[b] + depth,
depth = (number of True in its row) - 1; the window applies to positions (W keys, itself included),
so a prefix key at position p is visible to draft i iff p > pos_i - W, and draft j iff mask[i, j]
and pos_j > pos_i - W. The metadata step turns the tree into a `TreeMask` once per forward; the
extend kernels take it as `tree=`.

Decode-like tree verify (backend option `tree_verify="decode"`): every draft token becomes a decode
query over its own list: its request's prefix keys, then its ancestors in depth order, then itself.
Those keys sit at consecutive positions (prefix ... q_pos0 - 1, then q_pos0 + depth), so any decode
kernel is window-exact over the list with no mask at all (`tree_decode_list`, once per forward per list).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, NoReturn, Optional

import torch

from hwkv import ops
from hwkv.checks import (as_int, check_flag, check_host_copy, check_on_device, check_rows, check_shape, items_of,
                         values_checkable)
from hwkv.errors import CapacityError, DoubleFreeError, ShapeError
from hwkv.metadata import KVIndexList, cumsum_into
from hwkv.pages import ERR_ACCEPT_INDEX, ERR_ACCEPTED
from hwkv.sigint import interrupts_held


@dataclass(frozen=True)
class MultiStepDraft:
    """`ForwardBatch.spec_info` of a multi-step draft decode: `num_steps` draft tokens per request whose
    slots were allocated at once; `out_cache_loc` holds them step-major ([step 0 of every request,
    step 1 ...]), already written into the rows at positions seq_lens - 1 + step, and `seq_lens` are
    the lengths after step 0. `writes_swa=False`: the draft model has no SWA layer, so nothing is
    translated and no window list is built (an SWA layer forwarded anyway raises MissingSWALocError)."""

    num_steps: int
    writes_swa: bool = True

    def __post_init__(self) -> None:
        steps = as_int(self.num_steps)  # numpy and 0-d tensor integers kept as an int; a bool is none (True read as 1)
        if steps is None or steps < 1:
            raise ShapeError(f"MultiStepDraft.num_steps={self.num_steps!r} must be an integer >= 1 (a bool is none)")
        check_flag("MultiStepDraft.writes_swa", self.writes_swa)
        object.__setattr__(self, "num_steps", steps)


class TreeMask(NamedTuple):
    """Kernel-facing form of a verify tree, built once per forward by the metadata step.

    mask: bool [sum_b n_b^2], request b's [n_b, n_b] block row-major from mask_indptr[b];
    mask_indptr: int64 [bs + 1]; q_positions: int64 [T], each query's position (q_pos0 + depth).
    Request b's draft j is at list position q_pos0[b] + j, and its position is
    q_positions[qo_indptr[b] + j].
    """

    mask: torch.Tensor
    mask_indptr: torch.Tensor
    q_positions: torch.Tensor


@dataclass
class DraftTree:
    """What the engine hands as `ForwardBatch.spec_info` for a tree verify: the draft tokens'
    ancestor masks, flattened per request ([n_b, n_b] row-major, n_b = extend_seq_lens[b]). `chain`: every
    block is the causal chain (a linear verify carried as a tree to run decode-like, as VerifyStepGraph does);
    it only picks the rule tree_verify="auto" asks (`hwkv.spec_plan.TreePlanner.decode_like`)."""

    mask: torch.Tensor
    chain: bool = False

    def __post_init__(self) -> None:
        check_draft_tree(self)

    @staticmethod
    def from_parents(parents: "list[list[int]]", device: Optional[torch.device] = None) -> "DraftTree":
        """Build from each request's parent lists (parents[b][i] < i, or -1 for a root): a host
        helper for tests and engines that keep trees as parent arrays."""
        blocks = []
        lists = items_of(parents)
        if lists is None:
            _no_lists(parents)
        for b, par in enumerate(lists):
            par = items_of(par)
            if par is None:
                _no_lists(lists, b)
            n = len(par)
            m = torch.zeros(n, n, dtype=torch.bool, device="cpu")
            for i, parent in enumerate(par):
                p = as_int(parent)
                if p is None or not -1 <= p < i:
                    raise ShapeError(f"draft token {i} has parent {parent!r}: a parent is -1 (a root) or an earlier "
                                     f"draft token's index in [0, {i}) (parents come before their children)")
                m[i, i] = True
                if p >= 0:
                    m[i] |= m[p]
            blocks.append(m.reshape(-1))
        flat = torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.bool, device="cpu")
        return DraftTree(flat.to(device) if device is not None else flat)


def _no_lists(parents: Any, b: Optional[int] = None) -> NoReturn:
    """DraftTree.from_parents' refusal of what is no list of parent lists (ShapeError naming what was given)."""
    what = f"parents[{b}] is {parents[b]!r}" if b is not None else f"got {type(parents).__name__} {parents!r}"
    raise ShapeError(f"parents must be one list of parent indices a request (e.g. [[-1, 0, 0]] for one request of "
                     f"three draft tokens): {what}")


def check_tree(tree: DraftTree, ext_cpu: torch.Tensor, debug: bool) -> int:
    """The mask's length must be sum(n_b^2) (host lengths: no sync); debug also checks the values (diagonal
    set, nothing above it, and a tree: each token's ancestors are one path, one at every depth below its
    own, whose ancestors are its too), which reads the mask. Returns the mask length."""
    need = int((ext_cpu.to(torch.int64) ** 2).sum())
    got = int(tree.mask.shape[0])
    if got != need:
        raise ShapeError(f"DraftTree.mask has {got} entries; the draft tokens per request "
                         f"{ext_cpu.tolist()} need sum(n^2) = {need}")
    if debug and need:
        at = 0
        for n in ext_cpu.tolist():
            block = tree.mask[at:at + n * n].view(n, n).cpu()
            if not bool(block.diagonal().all()) or bool(torch.triu(block, 1).any()):
                raise ShapeError(f"DraftTree.mask block at {at} ({n} x {n}) must have its diagonal set and "
                                 "nothing above it (ancestors come first)")
            depth = block.sum(1) - 1
            for i in range(n):
                anc = block[i].nonzero().flatten()
                if (not torch.equal(depth[anc].sort().values, torch.arange(len(anc), device="cpu"))
                        or bool((block[anc] & ~block[i]).any())):
                    raise ShapeError(f"DraftTree.mask block at {at}: token {i}'s row {block[i].int().tolist()} is "
                                     "not one ancestor path (one token at every depth below its own, each "
                                     "with its own ancestors in the row)")
            at += n * n
    return need


def _mask_entries(ext: torch.Tensor, qo_indptr: torch.Tensor, mask_indptr: torch.Tensor, total: int
                  ) -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor]":
    """For each of the `total` mask entries: its request, and the batch rows of its query token (row) and
    of the draft it looks at (col); request b's [n_b, n_b] block is row-major from mask_indptr[b]."""
    dev = ext.device
    req = torch.repeat_interleave(torch.arange(ext.shape[0], device=dev), ext * ext, output_size=total)
    local = torch.arange(total, device=dev) - mask_indptr[req]
    n_b = ext[req].clamp(min=1)
    first = qo_indptr.to(torch.int64)[req]
    return req, first + torch.div(local, n_b, rounding_mode="floor"), first + torch.remainder(local, n_b)


def build_tree_mask(tree: DraftTree, ext: torch.Tensor, qo_indptr: torch.Tensor, q_pos0: torch.Tensor,
                    total: int, num_tokens: int, mask_indptr: Optional[torch.Tensor] = None,
                    q_positions: Optional[torch.Tensor] = None) -> TreeMask:
    """mask_indptr and each query's position from the tree, in a constant number of device ops (no
    host sync); `mask_indptr`/`q_positions` given: written in place (graph buffers)."""
    dev = q_pos0.device
    ext = ext.to(torch.int64)
    bs = ext.shape[0]
    if mask_indptr is None:
        mask_indptr = torch.zeros(bs + 1, dtype=torch.int64, device=dev)
    mask_indptr[:1].zero_()
    torch.cumsum(ext * ext, 0, out=mask_indptr[1:bs + 1])
    if q_positions is None:
        q_positions = torch.empty(num_tokens, dtype=torch.int64, device=dev)
    _, row, _ = _mask_entries(ext, qo_indptr, mask_indptr, total)
    depth = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
    depth.index_add_(0, row, tree.mask.to(torch.int64))
    tok_req = torch.repeat_interleave(torch.arange(bs, device=dev), ext, output_size=num_tokens)
    torch.add(q_pos0[tok_req], depth - 1, out=q_positions[:num_tokens])
    return TreeMask(tree.mask, mask_indptr[:bs + 1], q_positions[:num_tokens])


class TreeDecodeBuffers(NamedTuple):
    """Static storage of one decode-like tree list (graph mode): indptr int32 [T + 1], pos0 int64 [T],
    indices int64 [T * row_cap + 1] (the last entry takes the writes of masked-off elements)."""

    indptr: torch.Tensor
    pos0: torch.Tensor
    indices: torch.Tensor
    row_cap: int


def alloc_tree_decode(num_tokens: int, row_cap: int, device: torch.device) -> TreeDecodeBuffers:
    """Storage for `tree_decode_list` of up to `num_tokens` draft tokens whose lists hold <= row_cap keys.
    The indices are left uninitialised: only entries below indptr[T] are ever read, and an eager forward
    allocates T x row_cap of them (a memset of 120 MB at 8 x 15 drafts over 128K keys)."""
    if num_tokens * row_cap >= 2 ** 31:   # the lists' indptr is int32
        raise CapacityError(f"{num_tokens} draft tokens x {row_cap} keys = {num_tokens * row_cap} list entries "
                            f"exceed the int32 indptr's {2 ** 31 - 1}")
    return TreeDecodeBuffers(torch.zeros(num_tokens + 1, dtype=torch.int32, device=device),
                             torch.zeros(num_tokens, dtype=torch.int64, device=device),
                             torch.empty(num_tokens * row_cap + 1, dtype=torch.int64, device=device), row_cap)


def tree_decode_list(tree: TreeMask, lst: KVIndexList, qo_indptr: torch.Tensor, q_pos0: torch.Tensor,
                     ext: torch.Tensor, num_tokens: int, row_cap: int,
                     out: Optional[TreeDecodeBuffers] = None,
                     rows: Optional["tuple[torch.Tensor, torch.Tensor]"] = None) -> KVIndexList:
    """Request lists -> one decode list per draft token (see the module doc), in a constant number of
    device ops and no host sync: token t of request b reads b's list entries [lo_t, q_pos0 - pos0)
    (lo_t: the window start of t for window lists, else 0), its ancestors by depth (for window lists
    those inside the window), then itself; the list starts at its first key's position. row_cap: host
    bound on any token's list (the request lists' max_len; at most W for window lists, which keep only
    the keys in t's window). `out`: static storage
    from `alloc_tree_decode` (graph mode), else allocated here. `rows`: (req_to_token, req_pool_indices)
    of the batch: a full list (slot j = req_to_token[row, j]) then takes its prefixes straight from the
    rows, live entries only (the torch path: `ops.fill_kv_indices`, instead of a [T, row_cap] grid).
    Devices that registered a builder (`ops.register_tree_decode`: the Triton ones) run it instead of
    the torch path's sixty-odd small ops."""
    dev = q_pos0.device
    t_all, ext = num_tokens, ext.to(torch.int64)
    if out is None:
        out = alloc_tree_decode(t_all, row_cap, dev)
    elif t_all > out.pos0.shape[0] or row_cap > out.row_cap:
        raise CapacityError(f"{t_all} draft tokens with lists of {row_cap} keys exceed the tree-decode buffers "
                            f"({out.pos0.shape[0]} tokens of {out.row_cap})")
    from_rows = rows is not None and not lst.window and not lst.is_swa_slots
    fused = ops.tree_decode_kernel(dev.type)
    if fused is not None:
        fused(tree.q_positions, tree.mask, tree.mask_indptr, qo_indptr, q_pos0, lst.indptr, lst.indices, lst.pos0,
              lst.window, out.indptr, out.pos0, out.indices, t_all, ext.shape[0], row_cap, rows if from_rows else None)
    else:
        _tree_decode_torch(tree, lst, qo_indptr, q_pos0, ext, t_all, row_cap, out, rows if from_rows else None)
    return KVIndexList(out.indptr[:t_all + 1], out.indices, out.pos0[:t_all], lst.window, row_cap, lst.is_swa_slots)


def _tree_decode_torch(tree: TreeMask, lst: KVIndexList, qo_indptr: torch.Tensor, q_pos0: torch.Tensor,
                       ext: torch.Tensor, t_all: int, row_cap: int, out: TreeDecodeBuffers,
                       rows: Optional["tuple[torch.Tensor, torch.Tensor]"]) -> None:
    """`tree_decode_list` in torch ops (about sixty small ones): every device's default."""
    dev, bs = q_pos0.device, ext.shape[0]
    tok_req = torch.repeat_interleave(torch.arange(bs, device=dev), ext, output_size=t_all)
    q_pos = tree.q_positions[:t_all]
    pos0_b, kv_start = lst.pos0.to(torch.int64), lst.indptr.to(torch.int64)
    rel0 = (q_pos0.to(torch.int64) - pos0_b)[tok_req]            # list entries before the drafts
    depth = q_pos - q_pos0.to(torch.int64)[tok_req]
    lo, dmin = torch.zeros_like(rel0), torch.zeros_like(rel0)
    if lst.window:   # keep only the window: prefix entries from lo_t, ancestors from depth dmin_t
        start = q_pos - lst.window + 1 - pos0_b[tok_req]       # window start, relative to the list
        lo = torch.minimum(start.clamp(min=0), rel0)
        dmin = (start - rel0).clamp(min=0)
    prefix = rel0 - lo
    lens = prefix + depth - dmin + 1
    cumsum_into(lens, out.indptr[:t_all + 1])
    starts = out.indptr[:t_all].to(torch.int64)
    torch.add(pos0_b[tok_req], lo + dmin, out=out.pos0[:t_all])
    dump = out.indices.shape[0] - 1
    if rows is not None:
        # 2T runs (t's prefix, then a placeholder run of t's path length that the drafts overwrite below)
        rtt, req_rows = rows
        runs = torch.stack([prefix, lens - prefix], 1).reshape(-1)
        run_ptr = cumsum_into(runs, torch.empty(2 * t_all + 1, dtype=torch.int32, device=dev))
        run_rows = torch.stack([req_rows.to(torch.int64)[tok_req], torch.zeros_like(tok_req)], 1).reshape(-1)
        run_pos0 = torch.stack([pos0_b[tok_req] + lo, torch.zeros_like(lo)], 1).reshape(-1)
        ops.fill_kv_indices(rtt, run_rows, run_pos0, run_ptr, out.indices)
    else:
        # prefix keys: element (t, k) of a [T, row_cap] grid, kept where k < prefix_t
        k = torch.arange(row_cap, device=dev)
        keep = k[None, :] < prefix[:, None]
        src = (kv_start[tok_req] + lo)[:, None] + k[None, :]
        dst = torch.where(keep, starts[:, None] + k[None, :], dump)
        out.indices.index_copy_(0, dst.reshape(-1), lst.indices[torch.where(keep, src, 0).reshape(-1)])
    # drafts: mask entry (row r, draft j) of request b, set bits only, into t's slot prefix_t + depth_j
    total = tree.mask.shape[0]
    if total:
        req, row, col = _mask_entries(ext, qo_indptr, tree.mask_indptr, total)
        keep_d = tree.mask & (depth[col] >= dmin[row])
        dst_d = torch.where(keep_d, starts[row] + prefix[row] + depth[col] - dmin[row], dump)
        src_d = kv_start[req] + rel0[col] + (col - qo_indptr.to(torch.int64)[req])   # + draft j of request b
        out.indices.index_copy_(0, dst_d, lst.indices[src_d])


def tree_visible(prefix_len: int, tree_block: torch.Tensor, window: Optional[int]) -> "tuple[torch.Tensor, torch.Tensor]":
    """For the reference: ([n, prefix_len + n] bool visibility, [n] query positions) of one request's
    draft tokens over its prefix and drafts, straight from the definition in this module's docstring."""
    n = tree_block.shape[0]
    block = tree_block.bool().cpu()
    q_pos = prefix_len + block.sum(1).to(torch.int64) - 1
    k_pos = torch.cat([torch.arange(prefix_len, device="cpu"), q_pos])
    see = torch.cat([torch.ones(n, prefix_len, dtype=torch.bool, device="cpu"), block], dim=1)
    if window is not None and window > 0:
        see &= k_pos[None, :] > q_pos[:, None] - window
    return see, q_pos


def accept_draft_tokens(allocator: Any, pool: Any, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                        prefix_lens: torch.Tensor, accept_index: torch.Tensor, accept_lens: torch.Tensor, *,
                        prefix_lens_cpu: torch.Tensor, accept_lens_cpu: torch.Tensor,
                        frontiers: Optional[torch.Tensor] = None, chain: bool = False) -> torch.Tensor:
    """After a verify: keep each request's accepted draft tokens as its next positions, free the rest
    in both pools; returns the new seq_lens (prefix + accepted), on the device.

    accept_index int64 [bs, n]: row b's first accept_lens[b] entries are the accepted drafts' indices
    (0..n-1, in path order: ancestors first), n = drafts per request, which sit at row positions
    prefix .. prefix + n - 1. Page size 1: the row is pointed at the accepted slots and every other
    draft slot is freed. Page size P > 1 (a token's in-page offset must equal its position's): the
    accepted K/V move to the slots of their final positions (`pool.move_kv`) and the pages wholly past
    the new length go back. The row's draft positions past the new length are cleared to 0, so a second
    accept of the same drafts is caught (its positions hold no slot). Host lengths size everything: no
    host sync. Call it before the step's out-of-window release, which then runs on the accepted lengths
    (`frontiers`, if given: int64 [bs], each request's SWA frontier as req_pool_indices orders them, checked on
    the host where the allocator checks eagerly: none may pass a request's prefix).

    Where the allocator checks eagerly (CPU, HWKV_DEBUG) a draft named twice or out of range raises
    ShapeError and an accept applied twice DoubleFreeError, before anything changes. Otherwise they are
    found on the device and recorded in the allocator (raised by its next `available_size` or
    `check_integrity`): such a request keeps its first accept_lens[b] drafts in place (nothing leaks),
    and one whose drafts were already accepted is left as it is (nothing freed, its row and K/V as they were).
    Arguments that are not integer tensors of the batch's shape (frontiers: int64), host lengths out of range and
    (where values are checkable: CPU, HWKV_DEBUG) rows outside req_to_token or one row named twice raise
    ShapeError / LocError before anything changes.

    `chain=True`: every accept_index row is 0, 1, 2, ... (a chain's drafts, accepted in place, as a greedy engine
    verifies them), so no K/V moves: without it a page size above 1 copies every layer's accepted K/V onto itself.
    Checked on the host where the allocator checks eagerly (ShapeError); elsewhere the caller's word.
    """
    check_flag("chain", chain)
    bs, n, pre_cpu, acc_cpu = _check_accept_args(req_to_token, req_pool_indices, prefix_lens, accept_index,
                                                 accept_lens, prefix_lens_cpu, accept_lens_cpu, frontiers)
    dev = req_to_token.device
    ar = torch.arange(n, device=dev)[None, :]
    valid = ar < accept_lens.to(torch.int64)[:, None]
    idx = torch.where(valid, accept_index, 0)
    rows = req_pool_indices.to(torch.int64)[:, None]
    pos = prefix_lens.to(torch.int64)[:, None] + ar
    locs = req_to_token[rows, pos]                                   # [bs, n] the drafts' slots, as written
    page = allocator.page_size
    # [bs, 1] True for a request left as it is (deferred checks: its drafts were already accepted); its slots to
    # free become the padding slot 0, which the free skips (the range error it records there ranks after the
    # ERR_ACCEPTED recorded first, in an earlier op)
    left = None
    if allocator.immediate:  # host checks where they cost nothing (CPU, debug): before anything changes
        _check_accept(idx.cpu(), valid.cpu(), n, frontiers, pre_cpu, locs.cpu())
        if chain and bool((valid & (idx != ar)).any().cpu()):
            b = int((valid & (idx != ar)).any(1).to(torch.int8).argmax())
            raise ShapeError(f"chain=True, but accept_index of request {b} is no chain in place: "
                             f"{idx[b][valid[b]].tolist()} (drafts 0, 1, 2, ... expected)")
    else:  # the same checks on the device: recorded, and the bad requests changed so that nothing leaks
        inside = (idx >= 0) & (idx < n)
        taken = torch.zeros(bs, n, dtype=torch.int64, device=dev).scatter_add_(
            1, torch.where(inside, idx, 0), valid.to(torch.int64))
        bad_index = (valid & ~inside).any(1) | (taken > 1).any(1)
        accepted = (locs == 0).any(1)                                # drafts already accepted: keep as they are
        which = torch.arange(bs, device=dev)
        allocator.record_error(bad_index, which, ERR_ACCEPT_INDEX)
        allocator.record_error(accepted, which, ERR_ACCEPTED)
        idx = torch.where((bad_index | accepted)[:, None], ar, idx)  # keep the first drafts in place
        left = accepted[:, None]
    kept_locs = torch.where(valid, locs.gather(1, idx), locs)        # slot of each final position
    if page == 1:
        kept = torch.zeros(bs, n, dtype=torch.int64, device=dev).scatter_add_(1, idx, valid.to(torch.int64)) > 0
        rejected = int(bs * n - int(acc_cpu.sum()))
        order = torch.argsort(kept.view(-1).to(torch.int8), stable=True)[:rejected]  # not kept first: no sync
        free = _unless_left(left, locs, 0).view(-1)[order]
        if allocator.immediate:
            allocator._check_free(free, swa_required=False)          # raise before the row changes
        with interrupts_held():  # the rows and the free land together
            req_to_token[rows, pos] = _unless_left(left, torch.where(valid, kept_locs, 0), locs)
            allocator.free(free)
    else:
        new_end = ((pre_cpu + acc_cpu + page - 1) // page) * page   # first position of the first page to free
        old_end = pre_cpu + n
        pages = ((old_end - new_end + page - 1) // page).clamp(min=0)
        total = int(pages.sum())
        free = None
        if total:
            req = torch.repeat_interleave(torch.arange(bs, device="cpu"), pages, output_size=total)
            first = torch.cat([torch.zeros(1, dtype=torch.int64, device="cpu"), pages.cumsum(0)[:-1]])
            at = new_end[req] + (torch.arange(total, device="cpu") - first[req]) * page
            # both index lists in one copy, not waited for (two blocking copies had each waited for the stream)
            req, at = torch.stack((req, at)).to(dev, non_blocking=True)
            free = req_to_token[req_pool_indices.to(torch.int64)[req], at]
            if left is not None:
                free = torch.where(left[req, 0], 0, free)
            if allocator.immediate:
                allocator._check_free(free, swa_required=False)      # raise before anything moves
        with interrupts_held():  # the K/V moves, the rows and the free land together
            if not chain:  # (a chain's drafts stay where they are: kept_locs is locs)
                pool.move_kv(kept_locs.view(-1), locs.view(-1))     # (a request left as it is: onto itself)
            req_to_token[rows, pos] = _unless_left(left, torch.where(valid, locs, 0), locs)
            if free is not None:
                allocator.free(free)
    return prefix_lens.to(torch.int64) + accept_lens.to(torch.int64)


def _unless_left(left: Optional[torch.Tensor], new: Any, old: Any) -> Any:
    """`new` for every request but those left as they are (`left` [bs, 1]; None: none), which keep `old`."""
    return new if left is None else torch.where(left, old, new)


def _check_accept_args(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                       accept_index: torch.Tensor, accept_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor,
                       accept_lens_cpu: torch.Tensor, frontiers: Optional[torch.Tensor] = None
                       ) -> "tuple[int, int, torch.Tensor, torch.Tensor]":
    """accept_draft_tokens' arguments against each other and req_to_token (ShapeError, LocError): integer tensors
    of the batch's shape (frontiers, when given, int64 [bs]), host lengths in range, rows in range and distinct
    (their values where checkable: CPU, HWKV_DEBUG).
    Returns (requests, drafts per request, host int64 prefix lengths, host int64 accept lengths)."""
    args = (("req_pool_indices", req_pool_indices), ("prefix_lens", prefix_lens), ("accept_index", accept_index),
            ("accept_lens", accept_lens), ("prefix_lens_cpu", prefix_lens_cpu), ("accept_lens_cpu", accept_lens_cpu))
    for name, t in args:
        if not isinstance(t, torch.Tensor):
            raise ShapeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ShapeError(f"{name} must hold integers, got {t.dtype}")
    if req_pool_indices.dim() != 1:
        raise ShapeError(f"req_pool_indices must be 1-D (one row a request), got shape {tuple(req_pool_indices.shape)}")
    for name, t in args[:4] + (("frontiers", frontiers),):   # (host copies may live anywhere: they are read once)
        check_on_device(name, t, req_to_token.device, "req_to_token")
    bs = int(req_pool_indices.shape[0])
    if accept_index.dim() != 2 or accept_index.shape[0] != bs or accept_index.dtype != torch.int64:
        raise ShapeError(f"accept_index must be int64 [batch {bs}, drafts], got {accept_index.dtype} "
                         f"{tuple(accept_index.shape)}")
    n = int(accept_index.shape[1])
    for name, t in args:
        if name != "accept_index" and t.shape != (bs,):
            raise ShapeError(f"{name} has shape {tuple(t.shape)}, expected ({bs},)")
    if frontiers is not None and (not isinstance(frontiers, torch.Tensor) or frontiers.dtype != torch.int64
                                  or frontiers.shape != (bs,)):  # (the step graphs' per-row table is not it)
        got = (f"{frontiers.dtype} {tuple(frontiers.shape)}" if isinstance(frontiers, torch.Tensor)
               else type(frontiers).__name__)
        raise ShapeError(f"frontiers must be an int64 tensor of shape ({bs},) (each request's SWA frontier, as "
                         f"req_pool_indices), got {got}")
    pre_cpu, acc_cpu = prefix_lens_cpu.to(torch.int64).cpu(), accept_lens_cpu.to(torch.int64).cpu()
    check_host_copy("prefix_lens", prefix_lens, prefix_lens_cpu)   # the frees size from these, the rows from those
    check_host_copy("accept_lens", accept_lens, accept_lens_cpu)
    if not bs:
        return bs, n, pre_cpu, acc_cpu
    if int(acc_cpu.max()) > n or int(acc_cpu.min()) < 0:
        bad = int(torch.argmax(((acc_cpu > n) | (acc_cpu < 0)).to(torch.int8)))
        raise ShapeError(f"request {bad} accepts {int(acc_cpu[bad])} tokens; it drafted {n} (accept 0..{n})")
    if int(pre_cpu.min()) < 0:
        bad = int(torch.argmin(pre_cpu))
        raise ShapeError(f"prefix_lens[{bad}] is {int(pre_cpu[bad])}; allowed range is "
                         f"[0, {req_to_token.shape[1] - n}] (drafts of {n} within max_context_len "
                         f"{req_to_token.shape[1]})")
    if int((pre_cpu + n).max()) > req_to_token.shape[1]:
        raise ShapeError(f"drafts reach position {int((pre_cpu + n).max())}, past max_context_len "
                         f"{req_to_token.shape[1]}")
    # one row named twice: the second entry frees what the first keeps and leaves a hole in the row
    check_rows(req_pool_indices, req_to_token.shape[0], "an accept takes each request once", ShapeError)
    return bs, n, pre_cpu, acc_cpu


def _check_accept(idx: torch.Tensor, valid: torch.Tensor, n: int, frontiers: Optional[torch.Tensor],
                  prefix_cpu: torch.Tensor, locs: torch.Tensor) -> None:
    """Host checks of an accept (immediate mode): indices in range and distinct, drafts not yet accepted."""
    out = valid & ((idx < 0) | (idx >= n))
    if bool(out.any()):
        b = int(out.any(1).to(torch.int8).argmax())
        raise ShapeError(f"accept_index of request {b} holds a draft index outside [0, {n}): "
                         f"{idx[b][valid[b]].tolist()}")
    taken = torch.zeros(idx.shape[0], n, dtype=torch.int64, device="cpu").scatter_add_(1, idx, valid.to(torch.int64))
    if bool((taken > 1).any()):
        b = int((taken > 1).any(1).to(torch.int8).argmax())
        raise ShapeError(f"accept_index names one draft token twice in request {b}'s accepted path: "
                         f"{idx[b][valid[b]].tolist()}")
    if bool((locs == 0).any()):
        b = int((locs == 0).any(1).to(torch.int8).argmax())
        raise DoubleFreeError(f"request {b}'s draft positions {int(prefix_cpu[b])}.. hold no slot (0): its drafts "
                              "were already accepted (accept_draft_tokens applied twice?)")
    if frontiers is not None and bool((frontiers.cpu() > prefix_cpu).any()):
        raise ShapeError("an SWA frontier passed its request's prefix: release ran on the drafted length "
                         "before the accept; run accept_draft_tokens first")


def check_draft_tree(tree: DraftTree, device: Optional[torch.device] = None) -> None:
    """A DraftTree's fields as the kernels read them: a dense 1-D bool mask (on `device`'s type, when given) and a
    bool `chain` (ShapeError, ConfigError). At construction, and again by the metadata steps, eager and graph, before
    they build or store anything (the dataclass is mutable: a field set since would otherwise reach the kernels
    after a layer's K/V store)."""
    if not isinstance(tree.mask, torch.Tensor) or tree.mask.dtype != torch.bool or tree.mask.dim() != 1:
        raise ShapeError(f"DraftTree.mask must be a 1-D bool tensor (each request's [n, n] block "
                         f"flattened), got {getattr(tree.mask, 'dtype', type(tree.mask))} "
                         f"of shape {tuple(getattr(tree.mask, 'shape', ()))}")
    if device is not None and tree.mask.device.type != device.type:
        raise ShapeError(f"DraftTree.mask lives on {tree.mask.device}, the pool on {device}")
    _check_dense_mask("DraftTree.mask", tree.mask)
    check_flag("DraftTree.chain", tree.chain)


def _check_dense_mask(name: str, mask: torch.Tensor) -> None:
    """A 1-D mask the kernels read by offset from its start: its elements one apart (a strided view, e.g. big[::2],
    would have them read the bits in between). Refused rather than copied: a graph replays its captured address."""
    if mask.numel() > 1 and mask.stride(0) != 1:
        raise ShapeError(f"{name} has stride {mask.stride(0)}; the kernels read a dense 1-D mask (stride 1): pass "
                         "mask.contiguous()")


def check_tree_mask(tree: TreeMask, q: torch.Tensor, qo_indptr: torch.Tensor, q_pos0: torch.Tensor) -> None:
    """A verify tree's kernel form against the batch: mask bool [*], mask_indptr int64 [bs + 1],
    q_positions int64 [T], on q's device (CPU); request b's block holds n_b^2 bits inside the mask and
    its positions lie in q_pos0[b] + [0, n_b) (values read: free on CPU; skipped while torch.compile traces)."""
    if not isinstance(tree, TreeMask):
        raise ShapeError(f"tree must be a hwkv.spec.TreeMask, got {type(tree).__name__}")
    bs = qo_indptr.shape[0] - 1
    for name, t, dtype, shape in (("tree.mask", tree.mask, torch.bool, [None]),
                                  ("tree.mask_indptr", tree.mask_indptr, torch.int64, [bs + 1]),
                                  ("tree.q_positions", tree.q_positions, torch.int64, [q.shape[0]])):
        if not isinstance(t, torch.Tensor) or t.dtype != dtype:
            raise ShapeError(f"{name} must be a {dtype} tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        check_shape(name, t, shape)
        if t.device != q.device:
            raise ShapeError(f"{name} is on {t.device}, q is on {q.device}")
    _check_dense_mask("tree.mask", tree.mask)
    if bs > 0 and values_checkable(tree.mask_indptr):
        _check_tree_values(tree, qo_indptr.cpu().to(torch.int64), q_pos0.cpu().to(torch.int64))


def _check_tree_values(tree: TreeMask, qo: torch.Tensor, q_pos0: torch.Tensor) -> None:
    """Request b's mask block holds n_b^2 bits inside the mask, its positions lie in q_pos0[b] + [0, n_b)
    (qo, q_pos0: host int64 copies of qo_indptr and q_pos0)."""
    n = qo[1:] - qo[:-1]
    ptr = tree.mask_indptr.cpu()
    bad = torch.nonzero(ptr[1:] - ptr[:-1] != n * n).flatten()
    if bad.numel():
        b = int(bad[0])
        raise ShapeError(f"tree.mask_indptr gives request {b} {int(ptr[b + 1] - ptr[b])} mask entries; its "
                         f"{int(n[b])} draft tokens need {int(n[b]) ** 2}")
    if int(ptr[0]) < 0 or int(ptr[-1]) > tree.mask.shape[0]:
        raise ShapeError(f"tree.mask_indptr spans [{int(ptr[0])}, {int(ptr[-1])}), past tree.mask's "
                         f"{tree.mask.shape[0]} entries")
    req = torch.repeat_interleave(torch.arange(n.shape[0], device="cpu"), n)
    pos = tree.q_positions.cpu()[int(qo[0]): int(qo[0]) + req.shape[0]]
    rel = pos - q_pos0[req]
    bad = torch.nonzero((rel < 0) | (rel >= n[req])).flatten()
    if bad.numel():
        r, b = int(bad[0]), int(req[bad[0]])
        raise ShapeError(f"tree.q_positions[{int(qo[0]) + r}] = {int(pos[r])} lies outside request {b}'s draft "
                         f"positions [{int(q_pos0[b])}, {int(q_pos0[b] + n[b])})")
