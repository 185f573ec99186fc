"""The page-op kernels (the allocation, the one-launch decode step, the claim's give-back) build for sm_90 without a
GPU, in every variant a step graph launches: the interpreter runs them in CI but does not type-check them as the
compiler does. `make test` runs these under TRITON_INTERPRET=0 after the main suite, beside the decode and Gluon
extend builds."""
import pytest

pytest.importorskip("triton")

from hwkv_cuda.kernels import alloc as A  # noqa: E402
from hwkv_cuda.kernels.common import build_for_sm90  # noqa: E402

from test_extend_hopper import _build_reason  # noqa: E402

P = "*i64"
ALLOC_SIG = dict(seq=P, prefix=P, last=P, out=P, buf_f=P, head_f="i64", n_full="i32", buf_s=P, head_s="i64",
                 n_swa="i32", mapping=P, opk="i64", heads=P, claim="i64")
STEP_SIG = dict(ctl=P, rows_in=P, seq_in=P, stride_in="i64", pad_row="i64", rtt=P, stride_rtt="i64", rows=P, seq=P,
                out=P, buf_f=P, n_full="i32", buf_s=P, n_swa="i32", mapping=P, opk="i64", opk_release="i64", bs="i32",
                frontiers=P, window="i32")


@pytest.mark.skipif(_build_reason() is not None, reason=str(_build_reason()))
@pytest.mark.parametrize("hybrid", [False, True], ids=["full", "hybrid"])
@pytest.mark.parametrize("claim_ptr", [False, True], ids=["host-claim", "claim-on-device"])
def test_page_ops_compiles_for_sm90_without_a_gpu(hybrid, claim_ptr):
    ptrs = [k for k, v in ALLOC_SIG.items() if v == P]
    build_for_sm90(A._alloc_kernel, ALLOC_SIG,
                   dict(P=16, HYBRID=hybrid, DECODE=False, HEADS_PTR=claim_ptr, OP_PTR=claim_ptr, CLAIM_PTR=claim_ptr,
                        BLOCK_B=256, BLOCK_P=16, BLOCK=256), ptrs, dict(num_warps=4))
    ptrs = [k for k, v in STEP_SIG.items() if v == P]
    for advance in (False, True):
        build_for_sm90(A._alloc_step_kernel, STEP_SIG,
                       dict(P=16, HYBRID=hybrid, BLOCK_P=16, ADVANCE=advance, RELEASE=hybrid, OP_PTR=True,
                            CLAIM_PTR=claim_ptr, BLOCK=256), ptrs, dict(num_warps=4))
    build_for_sm90(A._give_back_all_kernel, dict(heads=P, buf_f=P, n_full="i32", buf_s=P, n_swa="i32"),
                   dict(HYBRID=hybrid, BLOCK=1024), ["heads", "buf_f", "buf_s"], dict(num_warps=4))
