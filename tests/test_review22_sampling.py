"""Review 22 (rev3): the sampler on non-finite logits and cold temperatures, ForwardBatch.batch_size, and the eager
metadata step's window lengths.

1. A row holding +inf draws among its +inf tokens (greedy's pick, the T -> 0 limit); NaN counts as +inf (as argmax
   ranks it); a row of nothing but -inf draws from the whole row.
2. A temperature in (0, 1e-6) samples at that temperature, not at 1e-6; no row overflows. Finite rows at T >= 1e-6
   draw exactly what they drew before.
3. `ForwardBatch.batch_size` is an integer >= 0 (numpy and 0-d tensor integers stored as int): anything else is a
   ShapeError at construction, and the pools, tables and graph buffers stay as they were.
4. The eager metadata step's per-window list lengths come from vector ops over the host lengths: the same numbers as
   the per-request formula, and no Python per request.
"""
import math
import os
import sys
from dataclasses import fields

import numpy as np
import pytest
import torch

from hwkv.allocator import same_snapshot
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.engine.sampling import RowSampling, SamplingParams, sample
from hwkv.errors import HwkvError, ShapeError
from hwkv.testing.harness import Harness, ModelGeometry
from hwkv.testing.reference_backend import ReferenceBackend
from hwkv_cpu.backend import TorchCPUBackend

INF = math.inf


def draw(logits, temperature, top_p=1.0, n=None, seeds=None):
    """`sample` over `logits` [V] repeated n times (seeds 0..n-1) or [K, V] (seeds 0..K-1), output index 0."""
    if logits.dim() == 1:
        logits = logits.expand(n, -1).contiguous()
    k = logits.shape[0]
    seeds = torch.arange(k) if seeds is None else seeds
    return sample(logits, torch.full((k,), float(temperature)), torch.full((k,), float(top_p)), seeds,
                  torch.zeros(k, dtype=torch.int64), True)


def old_sample(logits, temperature, top_p, seeds, steps):
    """The sampler before review 22, for finite logits and T >= 1e-6 (whose draws must not change)."""
    from hwkv.engine.sampling import _outside_nucleus, uniform_noise
    t = temperature.to(torch.float32).clamp(min=1e-6)[:, None]
    logp = torch.log_softmax(logits.to(torch.float32) / t, dim=-1)
    sorted_lp, order = logp.sort(dim=-1)
    sorted_lp = sorted_lp.masked_fill(_outside_nucleus(sorted_lp.exp(), top_p), -INF)
    u = uniform_noise(seeds, steps, order)
    return order.gather(-1, (sorted_lp - torch.log(-torch.log(u))).argmax(dim=-1, keepdim=True))[:, 0]


# ---- 1. +inf, NaN and all -inf rows ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1e-7, 0.7, 1.0, 50.0])
@pytest.mark.parametrize("top_p", [1.0, 0.5])
def test_a_row_holding_inf_draws_among_its_inf_tokens(dtype, temperature, top_p):
    logits = torch.zeros(32, dtype=dtype)
    logits[5] = logits[20] = INF
    logits[7] = 3.0
    tok = draw(logits, temperature, top_p, n=400)
    counts = torch.bincount(tok, minlength=32)
    assert counts.sum() == counts[5] + counts[20], counts.tolist()
    if top_p == 1.0:  # both, about equally (the nucleus at 0.5 may keep one of the two)
        assert min(int(counts[5]), int(counts[20])) > 120, counts.tolist()
    greedy = draw(logits, 0.0, top_p, n=4)
    assert greedy.tolist() == [5] * 4


def test_one_inf_token_is_greedys_answer_through_row_sampling():
    logits = torch.zeros(2, 32)
    logits[:, 5] = INF
    logits[:, 7] = 3.0
    rs = RowSampling(4, torch.device("cpu"))
    rs.admit([0, 1], [SamplingParams(temperature=0.7, seed=3), SamplingParams(temperature=0.7, top_p=0.5, seed=4)])
    assert rs.sample(logits, torch.tensor([0, 1])).tolist() == [5, 5]


def test_nan_counts_as_inf_as_in_argmax():
    row = torch.zeros(16)
    row[3], row[9] = math.nan, 4.0
    assert draw(row, 0.0, n=2).tolist() == [3, 3]  # argmax (greedy) ranks NaN highest
    assert draw(row, 1.0, n=300).unique().tolist() == [3]
    assert draw(row, 1e-7, 0.5, n=50).unique().tolist() == [3]
    row[12] = INF  # NaN and +inf: drawn among both
    assert draw(row, 1.0, n=300).unique().tolist() == [3, 12]


