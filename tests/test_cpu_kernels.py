"""hwkv_cpu.kernels against hwkv.reference on tiny random shapes (CPU, no vendor library)."""
import math

import pytest
import torch

from hwkv import reference
from hwkv.errors import LocError, ShapeError
from hwkv.ops import quantize
from hwkv.window import first_visible
from hwkv_cpu import amx, kernels, kernels_decode, kernels_extend

pytestmark = pytest.mark.cpu

FP8 = [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d]
TOL = {torch.float32: 3e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _indptr(lens):
    return torch.tensor([0] + list(lens), dtype=torch.int64).cumsum(0).to(torch.int32)


class Case:
    """A batch whose K/V sit at scattered slots of a pool larger than needed (slot 0 = padding).

    window_list: request b's list starts at first_visible(q_pos0[b], W) (kv_pos0 > 0), as the
    metadata step builds window lists; otherwise it holds the whole sequence.
    """

    def __init__(self, seq_lens, extend_lens, h=4, kvh=2, d=16, dv=None, dtype=torch.float32, window=None,
                 window_list=True, k_scale=None, v_scale=None, seed=0):
        g = torch.Generator().manual_seed(seed)
        dv = dv or d
        self.seq_lens, self.extend_lens, self.window = list(seq_lens), list(extend_lens), window
        self.h, self.dv, self.dtype, self.k_scale, self.v_scale = h, dv, dtype, k_scale, v_scale
        total = sum(seq_lens)
        size = 2 * total + 7
        k_true = torch.randn(size, kvh, d, generator=g)
        v_true = torch.randn(size, kvh, dv, generator=g)
        self.k_buf, self.v_buf = quantize(k_true, dtype, k_scale), quantize(v_true, dtype, v_scale)
        perm = torch.randperm(size - 1, generator=g)[:total] + 1
        self.slots = list(torch.split(perm, self.seq_lens))
        # what the pool holds, dequantized: the kernel's exact target
        k_deq = self.k_buf.float() * (k_scale or 1.0)
        v_deq = self.v_buf.float() * (v_scale or 1.0)
        self.keys = [k_deq[s] for s in self.slots]
        self.values = [v_deq[s] for s in self.slots]
        self.keys_true = [k_true[s] for s in self.slots]
        self.values_true = [v_true[s] for s in self.slots]
        self.q_pos0 = [s - e for s, e in zip(seq_lens, extend_lens)]
        pos0 = [first_visible(p, window) if window_list else 0 for p in self.q_pos0]
        lists = [s[p:] for s, p in zip(self.slots, pos0)]
        self.kv_indptr = _indptr([len(x) for x in lists])
        self.kv_indices = torch.cat(lists + [torch.zeros(5, dtype=torch.int64)])  # unspecified tail
        self.kv_pos0 = torch.tensor(pos0, dtype=torch.int64)
        self.qo_indptr = _indptr(extend_lens)
        self.q = torch.randn(sum(extend_lens), h, d, generator=g).to(dtype if dtype not in FP8 else torch.float32)
        self.scaling = 1.0 / math.sqrt(d)

    def ref(self, logit_cap=0.0, sinks=None, q=None, true=False):
        keys, values = (self.keys_true, self.values_true) if true else (self.keys, self.values)
        return reference.batch_attention((self.q if q is None else q).float(), keys, values, self.seq_lens,
                                         self.extend_lens, self.scaling, self.window, logit_cap, sinks)

    def extend(self, logit_cap=0.0, sinks=None, out_dtype=None):
        out = torch.full((self.q.shape[0], self.h, self.dv), float("nan"), dtype=out_dtype or self.q.dtype)
        kernels.extend_attention(self.q, self.k_buf, self.v_buf, self.kv_indptr, self.kv_indices, self.kv_pos0,
                                 self.qo_indptr, torch.tensor(self.q_pos0), out, max(self.extend_lens),
                                 self.scaling, self.window, logit_cap, sinks, self.k_scale, self.v_scale)
        return out

    def decode(self, logit_cap=0.0, sinks=None, out_dtype=None, q=None):
        """Each request's last query (needs a list that reaches the request's end)."""
        q = self.q if q is None else q
        out = torch.full((len(self.seq_lens), self.h, self.dv), float("nan"), dtype=out_dtype or q.dtype)
        q_pos = torch.tensor([s - 1 for s in self.seq_lens], dtype=torch.int64)
        kernels.decode_attention(q, self.k_buf, self.v_buf, self.kv_indptr, self.kv_indices, self.kv_pos0, q_pos,
                                 out, self.scaling, self.window, logit_cap, sinks, self.k_scale, self.v_scale,
                                 max_kv_len=max(self.seq_lens))
        return out


def _tol(pool_dtype, out_dtype=torch.float32):
    """Output rounding, or the error of bf16 scores where the pool computes in bf16 (AMX)."""
    tol = TOL.get(out_dtype, TOL[torch.float32])
    return max(tol, 4e-2) if amx.compute_dtype(pool_dtype) == torch.bfloat16 else tol


def _close(out, ref, tol):
    assert not torch.isnan(out).any(), "output holds NaN (unwritten or 0/0)"
    err = (out.float() - ref).abs().max().item()
    assert err <= tol * max(1.0, ref.abs().max().item()), f"max abs error {err} > {tol}"


def _sinks(h, seed=1):
    return torch.randn(h, generator=torch.Generator().manual_seed(seed)) * 2


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request):
    """Run with this torch thread count (1: inline; more: split over parallel_map's threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of a few keys, so that every test crosses chunk and query-block borders."""
    monkeypatch.setattr(kernels_decode.decode_torch, "__defaults__", (10,))
    monkeypatch.setattr(kernels_decode, "MIN_CHUNK", 3)
    monkeypatch.setattr(kernels_extend.extend_torch, "__defaults__", (4, 12))
    monkeypatch.setattr(kernels_extend, "RESIDENT_BYTES", 0)


