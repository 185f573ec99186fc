"""Review 36 (allocator and pool internals): defects found in `hwkv/allocator.py`, `hwkv/release.py`,
`hwkv/torch_page_ops.py` and `hwkv/pool.py`'s use of the allocator's table, each shown by a test that fails on the
code as reviewed and passes once the defect is fixed.

The Triton page-op kernels run on CPU tensors under TRITON_INTERPRET=1 (conftest's `triton_page_ops_on_cpu`).
"""
import os
import sys

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conftest import triton_page_ops_on_cpu  # noqa: E402
from hwkv.allocator import SWATokenToKVPoolAllocator, same_snapshot  # noqa: E402
from hwkv.errors import ConfigError, LocError  # noqa: E402
from hwkv.pool import SWAKVPool  # noqa: E402
from hwkv.release import release_out_of_window_batch  # noqa: E402
from hwkv.req_to_token import ReqToTokenPool  # noqa: E402

I64 = torch.int64
P = 4


def T(xs):
    return torch.tensor(xs, dtype=I64)


def allocator(size=32, size_swa=32, page=P, ops=None, host_ops=True, immediate=True):
    """A CPU SWATokenToKVPoolAllocator without a pool; `ops`: "triton" for the Triton page ops (else torch's)."""
    a = SWATokenToKVPoolAllocator(size, size_swa, page, "cpu", None)
    if ops == "triton":
        a._ops = a.swa_attn_allocator._ops = triton_page_ops_on_cpu()
    a.host_ops = a.swa_attn_allocator.host_ops = host_ops
    a.immediate = immediate
    return a


# ---- 1. cancel_reserve after an allocation that ran and gave every claimed page back ---------------------------------
@pytest.mark.parametrize("ops", ["torch", "triton"])
def test_cancel_reserve_after_an_allocation_that_returned_its_claim_does_not_free_the_pages_again(ops):
    """cancel_reserve takes "no claimed page is live" for "the allocation never ran", so after an alloc_reserved that
    ran but opened none of the claimed pages (it pushed them back to the tail) it also moves the head back: the page is
    on the free ring twice (check_integrity fails, free count 32 of 32 while a page is held). Right: the head stays
    (nothing to give back), one page held, 28 slots free, integrity holds."""
    a = allocator(ops=ops)
    loc = a.alloc_extend([0], [2], [0], 2)  # one request, 2 tokens on page 1: its next token continues that page
    heads = a.reserve(1)  # the host planned a page (its lengths said so); the device's lengths open none
    out = torch.empty(1, dtype=I64)
    a.alloc_reserved(T([2]), T([3]), loc[1:2].clone(), out, heads, 1)
    assert a.full_available_size() == 28  # the unopened claimed page went back to the ring's tail
    a.cancel_reserve(1)  # the step's replay then raised (a layer): the error path cancels its claim
    a.check_integrity()
    assert a.full_available_size() == 28 and a.swa_available_size() == 28


# ---- 2. out-of-window release with a window near 2**63 -------------------------------------------------------------
@pytest.mark.parametrize("mode", ["immediate", "deferred"])
def test_release_with_a_window_of_sys_maxsize_releases_nothing_instead_of_overflowing(mode):
    """`check_window` admits any window below 2**63, e.g. sys.maxsize for "never slide out". At page size 16 the host
    check (`_check_release`: (dead // p) * p - p) and the torch op (`TorchPageOps.release_window`) overflow int64 for
    dead = seq - W + 1 near -2**63: the new frontier wraps to about 2**63 and the release tries to release 2**59 pages
    (numpy MemoryError / torch RuntimeError, bare). The Triton kernel (`_frontier`: where dead > 0) releases nothing.
    Right: nothing released, the frontier stays 0, the allocator unchanged."""
    page = 16
    a = allocator(size=64, size_swa=64, page=page, immediate=mode == "immediate")
    rtt = ReqToTokenPool(2, 64, "cpu")
    rtt.write(0, 0, a.alloc_extend([0], [10], [0], 10))
    before = a.integrity_snapshot()
    f = T([0])
    release_out_of_window_batch(a, rtt.req_to_token, T([0]), T([10]), f, sys.maxsize)
    a.check_integrity()
    assert f.tolist() == [0]
    assert same_snapshot(before, a.integrity_snapshot())


