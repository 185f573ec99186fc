"""Review 20 (the speculative-decoding API: spec.py, spec_plan.py, draft.py, the Verify/Draft step graphs): each bad
input is refused with a typed error naming the value and the limit, before anything changes (pools, req_to_token,
the allocator, the backend's graph and draft-graph state and the runner's static buffers compared as snapshots):

1. DraftGraphRunner: an input that is the runner's own buffer at the batch's width, padded to a larger bucket
   (the replay reads step i of request b at row i * bucket + b): ShapeError, as DraftStepGraph gives;
2. DraftGraphRunner.prepare: draft lengths, rows and write locs the eager step refuses, before its first copy and
   also where the refill is recorded in the graph (never run by prepare); GraphRunner.prepare's write locs too;
3. a bool step count (MultiStepDraft, DraftGraphRunner, init_draft_graph_state): refused, no graph state left;
4. accept_draft_tokens(frontiers=...) that is no int64 tensor of shape [batch];
5. VerifyStepGraph under tree_verify="auto": the buckets that carry the chain as a DraftTree run it decode-like
   (one rule, TreePlanner.decode_like, decides both);
6. step() with seq_lens_cpu on a device: LocError naming the device;
7. step() that might not fit (OutOfSlotsError) leaves the graph's inputs and host lengths as they were."""
import re

import numpy as np
import pytest
import torch

import hwkv
from hwkv.allocator import same_snapshot
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.errors import ConfigError, LocError, OutOfSlotsError, ShapeError
from hwkv.graph import EagerAdapter
from hwkv.spec import DraftTree, MultiStepDraft, accept_draft_tokens
from hwkv.step_graph import DecodeStepGraph, DraftStepGraph, VerifyStepGraph
from hwkv.testing.spec_harness import draft_batch, draft_graphs, draft_model
from test_accept_draft import N, Setup
from test_spec_refusals import CTX, ROWS, assert_unchanged, draft, harness, snapshot
from test_step_graph import D, DEVICE, Engine, H, KVH, W

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPES = {"q": ((H, D), torch.float32), "k": ((KVH, D), torch.float32), "v": ((KVH, D), torch.float32)}


class Recording(EagerAdapter):
    """A host 'graph' standing in for a device graph: the metadata refill is recorded with the layers (prepare
    never runs it), as hwkv_cuda's under CUDA graphs."""

    records_device_work = True


# ---- 1. the runner's own buffers at a narrower width ---------------------------------------------------------

def test_a_draft_runner_refuses_its_own_buffers_at_the_batch_width_when_padded():
    """2 requests in bucket 4, k = 3: inputs written step-major at the batch's width into `runner.inputs` had been
    read at the bucket's (and partly zeroed as padding): outputs off by 2.45, nothing raised."""
    h, rids = harness()
    runner = draft_graphs(h, [4], EagerAdapter(), 3)
    inputs = h.random_inputs(6)
    passed = {name: buf[:6] for name, buf in runner.inputs.items()}
    for name, v in passed.items():
        v.copy_(inputs[name])
    batch = draft_batch(h, rids, 3)
    before = snapshot(h, runner)
    with pytest.raises(ShapeError, match=r"input '\w+' is the graph's own buffer at 6 rows: .* a draft of 2 requests "
                                         r"sits at bucket 4's width \(step i of request b at row i \* 4 \+ b\)"):
        runner.run(batch, passed)
    assert_unchanged(h, before, runner)


def test_a_draft_runner_takes_its_own_buffers_at_the_bucket_width():
    """The layout the refusal names: step i of request b at row i * bucket + b, the whole buffer passed (no copy)."""
    ref, rids = harness()
    h, _ = harness()
    k, bucket = 3, 4
    runner = draft_graphs(h, [bucket], EagerAdapter(), k)
    inputs = ref.random_inputs(2 * k)
    want = draft_model(ref, ref.layers)(ref.backend.init_draft_metadata(draft_batch(ref, rids, k)), inputs)
    for name, buf in runner.inputs.items():
        buf[:k * bucket].view(k, bucket, *buf.shape[1:])[:, :2].copy_(inputs[name].view(k, 2, *buf.shape[1:]))
    got = runner.run(draft_batch(h, rids, k), dict(runner.inputs))
    torch.testing.assert_close(got, want.view(k, 2, -1), rtol=1e-5, atol=1e-5)


# ---- 2. DraftGraphRunner.prepare checks before its first copy; GraphRunner.prepare's write locs -------------

