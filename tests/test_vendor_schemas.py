"""The vendor stand-ins (hwkv.testing.vendor_schemas) refuse what the vendor refuses: a wrong argument name,
kind, dtype or layout fails in CPU CI. And the names hwkv verifies at run time are the stand-ins' names."""
from __future__ import annotations

import inspect

import pytest
import torch

from hwkv.testing.vendor_schemas import VendorCallError
from hwkv.testing.vendor_schemas import aiter as aiter_si
from hwkv.testing.vendor_schemas import npu as npu_si
from hwkv.testing.vendor_schemas import sgl_kernel as sgl_si

F16 = torch.float16


# ---- the schemas hwkv checks installed libraries against ---------------------------------------------
def test_hwkv_checks_installed_libraries_against_these_schemas():
    from hwkv_cpu import amx
    from hwkv_npu import fia
    from hwkv_rocm import aiter_ops

    mod = aiter_si.make_aiter()
    assert aiter_ops._param_names(mod.paged_attention_ragged)[:len(aiter_ops.EXPECTED_PARAMS)] == aiter_ops.EXPECTED_PARAMS
    names = aiter_ops._param_names(mod.mha_batch_prefill_func)
    assert names[:8] == aiter_ops.PREFILL_POSITIONAL and set(aiter_ops.PREFILL_KEYWORDS) <= set(names)
    assert set(fia.V1_ARGS) <= set(npu_si.FIA.names) and set(fia.V2_ARGS) <= set(npu_si.FIA_V2.names)
    decode, extend = sgl_si.make_sgl_ops()
    assert amx._schema_names(decode) == amx._DECODE_SCHEMA and amx._schema_names(extend) == amx._EXTEND_SCHEMA
    assert aiter_ops.load_paged_attention_ragged  # the loaders read the same names from the real modules


def test_keyword_only_arguments_stay_keyword_only():
    sig = npu_si.FIA.signature()
    assert [p.name for p in sig.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY][:2] == \
        ["pse_shift", "atten_mask"]
    q = torch.zeros(1, 1, 2, 16, dtype=F16)
    with pytest.raises(VendorCallError, match="positional"):
        npu_si.make_torch_npu().npu_fused_infer_attention_score(q, q, q, None)


# ---- AITER -------------------------------------------------------------------------------------------
def _ragged_args(**over):
    s, h, kvh, d, n = 2, 4, 2, 64, 5
    kw = dict(out=torch.zeros(s, h, d, dtype=F16), workspace_buffer=torch.zeros(s * h * (d * 4 + 8), dtype=torch.uint8),
              query=torch.randn(s, h, d, dtype=F16), key_cache=torch.randn(n, 1, kvh, d, dtype=F16),
              value_cache=torch.randn(n, 1, kvh, d, dtype=F16), scale=0.125,
              kv_indptr=torch.tensor([0, 2, 5], dtype=torch.int32), kv_page_indices=torch.arange(5, dtype=torch.int32),
              kv_last_page_lens=torch.ones(2, dtype=torch.int32), block_size=1, max_num_partitions=1,
              alibi_slopes=None, kv_cache_dtype="auto", kv_cache_layout="NHD", logits_soft_cap=0.0,
              k_scale=torch.ones(1), v_scale=torch.ones(1), fp8_out_scale=None, partition_size=256)
    kw.update(over)
    return kw


def test_paged_attention_ragged_accepts_hwkvs_call_and_refuses_wrong_ones():
    op = aiter_si.make_aiter().paged_attention_ragged
    op(**_ragged_args())
    bad = [(dict(kv_page_indices=torch.arange(5)), "int32"),                     # int64 indices
           (dict(k_scale=torch.ones(1, dtype=torch.float16)), "float32"),        # scale read through float*
           (dict(kv_cache_layout="NDH"), "kv_cache_layout"),
           (dict(kv_cache_dtype="fp8"), "one byte"),                             # fp16 cache called fp8
           (dict(key_cache=torch.randn(5, 2, 64, dtype=F16)), "4-D"),            # 3-D cache
           (dict(block_size=16), "block_size")]
    for over, match in bad:
        with pytest.raises(VendorCallError, match=match):
            op(**_ragged_args(**over))
    kw = _ragged_args()
    kw["logit_cap"] = kw.pop("logits_soft_cap")
    with pytest.raises(VendorCallError, match="logits_soft_cap"):  # a misspelled argument
        op(**kw)


