"""Review 23: a batched out-of-window release by row (`by_row=True`) of a request row past req_to_token's rows is
refused with the row check's LocError before anything changes; it had raised a bare IndexError from the frontier
gather, where the same row without by_row was already a typed LocError."""
import pytest
import torch

from hwkv.allocator import SWATokenToKVPoolAllocator, same_snapshot
from hwkv.errors import LocError
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