# ---- decode ---------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [None, 1, 3, 17, 40])
@pytest.mark.parametrize("window_list", [True, False])
def test_decode_matches_reference(small_chunks, threads, window, window_list):
    c = Case([1, 17, 33, 2], [1, 1, 1, 1], window=window, window_list=window_list, seed=window or 0)
    _close(c.decode(), c.ref(), TOL[torch.float32])


@pytest.mark.parametrize("chunked", [True, False])
def test_decode_sinks_softcap_gqa_dv(request, chunked):
    if chunked:
        request.getfixturevalue("small_chunks")
    c = Case([9, 38, 3], [1, 1, 1], h=8, kvh=2, d=24, dv=40, window=8, seed=2)
    sinks = _sinks(8)
    _close(c.decode(logit_cap=1.5, sinks=sinks), c.ref(1.5, sinks), TOL[torch.float32])
    _close(c.decode(sinks=sinks), c.ref(0.0, sinks), TOL[torch.float32])
    _close(c.decode(logit_cap=30.0), c.ref(30.0), TOL[torch.float32])


def _edge_case(extend_lens):
    """6 tokens, W = 3, the whole (untrimmed) list; V of the key at position p is the unit vector
    e_p, and the last query scores key 2 at 100 / sqrt(8), every other key at 0."""
    c = Case([6], extend_lens, h=2, kvh=1, d=8, dv=6, window=3, window_list=False, seed=4)
    k = torch.zeros_like(c.k_buf)
    v = torch.zeros_like(c.v_buf)
    for pos, slot in enumerate(c.slots[0].tolist()):
        v[slot, 0, pos] = 1.0
    k[c.slots[0][2], 0, 0] = 100.0  # key 2 would dominate if it leaked in
    c.k_buf, c.v_buf = k, v
    c.q = torch.zeros_like(c.q)
    c.q[-1, :, 0] = 1.0
    return c


