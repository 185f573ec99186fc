"""Review 37, re-review of the day's fixes (d67e02e..HEAD): where a fix is incomplete or regressed.

1. `AttentionBackend.forward`'s new identity check (the batch must be the one the last metadata step took) is
   skipped whenever that metadata is a graph refill (`and not md.graph`): after a graph step, an eager forward of
   another batch whose metadata step was refused stores its K/V at the graph's static write locs (the previous
   step's slots) silently, which docs/bad-inputs.md row 312 says is refused.
2. The staged counter (`GraphRunner.staged`) is per runner, but every runner over a backend shares the backend's
   static metadata buffers: prepare on runner A, prepare on runner B, replay A runs A's batch over B's lists.
3. `hwkv.allocator._host_ints` now compares a CPU tensor with its host copy through `check_host_copy`, which reads
   the host copy before anything checks it: a host copy on meta is a bare NotImplementedError (it was a LocError).
4. The CPU kernels' `check_tensors` (row 311) leaves out q_pos (decode) and qo_indptr / q_pos0 (extend): a list
   there is a bare AttributeError.
5. `check_store` reads `k_buf.shape[1]` before `k_buf`'s dims are checked (a flat or 0-d buffer: bare IndexError),
   and `hwkv.ops.store_kv` reads `loc.numel()` / `k_buf.device` before `check_store` runs (a list: AttributeError).
6. `cp_plan` now converts its first argument with `as_int`, which (operator.index) takes a one-element tensor of any
   shape: a forward's one-token write-loc tensor passed for the KVWriteLoc plans as many tokens as its slot number,
   where a longer tensor (and before 88a50e8, this one) is refused with LocError.
"""
from __future__ import annotations

import pytest
import torch

from hwkv import ops
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.errors import ConfigError, LocError, ShapeError
from hwkv.graph import EagerAdapter, GraphRunner
from hwkv.testing.harness import Harness, ModelGeometry
from hwkv.testing.reference_backend import ReferenceBackend
from hwkv_cpu.backend import TorchCPUBackend
from test_allocator_refusals import T, hybrid, unchanged
from test_review19_cli import world_of_one  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

META = dict(dtype=torch.int64, device="meta")


def _harness(factory=TorchCPUBackend) -> Harness:
    """Two layers (one SWA of W=4, one full), fp32 on the CPU, outputs checked against hwkv.reference."""
    g = ModelGeometry(num_layers=2, swa_every=2, window=4, num_heads=2, num_kv_heads=1, head_dim=8)
    return Harness(factory, geometry=g, size=64, size_swa=48, page_size=1, max_reqs=4, max_context_len=64)


# ---- 1. the forward's batch check is skipped after a graph step ----------------------------------------------------

@pytest.mark.parametrize("factory", [TorchCPUBackend, ReferenceBackend], ids=["cpu", "reference"])
def test_forward_after_a_graph_step_refuses_a_batch_its_metadata_step_did_not_take(factory):
    """Request a decodes through a GraphRunner (the backend keeps that graph refill's metadata); b's metadata step is
    refused; `forward(..., batch_b)` then stores b's K/V at the graph's static write loc (a's slot), silently, as the
    eager case fixed today did. Expected: ConfigError (row 312: a batch the last metadata step did not take), a's
    K/V untouched."""
    h = _harness(factory)
    h.enable_graphs([1])
    a, b = h.add_request(), h.add_request()
    h.forward([a], [5], ForwardMode.EXTEND)
    h.forward([b], [5], ForwardMode.EXTEND)
    h.forward([a], [1])                              # through the graph: backend.forward_metadata.graph is True
    loc_a = h.runner.out_cache_loc[:1].clone()
    batch_b, inputs = h.prepare([b], [1])
    stored_a = h.pool.get_key_buffer(1)[loc_a].clone()
    bad = ForwardBatch(ForwardMode.DECODE, 1, batch_b.req_pool_indices, torch.tensor([999]), batch_b.out_cache_loc)
    with pytest.raises(ShapeError):                  # b's metadata step refused (a length past the table)
        h.backend.init_forward_metadata(bad)
    with pytest.raises(ConfigError):
        h.backend.forward(inputs["q1"], inputs["k1"], inputs["v1"], h.layers[1], batch_b)
    assert torch.equal(h.pool.get_key_buffer(1)[loc_a], stored_a), "request a's K/V was overwritten by b's"


