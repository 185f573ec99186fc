"""hwkv.engine.forward.ForwardSlots: the one copy of a forward's slot bookkeeping (the engine steps on it, the
contract harness checks it)."""
import random

import pytest
import torch

import hwkv.engine.forward as forward
from hwkv.allocator import SWATokenToKVPoolAllocator
from hwkv.req_to_token import ReqToTokenPool
from hwkv.batch import ForwardMode
from hwkv.engine.forward import ForwardSlots
from hwkv.errors import LocError, ShapeError

P, W = 4, 8


def _slots(rows=6, context=96, size=512, size_swa=256):
    alloc = SWATokenToKVPoolAllocator(size, size_swa, P, "cpu", None)
    return ForwardSlots(alloc, ReqToTokenPool(rows, context, "cpu"), W)


def test_extend_and_decode_write_each_token_once_and_the_batch_matches():
    """Extend (one scatter for every request's chunk, a request with no token yet among them) and decode: each new
    token's loc sits in req_to_token at its position, distinct and continuing the request's pages."""
    s = _slots()
    rows = s.new_rows(3)
    lens = s.plan_extend(ForwardMode.EXTEND, rows, [0, 0, 0], [5, 9, 3], ids=list(range(17)))
    batch = s.allocate(lens)
    assert batch.forward_mode == ForwardMode.EXTEND and batch.num_tokens == 17
    assert lens.ids_dev.tolist() == list(range(17)) and lens.pos_dev.tolist() == [*range(5), *range(9), *range(3)]
    rtt = s.rtt.req_to_token
    got = torch.cat([rtt[r, :n] for r, n in zip(rows, [5, 9, 3])])
    assert torch.equal(got, batch.out_cache_loc) and got.unique().numel() == 17
    lens = s.plan_extend(ForwardMode.MIXED, rows, [5, 9, 3], [1, 2, 4])  # page 1 of row 0 continues at offset 1
    batch = s.allocate(lens)
    assert int(rtt[rows[0], 5]) == int(rtt[rows[0], 4]) + 1
    assert lens.prefix_cpu.tolist() == [5, 9, 3] and lens.seq == [6, 11, 7]
    dec = s.plan_decode(rows, [6, 11, 7])
    batch = s.allocate(dec)
    assert batch.forward_mode == ForwardMode.DECODE and batch.seq_lens_cpu.tolist() == [7, 12, 8]
    assert rtt[torch.tensor(rows), torch.tensor([6, 11, 7])].tolist() == batch.out_cache_loc.tolist()
    assert int(rtt[rows[0], 6]) == int(rtt[rows[0], 5]) + 1  # offsets 2 of the same page
    s.allocator.check_integrity()


@pytest.mark.parametrize("bs", [1, 2, 3])
def test_every_device_list_starts_16_byte_aligned_whatever_the_batch(bs):
    """Triton compiles a kernel variant per pointer alignment: the one copy's device views (per request and per token)
    all start at a 16-byte boundary for odd and even batches and token counts, so a batch's parity never picks a new
    compile in the middle of a run."""
    s = _slots()
    rows = s.new_rows(bs)
    ext = s.plan_extend(ForwardMode.EXTEND, rows, [0] * bs, [3] * bs, ids=list(range(3 * bs)))
    dec = s.plan_decode(rows, [3] * bs, ids=list(range(bs)))
    views = [ext.rows_dev, ext.prefix_dev, ext.seq_dev, ext.ext_dev, ext.before_dev, ext.pos_dev, ext.row_of_dev,
             ext.ids_dev, dec.rows_dev, dec.prefix_dev, dec.seq_dev, dec.before_dev, dec.ids_dev]
    assert all(v.data_ptr() % 16 == 0 and v.is_contiguous() for v in views)
    assert ext.seq_cpu.tolist() == [3] * bs and ext.ext_cpu.tolist() == [3] * bs and ext.prefix_cpu.tolist() == [0] * bs
    assert dec.seq_cpu.tolist() == [4] * bs and dec.ids_dev.tolist() == list(range(bs))
    assert ext.pos_dev.tolist() == [0, 1, 2] * bs and ext.ids_dev.tolist() == list(range(3 * bs))


