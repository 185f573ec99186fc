"""Review 35 (graph mode: GraphRunner, DraftGraphRunner, the whole-step graphs): refusals that are bare Python errors,
come after something was staged or built, or refuse a valid value.

1. `DraftGraphRunner.prepare` (hwkv/draft.py) overrides `GraphRunner.prepare` without its "bucket not captured"
   check (review 30 added it to GraphRunner only): a draft run before `capture()` (or after a capture that stopped
   part way) stages the batch, refills every step's metadata and then fails with a bare `KeyError` at
   `self.graphs[step.bucket]` (hwkv/graph.py, `replay`).
2. `GraphRunner.__init__` checks only `min(batch_sizes) >= 1`: a bucket of 2.5, "4" or True is taken (or fails in a
   bare comparison), the backend's graph state is built for the largest bucket, and capture then fails with a bare
   TypeError / a ShapeError about a batch. A DecodeStepGraph also takes a request row for its padding first and never
   gives it back. The engine checks the same sizes at its boundary (`hwkv.engine.inputs.batch_sizes`: ConfigError
   unless each is an integer >= 1); the runners, public API, should too, before anything is built.
3. `VerifyStepGraph(drafts=np.int64(2))` (or a 0-d tensor) is refused with "checks drafts >= 1 per request, got
   drafts=np.int64(2)", a message that contradicts itself; every other count of the graph classes takes numpy and
   0-d tensor integers (`check_draft_steps` for DraftStepGraph, `pad_row`, `max_q_len`).
4. `GraphRunner.prepare` never runs the eager step's device check (`ForwardBatch.check_devices`): a batch with a
   tensor on another device type (meta here) gets a bare NotImplementedError from `copy_`, after the inputs (or part
   of the static batch) were overwritten; the eager step refuses the same batch with a LocError naming the field.

Runs on CPU (a host 'graph').
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.draft import DraftGraphRunner
from hwkv.errors import ConfigError, LocError
from hwkv.graph import EagerAdapter, GraphRunner
from hwkv.step_graph import DecodeStepGraph, VerifyStepGraph
from hwkv.testing.harness import Harness, ModelGeometry
from hwkv.testing.reference_backend import ReferenceBackend
from hwkv.testing.spec_harness import draft_batch, draft_model
from test_review20_graphs import SHAPES
from test_step_graph import W, Engine

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("one_thread")]


def _harness() -> Harness:
    return Harness(ReferenceBackend, geometry=ModelGeometry(num_layers=2, window=4), size=256, size_swa=64, seed=3)


def _static(runner) -> list:
    """The runner's static batch and inputs, cloned."""
    return [t.clone() for t in (runner.req_pool_indices, runner.seq_lens, runner.seq_lens_cpu, runner.out_cache_loc,
                                *runner.inputs.values())]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ---- 1. DraftGraphRunner: a bucket that is not captured -------------------------------------------------------

def test_draft_graph_runner_refuses_an_uncaptured_bucket_with_a_typed_error_before_staging():
    """Wrong: DraftGraphRunner.prepare (hwkv/draft.py) stages the draft and refills the metadata of bucket 1, which
    was never captured; `replay` then raises a bare `KeyError: 1` (hwkv/graph.py `self.graphs[step.bucket]`).
    Expected: the ConfigError GraphRunner.prepare gives ("a batch of 1 replays bucket 1, which is not captured ...:
    call capture() before run()"), before any static buffer is written."""
    h = _harness()
    runner = DraftGraphRunner(h.backend, draft_model(h, h.layers), [1, 2], h._input_shapes(), 2, EagerAdapter())
    rid = h.add_request()
    h.forward([rid], [5], ForwardMode.EXTEND)
    batch, inputs = draft_batch(h, [rid], 2), h.random_inputs(2)
    before = _static(runner)
    with pytest.raises(ConfigError, match="not captured"):
        runner.run(batch, inputs)
    assert _same(before, _static(runner)), "the refused draft was staged into the static buffers"


# ---- 2. bucket sizes that are no integers ---------------------------------------------------------------------

BAD_BUCKETS = [[2.5, 4], ["4"], [True, 4]]


