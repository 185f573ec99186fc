"""Multi-step draft decode: one metadata step for k draft steps (the write locs of all steps translated
once; per window, every request's span covering all steps gathered as one dense block and translated
once, each step's window list cut from it by a gather), then k decode steps, eager or through graphs."""
from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from hwkv import ops
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.checks import as_int, normal_tensors, values_checkable
from hwkv.errors import CapacityError, ConfigError, ShapeError
from hwkv.graph import GraphAdapter, GraphRunner, ModelFn, PreparedStep
from hwkv.loc import KVWriteLoc
from hwkv.metadata import (ForwardMetadata, GraphViews, KVIndexList, StaticBuffers, alloc_static, check_fits,
                           cumsum_into, fill_list, window_pos0)
from hwkv.spec import MultiStepDraft

Block = Tuple[torch.Tensor, torch.Tensor]  # ([rows, width] slots of each request's span, its first position)


@dataclass
class DraftSteps:
    """The k steps of a draft forward: iterate to run them; each step makes its metadata current on
    the backend and yields that step's DECODE batch (the one its layers' forward calls take)."""

    backend: Any
    batches: List[ForwardBatch]
    metadata: List[ForwardMetadata]

    def __len__(self) -> int:
        return len(self.batches)

    def select(self, i: int) -> ForwardBatch:
        """Make step i current (its metadata on the backend) and return its batch."""
        self.backend.forward_metadata = self.metadata[i]
        return self.batches[i]

    def __iter__(self) -> Iterator[ForwardBatch]:
        for i in range(len(self.batches)):
            yield self.select(i)


@dataclass
class DraftStatic:
    """Graph buffers of drafts of up to k steps, allocated once: each step's lists (step 0 is the
    backend's StaticBuffers), and per window the dense span block, as locs and translated."""

    max_bs: int
    steps: List[StaticBuffers]
    widths: Dict[int, int]                # columns of each window's block (block_width)
    rows: torch.Tensor                    # int64 arange(max_bs): the blocks' rows
    block_locs: Dict[int, torch.Tensor]   # int64 [max_bs * width_W]
    blocks: Dict[int, torch.Tensor]       # int64 [max_bs * width_W]: translated (hybrid), else block_locs
    block_indptr: Dict[int, torch.Tensor]  # int32 [max_bs + 1]: b * width_W
    block_pos0: Dict[int, torch.Tensor]   # int64 [max_bs]


def block_width(window: int, num_steps: int, ctx: int) -> int:
    """Columns of a window's span block: W keys of step 0 plus one per further step, at most the row."""
    return min(window + num_steps - 1, ctx)


def check_draft_steps(draft_steps: Any) -> int:
    """A graph's draft step count as an int >= 1 (Python, numpy or 0-d tensor integers); anything else, a bool
    included (True had read as one step), is a ConfigError naming it, before anything is built."""
    k = as_int(draft_steps)
    if k is None or k < 1:
        raise ConfigError(f"a draft runs draft_steps >= 1 steps, got draft_steps={draft_steps!r} (an integer; a "
                          "bool is none)")
    return k


def _draft_info(batch: ForwardBatch) -> MultiStepDraft:
    info = batch.spec_info
    if not isinstance(info, MultiStepDraft) or batch.forward_mode != ForwardMode.DECODE:
        raise ConfigError("draft metadata takes a DECODE batch with spec_info=MultiStepDraft(num_steps)")
    return info


