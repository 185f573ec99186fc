"""The public attention kernels refuse bad index lists and dtypes with a typed error, and write nothing.

Both kernel sets (`hwkv_cpu.kernels`, and `hwkv_cuda.kernels` under TRITON_INTERPRET=1 on CPU) check that the
index tensors are int32/int64 and q/out/sinks (and the buffers) floating point; where values are checkable
(CPU tensors, or HWKV_DEBUG: `hwkv.checks.values_checkable`) that each indptr starts at >= 0, never decreases
and ends inside what it indexes (qo_indptr: q's rows; kv_indptr: kv_indices' entries), and that the used
entries of kv_indices lie in the pool's slots. Entries of kv_indices past kv_indptr[-1] stay unspecified.
The planned per-layer calls compare tuples only: no value check is added there.
"""
import pytest
import torch
from conftest import triton_runs_cpu_tensors

from hwkv import csr_checks
from hwkv.errors import LocError, ShapeError
from hwkv.spec import TreeMask

triton = pytest.importorskip("triton")

import hwkv_cpu.kernels as cpu_kernels  # noqa: E402
import hwkv_cuda.kernels as triton_kernels  # noqa: E402
from hwkv_cuda.kernels import decode as triton_decode  # noqa: E402
from hwkv_cuda.kernels import extend as triton_extend  # noqa: E402

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("one_thread")]

S, KVH, D, H = 16, 2, 8, 4
I32, I64 = torch.int32, torch.int64
KERNELS = {"cpu": cpu_kernels, "triton": triton_kernels}


def buffers():
    g = torch.Generator().manual_seed(0)
    return torch.randn(S, KVH, D, generator=g), torch.randn(S, KVH, D, generator=g)


def guarded_out(rows, fill=7.0):
    """An output of `rows` rows, the first rows of a larger tensor: rows past it must stay untouched too."""
    big = torch.full((rows + 8, H, D), fill)
    return big, big[:rows]


def decode_args(**over):
    """A valid decode call (one request, keys at slots 1..5, query at position 4) with `over` replaced."""
    k_buf, v_buf = buffers()
    args = dict(q=torch.randn(1, H, D), k_buf=k_buf, v_buf=v_buf, kv_indptr=torch.tensor([0, 5], dtype=I32),
                kv_indices=torch.arange(1, 6), kv_pos0=torch.tensor([0]), q_pos=torch.tensor([4]), sinks=None)
    args.update(over)
    if "out" not in args:
        args["big"], args["out"] = guarded_out(args["q"].shape[0])
    return args


def extend_args(**over):
    """A valid extend call (one request of 3 rows at positions 2..4 over keys 1..5) with `over` replaced."""
    k_buf, v_buf = buffers()
    args = dict(q=torch.randn(3, H, D), k_buf=k_buf, v_buf=v_buf, kv_indptr=torch.tensor([0, 5], dtype=I32),
                kv_indices=torch.arange(1, 6), kv_pos0=torch.tensor([0]), qo_indptr=torch.tensor([0, 3], dtype=I32),
                q_pos0=torch.tensor([2]), sinks=None, tree=None)
    args.update(over)
    if "out" not in args:
        args["big"], args["out"] = guarded_out(args["q"].shape[0])
    return args


def run_decode(kern, a):
    kern.decode_attention(a["q"], a["k_buf"], a["v_buf"], a["kv_indptr"], a["kv_indices"], a["kv_pos0"], a["q_pos"],
                          a["out"], D ** -0.5, None, 0.0, a["sinks"], None, None)


def run_extend(kern, a):
    tree = {} if a["tree"] is None else {"tree": a["tree"]}
    kern.extend_attention(a["q"], a["k_buf"], a["v_buf"], a["kv_indptr"], a["kv_indices"], a["kv_pos0"],
                          a["qo_indptr"], a["q_pos0"], a["out"], a["q"].shape[0], D ** -0.5, None, 0.0, a["sinks"],
                          None, None, **tree)


def refused(run, kern, a, error, match):
    """`run` raises `error` matching `match`, and neither out nor the memory past it (nor the pool) changed."""
    big, k, v = a["big"].clone(), a["k_buf"].clone(), a["v_buf"].clone()
    with pytest.raises(error, match=match):
        run(kern, a)
    assert torch.equal(a["big"], big), "out (or the memory past it) was written by a refused call"
    assert torch.equal(a["k_buf"], k) and torch.equal(a["v_buf"], v)


@pytest.fixture(params=sorted(KERNELS))
def kern(request):
    return KERNELS[request.param]


# ---- index values ---------------------------------------------------------------------------------------------

def test_extend_refuses_qo_indptr_past_q(kern):
    refused(run_extend, kern, extend_args(qo_indptr=torch.tensor([0, 6], dtype=I32)), LocError,
            r"qo_indptr ends at 6, past q's 3 rows")


