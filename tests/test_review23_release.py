"""Review 23: a batched out-of-window release by row (`by_row=True`) of a request row past req_to_token's rows is
refused with the row check's LocError before anything changes; it had raised a bare IndexError from the frontier
gather, where the same row without by_row was already a typed LocError. `alloc`'s count is an integer as
`reserve`'s is (numpy integers taken, bools refused)."""
import numpy as np
import pytest
import torch

from hwkv.allocator import SWATokenToKVPoolAllocator, same_snapshot
from hwkv.errors import ConfigError, LocError
from hwkv.release import release_out_of_window_batch

I64 = dict(dtype=torch.int64)


@pytest.mark.parametrize("row", [7, 4, -1])
def test_a_release_by_row_of_a_row_outside_the_table_is_a_loc_error_and_changes_nothing(row):
    a = SWATokenToKVPoolAllocator(64, 64, 4, "cpu", None)
    rtt = torch.zeros(4, 32, **I64)
    rtt[1, :16] = a.alloc(16)
    frontiers = torch.zeros(4, **I64)
    before, rtt0 = a.integrity_snapshot(), rtt.clone()
    with pytest.raises(LocError, match=rf"req_pool_indices hold values in \[{row}, {row}\], allowed range is \[0, 4\)"):
        release_out_of_window_batch(a, rtt, torch.tensor([row]), torch.tensor([16]), frontiers, 2, by_row=True)
    assert same_snapshot(before, a.integrity_snapshot()) and torch.equal(rtt, rtt0) and not frontiers.any()
    release_out_of_window_batch(a, rtt, torch.tensor([1]), torch.tensor([16]), frontiers, 2, by_row=True)
    assert frontiers.tolist() == [0, 8, 0, 0]   # the good row releases as before
    a.check_integrity()


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("count", [True, np.True_, 4.0, "4", torch.tensor(4), -4, 3])
def test_alloc_takes_integer_counts_only_and_changes_nothing_otherwise(page, count):
    """alloc(True) had taken one slot at page_size 1, and numpy integers (which reserve takes) were refused."""
    a = SWATokenToKVPoolAllocator(64, 64, page, "cpu", None)
    before = a.integrity_snapshot()
    if count == 3 and page == 1:   # a multiple of page_size 1: taken
        assert a.alloc(count).numel() == 3
        return
    with pytest.raises(ConfigError, match=r"alloc\(.*\) must be a non-negative multiple of page_size"):
        a.alloc(count)
    assert same_snapshot(before, a.integrity_snapshot())


def test_alloc_takes_numpy_integers_as_reserve_does():
    a = SWATokenToKVPoolAllocator(64, 64, 4, "cpu", None)
    assert a.alloc(np.int64(8)).numel() == 8 and a.alloc(np.int32(4)).numel() == 4
    a.check_integrity()
