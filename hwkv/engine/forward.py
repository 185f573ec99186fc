"""A forward's slot bookkeeping, in one place: the engine's step loop and the contract harness both run on it.

`ForwardSlots` keeps, over one allocator and its request rows, what a step does around the layers:
- `plan_extend` / `plan_decode`: a forward's requests (host lists: row, prefix length, new tokens) and the
  caller's token ids in one host tensor, copied to the device once (`StepLens`);
- `allocate`: each request's last loc gathered on the device, the allocator's one batched call (device lengths
  plus their host copies), the new locs written into req_to_token in one scatter, the `ForwardBatch`;
- `release`: the out-of-window release of a batch, only in the steps where the host's copy of some row's
  frontier moves (the allocator's own rule, on host lengths); the device frontiers per request row are the ones a
  whole-step graph (`hwkv.step_graph.DecodeStepGraph`) releases from, and `replay_decode` moves the host copy
  with such a replay;
- `new_rows` / `free`: request rows in and out, a finished request's slots back to the allocator;
- `undo`: a forward that raised after its allocation gives back the pages it opened (the step is run again).
No host sync anywhere, one host-to-device copy per forward, no device op per request. A layer only stores and
attends: the metadata step (`backend.init_forward_metadata`) is the caller's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from hwkv.checks import normal_tensors
from hwkv.release import release_out_of_window_batch
from hwkv.req_to_token import ReqToTokenPool
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.errors import LocError, ShapeError
from hwkv.metadata import aligned_width
from hwkv.sigint import interrupts_held

I64 = torch.int64
HOST = dict(dtype=torch.int64, device="cpu")  # host values: never on the default device a user set


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: itself on the CPU, else one pinned, non-blocking copy."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def pack(blocks: Sequence[Tuple[int, Sequence[Sequence[int]]]], device: torch.device
         ) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """Blocks of equal-length int lists (or arrays) as one host tensor sent in one copy; returns each block's [rows,
    width] views (host, device). Every list starts at a 16-byte boundary (`hwkv.metadata.aligned_width`): views at
    odd int64 offsets would make the batch size's parity pick a new kernel compile."""
    shapes = [(len(lists), aligned_width(width, I64), width) for width, lists in blocks]
    flat = np.zeros(sum(k * padded for k, padded, _ in shapes), dtype=np.int64)
    at = 0
    for (k, padded, width), (_, lists) in zip(shapes, blocks):
        view = flat[at:at + k * padded].reshape(k, padded)
        for i, one in enumerate(lists):  # one conversion per list, in numpy
            if len(one) != width:  # (numpy would broadcast a list of one across the row)
                raise ShapeError(f"pack: list {i} of a block of width {width} has {len(one)} entries")
            view[i, :width] = one
        at += k * padded
    host = torch.from_numpy(flat)
    dev = to_device(host, device)
    hosts, devs, at = [], [], 0
    for k, padded, width in shapes:
        hosts.append(host[at:at + k * padded].view(k, padded)[:, :width])
        devs.append(dev[at:at + k * padded].view(k, padded)[:, :width])
        at += k * padded
    return hosts, devs


# the forward's tokens whose logits are wanted (their indices in token order) and those tokens' request rows: host
# arrays a forward whose every token samples leaves out (None)
Keep = Tuple[np.ndarray, np.ndarray]


def _keep_block(keep: Optional[Keep]) -> List[Tuple[int, Sequence[Sequence[int]]]]:
    """`pack`'s block for `keep` (none without it)."""
    return [] if keep is None else [(len(keep[0]), list(keep))]


