"""Review 37 (triton): the portable Triton kernels (`hwkv_cuda.kernels`) under TRITON_INTERPRET=1 on CPU tensors.

What held (not tested again here): a differential hunt against `hwkv.reference` over ~2,000 random cases found no
numerical mismatch: decode (public, workspace and config paths; 1-6 splits, in-place and kernel merges, 1-8 kv heads a
program, batched heads, slots ahead), extend (prefixes, 0-token requests beside others, max_q_len above the longest
run, one-loop and int64-mask configs), tree verify (tree extend and decode over `tree_decode_list`), GQA groups 1-32,
D/Dv 1-128 (Dv != D), pages 1/3/16 in random order, windows 1..40, W >= context and W up to 2**63-1, sinks, soft-cap,
fp16/bf16/fp32/fp64 q and out of another dtype, fp8 K/V with scales, strided q/out/k_buf/v_buf views, int32 lists,
queries before the end of their list, empty batches; the TritonBackend through the harness (hybrid pools with other
SWA geometry, several windows, MIXED forwards, window layers over the full list).

What failed is below: one test per defect, each saying what is wrong and what is expected.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from hwkv.errors import HwkvError, LocError, ShapeError  # noqa: E402

from conftest import triton_runs_cpu_tensors  # noqa: E402

pytestmark = [pytest.mark.interpret, pytest.mark.usefixtures("one_thread")]

I32 = torch.int32
S, KVH, D, H = 16, 2, 8, 4


@pytest.fixture
def tk():
    triton_runs_cpu_tensors()
    import hwkv_cuda.kernels as kernels
    return kernels


def _decode_inputs(bs=2):
    """A valid decode batch: request b's 5 keys at slots 1..5 (b=0) and 6..10 (b=1), each query at position 4."""
    g = torch.Generator().manual_seed(0)
    k_buf, v_buf = torch.randn(S, KVH, D, generator=g), torch.randn(S, KVH, D, generator=g)
    q = torch.randn(bs, H, D, generator=g)
    indptr = torch.tensor([5 * b for b in range(bs + 1)], dtype=I32)
    indices = torch.arange(1, 5 * bs + 1)
    pos0 = torch.zeros(bs, dtype=torch.int64)
    q_pos = torch.full((bs,), 4, dtype=torch.int64)
    return q, k_buf, v_buf, indptr, indices, pos0, q_pos


def test_fill_kv_indices_refuses_an_indptr_past_out_instead_of_writing_past_it(tk):
    """fill_kv_indices (a public kernel; its CPU tensors' values are checkable) writes past `out` for an indptr ending
    beyond it, overwriting the caller's memory there. Expected: LocError naming indptr's end and out's entries, nothing
    written (as decode/extend refuse a kv_indptr past kv_indices)."""
    rtt = torch.arange(40).reshape(4, 10)
    big = torch.full((30,), -7, dtype=torch.int64)
    out = big[:10]                                   # the caller's list buffer: 10 entries of a larger allocation
    indptr = torch.tensor([0, 3, 15], dtype=I32)     # request 1 would take entries 3..14
    with pytest.raises(LocError, match="indptr"):
        tk.fill_kv_indices(rtt, torch.tensor([2, 0]), torch.tensor([1, 3]), indptr, out)
    assert torch.equal(big, torch.full((30,), -7, dtype=torch.int64)), f"written: {big.tolist()}"


def test_fill_kv_indices_refuses_a_row_outside_req_to_token(tk):
    """fill_kv_indices reads rows outside req_to_token for a req_pool_indices entry past its rows (garbage slots into
    the list; the torch path raises a bare IndexError). Expected: LocError naming the row and the table's rows."""
    table = torch.arange(160).reshape(16, 10)
    rtt = table[:4]                                  # a 4-row table (the rows past it are readable memory here)
    out = torch.full((10,), -7, dtype=torch.int64)
    with pytest.raises(LocError):
        tk.fill_kv_indices(rtt, torch.tensor([9, 0]), torch.tensor([1, 3]), torch.tensor([0, 3, 5], dtype=I32), out)
    assert torch.equal(out, torch.full((10,), -7, dtype=torch.int64)), f"written: {out.tolist()}"