DRAFT_CASES = [  # (rows, lengths after step 0, write locs, error, message): as init_draft_metadata refuses them
    ([0, 1], [7, 15], None, ShapeError, rf"seq_lens\[1\] is 15: its 3 draft steps reach length 17, past "
                                        rf"max_context_len {CTX}"),
    ([0, 1], [0, 10], None, ShapeError, rf"seq_lens\[0\] is 0; allowed range is \[1, {CTX}\]"),
    ([0, 99], [7, 10], None, LocError, rf"req_pool_indices hold values in \[0, 99\], allowed range is \[0, {ROWS}\)"),
    ([-1, 1], [7, 10], None, LocError, rf"req_pool_indices hold values in \[-1, 1\], allowed range is \[0, {ROWS}\)"),
    ([0, 1], [7, 10], [100, 101, 102, 103, 104, 99999], LocError,
     r"loc holds values in \[100, 99999\], allowed range is \[0, 257\)"),
]


@pytest.mark.parametrize("recorded", [False, True], ids=["host refill", "refill recorded in the graph"])
@pytest.mark.parametrize("rows,seq,loc,error,match", DRAFT_CASES)
def test_a_draft_runner_refuses_what_the_eager_draft_refuses_before_any_static_buffer_is_written(
        rows, seq, loc, error, match, recorded):
    """The host refill had refused them only after the runner's rows, lengths and write locs were overwritten; a
    refill recorded in the graph (hwkv_cuda under CUDA graphs) had not checked them at all: accepted and replayed
    (a read past the row or past req_to_token on the GPU)."""
    h, rids = harness()
    if recorded:
        h.backend.metadata_in_graph = True
    runner = draft_graphs(h, [2], Recording() if recorded else EagerAdapter(), 3)
    assert runner.metadata_in_graph == recorded
    runner.run(draft_batch(h, rids, 3), h.random_inputs(6))  # one good replay first
    batch = draft(rows, seq, steps=3, loc=torch.tensor(loc) if loc else torch.arange(100, 106))
    with pytest.raises(error, match=match):  # the eager step's refusal of the same batch
        h.backend.init_draft_metadata(batch)
    before = snapshot(h, runner)
    with pytest.raises(error, match=match):
        runner.prepare(batch, h.random_inputs(6))
    assert_unchanged(h, before, runner)


@pytest.mark.parametrize("recorded", [False, True], ids=["host refill", "refill recorded in the graph"])
def test_graph_runner_refuses_a_write_loc_outside_the_pool_before_any_static_buffer_is_written(recorded):
    """The refill's check_write_loc had refused loc 99999 after the runner's rows, lengths and out_cache_loc held it."""
    h, rids = harness()
    if recorded:
        h.backend.metadata_in_graph = True
    h.enable_graphs([2], Recording() if recorded else EagerAdapter(), mode=ForwardMode.DECODE)
    runner = h.runner
    batch = ForwardBatch(ForwardMode.DECODE, 2, torch.tensor(rids), torch.tensor([7, 10]), torch.tensor([5, 99999]),
                         seq_lens_cpu=torch.tensor([7, 10]))
    before = snapshot(h, runner)
    with pytest.raises(LocError, match=r"loc holds values in \[5, 99999\], allowed range is \[0, 257\)"):
        runner.run(batch, h.random_inputs(2))
    assert_unchanged(h, before, runner)


# ---- 3. bool step counts ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("steps", [True, False, np.bool_(True), 0, 2.0, "3", None], ids=repr)
def test_a_multi_step_draft_of_no_integer_count_is_refused(steps):
    """MultiStepDraft(True) had been taken as one step (equal to MultiStepDraft(1)). Its error stays the ShapeError
    MultiStepDraft(0) has always raised (the contract suite's)."""
    with pytest.raises(ShapeError, match=rf"MultiStepDraft.num_steps={re.escape(repr(steps))} must be an integer "
                                         r">= 1"):
        MultiStepDraft(steps)


def test_a_multi_step_draft_takes_numpy_and_tensor_integers_as_ints():
    for steps in (np.int64(3), torch.tensor(3)):
        info = MultiStepDraft(steps)
        assert type(info.num_steps) is int and info == MultiStepDraft(3)


@pytest.mark.parametrize("steps", [True, np.bool_(True), torch.tensor(True), 0, -1, 2.0, "3", None], ids=repr)
def test_a_draft_runner_of_no_integer_step_count_is_refused_before_any_graph_state_is_built(steps):
    """draft_steps=True had built the backend's draft graph state for 'True' steps, then failed in capture with a bare
    TypeError; the state left made the next, valid runner a ConfigError."""
    h, rids = harness()
    match = rf"a draft runs draft_steps >= 1 steps, got draft_steps={re.escape(repr(steps))}"
    with pytest.raises(ConfigError, match=match):
        draft_graphs(h, [2], EagerAdapter(), steps)
    with pytest.raises(ConfigError, match=match):
        h.backend.init_draft_graph_state(2, steps)
    assert h.backend.draft_static is None and h.backend.static is None
    runner = draft_graphs(h, [2], EagerAdapter(), 3)  # a valid runner after them
    runner.run(draft_batch(h, rids, 3), h.random_inputs(6))
    h.allocator.check_integrity()