# ---- 3. lengths past int64 in a list ------------------------------------------------------------------------------
@pytest.mark.parametrize("call", ["alloc_extend", "alloc_decode"])
def test_a_length_past_int64_in_a_list_is_a_loc_error(call):
    """`_host_ints` takes Python ints of any size (operator.index) and converts them with np.asarray(dtype=int64),
    which raises a bare OverflowError for 2**63 (seq_lens, prefix_lens, last_loc given as lists). Right: a LocError
    naming the argument and the int64 limit, nothing taken (as `alloc(2**70)` and `release_out_of_window(seq_len=2**70)`
    are refused)."""
    a = allocator()
    before = a.integrity_snapshot()
    with pytest.raises(LocError, match="seq_lens"):
        if call == "alloc_extend":
            a.alloc_extend([0], [2 ** 63], [0], 2 ** 63)
        else:
            a.alloc_decode([2 ** 63], [0])
    assert same_snapshot(before, a.integrity_snapshot())


# ---- 4. a host copy that disagrees with its CPU tensor ---------------------------------------------------------------
@pytest.mark.parametrize("host_ops", [True, False], ids=["host-ops", "torch-ops"])
@pytest.mark.parametrize("call", ["alloc_extend", "alloc_decode"])
def test_a_host_copy_disagreeing_with_its_cpu_tensor_is_refused_before_any_change(call, host_ops):
    """With checks immediate (CPU, HWKV_DEBUG=1) the allocator reads the lengths anyway, but never compares
    `seq_lens_cpu` with `seq_lens`: it sizes the call from the host copy and computes slots from the tensor. An extend
    (tensor 3 tokens, host copy 5) gets a bare numpy ValueError (host path) or, through the page ops, 5 slots of which
    slot 8 lies on a page the op pushed back to the free ring (a later allocation hands it out again); a decode (tensor
    length 3, host copy 5) opens a new page where the tensor says the token continues slot 6. Right: LocError naming
    the disagreement, before any change."""
    a = allocator(host_ops=host_ops)
    loc = a.alloc_extend([0], [2], [0], 2)
    before = a.integrity_snapshot()
    with pytest.raises(LocError, match="seq_lens"):
        if call == "alloc_extend":
            a.alloc_extend(T([2]), T([5]), loc[1:2].clone(), 5, seq_lens_cpu=T([7]))
        else:
            a.alloc_decode(T([3]), loc[1:2].clone(), seq_lens_cpu=T([5]))
    assert same_snapshot(before, a.integrity_snapshot())


# ---- 5. an allocator smaller than its pool ---------------------------------------------------------------------------
def _smaller_allocator():
    """A pool of 64 slots and an allocator of 32 over it (`_check_fits_pool` refuses only a larger one); None where
    construction refuses the pair with a ConfigError (a fix that requires equal sizes)."""
    pool = SWAKVPool(64, 32, P, torch.float32, 1, 2, [0], [1], "cpu")
    try:
        a = SWATokenToKVPoolAllocator(32, 16, P, "cpu", pool)
    except ConfigError:
        return None, None
    return pool, a


def test_a_pool_under_a_smaller_allocator_passes_its_own_integrity_check():
    """`SWAKVPool.check_integrity` asserts the table is `size + page_size + 1` long (the pool's size), but the table
    is the allocator's, which may be smaller than the pool: a fresh, unused pair fails it (AssertionError "mapping
    length"; the engine's and the harness's check_integrity call it). Right: the pair is either refused at
    construction (ConfigError) or passes."""
    pool, a = _smaller_allocator()
    if pool is None:
        return
    a.alloc(8)
    a.check_integrity()
    pool.check_integrity()


@pytest.mark.parametrize("out", [False, True], ids=["gather", "out="])
def test_a_pool_under_a_smaller_allocator_refuses_a_loc_past_the_allocators_table(out):
    """The pool checks locs against its own slots [-1, 68) and then gathers from the allocator's table of 37 entries:
    loc 40 is a bare IndexError on the CPU (an out-of-bounds read on a GPU), and loc 36 (the table's trailing -1)
    translates to -1 ("no loc") although it names a slot of the pool. Right: LocError naming the loc and the table's
    range (or the pair refused at construction)."""
    pool, a = _smaller_allocator()
    if pool is None:
        return
    with pytest.raises(LocError):
        if out:
            pool.translate_loc_from_full_to_swa(T([40]), out=torch.zeros(2, dtype=I64))
        else:
            pool.translate_loc_from_full_to_swa(T([40]))


# ---- 6. the refusal of a numpy loc -----------------------------------------------------------------------------------
def test_free_of_a_numpy_array_names_what_it_got():
    """`_check_loc_tensor` names a non-tensor by its dtype when it has one, so `free(np.array([4]))` says "loc must be
    an int64 tensor, got int64": the message contradicts itself and hides that a numpy array was given. Right: the
    message names the type (ndarray)."""
    a = allocator()
    a.alloc(4)
    with pytest.raises(LocError, match="ndarray"):
        a.free(np.array([4]))
