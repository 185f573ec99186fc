"""The fused graph refill (hwkv_cuda.kernels.refill, under TRITON_INTERPRET=1 on CPU) against the torch path.

Both paths refill the same static buffers from the same starting state; they must agree exactly
(index lists on their live prefix: entries past indptr[bs] are unspecified and read by no kernel).
Launches are counted as a GPU would see them: Triton launches plus non-view aten ops, with the
write locs' value checks off (as on a GPU without HWKV_DEBUG).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

triton = pytest.importorskip("triton")

from hwkv import checks, ops  # noqa: E402
from hwkv.batch import ForwardBatch, ForwardMode  # noqa: E402
from hwkv.testing.harness import Harness, ModelGeometry  # noqa: E402
from hwkv.testing.reference_backend import ReferenceBackend  # noqa: E402
from hwkv_cuda.kernels import fill_kv_indices, refill  # noqa: E402

pytestmark = [pytest.mark.interpret,
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="a GPU is present: the CUDA contract run covers the fused refill")]

W = 8
I64 = torch.int64


class Launches(TorchDispatchMode):
    """Counts what would be device launches: Triton kernel runs and non-view aten ops."""

    def __init__(self):
        super().__init__()
        self.triton, self.aten = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.aten.append(str(func))
        return func(*args, **(kwargs or {}))

    @property
    def total(self):
        return len(self.triton) + len(self.aten)


@pytest.fixture
def launches(monkeypatch):
    """A Launches mode whose Triton launches are recorded (and run outside the mode)."""
    counter = Launches()
    cls = type(refill._fill_lists_kernel)
    inner = cls.run

    def run(self, *args, **kwargs):
        counter.triton.append(self.fn.__name__)
        with _disable_current_modes():
            return inner(self, *args, **kwargs)

    monkeypatch.setattr(cls, "run", run)
    monkeypatch.setattr(checks, "values_checkable", lambda t: False)  # a GPU without HWKV_DEBUG
    return counter


def fused(monkeypatch, on: bool):
    """Register (or not) the Triton refill and index-fill kernels for CPU tensors."""
    if on:
        monkeypatch.setitem(ops._REFILL, "cpu", refill.KERNELS)
        monkeypatch.setitem(ops._FILL, "cpu", fill_kv_indices)
    else:
        monkeypatch.delitem(ops._REFILL, "cpu", raising=False)
        monkeypatch.delitem(ops._FILL, "cpu", raising=False)


def harness(page_size, size_swa=128, windows=None):
    h = Harness(ReferenceBackend, geometry=ModelGeometry(num_layers=2, swa_every=2, window=W), size=1024,
                size_swa=size_swa, page_size=page_size, max_reqs=12, max_context_len=128)
    if windows is not None:
        h.backend = ReferenceBackend(h.pool, h.rtt, sliding_window=windows)
    h.backend.init_graph_state(8, 24)
    return h


def warm(h, lens):
    """Requests of these lengths (some shorter than W), prefilled and released, so SWA slots are reused."""
    rids = [h.add_request() for _ in lens]
    for rid, n in zip(rids, lens):
        while n:
            h.make_batch([rid], [min(n, W)], ForwardMode.EXTEND)
            h.release()
            n -= min(n, W)
    return rids


def padded(h, rids, new, mode, bs_pad):
    """A batch padded to bs_pad the way GraphRunner pads: row 0, length tpr, slot 0."""
    b = h.make_batch(rids, new, mode)
    tpr = 1 if mode == ForwardMode.DECODE else new[0]
    pad = bs_pad - len(rids)
    dev = dict(dtype=I64, device=h.device)
    rows = torch.cat([b.req_pool_indices, torch.zeros(pad, **dev)])
    seq = torch.cat([b.seq_lens, torch.full((pad,), tpr, **dev)])
    loc = torch.cat([b.out_cache_loc, torch.zeros(pad * tpr, **dev)])
    if mode == ForwardMode.DECODE:
        return ForwardBatch(mode, bs_pad, rows, seq, loc)
    ext = torch.cat([b.extend_seq_lens, torch.full((pad,), tpr, **dev)])
    return ForwardBatch(mode, bs_pad, rows, seq, loc, seq - ext, ext)


def snapshot(h):
    st = h.backend.static
    return {"swa": h.backend.loc_cache.buffer, "lens": st.lens, "q_pos0": st.q_pos0, "qo_indptr": st.qo_indptr,
            "list_indptr": st.list_indptr, "list_pos0": st.list_pos0, "full": st.full_indices,
            **{f"win{w}": t for w, t in st.win_indices.items()}}


def live(h, name, t, bs):
    """The part a kernel reads: a list's entries up to its indptr[bs]; every other buffer whole."""
    st = h.backend.static
    if name == "full":
        return t[:int(st.list_indptr[0, bs])]
    if name.startswith("win"):
        row = 1 + sorted(st.win_indices).index(int(name[3:]))
        return t[:int(st.list_indptr[row, bs])]
    return t