def test_mha_batch_prefill_refuses_wrong_ones():
    op = aiter_si.make_aiter().mha_batch_prefill_func
    q, k = torch.randn(6, 4, 64, dtype=F16), torch.randn(10, 2, 64, dtype=F16)
    i32 = dict(dtype=torch.int32)
    args = (q, k, k, torch.tensor([0, 6], **i32), torch.tensor([0, 8], **i32), torch.arange(8, **i32), 6, 8)
    op(*args, causal=True, window_size=(3, 0))
    with pytest.raises(VendorCallError, match="window_size"):
        op(*args, causal=True, window_size=3)
    with pytest.raises(VendorCallError, match="dtypes must match"):
        op(q, k.float(), k, *args[3:], causal=True)
    with pytest.raises(VendorCallError, match="int32"):
        op(*args[:5], torch.arange(8), 6, 8, causal=True)
    with pytest.raises(VendorCallError, match="max_seqlen"):
        op(*args[:6], 6, 4, causal=True)


# ---- torch_npu ---------------------------------------------------------------------------------------
def _fia_kw(d=16, **over):
    b, n, kvh, p = 2, 4, 2, 16
    kw = dict(num_heads=n, num_key_value_heads=kvh, input_layout="BSND", scale=0.25,
              block_table=torch.tensor([[1, 2], [3, 0]], dtype=torch.int32), block_size=p,
              actual_seq_lengths_kv=[20, 9])
    kw.update(over)
    q = torch.randn(b, 1, n, d, dtype=F16)
    cache = torch.randn(4, p, kvh * d, dtype=F16)
    return q, cache, kw


def test_fused_infer_attention_accepts_hwkvs_call_and_refuses_wrong_ones():
    mod = npu_si.make_torch_npu()
    op = mod.npu_fused_infer_attention_score
    q, cache, kw = _fia_kw()
    out, _ = op(q, cache, cache, **kw)
    assert out.shape == (2, 1, 4, 16)
    bad = [(dict(block_table=torch.tensor([[1, 2], [3, 0]])), "int32"),
           (dict(actual_seq_lengths_kv=torch.tensor([20, 9])), "int\\[\\]"),      # a device tensor, not a host list
           (dict(actual_seq_lengths_kv=[40, 9]), "capacity"),
           (dict(block_size=24), "block_size"),
           (dict(num_key_value_heads=3), "num_key_value_heads"),
           (dict(input_layout="TND"), "BSND/BSH"),
           (dict(atten_mask=torch.zeros(2, 1, 1, 8, dtype=torch.bool)), "KV_S")]
    for over, match in bad:
        q, cache, kw = _fia_kw(**over)
        with pytest.raises(VendorCallError, match=match):
            op(q, cache, cache, **kw)
    q, cache, kw = _fia_kw()
    kw["scale_value"] = kw.pop("scale")  # the older release's name: not this schema's
    with pytest.raises(VendorCallError, match="scale_value"):
        op(q, cache, cache, **kw)
    with pytest.raises(VendorCallError, match="query's"):
        q, cache, kw = _fia_kw()
        op(q, cache.float(), cache.float(), **kw)


def test_prefill_page_sizes_and_masks_are_checked():
    op = npu_si.make_torch_npu().npu_fused_infer_attention_score
    q = torch.randn(1, 3, 4, 16, dtype=F16)
    cache = torch.randn(2, 128, 32, dtype=F16)
    kw = dict(num_heads=4, num_key_value_heads=2, input_layout="BSND", block_table=torch.tensor([[0]], dtype=torch.int32),
              block_size=128, actual_seq_lengths_kv=[10], actual_seq_lengths=[3], sparse_mode=3,
              atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu_(1))
    op(q, cache, cache, **kw)
    with pytest.raises(VendorCallError, match="lower-triangular"):
        op(q, cache, cache, **dict(kw, atten_mask=torch.ones(2048, 2048, dtype=torch.bool).tril_(-1)))
    small = torch.randn(16, 16, 32, dtype=F16)
    with pytest.raises(VendorCallError, match="multiple of 128"):
        op(q, small, small, **dict(kw, block_size=16))