@dataclass
class StepLens:
    """One forward's requests and lengths as the scheduler holds them before allocation: host lists and tensors
    (`_cpu`) and their device views from one copy (`_dev`). Per token (`pos_dev`, `row_of_dev`, `ids_dev`) in
    request order; a decode has one token per request, at position prefix."""

    mode: ForwardMode
    rows: List[int]             # request rows (host)
    seq: List[int]              # lengths after the forward (host)
    host: torch.Tensor          # the per-request lists copied, one row each: rows, prefix lengths, ... (`ForwardSlots`')
    seq_cpu: torch.Tensor
    ext_cpu: Optional[torch.Tensor]  # new tokens per request (None: a decode, one each)
    rows_dev: torch.Tensor
    prefix_dev: torch.Tensor
    seq_dev: torch.Tensor
    ext_dev: Optional[torch.Tensor]
    before_dev: torch.Tensor    # the position of each request's last token (prefix - 1; a new request's clamped)
    pos_dev: torch.Tensor       # each new token's position
    row_of_dev: torch.Tensor    # each new token's request row
    ids_dev: Optional[torch.Tensor]  # the caller's token ids (None: none given)
    fresh: bool                 # some request has no token yet (no last loc)
    num_tokens: int
    # with `keep` (the forward's tokens whose logits are wanted, and their requests' rows) in the same copy:
    keep_dev: Optional[torch.Tensor] = None   # those tokens' indices in the forward
    where_dev: Optional[torch.Tensor] = None  # their request rows (where the sampled tokens go)

    @property
    def prefix_cpu(self) -> torch.Tensor:
        """Each request's prefix length (host): a view of the copied block, taken only when read."""
        return self.host[1]