def test_a_row_of_only_minus_inf_draws_from_the_whole_row():
    tok = draw(torch.full((8,), -INF), 1.0, n=800)
    counts = torch.bincount(tok, minlength=8)
    assert counts.shape[0] == 8 and int(counts.min()) > 50, counts.tolist()


def test_finite_rows_beside_non_finite_ones_keep_their_draws():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 40, generator=gen) * 3
    want = draw(logits, 0.8, 0.9)
    odd = logits.clone()
    odd[1, 4], odd[3, 8], odd[5] = INF, math.nan, -INF
    got = draw(odd, 0.8, 0.9)
    assert got[[0, 2, 4]].tolist() == want[[0, 2, 4]].tolist()
    assert got[1] == 4 and got[3] == 8


# ---- 2. cold temperatures --------------------------------------------------------------------------------------
def test_a_temperature_below_1e_6_samples_at_that_temperature():
    """Logits [0, 2e-6] at T=1e-7: token 0 has p = 1/(1 + e^20) ~ 2e-9 (at 1e-6 it was 0.12)."""
    tok = draw(torch.tensor([0.0, 2e-6]), 1e-7, n=4000)
    assert int((tok == 0).sum()) == 0


@pytest.mark.parametrize("base", [0.0, 5.0, -3.0])
def test_cold_rows_follow_the_softmax_at_their_temperature(base):
    """Two tokens one float32 step apart at `base`, T chosen so that their probabilities are 1/4 and 3/4."""
    lo = torch.tensor(base if base else 1e-30, dtype=torch.float32)
    hi = torch.nextafter(lo, torch.tensor(INF)) if base else torch.tensor(1e-7)
    d = float(hi) - float(lo)
    t = d / math.log(3)
    assert 0 < t < 1e-6
    freq = torch.bincount(draw(torch.stack([lo, hi]), t, n=6000), minlength=2).float() / 6000
    assert abs(float(freq[1]) - 0.75) < 0.03, (t, freq.tolist())


@pytest.mark.parametrize("temperature", [1e-6, 1e-3, 1.0])
def test_logits_whose_quotient_overflows_still_draw_the_most_likely_token(temperature):
    """max / T past float32's range had turned the row into NaN (a fixed unrelated token)."""
    logits = torch.tensor([1e33, 0.0, -1e33, 1e33 - 1e28, 3e38])
    tok = draw(logits, temperature, n=200)
    assert tok.unique().tolist() == [4]
    tok = draw(logits[:4], temperature, n=200)
    assert tok.unique().tolist() == [0]
    neg = torch.tensor([-1e33, -1e33 - 1e28, -3e38])  # every quotient -inf had been NaN too
    assert draw(neg, 1e-6, n=100).unique().tolist() == [0]


@pytest.mark.parametrize("temperature", [1e-6, 0.05, 0.7, 1.0, 1.7, 1e4])
@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.3])
def test_finite_rows_at_1e_6_or_more_draw_as_before(temperature, top_p):
    gen = torch.Generator().manual_seed(11)
    k, v = 256, 300
    logits = torch.randn(k, v, generator=gen) * 4
    logits[::7] *= 1e-6  # rows of near-equal logits
    seeds, steps = torch.randint(0, 2**32, (k,), generator=gen), torch.randint(0, 99, (k,), generator=gen)
    t, p = torch.full((k,), temperature), torch.full((k,), top_p)
    assert torch.equal(sample(logits, t, p, seeds, steps, True), old_sample(logits, t, p, seeds, steps))


# ---- 3. ForwardBatch.batch_size ----------------------------------------------------------------------------------
def _graph_harness():
    h = Harness(ReferenceBackend, geometry=ModelGeometry(num_layers=2, swa_every=2, window=4), size=256, size_swa=64,
                page_size=2, max_reqs=4, max_context_len=32)
    h.backend.init_graph_state(4, 16)
    return h


