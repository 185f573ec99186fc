"""accept_draft_tokens (hwkv.spec) on a real allocator and pool: a draft named twice never leaks, an accept
applied twice raises and changes nothing, in immediate (CPU) and deferred (device-style) checking."""
import pytest
import torch

from hwkv.allocator import SWATokenToKVPoolAllocator, same_snapshot
from hwkv.req_to_token import ReqToTokenPool
from hwkv.errors import DoubleFreeError, LocError, ShapeError
from hwkv.pool import SWAKVPool
from hwkv.spec import accept_draft_tokens

I64 = torch.int64
SIZE, SIZE_SWA, N = 128, 64, 4  # slots, SWA slots, drafts per request


class Setup:
    """Two requests with prefixes 5 and 6, N drafts each allocated and written at their next positions."""

    def __init__(self, page, immediate):
        self.pool = SWAKVPool(SIZE, SIZE_SWA, page, torch.float32, 1, 4, [0], [1], "cpu")
        self.a = SWATokenToKVPoolAllocator(SIZE, SIZE_SWA, page, "cpu", self.pool)
        self.a.immediate = immediate
        self.rtt = ReqToTokenPool(2, 64, "cpu")
        self.rows = torch.tensor(self.rtt.alloc(2), dtype=I64)
        self.prefix = torch.tensor([5, 6], dtype=I64)
        loc = self.a.alloc_extend([0, 0], self.prefix.tolist(), [0, 0], 11)
        self.rtt.write(int(self.rows[0]), 0, loc[:5])
        self.rtt.write(int(self.rows[1]), 0, loc[5:])
        seq = self.prefix + N
        last = self.rtt.req_to_token[self.rows, self.prefix - 1]
        drafts = self.a.alloc_extend(self.prefix, seq, last, 2 * N)
        for b in range(2):
            self.rtt.write(int(self.rows[b]), int(self.prefix[b]), drafts[b * N:(b + 1) * N])

    def accept(self, index, lens):
        idx = torch.zeros(2, N, dtype=I64)
        for b, a in enumerate(index):
            idx[b, :len(a)] = torch.tensor(a, dtype=I64)
        lens = torch.tensor(lens, dtype=I64)
        return accept_draft_tokens(self.a, self.pool, self.rtt.req_to_token, self.rows, self.prefix, idx, lens,
                                   prefix_lens_cpu=self.prefix, accept_lens_cpu=lens)

    def held_slots(self):
        """Full slots the requests' rows name up to their lengths (what the allocator must hold, no more)."""
        return self.a.size - self.a.full_available_size()

    def snapshot(self):
        return self.a.integrity_snapshot(), self.rtt.req_to_token.clone()

    def unchanged(self, snap):
        return same_snapshot(snap[0], self.a.integrity_snapshot()) and torch.equal(snap[1], self.rtt.req_to_token)

    def finish(self, seq):
        """Free both requests' rows up to `seq`: every page must come back."""
        for b in range(2):
            self.a.free(self.rtt.req_to_token[int(self.rows[b]), :int(seq[b])].clone())
        self.a.check_integrity()
        assert self.a.full_available_size() == SIZE and self.a.swa_available_size() == SIZE_SWA