@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_window_edge_sees_exactly_keys_3_4_5(mode):
    """W = 3, query at position 5: keys 3, 4, 5 (a third each), no other."""
    c = _edge_case([1] if mode == "decode" else [6])
    run = (lambda **kw: c.decode(**kw)) if mode == "decode" else (lambda **kw: c.extend(**kw)[-1:])
    expect = torch.tensor([0, 0, 0, 1 / 3, 1 / 3, 1 / 3]).expand(1, 2, 6)
    _close(run(), expect, 1e-6)
    sinks = torch.full((2,), math.log(3.0))  # denominator 3 + 3: each visible key gets 1/6
    _close(run(sinks=sinks), expect / 2, 1e-6)


def test_decode_no_visible_key_outputs_zeros():
    c = Case([4, 6], [1, 1], window=2, window_list=False, seed=5)
    c.kv_indptr = torch.tensor([0, 0, 6], dtype=torch.int32)  # request 0: empty list
    c.kv_indices = torch.cat([c.slots[1], torch.zeros(3, dtype=torch.int64)])
    out = c.decode(sinks=_sinks(4))
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    c.kv_pos0 = torch.tensor([0, 100])  # request 1's keys all lie after its query
    out = c.decode()
    assert torch.equal(out, torch.zeros_like(out))


# ---- extend ---------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [None, 1, 3, 9, 64])
@pytest.mark.parametrize("prefix", [False, True])
def test_extend_matches_reference(small_chunks, threads, window, prefix):
    ext = [7, 13, 1, 30]
    seq = [e + (p if prefix else 0) for e, p in zip(ext, [5, 20, 0, 11])]
    c = Case(seq, ext, window=window, seed=10 + (window or 0))
    _close(c.extend(), c.ref(), TOL[torch.float32])


def test_extend_sinks_softcap_gqa_dv_untrimmed(small_chunks):
    c = Case([29, 11], [17, 11], h=6, kvh=2, d=8, dv=12, window=5, window_list=False, seed=11)
    sinks = _sinks(6)
    _close(c.extend(logit_cap=2.0, sinks=sinks), c.ref(2.0, sinks), TOL[torch.float32])


def test_extend_default_blocks_mha():
    c = Case([300, 90], [260, 90], h=2, kvh=2, d=16, window=100, seed=12)
    _close(c.extend(), c.ref(), TOL[torch.float32])


def test_decode_and_extend_agree_on_last_token(small_chunks):
    c = Case([23, 40, 9], [6, 40, 2], h=4, kvh=1, d=16, window=None, seed=13)
    ext = c.extend(logit_cap=3.0)
    last = (c.qo_indptr[1:] - 1).long()
    dec = c.decode(logit_cap=3.0, q=c.q[last])
    _close(dec, ext[last], 1e-6)


# ---- dtypes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("compute", ["this CPU's", "bf16 (AMX path)"])
def test_reduced_pools(small_chunks, monkeypatch, dtype, compute):
    if compute.startswith("bf16"):
        monkeypatch.setattr(amx, "compute_dtype", lambda buf_dtype: torch.bfloat16)
    tol = _tol(dtype, dtype)
    c = Case([12, 30], [1, 1], h=4, kvh=2, d=16, dtype=dtype, window=9, seed=20)
    _close(c.decode(sinks=_sinks(4), out_dtype=torch.float32), c.ref(0.0, _sinks(4)), tol)
    e = Case([12, 30], [5, 30], h=4, kvh=2, d=16, dtype=dtype, window=9, seed=21)
    _close(e.extend(logit_cap=4.0), e.ref(4.0), tol)


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_fp8_pools_with_scales(small_chunks, dtype):
    c = Case([15, 31], [4, 31], h=4, kvh=2, d=16, dtype=dtype, window=20, k_scale=0.5, v_scale=0.25, seed=30)
    _close(c.extend(), c.ref(), _tol(dtype))  # exact w.r.t. what the pool holds (fp32 compute)
    rel = 0.07 if dtype == torch.float8_e4m3fn else 0.14  # 3 / 2 mantissa bits
    _close(c.extend(), c.ref(true=True), rel)  # and within quantization error of the true K/V
    d = Case([15, 31], [1, 1], h=4, kvh=2, d=16, dtype=dtype, k_scale=2.0, v_scale=0.5, seed=31)
    _close(d.decode(), d.ref(), _tol(dtype))


