"""The fused graph refill (hwkv_cuda.kernels.refill, under TRITON_INTERPRET=1 on CPU) against the torch path.

Both paths refill the same static buffers from the same starting state; they must agree exactly
(index lists on their live prefix: entries past indptr[bs] are unspecified and read by no kernel).
Launches are counted as a GPU would see them: Triton launches plus non-view aten ops, with the
write locs' value checks off (as on a GPU without HWKV_DEBUG).
"""
import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

triton = pytest.importorskip("triton")

from hwkv import backend as backend_module, checks, csr_checks, ops  # noqa: E402
from hwkv.errors import HwkvError  # noqa: E402
from hwkv.loc import translations_of  # noqa: E402
from hwkv.metadata import cumsum_into, window_pos0  # noqa: E402
from hwkv.batch import ForwardBatch, ForwardMode  # noqa: E402
from hwkv.testing.harness import Harness, ModelGeometry  # noqa: E402
from hwkv.testing.reference_backend import ReferenceBackend  # noqa: E402
from hwkv_cuda.kernels import refill  # noqa: E402
from hwkv_cuda.kernels.index import fill_kv_indices_prechecked as fill_kv_indices  # noqa: E402 (what GPUs register)

pytestmark = [pytest.mark.interpret,
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="a GPU is present: the CUDA contract run covers the fused refill")]

W = 8
I64 = torch.int64
SEPARATE = ops.GraphRefillKernels(refill.translate_into, refill.translate_runs, refill.fill_lists)  # no fused refill


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
    for module in (checks, backend_module, csr_checks):   # a GPU without HWKV_DEBUG (each module's own name)
        monkeypatch.setattr(module, "values_checkable", lambda t: False)
    return counter


def fused(monkeypatch, on: bool, kernels=refill.KERNELS):
    """Register (or not) the Triton refill (`kernels`) and index-fill kernels for CPU tensors."""
    if on:
        monkeypatch.setitem(ops._REFILL, "cpu", kernels)
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


def refill_both(h, batch, monkeypatch, launches=None, kernels=refill.KERNELS):
    """Torch refill and fused refill (through `kernels`) from the same starting buffers; returns (torch, fused)
    states and the fused metadata. With `launches`, counts the torch path's then the fused path's launches."""
    bufs = snapshot(h)
    start = {k: v.clone() for k, v in bufs.items()}
    counts = []
    states = []
    for on in (False, True):
        for k, v in bufs.items():
            v.copy_(start[k])
        fused(monkeypatch, on, kernels)
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


@pytest.mark.parametrize("kernels, expect", [(refill.KERNELS, 1), (SEPARATE, 3)], ids=["fill_translated", "separate"])
@pytest.mark.parametrize("mode, new", [(ForwardMode.DECODE, [1, 1, 1]), (ForwardMode.EXTEND, [2, 5, 1]),
                                       (ForwardMode.TARGET_VERIFY, [3, 3, 3])])
def test_fused_refill_launch_count(mode, new, kernels, expect, monkeypatch, launches):
    """One launch with `fill_translated`; a device registering only the three kernels keeps write locs, lists +
    positions and one window list: 3 launches. Both the same buffers."""
    h = harness(4)
    rids = warm(h, [3, 12, 25])
    batch = padded(h, rids, new, mode, 4)
    ref, got, _, counts = refill_both(h, batch, monkeypatch, launches, kernels)
    assert_same(h, ref, got, 4)
    (torch_triton, torch_aten), (fused_triton, fused_aten) = counts
    print(f"{mode.name}: torch path {torch_triton} Triton + {len(torch_aten)} aten launches; "
          f"fused {fused_triton} Triton + {len(fused_aten)} aten")
    assert not fused_aten, f"the fused refill ran torch ops: {fused_aten}"
    assert fused_triton == expect
    assert torch_triton + len(torch_aten) > 10  # what it replaces