class DraftMetadataMixin:
    """Multi-step draft metadata for AttentionBackend (kept apart: it is a mode, not the template)."""

    draft_static: Optional[DraftStatic] = None

    def init_draft_metadata(self, batch: ForwardBatch) -> DraftSteps:
        """All k steps' metadata at once: one write-loc translation, one translated span block per
        window covering every step; each step's full list and window lists (no further translation)."""
        info = _draft_info(batch)
        k, bs = info.num_steps, batch.batch_size
        seq_cpu, _ = batch.host_lens()
        self._check_draft_lens(batch, seq_cpu.tolist(), k)      # before anything is built
        write_all = self._draft_write_loc(batch.out_cache_loc, info, graph=False)
        seq, rows = batch.seq_lens.to(torch.int64), batch.req_pool_indices
        ctx = self.req_to_token_pool.req_to_token.shape[1]
        blocks = {}
        for w in (self.windows if info.writes_swa else ()):
            width = block_width(w, k, ctx)
            indptr = torch.arange(0, (bs + 1) * width, width, dtype=torch.int32, device=self.device)
            locs = torch.empty(bs * width, dtype=torch.int64, device=self.device)
            blocks[w] = self._span_block(rows, seq, w, width, indptr, locs, None, None)
        arange = torch.arange(bs, device=self.device)
        ones = torch.ones(bs, dtype=torch.int64, device="cpu")
        qo_indptr = torch.arange(bs + 1, dtype=torch.int32, device=self.device)
        batches, mds = [], []
        for i in range(k):
            seq_i, seq_i_cpu = seq + i, seq_cpu + i
            loc_i = batch.out_cache_loc[i * bs:(i + 1) * bs]
            swa_i = None if write_all.swa_loc is None else write_all.swa_loc[i * bs:(i + 1) * bs]
            step = ForwardBatch(ForwardMode.DECODE, bs, rows, seq_i, loc_i, seq_lens_cpu=seq_i_cpu)
            full = self._eager_list(step, seq_i, torch.zeros_like(seq_i), int(seq_i_cpu.sum()), None,
                                    int(seq_i_cpu.max()) if bs else 0)
            windows = {}
            for w, block in blocks.items():
                lens_cpu = seq_i_cpu - window_pos0(seq_i_cpu - 1, w)
                out = torch.empty(int(lens_cpu.sum()), dtype=torch.int64, device=self.device)
                indptr = torch.empty(bs + 1, dtype=torch.int32, device=self.device)
                pos0 = _cut(block, arange, window_pos0(seq_i - 1, w), seq_i, indptr, out)
                if self.debug and self.hybrid:
                    self._check_not_evicted(out, w)
                windows[w] = KVIndexList(indptr, out, pos0, w, int(lens_cpu.max()) if bs else 0, self.hybrid)
            md = ForwardMetadata(KVWriteLoc(loc_i, swa_i), swa_i, qo_indptr, seq_i - 1, full, windows, 1, bs, True,
                                 seq_lens_cpu=seq_i_cpu, extend_lens_cpu=ones)
            self.init_kernel_metadata(md, step, graph=False)
            batches.append(step)
            mds.append(md)
        if bs:  # the last step's full list holds every step's (eager lists)
            self._check_full_list(full.indices)
        steps = DraftSteps(self, batches, mds)
        steps.select(0)
        return steps

    # ---- graph mode ---------------------------------------------------------------------------
    @normal_tensors
    def init_draft_graph_state(self, max_bs: int, draft_steps: int, max_context_len: Optional[int] = None) -> None:
        """Static buffers for drafts of up to `draft_steps` steps of up to `max_bs` requests, allocated once
        and shared by every runner: the base state (write locs for max_bs * draft_steps tokens), then
        each further step's lists and each window's span block."""
        draft_steps = check_draft_steps(draft_steps)
        ds = self.draft_static
        if ds is not None and (draft_steps > len(ds.steps) or max_bs > ds.max_bs):  # captured graphs read them
            raise ConfigError(f"draft graph state exists for {len(ds.steps)} steps of {ds.max_bs} requests; asked "
                              f"for {draft_steps} of {max_bs}: call init_draft_graph_state once with the largest "
                              "sizes before capturing any graph")
        self.init_graph_state(max_bs, max_bs * draft_steps, max_context_len)
        if ds is not None:
            return
        ctx, dev = self.graph_max_context_len, self.device
        i32, i64 = dict(dtype=torch.int32, device=dev), dict(dtype=torch.int64, device=dev)
        width = {w: block_width(w, draft_steps, self.req_to_token_pool.req_to_token.shape[1]) for w in self.windows}
        locs = {w: torch.zeros(max_bs * n, **i64) for w, n in width.items()}
        steps = [self.static] + [alloc_static(max_bs, max_bs, ctx, self.windows, dev) for _ in range(draft_steps - 1)]
        self._graph_tables[1:] = [self.alloc_graph_tables(st) for st in steps[1:]]  # the backend's, per step
        self.draft_static = DraftStatic(
            max_bs, steps, width, torch.arange(max_bs, **i64), locs,
            {w: torch.zeros(max_bs * n, **i64) for w, n in width.items()} if self.hybrid else locs,
            {w: torch.arange(0, (max_bs + 1) * n, n, **i32) for w, n in width.items()},
            {w: torch.zeros(max_bs, **i64) for w in self.windows})

    def init_draft_metadata_graph(self, batch: ForwardBatch) -> DraftSteps:
        """Refill every step's static buffers in place for a (padded) draft batch, with no host sync and
        no allocation of index storage: one write-loc translation (tail zeroed), one per window.
        Raises CapacityError (changing nothing) when the steps or requests exceed the graph state."""
        info, ds = _draft_info(batch), self.draft_static
        if ds is None:
            raise ConfigError("init_draft_graph_state(max_bs, draft_steps) must run before draft graph metadata")
        k, bs = info.num_steps, batch.batch_size
        if k > len(ds.steps):
            raise CapacityError(f"a draft of {k} steps exceeds the graph state's {len(ds.steps)} steps; run it "
                                "eagerly (init_draft_metadata) or init_draft_graph_state with more steps")
        check_fits("batch size", bs, ds.max_bs)
        host = batch.checkable_seq_lens()  # the caller's host copy, or CPU / debug
        if host is not None:
            self._check_draft_lens(batch, host.tolist(), k)
            self._check_graph_context(host, k)  # all k steps within the graph state's context
        write_all = self._draft_write_loc(batch.out_cache_loc, info, graph=True)
        rows, seq = batch.req_pool_indices, batch.seq_lens
        blocks = {w: self._span_block(rows, seq, w, ds.widths[w], ds.block_indptr[w][:bs + 1], ds.block_locs[w],
                                      ds.blocks[w], ds.block_pos0[w][:bs])
                  for w in (self.windows if info.writes_swa else ())}
        kernels = ops.graph_refill_kernels(self.device.type) if self._fusable_refill else None
        batches, mds = [], []
        for i, st in enumerate(ds.steps[:k]):
            views = self._refill_draft_step(st, rows, seq, i, blocks, ds.rows[:bs], kernels)
            if bs and values_checkable(views.full.indptr):   # as a graph refill's (the last step's full list holds
                self._check_list_values(views.full if i == k - 1 else None, views.windows,   # every step's)
                                        batch.out_cache_loc[:bs])
            loc_i = batch.out_cache_loc[i * bs:(i + 1) * bs]
            swa_i = None if write_all.swa_loc is None else write_all.swa_loc[i * bs:(i + 1) * bs]
            host = None if batch.seq_lens_cpu is None else batch.seq_lens_cpu + i   # host ints: no sync
            step = ForwardBatch(ForwardMode.DECODE, bs, rows, st.lens[:bs], loc_i, seq_lens_cpu=host)
            md = ForwardMetadata(KVWriteLoc(loc_i, swa_i), swa_i, views.qo_indptr, views.q_pos0, views.full,
                                 views.windows, 1, bs, True, graph=True, graph_step=i)
            self.init_kernel_metadata(md, step, graph=True)
            batches.append(step)
            mds.append(md)
        shared = _shared_kernel_state(mds) if any(md.extra for md in mds) else None
        if shared is not None:
            raise ConfigError(f"{type(self).__name__}'s graph kernel metadata md.extra{shared} is one set of tables "
                              "that every draft step would overwrite: run drafts eagerly (init_draft_metadata), or "
                              "keep the tables per step (alloc_graph_tables / graph_tables(md))")
        steps = DraftSteps(self, batches, mds)
        steps.select(0)
        return steps

    def _refill_draft_step(self, st: StaticBuffers, rows: torch.Tensor, seq: torch.Tensor, step: int,
                           blocks: Dict[int, Block], arange: torch.Tensor, kernels: Optional[ops.GraphRefillKernels]
                           ) -> GraphViews:
        """Step `step`'s positions and lists into its static buffers: the full list from req_to_token (one
        fused launch where the device has one), each window list cut from its block (nothing translated)."""
        bs, rtt, ctx = rows.shape[0], self.req_to_token_pool.req_to_token, self.graph_max_context_len
        lens = torch.add(seq, step, out=st.lens[:bs])
        if kernels is not None:  # reads lens as the lengths it also stores there: the same values
            kernels.fill_lists(rtt, rows, lens, None, st.list_windows, st.lens, st.q_pos0, st.qo_indptr,
                               st.list_indptr, st.list_pos0, st.full_indices)
        else:
            torch.sub(lens, 1, out=st.q_pos0[:bs])
            st.full_pos0[:bs].zero_()
            fill_list(rtt, rows, lens, st.full_pos0[:bs], st.full_indptr[:bs + 1], st.full_indices)
        q_pos0 = st.q_pos0[:bs]
        windows = {}
        for w, block in blocks.items():
            pos0, indptr = st.win_pos0[w][:bs], st.win_indptr[w][:bs + 1]
            if kernels is None:
                torch.sub(q_pos0, w - 1, out=pos0).clamp_(min=0)
            _cut(block, arange, pos0, lens, indptr, st.win_indices[w], indptr_done=kernels is not None)
            windows[w] = KVIndexList(indptr, st.win_indices[w], pos0, w, min(ctx, w), self.hybrid)
        full = KVIndexList(st.full_indptr[:bs + 1], st.full_indices, st.full_pos0[:bs], None, ctx)
        return GraphViews(st.arange[:bs + 1], q_pos0, full, windows)

    # ---- shared -------------------------------------------------------------------------------
    def _check_draft_lens(self, batch: ForwardBatch, seq_h: List[int], k: int) -> None:
        """`ForwardBatch.check_lens` for all k steps of a draft (step i's lengths are seq_lens + i): 1 <= seq_lens,
        seq_lens + k - 1 <= max_context_len, rows in range (where checkable); typed, before anything is built.
        `seq_h`: host lengths after step 0."""
        rows, ctx = self.req_to_token_pool.req_to_token.shape
        batch.check_lens(seq_h, [1] * len(seq_h), rows, ctx)
        if k > 1 and seq_h and max(seq_h) > ctx - k + 1:
            i = next(i for i, n in enumerate(seq_h) if n > ctx - k + 1)
            raise ShapeError(f"seq_lens[{i}] is {seq_h[i]}: its {k} draft steps reach length {seq_h[i] + k - 1}, past "
                             f"max_context_len {ctx} (the ReqToTokenPool's); allowed range is [1, {ctx - k + 1}]")

    def _draft_write_loc(self, loc: torch.Tensor, info: MultiStepDraft, graph: bool) -> KVWriteLoc:
        """Every step's write locs, translated once; a draft without SWA layers translates nothing (an SWA
        layer forwarded there raises MissingSWALocError)."""
        if info.writes_swa:
            return self._write_loc(loc, graph=graph)
        check = getattr(self.pool, "check_write_loc", None)
        if check is not None:
            check(loc)
        return KVWriteLoc(loc)

    def _span_block(self, rows: torch.Tensor, seq: torch.Tensor, window: int, width: int, indptr: torch.Tensor,
                    locs: torch.Tensor, out: Optional[torch.Tensor], pos0_out: Optional[torch.Tensor]) -> Block:
        """Each request's `width` slots of its row from step 0's first window key (seq - W, at least 0)
        as a dense block, gathered and translated once: the window's one translation for all k steps."""
        pos0 = torch.sub(seq, window, out=pos0_out).clamp_(min=0)
        ops.fill_kv_indices(self.req_to_token_pool.req_to_token, rows, pos0, indptr, locs)
        if self.hybrid:
            translated = self._translate_window(locs[:rows.shape[0] * width], out=out)
            locs = translated if out is None else out  # graph: the whole static block (its tail zeroed)
        return locs.view(-1, width), pos0