def test_scale_tensors_and_bf16_out():
    c = Case([10], [10], h=2, kvh=1, d=8, k_scale=0.5, v_scale=2.0, seed=40)
    c.k_scale, c.v_scale = torch.tensor(0.5), torch.tensor([2.0])
    _close(c.extend(out_dtype=torch.bfloat16), c.ref(), _tol(torch.bfloat16, torch.bfloat16))


def test_parallel_map_runs_single_threaded_ops_and_restores(threads):
    seen = kernels_decode.parallel_map(lambda _: torch.get_num_threads(), range(4))
    assert seen == [1] * 4
    assert torch.get_num_threads() == threads


def test_parallel_map_restores_threads_on_error(threads):
    def boom(_):
        raise ValueError("boom")
    with pytest.raises(ValueError):
        kernels_decode.parallel_map(boom, range(3))
    assert torch.get_num_threads() == threads


def test_parallel_map_runs_in_the_callers_inference_and_grad_mode(threads):
    """Grad and inference mode are thread-local: helpers run as the caller does, so an engine step (inference mode)
    may extend in place into its inference-tensor outputs from every thread, and a grad-enabled caller's helpers
    still record."""
    with torch.inference_mode():
        out = torch.zeros(4)
        modes = kernels_decode.parallel_map(lambda i: (out[i:i + 1].add_(i + 1), torch.is_inference_mode_enabled())[1],
                                            range(4))
    assert modes == [True] * 4 and out.tolist() == [1.0, 2.0, 3.0, 4.0]
    with torch.no_grad():
        assert kernels_decode.parallel_map(lambda _: torch.is_grad_enabled(), range(4)) == [False] * 4
    assert kernels_decode.parallel_map(lambda _: (torch.is_grad_enabled(), torch.is_inference_mode_enabled()),
                                       range(4)) == [(True, False)] * 4


def test_split_columns_balances_keys():
    assert kernels_decode._split_columns([4096] * 8, 2, 512) == [(0, 2048), (2048, 4096)]
    assert kernels_decode._split_columns([100, 50, 10], 2, 8) == [(0, 35), (35, 100)]  # 80 keys each
    assert kernels_decode._split_columns([5], 2, 16) == [(0, 5)]  # too few keys to split


# ---- contracts ------------------------------------------------------------------------------
def test_inputs_unchanged(small_chunks):
    c = Case([8, 21], [3, 21], dtype=torch.bfloat16, window=6, k_scale=0.5, seed=50)
    sinks = _sinks(4)
    before = [t.clone() for t in (c.q, c.k_buf, c.v_buf, c.kv_indices, c.kv_indptr, c.kv_pos0, sinks)]
    c.extend(logit_cap=2.0, sinks=sinks)
    last = (c.qo_indptr[1:] - 1).long()
    c.decode(logit_cap=2.0, sinks=sinks, q=c.q[last].clone())
    after = (c.q, c.k_buf, c.v_buf, c.kv_indices, c.kv_indptr, c.kv_pos0, sinks)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_bad_arguments_raise_typed_errors():
    c = Case([4], [1], seed=60)
    with pytest.raises(ShapeError, match="out"):
        kernels.decode_attention(c.q, c.k_buf, c.v_buf, c.kv_indptr, c.kv_indices, c.kv_pos0,
                                 torch.tensor([3]), torch.empty(1, 4, 3), None, None, 0.0, None, None, None)
    with pytest.raises(ShapeError, match="heads"):
        kernels.decode_attention(c.q[:, :3], c.k_buf, c.v_buf, c.kv_indptr, c.kv_indices, c.kv_pos0,
                                 torch.tensor([3]), torch.empty(1, 3, 16), None, None, 0.0, None, None, None)
    with pytest.raises(LocError, match="kv_indices"):
        kernels.decode_attention(c.q, c.k_buf, c.v_buf, c.kv_indptr, c.kv_indices.float(), c.kv_pos0,
                                 torch.tensor([3]), torch.empty(1, 4, 16), None, None, 0.0, None, None, None)