def test_extend_refuses_decreasing_qo_indptr(kern):
    a = extend_args(q=torch.randn(4, H, D), kv_indptr=torch.tensor([0, 3, 5], dtype=I32),
                    kv_pos0=torch.tensor([0, 0]), qo_indptr=torch.tensor([0, 3, 2], dtype=I32),
                    q_pos0=torch.tensor([0, 0]))
    refused(run_extend, kern, a, LocError, r"qo_indptr decreases at 1: qo_indptr\[1\] = 3 > qo_indptr\[2\] = 2")


def test_extend_refuses_negative_qo_indptr(kern):
    refused(run_extend, kern, extend_args(qo_indptr=torch.tensor([-1, 2], dtype=I32)), LocError,
            r"qo_indptr starts at -1")


def test_extend_refuses_kv_index_outside_pool(kern):
    refused(run_extend, kern, extend_args(kv_indices=torch.tensor([1, 2, 3, 4, 99])), LocError,
            r"kv_indices\[4\] = 99 lies outside the pool's slots \[0, 16\)")


def test_decode_refuses_kv_index_outside_pool(kern):
    refused(run_decode, kern, decode_args(kv_indices=torch.tensor([1, 2, 3, 4, 99])), LocError,
            r"kv_indices\[4\] = 99 lies outside the pool's slots \[0, 16\)")
    refused(run_decode, kern, decode_args(kv_indices=torch.tensor([1, -2, 3, 4, 5])), LocError,
            r"kv_indices\[1\] = -2 lies outside")


def test_decode_refuses_kv_indptr_past_kv_indices(kern):
    refused(run_decode, kern, decode_args(kv_indptr=torch.tensor([0, 9], dtype=I32)), LocError,
            r"kv_indptr ends at 9, past kv_indices' 5 entries")


def test_decode_refuses_decreasing_kv_indptr(kern):
    a = decode_args(q=torch.randn(2, H, D), kv_indptr=torch.tensor([0, 4, 3], dtype=I32),
                    kv_pos0=torch.tensor([0, 0]), q_pos=torch.tensor([3, 3]))
    refused(run_decode, kern, a, LocError, r"kv_indptr decreases at 1")


def test_entries_past_the_list_stay_unspecified(kern):
    """kv_indices past kv_indptr[-1] (and before kv_indptr[0]) are not read, so they are not checked."""
    if kern is triton_kernels:
        triton_runs_cpu_tensors()
    a = decode_args(kv_indptr=torch.tensor([1, 6], dtype=I32), kv_indices=torch.tensor([-5, 1, 2, 3, 4, 5, 10 ** 6]))
    run_decode(kern, a)
    assert torch.equal(a["big"][1:], torch.full_like(a["big"][1:], 7.0))
    e = extend_args(kv_indices=torch.tensor([1, 2, 3, 4, 5, -1, 10 ** 6]))
    run_extend(kern, e)
    assert torch.equal(e["big"][3:], torch.full_like(e["big"][3:], 7.0))


def test_a_bad_call_after_a_good_one_of_its_kind_is_refused():
    """Triton's public decode keeps a plan per call signature: a call like a checked one still has its values
    and dtypes checked."""
    triton_runs_cpu_tensors()
    run_decode(triton_kernels, decode_args())
    refused(run_decode, triton_kernels, decode_args(kv_indices=torch.tensor([1, 2, 3, 4, 99])), LocError,
            "outside the pool")
    refused(run_decode, triton_kernels, decode_args(kv_indices=torch.arange(1.0, 6.0)), LocError,
            "kv_indices must be int32 or int64, got torch.float32")


def test_tree_verify_refuses_bad_lists(kern):
    """A verify tree's extend runs the same list checks (before the tree's, which read qo_indptr)."""
    tree = TreeMask(torch.ones(9, dtype=torch.bool), torch.tensor([0, 9]), torch.tensor([2, 3, 4]))
    refused(run_extend, kern, extend_args(tree=tree, kv_indices=torch.tensor([1, 2, 3, 4, 16])), LocError,
            r"kv_indices\[4\] = 16 lies outside")
    refused(run_extend, kern, extend_args(tree=tree, kv_indptr=torch.tensor([0, 6], dtype=I32)), LocError,
            "kv_indptr ends at 6")


# ---- dtypes -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["kv_indptr", "kv_indices", "kv_pos0", "q_pos"])
def test_decode_refuses_float_index_tensors(kern, name):
    a = decode_args()
    a[name] = a[name].to(torch.float32)
    refused(run_decode, kern, a, LocError, f"{name} must be int32 or int64, got torch.float32")


@pytest.mark.parametrize("name", ["kv_indptr", "kv_indices", "kv_pos0", "qo_indptr", "q_pos0"])
def test_extend_refuses_float_index_tensors(kern, name):
    a = extend_args()
    a[name] = a[name].to(torch.float32)
    refused(run_extend, kern, a, LocError, f"{name} must be int32 or int64, got torch.float32")