def test_bad_lengths_raise_typed_errors_before_anything_changes():
    s = _slots(context=16)
    rows = s.new_rows(2)
    free = s.allocator.full_available_size()
    with pytest.raises(LocError, match="max_context_len 16"):
        s.plan_extend(ForwardMode.EXTEND, rows, [0, 0], [4, 17])
    with pytest.raises(LocError, match="max_context_len 16"):
        s.plan_decode(rows, [3, 16])
    with pytest.raises(ShapeError, match="3 token ids for 5 new tokens"):
        s.plan_extend(ForwardMode.EXTEND, rows, [0, 0], [2, 3], ids=[1, 2, 3])
    with pytest.raises(LocError, match=r"extend lengths must be >= 0: prefix \[0, 0\], new \[2, -1\]"):
        s.plan_extend(ForwardMode.EXTEND, rows, [0, 0], [2, -1])
    with pytest.raises(LocError, match=r"prefix \[-1, 0\]"):
        s.plan_extend(ForwardMode.EXTEND, rows, [-1, 0], [2, 1])
    with pytest.raises(ShapeError, match="1 token ids for 2 requests"):
        s.plan_decode(rows, [3, 4], ids=[1])
    with pytest.raises(ShapeError, match="list 1 of a block of width 2 has 1 entries"):  # never broadcast
        forward.pack([(2, [[1, 2], [3]])], s.device)
    with pytest.raises(ShapeError, match="5 token ids for 2 requests of 3 tokens"):
        s.replay_verify(type("G", (), {"tpr": 3})(), rows, [3, 4], [1, 2, 3, 4, 5])
    with pytest.raises(LocError, match="max_context_len 16"):
        s.replay_verify(type("G", (), {"tpr": 3})(), rows, [3, 14], [0] * 6)
    assert s.allocator.full_available_size() == free and not s.rtt.req_to_token.any()


def test_release_runs_only_when_a_host_frontier_moves_and_both_copies_agree(monkeypatch):
    """Random chunked prefills and decodes: the host's frontiers follow the device's exactly, and the release is
    called in exactly the forwards where one of them moves; finished requests give every slot back."""
    calls = []
    real = forward.release_out_of_window_batch
    monkeypatch.setattr(forward, "release_out_of_window_batch", lambda *a, **k: calls.append(1) or real(*a, **k))
    s = _slots()
    rng = random.Random(0)
    seq = {r: 0 for r in s.new_rows(4)}
    forwards = 0
    while any(n < 80 for n in seq.values()):
        rows = [r for r, n in seq.items() if n < 80]
        new = [1 if seq[r] and rng.random() < 0.7 else rng.randint(1, 9) for r in rows]
        new = [min(k, 80 - seq[r]) for r, k in zip(rows, new)]
        prefix = [seq[r] for r in rows]
        before = s.frontiers_cpu.tolist()
        if all(k == 1 for k in new) and all(prefix):
            lens = s.plan_decode(rows, prefix)
        else:
            lens = s.plan_extend(ForwardMode.EXTEND, rows, prefix, new)
        batch = s.allocate(lens)
        n_calls = len(calls)
        ran = s.release(lens.rows, lens.seq, batch.req_pool_indices, batch.seq_lens)
        assert ran == (s.frontiers_cpu.tolist() != before) == (len(calls) == n_calls + 1)
        assert s.frontiers.tolist() == s.frontiers_cpu.tolist()
        for r, k in zip(rows, new):
            seq[r] += k
        s.allocator.check_integrity()
        forwards += 1
    assert 0 < len(calls) < forwards
    s.free(list(seq), list(seq.values()))
    assert s.allocator.full_available_size() == 512 and s.allocator.swa_available_size() == 256
    assert s.rtt.available_size() == 6


def test_aligned_width_rounds_rows_to_16_bytes():
    """The one rule both the engine's copy and the eager metadata's rows use."""
    from hwkv.metadata import aligned_width
    assert [aligned_width(n, torch.int64) for n in (0, 1, 2, 3)] == [0, 2, 2, 4]
    assert [aligned_width(n, torch.int32) for n in (1, 4, 5, 9)] == [4, 4, 8, 12]
    assert aligned_width(3, torch.uint8) == 16