def test_v2_sink_and_out_overload_are_checked():
    mod = npu_si.make_torch_npu()
    q, cache, kw = _fia_kw(d=64)  # learnable_sink: V_D 64 or 128 only
    kw2 = {"num_query_heads" if k == "num_heads" else "softmax_scale" if k == "scale" else
           "actual_seq_kvlen" if k == "actual_seq_lengths_kv" else k: v for k, v in kw.items()}
    mod.npu_fused_infer_attention_score_v2(q, cache, cache, learnable_sink=torch.zeros(4, dtype=F16), **kw2)
    with pytest.raises(VendorCallError, match="learnable_sink"):
        mod.npu_fused_infer_attention_score_v2(q, cache, cache, learnable_sink=torch.zeros(2, dtype=F16), **kw2)
    with pytest.raises(VendorCallError, match="learnable_sink"):  # a release without it
        npu_si.make_torch_npu(v2_sinks=False).npu_fused_infer_attention_score_v2(
            q, cache, cache, learnable_sink=torch.zeros(4, dtype=F16), **kw2)
    out = mod.npu_fused_infer_attention_score.out
    with pytest.raises(VendorCallError, match="out"):
        out(q, cache, cache, workspace=torch.zeros(8, dtype=torch.uint8), **kw)  # out= missing
    with pytest.raises(VendorCallError, match="attention_out"):
        out(q, cache, cache, workspace=torch.zeros(8, dtype=torch.uint8), **kw,
            out=[torch.zeros(2, 1, 4, 16), torch.zeros(1)])  # fp32 out for fp16 q


def test_graph_task_updates_follow_the_documented_protocol():
    mod = npu_si.make_torch_npu()
    rt, op = mod.npu, mod.npu_fused_infer_attention_score.out
    q, cache, kw = _fia_kw()
    ws = mod._npu_fused_infer_attention_score_get_max_workspace(q, cache, cache, **kw)
    out = [torch.zeros(2, 1, 4, 16, dtype=F16), torch.zeros(1)]
    g = rt.NPUGraph()
    with rt.graph(g):
        s = rt.current_stream()
        ev = rt.ExternalEvent()
        ev.wait(s)
        ev.reset(s)
        rt.graph_task_group_begin(s)
        op(q, cache, cache, workspace=ws, **kw, out=out)
        handle = rt.graph_task_group_end(s)
    with pytest.raises(VendorCallError, match="not updated"):
        g.replay()
    with pytest.raises(VendorCallError, match="differ from the capture stream"):
        rt.graph_task_update_begin(s, handle)
    upd = rt.Stream()
    rt.graph_task_update_begin(upd, handle)
    with pytest.raises(VendorCallError, match="captured"):  # another output buffer than the captured one
        op(q, cache, cache, workspace=ws, **kw, out=[torch.zeros(2, 1, 4, 16, dtype=F16), out[1]])
    op(q, cache, cache, workspace=ws, **dict(kw, actual_seq_lengths_kv=[5, 3]), out=out)
    rt.graph_task_update_end(upd)
    ev.record(upd)
    g.replay()
    assert handle.params["actual_seq_lengths_kv"] == [5, 3] and handle.updates == 1


def test_reshape_and_cache_refuses_wrong_ones():
    op = npu_si.make_torch_npu()._npu_reshape_and_cache
    k = torch.randn(3, 2, 16, dtype=F16)
    cache = torch.zeros(4, 16, 2, 16, dtype=F16)
    op(k, k, cache, cache.clone(), torch.tensor([1, 17, 40], dtype=torch.int32))
    with pytest.raises(VendorCallError, match="int32"):
        op(k, k, cache, cache.clone(), torch.tensor([1, 17, 40]))
    with pytest.raises(VendorCallError, match="4-D"):
        op(k, k, cache.view(64, 2, 16), cache.clone(), torch.tensor([1, 17, 40], dtype=torch.int32))
    with pytest.raises(VendorCallError, match="slot_indices"):
        op(k, k, cache, cache.clone(), slots=torch.tensor([1, 17, 40], dtype=torch.int32))