def refill_both(h, batch, monkeypatch, launches=None):
    """Torch refill and fused refill from the same starting buffers; returns (torch, fused) states and
    the fused metadata. With `launches`, counts the torch path's then the fused path's launches."""
    bufs = snapshot(h)
    start = {k: v.clone() for k, v in bufs.items()}
    counts = []
    states = []
    for on in (False, True):
        for k, v in bufs.items():
            v.copy_(start[k])
        fused(monkeypatch, on)
        if launches is not None:
            if not on:
                monkeypatch.setitem(ops._FILL, "cpu", fill_kv_indices)  # today's GPU path: Triton fill
            launches.triton.clear()
            launches.aten.clear()
            with launches:
                md = h.backend.init_forward_metadata_graph(batch)
            counts.append((len(launches.triton), list(launches.aten)))
        else:
            md = h.backend.init_forward_metadata_graph(batch)
        states.append({k: v.clone() for k, v in bufs.items()})
    return states[0], states[1], md, counts


def assert_same(h, ref, got, bs):
    for name in ref:
        a, b = live(h, name, ref[name], bs), live(h, name, got[name], bs)
        assert torch.equal(a, b), f"{name} differs: torch {a.tolist()[:40]} fused {b.tolist()[:40]}"


def assert_matches_eager(h, md, batch):
    """The graph lists' live entries equal the eager metadata's (the ground truth) for the same batch."""
    eager = h.backend.init_forward_metadata(batch)
    for lst, ref in [(md.full, eager.full)] + [(md.windows[w], eager.windows[w]) for w in eager.windows]:
        assert torch.equal(lst.indptr, ref.indptr) and torch.equal(lst.pos0, ref.pos0)
        assert torch.equal(lst.indices[:int(ref.indptr[-1])], ref.indices)
        assert lst.is_swa_slots == ref.is_swa_slots
    assert torch.equal(md.q_pos0, eager.q_pos0) and torch.equal(md.qo_indptr, eager.qo_indptr)
    if eager.swa_out_cache_loc is None:
        assert md.swa_out_cache_loc is None
    else:
        assert torch.equal(md.swa_out_cache_loc, eager.swa_out_cache_loc)


@pytest.mark.parametrize("page_size", [1, 4])
def test_decode_refill_matches_torch_and_tail_is_zeroed(page_size, monkeypatch):
    h = harness(page_size)
    rids = warm(h, [3, 5, 40, 70, 9, 2])        # some shorter than W = 8, some far longer
    assert 1024 - h.allocator.full_available_size() > 128, "more tokens than the SWA pool has slots"
    big = padded(h, rids, [1] * 6, ForwardMode.DECODE, 8)
    ref, got, md, _ = refill_both(h, big, monkeypatch)
    assert_same(h, ref, got, 8)
    assert (got["swa"][:6] > 0).all() and (got["swa"][6:] == 0).all()  # padding writes slot 0
    assert_matches_eager(h, md, big)
    h.release()
    small = padded(h, rids[:2], [1, 1], ForwardMode.DECODE, 4)        # fewer tokens after more
    ref, got, md, _ = refill_both(h, small, monkeypatch)
    assert_same(h, ref, got, 4)
    assert (got["swa"][2:] == 0).all(), "stale slots left in the static buffer's tail"
    assert_matches_eager(h, md, small)


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY,
                                  ForwardMode.DRAFT_EXTEND])
@pytest.mark.parametrize("page_size", [1, 4])
def test_extend_like_refill_matches_torch(mode, page_size, monkeypatch):
    h = harness(page_size)
    rids = warm(h, [2, 6, 17, 30])
    new = [3, 3, 3] if mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND) else [1, 7, 3]
    batch = padded(h, rids[:3], new, mode, 5)
    ref, got, md, _ = refill_both(h, batch, monkeypatch)
    assert_same(h, ref, got, 5)
    assert md.max_q_len == batch.num_tokens and not md.is_decode
    assert_matches_eager(h, md, batch)


def test_fresh_requests_with_prefix_zero(monkeypatch):
    """Extend of brand-new requests (no prefix) and of one whose whole history fits the window."""
    h = harness(1)
    rids = [h.add_request() for _ in range(3)]
    batch = padded(h, rids, [4, 9, 1], ForwardMode.EXTEND, 4)
    ref, got, md, _ = refill_both(h, batch, monkeypatch)
    assert_same(h, ref, got, 4)
    assert_matches_eager(h, md, batch)


@pytest.mark.parametrize("mode, new, bound", [(ForwardMode.DECODE, [1, 1, 1], 3),
                                              (ForwardMode.EXTEND, [2, 5, 1], 5),
                                              (ForwardMode.TARGET_VERIFY, [3, 3, 3], 5)])
def test_fused_refill_launch_count(mode, new, bound, monkeypatch, launches):
    h = harness(4)
    rids = warm(h, [3, 12, 25])
    batch = padded(h, rids, new, mode, 4)
    _, _, _, counts = refill_both(h, batch, monkeypatch, launches)
    (torch_triton, torch_aten), (fused_triton, fused_aten) = counts
    print(f"{mode.name}: torch path {torch_triton} Triton + {len(torch_aten)} aten launches; "
          f"fused {fused_triton} Triton + {len(fused_aten)} aten")
    assert not fused_aten, f"the fused refill ran torch ops: {fused_aten}"
    assert fused_triton <= bound
    assert fused_triton == 3  # write locs, lists + positions, one window list
    assert torch_triton + len(torch_aten) > 10  # what it replaces


