"""The CPU dense path's host-lean layouts: one request's plan (its slots, no row table) against the chunked
kernels, for decode and extend, windows, sinks, soft-cap and reduced-precision pools."""
import pytest
import torch

from test_cpu_kernels import FP8, Case, _dense, _tol  # noqa: E402


@pytest.mark.parametrize("window", [None, 1, 3, 9])
@pytest.mark.parametrize("window_list", [True, False])
@pytest.mark.parametrize("mode", ["decode", "extend", "prefill"])
def test_one_request_matches_chunked_kernels(window, window_list, mode):
    seq, ext = {"decode": (17, 1), "extend": (23, 6), "prefill": (12, 12)}[mode]
    case = Case([seq], [ext], h=6, kvh=2, d=8, dv=12, window=window, window_list=window_list, seed=11)
    dense_mode = "decode" if mode == "decode" else "extend"
    got = _dense(case, dense_mode, window)
    assert got is not None
    from hwkv_cpu.kernels_dense import plan_dense  # the plan holds the list's slots themselves

    plan = plan_dense(case.kv_indptr, case.kv_indices, case.kv_pos0, torch.tensor(case.q_pos0),
                      None if mode == "decode" else case.qo_indptr, int(case.kv_indptr[-1]), ext, window or 0, 2, 3,
                      8, 12)
    assert plan.rows.shape[0] == plan.keys
    want = case.decode(q=case.q[-1:]) if mode == "decode" else case.extend()
    torch.testing.assert_close(got, want, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_one_request_sinks_softcap_scales_reduced_out(mode):
    ext = 5 if mode == "extend" else 1
    for dtype in (torch.float32, torch.bfloat16, *FP8):
        case = Case([14], [ext], h=4, kvh=1, d=16, dv=8, dtype=dtype, window=5,
                    k_scale=0.5 if dtype in FP8 else None, v_scale=2.0 if dtype in FP8 else None, seed=12)
        sinks = torch.randn(4)
        for cap, s, out_dtype in ((0.0, sinks, None), (20.0, None, torch.bfloat16), (7.0, sinks, torch.float32)):
            got = _dense(case, mode, 5, cap, s, out_dtype)
            if mode == "decode":
                want = case.decode(cap, s, out_dtype, q=case.q[-1:])
            else:
                want = case.extend(cap, s, out_dtype)
            tol = max(_tol(dtype, got.dtype), 3e-5 if got.dtype == torch.float32 else 2e-2)
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