def test_fused_refill_counts_one_translation_of_each_kind(monkeypatch):
    """Write locs once (SWALocCache) and the window list once, through the pool's one entry point: two calls
    with the separate kernels, one call making both translations with `fill_translated`."""
    h = harness(1)
    rids = warm(h, [4, 11])
    calls = []
    inner = h.pool.translate_loc_from_full_to_swa
    h.pool.translate_loc_from_full_to_swa = lambda *a, **k: calls.append(translations_of(*a, **k)) or inner(*a, **k)
    for kernels, expect in ((SEPARATE, [1, 1]), (refill.KERNELS, [2])):
        fused(monkeypatch, True, kernels)
        calls.clear()
        before = (h.backend.loc_cache.translations, h.backend.window_translations)
        h.backend.init_forward_metadata_graph(padded(h, rids, [1, 1], ForwardMode.DECODE, 4))
        assert calls == expect
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
    """Every window gets its list (in the one launch; a plain pool's window lists stay locs: one more launch
    each, beside the lists' launch)."""
    for h, expect in ((harness(2, windows=(3, W)), 1), (harness(1, size_swa=None), 2)):
        rids = warm(h, [2, 13, 40])
        batch = padded(h, rids, new, mode, 4)
        ref, got, md, counts = refill_both(h, batch, monkeypatch, launches)
        assert_same(h, ref, got, 4)
        assert_matches_eager(h, md, batch)
        assert counts[1] == (expect, [])


def eager_both(h, batch, monkeypatch, kernels=refill.KERNELS):
    """Eager metadata through the torch lists and through the fused refill kernels (buffers sized per forward)."""
    out = []
    for on in (False, True):
        fused(monkeypatch, on, kernels)
        out.append(h.backend.init_forward_metadata(batch))
    return out


@pytest.mark.parametrize("kernels", [refill.KERNELS, SEPARATE], ids=["fill_translated", "separate"])
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
@pytest.mark.parametrize("page_size", [1, 4])
def test_eager_metadata_through_the_fused_kernels_matches_torch(mode, page_size, kernels, monkeypatch):
    """The eager path on devices with refill kernels: one launch with `fill_translated` (write locs translated,
    every list built and each window list translated), else 2 + windows, instead of a dozen ops per list; every
    list, length bound and position equal to the torch path's on the same random batch."""
    gen = torch.Generator().manual_seed(page_size)
    h = harness(page_size, windows=[W, 3])
    lens = torch.randint(1, 40, (5,), generator=gen).tolist()
    rids = warm(h, lens)
    new = [1] * 5 if mode == ForwardMode.DECODE else torch.randint(1, 7, (5,), generator=gen).tolist()
    batch = h.make_batch(rids, new, mode)
    ref, got = eager_both(h, batch, monkeypatch, kernels)
    assert torch.equal(ref.q_pos0, got.q_pos0) and torch.equal(ref.qo_indptr, got.qo_indptr)
    assert torch.equal(ref.swa_out_cache_loc, got.swa_out_cache_loc) and ref.max_q_len == got.max_q_len
    for a, b in [(ref.full, got.full)] + [(ref.windows[w], got.windows[w]) for w in ref.windows]:
        assert torch.equal(a.indptr, b.indptr) and torch.equal(a.pos0, b.pos0) and torch.equal(a.indices, b.indices)
        assert (a.max_len, a.min_len, a.is_swa_slots, a.window) == (b.max_len, b.min_len, b.is_swa_slots, b.window)
        # every list's indptr and pos0 starts 16-byte aligned for this odd batch (one compiled variant per kernel)
        assert b.indptr.data_ptr() % 16 == 0 and b.pos0.data_ptr() % 16 == 0 and b.indptr.is_contiguous()
    assert h.backend.window_translations >= 2 * len(ref.windows)  # still one counted translation per list


# ---- the one-launch refill (`fill_translated`) against the separate launches and the torch path ----------
JUNK = -7  # what every output buffer holds before a refill: an entry nobody writes keeps it