def test_a_draft_runner_takes_a_numpy_step_count_as_an_int():
    h, rids = harness()
    runner = draft_graphs(h, [2], EagerAdapter(), np.int64(3))
    assert type(runner.steps) is int and runner.steps == 3 and runner.draft == MultiStepDraft(3)
    assert runner.run(draft_batch(h, rids, 3), h.random_inputs(6)).shape[:2] == (3, 2)


# ---- 4. accept_draft_tokens' frontiers ---------------------------------------------------------------------------

@pytest.mark.parametrize("bs,frontiers,got", [
    (2, [0, 0], "list"),
    (2, torch.tensor([0, 0, 0]), r"torch.int64 \(3,\)"),          # a per-row table (as the step graphs keep)
    (1, torch.tensor([0, 9]), r"torch.int64 \(2,\)"),             # had been a misleading 'passed its prefix'
    (2, torch.tensor([0, 0], dtype=torch.int32), r"torch.int32 \(2,\)"),
    (2, torch.tensor([0.0, 0.0]), r"torch.float32 \(2,\)"),
    (2, torch.tensor([[0, 0]]), r"torch.int64 \(1, 2\)"),
], ids=["list", "row table", "row table, one request", "int32", "float", "2-D"])
@pytest.mark.parametrize("immediate", [True, False], ids=["immediate", "deferred"])
def test_accept_refuses_frontiers_that_are_no_int64_tensor_of_the_batch_shape(bs, frontiers, got, immediate):
    """A list had been a bare AttributeError, the per-row table a bare RuntimeError (broadcasting)."""
    s = Setup(1, immediate)
    idx, lens = torch.zeros(bs, N, dtype=torch.int64), torch.ones(bs, dtype=torch.int64)
    snap = s.snapshot()
    with pytest.raises(ShapeError, match=rf"frontiers must be an int64 tensor of shape \({bs},\) \(each request's SWA "
                                         rf"frontier, as req_pool_indices\), got {got}"):
        accept_draft_tokens(s.a, s.pool, s.rtt.req_to_token, s.rows[:bs], s.prefix[:bs], idx, lens,
                            prefix_lens_cpu=s.prefix[:bs], accept_lens_cpu=lens, frontiers=frontiers)
    assert s.unchanged(snap)
    s.a.check_integrity()


