"""Review 35, the reviewer's unconfirmed notes on graph mode, confirmed and fixed:

1. `DecodeStepGraph.release_rows()` gave the padding row back but left the graph running: a later step's padded
   lanes wrote that row, which the pool may have handed to a live request.
2. A static input of another dtype was cast into the static buffer (float64 into float32): the replay rounded what
   the eager step computes with, silently. A lossless cast (int32 ids into int64) stays taken.
3. `GraphRunner(tokens_per_req=0 or 2.5)` was refused by the backend's graph state with a message naming
   max_num_tokens, not the argument.

Runs on CPU (a host 'graph').
"""
from __future__ import annotations

import pytest
import torch

from hwkv.batch import ForwardMode
from hwkv.errors import ConfigError, ShapeError
from hwkv.graph import EagerAdapter, GraphRunner
from test_review35_graphs import _harness, _same, _static
from test_step_graph import D, DEVICE, H, KVH, Engine, _bucket_of_4, same_state

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("one_thread")]


def _inputs(n, dtype=torch.float32):
    kv = dict(dtype=dtype, device=DEVICE)
    return {"q": torch.randn(n, H, D, **kv), "k": torch.randn(n, KVH, D, **kv), "v": torch.randn(n, KVH, D, **kv)}


def test_a_whole_step_graph_that_gave_its_padding_row_back_runs_no_more_steps():
    e = Engine(4)
    graph = _bucket_of_4(e)
    e.graph_step(graph, [0, 1], _inputs(2))   # padded to 4: two lanes write the padding row
    pad = graph.pad_row
    graph.release_rows()
    taken = e.rtt.alloc(1)[0]   # the pool hands the row on
    assert taken == pad
    before, row = e.state(), e.rtt.req_to_token[pad].clone()
    with pytest.raises(ConfigError, match="padding row back"):
        e.graph_step(graph, [0, 1], _inputs(2))
    assert same_state(before, e.state()) and torch.equal(row, e.rtt.req_to_token[pad])


def test_a_static_input_of_a_wider_float_dtype_is_refused_not_rounded():
    e = Engine(4)
    graph = _bucket_of_4(e)
    before = e.state()
    with pytest.raises(ShapeError, match="input 'q' is torch.float64, its static buffer torch.float32"):
        e.graph_step(graph, [0, 1], _inputs(2, torch.float64))
    assert same_state(before, e.state())


def test_graph_runner_takes_int32_ids_into_its_int64_buffer_and_refuses_float_ids():
    h = _harness()
    shapes = dict(h._input_shapes(), ids=((), torch.int64))
    runner = GraphRunner(h.backend, lambda b, i: h.model_step(b, {k: v for k, v in i.items() if k != "ids"}),
                         [2], shapes, EagerAdapter())
    runner.capture()
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [5, 6], ForwardMode.EXTEND)
    batch, inputs = h.prepare(rids, [1, 1], ForwardMode.DECODE)
    before = _static(runner)
    with pytest.raises(ShapeError, match="input 'ids' is torch.float32"):
        runner.prepare(batch, dict(inputs, ids=torch.tensor([1.0, 2.0])))
    assert _same(before, _static(runner))
    runner.prepare(batch, dict(inputs, ids=torch.tensor([7, 8], dtype=torch.int32)))
    assert runner.inputs["ids"][:2].tolist() == [7, 8]
    before = _static(runner)
    with pytest.raises(ShapeError, match="input 'q0' is torch.int64, its static buffer torch.float32"):
        runner.prepare(batch, dict(inputs, q0=(inputs["q0"] * 1000).to(torch.int64)))   # ints past 2**24 would round
    assert _same(before, _static(runner))


@pytest.mark.parametrize("tpr", [0, 2.5, True])
def test_graph_runner_names_tokens_per_req_when_it_is_no_count(tpr):
    h = _harness()
    with pytest.raises(ConfigError, match="tokens_per_req must be an integer >= 1"):
        GraphRunner(h.backend, h.model_step, [2], h._input_shapes(), EagerAdapter(), ForwardMode.TARGET_VERIFY, tpr)
    assert h.backend.static is None