def held_pages(page, seq):
    return sum(-(-int(s) // page) for s in seq)


@pytest.mark.parametrize("page", [1, 4])
def test_accept_keeps_the_path_and_frees_the_rest(page):
    s = Setup(page, immediate=True)
    seq = s.accept([[0, 2], [1]], [2, 1])
    assert seq.tolist() == [7, 7]
    assert s.held_slots() == held_pages(page, seq) * page
    row0 = s.rtt.req_to_token[int(s.rows[0])]
    assert (row0[7:9] == 0).all(), "draft positions past the new length name no slot"
    s.finish(seq)


@pytest.mark.parametrize("page", [1, 4])
def test_a_draft_named_twice_raises_before_any_change_where_checked_eagerly(page):
    s = Setup(page, immediate=True)
    snap = s.snapshot()
    with pytest.raises(ShapeError, match="twice in request 0"):
        s.accept([[1, 1], [0]], [2, 1])
    assert s.unchanged(snap)
    with pytest.raises(ShapeError, match=r"outside \[0, 4\)"):
        s.accept([[0], [4]], [1, 1])
    assert s.unchanged(snap)


@pytest.mark.parametrize("page", [1, 4])
def test_a_draft_named_twice_in_deferred_mode_is_recorded_and_leaks_nothing(page):
    """Deferred checks (accelerators): no host read, the error raised at the next sync; the bad request
    keeps its first drafts in place, so the allocator holds exactly what the rows name."""
    s = Setup(page, immediate=False)
    seq = s.accept([[1, 1], [0]], [2, 1])
    with pytest.raises(ShapeError, match="accept_index of request 0 names a draft token twice"):
        s.a.available_size()
    assert s.held_slots() == held_pages(page, seq) * page, "a slot leaked"
    s.finish(seq)


@pytest.mark.parametrize("page", [1, 4])
def test_a_draft_index_out_of_range_in_deferred_mode_is_recorded_and_leaks_nothing(page):
    s = Setup(page, immediate=False)
    seq = s.accept([[0], [7, 1]], [1, 2])
    with pytest.raises(ShapeError, match="request 1 names a draft token twice or one outside"):
        s.a.check_integrity()
    assert s.held_slots() == held_pages(page, seq) * page
    s.finish(seq)


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("immediate", [True, False])
def test_accept_applied_twice_raises_and_changes_nothing(page, immediate):
    """The second call with the same arguments would free accepted slots its row still names: it raises a
    typed error (deferred: at the next sync) and leaves the allocator and req_to_token as they were."""
    s = Setup(page, immediate)
    args = ([[0, 2], [1, 3]], [2, 2])
    seq = s.accept(*args)
    s.a.check_integrity()
    snap = s.snapshot()
    with pytest.raises(DoubleFreeError, match="already accepted"):
        s.accept(*args)
        s.a.available_size()
    assert s.unchanged(snap)
    s.finish(seq)


def kv_state(s):
    """Every K/V buffer of both pool groups (page size > 1 moves accepted K/V)."""
    p = s.pool
    return [b.clone() for sub in (p.full_kv_pool, p.swa_kv_pool) for b in (*sub.k_buffer, *sub.v_buffer)]


@pytest.mark.parametrize("page", [1, 4])
def test_accept_applied_twice_with_shorter_lengths_in_deferred_mode_changes_nothing(page):
    """Deferred checks: a second accept of the same drafts, shorter than the first, frees nothing (not the
    accepted drafts past its length either), writes no row entry and moves no K/V (the request is left as it
    is); the error waits for the next sync."""
    s = Setup(page, immediate=False)
    seq = s.accept([[0, 2], [1, 3]], [2, 2])
    s.a.check_integrity()
    snap, kv = s.snapshot(), kv_state(s)
    s.accept([[0], [1]], [1, 1])
    assert s.unchanged(snap), "an already accepted request was changed"
    assert all(torch.equal(a, b) for a, b in zip(kv, kv_state(s))), "K/V moved"
    with pytest.raises(DoubleFreeError, match="request 0's draft positions hold no slot"):
        s.a.check_integrity()
    assert s.held_slots() == held_pages(page, seq) * page
    s.finish(seq)


@pytest.mark.parametrize("immediate", [True, False])
@pytest.mark.parametrize("change, error, match", [
    (dict(rows=[0, 7]), LocError, r"req_pool_indices hold values in \[0, 7\], allowed range is \[0, 2\)"),
    (dict(rows=[-1, 1]), LocError, r"req_pool_indices hold values in \[-1, 1\], allowed range is \[0, 2\)"),
    (dict(prefix_lens_cpu=[5, 6]), ShapeError, "prefix_lens_cpu must be a torch.Tensor, got list"),
    (dict(accept_lens_cpu=[2, 1]), ShapeError, "accept_lens_cpu must be a torch.Tensor, got list"),
    (dict(accept_lens=[2, 1]), ShapeError, "accept_lens must be a torch.Tensor, got list"),
    (dict(accept_lens=torch.tensor([2., 1.]), accept_lens_cpu=torch.tensor([2., 1.])), ShapeError,
     "accept_lens must hold integers, got torch.float32"),
    (dict(prefix_lens=torch.tensor([-3, 6]), prefix_lens_cpu=torch.tensor([-3, 6])), ShapeError,
     r"prefix_lens\[0\] is -3"),
], ids=["row past the table", "negative row", "prefix list", "accept list", "accept_lens list", "float lens",
        "negative prefix"])
def test_bad_accept_arguments_raise_typed_errors_and_change_nothing(immediate, change, error, match):
    s = Setup(4, immediate)
    args = dict(rows=s.rows, prefix_lens=s.prefix, accept_index=torch.tensor([[0, 1, 0, 0], [0, 0, 0, 0]]),
                accept_lens=torch.tensor([2, 1]), prefix_lens_cpu=s.prefix, accept_lens_cpu=torch.tensor([2, 1]))
    args.update(change)
    rows = args.pop("rows")
    rows = torch.tensor(rows) if isinstance(rows, list) else rows
    snap, kv = s.snapshot(), kv_state(s)
    with pytest.raises(error, match=match):
        accept_draft_tokens(s.a, s.pool, s.rtt.req_to_token, rows, **args)
    assert s.unchanged(snap) and all(torch.equal(a, b) for a, b in zip(kv, kv_state(s)))
    s.a.check_integrity()


@pytest.mark.parametrize("immediate", [True, False])
@pytest.mark.parametrize("page", [1, 4])
def test_a_request_row_named_twice_raises_before_any_change(page, immediate):
    """Two batch entries of one request row: the second had freed a draft slot the first keeps and left the row
    with a hole (its new length naming a position of no slot). Where the rows' values are checkable (CPU, as for
    the row range), a ShapeError naming the row, before anything changes (deferred allocator mode included)."""
    s = Setup(page, immediate)
    row = s.rows[0]
    rows = torch.stack([row, row])
    prefix = torch.tensor([5, 5], dtype=I64)
    lens = torch.tensor([2, 1], dtype=I64)
    snap, kv = s.snapshot(), kv_state(s)
    with pytest.raises(ShapeError, match=rf"req_pool_indices name request row {int(row)} twice \(entries 0 and 1\)"):
        accept_draft_tokens(s.a, s.pool, s.rtt.req_to_token, rows, prefix, torch.tensor([[0, 1, 0, 0], [0, 0, 0, 0]]),
                            lens, prefix_lens_cpu=prefix, accept_lens_cpu=lens)
    assert s.unchanged(snap) and all(torch.equal(a, b) for a, b in zip(kv, kv_state(s)))
    s.a.check_integrity()