def test_runs_under_torch_compile():
    c = Case([9, 17], [1, 1], window=4, seed=70)
    out = torch.empty(2, 4, 16)
    q_pos = torch.tensor([8, 16])

    def step():
        kernels.decode_attention(c.q, c.k_buf, c.v_buf, c.kv_indptr, c.kv_indices, c.kv_pos0, q_pos, out,
                                 c.scaling, c.window, 0.0, None, None, None)
        return out

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    _close(compiled(), c.ref(), TOL[torch.float32])


def test_active_path_names_the_path():
    name, why = amx.active_path()
    assert name and why
    assert amx.compute_dtype(torch.float32) == torch.float32
    if not amx.features().amx:
        assert amx.compute_dtype(torch.bfloat16) == torch.float32


# ---- sgl-kernel glue, against the schema stand-ins (hwkv.testing.vendor_schemas.sgl_kernel) ----------
class StandInSgl:
    """decode_attention_cpu / extend_attention_cpu as sgl-kernel registers them: a wrong call fails."""

    def __init__(self):
        from hwkv.testing.vendor_schemas.sgl_kernel import make_sgl_ops

        self.decode, self.extend = make_sgl_ops()

    @property
    def calls(self):
        return ["decode"] * len(self.decode.calls) + ["extend"] * len(self.extend.calls)


@pytest.fixture
def fake_sgl(monkeypatch):
    fake = StandInSgl()
    monkeypatch.setattr(amx, "sgl_ops", lambda: (amx.SglOps(fake.decode, fake.extend), ""))
    return fake


def test_sgl_glue_decode_and_extend(fake_sgl):
    c = Case([5, 40, 2], [1, 1, 1], h=4, kvh=2, d=32, dtype=torch.bfloat16, window=16, seed=80)
    k_before = c.k_buf.clone()
    _close(c.decode(logit_cap=3.0), c.ref(3.0), _tol(torch.bfloat16, torch.bfloat16))
    assert fake_sgl.calls == ["decode"] and torch.equal(c.k_buf, k_before)
    e = Case([9, 33], [4, 33], h=4, kvh=2, d=32, dtype=torch.bfloat16, k_scale=0.5, seed=81)
    _close(e.extend(), e.ref(), _tol(torch.bfloat16, torch.bfloat16))
    assert fake_sgl.calls == ["decode", "extend"]


def test_sgl_not_used_where_it_would_be_wrong(fake_sgl):
    c = Case([40], [1], h=4, kvh=2, d=32, dtype=torch.bfloat16, window=16, window_list=False, seed=82)
    _close(c.decode(), c.ref(), _tol(torch.bfloat16, torch.bfloat16))  # the list holds keys outside the window
    e = Case([30], [10], h=4, kvh=2, d=32, dtype=torch.bfloat16, window=16, seed=83)
    _close(e.extend(), e.ref(), _tol(torch.bfloat16, torch.bfloat16))  # per-query window mask
    s = Case([9], [9], h=4, kvh=2, d=32, dtype=torch.bfloat16, seed=84)
    _close(s.extend(sinks=_sinks(4)), s.ref(0.0, _sinks(4)), _tol(torch.bfloat16, torch.bfloat16))  # sinks
    assert fake_sgl.calls == []


# ---- the dense path (hwkv_cpu.kernels_dense): planned once per forward, a fixed handful of ops per layer ----