def random_refill_inputs(gen, bs, windows, decode, ctx=40, rows=50, map_len=300):
    """Random req_to_token rows and mapping (zeros and a few negative locs among them), seq lens, extend lens
    and write locs; output buffers full of JUNK, the write locs' one longer than the batch's tokens."""
    rtt = torch.randint(0, map_len - 1, (rows, ctx), generator=gen)
    rtt[:, ::7] = -torch.randint(1, 3, (rows, 1), generator=gen)  # negative locs read the mapping from its end
    mapping = torch.randint(1, 60, (map_len,), generator=gen)
    mapping[torch.rand(map_len, generator=gen) < 0.25] = 0
    mapping[-1] = -1
    rpi = torch.randperm(rows, generator=gen)[:bs]
    seq = torch.randint(1, ctx + 1, (bs,), generator=gen)
    ext = None if decode else torch.minimum(torch.randint(1, 6, (bs,), generator=gen), seq)
    n = bs if decode else int(ext.sum())
    loc = torch.randint(0, map_len - 1, (n,), generator=gen)
    loc[::3] = -torch.randint(1, 3, loc[::3].shape, generator=gen)
    wins = torch.tensor([0, *windows], dtype=I64)
    nl, cap = 1 + len(windows), n + bs * max(windows)
    out = dict(lens=torch.full((bs + 3,), JUNK), q_pos0=torch.full((bs + 3,), JUNK),
               qo_indptr=torch.full((bs + 4,), JUNK, dtype=torch.int32),
               list_indptr=torch.full((nl, bs + 4), JUNK, dtype=torch.int32), list_pos0=torch.full((nl, bs + 3), JUNK),
               full_indices=torch.full((bs * ctx + 5,), JUNK), loc_out=torch.full((n + 9,), JUNK),
               window_indices=torch.full((len(windows), cap), JUNK))
    return (rtt, rpi, seq, ext, wins), (mapping, loc), out


def torch_refill(inputs, translate, out):
    """The same buffers from torch ops (no refill kernel): the reference of both kernel paths."""
    (rtt, rpi, seq, ext, wins), (mapping, loc) = inputs, translate
    bs = rpi.shape[0]
    q_pos0 = seq - (1 if ext is None else ext)
    out["lens"][:bs] = seq
    out["q_pos0"][:bs] = q_pos0
    cumsum_into(torch.ones_like(seq) if ext is None else ext, out["qo_indptr"][:bs + 1])
    for j, w in enumerate(wins.tolist()):
        pos0 = window_pos0(q_pos0, w) if w else torch.zeros_like(seq)
        out["list_pos0"][j, :bs] = pos0
        target = out["full_indices"] if j == 0 else out["window_indices"][j - 1]
        runs = torch.cat([rtt[r, p:s] for r, p, s in zip(rpi.tolist(), pos0.tolist(), seq.tolist())])
        cumsum_into(seq - pos0, out["list_indptr"][j, :bs + 1])
        target[:runs.shape[0]] = runs if j == 0 else mapping[runs]
    n = loc.shape[0]
    out["loc_out"][:n] = mapping[loc]  # negative locs read from the end (index_select would refuse them)
    out["loc_out"][n:] = 0


def separate_refill(inputs, translate, out):
    """Today's separate launches: write locs, lists, then one per window."""
    rtt, rpi = inputs[:2]
    mapping, loc = translate
    refill.translate_into(mapping, loc, out["loc_out"])
    refill.fill_lists(*inputs, *(out[k] for k in ("lens", "q_pos0", "qo_indptr", "list_indptr", "list_pos0",
                                                  "full_indices")))
    for i, row in enumerate(out["window_indices"]):
        refill.translate_runs(mapping, rtt, rpi, out["list_pos0"][1 + i], out["list_indptr"][1 + i], row)


def one_launch_refill(inputs, translate, out):
    refill.fill_translated(*inputs, *(out[k] for k in ("lens", "q_pos0", "qo_indptr", "list_indptr", "list_pos0",
                                                       "full_indices")), *translate, out["loc_out"],
                           out["window_indices"])