# ---- sgl-kernel --------------------------------------------------------------------------------------
def test_sgl_kernel_ops_refuse_wrong_ones():
    decode, _ = sgl_si.make_sgl_ops()
    bs, h, kvh, d = 2, 4, 2, 32
    bf = torch.bfloat16
    kc, vc = torch.randn(16, kvh, d, dtype=bf), torch.randn(16, kvh, d, dtype=bf)
    args = dict(query=torch.randn(bs, h, d, dtype=bf), k_cache=kc, v_cache=vc, output=torch.zeros(bs, h, d, dtype=bf),
                key=kc[:2].clone(), value=vc[:2].clone(), loc=torch.zeros(bs, dtype=torch.int64),
                attn_logits=torch.zeros(bs, h, 8, d + 1), req_to_token=torch.arange(16).view(2, 8),
                req_pool_indices=torch.arange(2), seq_lens=torch.tensor([3, 5]), sm_scale=0.2, logit_cap=0.0)
    decode(**args)
    with pytest.raises(VendorCallError, match="int64"):
        decode(**dict(args, seq_lens=torch.tensor([3, 5], dtype=torch.int32)))
    with pytest.raises(VendorCallError, match="one reduced dtype"):
        decode(**dict(args, output=torch.zeros(bs, h, d)))
    with pytest.raises(VendorCallError, match="attn_logits"):
        decode(**dict(args, attn_logits=torch.zeros(bs, h, 8, d)))
    with pytest.raises(VendorCallError, match="v_cahce|v_cache"):
        wrong = dict(args)
        wrong["v_cahce"] = wrong.pop("v_cache")
        decode(**wrong)


def test_sgl_kernel_extend_wants_extend_lens_in_req_to_tokens_dtype():
    """extend.cpp: "expect extend_seq_lens and extend_start_loc to have same dtype as req_to_token" (int32 or
    int64 alike); seq_lens and req_pool_indices stay int64. hwkv passes int64 for all three."""
    _, extend = sgl_si.make_sgl_ops()
    t, h, kvh, d = 5, 4, 2, 32
    bf, i32 = torch.bfloat16, torch.int32
    kb, vb = torch.randn(16, kvh, d, dtype=bf), torch.randn(16, kvh, d, dtype=bf)
    args = dict(q_extend=torch.randn(t, h, d, dtype=bf), k_extend=torch.randn(t, kvh, d, dtype=bf),
                v_extend=torch.randn(t, kvh, d, dtype=bf), o_extend=torch.zeros(t, h, d, dtype=bf), k_buffer=kb,
                v_buffer=vb, req_to_token=torch.arange(16).view(2, 8), req_pool_indices=torch.arange(2),
                seq_lens=torch.tensor([3, 6]), extend_seq_lens=torch.tensor([2, 3]),
                extend_start_loc=torch.tensor([0, 2]), max_len_extend=3, sm_scale=0.2, logit_cap=0.0)
    extend(**args)  # int64 throughout: hwkv's call
    extend(**dict(args, req_to_token=args["req_to_token"].to(i32), extend_seq_lens=args["extend_seq_lens"].to(i32),
                  extend_start_loc=args["extend_start_loc"].to(i32)))  # int32 throughout
    for over in (dict(req_to_token=args["req_to_token"].to(i32)),        # int32 table, int64 extend lengths
                 dict(extend_seq_lens=args["extend_seq_lens"].to(i32)),
                 dict(extend_start_loc=args["extend_start_loc"].to(i32))):
        with pytest.raises(VendorCallError, match="req_to_token's dtype"):
            extend(**dict(args, **over))
    with pytest.raises(VendorCallError, match="int64"):
        extend(**dict(args, seq_lens=args["seq_lens"].to(i32)))