# ---- 2. the staged counter is per runner, the static metadata per backend ------------------------------------------

def test_replay_after_another_runners_prepare_on_the_same_backend_is_refused_or_right():
    """Two GraphRunners over one backend share its static lists (`init_graph_state`: shared by every runner).
    A.prepare(x), B.prepare(y), A.replay(x's step): A's `staged` still matches, so it replays x's batch over y's
    lists and write locs: outputs off by ~2.8 (and K/V stored at y's slots). Expected: refused (ConfigError, as a
    later prepare of the same runner is, row 308), or x's correct outputs."""
    h = _harness(ReferenceBackend)
    runner_a = GraphRunner(h.backend, h.model_step, [2], h._input_shapes(), EagerAdapter())
    runner_a.capture()
    runner_b = GraphRunner(h.backend, h.model_step, [2], h._input_shapes(), EagerAdapter())
    runner_b.capture()
    rids = [h.add_request() for _ in range(4)]
    h.forward(rids, [5, 6, 7, 8], ForwardMode.EXTEND)
    batch_x, inputs_x = h.prepare(rids[:2], [1, 1], ForwardMode.DECODE)
    batch_y, inputs_y = h.prepare(rids[2:], [1, 1], ForwardMode.DECODE)
    step_x = runner_a.prepare(batch_x, inputs_x)
    runner_b.prepare(batch_y, inputs_y)
    try:
        out = runner_a.replay(step_x)
    except ConfigError:
        return   # refused: fine
    h.complete(rids[:2], [1, 1], inputs_x, out)   # ReferenceMismatchError where x ran over y's metadata


# ---- 3. an allocator host copy on meta -----------------------------------------------------------------------------

@pytest.mark.parametrize("call", ["alloc_decode", "alloc_extend"])
def test_allocator_refuses_a_host_copy_on_meta_with_a_loc_error(call):
    """Regression of 4e66660/88a50e8: `_host_ints` hands a CPU tensor and its host copy to `check_host_copy`, which
    copies the host copy to the CPU before anything checks it: a meta host copy raises a bare NotImplementedError
    ('Cannot copy out of meta tensor'). Before, it was `LocError: seq_lens's host copy is on meta: it holds no
    values to read`. Expected: that LocError, nothing allocated."""
    a = hybrid()
    last = int(a.alloc(4)[3])
    if call == "alloc_decode":
        go = lambda: a.alloc_decode(T([5]), T([last]), seq_lens_cpu=torch.empty(1, **META))  # noqa: E731
    else:
        go = lambda: a.alloc_extend(T([4]), T([6]), T([last]), 2,  # noqa: E731
                                    prefix_lens_cpu=torch.empty(1, **META))
    unchanged(a, go, LocError, "meta")


# ---- 4. the CPU kernels' tensor checks miss the query positions ----------------------------------------------------

def _cpu_lists(bs=2, h=4, d=8):
    g = torch.Generator().manual_seed(0)
    k_buf, v_buf = torch.randn(16, 2, d, generator=g), torch.randn(16, 2, d, generator=g)
    q = torch.randn(bs, h, d, generator=g)
    indptr = torch.tensor([5 * b for b in range(bs + 1)], dtype=torch.int32)
    return q, k_buf, v_buf, indptr, torch.arange(1, 5 * bs + 1), torch.zeros(bs, dtype=torch.int64)