def _cut(block: Block, rows: torch.Tensor, pos0: torch.Tensor, seq: torch.Tensor, indptr: torch.Tensor,
         out: torch.Tensor, indptr_done: bool = False) -> torch.Tensor:
    """Each request's list [pos0, seq) gathered from its span block (a gather: nothing translated); returns pos0."""
    slots, first = block
    if not indptr_done:
        cumsum_into(seq - pos0, indptr)
    ops.fill_kv_indices(slots, rows, pos0 - first, indptr, out)
    return pos0


def _shared_kernel_state(mds: List[ForwardMetadata]) -> Optional[str]:
    """The `md.extra` entry through which a step shares memory (or a plan object) with an earlier step's, else None."""
    owner: Dict[int, int] = {}
    for i, md in enumerate(mds):
        for where, ident in _identities(md.extra, ""):
            if owner.setdefault(ident, i) != i:
                return where
    return None


def _identities(obj: Any, where: str) -> Iterator[Tuple[str, int]]:
    """(path, identity) of the tensors' storages and the dataclass objects inside kernel metadata."""
    if isinstance(obj, torch.Tensor):
        if obj.untyped_storage().nbytes():
            yield where, obj.untyped_storage().data_ptr()
    elif isinstance(obj, dict):
        for key, v in obj.items():
            yield from _identities(v, f"{where}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        for j, v in enumerate(obj):
            yield from _identities(v, f"{where}[{j}]")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        yield where, id(obj)
        for f in dataclasses.fields(obj):
            yield from _identities(getattr(obj, f.name), f"{where}.{f.name}")


def _by_step(buf: torch.Tensor, steps: int, bs: int) -> torch.Tensor:
    """A step-major token buffer's first steps * bs rows as [steps, bs, ...]."""
    return buf[:steps * bs].view(steps, bs, *buf.shape[1:])


class DraftReplay:
    """What every graph of a multi-step draft shares (DraftGraphRunner, `hwkv.step_graph.DraftStepGraph`): the
    backend's draft graph state for `steps` steps, `fn` taking the steps of the latest refill, step-major inputs
    placed at the bucket's width and the step-major output read by step and request. Mixed in ahead of the runner
    class."""

    steps: int
    backend: Any
    inputs: Dict[str, torch.Tensor]
    _current: Optional[DraftSteps] = None

    def _init_state(self, max_bs: int, max_tokens: int) -> None:
        self.backend.init_draft_graph_state(max_bs, self.steps)

    def _arg(self, batch: ForwardBatch) -> Any:
        return self._current  # the steps of the latest refill (their lists are static buffers)

    def _check_step_inputs(self, inputs: Dict[str, torch.Tensor], bs: int,
                           bucket: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Step-major inputs of `bs` requests checked whole (ShapeError) before anything is copied; returns the
        (buffer, input) pairs `_stage_inputs` copies. An input that is the graph's own buffer is read in place at the
        bucket's width (step i of request b at row i * bucket + b): a view of its first k * bs rows at a narrower
        width would be read at the wrong rows and partly zeroed as padding (ShapeError)."""
        k = self.steps
        fresh = self._check_inputs(inputs, k * bs, " (step-major)")  # GraphRunner's check
        if bs != bucket:
            for name, buf in self.inputs.items():
                src = inputs[name]
                if src.data_ptr() == buf.data_ptr() and src.shape[0] < k * bucket:
                    raise ShapeError(f"input {name!r} is the graph's own buffer at {src.shape[0]} rows: written "
                                     f"there, a draft of {bs} requests sits at bucket {bucket}'s width (step i of "
                                     f"request b at row i * {bucket} + b); pass the whole buffer (a whole-step "
                                     "graph: or None)")
        return fresh

    def _stage_inputs(self, fresh: List[Tuple[torch.Tensor, torch.Tensor]], bs: int, bucket: int) -> None:
        """Step-major at the caller's width into step-major at the bucket's."""
        with torch.no_grad():   # a static buffer never joins the caller's autograd graph
            for buf, src in fresh:
                _by_step(buf, self.steps, bucket)[:, :bs].copy_(_by_step(src, self.steps, bs))

    def _by_step_rows(self, out: torch.Tensor, bs: int) -> torch.Tensor:
        """A step-major output [k * bucket, ...] as [k, bs, ...] of the live requests."""
        return out.view(self.steps, -1, *out.shape[1:])[:, :bs]


class DraftGraphRunner(DraftReplay, GraphRunner):
    """Captures the whole k-step draft forward per batch-size bucket: `fn(steps, inputs)` runs every
    step (`for step_batch in steps:` its layers) and returns [k * bs, ...]; inputs are per token,
    step-major [k * bs, ...]; `run` returns [k, bs, ...]. Larger batches run eagerly (never dropped).
    Inputs the caller writes into `self.inputs` itself go step-major at the bucket's width (step i of request b
    at row i * bucket + b) and are passed whole; a batch whose lengths, rows or write locs the eager draft step
    refuses is refused (the same errors) before any static buffer changes; the refilled lists' values are checked
    after the refill, as `GraphRunner.prepare` says."""

    @normal_tensors
    def __init__(self, backend: Any, fn: ModelFn, batch_sizes: Sequence[int],
                 input_shapes: Dict[str, Tuple[Tuple[int, ...], torch.dtype]], draft_steps: int,
                 adapter: Optional[GraphAdapter] = None, writes_swa: bool = True) -> None:
        draft_steps = check_draft_steps(draft_steps)  # before the backend's draft graph state is built
        self.draft = MultiStepDraft(draft_steps, writes_swa)
        self.steps = draft_steps
        super().__init__(backend, fn, batch_sizes, input_shapes, adapter, ForwardMode.DECODE)

    def _refill(self, batch: ForwardBatch) -> None:
        self._current = self.backend.init_draft_metadata_graph(batch)

    def _eager(self, batch: ForwardBatch) -> Any:
        return self.backend.init_draft_metadata(batch)

    def _live(self, out: torch.Tensor, step: PreparedStep) -> torch.Tensor:
        return self._by_step_rows(out, step.num_tokens // self.steps)

    def _static_batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(ForwardMode.DECODE, bs, self.req_pool_indices[:bs], self.seq_lens[:bs],
                            self.out_cache_loc[:bs * self.steps], spec_info=self.draft,
                            seq_lens_cpu=self.seq_lens_cpu[:bs] if self._host_lens else None)

    def _pad(self, bs_pad: int, live: int) -> None:
        """Padded requests: row 0, length 1, every step's slot the padding slot 0."""
        if live == bs_pad:
            return
        self.req_pool_indices[live:bs_pad].zero_()
        self.seq_lens[live:bs_pad].fill_(1)
        self.seq_lens_cpu[live:bs_pad].fill_(1)
        for buf in (self.out_cache_loc, *self.inputs.values()):
            _by_step(buf, self.steps, bs_pad)[:, live:].zero_()

    def _check_host_lens(self, batch: ForwardBatch, seq_h: List[int]) -> None:
        self.backend._check_draft_lens(batch, seq_h, self.steps)  # every step's length within the row, rows in range

    def prepare(self, batch: ForwardBatch, inputs: Dict[str, torch.Tensor]) -> PreparedStep:
        """Copy the draft batch and inputs into the static buffers step by step, pad to the smallest
        bucket that fits, refill every step's metadata; a batch larger than every bucket: eager metadata.
        Everything is checked before the first copy (lengths, rows, write locs, inputs: as the eager step)."""
        if not isinstance(batch, ForwardBatch):   # as the eager step
            raise ConfigError(f"batch must be a ForwardBatch, got {type(batch).__name__}")
        batch.check_devices(self.backend.device)   # as the eager step: before any tensor is read or copied
        info = _draft_info(batch)   # the eager draft step's rule: a DECODE batch (an EXTEND one had replayed as decodes)
        k = self.steps
        if info.num_steps > k:
            raise CapacityError(f"a draft of {info.num_steps} steps exceeds the {k} steps these graphs run; "
                                f"capture a DraftGraphRunner with draft_steps={info.num_steps}")
        if info != self.draft:
            raise ConfigError(f"these graphs run {self.draft}, the batch carries {info}")
        bs = batch.batch_size
        i = bisect.bisect_left(self.buckets, bs)
        if i == len(self.buckets):
            return PreparedStep(None, batch.num_tokens, self._eager(batch), inputs)
        bs_pad = self._captured(bs, i)
        self._check_lens_and_rows(batch)   # as the eager draft step (every step), also where the refill is recorded
        self._check_write_locs(batch.out_cache_loc)
        fresh = self._check_step_inputs(inputs, bs, bs_pad)  # first: a bad input changes nothing
        self.req_pool_indices[:bs].copy_(batch.req_pool_indices)
        self.seq_lens[:bs].copy_(batch.seq_lens)
        self._host_lens = batch.seq_lens_cpu is not None   # handed on to each step (backends with host lengths)
        if self._host_lens:
            self.seq_lens_cpu[:bs].copy_(batch.seq_lens_cpu)
        _by_step(self.out_cache_loc, k, bs_pad)[:, :bs].copy_(_by_step(batch.out_cache_loc, k, bs))
        self._stage_inputs(fresh, bs, bs_pad)  # inputs produced in the static buffers need no copy
        self._pad(bs_pad, bs)
        if not self.metadata_in_graph:
            self._refill(self._bucket_batch(bs_pad))
        return PreparedStep(bs_pad, batch.num_tokens, staged=self._new_staging())
