"""Review 23 (B): free(with_swa=False) never leaves an SWA page more holders than its full page (every mode); a
deferred share of a page whose SWA slots were released changes nothing; an out-of-window release over a
req_to_token entry outside the pool is recorded (ERR_RANGE), not a bare IndexError or an out-of-bounds read; the
torch ops and the Triton kernels agree on each."""
from __future__ import annotations

import pytest
import torch
from conftest import triton_page_ops_on_cpu

from hwkv.allocator import SWATokenToKVPoolAllocator
from hwkv.errors import HwkvError, LocError
from hwkv.release import release_out_of_window_batch
from hwkv.torch_page_ops import TORCH_OPS

pytestmark = pytest.mark.usefixtures("one_thread")
T = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731


def _ops(name):
    return TORCH_OPS if name == "torch" else triton_page_ops_on_cpu()


def _make(p, ops=None, n=16):
    a = SWATokenToKVPoolAllocator(n * p, n * p, p, "cpu", None)
    if ops is not None:
        a._ops = a.swa_attn_allocator._ops = _ops(ops)
        a.immediate = False
    return a


def _refs(a, loc, p):
    """(full refs, SWA refs) of loc's page."""
    fp = int(loc[0]) // p
    s = int(a.full_to_swa_index_mapping[fp * p]) // p
    return int(a.pages.refs[fp]), (int(a._swa.refs[s]) if s > 0 else None)


@pytest.mark.parametrize("p", [1, 4])
def test_free_keeping_swa_refused_when_swa_has_as_many_holders_immediate(p):
    a = _make(p)
    loc = a.alloc(p)
    a.share(loc)  # full 2, SWA 2
    snap = a.integrity_snapshot()
    with pytest.raises(LocError, match="SWA"):
        a.free(loc, with_swa=False)
    from hwkv.allocator import same_snapshot
    assert same_snapshot(snap, a.integrity_snapshot())
    a.free(loc)
    a.free(loc)
    a.check_integrity()
    assert a.swa_available_size() == 16 * p and a.full_available_size() == 16 * p


@pytest.mark.parametrize("ops", [None, "torch", "triton"])
def test_free_keeping_swa_accepted_when_swa_has_fewer_holders(ops):
    a = _make(4, ops)
    loc = a.alloc(4)
    a.share(loc, with_swa=False)  # full 2, SWA 1
    a.free(loc, with_swa=False)  # full 1, SWA 1: fine
    a.check_integrity()
    assert _refs(a, loc, 4) == (1, 1)
    a.free(loc)
    a.check_integrity()
    assert a.swa_available_size() == 64 and a.full_available_size() == 64


@pytest.mark.parametrize("ops", ["torch", "triton"])
def test_free_keeping_swa_recorded_when_swa_has_as_many_holders_deferred(ops):
    a = _make(4, ops)
    loc = a.alloc(4)
    a.share(loc)  # full 2, SWA 2
    a.free(loc, with_swa=False)
    with pytest.raises(LocError, match="with_swa=False"):
        a.available_size()
    assert _refs(a, loc, 4) == (2, 2)  # the page skipped
    a.free(loc)
    a.free(loc)
    a.check_integrity()
    assert a.swa_available_size() == 64 and a.full_available_size() == 64


@pytest.mark.parametrize("ops", ["torch", "triton"])
def test_deferred_share_of_released_swa_changes_nothing(ops):
    a = _make(4, ops)
    loc = a.alloc(4)
    a.free_swa(loc)
    a.share(loc)
    with pytest.raises(HwkvError):
        a.available_size()
    assert _refs(a, loc, 4) == (1, None)
    a.free(loc, with_swa=False)
    a.check_integrity()
    assert a.full_available_size() == 64 and a.swa_available_size() == 64


@pytest.mark.parametrize("ops", ["torch", "triton"])
@pytest.mark.parametrize("bogus", [10**6, 72, -7])
def test_release_over_entry_outside_pool_is_recorded(ops, bogus):
    a = _make(4, ops)
    rtt = torch.zeros(1, 32, dtype=torch.int64)
    rtt[0, :16] = a.alloc(16)
    good = rtt[0, 4].clone()
    rtt[0, 0] = bogus  # a corrupt entry
    f = T([0])
    release_out_of_window_batch(a, rtt, T([0]), T([16]), f, 2)
    with pytest.raises(LocError, match="outside"):
        a.available_size()
    a.check_integrity()
    assert _refs(a, good.reshape(1), 4) == (1, None)  # the good entries' pages were released
    assert int(f[0]) == 8
