"""DecodeStepGraph: the whole decode step in one graph per batch bucket.

One replay runs what an engine's decode step runs (steps 1-5 of a forward, docs/architecture.md):
the allocation, the req_to_token write and the out-of-window release (one launch, `allocator.alloc_step`,
where the device's page ops have it: the release frees only tokens no query of the step sees, so it may come
first; the ring heads come from a device buffer the host writes before the replay), the metadata refill and
the layers (elsewhere the release follows them; the rows' frontiers move where they are kept). Between
two replays the host settles the step's capacity on its bound of free pages (`allocator.reserve`: an
OutOfSlotsError before anything runs when the step might not fit), copies the live rows, the lengths
after the step and [head_full, head_swa, live count, op number] into static buffers, and launches once
(the op number orders the errors the step's page ops record; an argument would stay the capture's).

Padded requests of a bucket write into a row the graph reserves for them (position 0, the padding slot
0), take no pages and release nothing. Frontiers stay on the device, one per request row
(`frontiers[row]`), moved by the release inside the graph. A batch larger than every bucket runs the
same step eagerly. Errors a device op records stay deferred to the next synchronizing call.
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from hwkv import ops
from hwkv.release import release_out_of_window_batch
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.checks import as_int, check_int_dtype, check_rows, normal_tensors, release_window
from hwkv.draft import DraftReplay, check_draft_steps
from hwkv.errors import ConfigError, LocError, ShapeError
from hwkv.graph import EagerAdapter, GraphAdapter, GraphRunner, ModelFn, _Captured
from hwkv.spec import DraftTree, MultiStepDraft
from hwkv.staging import StagingRing


_CTL = 5  # control words before the staged (row, length) pairs: head_full, head_swa, live count, op number, claim


class DecodeStepGraph(GraphRunner):
    """Captures `alloc + req_to_token write + refill + fn(batch, inputs) + release` per bucket (see module doc).

    `frontiers`: int64 [req_to_token rows] on the device, each row's release frontier (None: no release, a
    pool without windows). `window`: what the release keeps, by the engine's rule (`hwkv.checks.release_window`:
    an integer >= the backend's largest sliding window, or >= context - page_size + 1 where that is smaller).
    `pad_row`: a req_to_token row the caller keeps for padded requests, an integer in [0, rows) (None: the graph
    takes one from the pool). Each is checked before anything is built (ConfigError naming the value and the
    limit). `step(rows, seq_lens, seq_lens_cpu, inputs)` runs one decode step: rows and seq_lens (lengths after
    the step, integer tensors) on the device, seq_lens_cpu their host copy.
    """

    # one step: a decode, one token per request (VerifyStepGraph and DraftStepGraph change these)
    _MODE, _TOKENS, _TREE, _WHAT = ForwardMode.DECODE, 1, False, "decode"

    @normal_tensors
    def __init__(self, backend: Any, allocator: Any, fn: ModelFn, batch_sizes: Sequence[int],
                 input_shapes: Dict[str, Tuple[Tuple[int, ...], torch.dtype]], adapter: Optional[GraphAdapter] = None,
                 frontiers: Optional[torch.Tensor] = None, window: Optional[int] = None,
                 pad_row: Optional[int] = None) -> None:
        # checked before anything is made (the base class sets up the backend's graph state)
        if (frontiers is None) != (window is None):
            raise ConfigError("frontiers and window go together: both for a pool with windows, neither without")
        rtt_pool = backend.req_to_token_pool
        if frontiers is not None and (frontiers.dtype != torch.int64 or frontiers.shape != (rtt_pool.size,)
                                      or frontiers.device.type != backend.device.type):
            raise LocError(f"frontiers must be int64 [{rtt_pool.size}] (one per request row) on {backend.device}, "
                           f"got {frontiers.dtype} {list(frontiers.shape)} on {frontiers.device}")
        if window is not None:  # a smaller one would free slots the SWA layers still read (wrong outputs)
            window = release_window(window, backend.hybrid, max(backend.windows, default=0), rtt_pool.max_context_len,
                                    allocator.page_size, "this graph's backend")
        pad = None if pad_row is None else as_int(pad_row)
        if pad_row is not None and (pad is None or not 0 <= pad < rtt_pool.size):
            raise ConfigError(f"pad_row={pad_row!r} must be an integer request row in [0, {rtt_pool.size}) (the "
                              "req_to_token row padded requests write; None: the graph takes one from the pool)")
        self.device_alloc = allocator.allocates_in_graph
        if not self.fits(allocator, adapter, backend):
            raise ConfigError(f"a whole-step graph on {backend.device.type} needs the device's page-op kernels "
                              "(hwkv.pages.register_page_ops) and, under a recording adapter, a backend whose refill "
                              "runs inside graphs (metadata_in_graph); run the step through GraphRunner instead")
        super().__init__(backend, fn, batch_sizes, input_shapes, adapter, self._MODE, self._TOKENS, self._TREE)
        self.allocator, self.frontiers, self.window = allocator, frontiers, window
        self.new = self.tpr * self.steps  # tokens a step allocates per request (a draft's k steps of one each)
        self._records = bool(getattr(self.adapter, "records_device_work", False))
        # a recorded step never stages host lengths (a device graph reads none): fn sees no stale host copy
        self._host_lens = not self._records
        self.rtt = rtt_pool.req_to_token
        # padded requests write here, never into a live row: the caller's reserved row, or one taken now
        self._own_pad, self._pad_freed = pad_row is None, False
        self.pad_row = rtt_pool.alloc(1)[0] if pad is None else pad
        if frontiers is not None:   # it holds no pages: a frontier left by the row's last request would stand past
            frontiers[self.pad_row] = 0   # the padded lanes' length (refused where releases are checked)
        dev, b = backend.device, self.buckets[-1]
        # what the host sends each step, one copy: [head_full, head_swa, live requests, the allocation's op number]
        # then (row, length) pairs
        self.staged = torch.zeros(_CTL + 2 * b, dtype=torch.int64, device=dev)
        self.staged[_CTL + 1::2] = self.new
        self.ctl = self.staged[:_CTL]
        self._ring = StagingRing(_CTL + 2 * b, dev)
        self._bucket_staged = {k: self.staged[:_CTL + 2 * k] for k in self.buckets}  # what a step of bucket k sends
        self.rows_in, self.seq_in = self.staged[_CTL::2], self.staged[_CTL + 1::2]
        # rows, slots and the req_to_token write in one launch where the device's page ops have it (else three)
        self._one_launch = self.device_alloc and allocator.allocates_step_in_one and self.new == 1
        # the release in the allocation's launch (before the layers: it frees only what no query of the step sees);
        # not in debug mode, whose release checks on the host
        self._releases_first = self._one_launch and frontiers is not None and not allocator.immediate
        # the ops a step numbers for its page-op kernels (its allocation, then its release) and the first one's
        # number (`_reserve`); the torch ops number themselves as they run on the host
        self._ops, self._op = (2 if frontiers is not None and self.device_alloc else 1), 0
        self._advances: Dict[int, bool] = {}  # per bucket: its replay moves the staged lengths on by one itself
        # the live count and bucket the device holds staged after the last replay where it moved the lengths
        # itself (None: unknown), and its rows and lengths (host arrays kept, written in place each step)
        self._sent: Optional[Tuple[int, int, int]] = None  # (live, bucket, the op number staged)
        self._sent_rows, self._sent_seq = np.zeros(b, np.int64), np.zeros(b, np.int64)
        if not self._one_launch:  # the three launches' temporaries
            self.prefix = torch.zeros(b, dtype=torch.int64, device=dev)
            self.last = torch.zeros(b, dtype=torch.int64, device=dev)
        self.kernels = ops.step_kernels(dev.type)  # one launch each where the device registered them
        self._tokens = {} if self.new == 1 else {"tokens": self.new}  # (a decode's calls pass none)
        self._host: Tuple[int, int, list] = (0, 0, [0, 0])  # live, pages, heads: what an eager 'replay' reads
        # a step opens a page where its length is 1 mod page: by mask where the page size is a power of two
        # (cheaper than numpy's int64 remainder, which grows with the batch)
        p = allocator.page_size
        self._opens = (np.bitwise_and, p - 1, 1 % p) if p & (p - 1) == 0 else (np.remainder, p, 1 % p)
        # (replay's output, live count, its live rows) of the last step: a device graph returns the same output
        # each replay, and a tensor slice per step costs about as much as the step's numpy work
        self._live_out: Tuple[Any, int, Any] = (None, 0, None)
        self.req_pool_indices.fill_(self.pad_row)

    @staticmethod
    def fits(allocator: Any, adapter: Optional[GraphAdapter], backend: Any = None) -> bool:
        """Whether the whole step can be one replay here. The allocation reads its ring heads on the device only
        through a device's page-op kernels (`allocator.allocates_in_graph`); the torch ops size themselves from
        host values, so they serve only a replay that calls the step as it is (`calls_step`, as EagerAdapter's,
        recording nothing), never a recorded or compiled one. A recorded step also records the metadata refill,
        which a backend declaring `metadata_in_graph = False` (ROCm, XPU: not verified inside their graphs) keeps
        out of graphs."""
        adapter = adapter if adapter is not None else EagerAdapter()
        records = bool(getattr(adapter, "records_device_work", False))
        if records and backend is not None and not getattr(backend, "metadata_in_graph", True):
            return False
        if allocator.allocates_in_graph:
            return True
        return bool(getattr(adapter, "calls_step", False)) and not records

    def release_rows(self) -> None:
        """Give the padding row back to the req_to_token pool (the graph is done with); a row the caller passed
        stays the caller's."""
        if self._own_pad:
            self.backend.req_to_token_pool.free(self.pad_row)
            self._own_pad = False
            self._pad_freed = True   # the row may be a live request's now: padded lanes must never write it again

    # ---- the step, as captured -------------------------------------------------------------------
    def _refill_and_run(self, batch: ForwardBatch, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        bs = batch.batch_size
        rows, seq, out = self.req_pool_indices[:bs], self.seq_lens[:bs], self._slots(bs)
        # padded requests: the reserved row, length `new` (1 for a decode), no token, no page, the padding slot 0
        if self._one_launch:  # and, where it can, the staged lengths moved on to the next step's; the release too
            # (not where the release follows the layers: the op number it reads must stay the allocation's)
            advance = self._releases_first or self.frontiers is None
            self._advances[bs] = self.allocator.alloc_step(self.ctl, self.rows_in, self.seq_in, self.pad_row,
                                                           self.rtt, rows, seq, out, advance=advance,
                                                           frontiers=self.frontiers if self._releases_first else None,
                                                           window=self.window or 0)
        else:
            prefix, last = self.prefix[:bs], self.last[:bs]
            self.kernels.prologue(self.ctl, self.rows_in, self.seq_in, self.pad_row, self.rtt, rows, seq, prefix,
                                  last, out, **self._tokens)
            n, pages, heads = self._host
            if self.device_alloc:
                self.allocator.alloc_reserved(prefix, seq, last, out, self.ctl, 0)
            else:  # a step the host runs (no device graph): the torch ops size themselves from host values
                self.allocator.alloc_reserved(prefix[:n], seq[:n], last[:n], out[:n * self.new], heads, pages)
            self.kernels.write(self.rtt, rows, seq, out, None, None, **self._tokens)  # the new slots
        if batch.extend_prefix_lens is not None:  # a verify's prefixes, from the lengths the step staged (as eagerly)
            torch.sub(seq, self.tpr, out=batch.extend_prefix_lens)
        self._refill(batch)
        result = self.fn(self._arg(batch), inputs)
        if self.frontiers is not None and not self._releases_first:  # the rows' frontiers move where they are kept
            release_out_of_window_batch(self.allocator, self.rtt, rows, seq, self.frontiers, self.window, by_row=True,
                                        op_word=self.ctl[3:4] if self.device_alloc else None)
        return result

    def _slots(self, bs: int) -> torch.Tensor:
        """Where the allocation writes a bucket's slots, request-major (the batch's own write locs here)."""
        return self.out_cache_loc[:bs * self.new]

    @property
    def adapter_records(self) -> bool:
        return self._records

    def _check_pad_row(self) -> None:
        """Nothing runs once the padding row went back (`release_rows`): padded lanes write that row, which the pool
        may have handed on."""
        if self._pad_freed:
            raise ConfigError("this graph gave its padding row back (release_rows): it runs no more steps, since its "
                              "padded requests would write that row, which the pool may have handed on")

    def capture(self) -> None:
        """Capture every bucket; the allocation, the release and the refill are recorded with the layers."""
        self._check_pad_row()   # (the warm-up and the captured steps are all padding lanes)
        if not self.adapter_records:
            self.metadata_in_graph = True  # an eager 'replay' runs the whole body too
        for bs in reversed(self.buckets):
            batch, inputs = self._bucket_batch(bs), self._static_inputs(bs)
            self._set_ctl(0, 0, self._reserve(0))  # no live request: the warm-up takes nothing
            self._refill_and_run(batch, inputs)  # warm-up outside the graph (compilation)
            graph, out = self.adapter.capture(lambda b=batch, i=inputs: self._refill_and_run(b, i))
            self.graphs[bs] = _Captured(graph, out)

    def prepare(self, batch: Any, inputs: Any) -> Any:
        """Refused: a whole-step graph's replay runs the rows and slots `step` staged, never a batch's."""
        raise ConfigError("a whole-step graph runs through step(rows, seq_lens, seq_lens_cpu, inputs), not "
                          "prepare/run/replay (its replay would rerun the last staged step with other inputs)")

    run = replay = prepare

    def _set_ctl(self, live: int, pages: int, heads: list, rows: Optional[np.ndarray] = None,
                 seq: Optional[np.ndarray] = None, bucket: Optional[int] = None) -> None:
        """Send [head_full, head_swa, live, op number, pages claimed] and, when given, the live (row, length) pairs for
        the next replay in one host-to-device copy, from a ring of pinned blocks that are rewritten only after the
        device read them (hwkv.staging; one reused block was overwritten before the device read it, on the H200: two
        steps took the same pages). Rows, seq and the step's bucket go together; the bucket's whole width is sent: the
        pairs past `live` are stale and the prologue reads none (a width per bucket keeps the ring's views few)."""
        self._host = (live, pages, heads)
        self._sent = None
        host = self._ring.next()
        host[0] = heads[0]
        host[1] = heads[1] if len(heads) > 1 else 0
        host[2] = live
        host[3] = self._op
        host[4] = pages  # the device checks its page need against it (a short claim is recorded, not overrun)
        if rows is None:
            self._ring.send(self.ctl)
        else:
            n = _CTL + 2 * live
            host[_CTL:n:2], host[_CTL + 1:n:2] = rows, seq
            self._ring.send(self._bucket_staged[bucket])

    def _reserve(self, pages: int) -> list:
        """`allocator.reserve` for one step's page ops, numbered there; the allocation's number is kept for the
        control words (`_op`)."""
        heads = self.allocator.reserve(pages, self._ops)
        self._op = self.allocator.pages.op - self._ops + 1  # (`op_number`; no call between the claim and the return,
        return heads                                         # where a Ctrl-C would leave the caller without heads)

    # ---- one step on the host --------------------------------------------------------------------
    def step(self, rows: torch.Tensor, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor,
             inputs: Optional[Dict[str, torch.Tensor]] = None) -> torch.Tensor:
        """One decode step of `rows` (lengths after it: seq_lens, seq_lens_cpu); returns the layers' output for
        the live tokens. Capacity is settled before anything runs: OutOfSlotsError leaves everything as it was.
        Rows and lengths on the host travel with the step's control words in one copy; on the device, as copies
        there. `inputs` None: the engine wrote this step's inputs into `self.inputs` (nothing to check or
        copy, however many there are); views of those buffers are not copied either. Rows and lengths that are no
        integers (a float, a bool: their dtype, a host attribute) are a LocError, as everything else, before
        anything is staged or claimed; so is a seq_lens_cpu that is not on the host (LocError naming its device);
        rows or lengths that are not 1-D (a [bs, 1] column, a 0-d tensor) are a ShapeError naming the shapes."""
        self._check_pad_row()
        if not (type(rows) is type(seq_lens) is type(seq_lens_cpu) is torch.Tensor):   # (one compare when they are)
            for name, t in (("rows", rows), ("seq_lens", seq_lens), ("seq_lens_cpu", seq_lens_cpu)):
                if not isinstance(t, torch.Tensor):
                    raise LocError(f"{name} must be a torch.Tensor of integers, got {type(t).__name__}")
        if not rows.dtype == seq_lens.dtype == seq_lens_cpu.dtype == torch.int64:  # (the common case: one compare)
            for name, t in (("rows", rows), ("seq_lens", seq_lens), ("seq_lens_cpu", seq_lens_cpu)):
                check_int_dtype(name, t)
        if not seq_lens_cpu.is_cpu:
            raise LocError(f"seq_lens_cpu is on {seq_lens_cpu.device}: it is seq_lens' host copy and must be a CPU "
                           "tensor")
        if not rows.dim() == seq_lens.dim() == seq_lens_cpu.dim() == 1:  # a [bs, 1] column: before the reservation
            raise ShapeError("rows, seq_lens and seq_lens_cpu must be 1-D [bs], got shapes "
                             + ", ".join(str(list(t.shape)) for t in (rows, seq_lens, seq_lens_cpu)))
        bs = rows.numel()
        if seq_lens.numel() != bs or seq_lens_cpu.numel() != bs:
            raise LocError(f"rows ({bs}), seq_lens ({seq_lens.numel()}) and seq_lens_cpu ({seq_lens_cpu.numel()}) "
                           "must have one entry per request")
        seq_h = seq_lens_cpu.numpy() if seq_lens_cpu.dtype == torch.int64 else seq_lens_cpu.to(torch.int64).numpy()
        if bs and np.minimum.reduce(seq_h) < self.new + 1:
            raise LocError(f"a {self._WHAT} step continues a request: seq_lens must be >= {self.new + 1}, got "
                           f"{int(seq_h.min())}")
        if bs and np.maximum.reduce(seq_h) > self.rtt.shape[1]:  # (the req_to_token write would pass its row)
            raise LocError(f"positions up to {int(seq_h.max())} exceed max_context_len {self.rtt.shape[1]}")
        rows_h = self._checked_rows(rows)
        i = bisect.bisect_left(self.buckets, bs)
        if i == len(self.buckets):
            if inputs is None:
                raise ShapeError(f"a batch of {bs} is larger than every bucket (<= {self.buckets[-1]}): its inputs "
                                 "cannot be in the graph's buffers; pass them")
            return self._eager_step(rows, seq_lens, seq_lens_cpu, inputs)
        bucket = self.buckets[i]
        if bucket not in self.graphs:
            raise ConfigError(f"a batch of {bs} replays bucket {bucket}, which is not captured (captured: "
                              f"{sorted(self.graphs) or 'none'}): call capture() before step()")
        fresh = None if inputs is None else self._check_step_inputs(inputs, bs, bucket)
        pages = self._pages(seq_h)
        heads = None
        try:
            heads = self._reserve(pages)  # raises before anything changed when the step might not fit
            if fresh:
                self._stage_inputs(fresh, bs, bucket)
            if not self._records:  # an eager 'replay' reads the host lengths; a device graph never does
                self._stage_host_lens(bs, seq_lens_cpu)
            if rows_h is not None and seq_lens.is_cpu:
                seq_s = seq_h if seq_lens is seq_lens_cpu else seq_lens.numpy()
                if pages == 0 and self._sent == (bs, bucket, self._op) \
                        and np.array_equal(self._sent_seq[:bs], seq_s) and np.array_equal(self._sent_rows[:bs], rows_h):
                    # the same rows, one token on, no page, no op between: the last replay left exactly this staged
                    # (the heads are read only where a page opens; it moved the op number on by its ops), so nothing
                    # is copied
                    self._host = (bs, pages, heads)
                else:
                    self._set_ctl(bs, pages, heads, rows_h, seq_s, bucket)
                sent = None
                if self._advances.get(bucket):  # what the replay will leave staged
                    self._sent_rows[:bs] = rows_h
                    np.add(seq_s, 1, out=self._sent_seq[:bs])
                    sent = (bs, bucket, self._op + self._ops)  # (the launch moved the op number on by the step's ops)
                self._sent = None  # until the replay has run: a replay that raises leaves nothing it claims
            else:
                sent = None
                self._set_ctl(bs, pages, heads)
                self.rows_in[:bs].copy_(rows)
                self.seq_in[:bs].copy_(seq_lens)
            self._new_staging()   # its replay refills the static lists: a step another runner prepared is stale
            graph = self.graphs[bucket].graph
            self.adapter.pre_replay(graph)
            out = self.adapter.replay(graph)  # the whole step; nothing else to do on the host
        except BaseException:  # staging, the host update or the launch raised (Ctrl-C, a vendor error): a claim whose
            self._sent = None   # allocation never ran goes back; one that ran is the caller's to undo (its pages live)
            if heads is not None:
                self.allocator.cancel_reserve(pages)
            raise
        self._sent = sent
        self.replays += 1
        last, n, view = self._live_out
        if out is not last or n != bs:
            view = self._live_view(out, bs)
            self._live_out = (out, bs, view)
        return view

    def _checked_rows(self, rows: torch.Tensor) -> Optional[np.ndarray]:
        """LocError unless every row lies inside req_to_token (-1 too: it would wrap to the last row), before anything
        is staged or claimed; returns the rows as a host array (None: on the device). Rows on the host are checked
        always (free); rows on the device only where their values are checkable (debug mode: a read is a sync). A row
        named twice is refused the same way (its two tokens would take one slot, or two pages one of which nobody
        holds)."""
        check_rows(rows, self.rtt.shape[0], f"a {self._WHAT} step takes each request once")
        return rows.numpy() if rows.is_cpu else None

    def _check_step_inputs(self, inputs: Dict[str, torch.Tensor], bs: int,
                           bucket: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """The caller's inputs checked whole (ShapeError) before anything is claimed or staged; returns the
        (buffer, input) pairs `_stage_inputs` copies once the step's room is settled."""
        return self._check_inputs(inputs, bs * self.tpr)

    def _stage_inputs(self, fresh: List[Tuple[torch.Tensor, torch.Tensor]], bs: int, bucket: int) -> None:
        """The checked inputs into the static buffers (token order: each request's tokens together)."""
        n = bs * self.tpr
        with torch.no_grad():   # a static buffer never joins the caller's autograd graph
            for buf, src in fresh:
                buf[:n].copy_(src[:n])

    def _stage_host_lens(self, bs: int, seq_lens_cpu: torch.Tensor) -> None:
        self.seq_lens_cpu[:bs].copy_(seq_lens_cpu)
        self.seq_lens_cpu[bs:].fill_(self.new)  # padded requests: what the prologue gives them on the device

    def _live_view(self, out: torch.Tensor, bs: int) -> torch.Tensor:
        """The live requests' rows of a replay's output."""
        return out[:bs * self.tpr]

    def _pages(self, seq_h: np.ndarray) -> int:
        """The pages a step to lengths `seq_h` opens: one per request whose new token starts a page (length 1 mod
        page); for `new` tokens each, one per page start among positions [length - new, length)."""
        if self.new == 1:
            op, mod, first = self._opens
            return int(np.count_nonzero(op(seq_h, mod) == first))
        p = self.allocator.page_size
        return int(np.subtract((seq_h - 1) // p, (seq_h - 1 - self.new) // p).sum())

    def _eager_step(self, rows: torch.Tensor, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor,
                    inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        """A batch larger than every bucket: the same step through the eager API (never dropped)."""
        self._sent = None  # (nothing staged changes here; the next replay sends all the same)
        self._check_inputs(inputs, rows.numel() * self.new)  # before any slot is taken
        rows, seq_lens = rows.to(self.rtt.device), seq_lens.to(self.rtt.device)
        loc = self._eager_slots(rows, seq_lens, seq_lens_cpu)
        out = self._eager_forward(rows, seq_lens, seq_lens_cpu, loc, inputs)
        if self.frontiers is not None:
            release_out_of_window_batch(self.allocator, self.rtt, rows, seq_lens, self.frontiers, self.window,
                                        by_row=True)
        self.eager_runs += 1
        return out

    def _eager_slots(self, rows: torch.Tensor, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor) -> torch.Tensor:
        """Slots for each request's `new` tokens [length - new, length), written into req_to_token (request-major)."""
        dev, n = self.rtt.device, self.new
        last = self.rtt[rows, seq_lens - n - 1]
        if n == 1:
            loc = self.allocator.alloc_decode(seq_lens, last, seq_lens_cpu=seq_lens_cpu)
            self.rtt[rows, seq_lens - 1] = loc
            return loc
        bs, prefix = rows.numel(), seq_lens - n
        loc = self.allocator.alloc_extend(prefix, seq_lens, last, bs * n, prefix_lens_cpu=seq_lens_cpu - n,
                                          seq_lens_cpu=seq_lens_cpu)
        self.rtt[rows.unsqueeze(1), prefix.unsqueeze(1) + torch.arange(n, dtype=torch.int64, device=dev)] = \
            loc.view(bs, n)
        return loc

    def _eager_forward(self, rows: torch.Tensor, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor,
                       loc: torch.Tensor, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The eager metadata and layers over the slots `_eager_slots` gave."""
        bs, n = rows.numel(), self.tpr
        if n == 1:
            batch = ForwardBatch(ForwardMode.DECODE, bs, rows, seq_lens, loc, seq_lens_cpu=seq_lens_cpu)
        else:  # a verify: tokens [length - n, length) of each request
            ext = torch.full((bs,), n, dtype=torch.int64, device="cpu")
            batch = ForwardBatch(self.mode, bs, rows, seq_lens, loc, seq_lens - n, ext.to(self.rtt.device),
                                 seq_lens_cpu=seq_lens_cpu, extend_seq_lens_cpu=ext)
        self.backend.init_forward_metadata(batch)
        return self.fn(batch, inputs)


class VerifyStepGraph(DecodeStepGraph):
    """A speculative verify step in one graph per bucket: each request's last token and `drafts` draft tokens
    (`drafts + 1` per request, TARGET_VERIFY) get their slots, the req_to_token write, the metadata refill and
    the layers inside the replay, as a decode step's do in DecodeStepGraph (prologue, allocation from the ring
    heads the host staged, write: three launches). `step(rows, seq_lens, seq_lens_cpu, inputs)` takes the
    lengths after every draft (prefix + drafts + 1) and returns every token's output, `drafts + 1` per request.

    Which draft slots stay depends on that output, so the acceptance (`hwkv.spec.accept_draft_tokens`) and the
    out-of-window release on the accepted lengths run after the replay, on the caller's schedule. The backend's
    `tree_verify` holds for the chain of drafts too: with "decode", and with "auto" in the buckets where the
    backend says decode-like lists pay (`decode_like_chain_pays`: few requests), the chain is carried as its
    DraftTree (the static causal mask, `chain=True`) and runs one decode query per token (the planner's one rule,
    `TreePlanner.decode_like`, decides both); elsewhere ("extend", the default) the extend
    kernels' causal verify (the chain through the masked extend kernel is slower: 1.37-1.44x on the H200)."""

    _MODE, _WHAT = ForwardMode.TARGET_VERIFY, "verify"

    @normal_tensors
    def __init__(self, backend: Any, allocator: Any, fn: ModelFn, batch_sizes: Sequence[int],
                 input_shapes: Dict[str, Tuple[Tuple[int, ...], torch.dtype]], drafts: int,
                 adapter: Optional[GraphAdapter] = None, pad_row: Optional[int] = None) -> None:
        k = as_int(drafts)
        if k is None or k < 1:
            raise ConfigError(f"a verify step checks drafts >= 1 per request (an integer; a bool is none), got "
                              f"drafts={drafts!r}")
        drafts = k
        self._TOKENS = drafts + 1
        self._TREE = getattr(getattr(backend, "options", None), "tree_verify", "extend") != "extend"
        super().__init__(backend, allocator, fn, batch_sizes, input_shapes, adapter, pad_row=pad_row)
        self.drafts = drafts

    def decode_like(self, bs: int) -> bool:
        """Whether bucket `bs` runs its chain decode-like: the backend's `tree_verify` by the rule its metadata step
        follows for a chain (`TreePlanner.decode_like`: "decode", or "auto" where `decode_like_chain_pays`)."""
        return self.tree_mask is not None and self.backend.tree_planner.decode_like(bs, bs * self.tpr, chain=True)

    def _static_batch(self, bs: int) -> ForwardBatch:
        batch = super()._static_batch(bs)
        if self.tree_mask is None:
            return batch
        spec = DraftTree(batch.spec_info.mask, chain=True) if self.decode_like(bs) else None
        return dataclasses.replace(batch, spec_info=spec)


class DraftStepGraph(DraftReplay, DecodeStepGraph):
    """A multi-step draft in one graph per bucket: `draft_steps` decode steps of a draft model, each request's k
    slots allocated and written into req_to_token (prologue, allocation, write: as VerifyStepGraph's, k tokens a
    request), put in step order, every step's metadata refilled (`init_draft_metadata_graph`: the write locs and
    each window's span translated once) and `fn(steps, inputs)` run (as `hwkv.draft.DraftGraphRunner`'s: every
    step's layers, inputs and output step-major [k * bucket, ...]), all inside the replay.

    `step(rows, seq_lens, seq_lens_cpu, inputs)` takes the lengths after the last draft step (prefix + k) and
    returns [k, bs, ...]. Nothing is released: which drafts stay is the verify's to say, so the out-of-window
    release follows the acceptance on the caller's schedule (as after VerifyStepGraph). Inputs the caller writes
    into `self.inputs` itself go step-major at the bucket's width: step i of request b at row i * bucket + b."""

    _WHAT = "draft"

    @normal_tensors
    def __init__(self, backend: Any, allocator: Any, fn: ModelFn, batch_sizes: Sequence[int],
                 input_shapes: Dict[str, Tuple[Tuple[int, ...], torch.dtype]], draft_steps: int,
                 adapter: Optional[GraphAdapter] = None, pad_row: Optional[int] = None, writes_swa: bool = True) -> None:
        self.steps = draft_steps = check_draft_steps(draft_steps)  # before anything is built
        self.draft = MultiStepDraft(draft_steps, writes_swa)
        super().__init__(backend, allocator, fn, batch_sizes, input_shapes, adapter, pad_row=pad_row)
        b, dev = self.buckets[-1], backend.device
        self.req_loc = torch.zeros(b * draft_steps, dtype=torch.int64, device=dev)  # the allocation's, request-major
        self.seq0 = torch.ones(b, dtype=torch.int64, device=dev)                    # lengths after step 0
        self.seq0_cpu = torch.ones(b, dtype=torch.int64, device="cpu")

    def _slots(self, bs: int) -> torch.Tensor:
        return self.req_loc[:bs * self.steps]

    def _static_batch(self, bs: int) -> ForwardBatch:
        k = self.steps
        return ForwardBatch(ForwardMode.DECODE, bs, self.req_pool_indices[:bs], self.seq0[:bs],
                            self.out_cache_loc[:bs * k], spec_info=self.draft,
                            seq_lens_cpu=None if self._records else self.seq0_cpu[:bs])

    def _refill(self, batch: ForwardBatch) -> None:
        """Step-major write locs and step 0's lengths from what the allocation left, then every step's lists."""
        bs, k = batch.batch_size, self.steps
        self.out_cache_loc[:bs * k].view(k, bs).copy_(self.req_loc[:bs * k].view(bs, k).t())
        torch.sub(self.seq_lens[:bs], k - 1, out=self.seq0[:bs])
        self._current = self.backend.init_draft_metadata_graph(batch)

    def _stage_host_lens(self, bs: int, seq_lens_cpu: torch.Tensor) -> None:
        torch.sub(seq_lens_cpu, self.steps - 1, out=self.seq0_cpu[:bs])
        self.seq0_cpu[bs:].fill_(1)  # padded requests: length 1 after step 0

    def _live_view(self, out: torch.Tensor, bs: int) -> torch.Tensor:
        return self._by_step_rows(out, bs)

    def _eager_forward(self, rows: torch.Tensor, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor,
                       loc: torch.Tensor, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        bs, k = rows.numel(), self.steps
        step_major = loc.view(bs, k).t().reshape(-1)
        batch = ForwardBatch(ForwardMode.DECODE, bs, rows, seq_lens - (k - 1), step_major, spec_info=self.draft,
                             seq_lens_cpu=seq_lens_cpu - (k - 1))
        out = self.fn(self.backend.init_draft_metadata(batch), inputs)
        return out.view(k, bs, *out.shape[1:])