def _state(h):
    """Pools, mapping, req_to_token, allocator, the backend's graph buffers and translation counters (host copies)."""
    p, be = h.pool, h.backend
    bufs = [b.clone() for sub in (p.full_kv_pool, p.swa_kv_pool) for b in (*sub.k_buffer, *sub.v_buffer)]
    static = []
    for f in fields(be.static):
        val = getattr(be.static, f.name)
        for t in (val.values() if isinstance(val, dict) else [val]):
            if isinstance(t, torch.Tensor):
                static.append(t.clone())
    counters = (be.loc_cache.translations, be.window_translations, h.rtt.available_size())
    return bufs + static + [p.full_to_swa_index_mapping.clone(), h.rtt.req_to_token.clone(),
                            be.loc_cache.buffer.clone()], counters, h.allocator.integrity_snapshot()


def _same(a, b):
    return (len(a[0]) == len(b[0]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and a[1] == b[1]
            and same_snapshot(a[2], b[2]))


@pytest.mark.parametrize("bad, n", [(2.0, 2), (True, 1), (np.True_, 1), (torch.tensor(True), 1), (2.5, 2),
                                    (torch.tensor(2.0), 2), ("2", 2), (None, 0), (-1, 0)])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_a_batch_size_that_is_no_integer_is_refused_at_construction(bad, n, graph):
    h = _graph_harness()
    rids = [h.add_request() for _ in range(2)]
    b = h.make_batch(rids, [3, 5], ForwardMode.EXTEND)
    before = _state(h)
    with pytest.raises(HwkvError) as err:
        batch = ForwardBatch(ForwardMode.EXTEND, bad, b.req_pool_indices[:n], b.seq_lens[:n],
                             b.out_cache_loc[:int(b.extend_seq_lens[:n].sum())], extend_seq_lens=b.extend_seq_lens[:n])
        (h.backend.init_forward_metadata_graph if graph else h.backend.init_forward_metadata)(batch)
    assert isinstance(err.value, ShapeError), repr(err.value)
    msg = str(err.value)
    assert msg.startswith("batch_size must be an integer >= 0") and f"got {bad!r}" in msg, msg
    assert _same(before, _state(h))


@pytest.mark.parametrize("size", [np.int64(2), np.int32(2), torch.tensor(2)])
def test_integer_batch_sizes_of_numpy_and_torch_are_stored_as_int(size):
    h = _graph_harness()
    rids = [h.add_request() for _ in range(2)]
    b = h.make_batch(rids, [3, 5], ForwardMode.EXTEND)
    batch = ForwardBatch(ForwardMode.EXTEND, size, b.req_pool_indices, b.seq_lens, b.out_cache_loc,
                         extend_seq_lens=b.extend_seq_lens)
    assert type(batch.batch_size) is int and batch.batch_size == 2
    md = h.backend.init_forward_metadata(batch)
    assert md.batch_size == 2 and md.full.indices.tolist() == h.backend.init_forward_metadata(b).full.indices.tolist()
    assert h.backend.init_forward_metadata_graph(batch).batch_size == 2


# ---- 4. the eager step's window lengths ------------------------------------------------------------------------
CTX = 40
WINDOWS = (1, 2, 5, 17, CTX, CTX + 1, 1000)


def old_win_lens(seq_h, ext_h, windows):
    """The per-request formula the eager metadata step used before review 22."""
    return {w: [s - max(0, s - e - w + 1) for s, e in zip(seq_h, ext_h)] for w in windows}


def _windows_harness(factory, seed):
    h = Harness(factory, geometry=ModelGeometry(num_layers=2, swa_every=2, window=1000), size=2048, size_swa=2048,
                page_size=1, max_reqs=24, max_context_len=CTX, seed=seed, shadow=False, sliding_window=WINDOWS)
    return h


def _random_batch(h, gen, mode):
    """Requests with random prefixes (0 included), then one forward of random new lengths (0 included in
    EXTEND/MIXED, where a zero-length row needs a prefix)."""
    bs = int(torch.randint(1, 20, (1,), generator=gen))
    rids = [h.add_request() for _ in range(bs)]
    for rid in rids:
        n = int(torch.randint(0 if mode != ForwardMode.DECODE else 1, CTX - 8, (1,), generator=gen))
        if n:
            h.make_batch([rid], [n], ForwardMode.EXTEND)
    if mode == ForwardMode.DECODE:
        new = [1] * bs
    else:
        new = [int(torch.randint(0 if h.requests[r].seq_len else 1, 8, (1,), generator=gen)) for r in rids]
    return h.make_batch(rids, new, mode)


def _spy(be, monkeypatch):
    """Records the win_lens argument of the eager list builders (torch path and fused path)."""
    seen = []
    for name in ("_eager_lists", "_eager_fused"):
        inner = getattr(be, name)

        def spy(*a, _inner=inner, **k):
            seen.append({w: list(v) for w, v in a[-1].items()})
            return _inner(*a, **k)
        monkeypatch.setattr(be, name, spy)
    return seen


def _fused(monkeypatch):
    """The fused eager path (hwkv_cuda's refill kernels, interpreted) for CPU tensors."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the fused path runs here under TRITON_INTERPRET=1 (a GPU run covers it on the device)")
    pytest.importorskip("triton")
    from hwkv import ops
    from hwkv_cuda.kernels import fill_kv_indices, refill
    monkeypatch.setitem(ops._REFILL, "cpu", refill.KERNELS)
    monkeypatch.setitem(ops._FILL, "cpu", fill_kv_indices)


@pytest.mark.parametrize("path", ["torch", "cpu", "fused"])
@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DECODE])
def test_window_lengths_equal_the_per_request_formula(path, mode, monkeypatch):
    if path == "fused":
        _fused(monkeypatch)
    for seed in range(3 if path == "fused" else 12):
        gen = torch.Generator().manual_seed(seed)
        h = _windows_harness(TorchCPUBackend if path == "cpu" else ReferenceBackend, seed)
        batch = _random_batch(h, gen, mode)
        seen = _spy(h.backend, monkeypatch)
        md = h.backend.init_forward_metadata(batch)
        seq_h, ext_h = (t.tolist() for t in batch.host_lens())
        want = old_win_lens(seq_h, ext_h, WINDOWS)
        assert seen == [want], (seed, seq_h, ext_h)
        for w, lens in want.items():
            kv = md.windows[w]
            assert torch.diff(kv.indptr).tolist() == lens
            assert (kv.indices.shape[0], kv.max_len, kv.min_len) == (sum(lens), max(lens), min(lens)), (seed, w)


def test_window_lengths_of_no_requests():
    h = _windows_harness(ReferenceBackend, 0)
    empty = torch.zeros(0, dtype=torch.int64)
    md = h.backend.init_forward_metadata(ForwardBatch(ForwardMode.IDLE, 0, empty, empty, empty))
    assert all((kv.indices.shape[0], kv.max_len, kv.min_len) == (0, 0, 0) for kv in md.windows.values())


def _lines_run(h, batch):
    """Python lines executed in hwkv/backend.py and hwkv/batch.py while one eager metadata step runs."""
    files = {sys.modules["hwkv.backend"].__file__, sys.modules["hwkv.batch"].__file__}
    count = [0]

    def tracer(frame, event, arg):
        if frame.f_code.co_filename not in files:
            return None
        if event == "line":
            count[0] += 1
        return tracer

    sys.settrace(tracer)
    try:
        h.backend.init_forward_metadata(batch)
    finally:
        sys.settrace(None)
    return count[0]


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE])
def test_the_eager_step_runs_no_python_per_request(mode):
    counts = []
    for bs in (3, 60):
        h = Harness(ReferenceBackend, geometry=ModelGeometry(num_layers=4, swa_every=2, window=16,
                                                             swa_windows=(4, 16)),
                    size=2048, size_swa=2048, page_size=4, max_reqs=64, max_context_len=32, shadow=False)
        rids = [h.add_request() for _ in range(bs)]
        h.make_batch(rids, [3] * bs, ForwardMode.EXTEND)
        batch = h.make_batch(rids, [1] * bs if mode == ForwardMode.DECODE else [2] * bs, mode)
        h.backend.init_forward_metadata(batch)  # a first step's one-off work aside
        counts.append(_lines_run(h, batch))
    assert counts[0] == counts[1], counts


def test_a_float64_temperature_that_is_zero_in_float32_is_greedy():
    """`sample` reads temperatures in float32: a float64 T of 1e-50 (0 there) is greedy, not a NaN row's token 0."""
    logits = torch.tensor([[0.0, 3.0, 1.0]]).expand(8, -1).contiguous()
    got = sample(logits, torch.full((8,), 1e-50, dtype=torch.float64), torch.ones(8), torch.arange(8),
                 torch.zeros(8, dtype=torch.int64), True)
    assert got.tolist() == [1] * 8
