"""Review 25, hot paths: host work per step that grows with the layer count or the batch, counted (aten ops
dispatched, calls), never timed. Each test states the rule it checks and fails while the violation stands."""
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hwkv.allocator import SWATokenToKVPoolAllocator
from hwkv.batch import ForwardMode
from hwkv.engine.forward import ForwardSlots
from hwkv.pool import SWAKVPool
from hwkv.req_to_token import ReqToTokenPool
from hwkv.spec import accept_draft_tokens

I64 = torch.int64


class AtenOps(TorchDispatchMode):
    """Counts every aten op dispatched in the block (`ops[name]`, `total`)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self):
        return sum(self.ops.values())


# ---- speculative accept (every verify step of the engine): work per layer -------------------------------------
def _accept_ops(layers, page=4, drafts=3, bs=2, chain=True, index=None):
    """A verify's accept as the engine calls it (hwkv/engine/engine.py `_accept`: accept_index = arange(k), the
    chain), over a hybrid pool of `layers` layers (half SWA), page size > 1; returns the aten ops it dispatched."""
    swa_ids = list(range(0, layers, 2))
    full_ids = [i for i in range(layers) if i not in swa_ids]
    pool = SWAKVPool(256, 128, page, torch.float32, 1, 4, swa_ids, full_ids, "cpu")
    a = SWATokenToKVPoolAllocator(256, 128, page, "cpu", pool)
    rtt = ReqToTokenPool(bs + 1, 64, "cpu")
    rows = torch.tensor(rtt.alloc(bs), dtype=I64)
    prefix = torch.tensor([5 + b for b in range(bs)], dtype=I64)
    loc = a.alloc_extend([0] * bs, prefix.tolist(), [0] * bs, int(prefix.sum()))
    at = 0
    for b in range(bs):
        rtt.write(int(rows[b]), 0, loc[at:at + int(prefix[b])])
        at += int(prefix[b])
    seq = prefix + drafts
    last = rtt.req_to_token[rows, prefix - 1]
    dl = a.alloc_extend(prefix, seq, last, bs * drafts)
    for b in range(bs):
        rtt.write(int(rows[b]), int(prefix[b]), dl[b * drafts:(b + 1) * drafts])
    if index is None:
        index = torch.arange(drafts, dtype=I64).expand(bs, drafts).contiguous()  # the engine's chain
    acc = torch.tensor([2] * bs, dtype=I64)
    with AtenOps() as ops:
        accept_draft_tokens(a, pool, rtt.req_to_token, rows, prefix, index, acc,
                            prefix_lens_cpu=prefix, accept_lens_cpu=acc, chain=chain)
    return ops


def test_the_accept_of_a_verify_step_does_not_dispatch_ops_per_layer():
    """accept_draft_tokens -> pool.move_kv ran index_select + index_copy_ on every layer's K and V buffer: 4
    dispatches (and a gather's allocation) per layer on every verify step at page_size > 1; for the engine's chain
    accept (accept_index = arange, now `chain=True`) every move was onto itself. Host work per step must not grow with
    layers; a tree's accept (chain=False) still moves the K/V it reorders."""
    few, many = _accept_ops(2), _accept_ops(8)
    grown = {k: many.ops[k] - few.ops.get(k, 0) for k in many.ops if many.ops[k] != few.ops.get(k, 0)}
    assert many.total == few.total, (f"accept dispatched {few.total} aten ops with 2 layers, {many.total} with 8; "
                                     f"grown: {grown}")
    tree = torch.tensor([[0, 2, 1], [0, 2, 1]], dtype=I64)  # drafts 0 and 2 kept: draft 2's K/V moves to position 1
    assert _accept_ops(8, chain=False, index=tree).ops["aten.index_copy_.default"] == 16


def test_a_chain_accept_that_is_no_chain_is_refused():
    """chain=True skips the move, so where the allocator checks eagerly an accept_index that is no chain in place is
    a ShapeError (nothing changed: the checks precede every change)."""
    from hwkv.errors import ShapeError
    with pytest.raises(ShapeError, match=r"chain=True, but accept_index of request 0 is no chain in place: \[0, 2\]"):
        _accept_ops(2, index=torch.tensor([[0, 2, 1], [0, 1, 2]], dtype=I64))


# ---- a finished request's slots (every step where requests finish): work per request -------------------------
def _slots(rows=40):
    pool = SWAKVPool(1024, 1024, 4, torch.float32, 1, 4, [0], [1], "cpu")
    a = SWATokenToKVPoolAllocator(1024, 1024, 4, "cpu", pool)
    rtt = ReqToTokenPool(rows, 64, "cpu")
    return ForwardSlots(a, rtt, window=8)


def _free_ops(n):
    """ForwardSlots.free of n requests of 8 tokens each, as Engine._finish calls it without a prefix cache."""
    s = _slots()
    rows = s.new_rows(n)
    lens = s.plan_extend(ForwardMode.EXTEND,
                         rows, [0] * n, [8] * n)
    s.allocate(lens)
    with AtenOps() as ops:
        s.free(rows, [8] * n)
    return ops


def test_freeing_finished_requests_dispatches_no_op_per_request():
    """hwkv/engine/forward.py ForwardSlots.free: `[rtt[r, :n] for r, n in zip(rows, kv_lens) if n]` slices
    req_to_token once per finished request (a select and a slice dispatched per request) and cats them: the
    module promises "no device op per request". The op count must not grow with the requests that finish."""
    two, sixteen = _free_ops(2), _free_ops(16)
    assert sixteen.total == two.total, (f"free dispatched {two.total} aten ops for 2 requests, {sixteen.total} for "
                                        f"16: {dict(sixteen.ops)}")


def test_freeing_finished_requests_checks_their_rows_once(monkeypatch):
    """hwkv/engine/forward.py ForwardSlots.free (since 2fb56ac) calls rtt.check_free(rows) and then rtt.free(rows),
    which runs check_free again: the per-row Python checks and the set built from the whole free list (O(pool rows),
    not O(rows freed)) run twice per finishing step."""
    s = _slots()
    rows = s.new_rows(4)
    calls = Counter()
    inner = ReqToTokenPool.check_free

    def counted(self, r):
        calls["check_free"] += 1
        return inner(self, r)

    monkeypatch.setattr(ReqToTokenPool, "check_free", counted)
    s.free(rows, None)
    assert calls["check_free"] == 1, f"check_free ran {calls['check_free']} times for one free"