@pytest.mark.parametrize("windows", [(5,), (3, 9)], ids=["one-window", "two-windows"])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "extend"])
def test_fill_translated_matches_separate_launches_and_torch(windows, decode):
    """Random rows, mappings (zeros, negative locs read from the end), lens and batch sizes 1..40: the one launch
    writes exactly what the separate launches write, everywhere (untouched entries stay JUNK alike), and the
    torch ops' buffers on every entry a kernel reads (each list up to its indptr[bs])."""
    gen = torch.Generator().manual_seed(len(windows) + 2 * decode)
    for bs in (1, 6, 33):
        inputs, translate, start = random_refill_inputs(gen, bs, windows, decode)
        results = []
        for run in (torch_refill, separate_refill, one_launch_refill):
            out = {k: v.clone() for k, v in start.items()}
            run(inputs, translate, out)
            results.append(out)
        ref, sep, one = results
        n = translate[1].shape[0]
        assert (one["loc_out"][n:] == 0).all() and (one["loc_out"][:n] == translate[0][translate[1]]).all()
        for k in start:
            assert torch.equal(sep[k], one[k]), f"bs={bs}: {k} differs from the separate launches'"
            if k == "full_indices" or k == "window_indices":
                rows = [one[k]] if k == "full_indices" else list(one[k])
                for j, row in enumerate(rows):
                    live = int(one["list_indptr"][j + (k != "full_indices"), bs])
                    ref_row = ref[k] if k == "full_indices" else ref[k][j]
                    assert torch.equal(row[:live], ref_row[:live]), f"bs={bs}: {k}[{j}] differs from torch's"
            else:
                assert torch.equal(ref[k], one[k]), f"bs={bs}: {k} differs from torch's"


def randomized(h, gen, bs, decode, map_len):
    """A batch of `bs` random rows of random contents, random lens and write locs, over a random mapping with
    zeros (registered on the pool: the allocator's own is untouched)."""
    rtt = h.rtt.req_to_token
    ctx = rtt.shape[1]
    rtt.copy_(torch.randint(1, map_len - 1, rtt.shape, generator=gen))
    mapping = torch.randint(1, 100, (map_len,), generator=gen)
    mapping[torch.rand(map_len, generator=gen) < 0.25] = 0
    mapping[-1] = -1
    h.pool.register_mapping(mapping)
    rows = torch.randperm(rtt.shape[0], generator=gen)[:bs]
    seq = torch.randint(1, ctx + 1, (bs,), generator=gen)
    if decode:
        return ForwardBatch(ForwardMode.DECODE, bs, rows, seq, torch.randint(1, map_len - 1, (bs,), generator=gen))
    ext = torch.minimum(torch.randint(1, 4, (bs,), generator=gen), seq)
    loc = torch.randint(1, map_len - 1, (int(ext.sum()),), generator=gen)
    return ForwardBatch(ForwardMode.EXTEND, bs, rows, seq, loc, seq - ext, ext)


@pytest.mark.parametrize("windows", [(W,), (3, W)], ids=["one-window", "two-windows"])
def test_graph_refill_one_launch_matches_separate_launches_and_torch(windows, monkeypatch):
    """init_forward_metadata_graph through `fill_translated`, through the separate kernels and through torch, from
    the same buffers: every static buffer the same (the write locs' zeroed tail included; lists up to their
    indptr[bs]), `swa_loc` the buffer's [:n] view, the same counted translations."""
    gen = torch.Generator().manual_seed(len(windows))
    h = Harness(ReferenceBackend, geometry=ModelGeometry(num_layers=2, swa_every=2, window=W), size=1024,
                size_swa=128, page_size=1, max_reqs=48, max_context_len=32)
    h.backend = ReferenceBackend(h.pool, h.rtt, sliding_window=windows)
    h.backend.init_graph_state(40, 96)
    monkeypatch.setitem(ops._FILL, "cpu", fill_kv_indices)
    for bs, decode in ((1, True), (17, True), (40, True), (9, False)):
        batch = randomized(h, gen, bs, decode, 1024 + 2)
        bufs = snapshot(h)
        for t in bufs.values():
            t.fill_(JUNK)
        start = {k: v.clone() for k, v in bufs.items()}
        states, counted = [], []
        for kernels in (None, SEPARATE, refill.KERNELS):
            for k, v in bufs.items():
                v.copy_(start[k])
            if kernels is None:
                monkeypatch.delitem(ops._REFILL, "cpu", raising=False)
            else:
                monkeypatch.setitem(ops._REFILL, "cpu", kernels)
            before = (h.backend.loc_cache.translations, h.backend.window_translations)
            md = h.backend.init_forward_metadata_graph(batch)
            counted.append((h.backend.loc_cache.translations - before[0], h.backend.window_translations - before[1]))
            states.append({k: v.clone() for k, v in bufs.items()})
            n = batch.num_tokens
            swa = md.write_loc.swa_loc
            assert swa is h.backend.loc_cache.current and swa.shape[0] == n
            assert swa._base is h.backend.loc_cache.buffer and swa.data_ptr() == h.backend.loc_cache.buffer.data_ptr()
        ref, sep, one = states
        assert counted == [(1, len(windows))] * 3
        assert (one["swa"][:batch.num_tokens] == h.pool.full_to_swa_index_mapping[batch.out_cache_loc]).all()
        assert (one["swa"][batch.num_tokens:] == 0).all()
        for k in start:
            assert torch.equal(sep[k], one[k]), f"bs={bs}: {k} differs from the separate launches'"
        assert_same(h, ref, one, bs)


