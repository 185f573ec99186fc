"""Review 20 (page ops): the torch page ops and the Triton kernels agree on three bad-input cases.

1. A whole-step allocation (`alloc_reserved`) that continues a page whose SWA slots were released is recorded
   (ERR_CONT_RELEASED) in immediate mode too, by the torch ops as by the kernels (it was handed out silently).
2. One step that both continues a released page and releases over a stale frontier records the same error
   whether the Triton one-launch `alloc_step`, the Triton three launches or the torch path runs it.
3. `free(loc, with_swa=False)` by a page's last full holder while its SWA page is still held is refused before any
   change (immediate) or recorded with the page skipped (deferred): its SWA pages no longer leak.
Both implementations run under TRITON_INTERPRET=1 on CPU tensors (as tests/test_page_ops_differential.py).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hwkv.allocator import SWATokenToKVPoolAllocator, same_snapshot  # noqa: E402
from hwkv.errors import HwkvError, LocError, NotAllocatedError  # noqa: E402
from hwkv.ops import TORCH_STEP  # noqa: E402
from hwkv.pages import ERR_CONT_RELEASED, ERR_SWA_HELD  # noqa: E402
from hwkv.release import release_out_of_window_batch  # noqa: E402
from hwkv.torch_page_ops import TORCH_OPS  # noqa: E402

triton = pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
pytestmark = [pytest.mark.interpret,
              pytest.mark.skipif(not INTERPRET, reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1")]

P = 4
I64 = torch.int64


def T(xs):
    return torch.tensor(xs, dtype=I64)


def triton_ops():
    from hwkv_cuda.kernels.alloc import TritonPageOps
    return TritonPageOps()


def make(ops, immediate, size=64, size_swa=64):
    """A hybrid CPU allocator with the given page ops (None: the numpy host path) and checking mode."""
    a = SWATokenToKVPoolAllocator(size, size_swa, P, "cpu", None)
    if ops is not None:
        a._ops = a.swa_attn_allocator._ops = ops() if callable(ops) else ops
    a.immediate = immediate
    return a


OPS = [pytest.param(TORCH_OPS, id="torch"), pytest.param(triton_ops, id="triton")]


def raised(fn):
    """(type name, message) of the HwkvError fn raises, or None."""
    try:
        fn()
    except HwkvError as e:
        return type(e).__name__, str(e)
    return None


# ---- 1. the whole-step allocation checks a continuation in immediate mode too --------------------------------------
def _continue_released(ops):
    """A request of 10 tokens whose partial last page lost its SWA slots; the step to 11 through alloc_reserved."""
    a = make(ops, immediate=True)
    loc = a.alloc_extend([0], [10], [0], 10)
    a.free_swa(loc[8:9].clone())
    a.check_integrity()
    heads = a.reserve(0)
    out = torch.full((1,), -1, dtype=I64)
    a.alloc_reserved(T([10]), T([11]), loc[9:10].clone(), out, heads, 0)
    return a, loc, out


@pytest.mark.parametrize("ops", OPS)
def test_alloc_reserved_records_a_released_continuation_in_immediate_mode(ops):
    a, loc, out = _continue_released(ops)
    assert int(out[0]) == int(loc[9]) + 1
    assert a.pages.pending() == (ERR_CONT_RELEASED, int(loc[9]) // P)
    with pytest.raises(NotAllocatedError, match="has no SWA slot"):
        a.check_integrity()


def test_alloc_reserved_continuation_torch_and_triton_agree():
    got = []
    for ops in (TORCH_OPS, triton_ops):
        a, loc, out = _continue_released(ops)
        got.append((out.tolist(), a.pages.pending(), raised(a.check_integrity)))
    assert got[0] == got[1]
    assert got[0][2] is not None


# ---- 2. one step, one error: the one launch numbers its release as an op of its own ---------------------------------
def _step_with_two_errors(how):
    from hwkv_cuda.kernels import step as step_kernels
    W = 1
    a = make(TORCH_OPS if how == "torch" else triton_ops, immediate=False)
    rtt, frontiers = torch.zeros(2, 32, dtype=I64), torch.zeros(2, dtype=I64)  # row 1: the padding row
    rtt[0, :10] = a.alloc_extend(T([0]), T([10]), T([0]), 10, prefix_lens_cpu=T([0]), seq_lens_cpu=T([10]))
    release_out_of_window_batch(a, rtt, T([0]), T([10]), frontiers, W, by_row=True)
    a.free_swa(rtt[0, 8:9].clone())  # the partial last page loses its SWA slots
    frontiers[0] = 0  # a stale frontier: the page of tokens 0..3 is released already
    a.check_integrity()
    heads = a.reserve(0)
    staged = T([heads[0], heads[1], 1, 0, 11])
    ctl, rows_in, seq_in = staged[:3], staged[3::2], staged[4::2]
    rows, seq, out = (torch.zeros(1, dtype=I64) for _ in range(3))
    if how == "triton one launch":
        assert a.allocates_step_in_one
        a.alloc_step(ctl, rows_in, seq_in, 1, rtt, rows, seq, out, frontiers=frontiers, window=W)
    else:
        kern = TORCH_STEP if how == "torch" else step_kernels.KERNELS
        prefix, last = torch.zeros(1, dtype=I64), torch.zeros(1, dtype=I64)
        kern.prologue(ctl, rows_in, seq_in, 1, rtt, rows, seq, prefix, last, out)
        a.alloc_reserved(prefix, seq, last, out, heads if how == "torch" else ctl, 0)
        kern.write(rtt, rows, seq, out, None, None)
        release_out_of_window_batch(a, rtt, rows, seq, frontiers, W, by_row=True)
    return [r.op for r in a._rings()], raised(a.check_integrity), rtt.clone(), frontiers.clone()


def test_one_launch_step_records_the_allocations_error_like_the_other_paths():
    got = {how: _step_with_two_errors(how) for how in ("torch", "triton three launches", "triton one launch")}
    errs = {how: g[1] for how, g in got.items()}
    assert errs["torch"] is not None and errs["torch"][0] == "NotAllocatedError", errs
    assert len(set(errs.values())) == 1, errs
    for how, g in got.items():
        assert g[0] == got["torch"][0], f"{how}: op numbers {g[0]} vs torch {got['torch'][0]}"
        assert torch.equal(g[2], got["torch"][2]) and torch.equal(g[3], got["torch"][3]), how


# ---- 3. free(with_swa=False) by a page's last full holder while its SWA page is held --------------------------------
@pytest.mark.parametrize("ops", [pytest.param(None, id="host")] + OPS)
def test_free_without_swa_by_last_holder_is_refused_before_any_change(ops):
    a = make(ops, immediate=True)
    loc = a.alloc(8)
    snap = a.integrity_snapshot()
    with pytest.raises(LocError, match=rf"loc {int(loc[0])} .*SWA.*still held.*with_swa=True"):
        a.free(loc, with_swa=False)
    assert same_snapshot(snap, a.integrity_snapshot())
    a.check_integrity()
    a.free(loc)
    a.check_integrity()
    assert a.full_available_size() == 64 and a.swa_available_size() == 64


@pytest.mark.parametrize("ops", OPS)
def test_free_without_swa_by_last_holder_is_recorded_and_skipped_deferred(ops):
    a = make(ops, immediate=False)
    loc = a.alloc(8)
    keep = a.alloc(4)
    a.free_swa(keep)  # a page whose SWA slots are gone: with_swa=False is right for it
    snap = a.integrity_snapshot()
    a.free(torch.cat([loc, keep]), with_swa=False)
    assert a.pages.pending() == (ERR_SWA_HELD, int(loc[0]) // P)
    with pytest.raises(LocError, match=rf"full page {int(loc[0]) // P} .*SWA.*still held"):
        a.available_size()
    # the held pages were skipped (nothing leaked), the released one went back
    after = a.integrity_snapshot()
    assert torch.equal(after["full"]["refs"][loc // P], snap["full"]["refs"][loc // P])
    assert torch.equal(after["full->SWA"]["table"], snap["full->SWA"]["table"])
    assert int(after["full"]["refs"][int(keep[0]) // P]) == 0
    a.check_integrity()
    a.free(loc)
    a.check_integrity()
    assert a.full_available_size() == 64 and a.swa_available_size() == 64


def test_free_without_swa_deferred_torch_and_triton_agree():
    got = []
    for ops in (TORCH_OPS, triton_ops):
        a = make(ops, immediate=False)
        loc = a.alloc(12)
        a.free(loc[:4], with_swa=False)
        got.append((a.pages.pending(), a.integrity_snapshot()))
    assert got[0][0] == got[1][0] and got[0][0] is not None
    a, b = got[0][1], got[1][1]
    for pool in ("full", "SWA"):
        assert torch.equal(a[pool]["refs"], b[pool]["refs"]) and a[pool]["tail"] == b[pool]["tail"]
    assert torch.equal(a["full->SWA"]["table"], b["full->SWA"]["table"])


@pytest.mark.parametrize("immediate", [True, False])
@pytest.mark.parametrize("ops", [pytest.param(None, id="host")] + OPS)
def test_free_without_swa_stays_legal_where_a_full_holder_remains_or_swa_is_gone(ops, immediate):
    if ops is None and not immediate:
        pytest.skip("the host path is immediate mode's")
    a = make(ops, immediate=immediate)
    loc = a.alloc(8)
    a.share(loc, with_swa=False)  # a second full holder (a tombstone-like holder without SWA)
    a.free(loc, with_swa=False)   # the full page keeps a holder: its SWA is not orphaned
    a.check_integrity()
    a.free_swa(loc)
    a.free(loc, with_swa=False)   # the SWA slots are gone already: the last full holder may go
    a.check_integrity()
    assert a.full_available_size() == 64 and a.swa_available_size() == 64