def _dense(case, mode, window=None, logit_cap=0.0, sinks=None, out_dtype=None, max_elements=None):
    """case's decode / extend through plan_dense + dense_attention (None: the plan declined)."""
    from hwkv_cpu.kernels_dense import DENSE_MAX_ELEMENTS, dense_attention, plan_dense

    kvh, d, dv = case.k_buf.shape[1], case.k_buf.shape[2], case.v_buf.shape[2]
    lens = (case.kv_indptr[1:] - case.kv_indptr[:-1]).tolist()
    decode = mode == "decode"
    q_pos0 = torch.tensor([s - 1 for s in case.seq_lens] if decode else case.q_pos0, dtype=torch.int64)
    plan = plan_dense(case.kv_indptr, case.kv_indices, case.kv_pos0, q_pos0, None if decode else case.qo_indptr,
                      max(lens), max(case.extend_lens), window or 0, kvh, case.h // kvh, d, dv,
                      DENSE_MAX_ELEMENTS if max_elements is None else max_elements)
    if plan is None:
        return None
    q = case.q if not decode else case.q[(case.qo_indptr[1:] - 1).long()]
    out = torch.full((q.shape[0], case.h, case.dv), float("nan"), dtype=out_dtype or q.dtype)
    qk, cap, vs, _ = kernels._scalars(q, case.scaling, window, logit_cap, case.k_scale, case.v_scale)
    dense_attention(q, case.k_buf, case.v_buf, plan, out, qk, cap, vs, sinks)
    return out


@pytest.mark.parametrize("window", [None, 1, 3, 9])
@pytest.mark.parametrize("window_list", [True, False])
@pytest.mark.parametrize("mode", ["decode", "extend", "extend-uniform"])
def test_dense_matches_chunked_kernels(window, window_list, mode):
    """Mixed lengths (padding), prefixes and single-token rows, windows trimmed or masked, GQA; extend with
    queries padded per request, or with as many for every request (no padding)."""
    ext = {"decode": [1, 1, 1, 1], "extend": [1, 6, 1, 12], "extend-uniform": [4, 4, 4, 4]}[mode]
    case = Case([5, 17, 4, 30], ext, h=6, kvh=2, d=8, dv=12, window=window, window_list=window_list, seed=3)
    mode = mode.split("-")[0]
    got = _dense(case, mode, window)
    assert got is not None
    if mode == "decode":
        q = case.q[(case.qo_indptr[1:] - 1).long()]
        want = case.decode(q=q)
    else:
        want = case.extend()
    torch.testing.assert_close(got, want, atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_dense_sinks_softcap_scales_reduced_out(mode):
    ext = [3, 1, 4] if mode == "extend" else [1, 1, 1]
    for dtype in (torch.float32, torch.bfloat16, *FP8):
        case = Case([9, 4, 13], ext, h=4, kvh=1, d=16, dv=8, dtype=dtype, window=5,
                    k_scale=0.5 if dtype in FP8 else None, v_scale=2.0 if dtype in FP8 else None, seed=7)
        sinks = torch.randn(4)
        for cap, s, out_dtype in ((0.0, sinks, None), (20.0, None, torch.bfloat16), (7.0, sinks, torch.float32)):
            got = _dense(case, mode, 5, cap, s, out_dtype)
            if mode == "decode":
                want = case.decode(cap, s, out_dtype, q=case.q[(case.qo_indptr[1:] - 1).long()])
            else:
                want = case.extend(cap, s, out_dtype)
            # the chunked kernels compute bf16 pools' scores in bf16 where the CPU has AMX: _tol allows for it
            tol = max(_tol(dtype, got.dtype), 3e-5 if got.dtype == torch.float32 else 2e-2)
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_dense_declines_large_tables_and_queries_without_keys():
    case = Case([40, 40], [1, 1], seed=1)
    assert _dense(case, "decode", max_elements=100) is None, "above the size cap: the chunked kernels"
    # a list that ends before its query's window: no visible key, which must give zeros (chunked kernels)
    empty = Case([6], [1], window=2, window_list=False, seed=2)
    empty.kv_indptr = torch.tensor([0, 2], dtype=torch.int32)
    assert _dense(empty, "decode", 2) is None
