"""Engine: the one step loop. Requests and sampling parameters, admission by reservation, chunked prefill
beside decoding requests, the prefix cache, decode graphs and the overlapped loop, over one model's pools.

One step is one forward: the scheduler picks the rows (every decoding request, then prompt chunks), the
allocator serves the whole batch in one call (a decode step whose tokens all continue their pages moves no
page) and req_to_token gets one scatter, the backend's metadata step runs once, the model runs over the packed
tokens (`model_step`), one out-of-window release for the batch (in the steps where some request's frontier
moves), the sampled tokens stay on the device as the next forward's inputs and reach the host one step later
(overlap) or at the end of the step, and finished requests free their slots (or leave them to the prefix
cache). Host work is a constant number of torch calls per step, none per request; a layer only stores and
attends. Decode-only forwards replay graphs where the device has them. The model is a callable: the
transformers integration (`hwkv.integrations.runner.HybridRunner`) is one.
"""
from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.cache import HybridPrefixCache
from hwkv.checks import check_flag
from hwkv.engine.drafters import Drafter, TokenHistory, draft_ids
from hwkv.engine.forward import ForwardSlots, StepLens, pack
from hwkv.engine.inputs import batch_sizes, engine_args, prompt_ids, release_window, shown
from hwkv.engine.integrity import check_holders
from hwkv.engine.pools import Cache
from hwkv.engine.prefixing import EnginePrefix
from hwkv.engine.readback import Held, ReadBack
from hwkv.engine.sampling import RowSampling, SamplingParams
from hwkv.engine.scheduler import Request, Row, Scheduler
from hwkv.engine.stats import RunnerStats
from hwkv.errors import ConfigError, HwkvError, ShapeError
from hwkv.sigint import interrupts_held
from hwkv.spec import accept_draft_tokens

I64 = torch.int64
# the model over one forward's packed tokens: (batch, token ids, positions, keep) -> logits [K, vocab], where
# keep is 0 (every token) or the indices of the tokens whose logits are wanted
ModelStep = Callable[[ForwardBatch, torch.Tensor, torch.Tensor, Union[int, torch.Tensor]], torch.Tensor]


