"""Random alloc / extend / decode / release / free sequences keep the allocator's invariants."""
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hwkv.allocator import ReqToTokenPool, SWATokenToKVPoolAllocator, release_out_of_window
from hwkv.errors import OutOfSlotsError
from hwkv.pool import SWAKVPool

OPS = st.lists(st.tuples(st.sampled_from(["new", "extend", "decode", "release", "finish"]),
                         st.integers(0, 7), st.integers(1, 9)), min_size=1, max_size=40)


def invariants(a, rtt, reqs, page):
    a.check_integrity()
    m = a.full_to_swa_index_mapping
    full_owned = torch.cat([rtt.req_to_token[r, :s] for r, (s, _) in reqs.items()]) if reqs else torch.zeros(0, dtype=torch.long)
    assert full_owned.numel() == torch.unique(full_owned).numel(), "a full slot is owned twice"
    live_swa = m[full_owned]
    live_swa = live_swa[live_swa > 0]
    assert live_swa.numel() == torch.unique(live_swa).numel(), "an SWA slot is owned twice"
    # every table entry points at a live SWA slot or 0, and only owned tokens map
    mapped = torch.nonzero(m[:-1] > 0).reshape(-1)
    assert set(mapped.tolist()) <= set(full_owned.tolist())
    # free counts add up (whole pages per request)
    pages = sum(-(-s // page) for s, _ in reqs.values())
    assert a.full_available_size() == a.size - pages * page


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(page=st.sampled_from([1, 2, 4]), window=st.integers(1, 6), ops=OPS)
def test_random_sequences_keep_invariants(page, window, ops):
    size, size_swa = 128, 48
    pool = SWAKVPool(size, size_swa, page, torch.float32, 1, 2, [0], [1], "cpu")
    a = SWATokenToKVPoolAllocator(size, size_swa, page, "cpu", pool)
    rtt = ReqToTokenPool(8, 256, "cpu")
    reqs = {}  # row -> (seq_len, frontier)
    initial = (a.full_available_size(), a.swa_available_size())
    for op, pick, n in ops:
        rows = sorted(reqs)
        row = rows[pick % len(rows)] if rows else None
        try:
            if op == "new" and rtt.available_size():
                r = rtt.alloc(1)[0]
                loc = a.alloc_extend([0], [n], [0], n)
                rtt.write(r, 0, loc)
                reqs[r] = (n, 0)
            elif op == "extend" and row is not None:
                s, f = reqs[row]
                loc = a.alloc_extend([s], [s + n], [int(rtt.req_to_token[row, s - 1])], n)
                rtt.write(row, s, loc)
                reqs[row] = (s + n, f)
            elif op == "decode" and rows:
                seq = [reqs[r][0] + 1 for r in rows]
                loc = a.alloc_decode(seq, [int(rtt.req_to_token[r, s - 2]) for r, s in zip(rows, seq)])
                for i, r in enumerate(rows):
                    rtt.write(r, seq[i] - 1, loc[i:i + 1])
                    reqs[r] = (seq[i], reqs[r][1])
            elif op == "release":
                for r in rows:
                    s, f = reqs[r]
                    reqs[r] = (s, release_out_of_window(a, rtt.req_to_token[r], s, f, window))
            elif op == "finish" and row is not None:
                s, _ = reqs.pop(row)
                a.free(rtt.req_to_token[row, :s].clone())
                rtt.free(row)
        except OutOfSlotsError:
            pass  # refused allocations must leave the state unchanged: the invariants below check it
        invariants(a, rtt, reqs, page)
    for r in list(reqs):
        s, _ = reqs.pop(r)
        a.free(rtt.req_to_token[r, :s].clone())
        rtt.free(r)
    invariants(a, rtt, reqs, page)
    assert (a.full_available_size(), a.swa_available_size()) == initial
    assert (a.full_to_swa_index_mapping[:-1] == 0).all()
