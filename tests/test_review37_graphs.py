"""Review 37 (graph mode: GraphRunner, DecodeStepGraph and their host-side checks): defects found on CPU.

1. The static input buffers join the caller's autograd graph: `v[:n].copy_(src)` in grad mode makes the runner's
   buffer require grad, its CopySlices node holding the caller's activations (and every earlier step's: the chain
   grows per step); the pools store K/V detached for exactly this reason (`ops.store_kv_torch`).
2. `GraphRunner._check_inputs` crashes with bare errors: a 0-d input (IndexError at `src.shape[0]`), an fp8 input
   (RuntimeError from `torch.promote_types` in `_lossless`), inputs=None (AttributeError at `inputs.get`).
3. `input_shapes` is never checked: a dtype given as text, a shape as an int or a negative size fail in torch.zeros
   with a bare TypeError / RuntimeError, after the backend's graph state was built for the runner.
4. A caller whose batch carries no host lengths gets its static batch refilled, but `fn` is handed the batch the
   capture bound (the one with host lengths), whose `seq_lens_cpu` is stale (the init's ones, or an older batch's).
   DecodeStepGraph under an adapter that records device work hands fn and its refill the same stale host copy.
5. `DecodeStepGraph.step` with rows / lengths as a list (what `ReqToTokenPool.alloc` returns) or a numpy array: a
   bare AttributeError.
6. `GraphRunner.prepare` of something that is no ForwardBatch: a bare AttributeError (the eager step: ConfigError).
7. `DecodeStepGraph` inherits `GraphRunner.run`/`prepare`: `graph.run(batch, inputs)` is accepted, and its replay
   re-runs the last staged step (the previous rows and slots) with the new inputs: the batch's slots get no K/V, the
   previous step's K/V are overwritten, the output is another request's.

Runs on CPU (a host 'graph').
"""
from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import pytest
import torch

from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.errors import ConfigError, HwkvError, LocError, ShapeError
from hwkv.graph import EagerAdapter, GraphRunner
from test_review35_graphs import _harness, _same, _static
from test_review35_graphs2 import _inputs
from test_step_graph import Engine, _bucket_of_4, same_state

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("one_thread")]


def _decoding(buckets=(2,)):
    """A harness with a captured decode GraphRunner and two prefilled requests; their next decode batch, inputs."""
    h = _harness()
    runner = h.enable_graphs(list(buckets))
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [5, 6], ForwardMode.EXTEND)
    batch, inputs = h.prepare(rids, [1, 1], ForwardMode.DECODE)
    return h, runner, rids, batch, inputs


# ---- 1. static inputs and the caller's autograd graph ---------------------------------------------------------

@pytest.mark.parametrize("kind", ["GraphRunner", "DecodeStepGraph"])
def test_static_inputs_never_join_the_callers_autograd_graph(kind):
    """Wrong: `_take_inputs` / `_stage_inputs` copy a grad-requiring input into the static buffer in grad mode, which
    then requires grad and keeps the caller's activation graph alive forever (a leak growing every step)."""
    alive = []
    if kind == "GraphRunner":
        h, runner, rids, batch, inputs = _decoding()
        name, run = "q0", lambda x: runner.run(batch, x)
    else:
        e = Engine(4)
        runner = _bucket_of_4(e)
        inputs = _inputs(2)
        name, run = "q", lambda x: e.graph_step(runner, [0, 1], x, on_host=True)

    def step():   # an activation whose graph saves `big`, dropped by the caller once the step ran
        big = torch.randn(64, 64, requires_grad=True)
        alive.append(weakref.ref(big))
        run(dict(inputs, **{name: inputs[name] + 0 * (big @ big).sum()}))

    step()
    gc.collect()
    buf = runner.inputs[name]
    assert not buf.requires_grad and buf.grad_fn is None, "the static input buffer joined the caller's autograd graph"
    assert alive[0]() is None, "the caller's activations are kept alive by the graph's static input buffer"


# ---- 2. _check_inputs: bare errors ---------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["0-d tensor", "fp8 tensor", "inputs None"])
def test_graph_runner_refuses_malformed_inputs_with_a_typed_error_and_changes_nothing(case):
    """Wrong: a 0-d input raises a bare IndexError (`src.shape[0]`), an fp8 one a bare RuntimeError (`_lossless`'s
    torch.promote_types), inputs=None a bare AttributeError (`inputs.get`). Expected: a ShapeError naming the input,
    the static buffers unchanged."""
    h, runner, rids, batch, inputs = _decoding()
    bad = {"0-d tensor": dict(inputs, q0=inputs["q0"][0, 0, 0]),
           "fp8 tensor": dict(inputs, q0=inputs["q0"].to(torch.float8_e4m3fn)),
           "inputs None": None}[case]
    before = _static(runner)
    with pytest.raises(ShapeError if bad is not None else (ShapeError, ConfigError), match="input"):
        runner.prepare(batch, bad)
    assert _same(before, _static(runner))