def test_fused_refill_counts_one_translation_of_each_kind(monkeypatch):
    """Write locs once (SWALocCache) and the window list once, each through the pool's one entry point."""
    h = harness(1)
    rids = warm(h, [4, 11])
    fused(monkeypatch, True)
    calls = []
    inner = h.pool.translate_loc_from_full_to_swa
    h.pool.translate_loc_from_full_to_swa = lambda *a, **k: calls.append(1) or inner(*a, **k)
    before = (h.backend.loc_cache.translations, h.backend.window_translations)
    h.backend.init_forward_metadata_graph(padded(h, rids, [1, 1], ForwardMode.DECODE, 4))
    assert len(calls) == 2
    assert (h.backend.loc_cache.translations, h.backend.window_translations) == (before[0] + 1, before[1] + 1)


def test_kernels_direct():
    """The three kernels on hand-made tensors: negative locs read the mapping from its end."""
    mapping = torch.tensor([0, 7, 8, 9, 0, 5, -1], dtype=I64)
    out = torch.full((6,), 99, dtype=I64)
    refill.translate_into(mapping, torch.tensor([1, 3, -1, 5], dtype=I64), out)
    assert out.tolist() == [7, 9, -1, 5, 0, 0]
    rtt = torch.tensor([[1, 2, 3, 5, 0], [3, 3, 1, 0, 0]], dtype=I64)
    out = torch.full((6,), 99, dtype=I64)
    refill.translate_runs(mapping, rtt, torch.tensor([1, 0]), torch.tensor([1, 2], dtype=I64),
                          torch.tensor([0, 2, 4], dtype=torch.int32), out)
    assert out.tolist() == [9, 7, 9, 5, 99, 99]  # row 1 from 1: locs 3, 1; row 0 from 2: locs 3, 5
    with pytest.raises(Exception, match="at least as long"):
        refill.translate_into(mapping, torch.tensor([1, 2, 3], dtype=I64), torch.zeros(2, dtype=I64))


@pytest.mark.parametrize("mode, new", [(ForwardMode.DECODE, [1, 1, 1]), (ForwardMode.EXTEND, [4, 1, 2])])
def test_two_windows_and_a_plain_pool(mode, new, monkeypatch, launches):
    """Every window gets its list (one more launch each); a plain pool's window lists stay locs."""
    for h, expect in ((harness(2, windows=(3, W)), 4), (harness(1, size_swa=None), 2)):
        rids = warm(h, [2, 13, 40])
        batch = padded(h, rids, new, mode, 4)
        ref, got, md, counts = refill_both(h, batch, monkeypatch, launches)
        assert_same(h, ref, got, 4)
        assert_matches_eager(h, md, batch)
        assert counts[1] == (expect, [])


def eager_both(h, batch, monkeypatch):
    """Eager metadata through the torch lists and through the fused refill kernels (buffers sized per forward)."""
    out = []
    for on in (False, True):
        fused(monkeypatch, on)
        out.append(h.backend.init_forward_metadata(batch))
    return out


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
@pytest.mark.parametrize("page_size", [1, 4])
def test_eager_metadata_through_the_fused_kernels_matches_torch(mode, page_size, monkeypatch):
    """The eager path on devices with refill kernels: 2 + windows launches instead of a dozen ops per list;
    every list, length bound and position equal to the torch path's on the same random batch."""
    gen = torch.Generator().manual_seed(page_size)
    h = harness(page_size, windows=[W, 3])
    lens = torch.randint(1, 40, (5,), generator=gen).tolist()
    rids = warm(h, lens)
    new = [1] * 5 if mode == ForwardMode.DECODE else torch.randint(1, 7, (5,), generator=gen).tolist()
    batch = h.make_batch(rids, new, mode)
    ref, got = eager_both(h, batch, monkeypatch)
    assert torch.equal(ref.q_pos0, got.q_pos0) and torch.equal(ref.qo_indptr, got.qo_indptr)
    assert torch.equal(ref.swa_out_cache_loc, got.swa_out_cache_loc) and ref.max_q_len == got.max_q_len
    for a, b in [(ref.full, got.full)] + [(ref.windows[w], got.windows[w]) for w in ref.windows]:
        assert torch.equal(a.indptr, b.indptr) and torch.equal(a.pos0, b.pos0) and torch.equal(a.indices, b.indices)
        assert (a.max_len, a.min_len, a.is_swa_slots, a.window) == (b.max_len, b.min_len, b.is_swa_slots, b.window)
        # every list's indptr and pos0 starts 16-byte aligned for this odd batch (one compiled variant per kernel)
        assert b.indptr.data_ptr() % 16 == 0 and b.pos0.data_ptr() % 16 == 0 and b.indptr.is_contiguous()
    assert h.backend.window_translations >= 2 * len(ref.windows)  # still one counted translation per list