@pytest.mark.parametrize("name", ["q_pos", "qo_indptr", "q_pos0"])
def test_cpu_kernels_refuse_query_positions_that_are_no_tensor(name):
    """hwkv_cpu.kernels.decode_attention(q_pos=[4, 4]) and extend_attention(qo_indptr=[0, 1, 2] or q_pos0=[4, 4]) raise
    a bare AttributeError ('list' object has no attribute 'dim'): `_check_common`'s check_tensors leaves them out.
    Expected: ShapeError naming the argument (row 311: 'the Triton (and CPU) kernels given a list ...'), out
    untouched."""
    import hwkv_cpu.kernels as ck
    q, k_buf, v_buf, indptr, indices, pos0 = _cpu_lists()
    out = torch.full((2, 4, 8), 7.0)
    pos = [4, 4]
    with pytest.raises(ShapeError, match=name):
        if name == "q_pos":
            ck.decode_attention(q, k_buf, v_buf, indptr, indices, pos0, pos, out, 8 ** -0.5, None, 0.0, None,
                                None, None)
        else:
            qo = torch.tensor([0, 1, 2], dtype=torch.int32)
            args = dict(qo_indptr=[0, 1, 2], q_pos0=torch.tensor(pos)) if name == "qo_indptr" else \
                dict(qo_indptr=qo, q_pos0=pos)
            ck.extend_attention(q, k_buf, v_buf, indptr, indices, pos0, args["qo_indptr"], args["q_pos0"], out, 1,
                                8 ** -0.5, None, 0.0, None, None, None)
    assert torch.equal(out, torch.full((2, 4, 8), 7.0))


# ---- 5. store_kv: k_buf's dims read before they are checked; ops.store_kv reads before check_store ---------------

def _store_args():
    return dict(k_buf=torch.zeros(16, 2, 8), v_buf=torch.zeros(16, 2, 8), loc=torch.tensor([1, 2]),
                k=torch.ones(2, 2, 8), v=torch.ones(2, 2, 8))


@pytest.mark.parametrize("case", ["flat k_buf", "0-d k_buf", "list loc", "list k_buf"])
def test_ops_store_kv_refuses_malformed_buffers_and_locs_with_a_typed_error(case):
    """hwkv.ops.store_kv (every device's checked store, `check_store`): a flattened k_buf ([S * KVH * D]) or a 0-d one
    raises a bare IndexError (`kvh = k_buf.shape[1]` before `check_dims('k_buf', ...)`); a list loc or k_buf a bare
    AttributeError (`loc.numel()` / `k_buf.device.type` before `check_store`). Expected: ShapeError / LocError naming
    the argument (row 311), nothing written."""
    a = _store_args()
    if case == "flat k_buf":
        a["k_buf"] = a["k_buf"].reshape(-1)
    elif case == "0-d k_buf":
        a["k_buf"] = torch.tensor(0.0)
    elif case == "list loc":
        a["loc"] = [1, 2]
    else:
        a["k_buf"] = a["k_buf"].tolist()
    before = a["v_buf"].clone()
    with pytest.raises((ShapeError, LocError), match="k_buf|loc"):
        ops.store_kv(**a)
    assert torch.equal(a["v_buf"], before)


@pytest.mark.interpret
def test_triton_store_kv_refuses_a_flat_k_buf_with_a_shape_error():
    """hwkv_cuda.kernels.store_kv (public) with a flattened k_buf: the same bare IndexError from `check_store`.
    Expected: ShapeError naming k_buf, nothing written."""
    from conftest import triton_runs_cpu_tensors
    triton_runs_cpu_tensors()
    import hwkv_cuda.kernels as tk
    a = _store_args()
    a["k_buf"] = a["k_buf"].reshape(-1)
    with pytest.raises(ShapeError, match="k_buf"):
        tk.store_kv(**a)
    assert not a["v_buf"].any()


# ---- 6. cp_plan: a one-element loc tensor read as a token count -----------------------------------------------------

def test_cp_plan_refuses_a_one_element_loc_tensor_as_it_refuses_longer_ones(world_of_one):  # noqa: F811
    """cp_plan(write_loc.loc) (the locs tensor instead of the KVWriteLoc) of a one-token forward at slot 37 is planned
    as 37 tokens (`as_int(tensor([37]))` is 37: operator.index takes any one-element tensor), while a two-token one is
    refused. Expected: the same LocError ('write_loc must be a KVWriteLoc or an int token count ... got Tensor')."""
    from hwkv.distributed import cp_plan
    with pytest.raises(LocError, match="KVWriteLoc"):
        cp_plan(torch.tensor([3, 4]))
    with pytest.raises(LocError, match="KVWriteLoc"):
        cp_plan(torch.tensor([37]))