def test_decode_workspace_of_zero_splits_is_refused_not_a_silent_no_op(tk):
    """make_decode_workspace(num_splits=0) is accepted and decode_attention with it returns without writing `out`
    (the kernel's split range divides by the split count 0; out keeps its NaN). Expected: a typed error (ConfigError
    or ShapeError naming num_splits and its minimum 1) from either call, before anything is written."""
    q, k_buf, v_buf, indptr, indices, pos0, q_pos = _decode_inputs()
    out = torch.full((2, H, D), float("nan"))
    with pytest.raises(HwkvError, match="split"):
        ws = tk.make_decode_workspace(2, H, D, 0, "cpu")
        tk.decode_attention(q, k_buf, v_buf, indptr, indices, pos0, q_pos, out, D ** -0.5, workspace=ws)


@pytest.mark.parametrize("part", ["acc", "lse"])
def test_decode_workspace_smaller_than_the_batch_is_refused(tk, part):
    """decode_attention's workspace check (`_workspace`) compares lse's rows with the batch and acc's shape past its
    first dim only: an acc of fewer rows than the batch, or an lse of fewer heads, is accepted and the split kernel
    writes its partials past them (here into the rest of the parent tensor). Expected: ShapeError naming the
    workspace's shape and the expected [>=B, H, splits, Dv] / [>=B, H, splits], nothing written."""
    q, k_buf, v_buf, indptr, indices, pos0, q_pos = _decode_inputs()
    full = tk.make_decode_workspace(2, H, D, 3, "cpu")
    full.acc.fill_(5.0)
    full.lse.fill_(5.0)
    if part == "acc":
        ws = full._replace(acc=full.acc[:1])          # 1 row for a batch of 2
        guard = full.acc[1:]
    else:
        ws = full._replace(lse=full.lse[:, :1])       # 1 head of 4
        guard = full.lse[:, 1:]
    out = torch.full((2, H, D), float("nan"))
    with pytest.raises(ShapeError, match="workspace"):
        tk.decode_attention(q, k_buf, v_buf, indptr, indices, pos0, q_pos, out, D ** -0.5, workspace=ws)
    assert torch.equal(guard, torch.full_like(guard, 5.0)), "the kernel wrote past the workspace it was handed"
    assert torch.isnan(out).all()


@pytest.mark.parametrize("name", ["q", "kv_indptr", "q_pos"])
def test_decode_refuses_a_zero_dim_tensor_with_a_shape_error(tk, name):
    """decode_attention's cached-plan key (`_public_plan`) reads `.stride(-1)` of every tensor before any check, so a
    0-dim tensor raises a bare IndexError ('Dimension specified as -1 but tensor has no dimensions'), where
    extend_attention and hwkv_cpu's decode_attention raise ShapeError. Expected: ShapeError naming the tensor."""
    q, k_buf, v_buf, indptr, indices, pos0, q_pos = _decode_inputs(bs=1)
    args = dict(q=q, kv_indptr=indptr, q_pos=q_pos)
    args[name] = torch.tensor(1.0 if name == "q" else 1)
    out = torch.full((1, H, D), 7.0)
    with pytest.raises(ShapeError, match=name):
        tk.decode_attention(args["q"], k_buf, v_buf, args["kv_indptr"], indices, pos0, args["q_pos"], out,
                            D ** -0.5)
    assert torch.equal(out, torch.full((1, H, D), 7.0))


@pytest.mark.parametrize("kernel", ["decode", "extend"])
def test_attention_refuses_sinks_that_are_no_tensor(tk, kernel):
    """sinks given as a Python list (one logit per head, as a config file holds them) raises a bare AttributeError
    ("'list' object has no attribute 'shape'" / "'dim'") from both public attention kernels. Expected: ShapeError
    naming sinks (AttentionLayer and hwkv.reference refuse it so: docs/bad-inputs.md 106, 290)."""
    q, k_buf, v_buf, indptr, indices, pos0, q_pos = _decode_inputs(bs=1)
    out = torch.full((1, H, D), 7.0)
    with pytest.raises(ShapeError, match="sinks"):
        if kernel == "decode":
            tk.decode_attention(q, k_buf, v_buf, indptr, indices, pos0, q_pos, out, D ** -0.5, None, 0.0, [0.0] * H)
        else:
            tk.extend_attention(q, k_buf, v_buf, indptr, indices, pos0, torch.tensor([0, 1], dtype=I32), q_pos, out,
                                1, D ** -0.5, None, 0.0, [0.0] * H)
    assert torch.equal(out, torch.full((1, H, D), 7.0))