@pytest.mark.parametrize("sizes", BAD_BUCKETS, ids=repr)
def test_graph_runner_refuses_bucket_sizes_that_are_no_integers_before_building_graph_state(sizes):
    """Wrong: [2.5, 4] and [True, 4] are taken (the backend's graph state is built for 4), capture then fails with a
    bare TypeError ("slice indices must be integers") or a ShapeError ("batch_size ... got True"); ["4"] fails in
    `min(batch_sizes) < 1` with a bare TypeError. Expected: a ConfigError naming batch_sizes at construction (as the
    engine's `graph_batch_sizes` check), with the backend's graph state not built."""
    h = _harness()
    with pytest.raises(ConfigError, match="batch_sizes"):
        runner = GraphRunner(h.backend, h.model_step, sizes, h._input_shapes(), EagerAdapter())
        runner.capture()
    assert h.backend.static is None, "the backend's graph state was built for a refused runner"


def test_decode_step_graph_refuses_a_bucket_size_that_is_no_integer_without_taking_a_row():
    """Wrong: DecodeStepGraph(batch_sizes=[2.5, 4]) builds the backend's graph state, takes a req_to_token row for its
    padding (hwkv/step_graph.py, `rtt_pool.alloc(1)`), then fails with a bare TypeError slicing its staged words by
    2.5; the row is never given back. Expected: a ConfigError naming batch_sizes, nothing taken or built."""
    e = Engine(4)
    rows = e.rtt.available_size()
    with pytest.raises(ConfigError, match="batch_sizes"):
        DecodeStepGraph(e.backend, e.alloc, e.layers_fn, [2.5, 4], SHAPES, frontiers=e.frontiers, window=W)
    assert e.rtt.available_size() == rows, "a request row was taken for the padding of a refused graph"
    assert e.backend.static is None, "the backend's graph state was built for a refused graph"


# ---- 3. VerifyStepGraph's draft count as a numpy / 0-d tensor integer -------------------------------------------

@pytest.mark.parametrize("drafts", [np.int64(2), torch.tensor(2)], ids=repr)
def test_verify_step_graph_takes_a_numpy_or_0d_tensor_draft_count(drafts):
    """Wrong: `isinstance(drafts, int)` (hwkv/step_graph.py VerifyStepGraph.__init__) refuses np.int64(2) with
    "a verify step checks drafts >= 1 per request, got drafts=np.int64(2)". Expected: taken as 2, as DraftStepGraph
    takes draft_steps (`check_draft_steps`: Python, numpy or 0-d tensor integers), three tokens per request."""
    e = Engine(4)
    graph = VerifyStepGraph(e.backend, e.alloc, e.layers_fn, [2], SHAPES, drafts=drafts)
    assert graph.drafts == 2 and type(graph.drafts) is int and graph.tpr == 3


# ---- 4. GraphRunner.prepare of a batch on another device --------------------------------------------------------

@pytest.mark.parametrize("field", ["req_pool_indices", "seq_lens", "out_cache_loc"])
def test_graph_runner_refuses_a_batch_on_another_device_as_the_eager_step_does(field):
    """Wrong: GraphRunner.prepare copies the inputs and the batch into its static buffers without the eager step's
    `batch.check_devices`: a meta tensor fails in `copy_` with a bare NotImplementedError ("Cannot copy out of meta
    tensor") after the static inputs (or rows, lengths) were overwritten. Expected: the eager step's LocError naming
    the field and its device, before any static buffer is written."""
    h = _harness()
    runner = h.enable_graphs([2])
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [5, 6], ForwardMode.EXTEND)
    batch, inputs = h.prepare(rids, [1, 1], ForwardMode.DECODE)
    bad = ForwardBatch(ForwardMode.DECODE, 2, batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc,
                       seq_lens_cpu=batch.seq_lens_cpu)
    setattr(bad, field, getattr(bad, field).to("meta"))
    with pytest.raises(LocError, match=f"{field} is on meta"):   # the eager step
        h.backend.init_forward_metadata(bad)
    before = _static(runner)
    with pytest.raises(LocError, match=f"{field} is on meta"):
        runner.prepare(bad, inputs)
    assert _same(before, _static(runner)), "the refused batch was staged into the static buffers"