@pytest.mark.parametrize("name, dtype", [("q", I64), ("out", I32), ("sinks", I32), ("sinks", torch.bool)])
@pytest.mark.parametrize("run", [run_decode, run_extend], ids=["decode", "extend"])
def test_refuses_non_float_q_out_sinks(kern, run, name, dtype):
    a = (decode_args if run is run_decode else extend_args)(sinks=torch.zeros(H))
    if name == "out":
        a["big"] = a["big"].to(dtype)
        a["out"] = a["big"][:a["q"].shape[0]]
    else:
        a[name] = a[name].to(dtype)
    refused(run, kern, a, ShapeError, f"{name} must be a floating-point tensor, got {dtype}")


# ---- where the checks run -------------------------------------------------------------------------------------

def test_value_checks_follow_values_checkable(monkeypatch):
    """A GPU without HWKV_DEBUG (values_checkable False) reads no value: no host sync."""
    monkeypatch.setattr(csr_checks, "values_checkable", lambda t: False)
    csr_checks.check_csr_values(torch.tensor([0, 9]), torch.arange(3), 2, torch.tensor([0, 7]), 1)


def test_check_slots_names_the_first_slot_outside_the_pool(monkeypatch):
    csr_checks.check_slots("loc", torch.tensor([0, 15]), 16)
    csr_checks.check_slots("loc", torch.empty(0, dtype=I64), 16)
    for loc in (torch.tensor([3, 16, 2]), torch.arange(100) + 1):
        with pytest.raises(LocError, match=r"loc\[\d+\] = \d+ lies outside the pool's slots \[0, 16\)$"):
            csr_checks.check_slots("loc", loc, 16)
    monkeypatch.setattr(csr_checks, "values_checkable", lambda t: False)
    csr_checks.check_slots("loc", torch.tensor([99]), 16)


@pytest.mark.parametrize("bad", [16, 99, -3])
def test_triton_store_refuses_slots_outside_the_pool(bad):
    """store_kv (the public checked entry) writes nothing when a slot lies outside the pool: it had written past
    the buffers (the pool's own writes go through store_kv_prechecked after check_write_loc)."""
    k_buf, v_buf = torch.zeros(16, 2, 16), torch.zeros(16, 2, 16)
    k, v = torch.ones(2, 2, 16), torch.ones(2, 2, 16)
    with pytest.raises(LocError, match=f"lies outside the pool's slots \\[0, 16\\)"):
        triton_kernels.store_kv(k_buf, v_buf, torch.tensor([3, bad]), k, v)
    assert not k_buf.any() and not v_buf.any()


def test_plans_refuse_and_planned_calls_add_no_check(monkeypatch):
    """plan_decode / plan_extend check values as the checked calls do; the planned per-layer calls do not."""
    triton_runs_cpu_tensors()
    a = decode_args(kv_indices=torch.tensor([1, 2, 3, 4, 99]))
    with pytest.raises(LocError, match="outside the pool"):
        triton_kernels.plan_decode(a["q"], a["k_buf"], a["v_buf"], a["kv_indptr"], a["kv_indices"], a["kv_pos0"],
                                   a["q_pos"], a["out"])
    e = extend_args(qo_indptr=torch.tensor([0, 6], dtype=I32))
    with pytest.raises(LocError, match="qo_indptr ends at 6"):
        triton_kernels.plan_extend(e["q"], e["k_buf"], e["v_buf"], e["kv_indptr"], e["kv_indices"], e["kv_pos0"],
                                   e["qo_indptr"], e["q_pos0"], e["out"], 3)
    a, e = decode_args(), extend_args()
    dplan = triton_kernels.plan_decode(a["q"], a["k_buf"], a["v_buf"], a["kv_indptr"], a["kv_indices"], a["kv_pos0"],
                                       a["q_pos"], a["out"])
    eplan = triton_kernels.plan_extend(e["q"], e["k_buf"], e["v_buf"], e["kv_indptr"], e["kv_indices"], e["kv_pos0"],
                                       e["qo_indptr"], e["q_pos0"], e["out"], 3)
    calls = []
    for mod in (csr_checks, triton_decode, triton_extend):
        for fn in ("check_csr_values", "check_index_dtypes", "check_float_dtypes"):
            if hasattr(mod, fn):
                monkeypatch.setattr(mod, fn, lambda *x, _fn=fn: calls.append(_fn))
    triton_kernels.decode_attention_planned(dplan, a["q"], a["k_buf"], a["v_buf"], a["kv_indptr"], a["kv_indices"],
                                            a["kv_pos0"], a["q_pos"], a["out"], D ** -0.5)
    triton_kernels.extend_attention_planned(eplan, e["q"], e["k_buf"], e["v_buf"], e["kv_indptr"], e["kv_indices"],
                                            e["kv_pos0"], e["qo_indptr"], e["q_pos0"], e["out"], 3, D ** -0.5)
    assert calls == [], f"the planned calls ran checks: {calls}"