# ---- 3. input_shapes ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shapes", [{"q": ((4, 16), "float32")}, {"q": (4, torch.float32)}, {"q": ((4, 16),)},
                                    {"q": ((-1, 16), torch.float32)}, {"q": ((4.0, 16), torch.float32)}], ids=repr)
def test_graph_runner_refuses_malformed_input_shapes_before_building_graph_state(shapes):
    """Wrong: input_shapes is read only by torch.zeros after `_init_state`: a bare TypeError / ValueError /
    RuntimeError, with the backend's graph state already built for this runner's sizes. Expected: a typed error
    (ConfigError, as for batch_sizes and tokens_per_req) naming input_shapes, nothing built."""
    h = _harness()
    with pytest.raises(HwkvError, match="input_shapes"):
        GraphRunner(h.backend, h.model_step, [2], shapes, EagerAdapter())
    assert h.backend.static is None, "the backend's graph state was built for a refused runner"


# ---- 4. stale host lengths handed to fn ----------------------------------------------------------------------

def test_fn_never_sees_host_lengths_the_callers_batch_does_not_carry():
    """Wrong: a batch without seq_lens_cpu is refilled through the (bucket, no host lengths) static batch, but `fn`
    gets the batch the capture bound, whose seq_lens_cpu holds stale values ([1, 1] here while seq_lens is [6, 7]).
    Expected: fn's batch has no host copy (as the caller's and the eager step's), or one equal to seq_lens."""
    h = _harness()
    seen = []

    def fn(b, i):
        seen.append((b.seq_lens.tolist(), None if b.seq_lens_cpu is None else b.seq_lens_cpu.tolist()))
        return h.model_step(b, i)

    runner = GraphRunner(h.backend, fn, [2], h._input_shapes(), EagerAdapter())
    runner.capture()
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [5, 6], ForwardMode.EXTEND)
    batch, inputs = h.prepare(rids, [1, 1], ForwardMode.DECODE)
    no_host = ForwardBatch(ForwardMode.DECODE, 2, batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc)
    seen.clear()
    h.complete(rids, [1, 1], inputs, runner.run(no_host, inputs))
    (seq, host), = seen
    assert host is None or host == seq, f"fn got seq_lens {seq} with a stale host copy {host}"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the device page ops run interpreted on CPU")
def test_a_recording_whole_step_graph_hands_fn_no_stale_host_lengths():
    """Wrong: under an adapter that records device work (its replays stage no host lengths), DecodeStepGraph keeps
    the base class's static batch with host lengths: fn and the refill get seq_lens_cpu [1, 1, 1, 1] beside seq_lens
    [14, 31, 1, 1]. DraftStepGraph gives such a batch none (`None if self._records`). Expected: no host copy, or
    one equal to seq_lens."""
    from hwkv_cuda.kernels.alloc import TritonPageOps
    from hwkv.step_graph import DecodeStepGraph
    from test_review20_graphs import SHAPES
    from test_step_graph import RecordingEager, W
    e = Engine(4)
    e.alloc._ops = TritonPageOps()
    seen = []

    def fn(b, i):
        seen.append((b.seq_lens.tolist(), None if b.seq_lens_cpu is None else b.seq_lens_cpu.tolist()))
        return e.layers_fn(b, i)

    graph = DecodeStepGraph(e.backend, e.alloc, fn, [4], SHAPES, RecordingEager(), e.frontiers, W)
    graph.capture()
    seen.clear()
    e.graph_step(graph, [0, 1], _inputs(2))
    (seq, host), = seen
    assert host is None or host == seq, f"fn got seq_lens {seq} with a stale host copy {host}"


# ---- 5. DecodeStepGraph.step: rows that are no tensors --------------------------------------------------------

