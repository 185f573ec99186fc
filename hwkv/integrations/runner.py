"""HybridRunner: a Hugging Face causal LM generating through hwkv's hybrid cache, continuously batched.

One step is one forward: the scheduler picks the rows (every decoding request,
then prompt chunks), the allocator serves the whole batch in one call (a decode step whose tokens all
continue their pages moves no page: each slot follows its predecessor's) and req_to_token gets one scatter,
the backend's metadata step runs once, the model runs with every request packed into one row (B=1,
position_ids per token, `use_cache=False`: attention is the only place tokens meet, and hwkv does it per
request), one out-of-window release for the batch (in the steps where some request's frontier moves), the
sampled tokens back to the host (the step's one wait for the device), and one free for the requests that
finished. Host work is a constant number of torch calls per step, none per request; a layer only stores
and attends. Decode-only forwards replay graphs where the device has them (`graphs=`). The model's attention
implementation is "hwkv" while the runner is open; `close()` restores it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from hwkv.allocator import release_out_of_window_batch
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.errors import ConfigError, HwkvError
from hwkv.integrations.device_choice import graph_adapter, graph_choice, resolve_spec
from hwkv.integrations.hf_attention import ForwardContext, LayerTable, register
from hwkv.integrations.hf_model import Cache, build_cache, model_shape, plan_pools
from hwkv.integrations.sampling import SamplingParams, params_tensors, sample
from hwkv.integrations.scheduler import Request, Row, Scheduler, split_rows
from hwkv.integrations.stats import RunnerStats

I64 = torch.int64
GraphsOption = Union[bool, str]


@dataclass
class Result:
    """A finished (or refused) request: its output token ids, why it stopped, or the typed error."""

    rid: int
    prompt: List[int]
    tokens: List[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    error: Optional[HwkvError] = None
    seed: Optional[int] = None  # the sampling seed it ran with (as given, or derived for it)


class HybridRunner:
    """Continuous batching over one model: `add_request` any time, `step` runs one forward, `generate` runs all."""

    def __init__(self, model: Any, *, device: Optional[str] = None, memory: Union[None, int, str] = None,
                 context: Optional[int] = None, max_running: int = 16, chunk: int = 512, page_size: int = 16,
                 graphs: GraphsOption = "auto", graph_batch_sizes: Optional[Sequence[int]] = None) -> None:
        self.model = model
        dev = next(model.parameters()).device
        self.spec = resolve_spec(device, dev.type)
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if context is None:
            context = min(int(getattr(cfg, "max_position_embeddings", 4096) or 4096), 4096)
        self.shape = model_shape(model.config, model.dtype)
        pool_plan = plan_pools(self.shape, context=context, max_running=max_running, chunk=chunk,
                               page_size=page_size, memory=memory, device=dev)
        self.cache: Cache = build_cache(self.shape, pool_plan, model.dtype, dev, backend_device=self.spec)
        self.device = dev
        self.window = self.shape.window if self.shape.swa_layer_ids else None
        self.table = LayerTable(self.shape.layer_is_swa, self.shape.window, self.shape)
        self.scheduler = Scheduler(pool_plan, self.window)
        self.frontiers = torch.zeros(pool_plan.max_running, dtype=I64, device=dev)  # per request row
        # the host's copy of each row's frontier, moved by the release rule: steps where no frontier moves
        # (most of them: a request's frontier moves one page every page_size tokens) skip the release call
        self._host_frontiers: List[int] = [0] * pool_plan.max_running
        self._pools_changed = False  # this step moved a page (the KV held may have changed)
        self.stats = RunnerStats(self.shape, pool_plan)
        self.requests: Dict[int, Request] = {}
        self.unclaimed: Dict[int, Result] = {}  # finished inside generate(), queued by add_request: pop them
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self._next_rid = 0
        self._previous_attn = model.config._attn_implementation
        self.closed = False
        model.set_attn_implementation(register())
        self.graph = None
        try:
            self.graph = self._graph_runner(graph_choice(graphs), graph_batch_sizes)
        except BaseException:
            self.close()
            raise

    # ---- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """Give the model its previous attention implementation back."""
        if not self.closed:
            self.model.set_attn_implementation(self._previous_attn)
            self.closed = True

    def __enter__(self) -> "HybridRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _graph_runner(self, choice: str, batch_sizes: Optional[Sequence[int]]) -> Any:
        """A GraphRunner for decode forwards, captured now; None when graphs are off (see `graph_adapter`).

        The model's own code must be capturable too. With "auto" a capture that fails leaves decode eager and
        the reason in `stats.graph_error` (e.g. fp32 grouped_mm MoE experts copy through the host on CUDA);
        with "on" it raises ConfigError."""
        adapter = graph_adapter(self.spec, choice)
        if adapter is None:
            return None
        from hwkv.graph import GraphRunner

        top = self.cache.plan.max_running
        buckets = sorted({b for b in (batch_sizes or [1 << i for i in range(12)]) if b <= top} | {top})
        shapes = {"input_ids": ((), I64), "positions": ((), I64)}
        runner = GraphRunner(self.cache.backend, self._decode_step, buckets, shapes, adapter, ForwardMode.DECODE)
        try:
            with torch.no_grad():
                runner.capture()
        except HwkvError:
            raise
        except Exception as e:  # the model's code refused capture: reported, never silent
            reason = f"decode graph capture failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if choice != "auto":
                raise ConfigError(f"graphs={choice!r}: {reason}; graphs='auto' falls back to eager decode") from e
            self.stats.graph_error = reason
            return None
        return runner

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int], params: SamplingParams = SamplingParams()) -> int:
        """Queue a request (it joins the next forward that has room); returns its id. A `params.seed` of None
        samples with the request id as its seed, so requests added with the same parameters draw different
        streams. OutOfSlotsError when the pools can never hold it: nothing was queued and the other requests
        are untouched."""
        ids = [int(t) for t in prompt]
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

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: Union[SamplingParams, Sequence[SamplingParams]] = SamplingParams(),
                 on_step: Optional[Any] = None) -> List[Result]:
        """Run `prompts` to completion, in order. One SamplingParams serves every prompt with its own seed: prompt
        i samples with (params.seed or 0) + i, so equal prompts do not draw the same stream; a sequence gives
        each prompt its own (a None seed there is the prompt's index too). A prompt the cache can never hold
        gets its OutOfSlotsError in its Result and the others still run. `on_step(new_tokens)` is called after
        every forward. Requests queued with `add_request` that finish meanwhile keep their Result in
        `self.unclaimed`."""
        if isinstance(params, SamplingParams):
            per = [params.with_seed(i) for i in range(len(prompts))]
        else:
            per = [p if p.seed is not None else p.with_seed(i) for i, p in enumerate(params)]
        if len(per) != len(prompts):
            raise ConfigError(f"{len(per)} SamplingParams for {len(prompts)} prompts")
        results: List[Optional[Result]] = [None] * len(prompts)
        index: Dict[int, int] = {}
        for i, (prompt, p) in enumerate(zip(prompts, per)):
            try:
                index[self.add_request(prompt, p)] = i
            except HwkvError as e:  # refused up front: reported in its own Result
                results[i] = Result(-1, list(prompt), error=e, seed=p.seed)
        while any(rid in self.requests for rid in index):
            before = self.stats.generated_tokens
            for res in self.step():
                if res.rid in index:
                    results[index[res.rid]] = res
                else:
                    self.unclaimed[res.rid] = res
            if on_step is not None:
                on_step(self.stats.generated_tokens - before)
        return [r for r in results if r is not None]

    # ---- one forward ---------------------------------------------------------------------------
    def step(self) -> List[Result]:
        """Admit, run one forward over the scheduled rows, sample, release; returns the requests that finished."""
        if self.closed:
            raise ConfigError("this HybridRunner is closed (the model has its own attention back): make a new one")
        t0 = time.perf_counter()
        admitted = self.scheduler.admit()
        if admitted:
            new_rows = self.cache.rtt.alloc(len(admitted))
            for req, row in zip(admitted, new_rows):
                req.row = row
                self._host_frontiers[row] = 0
            self.frontiers[torch.tensor(new_rows, dtype=I64).to(self.device)] = 0
        rows = self.scheduler.schedule()
        if not rows:
            return []
        self._pools_changed = bool(admitted)
        with torch.no_grad():
            batch, ids, pos = self._allocate(rows)
            tokens = self._forward(rows, batch, ids, pos)
            self._release(batch, rows)
        new = tokens.tolist()  # the sampled tokens: the step's one wait for the device
        if self._pools_changed:  # slots are taken and given back only by allocator calls: else the same as before
            self.stats.record_memory(self.cache.held_slots())  # two scalar reads, after that wait
        prefill = sum(r.n for r in rows if r.prefix < len(r.req.prompt))
        finished = self._complete(rows, new)
        self.stats.record_step(batch.forward_mode, prefill, len(new), time.perf_counter() - t0)
        return finished

    def _allocate(self, rows: List[Row]) -> "tuple[ForwardBatch, torch.Tensor, torch.Tensor]":
        """Slots for every new token in one allocator call, req_to_token in one scatter, the ForwardBatch."""
        if all(r.n == 1 and r.prefix > 0 for r in rows):
            return self._allocate_decode(rows)
        ids, pos, row_of = split_rows(rows)
        bs, t = len(rows), len(ids)
        # per request (row, prefix, seq, new tokens, prefix - 1) and per token (id, position, row): one host
        # tensor, one copy to the device
        both = torch.tensor([r.req.row for r in rows] + [r.prefix for r in rows] + [r.prefix + r.n for r in rows]
                            + [r.n for r in rows] + [max(r.prefix - 1, 0) for r in rows] + ids + pos + row_of,
                            dtype=I64)
        host = both[:5 * bs].view(5, bs)
        both_dev = _to_device(both, self.device)
        host_dev, flat_dev = both_dev[:5 * bs].view(5, bs), both_dev[5 * bs:].view(3, t)
        rows_dev, prefix_dev, seq_dev, ext_dev, before_dev = host_dev
        rtt = self.cache.rtt.req_to_token
        last = rtt[rows_dev, before_dev]  # the slot of each request's token prefix - 1 (-1 for a new request)
        if any(r.prefix == 0 for r in rows):
            last = torch.where(prefix_dev > 0, last, -1)
        mode = ForwardMode.MIXED if any(not r.req.prefilling for r in rows) else ForwardMode.EXTEND
        self._pools_changed = True
        loc = self.cache.allocator.alloc_extend(prefix_dev, seq_dev, last, t, prefix_lens_cpu=host[1],
                                                seq_lens_cpu=host[2])
        rtt[flat_dev[2], flat_dev[1]] = loc
        batch = ForwardBatch(mode, bs, rows_dev, seq_dev, loc, prefix_dev, ext_dev, positions=flat_dev[1],
                             seq_lens_cpu=host[2], extend_seq_lens_cpu=host[3])
        return batch, flat_dev[0], flat_dev[1]

    def _allocate_decode(self, rows: List[Row]) -> "tuple[ForwardBatch, torch.Tensor, torch.Tensor]":
        """A decode step: one token per request at position prefix (its row, position, position - 1, length
        after, token id: one host tensor, one copy to the device), one slot each, one scatter."""
        both = torch.tensor([r.req.row for r in rows] + [r.prefix for r in rows] + [r.prefix - 1 for r in rows]
                            + [r.prefix + 1 for r in rows] + [r.req.next_tokens(1)[0] for r in rows], dtype=I64)
        bs = len(rows)
        seq_cpu = both[3 * bs:4 * bs]
        rows_dev, pos_dev, before_dev, seq_dev, ids_dev = _to_device(both, self.device).view(5, bs)
        rtt = self.cache.rtt.req_to_token
        last = rtt[rows_dev, before_dev]  # each request's slot of its previous token
        p = self.cache.plan.page_size
        if p == 1 or not all(r.prefix % p for r in rows):  # a page moves (else every token continues its page)
            self._pools_changed = True
        loc = self.cache.allocator.alloc_decode(seq_dev, last, seq_lens_cpu=seq_cpu)
        rtt[rows_dev, pos_dev] = loc
        batch = ForwardBatch(ForwardMode.DECODE, bs, rows_dev, seq_dev, loc, positions=pos_dev, seq_lens_cpu=seq_cpu)
        return batch, ids_dev, pos_dev

    def _forward(self, rows: List[Row], batch: ForwardBatch, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Metadata once, the model over the packed tokens (a graph replay for decode), the next tokens."""
        sampled = [r for r in rows if r.samples]
        ends, keep = 0, []
        for r in rows:  # the last token of each row that samples
            ends += r.n
            if r.samples:
                keep.append(ends - 1)
        keep_dev = None if len(keep) == ends else torch.tensor(keep, dtype=I64).to(self.device)
        if batch.forward_mode == ForwardMode.DECODE and self.graph is not None:
            logits = self.graph.run(batch, {"input_ids": ids, "positions": pos})
            self.stats.graph_replays = self.graph.replays
            if keep_dev is not None:  # a prompt's next-to-last chunk of one token rode along: no sample there
                logits = logits.index_select(0, keep_dev)
        else:
            self.cache.backend.init_forward_metadata(batch)
            logits = self._run_model(batch, ids, pos, 0 if keep_dev is None else keep_dev)
        params = [r.req.params for r in sampled]
        if all(p.greedy for p in params):  # argmax only: the sampling tensors would go unread
            return logits.argmax(dim=-1)
        temp, top_p, seeds, steps = params_tensors(params, [len(r.req.output) for r in sampled], self.device)
        return sample(logits, temp, top_p, seeds, steps, True)

    def _run_model(self, batch: ForwardBatch, ids: torch.Tensor, pos: torch.Tensor,
                   keep: Union[int, torch.Tensor]) -> torch.Tensor:
        """The HF model over one packed row; logits [K, V] at `keep` (0: every token)."""
        ctx = ForwardContext(self.cache.backend, batch, self.table)
        out = self.model(input_ids=ids[None], position_ids=pos[None], use_cache=False, logits_to_keep=keep,
                         hwkv_forward=ctx)
        return out.logits[0]

    def _decode_step(self, batch: ForwardBatch, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The graph runner's step: the model over the static decode inputs (every token's logits)."""
        return self._run_model(batch, inputs["input_ids"], inputs["positions"], 0)

    def _release(self, batch: ForwardBatch, rows: List[Row]) -> None:
        """One out-of-window release for the batch's requests (hybrid pools only), in the steps where some
        request's frontier moves (`release_out_of_window_batch`'s rule on the host lengths: the page-aligned
        frontier kept one page behind seq_len - W + 1); the others have nothing to release."""
        if self.window is None:
            return
        p, w, host_f, moves = self.cache.plan.page_size, self.window, self._host_frontiers, False
        for r in rows:
            f = max(host_f[r.req.row], ((r.prefix + r.n - w + 1) // p) * p - p)
            if f != host_f[r.req.row]:
                host_f[r.req.row], moves = f, True
        if not moves:
            return
        self._pools_changed = True
        f = self.frontiers[batch.req_pool_indices]
        release_out_of_window_batch(self.cache.allocator, self.cache.rtt.req_to_token, batch.req_pool_indices,
                                    batch.seq_lens, f, self.window)
        self.frontiers[batch.req_pool_indices] = f

    def _complete(self, rows: List[Row], new: List[int]) -> List[Result]:
        """Lengths forward, sampled tokens appended; finished requests free their slots and rows at once."""
        it = iter(new)
        done: List[Request] = []
        for r in rows:
            r.req.kv_len += r.n
            if r.samples and r.req.add_token(next(it)):
                done.append(r.req)
        if done:
            rtt = self.cache.rtt.req_to_token
            self.cache.allocator.free(torch.cat([rtt[r.row, :r.kv_len] for r in done]))
            self.cache.rtt.free([r.row for r in done])
            for r in done:
                self.scheduler.finish(r)
                del self.requests[r.rid]
        return [Result(r.rid, r.prompt, r.output, r.finish_reason, seed=r.params.seed) for r in done]

    def check_integrity(self) -> None:
        """Allocator, pools, request rows and reservations are consistent (tests call it after steps)."""
        self.cache.check_integrity()
        self.scheduler.check_integrity(self.cache.plan.max_running - self.cache.rtt.available_size())


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: itself on the CPU, else one pinned, non-blocking copy."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