def counted_refill(windows, monkeypatch):
    """The device's refill kernels registered with each call's name recorded, over a harness of three warmed
    requests: (the calls, the harness, its request ids)."""
    calls = []

    def counted(name, fn):
        return lambda *a: calls.append(name) or fn(*a)

    fused(monkeypatch, True, ops.GraphRefillKernels(*(counted(f, k) for f, k in zip(refill.KERNELS._fields,
                                                                                      refill.KERNELS))))
    h = harness(2, windows=windows)
    return calls, h, warm(h, [2, 13, 40])


@pytest.mark.parametrize("windows", [(W,), (3, W)], ids=["one-window", "two-windows"])
def test_decode_refill_is_one_launch_of_the_registered_kernels(windows, monkeypatch, launches):
    """A decode refill through the backend calls the device's refill kernels once (`fill_translated`): one Triton
    launch, no torch op; a subclass with its own window translation keeps the torch path and its hook."""
    calls, h, rids = counted_refill(windows, monkeypatch)
    batch = padded(h, rids, [1, 1, 1], ForwardMode.DECODE, 4)
    launches.triton.clear()
    launches.aten.clear()
    with launches:
        h.backend.init_forward_metadata_graph(batch)
    assert calls == ["fill_translated"] and launches.triton == ["_fill_lists_kernel"] and not launches.aten

    class OwnTranslation(ReferenceBackend):
        def _translate_window(self, locs, out=None):
            calls.append("hook")
            return super()._translate_window(locs, out=out)

    h.backend = OwnTranslation(h.pool, h.rtt, sliding_window=windows)
    h.backend.init_graph_state(8, 24)
    calls.clear()
    h.backend.init_forward_metadata_graph(batch)
    assert calls == ["translate_into"] + ["hook"] * len(windows)  # the torch path, the pool's write-loc kernel


@pytest.mark.parametrize("windows", [(W,), (3, W)], ids=["one-window", "two-windows"])
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_eager_metadata_is_one_launch_of_fill_translated(windows, mode, monkeypatch, launches):
    """Eager metadata on a device with `fill_translated` over a hybrid pool: one call of it, one Triton launch and
    one allocation (the forward's buffers), the same translations counted as the separate launches' (one of the
    write locs, one per window list)."""
    calls, h, rids = counted_refill(windows, monkeypatch)
    batch = h.make_batch(rids, [1, 1, 1] if mode == ForwardMode.DECODE else [2, 1, 3], mode)
    be = h.backend
    before = (be.loc_cache.translations, be.window_translations)
    launches.triton.clear()
    launches.aten.clear()
    with launches:
        be.init_forward_metadata(batch)
    assert calls == ["fill_translated"] and launches.triton == ["_fill_lists_kernel"]
    # one allocation, the forward's buffers (a decode's host extend lengths, ones on the CPU, aside)
    assert [op for op in launches.aten if op != "aten.ones.default"] == ["aten.empty.memory_format"]
    assert (be.loc_cache.translations, be.window_translations) == (before[0] + 1, before[1] + len(windows))