class ForwardSlots:
    """Slots of a forward over one allocator and its request rows, and each row's out-of-window frontier.

    `window`: the sliding window the release keeps (None: pools without windows, nothing is released).
    `frontiers` (int64 [rows] on the device) is what the release moves and a whole-step graph takes;
    `frontiers_cpu` (numpy int64 [rows]) is the host's copy, moved by the same rule, read by the prefix cache."""

    @normal_tensors
    def __init__(self, allocator: Any, rtt: ReqToTokenPool, window: Optional[int]) -> None:
        self.allocator, self.rtt, self.window = allocator, rtt, window
        self.device = rtt.req_to_token.device
        self.page_size = allocator.page_size
        self.frontiers = torch.zeros(rtt.size, dtype=I64, device=self.device)
        self.frontiers_cpu = np.zeros(rtt.size, dtype=np.int64)

    # ---- request rows -----------------------------------------------------------------------------
    def new_rows(self, n: int) -> List[int]:
        """`n` request rows for requests starting empty, their frontiers at 0 (host, and the device in one copy).
        OutOfSlotsError when fewer rows are free."""
        rows = self.rtt.alloc(n)
        self.frontiers_cpu[rows] = 0
        self.frontiers[to_device(torch.tensor(rows, **HOST), self.device)] = 0
        return rows

    def set_frontier(self, row: int, frontier: int) -> None:
        """A row starting from cached tokens: its frontier (host and device), where the cache's SWA begins."""
        self.frontiers_cpu[row] = frontier
        self.frontiers[row] = frontier

    def free(self, rows: Sequence[int], kv_lens: Optional[Sequence[int]] = None) -> None:
        """Finished requests leave: the slots of each row's first `kv_lens` tokens go back to the allocator in
        one call (released SWA slots are skipped there; None: the prefix cache took them), then the rows. The rows
        are checked first: a row out of range or named twice frees nothing."""
        rows = self.rtt.check_free(rows)
        if kv_lens is not None:
            lens = np.asarray(kv_lens, dtype=np.int64)
            total = int(lens.sum())
            if total:  # every row's first kv_lens entries: one index copy and one gather, nothing per request
                rtt = self.rtt.req_to_token
                starts = np.repeat(np.asarray(rows, dtype=np.int64) * rtt.shape[1] - (np.cumsum(lens) - lens), lens)
                flat = torch.from_numpy(starts + np.arange(total, dtype=np.int64)).to(self.device, non_blocking=True)
                self.allocator.free(rtt.view(-1)[flat])
        self.rtt._give_back(rows)

    def undo(self, rows: Sequence[int], prefix: Sequence[int], new: Sequence[int], loc: Optional[torch.Tensor] = None,
             head: Optional[int] = None) -> bool:
        """A forward that raised after its allocation (request `rows[b]`: `new[b]` tokens after `prefix[b]`) gives
        back what the allocation took, so the same step can run again: the pages its tokens opened (a token at a
        page's first offset opened it; the others continued a page the request held), full and SWA, and their
        req_to_token entries become the padding slot 0 (past each request's length: nothing reads them). `loc`:
        the allocation's slots in token order; None: a graph replay allocated, and wrote them into req_to_token
        only if the full ring's head moved from `head` (the host's count of pages taken) and the pages there are
        the ones the ring gave since. Returns whether anything was given back. The error path only: it reads the
        device."""
        p, ring = self.page_size, self.allocator.pages
        prefix_h, new_h = np.asarray(prefix, dtype=np.int64), np.asarray(new, dtype=np.int64)
        pos = np.concatenate([np.arange(s, s + n) for s, n in zip(prefix_h, new_h)]) if len(rows) else prefix_h
        opened = torch.from_numpy(np.flatnonzero(pos % p == 0)).to(self.device)
        row_of = torch.from_numpy(np.repeat(np.asarray(rows, dtype=np.int64), new_h)).to(self.device)
        pos_t = torch.from_numpy(pos).to(self.device)
        rtt = self.rtt.req_to_token
        if loc is None:
            taken = ring.head - head if head is not None else 0
            if not taken or taken != opened.numel():
                return False  # raised before the replay's allocation (or a step that opened no page)
            loc = rtt[row_of, pos_t]
            given = ring.popped(head, taken)
            got = torch.sort(loc[opened] // p).values
            if not torch.equal(got.cpu(), torch.sort(given).values.cpu()) or \
                    not bool((ring.refs[got.to(ring.refs.device)] == 1).all()):
                return False  # the ring's pages are not where the replay writes them, live: it did not allocate
        if opened.numel():
            self.allocator.free(loc[opened])
        rtt[row_of, pos_t] = 0
        return True

    def sync_frontiers(self, rows: Sequence[int]) -> None:
        """The host's copy of these rows' frontiers read from the device (after a graph replay that raised: its
        release may have moved them). The error path only."""
        at = np.asarray(rows, dtype=np.int64)
        self.frontiers_cpu[at] = self.frontiers[torch.from_numpy(at).to(self.device)].cpu().numpy()

    # ---- a forward ----------------------------------------------------------------------------------
    def plan_extend(self, mode: ForwardMode, rows: List[int], prefix: List[int], new: List[int],
                    ids: Optional[Sequence[int]] = None, keep: Optional[Keep] = None) -> StepLens:
        """An extend-like forward: request `rows[b]` adds `new[b]` tokens after its `prefix[b]`; `ids` (one per
        new token, optional: a list or an int64 array) and `keep` (see `Keep`) travel in the same copy. Positions
        and rows per token are numpy's (no Python per token). LocError when a length passes the rows' context."""
        bs = len(rows)
        seq = [p + n for p, n in zip(prefix, new)]
        self._check_context(max(seq, default=0))
        new_h = np.asarray(new, dtype=np.int64).reshape(-1)
        if bs and (new_h.min() < 0 or min(prefix) < 0):
            raise LocError(f"extend lengths must be >= 0: prefix {prefix}, new {new}")
        t = int(new_h.sum())
        # token i of request b sits at prefix[b] + (i - first token of b in the forward)
        pos = np.arange(t, dtype=np.int64) + np.repeat(np.asarray(prefix, dtype=np.int64) - np.cumsum(new_h) + new_h,
                                                        new_h)
        row_of = np.repeat(np.asarray(rows, dtype=np.int64), new_h)
        if ids is not None and len(ids) != t:
            raise ShapeError(f"{len(ids)} token ids for {t} new tokens")
        blocks = [(bs, [rows, prefix, seq, new, [max(p - 1, 0) for p in prefix]]),
                  (t, [pos, row_of] + ([] if ids is None else [ids]))]
        (host, *_), (dev, per_token, *sampling) = pack(blocks + _keep_block(keep), self.device)
        rows_dev, prefix_dev, seq_dev, ext_dev, before_dev = dev
        return StepLens(mode, rows, seq, host, host[2], host[3], rows_dev, prefix_dev, seq_dev, ext_dev, before_dev,
                        per_token[0], per_token[1], per_token[2] if ids is not None else None, 0 in prefix, t,
                        *(sampling[0] if sampling else ()))

    def plan_decode(self, rows: List[int], prefix: List[int], ids: Optional[List[int]] = None,
                    keep: Optional[Keep] = None) -> StepLens:
        """A decode forward: one token per request at position `prefix[b]`; `ids` (one per request, optional) and
        `keep` (see `Keep`) travel in the same copy. LocError when a length passes the rows' context."""
        bs = len(rows)
        pre = np.asarray(prefix, dtype=np.int64)
        self._check_context(int(pre.max()) + 1 if bs else 0)
        if ids is not None and len(ids) != bs:
            raise ShapeError(f"{len(ids)} token ids for {bs} requests")
        blocks = [(bs, [rows, pre, pre - 1, pre + 1] + ([] if ids is None else [ids]))]
        ((host, *_), (dev, *sampling)) = pack(blocks + _keep_block(keep), self.device)
        rows_dev, prefix_dev, before_dev, seq_dev = dev[:4]
        ids_dev = dev[4] if ids is not None else None
        # a request with no token yet reads position -1 (the row's last column) and its last loc is masked
        return StepLens(ForwardMode.DECODE, rows, host[3].tolist(), host, host[3], None, rows_dev, prefix_dev, seq_dev,
                        None, before_dev, prefix_dev, rows_dev, ids_dev, bool(bs and pre.min() == 0), bs,
                        *(sampling[0] if sampling else ()))

    def _check_context(self, longest: int) -> None:
        if longest > self.rtt.max_context_len:
            raise LocError(f"positions up to {longest} exceed max_context_len {self.rtt.max_context_len}")

    def allocate(self, s: StepLens) -> ForwardBatch:
        """The forward's slots: each request's last loc gathered on the device, one allocator call, one
        req_to_token scatter, the ForwardBatch (with the host lengths, so the metadata step reads nothing back)."""
        rtt = self.rtt.req_to_token
        last = rtt[s.rows_dev, s.before_dev]  # the slot of each request's token prefix - 1
        if s.fresh:
            last = torch.where(s.prefix_dev > 0, last, -1)
        bs, loc = len(s.rows), None
        try:  # (free of cost until it raises) an allocation that raises gives its pages back itself; what raises
            if s.mode == ForwardMode.DECODE:  # after it returned (the scatter) gives them back here
                loc = self.allocator.alloc_decode(s.seq_dev, last, seq_lens_cpu=s.seq_cpu)
                rtt[s.rows_dev, s.prefix_dev] = loc
                return ForwardBatch(ForwardMode.DECODE, bs, s.rows_dev, s.seq_dev, loc, positions=s.pos_dev,
                                    seq_lens_cpu=s.seq_cpu)
            loc = self.allocator.alloc_extend(s.prefix_dev, s.seq_dev, last, s.num_tokens,
                                              prefix_lens_cpu=s.prefix_cpu, seq_lens_cpu=s.seq_cpu)
            rtt[s.row_of_dev, s.pos_dev] = loc
            return ForwardBatch(s.mode, bs, s.rows_dev, s.seq_dev, loc, s.prefix_dev, s.ext_dev, positions=s.pos_dev,
                                seq_lens_cpu=s.seq_cpu, extend_seq_lens_cpu=s.ext_cpu)
        except BaseException:
            if loc is not None:
                with interrupts_held() as held:
                    self.undo(s.rows, s.prefix_cpu.tolist(), (s.seq_cpu - s.prefix_cpu).tolist(), loc, None)
                    held.drop()  # (the error being handled is the one raised)
            raise

    # ---- out-of-window release ------------------------------------------------------------------------
    def release(self, rows: Sequence[int], seq_lens: Sequence[int], rows_dev: Optional[torch.Tensor] = None,
                seq_dev: Optional[torch.Tensor] = None) -> bool:
        """One out-of-window release for a forward's requests (host `rows`, their lengths `seq_lens`; on the device
        `rows_dev`, `seq_dev`, or one copy of the host lists when None), only when some frontier moves; whether
        it ran. The others have nothing to release. The device frontiers move in place with the release (by row:
        no gather or scatter around it) and the host's copy with them, Ctrl-C held: a release that raised before it
        ran is run again by the next step that moves those frontiers, none of its pages left held."""
        moved = self._frontiers_after(rows, seq_lens)
        if moved is None:
            return False
        if rows_dev is None or seq_dev is None:
            _, ((rows_dev, seq_dev),) = pack([(len(rows), [list(rows), list(seq_lens)])], self.device)
        with interrupts_held():  # (the release holds its own changes: the host's copy joins them)
            release_out_of_window_batch(self.allocator, self.rtt.req_to_token, rows_dev, seq_dev, self.frontiers,
                                        self.window, by_row=True)
            self.frontiers_cpu[moved[0]] = moved[1]
        return True

    def move_frontiers(self, rows: Sequence[int], seq_lens: Sequence[int]) -> bool:
        """The host's copy of each row's frontier after a forward whose release ran on the device (a step graph's);
        whether any moved."""
        moved = self._frontiers_after(rows, seq_lens)
        if moved is not None:
            self.frontiers_cpu[moved[0]] = moved[1]
        return moved is not None

    def _frontiers_after(self, rows: Sequence[int], seq_lens: Sequence[int]
                         ) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """(rows, frontiers) of the host's copy after a forward (`release_out_of_window_batch`'s rule on the host
        lengths: the page-aligned frontier kept one page behind seq_len - W + 1); None where none moves."""
        if self.window is None:
            return None
        p, at = self.page_size, np.asarray(rows, dtype=np.int64)
        old = self.frontiers_cpu[at]
        dead = np.asarray(seq_lens, dtype=np.int64) - self.window + 1
        new = np.maximum(old, np.where(dead > 0, dead // p * p - p, 0))   # (no int64 wrap for a window near 2**63)
        return None if np.array_equal(new, old) else (at, new)

    def replay_decode(self, graph: Any, rows: List[int], prefix: List[int],
                      inputs: Optional[Dict[str, torch.Tensor]] = None) -> Tuple[torch.Tensor, bool]:
        """One decode step as a whole-step graph replay (`hwkv.step_graph.DecodeStepGraph` over these frontiers):
        the rows and their lengths after it in one host tensor; the host frontiers follow the graph's release.
        Returns the layers' output and whether a frontier moved. OutOfSlotsError before anything ran."""
        bs = len(rows)
        seq = [p + 1 for p in prefix]
        host = torch.tensor(rows + seq, **HOST)
        out = graph.step(host[:bs], host[bs:], host[bs:], inputs)
        return out, self.move_frontiers(rows, seq)

    def replay_verify(self, graph: Any, rows: List[int], prefix: List[int], ids: List[int]
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
        """One verify forward as a graph replay (`hwkv.step_graph.VerifyStepGraph` of k drafts): each row's k + 1
        token `ids` (its last token, then the drafts) at positions prefix .. prefix + k, the rows and lengths after
        it with the step's control words, the ids in one copy. Returns every token's output and the rows on the
        device (the graph's). LocError past the rows' context, OutOfSlotsError, before anything ran."""
        bs, n = len(rows), graph.tpr
        if len(ids) != bs * n:
            raise ShapeError(f"{len(ids)} token ids for {bs} requests of {n} tokens")
        seq = [p + n for p in prefix]
        self._check_context(max(seq, default=0))
        host = torch.tensor(rows + seq, **HOST)
        out = graph.step(host[:bs], host[bs:], host[bs:], {"input_ids": to_device(torch.tensor(ids, **HOST),
                                                                                   self.device)})
        return out, graph.req_pool_indices[:bs]
