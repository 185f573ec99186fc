"""Review 19, NPU: the v2 op's learnable_sink rules (hicann/ops-transformer
attention/fused_infer_attention_score/docs/aclnnFusedInferAttentionScoreV4.md, row learnableSinkOptional:
BFLOAT16/FLOAT16, shape (Q_N), V_D 128/64 only) and v2's own graph entry points (Ascend/op-plugin
FusedInferAttentionScoreV2KernelNpuOpApi.cpp: `.out` and `_npu_fused_infer_attention_score_v2_get_max_workspace`),
run against the stand-ins of hwkv.testing.vendor_schemas.npu (the `npu_standin` fixture) as
tests/test_vendor_backends.py does.
"""
import pytest
import torch

from hwkv.batch import ForwardMode
from hwkv.paths import FUSED, TORCH, LayerFacts
from hwkv.testing.harness import Harness, ModelGeometry, run_scenario
from hwkv.testing.vendor_schemas import VendorCallError
from hwkv_npu import fia
from hwkv_npu.backend import NPUBackend

F16 = torch.float16


from test_vendor_backends import _one_thread  # noqa: E402,F401  (autouse: one thread for tiny tensors)


def _v2_standin(d):
    """The stand-in's v2 op and one decode call's arguments at head dim d (two requests over page 16)."""
    from hwkv.testing.vendor_schemas import npu as npu_si

    op = npu_si.make_torch_npu().npu_fused_infer_attention_score_v2
    q = torch.randn(2, 1, 4, d, dtype=F16)
    cache = torch.randn(4, 16, 2 * d, dtype=F16)
    kw = dict(num_query_heads=4, num_key_value_heads=2, input_layout="BSND", softmax_scale=0.125, block_size=16,
              block_table=torch.tensor([[1, 2], [3, 0]], dtype=torch.int32), actual_seq_kvlen=[20, 9])
    return op, q, cache, kw


def _sink_geometry(head_dim=64, swa_only=False):
    return ModelGeometry(num_layers=2, swa_every=2, window=7, num_heads=4, num_kv_heads=2, head_dim=head_dim,
                         sinks=not swa_only, swa_sinks=True)


def _v2_calls(mod):
    return mod.npu_fused_infer_attention_score_v2.calls + mod.npu_fused_infer_attention_score_v2.out.calls


def _facts(head_dim, sinks=True, graph=False):
    return LayerFacts("decode", False, sinks, 0.0, F16, F16, head_dim, head_dim, 8, 2, False, 16, graph)


# ---- W1: learnable_sink in the query's dtype, from a copy kept per layer ------------------------------------
def test_standin_refuses_sinks_outside_bf16_fp16_or_of_another_shape():
    op, q, cache, kw = _v2_standin(64)
    for dtype in (F16, torch.bfloat16):
        op(q, cache, cache, learnable_sink=torch.zeros(4, dtype=dtype), **kw)
    for bad in (torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.zeros(1, 4, dtype=F16)):
        with pytest.raises(VendorCallError, match="learnable_sink must be BFLOAT16/FLOAT16"):
            op(q, cache, cache, learnable_sink=bad, **kw)


@pytest.mark.parametrize("dtype", [F16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_v2_gets_the_sinks_in_the_querys_dtype_from_one_kept_copy(npu_standin, dtype, graph):
    """The layers' sinks are fp32 (as many checkpoints keep them): every v2 call gets them cast to the query's
    dtype, shape (H,), and each layer always the same kept tensor (a captured call keeps its address)."""
    h = Harness(NPUBackend, "cpu", _sink_geometry(), size=1024, size_swa=256, page_size=16, dtype=dtype)
    assert all(layer.sinks.dtype == torch.float32 for layer in h.layers)
    if graph:
        h.enable_graphs([1, 2], npu_standin.graphs())
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [1, 1], ForwardMode.EXTEND)  # one row per request: the decode call form, fused at page 16
    for _ in range(3):
        h.forward(rids, [1, 1], ForwardMode.DECODE)  # checked against the reference inside
    calls = _v2_calls(npu_standin.mod)
    assert calls and (not graph or npu_standin.mod.npu_fused_infer_attention_score_v2.out.calls)
    assert all(c["learnable_sink"].dtype == c["query"].dtype == dtype for c in calls)
    assert all(tuple(c["learnable_sink"].shape) == (4,) for c in calls)
    kept = {c["learnable_sink"].data_ptr() for c in calls}
    assert len(kept) == len(h.layers) and not kept & {layer.sinks.data_ptr() for layer in h.layers}


def test_kept_sinks_follow_loads_and_reassignment_between_replays(npu_standin):
    """Graph replays after the sinks change: loaded in place through `.data` (no version bump) and replaced by
    another tensor. The kept copy is refreshed in place before each replay's task updates, so every replay matches
    the reference of the sinks as they are now, and the calls keep reading the one kept tensor per layer."""
    h = Harness(NPUBackend, "cpu", _sink_geometry(), size=1024, size_swa=256, page_size=16, dtype=F16)
    h.enable_graphs([2], npu_standin.graphs())
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [5, 19], ForwardMode.EXTEND)
    h.forward(rids, [1, 1], ForwardMode.DECODE)
    gen = torch.Generator().manual_seed(7)
    for layer in h.layers:
        layer.sinks.data.copy_(torch.randn(4, generator=gen) * 3)  # a weight load: no version bump
    h.forward(rids, [1, 1], ForwardMode.DECODE)  # checked against the reference of the new sinks inside
    for layer in h.layers:
        layer.sinks = torch.randn(4, generator=gen) * 3  # another tensor
    h.forward(rids, [1, 1], ForwardMode.DECODE)
    assert h.runner.replays == 3
    out_calls = npu_standin.mod.npu_fused_infer_attention_score_v2.out.calls
    assert out_calls and len({c["learnable_sink"].data_ptr() for c in out_calls}) == len(h.layers)