def test_accept_takes_frontiers_of_the_batch_shape():
    s = Setup(1, True)
    lens = torch.ones(2, dtype=torch.int64)
    idx, frontiers = torch.zeros(2, N, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    seq = accept_draft_tokens(s.a, s.pool, s.rtt.req_to_token, s.rows, s.prefix, idx, lens, prefix_lens_cpu=s.prefix,
                              accept_lens_cpu=lens, frontiers=frontiers)
    assert seq.tolist() == [6, 7]
    s.finish(seq)


# ---- 5. tree_verify="auto": one rule for the bucket and the lists ---------------------------------------------

def _auto_verify(chain_pays, verify_pays):
    e = Engine(4)
    e.backend = hwkv.make_backend(e.pool, e.rtt, device=DEVICE, sliding_window=W, tree_verify="auto")
    e.backend.decode_like_chain_pays = chain_pays
    e.backend.decode_like_verify_pays = verify_pays
    seen = []

    def fn(batch, inputs):
        md = e.backend.forward_metadata
        seen.append((batch.batch_size, md.tree is not None, md.tree_decode is not None))
        return e.layers_fn(batch, inputs)
    graph = VerifyStepGraph(e.backend, e.alloc, fn, [2, 4], SHAPES, 2, EagerAdapter())
    graph.capture()
    return e, graph, seen


def _verify_inputs(n):
    gen = torch.Generator().manual_seed(0)
    return {"q": torch.randn(n, H, D, generator=gen), "k": torch.randn(n, KVH, D, generator=gen),
            "v": torch.randn(n, KVH, D, generator=gen)}


def test_auto_verify_runs_the_chain_decode_like_in_the_buckets_chosen_decode_like():
    """A backend that overrides only decode_like_chain_pays (the base decode_like_verify_pays: never): the buckets
    it picks had carried the chain as a tree and run it through the masked extend kernel (no decode-like lists)."""
    e, graph, seen = _auto_verify(lambda requests, tokens: requests <= 2, lambda requests, tokens: False)
    assert graph.decode_like(2) and not graph.decode_like(4)
    seen.clear()
    e.graph_verify(graph, [0, 1], _verify_inputs(6), 3)      # bucket 2: decode-like
    e.seq[:2] += 3
    e.graph_verify(graph, [0, 1, 2], _verify_inputs(9), 3)   # bucket 4: the causal extend verify, no tree
    assert seen == [(2, True, True), (4, False, False)]


def test_auto_verify_follows_the_chain_rule_not_the_tree_rule():
    """The tree rule says decode-like everywhere, the chain rule nowhere: a chain runs the causal extend verify."""
    e, graph, seen = _auto_verify(lambda requests, tokens: False, lambda requests, tokens: True)
    assert not graph.decode_like(2) and not graph.decode_like(4)
    seen.clear()
    e.graph_verify(graph, [0, 1], _verify_inputs(6), 3)
    assert seen == [(2, False, False)]


def test_the_planner_rule_decides_chains_and_trees_apart():
    e = Engine(4)
    planner = hwkv.make_backend(e.pool, e.rtt, device=DEVICE, sliding_window=W, tree_verify="auto").tree_planner
    planner.backend.decode_like_chain_pays = lambda requests, tokens: requests <= 2
    planner.backend.decode_like_verify_pays = lambda requests, tokens: requests <= 8
    assert planner.decode_like(2, 6, chain=True) and not planner.decode_like(4, 12, chain=True)
    assert planner.decode_like(4, 12, chain=False) and not planner.decode_like(16, 48, chain=False)
    assert DraftTree(torch.ones(1, dtype=torch.bool)).chain is False


# ---- 6. and 7. the step graphs' step() ------------------------------------------------------------------------

def _step_graph(e, kind, buckets=(4,)):
    if kind == "decode":
        return DecodeStepGraph(e.backend, e.alloc, e.layers_fn, list(buckets), SHAPES, EagerAdapter(), e.frontiers,
                               W), 1
    if kind == "verify":
        return VerifyStepGraph(e.backend, e.alloc, e.layers_fn, list(buckets), SHAPES, 2, EagerAdapter()), 3
    return DraftStepGraph(e.backend, e.alloc, e.draft_fn, list(buckets), SHAPES, 3, EagerAdapter()), 3


def _graph_state(e, graph):
    """The allocator, req_to_token, the frontiers and every static buffer of the graph (a draft's step-0 lengths)."""
    own = [graph.req_pool_indices, graph.seq_lens, graph.seq_lens_cpu, graph.out_cache_loc, graph.staged,
           *graph.inputs.values(), *[getattr(graph, n) for n in ("seq0", "seq0_cpu", "req_loc") if hasattr(graph, n)]]
    return (e.alloc.integrity_snapshot(), e.rtt.req_to_token.clone(), e.frontiers.clone(),
            [t.clone() for t in own], (graph.replays, graph.eager_runs))


def _assert_same(before, after):
    assert same_snapshot(before[0], after[0]), "the allocator changed"
    assert torch.equal(before[1], after[1]) and torch.equal(before[2], after[2]), "req_to_token or frontiers changed"
    changed = [i for i, (a, b) in enumerate(zip(before[3], after[3])) if not torch.equal(a, b)]
    assert not changed, f"static buffers {changed} of the graph changed"
    assert before[4] == after[4]


@pytest.mark.parametrize("kind", ["decode", "verify", "draft"])
def test_step_refuses_host_lengths_on_a_device_naming_it(kind):
    """seq_lens_cpu on a device (the meta device stands in) had been a bare TypeError from .numpy()."""
    e = Engine(4)
    graph, n = _step_graph(e, kind, buckets=(2,))
    graph.capture()
    rows, seq = torch.tensor(e.rows[:2]), e.seq[:2] + n
    inputs = _verify_inputs(2 * n)
    before = _graph_state(e, graph)
    with pytest.raises(LocError, match=r"seq_lens_cpu is on meta: it is seq_lens' host copy and must be a CPU tensor"):
        graph.step(rows, seq, seq.to("meta"), inputs)
    _assert_same(before, _graph_state(e, graph))
    e.alloc.check_integrity()


@pytest.mark.parametrize("kind", ["decode", "verify", "draft"])
def test_a_step_that_might_not_fit_leaves_the_inputs_and_host_lengths_as_they_were(kind):
    """Four requests at 32 each open a page, one page is free: OutOfSlotsError. The graph's inputs, host lengths
    (and a draft's step-0 lengths) had been overwritten before the refusal."""
    e = Engine(4, size=132, size_swa=160, lens=(32, 32, 32, 32))
    graph, n = _step_graph(e, kind)
    graph.capture()
    rows, seq = torch.tensor(e.rows[:4], dtype=torch.int64), e.seq[:4] + n
    before = _graph_state(e, graph)
    with pytest.raises(OutOfSlotsError, match="need 4 pages"):
        graph.step(rows, seq, seq, _verify_inputs(4 * n))
    _assert_same(before, _graph_state(e, graph))
    e.alloc.check_integrity()