@dataclass
class Result:
    """A finished (or refused) request: its output token ids, why it stopped, or the typed error."""

    rid: int
    prompt: List[int]
    tokens: List[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    error: Optional[HwkvError] = None
    seed: Optional[int] = None  # the sampling seed it ran with (as given, or derived for it)


def check_switches(overlap: Optional[bool], prefix_cache: bool, whole_step: Optional[bool]) -> None:
    """The engine's on/off options: True or False, and None (decide by the device) for overlap and whole_step
    (`hwkv.checks.check_flag`: ConfigError naming the value, as `hwkv plan` refuses prefix_cache)."""
    check_flag("overlap", overlap, none=True)
    check_flag("prefix_cache", prefix_cache)
    check_flag("whole_step", whole_step, none=True)




class Engine:
    """Continuous batching over one model: `add_request` any time, `step` runs one forward, `generate` runs all.

    `cache`: the pools, allocator, request rows and backend (`hwkv.engine.pools.build_cache`); `model_step`:
    the model (see `ModelStep`); `window`: what the out-of-window release keeps: the model's sliding window (or
    more) over hybrid pools, None over full ones (else ConfigError: `hwkv.engine.inputs.release_window`);
    `graph_adapter`: the device's, or None for eager decode (`graph_choice` is the user's setting, for
    messages); `prefix_cache`: a HybridPrefixCache over hybrid pools (the pools planned
    with room for each request's cache lock window); `overlap`: read each step's tokens during the next (None:
    on accelerators); `whole_step`: decode steps replay one graph each, allocation, req_to_token write, metadata
    and release included (`hwkv.step_graph.DecodeStepGraph`; None: wherever the graph can hold them, i.e. the
    allocator has the device's page-op kernels or the adapter replays eagerly), else graphs of the layers
    only (`hwkv.graph.GraphRunner`). `draft`: speculative verify (see `_verify`): a callable (tokens so far, k)
    -> up to k draft ids (`hwkv.engine.drafters`; the tokens so far are the request's `TokenHistory`, a read-only
    sequence), `num_draft` = k; the tokens stay greedy decoding's (with the whole-step graph, a verify of k drafts
    replays a `hwkv.step_graph.VerifyStepGraph`). `vocab_size`: prompts' token ids lie in [0, vocab_size).

    Every argument is checked (ConfigError naming the value and the limit) before anything is taken from `cache`;
    a refusal after that (whole_step=True where it cannot run, a capture refused under graphs "on" or "eager")
    gives back what was taken, so a refused constructor leaves the cache as it was."""

    closed = False
    _in_callback = False  # generate's on_step is running (step and generate refuse then: its results would go astray)

    def __init__(self, cache: Cache, model_step: ModelStep, *, stats: RunnerStats, vocab_size: int,
                 window: Optional[int], graph_adapter: Any = None, graph_choice: str = "off",
                 graph_batch_sizes: Optional[Sequence[int]] = None, overlap: Optional[bool] = None,
                 prefix_cache: bool = True, whole_step: Optional[bool] = None, draft: Optional[Drafter] = None,
                 num_draft: int = 4) -> None:
        self._step_lock = threading.Lock()   # one step at a time: from a drafter or callback inside it, or a thread
        pool_plan = cache.plan
        # every argument is checked before anything is taken from the cache (the padding row, below)
        check_switches(overlap, prefix_cache, whole_step)
        graph_batch_sizes = batch_sizes(graph_batch_sizes)
        window = release_window(window, cache.hybrid, cache.shape.window, pool_plan.context, pool_plan.page_size,
                                cache.shape.name)
        vocab, num_draft = engine_args(model_step, stats, vocab_size, draft, num_draft)
        self.cache, self.model_step, self.stats, self.vocab_size = cache, model_step, stats, vocab
        self.draft, self.num_draft = draft, num_draft
        # the row past the requests' (build_cache makes one more): a whole-step graph's padded requests write there.
        # A refusal after this point (whole_step=True where it cannot run, a capture refused under "on") gives it
        # back: an engine built next on this cache has every request row
        self.pad_row = cache.rtt.alloc(1)[0]
        try:
            self._build(graph_adapter, graph_choice, graph_batch_sizes, overlap, prefix_cache, whole_step, window)
        except BaseException:
            cache.rtt.free(self.pad_row)
            raise

    def _build(self, graph_adapter: Any, graph_choice: str, graph_batch_sizes: Optional[Sequence[int]],
               overlap: Optional[bool], prefix_cache: bool, whole_step: Optional[bool], window: Optional[int]) -> None:
        """The engine's state over its checked arguments: scheduler, slots, prefix cache, read-back blocks, the
        sampling table, the decode graphs (captured now)."""
        cache, pool_plan, draft = self.cache, self.cache.plan, self.draft
        dev = self.device = cache.rtt.req_to_token.device
        self.window = window
        # prefix caching (hybrid pools: HybridPrefixCache keeps full and SWA pages of finished and prefilled
        # requests; a new request starts from its longest cached prefix)
        cached = prefix_cache and cache.hybrid and window is not None
        self.scheduler = Scheduler(pool_plan, window, cached=cached)
        rows = cache.rtt.size
        # a forward's slots, req_to_token and batch, the out-of-window release with each row's frontier (device,
        # and the host's copy by the same rule: steps where no frontier moves, most of them, skip the release)
        self.slots = ForwardSlots(cache.allocator, cache.rtt, window)
        # what the step loop asks of the prefix cache (`hwkv.engine.prefixing`); `prefix` is the cache itself
        self._prefixing = EnginePrefix(cache, window, self.scheduler, self.slots) if cached else None
        self.prefix: Optional[HybridPrefixCache] = self._prefixing.tree if cached else None
        # each row's last sampled token, the next forward's input: sampled tokens never wait for the host
        self.next_ids = torch.zeros(rows, dtype=I64, device=dev)
        # each row's sampling constants, written when a sampling request is admitted (`RowSampling`)
        self.sampling = RowSampling(rows, dev)
        # overlap: a step's tokens are read by the host during the next step (see `step`)
        # (with a drafter no step overlaps: a request is drafted for only once its last token is on the host, so an
        # overlapped step would leave every row pending and no verify would run; steps of sampling requests wait too)
        self.overlap = (dev.type != "cpu" if overlap is None else bool(overlap)) and draft is None
        # the forwards issued and not yet read back, and the pinned blocks their tokens travel in
        self.readback = ReadBack(pool_plan.max_running + 2, dev)
        self._pools_changed = False  # this step moved a page (the KV held may have changed)
        self.requests: Dict[int, Request] = {}
        self.unclaimed: Dict[int, Result] = {}  # finished inside generate(), queued by add_request: pop them
        # requests whose last token was read and whose hand-over (prefix cache, rows) a Ctrl-C kept from running:
        # the next step finishes them (`_finish_pending`)
        self._finishing: List[Request] = []
        self._carry: List[Result] = []       # finished in a step that raised after they did: the next step's
        self._release_owed = False           # an out-of-window release was cut short: the next step runs it first
        self._next_rid = 0
        self.whole_step = False
        self.verify_graph: Any = None  # a VerifyStepGraph of num_draft drafts, with the whole-step graph
        # a verify graph token's distance to the end (num_draft + 1 <= chunk where there is a verify graph)
        self._draft_back = torch.arange(min(self.num_draft, pool_plan.chunk) + 1, 0, -1, dtype=I64, device=dev)
        self.graph = self._graph_runner(graph_adapter, graph_choice, graph_batch_sizes, whole_step)

    def _graph_runner(self, adapter: Any, choice: str, batch_sizes: Optional[Sequence[int]],
                      whole_step: Optional[bool]) -> Any:
        """A DecodeStepGraph (or a GraphRunner of the layers) for decode forwards, captured now; None without an
        adapter (graphs off).

        The model's own code must be capturable too. With "auto" a capture that fails leaves decode eager and
        the reason in `stats.graph_error` (e.g. fp32 grouped_mm MoE experts copy through the host on CUDA);
        with "on" it raises ConfigError."""
        if adapter is None:
            if whole_step:
                raise ConfigError("whole_step=True needs a graph adapter (graphs off runs decode eagerly; "
                                  "graphs='eager' runs the whole step on the CPU; whole_step=None decides by the "
                                  "device)")
            return None
        from hwkv.graph import GraphRunner
        from hwkv.step_graph import DecodeStepGraph, VerifyStepGraph

        top = self.cache.plan.max_running
        buckets = sorted({b for b in (batch_sizes or [1 << i for i in range(12)]) if b <= top} | {top})
        able = DecodeStepGraph.fits(self.cache.allocator, adapter, self.cache.backend)
        if whole_step and not able:
            raise ConfigError(f"whole_step=True: a whole-step graph on {self.device.type} needs the device's page-op "
                              "kernels (hwkv.pages.register_page_ops) and a refill verified inside its graphs "
                              "(backend.metadata_in_graph), or graphs='eager'; whole_step=None uses it where it can")
        self.whole_step = able if whole_step is None else bool(whole_step)
        # verify steps of num_draft drafts as one graph each too, in the buckets the forward's token budget admits
        # (`_draft_len`: batch x (k + 1) <= chunk); other draft lengths run eagerly. The graphs share the backend's
        # static buffers, sized here for both
        n = self.num_draft + 1
        verify_buckets = [b for b in buckets if b * n <= self.cache.plan.chunk]
        verify = self.whole_step and self.draft is not None and bool(verify_buckets)
        if verify:
            self.cache.backend.init_graph_state(top, max(top, verify_buckets[-1] * n))
        if self.whole_step:
            frontiers = self.slots.frontiers if self.window is not None else None
            runner: Any = DecodeStepGraph(self.cache.backend, self.cache.allocator, self._whole_step_model, buckets,
                                          {}, adapter, frontiers=frontiers, window=self.window, pad_row=self.pad_row)
        else:
            shapes = {"input_ids": ((), I64), "positions": ((), I64)}
            runner = GraphRunner(self.cache.backend, self._decode_step, buckets, shapes, adapter, ForwardMode.DECODE)
        if verify:
            self.verify_graph = VerifyStepGraph(self.cache.backend, self.cache.allocator, self._verify_model,
                                                verify_buckets, {"input_ids": ((), I64)}, self.num_draft, adapter,
                                                pad_row=self.pad_row)
        try:
            with torch.inference_mode():  # as every step runs (see `step`)
                runner.capture()
                if self.verify_graph is not None:
                    self.verify_graph.capture()
        except HwkvError:
            raise
        except Exception as e:  # the model's code refused capture: reported, never silent
            reason = f"decode graph capture failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if choice != "auto":
                raise ConfigError(f"graphs={choice!r}: {reason}; graphs='auto' falls back to eager decode") from e
            self.stats.graph_error = reason
            self.whole_step, self.verify_graph = False, None
            return None
        return runner

    # ---- requests ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise ConfigError(f"this {type(self).__name__} is closed (the model has its own attention back): make a "
                              "new one")

    def _check_model(self) -> None:
        """Before each step, what the model must still be for this engine's forwards (a replayed graph runs what it
        captured, not the model's Python): nothing to check for a plain callable."""

    def add_request(self, prompt: Sequence[int], params: SamplingParams = SamplingParams()) -> int:
        """Queue a request (it joins the next forward that has room); returns its id. A `params.seed` of None
        samples with the request id as its seed, so requests added with the same parameters draw different
        streams. `prompt`: token ids (see `prompt_ids`). ConfigError for a closed engine, a prompt that is not
        token ids or holds one outside the vocabulary, params that are not a SamplingParams; OutOfSlotsError when
        the pools can never hold it: in each case nothing was queued and the other requests are untouched."""
        self._check_open()
        if not isinstance(params, SamplingParams):
            raise ConfigError(f"params must be a SamplingParams, got {shown(params)}")
        return self._add(prompt_ids(prompt), params)

    def _add(self, ids: List[int], params: SamplingParams) -> int:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ConfigError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if params.seed is None:
            params = params.with_seed(self._next_rid)
        req = Request(self._next_rid, ids, params)
        self.scheduler.add(req)
        self.requests[req.rid] = req
        self._next_rid += 1
        return req.rid

    def abort(self, rid: int) -> Optional[Result]:
        """Stop request `rid` (its client went away), between steps. A queued one leaves the queue; a running one
        (prefilling or decoding) leaves as a finished request does (`_finish`: the K/V of its first kv_len tokens to
        the prefix cache or freed, its row and reservation back, once); a token a forward still in flight samples
        for it (overlap) is dropped when read back, as one sampled after a stop token is, never appended. Returns
        its Result with finish_reason "abort" and the output the host has read; None when it already finished (its
        Result came from `step`, or waits in `unclaimed`). Aborting a request of a running `generate` (from
        `on_step`) leaves it out of generate's list. ConfigError for an id this engine never gave, a closed engine,
        or a call from inside a step (the model, a drafter): nothing changed then."""
        self._check_open()
        if self._step_lock.locked():   # a step is running (from inside it, or another thread)
            raise ConfigError(f"abort({rid!r}) inside a step: abort runs between steps")
        if isinstance(rid, bool) or not isinstance(rid, (int, np.integer)) or not 0 <= rid < self._next_rid:
            given = f"ids run from 0 to {self._next_rid - 1}" if self._next_rid else "it has given none yet"
            raise ConfigError(f"abort: {shown(rid)} is not a request id of this engine ({given})")
        req = self.requests.get(int(rid))
        if req is None:
            return None
        if req.finish_reason is None:  # (one already finished whose hand-over a Ctrl-C kept from it keeps its reason)
            req.finish_reason = "abort"
        if req.row < 0:  # still queued: no row, reservation or slot yet
            self.scheduler.drop(req)
            del self.requests[req.rid]
            if self._prefixing is not None:
                self._prefixing.refused_at = None  # the queue's new head was never tried
            return Result(req.rid, req.prompt, req.output, req.finish_reason, seed=req.params.seed)
        if req not in self._finishing:
            self._finishing.append(req)  # listed until its hand-over is done: a Ctrl-C leaves it to the next step
        with torch.inference_mode():
            results = self._finish_pending()
        mine = [r for r in results if r.rid == req.rid]
        self._carry += [r for r in results if r.rid != req.rid]  # others a Ctrl-C had kept: with the next step
        return mine[0]

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: Union[SamplingParams, Sequence[SamplingParams]] = SamplingParams(),
                 on_step: Optional[Any] = None) -> List[Result]:
        """Run `prompts` to completion, in order. One SamplingParams serves every prompt with its own seed: prompt
        i samples with (params.seed or 0) + i, so equal prompts do not draw the same stream; a sequence gives
        each prompt its own (a None seed there is the prompt's index too). A prompt the cache can never hold
        gets its OutOfSlotsError in its Result and the others still run. `on_step(new_tokens)` is called after
        every forward with the tokens the host read back in that step (with overlap, mostly the previous
        forward's). Once the last prompt finished, what is still in flight is read (one wait): the statistics then
        count exactly the tokens the results hold. Requests queued with `add_request` that finish meanwhile keep
        their Result in `self.unclaimed`. A closed engine, a prompt that is not token ids (see `prompt_ids`),
        params that are not SamplingParams or an on_step that is not callable raise ConfigError before any prompt is
        queued, as does a call made while a step runs (from inside it, or another thread). A run that raises (the model,
        `on_step`, Ctrl-C) aborts the requests it queued that are still there (their ids never reached the caller)
        before the error propagates."""
        self._check_open()
        if self._step_lock.locked() or self._in_callback:
            raise ConfigError("generate() while a step or a generate() of this engine runs (called from inside it, by "
                              "a drafter or on_step, or from another thread): one at a time")
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray, torch.Tensor)):
            raise ConfigError(f"prompts must be a sequence of prompts, got {shown(prompts)}")
        all_ids = []
        for i, prompt in enumerate(prompts):
            try:
                all_ids.append(prompt_ids(prompt))
            except ConfigError as e:
                raise ConfigError(f"prompt {i}: {e}") from None
        if isinstance(params, SamplingParams):
            per = [params.with_seed(i) for i in range(len(prompts))]
        elif isinstance(params, Sequence) and not isinstance(params, (str, bytes)):
            for i, p in enumerate(params):
                if not isinstance(p, SamplingParams):
                    raise ConfigError(f"params[{i}] must be a SamplingParams, got {shown(p)}")
            per = [p if p.seed is not None else p.with_seed(i) for i, p in enumerate(params)]
        else:
            raise ConfigError(f"params must be a SamplingParams or one per prompt, got {shown(params)}")
        if len(per) != len(prompts):
            raise ConfigError(f"{len(per)} SamplingParams for {len(prompts)} prompts")
        if on_step is not None and not callable(on_step):
            raise ConfigError(f"on_step must be callable (the step's new tokens -> None) or None, got {shown(on_step)}")
        results: List[Optional[Result]] = [None] * len(prompts)
        index: Dict[int, int] = {}
        try:
            for i, (ids, p) in enumerate(zip(all_ids, per)):
                try:
                    index[self._add(ids, p)] = i
                except HwkvError as e:  # refused up front: reported in its own Result
                    results[i] = Result(-1, ids, error=e, seed=p.seed)
            while any(rid in self.requests for rid in index):
                before = self.stats.generated_tokens
                for res in self.step():
                    if res.rid in index:
                        results[index[res.rid]] = res
                    else:
                        self.unclaimed[res.rid] = res
                if on_step is not None:   # between steps, but inside this run: a step or generate from it is refused
                    self._in_callback = True
                    try:
                        on_step(self.stats.generated_tokens - before)
                    finally:
                        self._in_callback = False
            # what is still in flight when the last prompt finished (with overlap the forward issued before that
            # read-back: its tokens for finished requests are dropped; or a verify's free counts) is read now, the run's
            # one wait past its steps: the counters hold the results' tokens, the memory statistics are complete, and
            # nothing of this run is left to read (a request queued by add_request that finishes here goes to unclaimed)
            for res in self._read_back():
                self.unclaimed[res.rid] = res
        except BaseException:  # (the model, on_step, Ctrl-C) the caller never gets these ids: the requests this run
            for rid in index:  # queued leave, as aborted ones do, rather than run on holding rows and pages
                if rid in self.requests:
                    try:
                        self.abort(rid)
                    except Exception:  # noqa: BLE001 - the run's own error is the one to propagate
                        break
            self._carry = [r for r in self._carry if r.rid not in index]   # nor come back with a later step
            raise
        return [r for r in results if r is not None]

    # ---- one forward ---------------------------------------------------------------------------
    def step(self) -> List[Result]:
        """Admit, run one forward over the scheduled rows, sample, release; returns the requests that finished.

        With `overlap` (the default on accelerators) the forward's sampled tokens stay on the device as the next
        forward's inputs, and the host reads them during the next step: stop tokens and finished requests are
        seen one step late (a stopped request may run one more forward, whose token is dropped), so the host
        prepares step N+1 while the device runs step N. Without it the host reads them at the end of the step.

        A forward that raises (the model's own error, Ctrl-C) gives back the pages its step allocated before the
        error propagates (`_undo`): nothing leaks, and the next step runs the same rows again. A forward stays in
        flight until its tokens are read, so Ctrl-C in the wait for them loses none: the next step reads them. What
        runs between the two on the host (caching prompt pages, the out-of-window release) is not undone: if it
        raises, the forward's lengths still move on and the next step's caching and release catch up. A verify
        that raises before its drafts' slots are settled is undone whole (no output moved); Ctrl-C while they settle
        is raised once the verify has landed. Results of requests a verify finished (or read back) before it raised
        come with the next step."""
        self._check_open()
        if self._in_callback or not self._step_lock.acquire(blocking=False):
            raise ConfigError("step() while a step or a generate() of this engine runs (called from inside it, by a "
                              "drafter or on_step, or from another thread): one at a time")
        try:
            self._check_model()
            # inference mode, not no_grad: tensors made here skip version counting and view tracking (1.07x
            # tokens/s for the tiny model at batch 1 on the CPU); everything the engine keeps across steps was made
            # in it too
            carried, self._carry = self._carry, []
            try:
                with torch.inference_mode():
                    if self._finishing:
                        carried += self._finish_pending()
                    return carried + self._step() if carried else self._step()
            except BaseException:
                self._carry[:0] = carried
                raise
        finally:
            self._step_lock.release()

    def _step(self) -> List[Result]:
        t0 = time.perf_counter()
        admitted: List[Request] = []
        if self.scheduler.waiting:  # rows, sampling constants and prompt counts land with the admission (steps
            with interrupts_held() if self.scheduler.can_admit() else nullcontext():   # admitting nothing: no hold)
                if self._prefixing is None:
                    admitted = self.scheduler.admit()
                    for req, row in zip(admitted, self.slots.new_rows(len(admitted))):
                        req.row = row
                    self._admitted(admitted)
                else:  # each from its longest cached prefix (`req.reused` tokens); those admitted before a
                    try:  # `start` that raised run too
                        self.scheduler.admit(self._prefixing.start, admitted)
                    finally:
                        self._admitted(admitted)
        rows = self.scheduler.schedule()
        if not rows:  # nothing to run: what is still in flight finishes
            return self._read_back()
        self._pools_changed = bool(admitted)
        if self._release_owed:  # a release an error (Ctrl-C) cut short runs before this step allocates: admission
            self._release([r.row for r in self.scheduler.running if r.row >= 0],   # reserved on the pages it frees
                          [r.kv_len for r in self.scheduler.running if r.row >= 0])
        sampled = [r for r in rows if r.samples]
        k = self._draft_len(rows)
        verified = self._verify(rows, k) if k else None   # (its tokens were counted as they joined the outputs)
        if verified is not None:
            finished, mode = verified[0], ForwardMode.TARGET_VERIFY
        else:
            mode = self._forward_step(rows, sampled)
            # the earlier steps' tokens (with overlap: while this one runs; without, this one's too), counted as read
            finished = self._read_back(keep=1 if self.overlap else 0)
        try:
            self.stats.record_step(mode, self.scheduler.prefill_tokens, time.perf_counter() - t0)
        except BaseException:  # the Results it finished come with the next step
            self._carry += finished
            raise
        return finished

    def _forward_step(self, rows: List[Row], sampled: List[Row]) -> ForwardMode:
        """A plain step's forward (the whole-step graph's replay, or allocation and the layers), its release and
        prompt caching, and its send-back; returns its mode. Its tokens are read by a later `_read_back`."""
        if self._prefixing is not None:
            self._prefixing.make_room(rows)
        if self.whole_step and self.scheduler.decoding == len(rows):  # every row decodes
            mode, where, tokens = ForwardMode.DECODE, *self._decode_whole(rows)
            try:
                self._send(rows, sampled, where, mode, tokens)
            except BaseException:  # the replay ran: as the eager path's handler
                self._resend(rows, sampled, where, mode, tokens)
                raise
        else:
            head, batch = self.cache.allocator.pages.head, None
            try:  # a forward that raises (the model, Ctrl-C) gives back what it allocated: the step can run again
                lens, batch, ids, pos = self._allocate(rows)
                # the request rows of the tokens sampled (every row's, or those `_keep` sent with the forward's copy)
                where = batch.req_pool_indices if lens.where_dev is None else lens.where_dev
                tokens = self._forward(batch, ids, pos, lens.keep_dev, where)
            except BaseException:
                self._undo(rows, None if batch is None else batch.out_cache_loc, head)
                raise
            mode = batch.forward_mode
            self._release_owed = True   # (cleared once the release below returns)
            try:
                if self._prefixing is None:
                    self._release(lens.rows, lens.seq, batch.req_pool_indices, batch.seq_lens)
                else:
                    # a prompt chunk's caching and its lock land together (no later step locks a last chunk's nodes):
                    # Ctrl-C held on prefill steps, and the lock taken even when the release between them raised
                    with interrupts_held() if self.scheduler.prefill_tokens else nullcontext():
                        self._prefixing.cache_prompts(rows, lock=False)  # with the chunk's SWA the release drops
                        try:
                            self._release(lens.rows, lens.seq, batch.req_pool_indices, batch.seq_lens)
                        finally:
                            self._prefixing.cache_prompts(rows, lock=True)
                self._send(rows, sampled, where, mode, tokens)
            except BaseException:  # (Ctrl-C) the forward ran: its lengths move on all the same, or the next step
                self._resend(rows, sampled, where, mode, tokens)  # would allocate its positions again (a leak);
                raise  # what was not cached or released is caught up by the next step's caching and release
        return mode

    def has_work(self) -> bool:
        """Whether requests wait or run, or a forward's tokens are still to be read back."""
        return self.scheduler.has_work() or bool(self.readback.inflight) or bool(self._carry) or bool(self._finishing)

    def tokens_of(self, row: int) -> List[int]:
        """The token ids of the running request in request row `row`: its prompt and the outputs the host has read
        (every token before the forward in flight, overlap or not), for checks that recompute a forward from token
        ids. ConfigError when no running request holds the row."""
        for req in self.scheduler.running:
            if req.row == row:
                return req.prompt + req.output
        raise ConfigError(f"no running request holds row {row}")

    def _send(self, rows: List[Row], sampled: List[Row], where: torch.Tensor, mode: ForwardMode,
              tokens: torch.Tensor) -> None:
        """After a forward is issued: the sampled tokens into `next_ids` (device; `where`: the sampling rows' request
        rows there) and on their way to the host (`ReadBack.send`: one async copy, with the allocator's free counts
        when pages moved), then the lengths forward: the device work that can fail first, and the host counts
        only once its record is listed, so a step whose `_send` raised sends once more (`_resend`)."""
        if sampled:
            self.next_ids[where] = tokens
        with interrupts_held():  # the record listed and the counts moved together (`_resend` keys on the record)
            # slots are taken and given back only by allocator calls: where none ran, the counts are as before
            self.readback.send(sampled, tokens, mode, self._held() if self._pools_changed else None)
            if sampled and self.scheduler.non_greedy:   # the draws counted with the tokens they drew: a step undone
                self.sampling.advance(where)            # before this point reruns them as drawn

            for r in rows:
                r.req.kv_len += r.n
            for r in sampled:
                r.req.pending += 1

    def _resend(self, rows: List[Row], sampled: List[Row], where: torch.Tensor, mode: ForwardMode,
                tokens: torch.Tensor) -> None:
        """In a step's handler, after its forward ran: `_send` once more where the last record in flight is not
        this forward's (`sampled`: its rows, one list a forward)."""
        if not (self.readback.inflight and self.readback.inflight[-1].sampled is sampled):
            self._send(rows, sampled, where, mode, tokens)

    def _admitted(self, admitted: List[Request]) -> None:
        """Admitted requests' prompts counted and their rows' sampling constants written."""
        if admitted:
            for req in admitted:
                self.stats.record_prompt(len(req.prompt), req.reused)
            self.sampling.admit([r.row for r in admitted], [r.params for r in admitted])

    def _held(self) -> Held:
        """The allocator's free counts now (the rings' tails, on the device, and host heads) with the slots only
        the prefix cache holds now: `_record_held` turns them into the memory statistics when read back."""
        tails, heads = self.cache.free_counts_async()
        return tails, heads, self._prefixing.evictable() if self._prefixing is not None else (0, 0)

    def _read_back(self, keep: int = 0) -> List[Result]:
        """The sampled tokens of the forwards in flight but the last `keep` (each one's wait for the device):
        appended, stops checked, finished requests free their slots and rows at once. A forward leaves the list
        only once its tokens are read, so an interrupted wait (Ctrl-C) loses none: the next step reads it."""
        finished: List[Result] = []
        try:
            while len(self.readback.inflight) > keep:
                finished += self._read_one()
        except BaseException:  # (Ctrl-C in a later wait) the requests the earlier reads finished: the next step's
            self._carry += finished
            raise
        return finished

    def _read_one(self) -> List[Result]:
        """The oldest forward's tokens appended (stops checked) and its statistics recorded; it leaves the list once
        they are, and an interrupted read goes on from the row it reached (`Inflight.done`), so none is lost."""
        rec, values = self.readback.read_oldest()
        n = len(rec.sampled)
        if rec.done < 0:
            if rec.heads is not None:
                self._record_held(values[n:], rec.heads, rec.cached)
            rec.done = 0
        i, dropped = rec.done, 0
        with interrupts_held():  # each row's token, finish and count land together (a Ctrl-C raised after)
            try:
                for r, tok in zip(rec.sampled[i:] if i else rec.sampled, values[i:n] if i else values):
                    req = r.req
                    if req.finish_reason is not None:  # sampled after its stop token (overlap): dropped, not counted
                        dropped += 1
                    elif req.add_token(tok):
                        self._finishing.append(req)
                    i += 1
                    req.pending -= 1
            finally:  # (a read an error cut short goes on from here)
                rec.done, rec.dropped = i, rec.dropped + dropped
            self.stats.record_tokens(rec.mode, n - rec.dropped, rec.dropped)  # counted as read: what outputs hold
            self.readback.inflight.pop(0)
        return self._finish_pending() if self._finishing else []

    def _finish_pending(self) -> List[Result]:
        """The hand-over of the requests whose last token was read (`_finish`), with Ctrl-C held; they stay listed
        until it is done, so a request a Ctrl-C (as tokens were read) or a hand-over refused before it changed
        anything kept from it is finished by the next step, not left running for ever. Only steps where a request
        finishes pay the hold. A Ctrl-C held through it is raised after it, the results then coming with the next
        step (`_carry`)."""
        results: List[Result] = []
        try:
            with interrupts_held():
                results = self._finish([r for r in self._finishing if r.rid in self.requests])  # (not aborted since)
                self._finishing = []
        except BaseException:  # a Ctrl-C held through it is raised here: the requests left, their results come with
            self._carry += results  # the next step
            raise
        return results

    def _record_held(self, tails: Sequence[int], heads: Sequence[int], cached: Tuple[int, int]) -> None:
        """The memory peaks from the rings' tails (read back) and heads: what the pools hold less what only the
        prefix cache held then."""
        full, swa = self.cache.held_from(tails, heads)
        self.stats.record_memory((full - cached[0], swa - cached[1]))

    def _finish(self, done: List[Request]) -> List[Result]:
        """Finished requests leave: their KV to the prefix cache (or freed), their rows and reservations back."""
        if done:
            if self._prefixing is not None:
                self._prefixing.release(done)
            self.slots.free([r.row for r in done], None if self.prefix is not None else [r.kv_len for r in done])
            for r in done:
                self.scheduler.finish(r)
                del self.requests[r.rid]
        return [Result(r.rid, r.prompt, r.output, r.finish_reason, seed=r.params.seed) for r in done]

    # ---- speculative verify --------------------------------------------------------------------
    def _draft_len(self, rows: List[Row]) -> int:
        """Draft tokens per request this step (0: a plain step): only when every row decodes greedily, within
        each request's reservation (k <= max_new_tokens - sampled - 1, so the drafts' K/V fits what admission
        reserved) and the forward's token budget (batch x (k + 1) <= chunk)."""
        if self.draft is None or not rows:
            return 0
        k = min(self.num_draft, self.cache.plan.chunk // len(rows) - 1)
        for r in rows:
            req = r.req
            if r.n != 1 or req.prefilling or not req.params.greedy or req.pending:
                return 0
            k = min(k, req.params.max_new_tokens - len(req.output) - 1)
        return max(k, 0)

    def _verify(self, rows: List[Row], k: int) -> Optional[Tuple[List[Result], int]]:
        """One verify forward: each request's last token and k drafts at its next k + 1 positions (one
        allocation, one forward with every token's logits), then the longest draft prefix greedy decoding
        agrees with plus the model's next token are kept, the rest of the drafts' slots freed
        (`accept_draft_tokens`) before the out-of-window release, which runs on the accepted lengths. A stop
        token or max_new_tokens inside the accepted run ends the request there. Returns the finished requests
        and the tokens added; None: the pools have no room for the drafts, not even once the prefix cache evicts
        (checked before the drafter runs), or no drafter proposed anything (the step runs as a plain decode).
        The drafter gets each request's `TokenHistory` (made once per request, grown by its outputs) and what it
        returns is checked (`draft_ids`: ConfigError before anything changed)."""
        drafts = self._propose(rows, k)
        if drafts is None:
            return None
        bs = len(rows)
        ids = [t for r, d in zip(rows, drafts) for t in [r.req.output[-1]] + d]
        graph = self.verify_graph
        head, batch, earlier, settled, finished = self.cache.allocator.pages.head, None, [], False, []
        handing = False
        try:  # as a plain step's forward: one that raises gives back what it allocated
            if graph is not None and k == graph.drafts and bs <= graph.buckets[-1]:  # one replay: slots, metadata,
                logits, rows_dev = self.slots.replay_verify(graph, [r.req.row for r in rows],  # layers
                                                            [r.prefix for r in rows], ids)
            else:
                _, batch, ids_dev, pos_dev = self._allocate([Row(r.req, r.prefix, k + 1, True) for r in rows], ids)
                self.cache.backend.init_forward_metadata(batch)
                logits, rows_dev = self._logits(batch, ids_dev, pos_dev, 0), batch.req_pool_indices
            pred = logits.argmax(dim=-1).view(bs, k + 1).tolist()  # the one wait
            earlier = self._read_back()  # the previous verify's free counts, copied before that wait: no wait
            self._pools_changed = True
            taken, accepted, kept, dev = self._acceptance(rows, k, drafts, pred)
            with interrupts_held():  # from here the verify lands whole, its finished requests too: a Ctrl-C is
                seq = self._keep_drafts(rows, k, rows_dev, accepted, dev)   # raised once it has
                settled = True
                used_all = self._commit(rows, k, taken, accepted, kept, rows_dev, dev[2], seq)
                handing = True  # from here a failure is the hand-over's: `_finish_pending` keeps its own results
                finished = self._finish_pending()
        except BaseException:
            if not settled:  # (before `accept_draft_tokens`, or refused by it before it changed anything)
                self._undo(rows, None if batch is None else batch.out_cache_loc, head, k + 1)
            # the results of requests the read-back or the verify finished come with the next step
            self._carry += earlier + finished
            if settled and not handing and self._finishing:  # a release that raised: they finish all the same
                self._carry += self._finish_pending()
            raise
        return earlier + finished, used_all

    def _propose(self, rows: List[Row], k: int) -> Optional[List[List[int]]]:
        """Each row's k drafts (short proposals padded with its last token), once the pools have room for them
        (evicting cached K/V where they need it); None: no room, or no drafter proposed anything."""
        pages = self.scheduler.new_pages([r.prefix for r in rows], k + 1)  # each row's last token and k drafts
        if not self.cache.allocator.has_room(pages) and not (self._prefixing is not None
                                                           and self._prefixing.can_make_room_for(pages)):
            return None
        drafts, found = [], False
        for r in rows:
            req = r.req
            if req.history is None:
                req.history = TokenHistory(req.prompt, req.output)
            d = draft_ids(self.draft(req.history, k), k, self.vocab_size)
            found = found or bool(d)
            drafts.append(d + [req.output[-1]] * (k - len(d)))  # padding: checked like any draft
        if not found:
            return None
        if self._prefixing is not None:  # as a plain step: cached K/V evicted where the drafts' pages need it
            self._prefixing.make_room_for(pages)
        return drafts

    def _acceptance(self, rows: List[Row], k: int, drafts: List[List[int]], pred: List[List[int]]
                    ) -> Tuple[List[List[int]], List[int], int, Tuple[torch.Tensor, ...]]:
        """Each row's tokens to keep: its longest draft prefix greedy decoding agrees with and the model's next token,
        up to a stop or max_new_tokens (nothing appended yet); their counts less one (the K/V kept past the last
        token); the drafts among them (all of them where a stop or max_new_tokens ends the run inside the drafts); and
        on the device, in one copy, the drafts' start (after the last token), those counts and each row's last
        token."""
        taken, accepted, kept = [], [], 0
        for r, d, pr in zip(rows, drafts, pred):
            a = 0
            while a < k and d[a] == pr[a]:
                a += 1
            toks = r.req.tokens_to_finish(d[:a] + [pr[a]])
            taken.append(toks)
            accepted.append(len(toks) - 1)
            kept += min(a, len(toks))
        (host,), (dev,) = pack([(len(rows), [[r.prefix + 1 for r in rows], accepted, [t[-1] for t in taken]])],
                               self.device)
        return taken, accepted, kept, (*dev, host[0], host[1])

    def _keep_drafts(self, rows: List[Row], k: int, rows_dev: torch.Tensor, accepted: List[int],
                     dev: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The accepted drafts' slots kept at their positions, the rest freed (`accept_draft_tokens`); returns the
        new lengths on the device."""
        pre_dev, acc_dev, _, pre, acc = dev
        c, bs = self.cache, len(rows)
        index = torch.arange(k, dtype=I64, device=self.device).expand(bs, k).contiguous()
        return accept_draft_tokens(c.allocator, c.pool, c.rtt.req_to_token, rows_dev, pre_dev, index, acc_dev,
                                   prefix_lens_cpu=pre, accept_lens_cpu=acc, chain=True)

    def _commit(self, rows: List[Row], k: int, taken: List[List[int]], accepted: List[int], kept: int,
                rows_dev: torch.Tensor, last_dev: torch.Tensor, seq: torch.Tensor) -> int:
        """A verify whose drafts are settled: the kept tokens (`kept` of them drafts) into the outputs (counted),
        lengths and next ids moved, then the out-of-window release on the accepted lengths; returns the tokens added.
        The requests they finished are listed for hand-over (`_finishing`) with their last token, so a release that
        raises still finishes them."""
        used_all = 0
        for r, toks, a in zip(rows, taken, accepted):
            for t in toks:
                if r.req.add_token(t):
                    self._finishing.append(r.req)
            r.req.kv_len = r.prefix + 1 + a
            used_all += len(toks)
        self.next_ids[rows_dev] = last_dev
        self.stats.record_drafts(len(rows), len(rows) * k, kept)
        self.stats.record_tokens(ForwardMode.TARGET_VERIFY, used_all)  # read already: a verify waits for them
        self._release_owed = True
        self._release([r.req.row for r in rows], [r.prefix + 1 + a for r, a in zip(rows, accepted)], rows_dev, seq)
        # the free counts after the release travel to the host without a wait: read with the next step's tokens
        # (or the next verify's, or at the end of `generate`)
        self.readback.send([], None, ForwardMode.TARGET_VERIFY, self._held())
        return used_all

    def clear_prefix_cache(self) -> int:
        """Evict everything the prefix cache holds; returns the full-pool tokens evicted. Call it after the model's
        weights change: the cached K/V are the old weights'. Between steps with no request running (as SGLang's
        flush): a running request's prompt is locked in the cache and would be cached again when it finishes, so
        later requests would reuse the old weights' K/V. A ConfigError otherwise (or from inside a step), nothing
        evicted."""
        if self._step_lock.locked():   # a step is running (from inside it, or another thread)
            raise ConfigError("clear_prefix_cache() inside a step: it runs between steps")
        if self._prefixing is not None and self.scheduler.running:
            raise ConfigError(f"clear_prefix_cache() while {len(self.scheduler.running)} request(s) run: their K/V "
                              "(the weights' of their prefill) stay locked in the cache and are cached again when "
                              "they finish; let them finish (or abort them) first, nothing was evicted")
        if self._prefixing is None:
            return 0
        with torch.inference_mode():
            return self._prefixing.clear()

    # ---- the forward's inputs ------------------------------------------------------------------
    def _allocate(self, rows: List[Row], ids: Optional[List[int]] = None
                  ) -> "tuple[StepLens, ForwardBatch, torch.Tensor, torch.Tensor]":
        """The forward's slots (`ForwardSlots`: one host copy, one allocator call, one req_to_token scatter), its
        ForwardBatch, token ids and positions on the device. `rows`: the last `Scheduler.schedule`'s (decoding rows
        first), or with `ids`, the forward's token ids from the host (a verify's, every token's logits wanted),
        instead of the rows' own; a decoding request's own is its last sampled token, on the device. Where only
        some tokens' logits are wanted, their indices and request rows ride in the same copy (`StepLens.keep_dev`,
        `where_dev`)."""
        row_list, prefix = [r.req.row for r in rows], [r.prefix for r in rows]
        decoding = self.scheduler.decoding
        chunks = rows[decoding:]  # prompt chunks
        keep = self._keep(rows, row_list) if ids is None else None
        if ids is None and all(r.n == 1 and r.prefix > 0 for r in chunks):  # a decode step, one token each
            # a prompt's last token rides along: its id comes from the host, in the same copy
            mixed = bool(chunks)
            lens = self.slots.plan_decode(row_list, prefix, [-1] * decoding + [
                r.req.next_tokens(1)[0] for r in chunks] if mixed else None, keep)
            if self.scheduler.new_pages(prefix, 1):  # a page moves (else every token continues its page)
                self._pools_changed = True
        else:
            mode = ForwardMode.MIXED if any(not r.req.prefilling for r in rows) else ForwardMode.EXTEND
            mixed = ids is None and mode == ForwardMode.MIXED
            if ids is None:  # decoding rows (first, one token each) feed -1, prompt chunks slices of their prompt
                ids = np.concatenate([np.full(decoding, -1, dtype=np.int64)] + [r.req.next_ids(r.n) for r in chunks])
            lens = self.slots.plan_extend(mode, row_list, prefix, [r.n for r in rows], ids, keep)
            self._pools_changed = True
        batch = self.slots.allocate(lens)
        if lens.ids_dev is None:  # every token is a decoding request's last sampled one
            ids_dev = self.next_ids[lens.rows_dev]
        elif mixed:  # decoding requests (-1 in the host ids) feed their last sampled token
            ids_dev = torch.where(lens.ids_dev < 0, self.next_ids[lens.row_of_dev], lens.ids_dev)
        else:
            ids_dev = lens.ids_dev
        return lens, batch, ids_dev, lens.pos_dev

    def _keep(self, rows: List[Row], row_list: List[int]) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """The tokens whose logits this forward wants, as (indices in the forward, their request rows): the last
        token of each row that samples (a prompt chunk before its last does not). None where that is every token
        (a decode step: each row samples its one token)."""
        if self.scheduler.decoding == len(rows):
            return None
        n = np.array([r.n for r in rows], dtype=np.int64)
        samples = np.array([r.samples for r in rows], dtype=bool)
        keep = (np.cumsum(n) - 1)[samples]
        if len(keep) == n.sum():
            return None
        return keep, np.asarray(row_list, dtype=np.int64)[samples]

    def _forward(self, batch: ForwardBatch, ids: torch.Tensor, pos: torch.Tensor, keep_dev: Optional[torch.Tensor],
                 where: torch.Tensor) -> torch.Tensor:
        """Metadata once, the model over the packed tokens (a graph replay of the layers for decode), the next
        tokens. `keep_dev`: the tokens whose logits are wanted (None: every token's); `where`: their request rows
        (device)."""
        if batch.forward_mode == ForwardMode.DECODE and self.graph is not None and not self.whole_step:
            logits = self.graph.run(batch, {"input_ids": ids, "positions": pos})
            self.stats.graph_replays = self.graph.replays
            if keep_dev is not None:  # a prompt's next-to-last chunk of one token rode along: no sample there
                logits = logits.index_select(0, keep_dev)
        else:
            self.cache.backend.init_forward_metadata(batch)
            logits = self._logits(batch, ids, pos, 0 if keep_dev is None else keep_dev)
        return self._sample(where, logits)

    def _logits(self, batch: ForwardBatch, ids: torch.Tensor, pos: torch.Tensor, keep: Any) -> torch.Tensor:
        """`model_step`'s logits, checked to be [kept tokens, V <= vocab_size] (an HF model ignoring a tensor
        `logits_to_keep` returns every token's): a ShapeError the caller's undo turns into a step that never ran.
        Every path calls the model through here, the graphs' functions too: so at capture where a device graph fixes
        the shapes (the engine is refused), and in a step graph before its out-of-window release where that follows
        the layers (where the device's page ops release first, the slots it freed stay free: no query of the step
        or its rerun sees them, and the undo syncs the frontiers). Shapes only: no device read."""
        logits = self.model_step(batch, ids, pos, keep)
        rows = ids.shape[0] if isinstance(keep, int) else keep.shape[0]
        if not isinstance(logits, torch.Tensor):
            raise ShapeError(f"model_step returned {shown(logits)}, expected a logits tensor [{rows}, V] (the step is "
                             "undone)")
        if logits.dim() != 2 or logits.shape[0] != rows or not 1 <= logits.shape[1] <= self.vocab_size:
            raise ShapeError(f"model_step returned logits of shape {list(logits.shape)}, expected [{rows}, V] with "
                             f"V <= vocab_size {self.vocab_size} and V >= 1 (one row per kept token; the step is "
                             f"undone, a graph capture refused)")
        return logits

    def _sample(self, where: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """The next token of each sampling row from its logits, `where` its request rows on the device (argmax when
        every running request is greedy): the constants are the rows' own (`RowSampling`), gathered on the device."""
        if not self.scheduler.non_greedy:  # argmax only: no sampling tensors
            return logits.argmax(dim=-1)
        return self.sampling.sample(logits, where)

    def _decode_step(self, batch: ForwardBatch, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The graph runner's step: the model over the static decode inputs (every token's logits)."""
        return self._logits(batch, inputs["input_ids"], inputs["positions"], 0)

    def _whole_step_model(self, batch: ForwardBatch, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The whole-step graph's model: each row's last sampled token at position length - 1, both read on the
        device inside the graph (the host sends nothing but the rows and lengths)."""
        return self._logits(batch, self.next_ids[batch.req_pool_indices], batch.seq_lens - 1, 0)

    def _verify_model(self, batch: ForwardBatch, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The verify graph's model: the host's token ids, each at its position (length - distance to the end),
        computed on the device inside the graph; every token's logits."""
        pos = (batch.seq_lens.unsqueeze(1) - self._draft_back).view(-1)
        return self._logits(batch, inputs["input_ids"], pos, 0)

    def _decode_whole(self, rows: List[Row]) -> "tuple[torch.Tensor, torch.Tensor]":
        """A decode step as one graph replay: the rows and lengths after it go to the device in one copy (the
        allocation, req_to_token write, metadata, layers and out-of-window release run inside); returns the
        request rows on the device (the graph's) and the sampled tokens. OutOfSlotsError before anything ran."""
        prefix, row_ids, head = [r.prefix for r in rows], [r.req.row for r in rows], self.cache.allocator.pages.head
        try:
            logits, released = self.slots.replay_decode(self.graph, row_ids, prefix)
            where = self.graph.req_pool_indices[:len(rows)]
            tokens = self._sample(where, logits)
            # a page moved (else every token continued its page), or the graph released what the host rule says
            if released or self.scheduler.new_pages(prefix, 1):  # moved (inside the try: from its end to the
                self._pools_changed = True                       # caller's send-back nothing is called)
        except BaseException:  # given back where the replay allocated: a recorded device graph runs no Python,
            # so what raises after its allocation is an eager adapter's replay (or a batch past the buckets)
            self._undo(rows, None, head)
            if self.window is not None:  # where the replay released before its layers, it moved the frontiers
                self.slots.sync_frontiers(row_ids)
            raise
        self.stats.graph_replays = self.graph.replays
        return where, tokens

    def _undo(self, rows: List[Row], loc: Optional[torch.Tensor], head: int, new: Optional[int] = None) -> None:
        """A forward over `rows` (`new` tokens each, else each row's own) raised after its allocation: the pages it
        opened go back and the requests stay where they were (`ForwardSlots.undo`; `loc` the allocation's slots,
        None: read where the allocation wrote them, if the full ring's host head moved from `head`). The requests'
        lengths, outputs and frontiers moved only after the forward, so the next step runs the same rows again.
        What follows a forward that returned (caching prompt pages, the release, sampling's bookkeeping) is not
        undone: it runs on the engine's own checked state."""
        self.slots.undo([r.req.row for r in rows], [r.prefix for r in rows],
                        [r.n if new is None else new for r in rows], loc, head)

    def _release(self, rows: List[int], seq_lens: List[int], rows_dev: Optional[torch.Tensor] = None,
                 seq_dev: Optional[torch.Tensor] = None) -> None:
        """The forward's out-of-window release (`ForwardSlots.release`: in the steps where some request's frontier
        moves) over its rows and lengths, host and device (a verify's: the accepted lengths). Owed from the forward
        on until it returns: where it did not, the next step runs one over the running requests first (`_step`)."""
        if self.slots.release(rows, seq_lens, rows_dev, seq_dev):
            self._pools_changed = True
        self._release_owed = False

    def check_integrity(self) -> None:
        """Allocator, pools, request rows, reservations and the prefix cache are consistent, and every page the
        allocator holds has its holders (tests call it)."""
        self.cache.check_integrity()
        if self.prefix is not None:
            self.prefix.check_integrity()
        # every row but the padding row is a running request's or free
        self.scheduler.check_integrity(self.cache.rtt.size - 1 - self.cache.rtt.available_size())
        check_holders(self.cache, self.scheduler.running, self.slots.frontiers_cpu, self.prefix)