@pytest.mark.parametrize("form", ["list", "numpy"])
def test_step_refuses_rows_and_lengths_that_are_no_tensors_with_a_typed_error(form):
    """Wrong: rows as a list (what ReqToTokenPool.alloc returns) or numpy arrays fail with a bare AttributeError
    ('list' object has no attribute 'dtype'). Expected: a typed error (LocError / ShapeError, as a float or 2-D
    rows get) naming the argument, nothing claimed."""
    e = Engine(4)
    graph = _bucket_of_4(e)
    seq = e.seq[:2] + 1
    rows = [e.rows[0], e.rows[1]]
    args = (rows, seq.tolist(), seq) if form == "list" else (np.array(rows), seq.numpy(), seq.numpy())
    before = e.state()
    with pytest.raises((LocError, ShapeError), match="rows|seq_lens"):
        graph.step(*args, _inputs(2))
    assert same_state(before, e.state())


# ---- 6. GraphRunner.prepare of something that is no ForwardBatch ----------------------------------------------

@pytest.mark.parametrize("bad", [None, {"batch_size": 2}], ids=repr)
def test_prepare_refuses_a_batch_that_is_no_forward_batch_as_the_eager_step_does(bad):
    """Wrong: GraphRunner.prepare reads `batch.batch_size` first: a bare AttributeError. Expected: the eager step's
    ConfigError ("batch must be a ForwardBatch, got ...")."""
    h, runner, rids, batch, inputs = _decoding()
    with pytest.raises(ConfigError, match="ForwardBatch"):
        h.backend.init_forward_metadata(bad)   # the eager step
    before = _static(runner)
    with pytest.raises(ConfigError, match="ForwardBatch"):
        runner.prepare(bad, inputs)
    assert _same(before, _static(runner))


# ---- 7. DecodeStepGraph through the inherited GraphRunner.run --------------------------------------------------

def test_a_whole_step_graph_refuses_the_inherited_run_instead_of_replaying_the_last_step():
    """Wrong: DecodeStepGraph.run (GraphRunner's) takes a decode batch whose slots the caller allocated, then
    replays the captured whole step over the control words staged by the last `step()`: it writes the new K/V into
    the previous step's slots (rows 0, 1) and none at the batch's, and returns rows 0 and 1's outputs. Expected: a
    ConfigError (a whole-step graph runs through step()), nothing written."""
    e = Engine(4)
    graph = _bucket_of_4(e)
    e.graph_step(graph, [0, 1], _inputs(2))
    prev = e.rtt.req_to_token[torch.tensor(e.rows[:2]), e.seq[:2] - 1]   # the last step's slots
    k_prev = e.pool.get_key_buffer(1)[prev].clone()
    rows, seq = torch.tensor(e.rows[2:4]), e.seq[2:4] + 1
    loc = e.alloc.alloc_decode(seq, e.rtt.req_to_token[rows, seq - 2], seq_lens_cpu=seq)
    e.rtt.req_to_token[rows, seq - 1] = loc
    batch = ForwardBatch(ForwardMode.DECODE, 2, rows, seq, loc, seq_lens_cpu=seq)
    inputs = _inputs(2)
    try:
        graph.run(batch, inputs)
        ran = True
    except ConfigError:
        ran = False
    assert torch.equal(e.pool.get_key_buffer(1)[prev], k_prev), "the previous step's K/V were overwritten"
    assert not ran or torch.equal(e.pool.get_key_buffer(1)[loc], inputs["k"]), \
        "the run was accepted but the batch's slots did not get its K/V"


def test_a_step_prepared_before_another_is_not_replayed_with_the_later_batch():
    """prepare(A), prepare(B), replay(A's step) replayed B's staged batch silently (A's slots got no K/V)."""
    h, runner, rids, batch, inputs = _decoding()
    first = runner.prepare(batch, inputs)
    runner.prepare(batch, inputs)
    with pytest.raises(ConfigError, match="staged before the last prepare"):
        runner.replay(first)


def test_a_whole_step_graph_keeps_the_refill_out_of_graphs_where_the_backend_does():
    """ROCm and XPU declare metadata_in_graph=False (their refill not verified inside their graphs), yet a recorded
    whole-step graph captured that refill anyway; under an adapter that records device work it now does not fit."""
    from types import SimpleNamespace

    from hwkv.step_graph import DecodeStepGraph
    alloc = SimpleNamespace(allocates_in_graph=True)
    recording = SimpleNamespace(records_device_work=True)
    assert not DecodeStepGraph.fits(alloc, recording, SimpleNamespace(metadata_in_graph=False))
    assert DecodeStepGraph.fits(alloc, recording, SimpleNamespace(metadata_in_graph=True))
    assert DecodeStepGraph.fits(alloc, EagerAdapter(), SimpleNamespace(metadata_in_graph=False))  # nothing recorded
