"""Speculative steps on a `Harness`: tree verify with accept/reject, and multi-step drafts, each
checked against hwkv.reference (the shadow K/V follows what acceptance keeps)."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from hwkv import reference
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.checks import as_int
from hwkv.draft import DraftGraphRunner, DraftSteps
from hwkv.errors import ConfigError, ShapeError
from hwkv.spec import DraftTree, MultiStepDraft, accept_draft_tokens, tree_visible
from hwkv.testing.harness import Harness, _as_stored

I64 = torch.int64


def tree_verify(h: Harness, rids: Sequence[int], parents: Sequence[Sequence[int]], accept: Sequence[Sequence[int]],
                check: bool = True) -> List[torch.Tensor]:
    """One TARGET_VERIFY over a draft tree per request (`parents[b]`, equal lengths), eager or through the
    harness's graph runner, then `accept_draft_tokens` keeping `accept[b]` (draft indices, path order).
    Ids not live, trees of different sizes and accepted indices out of range are refused before anything is
    allocated."""
    h.check_live(rids)
    n = _check_trees(rids, parents, accept)
    prefix_cpu = torch.tensor([h.requests[r].seq_len for r in rids], dtype=I64, device="cpu")
    tree = DraftTree.from_parents([list(p) for p in parents], device=h.device)
    batch = h.make_batch(rids, [n] * len(rids), ForwardMode.TARGET_VERIFY)
    batch.spec_info = tree
    inputs = h.random_inputs(batch.num_tokens)
    flat = h.step(batch, inputs)
    outs = h.split_outputs(flat)
    h._record(rids, [n] * len(rids), inputs)
    if check:
        blocks = tree.mask.cpu().view(len(rids), n, n)
        for l, out in zip(h.layers, outs):
            i = l.layer_id
            for b, rid in enumerate(rids):
                r = h.requests[rid]
                p = int(prefix_cpu[b])
                see, q_pos = tree_visible(p, blocks[b], l.window)
                k, v = torch.cat(r.k[i]), torch.cat(r.v[i])
                ref = reference.attention(inputs[f"q{i}"][b * n:(b + 1) * n].float().cpu(), k, v, q_pos,
                                          torch.arange(p + n, device="cpu"), l.scaling, l.window, l.logit_cap,
                                          l.sinks.cpu() if l.sinks is not None else None, mask=see)
                h.compare(l, out[b * n:(b + 1) * n], ref, f"tree verify request {b}")
    _accept(h, rids, batch, prefix_cpu, n, accept)
    return outs


def _check_trees(rids: Sequence[int], parents: Sequence[Sequence[int]], accept: Sequence[Sequence[int]]) -> int:
    """The draft tokens per request, n: ShapeError unless there is one tree and one accepted path per request, every
    tree has n tokens and every path names distinct drafts in [0, n) (the batch holds n tokens a request)."""
    if len(parents) != len(rids) or len(accept) != len(rids):
        raise ShapeError(f"tree_verify: {len(parents)} trees and {len(accept)} accepted paths for {len(rids)} "
                         "requests (one each)")
    n = len(parents[0]) if parents else 0
    for b, (par, acc) in enumerate(zip(parents, accept)):
        if len(par) != n:
            raise ShapeError(f"tree_verify: request {b}'s tree has {len(par)} draft tokens, request 0's {n}: every "
                             "tree of one verify has the same size")
        bad = [a for a in acc if as_int(a) is None or not 0 <= a < n]
        if bad or len(set(acc)) != len(acc):
            raise ShapeError(f"tree_verify: request {b} accepts drafts {list(acc)}: each an index in [0, {n}), "
                             "at most once")
    return n


def _accept(h: Harness, rids: Sequence[int], batch, prefix_cpu: torch.Tensor, n: int,
            accept: Sequence[Sequence[int]]) -> None:
    acc_cpu = torch.tensor([len(a) for a in accept], dtype=I64, device="cpu")
    idx = torch.zeros(len(rids), n, dtype=I64, device="cpu")
    for b, a in enumerate(accept):
        idx[b, :len(a)] = torch.tensor(a, dtype=I64, device="cpu")
    frontiers = h.frontiers[batch.req_pool_indices]
    accept_draft_tokens(h.allocator, h.pool, h.rtt.req_to_token, batch.req_pool_indices,
                        prefix_cpu.to(h.device), idx.to(h.device), acc_cpu.to(h.device),
                        prefix_lens_cpu=prefix_cpu, accept_lens_cpu=acc_cpu, frontiers=frontiers)
    for b, rid in enumerate(rids):  # the shadow keeps the prefix and the accepted drafts, in path order
        r, p = h.requests[rid], int(prefix_cpu[b])
        keep = torch.cat([torch.arange(p, device="cpu"), p + torch.tensor(list(accept[b]), dtype=I64, device="cpu")])
        for i in r.k:
            r.k[i] = [torch.cat(r.k[i])[keep]]
            r.v[i] = [torch.cat(r.v[i])[keep]]
        r.seq_len = p + len(accept[b])


def draft_model(h: Harness, layers: Sequence) -> Callable[[DraftSteps, Dict[str, torch.Tensor]], torch.Tensor]:
    """A draft model's forward over `layers` for every step (inputs step-major [k * bs, ...]):
    per step, each layer's output flattened, concatenated per token; [k * bs, sum(H * Dv)]."""
    def run(steps: DraftSteps, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        per_step = []
        for i in range(len(steps)):
            batch = steps.select(i)
            n = batch.batch_size
            outs = []
            for l in layers:
                q, k, v = (inputs[f"{t}{l.layer_id}"][i * n:(i + 1) * n] for t in "qkv")
                outs.append(h.backend.forward(q, k, v, l, batch).reshape(n, -1))
            per_step.append(torch.cat(outs, dim=1))
        return torch.cat(per_step)
    return run


def draft_graphs(h: Harness, batch_sizes: Sequence[int], adapter: Any, num_steps: int, writes_swa: bool = True,
                 layers: Optional[Sequence] = None, whole_step: bool = False) -> Any:
    """A DraftGraphRunner of `num_steps`-step drafts over the draft model's `layers` (default: the
    harness's), captured now; hand it to `draft_steps(..., runner=)`. `whole_step`: a
    `hwkv.step_graph.DraftStepGraph` instead (the slots' allocation and req_to_token write in the replay too;
    it takes a request row for its padding), under `adapter` where the allocator's page ops can run there, else
    replayed as the host running its body (`EagerAdapter`)."""
    layers = list(h.layers if layers is None else layers)
    shapes = {name: spec for name, spec in h._input_shapes().items() if int(name[1:]) in {l.layer_id for l in layers}}
    if whole_step:
        from hwkv.graph import EagerAdapter
        from hwkv.step_graph import DraftStepGraph
        adapter = adapter if DraftStepGraph.fits(h.allocator, adapter, h.backend) else EagerAdapter()
        runner: Any = DraftStepGraph(h.backend, h.allocator, draft_model(h, layers), batch_sizes, shapes, num_steps,
                                     adapter, writes_swa=writes_swa)
    else:
        runner = DraftGraphRunner(h.backend, draft_model(h, layers), batch_sizes, shapes, num_steps, adapter,
                                  writes_swa)
    runner.capture()
    return runner


def draft_batch(h: Harness, rids: Sequence[int], num_steps: int, writes_swa: bool = True) -> ForwardBatch:
    """Allocate `num_steps` draft slots per request at once (the engine's `ForwardSlots`: one allocator call, one
    req_to_token scatter), and build the step-major DECODE batch (seq_lens: the lengths after step 0)."""
    bs = len(rids)
    s = h.step_lens(rids, [num_steps] * bs, ForwardMode.EXTEND)
    loc = h.slots.allocate(s).out_cache_loc                                    # request-major
    step_major = loc.view(bs, num_steps).t().reshape(-1).contiguous()
    return ForwardBatch(ForwardMode.DECODE, bs, s.rows_dev, s.prefix_dev + 1, step_major,
                        spec_info=MultiStepDraft(num_steps, writes_swa=writes_swa), seq_lens_cpu=s.prefix_cpu + 1)


def draft_steps(h: Harness, rids: Sequence[int], num_steps: int, check: bool = True,
                writes_swa: bool = True, layers: Optional[Sequence] = None,
                runner: Any = None) -> List[List[torch.Tensor]]:
    """One multi-step draft forward: `num_steps` decode steps whose slots are allocated at once
    (step-major), metadata built once by `init_draft_metadata` or, with `runner` (from `draft_graphs`, over
    the same layers), replayed from its graphs (a DraftStepGraph allocates in its replay); each step checked
    against the reference.
    `layers`: the draft model's layers (default: the harness's); with writes_swa=False they must be full (else
    ConfigError, before anything is allocated)."""
    layers = list(h.layers if layers is None else layers)
    h.check_live(rids)
    swa = [l.layer_id for l in layers if l.window is not None]
    if not writes_swa and swa:
        raise ConfigError(f"draft_steps: writes_swa=False, but layers {swa} are window layers: a draft without SWA "
                          "slots runs full layers only (pass layers= the full ones, or writes_swa=True)")
    bs = len(rids)
    inputs = h.random_inputs(bs * num_steps)
    if runner is not None and not isinstance(runner, DraftGraphRunner):  # a DraftStepGraph allocates in its replay
        rows = torch.tensor([h.requests[r].row for r in rids], dtype=I64, device="cpu")   # on the host: sent with
        seq = torch.tensor([h.requests[r].seq_len + num_steps for r in rids], dtype=I64, device="cpu")  # the step
        flat = runner.step(rows, seq, seq, inputs)                           # [k, bs, ...]
    elif runner is not None:
        flat = runner.run(draft_batch(h, rids, num_steps, writes_swa), inputs)
    else:
        batch = draft_batch(h, rids, num_steps, writes_swa)
        flat = draft_model(h, layers)(h.backend.init_draft_metadata(batch), inputs).view(num_steps, bs, -1)
    results = []
    for i in range(num_steps):
        outs, c = [], 0
        for l in layers:
            w = l.num_heads * l.v_head_dim
            outs.append(flat[i, :, c:c + w].reshape(bs, l.num_heads, l.v_head_dim))
            c += w
        for rid in rids:
            h.requests[rid].seq_len += 1
        step_in = {name: t[i * bs:(i + 1) * bs] for name, t in inputs.items()}
        for l in layers:  # shadow what the draft's layers stored (others stored nothing)
            j = l.layer_id
            k = _as_stored(step_in[f"k{j}"], h.dtype, l.k_scale)
            v = _as_stored(step_in[f"v{j}"], h.dtype, l.v_scale)
            for b, rid in enumerate(rids):
                h.requests[rid].k[j].append(k[b:b + 1])
                h.requests[rid].v[j].append(v[b:b + 1])
        if check:
            for l, out in zip(layers, outs):
                j = l.layer_id
                reqs = [h.requests[r] for r in rids]
                ref = reference.batch_attention(step_in[f"q{j}"].float().cpu(), [torch.cat(r.k[j]) for r in reqs],
                                                [torch.cat(r.v[j]) for r in reqs], [r.seq_len for r in reqs],
                                                [1] * bs, l.scaling, l.window, l.logit_cap,
                                                l.sinks.cpu() if l.sinks is not None else None)
                h.compare(l, out, ref, f"draft step {i}")
        results.append(outs)
    return results
