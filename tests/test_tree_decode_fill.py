"""The fused decode-like tree list builder (hwkv_cuda.kernels.tree; interpreted on CPU, compiled on a GPU)
against hwkv.spec's torch path, on random forests, windows, prefixes and reused graph buffers.

Both paths fill the same kind of buffers from the same lists; they must agree exactly on the live
part (indptr[:T + 1], pos0[:T], indices[:indptr[T]]): nothing reads past it.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from hwkv import ops  # noqa: E402
from hwkv.errors import CapacityError  # noqa: E402
from hwkv.metadata import KVIndexList  # noqa: E402
from hwkv.spec import DraftTree, alloc_tree_decode, build_tree_mask, tree_decode_list  # noqa: E402
from hwkv.window import first_visible  # noqa: E402
from hwkv_cuda.kernels.tree import tree_decode_fill  # noqa: E402

pytestmark = [pytest.mark.interpret, pytest.mark.cuda]
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
I32, I64 = dict(dtype=torch.int32, device=DEV), dict(dtype=torch.int64, device=DEV)


def _parents(rng, n):
    """A random forest of n tokens in ancestor-first order."""
    return [rng.randrange(-1, i) if i else -1 for i in range(n)]


class Batch:
    """Requests with random prefixes and draft forests; request lists full (pos0 0) or windowed."""

    def __init__(self, seed, window, window_list=True, max_prefix=30, max_drafts=9, swa=False):
        rng = random.Random(seed)
        bs = rng.randint(1, 5)
        self.prefix = [rng.randint(0, max_prefix) for _ in range(bs)]
        self.parents = [_parents(rng, rng.choice([0, 1, rng.randint(2, max_drafts)])) for _ in range(bs)]
        self.ns = [len(p) for p in self.parents]
        self.T, self.bs, self.window = sum(self.ns), bs, window
        seq = [p + n for p, n in zip(self.prefix, self.ns)]
        g = torch.Generator().manual_seed(seed)
        rows = torch.randperm(8, generator=g)[:bs]
        self.req_to_token = torch.full((8, max_prefix + max_drafts + 3), -7, dtype=torch.int64)
        pos0 = [first_visible(p, window) if (window and window_list) else 0 for p in self.prefix]
        lists = []
        for b, (r, n) in enumerate(zip(rows.tolist(), seq)):
            slots = torch.randperm(1000, generator=g)[:n] + 1
            self.req_to_token[r, :n] = slots
            lists.append(slots[pos0[b]:])
        indptr = torch.tensor([0] + [len(x) for x in lists]).cumsum(0)
        self.max_len = max(len(x) for x in lists)
        if swa:   # "translated" slots: a builder that read the rows instead of the list would differ
            lists = [x + 5000 for x in lists]
        self.lst = KVIndexList(indptr.to(**I32), torch.cat(lists + [torch.zeros(3, dtype=torch.int64)]).to(DEV),
                               torch.tensor(pos0).to(**I64), window if window_list else None, self.max_len, swa)
        self.rows = (self.req_to_token.to(DEV), rows.to(DEV))
        self.ext = torch.tensor(self.ns).to(**I64)
        self.qo = torch.tensor([0] + self.ns).cumsum(0).to(**I32)
        self.q_pos0 = torch.tensor(self.prefix).to(**I64)
        draft = DraftTree.from_parents(self.parents, device=DEV)
        self.tree = build_tree_mask(draft, self.ext, self.qo, self.q_pos0, int(draft.mask.shape[0]), self.T)
        self.cap = max(1, min(self.max_len, window) if (window and window_list) else self.max_len)

    def build(self, fused, monkeypatch, rows=False, out=None):
        if fused:
            monkeypatch.setitem(ops._TREE_DECODE, DEV.type, tree_decode_fill)
        else:
            monkeypatch.delitem(ops._TREE_DECODE, DEV.type, raising=False)
        return tree_decode_list(self.tree, self.lst, self.qo, self.q_pos0, self.ext, self.T, self.cap, out,
                                self.rows if rows else None)


def _live(lst, T):
    end = int(lst.indptr[T])
    return lst.indptr[:T + 1].tolist(), lst.pos0[:T].tolist(), lst.indices[:end].tolist()


# (window, list trimmed to the window, rows handed over, SWA slots): rows serve full lists only
CASES = [(None, False, False, False), (None, False, True, False), (None, False, True, True),
         (1, True, False, False), (3, True, True, False), (3, True, True, True), (7, True, False, False),
         (100, True, False, False)]


@pytest.mark.parametrize("window,window_list,rows,swa", CASES)
def test_fused_equals_torch_path(window, window_list, rows, swa, monkeypatch):
    for seed in range(6):
        b = Batch(seed * 13 + (window or 0), window, window_list, swa=swa)
        want = _live(b.build(False, monkeypatch, rows), b.T)
        garbage = alloc_tree_decode(b.T + 3, b.cap + 2, DEV)     # a graph buffer holding the last replay's lists
        for t in garbage[:3]:
            t.fill_(12345)
        got = b.build(True, monkeypatch, rows, out=garbage)
        assert _live(got, b.T) == want, f"seed {seed}: {b.parents} over {b.prefix}"
        assert got.window == b.lst.window and got.max_len == b.cap


def test_fused_hand_computed(monkeypatch):
    """The hand-computed lists of test_tree_kernels (prefix 10..13, drafts 20..24 of [-1, 0, 0, 1, 2])."""
    monkeypatch.setitem(ops._TREE_DECODE, DEV.type, tree_decode_fill)
    ext, qo, q_pos0 = torch.tensor([5]).to(**I64), torch.tensor([0, 5]).to(**I32), torch.tensor([4]).to(**I64)
    tree = build_tree_mask(DraftTree.from_parents([[-1, 0, 0, 1, 2]], device=DEV), ext, qo, q_pos0, 25, 5)
    slots = torch.tensor([10, 11, 12, 13, 20, 21, 22, 23, 24]).to(DEV)
    full = KVIndexList(torch.tensor([0, 9]).to(**I32), slots, torch.tensor([0]).to(**I64), None, 9)
    pre = [10, 11, 12, 13]
    ptr, _, ind = _live(tree_decode_list(tree, full, qo, q_pos0, ext, 5, 9), 5)
    assert [ind[ptr[t]:ptr[t + 1]] for t in range(5)] == [pre + [20], pre + [20, 21], pre + [20, 22],
                                                          pre + [20, 21, 23], pre + [20, 22, 24]]
    win = KVIndexList(torch.tensor([0, 7]).to(**I32), slots[2:], torch.tensor([2]).to(**I64), 3, 7)
    ptr, pos0, ind = _live(tree_decode_list(tree, win, qo, q_pos0, ext, 5, 3), 5)
    assert [ind[ptr[t]:ptr[t + 1]] for t in range(5)] == [[12, 13, 20], [13, 20, 21], [13, 20, 22],
                                                          [20, 21, 23], [20, 22, 24]]
    assert pos0 == [2, 3, 3, 4, 4]


@pytest.mark.parametrize("window,window_list,rows,swa", [CASES[0], CASES[1], CASES[4]])
def test_fused_copies_a_prefix_chunk_in_several_passes(window, window_list, rows, swa, monkeypatch):
    """One prefix chunk per token (as with many tokens on a GPU), so each program copies its prefix in
    several key blocks."""
    from hwkv_cuda.kernels import tree
    monkeypatch.setattr(tree, "_TARGET_PROGRAMS", 1)
    for seed in range(4):
        b = Batch(seed * 7 + 1, window, window_list, max_prefix=40, swa=swa)
        want = _live(b.build(False, monkeypatch, rows), b.T)
        assert _live(b.build(True, monkeypatch, rows), b.T) == want, f"seed {seed}"


def test_fused_many_requests_and_long_prefixes(monkeypatch):
    """More requests than one binary-search step and tokens than one token block; prefixes over
    several prefix chunks (the interpreter's blocks are 8 wide)."""
    rng = random.Random(5)
    parents = [_parents(rng, rng.randint(0, 4)) for _ in range(37)]
    ns = [len(p) for p in parents]
    prefix = [rng.randint(0, 60) for _ in parents]
    lists = [torch.arange(p + n) * 3 + 1 + 1000 * b for b, (p, n) in enumerate(zip(prefix, ns))]
    lst = KVIndexList(torch.tensor([0] + [len(x) for x in lists]).cumsum(0).to(**I32), torch.cat(lists).to(DEV),
                      torch.zeros(len(parents)).to(**I64), None, max(len(x) for x in lists))
    ext, qo = torch.tensor(ns).to(**I64), torch.tensor([0] + ns).cumsum(0).to(**I32)
    q_pos0 = torch.tensor(prefix).to(**I64)
    tree = build_tree_mask(DraftTree.from_parents(parents, device=DEV), ext, qo, q_pos0, sum(n * n for n in ns),
                           sum(ns))
    ref = _live(tree_decode_list(tree, lst, qo, q_pos0, ext, sum(ns), lst.max_len), sum(ns))
    monkeypatch.setitem(ops._TREE_DECODE, DEV.type, tree_decode_fill)
    assert _live(tree_decode_list(tree, lst, qo, q_pos0, ext, sum(ns), lst.max_len), sum(ns)) == ref


def test_fused_refuses_buffers_too_small(monkeypatch):
    monkeypatch.setitem(ops._TREE_DECODE, DEV.type, tree_decode_fill)
    b = Batch(3, None)
    small = alloc_tree_decode(max(1, b.T - 1), b.cap, DEV)
    before = [t.clone() for t in small[:3]]
    with pytest.raises(CapacityError):
        b.build(True, monkeypatch, out=small)
    assert all(torch.equal(x, y) for x, y in zip(before, small[:3])), "buffers changed by a refused build"


@pytest.mark.skipif(DEV.type != "cpu", reason="a GPU is present: its contract run builds the lists with this kernel")
def test_decode_like_verify_through_the_backend_with_the_fused_builder(monkeypatch):
    """The interpreted Triton backend with the fused builder in place of the torch path, as on a GPU: tree
    verifies through graphs over a 32-slot SWA pool at page 4 (two requests, then one: the replay reuses
    static lists the last one filled), each checked against the reference, accepted paths kept."""
    from hwkv.batch import ForwardMode
    from hwkv.graph import EagerAdapter
    from hwkv.testing.contract_spec import GEOM, TREE
    from hwkv.testing.harness import Harness
    from hwkv.testing.spec_harness import tree_verify
    from hwkv_cuda.backend import TritonBackend
    calls = []

    def counted(*a, **k):
        calls.append(a[12])
        return tree_decode_fill(*a, **k)
    monkeypatch.setitem(ops._TREE_DECODE, "cpu", counted)
    h = Harness(TritonBackend, "cpu", GEOM, size=1024, size_swa=32, page_size=4, tree_verify="decode")
    h.enable_graphs([1, 2], EagerAdapter(), mode=ForwardMode.TARGET_VERIFY, tokens_per_req=5, tree=True)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [9, 3], ForwardMode.EXTEND)
    h.release()
    calls.clear()
    tree_verify(h, rids, [TREE, [-1, 0, 1, 2, 3]], [[0, 1, 3], [0, 2]])   # checked against the reference inside
    h.release()
    tree_verify(h, rids[:1], [TREE], [[0, 2, 4]])
    h.check_integrity()
    assert calls == [10, 10, 5, 5], calls   # per verify: the full list and the window list
