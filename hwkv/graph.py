"""GraphRunner: capture one graph per batch-size bucket, pad a batch up to its bucket, replay.

The device supplies a `GraphAdapter` (capture, replay, optional pre-replay host update); the
backend's base class refills its static metadata buffers before every replay. A batch larger
than the largest bucket runs eagerly; it is never dropped. `run` is one call; `prepare` (copy-in,
pad, metadata refill) and `replay` are its two halves, for callers that time them apart.
"""
from __future__ import annotations

import bisect
import contextlib
import gc
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Protocol, Sequence, Tuple

import torch

from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.checks import as_int, check_batch_sizes, check_rows, items_of, normal_tensors, values_checkable
from hwkv.errors import ConfigError, ShapeError
from hwkv.spec import DraftTree, MultiStepDraft, check_draft_tree, check_tree

ModelFn = Callable[[ForwardBatch, Dict[str, torch.Tensor]], torch.Tensor]


class GraphAdapter(Protocol):
    """What a device provides for graphs."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> Tuple[Any, torch.Tensor]:
        """Record `fn` once; return (graph handle, the output tensor the graph writes)."""

    def replay(self, graph: Any) -> torch.Tensor:
        """Run the recorded graph; return its output tensor."""

    def pre_replay(self, graph: Any) -> None:
        """Host-side update some vendors need before each replay (may do nothing)."""


class EagerAdapter:
    """No device graphs: 'capture' keeps the callable, 'replay' calls it over the same static buffers."""

    calls_step = True  # a replay runs the step's Python as it is (host values read afresh each time)

    def capture(self, fn: Callable[[], torch.Tensor]) -> Tuple[Any, torch.Tensor]:
        return fn, fn()

    def replay(self, graph: Any) -> torch.Tensor:
        return graph()

    def pre_replay(self, graph: Any) -> None:
        return None


@dataclass
class _Captured:
    graph: Any
    out: torch.Tensor


def _lossless(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether copying `src` values into a `dst` buffer keeps them all: a wider type of the same kind (int32 ids into
    int64, float16 into float32), or bools; not a float into a narrower one nor an int into a float (which rounds
    past its mantissa)."""
    if src == torch.bool:
        return True
    try:
        wider = torch.promote_types(src, dst) == dst
    except RuntimeError:   # no promotion rule (float8, unsigned ints): not known to keep every value
        return False
    return wider and src.is_floating_point == dst.is_floating_point


def _check_input_shapes(input_shapes: Any) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """`input_shapes` as {name: (trailing shape of ints >= 0, torch dtype)}: a ConfigError naming the entry
    otherwise, before anything is built."""
    if not isinstance(input_shapes, Mapping):
        raise ConfigError(f"input_shapes must map each input's name to (trailing shape, dtype), got "
                          f"{type(input_shapes).__name__}")
    out = {}
    for k, entry in input_shapes.items():
        pair = items_of(entry)
        dims = items_of(pair[0]) if pair is not None and len(pair) == 2 else None
        sizes = None if dims is None else [as_int(d) for d in dims]
        if sizes is None or any(d is None or d < 0 for d in sizes) or not isinstance(pair[1], torch.dtype):
            raise ConfigError(f"input_shapes[{k!r}] must be (trailing shape: ints >= 0, torch dtype), e.g. "
                              f"((4096,), torch.bfloat16), got {entry!r}")
        out[k] = (tuple(sizes), pair[1])
    return out