# ---- W2: learnable_sink only with V_D 64 or 128 --------------------------------------------------------------
@pytest.mark.parametrize("head_dim", [16, 32, 80, 256])
def test_decide_sends_sink_layers_of_other_head_dims_to_torch(npu_standin, head_dim):
    env = fia.load_env(npu_standin.mod)  # a release with v2's learnable_sink and its graph entry points
    path = fia.decide(_facts(head_dim), env)
    assert path.path == TORCH and path.why == f"sinks with Dv={head_dim}: v2's learnable_sink takes V_D 64 or 128 only"
    assert fia.decide(_facts(head_dim, sinks=False), env).path == FUSED, "the same layer without sinks stays fused"
    for d in fia.SINK_DV:
        assert fia.decide(_facts(d), env).path == FUSED


def test_sink_layers_of_head_dim_32_run_the_torch_path(npu_standin):
    """Sinks on the SWA layers only, D = 32: the full layer keeps v1, the sink layers never reach v2."""
    h = Harness(NPUBackend, "cpu", _sink_geometry(head_dim=32, swa_only=True), size=1024, size_swa=256,
                page_size=128, dtype=F16)
    run_scenario(h, steps=3, prompt_lens=(5, 20), chunk=16)
    assert npu_standin.mod.npu_fused_infer_attention_score.calls
    assert not _v2_calls(npu_standin.mod)


def test_standin_refuses_sinks_with_other_value_head_dims():
    op, q, cache, kw = _v2_standin(32)
    op(q, cache, cache, **kw)  # without sinks: any D % 16 == 0
    with pytest.raises(VendorCallError, match="V_D 64 or 128"):
        op(q, cache, cache, learnable_sink=torch.zeros(4, dtype=F16), **kw)


# ---- W3: sink layers in graphs need v2's .out and its workspace query ---------------------------------------
def _drop(mod, entry):
    if entry == "out":
        del mod.npu_fused_infer_attention_score_v2.overloads["out"]
        return f"{fia.V2}.out"
    delattr(mod, f"_{fia.V2}_get_max_workspace")
    return f"_{fia.V2}_get_max_workspace"


@pytest.mark.parametrize("entry", ["out", "workspace"])
def test_env_without_v2_graph_entry_points_keeps_sink_layers_off_graphs(npu_standin, entry):
    missing = _drop(npu_standin.mod, entry)
    env = fia.load_env(npu_standin.mod)
    assert env.fused and env.sinks and env.graph and not env.graph_sinks and missing in env.graph_sinks_why
    eager, graph = fia.decide(_facts(64), env), fia.decide(_facts(64, graph=True), env)
    assert eager.path == FUSED and graph.path == TORCH
    assert graph.why == f"graph replay with sinks: torch_npu lacks v2's graph entry points ({missing})"
    assert fia.decide(_facts(64, sinks=False, graph=True), env).path == FUSED, "v1 layers keep their graphs"
    assert fia.load_env(npu_standin.use().mod).graph_sinks


@pytest.mark.parametrize("entry", ["out", "workspace"])
def test_graphs_without_v2_graph_entry_points_run_sink_layers_on_torch(npu_standin, entry):
    """Capture and replays work (no AttributeError at capture): the sink layers run the torch path in the graph,
    the full layer (no sinks) keeps v1's task groups, and eager forwards still take v2."""
    _drop(npu_standin.mod, entry)
    h = Harness(NPUBackend, "cpu", _sink_geometry(swa_only=True), size=1024, size_swa=256, page_size=16, dtype=F16)
    h.enable_graphs([1, 2], npu_standin.graphs())
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [1, 1], ForwardMode.EXTEND)  # eager, one row per request: the decode form, v2 for sinks
    eager_v2 = len(npu_standin.mod.npu_fused_infer_attention_score_v2.calls)
    for step in range(3):
        h.forward(rids[:1 + step % 2], [1] * (1 + step % 2), ForwardMode.DECODE)  # checked inside
    assert h.runner.replays == 3 and eager_v2 > 0
    assert len(npu_standin.mod.npu_fused_infer_attention_score_v2.calls) == eager_v2, "no v2 in the graphs"
    assert npu_standin.mod.npu_fused_infer_attention_score.out.calls


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_sinks_already_in_the_querys_dtype_go_to_v2_as_they_are(npu_standin, graph):
    """bf16 sinks beside bf16 queries (a bf16 checkpoint): no kept copy and nothing to refresh per forward (a copy
    launch per sink layer per step would be host cost for nothing); the op reads the layer's own tensor."""
    h = Harness(NPUBackend, "cpu", _sink_geometry(), size=1024, size_swa=256, page_size=16, dtype=torch.bfloat16)
    for layer in h.layers:
        layer.sinks = layer.sinks.to(torch.bfloat16)
    if graph:
        h.enable_graphs([1, 2], npu_standin.graphs())
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [1, 1], ForwardMode.EXTEND)
    for _ in range(3):
        h.forward(rids, [1, 1], ForwardMode.DECODE)  # checked against the reference inside
    calls = _v2_calls(npu_standin.mod)
    assert calls and {c["learnable_sink"].data_ptr() for c in calls} <= {layer.sinks.data_ptr() for layer in h.layers}
    assert not h.backend._sinks._kept