class GraphRunner:
    """Runs a model step (`fn(batch, inputs) -> out [T, ...]`) through captured graphs.

    `inputs` maps names to per-token tensors [T, ...]; `input_shapes` gives their trailing
    shapes and dtypes so the runner can own static copies. `tokens_per_req` is 1 for decode
    (or the draft length for TARGET_VERIFY). `tree=True` (TARGET_VERIFY only): batches carry a
    `hwkv.spec.DraftTree`, copied into a static mask (padded requests get a chain, i.e. causal).
    Multi-step drafts run through `hwkv.draft.DraftGraphRunner`, a subclass.
    """

    steps: int = 1  # forward steps one replay runs, tokens step-major (a DraftGraphRunner's k)

    @normal_tensors
    def __init__(self, backend: Any, fn: ModelFn, batch_sizes: Sequence[int],
                 input_shapes: Dict[str, Tuple[Tuple[int, ...], torch.dtype]],
                 adapter: Optional[GraphAdapter] = None, mode: ForwardMode = ForwardMode.DECODE,
                 tokens_per_req: int = 1, tree: bool = False) -> None:
        batch_sizes = check_batch_sizes("batch_sizes", batch_sizes)
        if tree and mode != ForwardMode.TARGET_VERIFY:
            raise ConfigError(f"tree=True is for TARGET_VERIFY graphs, not {mode.name}")
        tpr = as_int(tokens_per_req)
        if tpr is None or tpr < 1:
            raise ConfigError(f"tokens_per_req must be an integer >= 1 (tokens a request runs a step), got "
                              f"{tokens_per_req!r}")
        tokens_per_req = tpr
        if mode == ForwardMode.DECODE and tokens_per_req != 1:
            raise ConfigError(f"DECODE graphs run one token per request, not tokens_per_req={tokens_per_req}")
        input_shapes = _check_input_shapes(input_shapes)   # before the backend's graph state is built
        self.backend, self.fn, self.mode, self.tpr = backend, fn, mode, tokens_per_req
        self.buckets: List[int] = sorted(set(batch_sizes))
        self.adapter = adapter if adapter is not None else EagerAdapter()
        dev = backend.device
        max_bs = self.buckets[-1]
        max_tokens = max_bs * tokens_per_req * self.steps
        self._init_state(max_bs, max_tokens)
        i64 = dict(dtype=torch.int64, device=dev)
        self.req_pool_indices = torch.zeros(max_bs, **i64)
        self.seq_lens = torch.ones(max_bs, **i64)
        self.out_cache_loc = torch.zeros(max_tokens, **i64)
        self.extend_seq_lens = torch.full((max_bs,), tokens_per_req, **i64)
        self.extend_prefix_lens = torch.zeros(max_bs, **i64)
        # host copies of the padded batch's lengths, handed on when the engine's batch has them (backends
        # whose vendor op takes host length lists read them in the metadata step: no device read)
        self.seq_lens_cpu = torch.full((max_bs,), tokens_per_req, dtype=torch.int64, device="cpu")
        self.extend_seq_lens_cpu = torch.full((max_bs,), tokens_per_req, dtype=torch.int64, device="cpu")
        self._host_lens = True
        # the verify tree's static mask: every request's [tpr, tpr] block, a chain (causal) until filled
        chain = torch.ones(tokens_per_req, tokens_per_req, dtype=torch.bool, device=dev).tril_().reshape(-1)
        self.chain_mask = chain
        self.tree_mask = chain.repeat(max_bs) if tree else None
        self.inputs = {k: torch.zeros((max_tokens, *shape), dtype=dt, device=dev)
                       for k, (shape, dt) in input_shapes.items()}
        self.graphs: Dict[int, _Captured] = {}
        self.recorded_translations: Dict[int, Tuple[int, int]] = {}  # per bucket, when the refill is recorded
        # a backend whose graph refill is device work only (no host update per replay), under an adapter
        # that records device work, has the refill captured with the layers: prepare only copies inputs
        self.metadata_in_graph = bool(getattr(backend, "metadata_in_graph", False)
                                      and getattr(self.adapter, "records_device_work", False))
        self.eager_runs = 0
        self.replays = 0
        # one static batch per (bucket, host lengths): captures and refills see the same objects every replay
        # (no batch built per step; torch.compile's guards on what the step reads keep holding)
        self._batches: Dict[Tuple[int, bool], ForwardBatch] = {}
        self._bounds_q = "max_q_len" in inspect.signature(backend.init_forward_metadata_graph).parameters

    def _static_batch(self, bs: int) -> ForwardBatch:
        n = bs * self.tpr
        extend = None if self.mode == ForwardMode.DECODE else self.extend_seq_lens[:bs]
        prefix = None if self.mode == ForwardMode.DECODE else self.extend_prefix_lens[:bs]
        host = self._host_lens
        spec = None if self.tree_mask is None else DraftTree(self.tree_mask[:bs * self.tpr * self.tpr])
        return ForwardBatch(self.mode, bs, self.req_pool_indices[:bs], self.seq_lens[:bs],
                            self.out_cache_loc[:n], prefix, extend, spec_info=spec,
                            seq_lens_cpu=self.seq_lens_cpu[:bs] if host else None,
                            extend_seq_lens_cpu=self.extend_seq_lens_cpu[:bs] if host else None)

    def _bucket_batch(self, bs: int) -> ForwardBatch:
        """The static batch of bucket `bs` (built once per bucket and host-lengths choice)."""
        key = (bs, self._host_lens)
        batch = self._batches.get(key)
        if batch is None:
            batch = self._batches[key] = self._static_batch(bs)
        return batch

    def _static_inputs(self, bs: int) -> Dict[str, torch.Tensor]:
        n = bs * self.tpr * self.steps
        return {k: v[:n] for k, v in self.inputs.items()}

    # ---- what a subclass (DraftGraphRunner) changes ------------------------------------------------
    def _init_state(self, max_bs: int, max_tokens: int) -> None:
        self.backend.init_graph_state(max_bs, max_tokens)

    def _refill(self, batch: ForwardBatch) -> None:
        """Static metadata for a padded static batch (at capture, before a replay, or inside the graph);
        every request has exactly `tpr` new tokens, which bounds the extend grids (a backend whose override
        of init_forward_metadata_graph predates `max_q_len` gets the batch's token count, as before)."""
        if self._bounds_q:
            self.backend.init_forward_metadata_graph(batch, max_q_len=self.tpr)
        else:
            self.backend.init_forward_metadata_graph(batch)

    def _check_mode(self, mode: ForwardMode) -> None:
        """The static batch runs the runner's mode (a DECODE runner had replayed an EXTEND batch of 2 and 0 new
        tokens as two decodes): a batch of another is a ConfigError naming both; a DECODE runner takes IDLE (a
        DECODE of no requests, as the eager step plans it). An enum compare: no device read."""
        if mode is not self.mode and not (mode is ForwardMode.IDLE and self.mode is ForwardMode.DECODE):
            name = getattr(mode, "name", repr(mode))
            raise ConfigError(f"these graphs were captured for {self.mode.name} batches, the batch is {name}: run it "
                              f"eagerly (backend.init_forward_metadata) or through a GraphRunner of mode={name}")

    def _check_tokens_per_request(self, batch: ForwardBatch) -> None:
        """The static batch gives every request `tpr` new tokens: a batch whose requests differ would run
        with the wrong lengths. Checked on the engine's host copies, or the lengths themselves where their values are
        checkable (on the CPU: free; on a device in debug mode, outside a capture)."""
        ext = batch.extend_seq_lens_cpu
        if ext is None and batch.extend_seq_lens is not None and values_checkable(batch.extend_seq_lens):
            ext = batch.extend_seq_lens.cpu()
        if ext is not None and bool((ext != self.tpr).any()):
            raise ShapeError(f"graph mode needs {self.tpr} new token(s) per request; extend_seq_lens are "
                             f"{ext.tolist()}")

    def _check_lens_and_rows(self, batch: ForwardBatch) -> None:
        """What the eager metadata step checks (`ForwardBatch.check_lens`: 1 <= seq_lens <= max_context_len, each
        request's `tpr` new tokens within its length, rows inside req_to_token), on the engine's host copies of the
        lengths, or the lengths themselves where they are on the host; never a device read. Lengths only on the
        device: the rows alone, where checkable (`check_rows`). Typed (ShapeError, LocError), before any static
        buffer is written."""
        seq = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens
        if seq.device.type == "cpu":
            self._check_host_lens(batch, seq.tolist())
        else:
            check_rows(batch.req_pool_indices, self.backend.req_to_token_pool.req_to_token.shape[0])

    def _check_host_lens(self, batch: ForwardBatch, seq_h: List[int]) -> None:
        """`_check_lens_and_rows` given host lengths (each request's new tokens: the tpr the static batch runs)."""
        rows, ctx = self.backend.req_to_token_pool.req_to_token.shape
        batch.check_lens(seq_h, [self.tpr] * batch.batch_size, rows, ctx)

    def _check_write_locs(self, loc: torch.Tensor) -> None:
        """The write locs' values as the refill will check their static copy (`pool.check_write_loc`, where values
        are checkable: CPU, HWKV_DEBUG; a refill recorded in a device graph checks none), before the copy: a loc outside
        the pool (LocError) leaves the static batch as it was. The static copy is int64 on the pool's device: the
        values alone are checked, whatever the caller's dtype (a copy only where it differs)."""
        check = getattr(self.backend.pool, "check_write_loc", None)
        if check is not None and loc.numel() and values_checkable(loc):
            check(loc.to(self.out_cache_loc.device, torch.int64).contiguous())

    def _arg(self, batch: ForwardBatch) -> Any:
        """What `fn` takes for a static batch: the batch itself."""
        return batch

    def _eager(self, batch: ForwardBatch) -> Any:
        """Eager metadata for a batch larger than every bucket; returns what `fn` takes."""
        self.backend.init_forward_metadata(batch)
        return batch

    def _live(self, out: torch.Tensor, step: "PreparedStep") -> torch.Tensor:
        return out[:step.num_tokens]

    def capture(self) -> None:
        """Capture every bucket, largest first (so smaller ones can share the largest's memory)."""
        for bs in reversed(self.buckets):
            self._pad(bs, 0)
            batch = self._bucket_batch(bs)
            inputs = self._static_inputs(bs)
            self._refill(batch)
            self.fn(self._arg(batch), inputs)  # warm-up outside the graph (kernel compilation, autotuning)
            if self.metadata_in_graph:  # the refill's launches are recorded too: a replay refills itself
                before = self._translations()
                # (the static batch of the replay's host-lengths choice: an adapter that reruns Python hands fn that)
                graph, out = self.adapter.capture(lambda k=bs, i=inputs: self._refill_and_run(self._bucket_batch(k), i))
                self.recorded_translations[bs] = tuple(a - b for a, b in zip(self._translations(), before))
            else:
                graph, out = self.adapter.capture(lambda k=bs, i=inputs: self.fn(self._arg(self._bucket_batch(k)), i))
            self.graphs[bs] = _Captured(graph, out)

    def _translations(self) -> Tuple[int, int]:
        return self.backend.loc_cache.translations, self.backend.window_translations

    def _refill_and_run(self, batch: ForwardBatch, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        self._refill(batch)
        return self.fn(self._arg(batch), inputs)

    def _pad(self, bs_pad: int, live: int) -> None:
        """Padded requests: row 0, length tpr (prefix 0), write to the padding slot 0 (nothing to do at bucket size)."""
        if live == bs_pad:
            return
        self.req_pool_indices[live:bs_pad].zero_()
        self.seq_lens[live:bs_pad].fill_(self.tpr)
        if self.mode != ForwardMode.DECODE:  # a decode batch hands the model no prefix lengths
            self.extend_prefix_lens[live:bs_pad].zero_()
        self.seq_lens_cpu[live:bs_pad].fill_(self.tpr)
        self.out_cache_loc[live * self.tpr:bs_pad * self.tpr].zero_()
        if self.tree_mask is not None:
            blk = self.tpr * self.tpr
            self.tree_mask[live * blk:bs_pad * blk].view(-1, blk).copy_(self.chain_mask)
        for v in self.inputs.values():
            v[live * self.tpr:bs_pad * self.tpr].zero_()

    def _new_staging(self) -> int:
        """Count one more batch staged into the backend's static buffers and lists (every runner over the backend
        shares them): a prepared step replays only while it is the last one staged."""
        self.backend.graph_stagings += 1
        return self.backend.graph_stagings

    def _captured(self, bs: int, i: int) -> int:
        """The bucket (index i) a batch of bs requests replays; a ConfigError where it was never captured (or a capture
        stopped part way), before anything is staged."""
        bs_pad = self.buckets[i]
        if bs_pad not in self.graphs:
            raise ConfigError(f"a batch of {bs} replays bucket {bs_pad}, which is not captured (captured: "
                              f"{sorted(self.graphs) or 'none'}): call capture() before run()")
        return bs_pad

    def prepare(self, batch: ForwardBatch, inputs: Dict[str, torch.Tensor]) -> "PreparedStep":
        """Everything before the layers: copy the batch and inputs into the static buffers, pad to the
        smallest bucket that fits, refill the static metadata. A batch larger than every bucket gets
        eager metadata instead (and `replay` runs it eagerly: it is never dropped). A batch the eager metadata
        step would refuse (rows, lengths: `_check_lens_and_rows`; write locs outside the pool: `_check_write_locs`;
        in debug mode a malformed DraftTree: `check_tree`), or one of another forward mode than the runner's
        (`_check_mode`), is refused before any static buffer changes. The refilled lists' values (history slots in
        the pool; in debug mode, no evicted window slot) are checked where the refill runs on the host, after it: such
        a refusal leaves the pools unchanged and the static buffers refilled, and returns no PreparedStep to replay."""
        if not isinstance(batch, ForwardBatch):   # as the eager step
            raise ConfigError(f"batch must be a ForwardBatch, got {type(batch).__name__}")
        bs = batch.batch_size
        if isinstance(batch.spec_info, MultiStepDraft):
            raise ConfigError("a MultiStepDraft batch runs through hwkv.draft.DraftGraphRunner, not GraphRunner")
        batch.check_devices(self.backend.device)   # as the eager step: before any tensor is read or copied
        self._check_mode(batch.forward_mode)
        if batch.num_tokens != bs * self.tpr:
            raise ShapeError(f"graph mode needs {self.tpr} token(s) per request: {batch.num_tokens} tokens "
                             f"for {bs} requests")
        n = bs * self.tpr
        tree = batch.spec_info if isinstance(batch.spec_info, DraftTree) else None
        if tree is not None and self.tree_mask is None:
            raise ConfigError("this batch carries a DraftTree: capture its graphs with GraphRunner(..., tree=True)")
        if tree is not None:
            check_draft_tree(tree, self.backend.device)   # as the eager step: before any static buffer changes
        if tree is not None and tree.mask.shape[0] != bs * self.tpr * self.tpr:
            raise ShapeError(f"DraftTree.mask has {tree.mask.shape[0]} entries; {bs} requests of {self.tpr} "
                             f"draft tokens need {bs * self.tpr * self.tpr}")
        i = bisect.bisect_left(self.buckets, bs)
        if i == len(self.buckets):
            return PreparedStep(None, n, self._eager(batch), inputs)
        prefix = batch.extend_prefix_lens
        if self.mode != ForwardMode.DECODE:   # eager runs take any lengths; the static batch takes tpr each
            self._check_tokens_per_request(batch)
            if prefix is not None and (prefix.dim() != 1 or prefix.shape[0] != bs):
                got = f"{prefix.shape[0]} entries" if prefix.dim() == 1 else f"shape {list(prefix.shape)}"
                raise ShapeError(f"extend_prefix_lens has {got}, batch_size is {bs}")
        if tree is not None and getattr(self.backend, "debug", False):  # the refill's value check, before any copy
            check_tree(tree, self.extend_seq_lens_cpu[:bs], values_checkable(tree.mask))
        self._check_lens_and_rows(batch)  # as the eager step would (which a batch past every bucket takes)
        self._check_write_locs(batch.out_cache_loc)
        bs_pad = self._captured(bs, i)
        self._take_inputs(inputs, n)  # first: a bad input leaves the static batch as it was
        self.req_pool_indices[:bs].copy_(batch.req_pool_indices)
        self.seq_lens[:bs].copy_(batch.seq_lens)
        if self.mode != ForwardMode.DECODE:  # what fn reads in the static batch, as the caller's batch has it eagerly
            if prefix is not None:
                self.extend_prefix_lens[:bs].copy_(prefix)
            else:  # (none given: those of the lengths, every request having tpr new tokens)
                torch.sub(self.seq_lens[:bs], self.tpr, out=self.extend_prefix_lens[:bs])
        self._host_lens = batch.seq_lens_cpu is not None
        if self._host_lens:
            self.seq_lens_cpu[:bs].copy_(batch.seq_lens_cpu)
        self.out_cache_loc[:n].copy_(batch.out_cache_loc)
        if self.tree_mask is not None:
            blk = self.tpr * self.tpr
            if tree is None:  # no tree: a plain (chain) verify
                self.tree_mask[:bs * blk].view(-1, blk).copy_(self.chain_mask)
            else:
                self.tree_mask[:bs * blk].copy_(tree.mask)
        self._pad(bs_pad, bs)
        if not self.metadata_in_graph:
            self._refill(self._bucket_batch(bs_pad))
        return PreparedStep(bs_pad, n, staged=self._new_staging())

    def _take_inputs(self, inputs: Dict[str, torch.Tensor], n: int) -> None:
        """Check every input for `n` tokens, then copy those not already in the static buffers (an engine that
        writes them there copies nothing); checked whole before the first copy, so a bad input changes nothing."""
        with torch.no_grad():   # a static buffer never joins the caller's autograd graph (it would hold it alive)
            for v, src in self._check_inputs(inputs, n):
                v[:n].copy_(src[:n])

    def _check_inputs(self, inputs: Dict[str, torch.Tensor], n: int,
                      what: str = "") -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """ShapeError unless every input holds `n` tokens of its static buffer's trailing shape; returns the
        (buffer, input) pairs whose input is not already that buffer (those a replay copies)."""
        if not isinstance(inputs, Mapping):
            raise ShapeError(f"inputs must map each input's name to its tensor{what}, got {type(inputs).__name__}")
        fresh = []
        for k, v in self.inputs.items():
            src = inputs.get(k)
            if src is not None and (not isinstance(src, torch.Tensor) or src.device.type not in (v.device.type, "cpu")):
                got = f"a tensor on {src.device}" if isinstance(src, torch.Tensor) else type(src).__name__
                raise ShapeError(f"input {k!r} must be a tensor on {v.device} (or the CPU){what}, got {got}")
            if src is None or src.dim() == 0 or src.shape[0] < n or src.shape[1:] != v.shape[1:]:
                raise ShapeError(f"input {k!r} must be [{n}, {', '.join(map(str, v.shape[1:]))}]{what}, got "
                                 f"{None if src is None else list(src.shape)}")
            if src.dtype != v.dtype and not _lossless(src.dtype, v.dtype):  # the copy would round
                raise ShapeError(f"input {k!r} is {src.dtype}, its static buffer {v.dtype}{what}: a replay would "
                                 f"round what the eager step computes with; pass {v.dtype} or capture with "
                                 f"{src.dtype}")
            if src.data_ptr() != v.data_ptr():
                fresh.append((v, src))
        return fresh

    def replay(self, step: "PreparedStep") -> torch.Tensor:
        """The layers of a prepared step: replay its bucket's graph (or run the eager fallback)."""
        if step.bucket is None:
            out = self.fn(step.batch, step.inputs)
            self.eager_runs += 1   # (counted once it ran, as replays are)
            return self._live(out, step)
        now = self.backend.graph_stagings
        if step.staged != now:   # the static buffers hold a later prepare's batch: its replay would run that
            raise ConfigError(f"this step was staged before the last prepare() over this backend's graph state (staged "
                              f"{step.staged}, now {now}): its static buffers hold that later batch; prepare again")
        cap = self.graphs[step.bucket]
        self.adapter.pre_replay(cap.graph)
        before = self._translations()
        out = self.adapter.replay(cap.graph)
        self.replays += 1
        rec = self.recorded_translations.get(step.bucket)
        if rec is not None and self._translations() == before:  # a device graph: the refill ran in it
            self.backend.loc_cache.translations += rec[0]     # keep the backend's counts of what ran
            self.backend.window_translations += rec[1]
        return self._live(out, step)

    def run(self, batch: ForwardBatch, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Replay the smallest bucket that fits, or run eagerly when the batch is larger than all."""
        return self.replay(self.prepare(batch, inputs))


@dataclass(frozen=True)
class PreparedStep:
    """What `GraphRunner.replay` needs after `prepare`: the bucket to replay and the live tokens;
    bucket None means the eager fallback, which keeps what `fn` takes (the batch, or a draft's
    DraftSteps) and the inputs to run."""

    bucket: Optional[int]
    num_tokens: int
    batch: Any = None
    inputs: Optional[Dict[str, torch.Tensor]] = None
    staged: int = 0   # the backend's count of staged batches when this one was staged (a later one overwrote it)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's garbage collector off for the block, back on after it if it was on before."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class TorchDeviceGraphAdapter:
    """Graphs through `torch.<module>`'s graph class and capture context (CUDA, HIP, MUSA, XPU, NPU).

    One memory pool is shared by every bucket (captured largest first); capture runs on a side
    stream. The vendor's torch module is looked up on `torch` at use time: the core imports nothing.
    Python's garbage collector is paused while a capture runs: a collection then could destroy an
    unreachable graph of an earlier runner, a call the driver forbids during capture, and the capture
    would fail ("operation failed due to a previous error during capture"); torch stopped collecting
    before captures in 2.9, so stale graphs in reference cycles are common.
    """

    module: str = "cuda"
    graph_class: str = "CUDAGraph"
    records_device_work = True  # every launch inside capture replays, the metadata refill's too

    def __init__(self) -> None:
        mod = getattr(torch, self.module, None)
        if mod is None or not hasattr(mod, self.graph_class) or not hasattr(mod, "graph"):
            raise ConfigError(f"torch.{self.module} has no {self.graph_class}/graph: graphs are unavailable here")
        available = getattr(mod, "is_available", None)
        if callable(available) and not available():
            raise ConfigError(f"torch.{self.module}.is_available() is False: {self.graph_class} graphs need a visible "
                              "device")
        self._mod = mod
        self._pool: Any = None
        self._stream = mod.Stream()

    def capture(self, fn: Callable[[], torch.Tensor]) -> Tuple[Any, torch.Tensor]:
        g = getattr(self._mod, self.graph_class)()
        with gc_paused(), self._mod.graph(g, pool=self._pool, stream=self._stream):
            out = fn()
        if self._pool is None:
            self._pool = g.pool()
        return (g, out), out

    def replay(self, graph: Any) -> torch.Tensor:
        g, out = graph
        g.replay()
        return out

    def pre_replay(self, graph: Any) -> None:
        return None
