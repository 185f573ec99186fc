"""hwkv_cuda.kernels against hwkv.reference, on tiny random shapes.

Without a CUDA GPU the kernels run under TRITON_INTERPRET=1 on CPU tensors (set here before
triton is imported; conftest may set it too). On a GPU the same tests run compiled.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
import math  # noqa: E402

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from hwkv import reference  # noqa: E402
from hwkv.errors import ShapeError  # noqa: E402
from hwkv.window import first_visible  # noqa: E402
from hwkv_cuda.kernels import (decode_attention, extend_attention, fill_kv_indices,  # noqa: E402
                               make_decode_workspace, store_kv)

pytestmark = pytest.mark.interpret

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


class Case:
    """A batch whose K/V live at random, non-contiguous slots of a pool larger than needed."""

    def __init__(self, seq_lens, extend_lens, h=4, kvh=2, d=16, dv=None, dtype=torch.float32,
                 window=None, window_list=True, seed=0, page=1):
        g = torch.Generator().manual_seed(seed)
        dv = dv or d
        self.seq_lens, self.extend_lens, self.window = list(seq_lens), list(extend_lens), window
        self.h, self.d, self.dv, self.dtype = h, d, dv, dtype
        total = sum(seq_lens)
        size = 2 * total + 7
        self.k_buf = torch.randn(size, kvh, d, generator=g).to(dtype).to(DEV)
        self.v_buf = torch.randn(size, kvh, dv, generator=g).to(dtype).to(DEV)
        perm = torch.randperm(size - 1, generator=g)[:total] + 1   # slot 0 stays padding
        self.slots = list(torch.split(perm, list(seq_lens)))
        if page > 1:   # whole pages: request r's token j at page_r[j // page] * page + j % page
            pages = torch.randperm((size - 1) // page, generator=g) + 1
            size = (int(pages.max()) + 1) * page
            self.k_buf = torch.randn(size, kvh, d, generator=g).to(dtype).to(DEV)
            self.v_buf = torch.randn(size, kvh, dv, generator=g).to(dtype).to(DEV)
            at = 0
            self.slots = []
            for n in seq_lens:
                own = pages[at:at + -(-n // page)]
                at += len(own)
                self.slots.append((own[:, None] * page + torch.arange(page)).reshape(-1)[:n])
        self.keys = [self.k_buf.float().cpu()[s] for s in self.slots]
        self.values = [self.v_buf.float().cpu()[s] for s in self.slots]
        self.q_pos0 = [s - e for s, e in zip(seq_lens, extend_lens)]
        pos0 = [first_visible(p, window) if window_list else 0 for p in self.q_pos0]
        lists = [s[p:] for s, p in zip(self.slots, pos0)]
        self.kv_indptr = _indptr([len(x) for x in lists])
        self.kv_indices = torch.cat(lists + [torch.zeros(5, dtype=torch.int64)]).to(DEV)
        self.kv_pos0 = torch.tensor(pos0, dtype=torch.int64, device=DEV)
        self.qo_indptr = _indptr(extend_lens)
        self.q = torch.randn(sum(extend_lens), h, d, generator=g).to(dtype).to(DEV)
        self.scaling = 1.0 / math.sqrt(d)

    def ref(self, logit_cap=0.0, sinks=None, q=None):
        q = self.q if q is None else q
        return reference.batch_attention(q.float().cpu(), self.keys, self.values, self.seq_lens,
                                         self.extend_lens, self.scaling, self.window, logit_cap,
                                         None if sinks is None else sinks.cpu())

    def extend(self, logit_cap=0.0, sinks=None, out_dtype=None, config=None):
        out = torch.full((self.q.shape[0], self.h, self.dv), float("nan"),
                         dtype=out_dtype or self.dtype, device=DEV)
        extend_attention(self.q, self.k_buf, self.v_buf, self.kv_indptr, self.kv_indices,
                         self.kv_pos0, self.qo_indptr,
                         torch.tensor(self.q_pos0, dtype=torch.int64, device=DEV), out,
                         max(self.extend_lens), self.scaling, self.window, logit_cap, sinks, None, None,
                         config=config)
        return out

    def decode(self, logit_cap=0.0, sinks=None, splits=None, max_kv_len=None, config=None):
        """Decode of each request's last query (requires extend_lens == 1 everywhere)."""
        bs = len(self.seq_lens)
        out = torch.full((bs, self.h, self.dv), float("nan"), dtype=self.dtype, device=DEV)
        ws = make_decode_workspace(bs + 1, self.h, self.dv, splits, DEV) if splits else None
        q_pos = torch.tensor([s - 1 for s in self.seq_lens], dtype=torch.int64, device=DEV)
        decode_attention(self.q, self.k_buf, self.v_buf, self.kv_indptr, self.kv_indices,
                         self.kv_pos0, q_pos, out, self.scaling, self.window, logit_cap, sinks,
                         None, None, max_kv_len, workspace=ws, config=config)
        return out


def _indptr(lens):
    return torch.tensor([0] + list(lens), dtype=torch.int32).cumsum(0).to(torch.int32).to(DEV)


def _close(out, ref, dtype):
    assert not torch.isnan(out).any(), "output holds NaN (unwritten or 0/0)"
    err = (out.float().cpu() - ref).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, ref.abs().max().item()), f"max abs error {err}"


def _sinks(h, seed=1):
    return (torch.randn(h, generator=torch.Generator().manual_seed(seed)) * 2).float().to(DEV)


# --------------------------------------------------------------------------- decode
@pytest.mark.parametrize("window", [None, 3, 17, 40])
@pytest.mark.parametrize("splits", [None, 3])
def test_decode_matches_reference(window, splits):
    c = Case([1, 17, 33], [1, 1, 1], window=window, seed=window or 0)
    _close(c.decode(splits=splits), c.ref(), torch.float32)


def test_decode_public_calls_reuse_their_plan_and_still_check_what_differs():
    """A public call like an earlier one reuses its checked plan (and split-K scratch): outputs equal a fresh plan's
    with other queries, other windows and a second split-needing list of the same shape; a call whose shapes differ
    still gets the typed error and leaves `out` as it was."""
    from hwkv_cuda.kernels import decode as D
    D._PUBLIC_PLANS.clear()
    c = Case([300], [1], seed=5)
    first = c.decode(max_kv_len=300)
    assert len(D._PUBLIC_PLANS) == 1
    plan = next(iter(D._PUBLIC_PLANS.values()))
    assert plan.splits > 1, "the case must exercise the reused scratch"
    _close(first, c.ref(), torch.float32)
    for seed in (6, 7):  # other queries through the same plan (the scratch of the call before is reused)
        c.q = torch.randn(c.q.shape, generator=torch.Generator().manual_seed(seed)).to(DEV)
        _close(c.decode(max_kv_len=300), c.ref(), torch.float32)
        # the public plan sizes its grid from max_kv_len's power of two: the same plan through a config
        assert torch.equal(c.decode(max_kv_len=300), c.decode(max_kv_len=512, config=D.decode_config(
            1, 2, 16, 512, DEV)))
    assert len(D._PUBLIC_PLANS) == 1 and next(iter(D._PUBLIC_PLANS.values())) is plan
    c.window = 9  # a window is an argument of the launch, not of the plan: same plan, the window's output
    _close(c.decode(max_kv_len=300), c.ref(), torch.float32)
    assert len(D._PUBLIC_PLANS) == 1
    out = torch.full((1, c.h, c.dv), 7.0, device=DEV)
    q_pos = torch.tensor([299], dtype=torch.int64, device=DEV)
    with pytest.raises(ShapeError, match="sinks"):
        decode_attention(c.q, c.k_buf, c.v_buf, c.kv_indptr, c.kv_indices, c.kv_pos0, q_pos, out, c.scaling,
                         sinks=torch.zeros(c.h + 1, device=DEV), max_kv_len=300)
    with pytest.raises(ShapeError, match="kv_pos0"):
        decode_attention(c.q, c.k_buf, c.v_buf, c.kv_indptr, c.kv_indices, c.kv_pos0[:0], q_pos, out, c.scaling,
                         max_kv_len=300)
    assert bool((out == 7.0).all()), "a refused call wrote its output"


def test_decode_public_plans_follow_the_thread_the_list_bound_and_a_strided_index_list():
    """Plans of public calls are per thread (two threads on one stream would otherwise share the scratch between a
    call's split and merge launches), per power of two of max_kv_len (a growing bound keeps a few plans), and a
    kv_indices view with a strided last dim is never cached: a later, longer strided view still gets the error."""
    import threading
    from hwkv_cuda.kernels import decode as D
    D._PUBLIC_PLANS.clear()
    c = Case([300], [1], seed=8)
    want = c.decode(max_kv_len=300)
    for n in (257, 300, 512):  # one power of two: one plan, the same output
        assert torch.equal(c.decode(max_kv_len=n), want)
    assert len(D._PUBLIC_PLANS) == 1
    _close(c.decode(max_kv_len=513), c.ref(), torch.float32)
    assert len(D._PUBLIC_PLANS) == 2
    got = []
    t = threading.Thread(target=lambda: got.append(c.decode(max_kv_len=300)))
    t.start()
    t.join()
    assert torch.equal(got[0], want) and len(D._PUBLIC_PLANS) == 3, "another thread gets a plan (and scratch) of its own"
    workspaces = {id(p.ws_acc) for p in D._PUBLIC_PLANS.values() if p.splits > 1}
    assert len(workspaces) == sum(p.splits > 1 for p in D._PUBLIC_PLANS.values())
    base = torch.arange(1, 129, dtype=torch.int64, device=DEV)
    k_buf = torch.randn(140, 2, 16, device=DEV)
    out = torch.zeros(1, 4, 16, device=DEV)

    def call(idx):
        n = idx.shape[0]
        decode_attention(torch.randn(1, 4, 16, device=DEV), k_buf, k_buf, torch.tensor([0, n], dtype=torch.int32,
                         device=DEV), idx, torch.zeros(1, dtype=torch.int64, device=DEV),
                         torch.full((1,), n - 1, dtype=torch.int64, device=DEV), out, 0.25)
    call(base[:2][::2])  # one entry, stride 2: allowed, not cached
    with pytest.raises(ShapeError, match="kv_indices must have a contiguous last dimension"):
        call(base[::2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_sinks_softcap_gqa(dtype):
    c = Case([9, 38], [1, 1], h=8, kvh=2, d=32, dtype=dtype, window=8, window_list=False, seed=2)
    sinks = _sinks(8)
    _close(c.decode(logit_cap=1.5, sinks=sinks, splits=2), c.ref(1.5, sinks), dtype)
    _close(c.decode(logit_cap=1.5, sinks=sinks), c.ref(1.5, sinks), dtype)


def test_decode_dv_not_d_and_odd_head_dim():
    c = Case([5, 26], [1, 1], h=4, kvh=1, d=24, dv=40, window=None, seed=3)
    _close(c.decode(splits=4), c.ref(), torch.float32)
    _close(c.decode(max_kv_len=26), c.ref(), torch.float32)


@pytest.mark.parametrize("hpp", [2, 4])
@pytest.mark.parametrize("h,kvh,d,dv", [(8, 4, 16, 16), (8, 2, 24, 40), (4, 4, 16, 32)])
def test_decode_several_kv_heads_per_program(hpp, h, kvh, d, dv):
    """A program reading several kv heads (block-diagonal query tile) gives each head its own keys:
    sinks, soft-cap, a window, Dv != D and an odd head dim, split and unsplit."""
    from hwkv_cuda.kernels import DecodeConfig
    from hwkv_cuda.kernels.decode import INTERPRET_CONFIG
    cfg = DecodeConfig(**{**INTERPRET_CONFIG.__dict__, "heads_per_program": hpp})
    assert cfg.kv_heads_per_program(kvh, max(d, dv)) > 1
    c = Case([9, 40, 23], [1, 1, 1], h=h, kvh=kvh, d=d, dv=dv, window=11, seed=hpp + kvh)
    sinks = _sinks(h)
    ref = c.ref(2.0, sinks)
    _close(c.decode(logit_cap=2.0, sinks=sinks, splits=3, config=cfg), ref, torch.float32)
    _close(c.decode(logit_cap=2.0, sinks=sinks, config=cfg), ref, torch.float32)


@pytest.mark.parametrize("batched", [False, True])
def test_decode_slots_ahead_equals_slots_in_their_own_iteration(batched):
    """Slots loaded a tile ahead (DecodeConfig.slots_ahead) give the output of slots loaded in their own iteration,
    bit for bit, and the reference's: lists shorter than a tile, splits left empty, a window, sinks and soft-cap."""
    import dataclasses
    from hwkv_cuda.kernels import DecodeConfig
    from hwkv_cuda.kernels.decode import INTERPRET_CONFIG
    cfg = DecodeConfig(**{**INTERPRET_CONFIG.__dict__, "heads_per_program": 2, "batched_heads": batched})
    ahead = dataclasses.replace(cfg, slots_ahead=True)
    c = Case([1, 9, 40, 57], [1, 1, 1, 1], h=8, kvh=4, d=16, window=23, seed=7)
    sinks = _sinks(8)
    ref = c.ref(2.0, sinks)
    for splits in (None, 3, 4):
        plain = c.decode(logit_cap=2.0, sinks=sinks, splits=splits, config=cfg)
        early = c.decode(logit_cap=2.0, sinks=sinks, splits=splits, config=ahead)
        assert torch.equal(plain, early), splits
        _close(early, ref, torch.float32)


@pytest.mark.parametrize("batched", [False, True])
def test_decode_evict_first_hint_leaves_the_output_unchanged(batched):
    """The K/V gathers' L2 hint (DecodeConfig.evict_first) changes no value: bit for bit, with splits and a window."""
    import dataclasses
    from hwkv_cuda.kernels import DecodeConfig
    from hwkv_cuda.kernels.decode import INTERPRET_CONFIG
    cfg = DecodeConfig(**{**INTERPRET_CONFIG.__dict__, "heads_per_program": 2, "batched_heads": batched})
    c = Case([1, 9, 40], [1, 1, 1], h=8, kvh=4, d=16, window=23, seed=11)
    for splits in (None, 3):
        plain = c.decode(logit_cap=2.0, splits=splits, config=cfg)
        hinted = c.decode(logit_cap=2.0, splits=splits, config=dataclasses.replace(cfg, evict_first=True))
        assert torch.equal(plain, hinted), splits
        _close(hinted, c.ref(2.0, None), torch.float32)


def test_decode_heads_per_program_divides_kv_heads_and_fits_the_row():
    from hwkv_cuda.kernels import DecodeConfig
    cfg = DecodeConfig(heads_per_program=8)
    assert cfg.kv_heads_per_program(8, 64) == 2     # 2 x 64 columns: the widest row
    assert cfg.kv_heads_per_program(6, 32) == 2     # the largest power of two dividing 6
    assert cfg.kv_heads_per_program(8, 16) == 8
    assert cfg.kv_heads_per_program(8, 128) == 1
    assert cfg.kv_heads_per_program(1, 16) == 1
    assert DecodeConfig().kv_heads_per_program(8, 16) == 1
    # batched heads: no row bound, but the key tile (heads x columns x keys) no larger than the 2 x 64 x 128 one
    rows = DecodeConfig(heads_per_program=8, batched_heads=True, block_n=32, mid_block_n=32)
    assert rows.kv_heads_per_program(8, 64) == 8
    assert rows.kv_heads_per_program(8, 128) == 4
    assert DecodeConfig(heads_per_program=8, batched_heads=True).kv_heads_per_program(8, 64) == 2    # 128-key tiles
    assert DecodeConfig(heads_per_program=8, batched_heads=True, block_n=32).kv_heads_per_program(8, 64) == 4


def test_decode_config_by_batch_and_list_length(monkeypatch):
    """The recorded decode configs: wide batches and long lists take two kv heads per program (four over long lists
    at wide batches), batches of one 8-head program an SM whole key rows."""
    from hwkv_cuda.kernels import decode as dec
    monkeypatch.setattr(dec, "interpreting", lambda: False)
    monkeypatch.setattr(dec, "num_sms", lambda device: 132)
    cpu = torch.device("cpu")
    assert dec.decode_config(256, 8, 64, 4096, cpu) == dec.GPU_CONFIG     # not a Hopper-class GPU: portable
    monkeypatch.setattr(dec, "hopper_class", lambda device: True)
    assert dec.decode_config(64, 8, 64, 4096, cpu) == dec.WIDE_CONFIG
    assert dec.decode_config(64, 8, 64, 32768, cpu) == dec.WIDE_LONG_CONFIG
    assert dec.decode_config(64, 8, 64, None, cpu) == dec.WIDE_LONG_CONFIG
    assert dec.decode_config(64, 8, 64, 128, cpu) == dec.LONG_CONFIG      # window lists, wide batch
    for ctx in (128, 4096, 32768, None):                                  # a program of 8 heads an SM: whole rows
        assert dec.decode_config(256, 8, 64, ctx, cpu) == dec.ROWS_CONFIG
    assert dec.decode_config(132, 8, 64, 4096, cpu) == dec.ROWS_CONFIG
    assert dec.decode_config(131, 8, 64, 4096, cpu) == dec.WIDE_CONFIG
    assert dec.decode_config(264, 4, 64, 4096, cpu) == dec.ROWS_CONFIG    # 4 heads a program: every row
    assert dec.decode_config(256, 2, 64, 4096, cpu) == dec.WIDE_CONFIG    # 2 heads: the block-diagonal tile
    assert dec.decode_config(256, 2, 64, 32768, cpu) == dec.WIDE_CONFIG   # ... over long lists too
    assert dec.ROWS_CONFIG.kv_heads_per_program(8, 64) == 8 and dec.WIDE_LONG_CONFIG.kv_heads_per_program(8, 64) == 4
    assert dec.decode_config(1, 8, 64, 128, cpu) == dec.GPU_CONFIG        # window lists, batch 1
    assert dec.decode_config(16, 8, 64, 32768, cpu) == dec.LONG_FEW_CONFIG  # small batches, long lists: splits down
    assert dec.decode_config(16, 8, 64, None, cpu) == dec.LONG_FEW_CONFIG
    assert dec.decode_num_splits(16, 8, 32768, cpu, head_dim=64) == 4      # 256 programs, not 5 x 64
    assert dec.decode_num_splits(1, 8, 32768, cpu, head_dim=64) == 64      # capped as before
    for b in (3, 4, 16, 32):                                              # middle batches: one even wave
        assert dec.decode_config(b, 8, 64, 4096, cpu) == dec.MID_CONFIG
    assert dec.decode_num_splits(16, 8, 4096, cpu, head_dim=64) == 2       # 2 x 128 programs
    assert dec.decode_num_splits(32, 8, 4096, cpu, head_dim=64) == 1       # 256 programs, one split
    assert dec.decode_config(2, 8, 64, 4096, cpu) == dec.GPU_CONFIG        # under an eighth of a program an SM
    assert dec.decode_config(1, 8, 64, 4096, cpu) == dec.GPU_CONFIG
    assert dec.decode_num_splits(1, 8, 4096, cpu, head_dim=64) == 32
    assert dec.decode_config(256, 8, 128, 4096, cpu) == dec.GPU_CONFIG    # a 2-head row is too wide
    assert dec.decode_config(256, 1, 64, 4096, cpu) == dec.GPU_CONFIG     # one kv head
    assert dec.decode_num_splits(64, 8, 4096, cpu, head_dim=64) == 1      # one program per SM already
    assert dec.decode_num_splits(64, 8, 4096, cpu) == 2                   # no head dim: one kv head per program
    down = dataclasses.replace(dec.GPU_CONFIG, ctas_per_sm=2, fill_down=True)   # splits rounded down: one even wave
    assert dec.decode_num_splits(16, 8, 4096, cpu, down, head_dim=64) == 2     # 256 programs, not 3 x 128
    assert dec.decode_num_splits(16, 8, 4096, cpu, dataclasses.replace(down, fill_down=False), head_dim=64) == 3
    assert dec.decode_num_splits(300, 8, 4096, cpu, down, head_dim=64) == 1    # never below one split
    monkeypatch.setattr(dec, "interpreting", lambda: True)
    assert dec.decode_config(256, 8, 64, 4096, cpu) == dec.INTERPRET_CONFIG


def test_decode_window_edge_sees_exactly_keys_3_4_5():
    """W = 3, query at position 5: keys 3, 4, 5 and no other, whatever the list holds."""
    c = Case([6], [1], h=2, kvh=1, d=16, window=3, window_list=False, seed=4)
    big = 1000.0
    v = torch.zeros_like(c.v_buf)
    for pos in range(6):            # value of key at position p is p in every channel
        v[c.slots[0][pos]] = float(pos)
    c.v_buf = v
    c.q = torch.zeros_like(c.q)     # uniform attention over the visible keys
    out = c.decode(splits=2)
    assert torch.allclose(out.float().cpu(), torch.full_like(out.float().cpu(), 4.0), atol=1e-5)
    # sanity: a huge logit on key 2 (outside the window) must not leak in
    c.q[0, :, 0] = big
    c.k_buf[c.slots[0][2], :, 0] = 1.0
    c.k_buf[c.slots[0][3:6], :, 0] = 0.0
    out = c.decode()
    assert torch.allclose(out.float().cpu(), torch.full_like(out.float().cpu(), 4.0), atol=1e-5)


def test_decode_no_visible_keys_outputs_zeros():
    c = Case([4, 7], [1, 1], window=None, seed=5)
    c.kv_indptr = _indptr([0, 7])   # request 0 lists no key at all
    c.kv_pos0 = torch.tensor([0, 0], dtype=torch.int64, device=DEV)
    c.kv_indices = torch.cat([c.slots[1], torch.zeros(3, dtype=torch.int64)]).to(DEV)
    for sinks in (None, _sinks(4)):
        for splits in (None, 3):
            out = c.decode(sinks=sinks, splits=splits)
            assert torch.equal(out[0].cpu(), torch.zeros_like(out[0].cpu()))
            c2 = c.ref(sinks=sinks)
            _close(out[1:], c2[1:], torch.float32)


# --------------------------------------------------------------------------- extend
@pytest.mark.parametrize("window", [None, 5, 24])
@pytest.mark.parametrize("prefix", [False, True])
def test_extend_matches_reference(window, prefix):
    seq = [20, 3, 37]
    ext = [8, 3, 21] if prefix else seq
    c = Case(seq, ext, window=window, seed=10 + (window or 0))
    _close(c.extend(), c.ref(), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_sinks_softcap_gqa_dv(dtype):
    c = Case([30, 12], [18, 12], h=8, kvh=2, d=32, dv=16, dtype=dtype, window=7, seed=11)
    sinks = _sinks(8)
    _close(c.extend(logit_cap=2.0, sinks=sinks), c.ref(2.0, sinks), dtype)


def test_extend_full_list_with_window_mask():
    """A full list (pos0 = 0) read by an SWA layer: the kernel's mask alone trims the window."""
    c = Case([35, 9], [20, 9], window=4, window_list=False, seed=12)
    _close(c.extend(sinks=_sinks(4)), c.ref(sinks=_sinks(4)), torch.float32)


@pytest.mark.parametrize("window", [None, 6])
def test_decode_and_extend_agree_on_last_token(window):
    seq = [14, 29]
    c = Case(seq, [4, 29], h=4, kvh=2, d=16, window=window, seed=13)
    sinks = _sinks(4)
    ext = c.extend(logit_cap=3.0, sinks=sinks)
    last = c.qo_indptr[1:].long().cpu() - 1
    d = Case(seq, [1, 1], h=4, kvh=2, d=16, window=window, seed=13)
    d.q = c.q[last.to(DEV)]
    dec = d.decode(logit_cap=3.0, sinks=sinks, splits=2)
    assert torch.allclose(dec.float(), ext[last.to(DEV)].float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 9])
def test_extend_mixed_batch_decode_rows_beside_prefill(window):
    """ForwardMode.MIXED: one-token rows next to a long chunk share the launch (and its tile size)."""
    c = Case([50, 7, 33, 1, 64], [40, 1, 1, 1, 64], h=4, kvh=2, window=window, seed=30)
    sinks = _sinks(4)
    _close(c.extend(sinks=sinks), c.ref(sinks=sinks), torch.float32)


@pytest.mark.parametrize("h,kvh", [(6, 2), (32, 1), (4, 4)])
def test_extend_group_sizes(h, kvh):
    """Packed GQA rows: a group that is not a power of two (padded rows), a group wider than the
    tile (one token per program), and no grouping."""
    c = Case([45, 19], [30, 19], h=h, kvh=kvh, window=11, seed=31)
    _close(c.extend(logit_cap=4.0), c.ref(4.0), torch.float32)


@pytest.mark.parametrize("page", [1, 16])
def test_extend_long_runs_take_unmasked_tiles(page):
    """Runs long enough for window-edge, unmasked and diagonal tiles in one program, with the
    window edge falling inside a tile, over page-structured and scattered slots."""
    for window in (None, 21, 40):
        c = Case([130, 97], [90, 97], window=window, seed=32 + (window or 0), page=page)
        _close(c.extend(), c.ref(), torch.float32)


@pytest.mark.parametrize("window", [None, 21, 40])
@pytest.mark.parametrize("one_loop,mask32", [(True, True), (False, False), (True, False)])
def test_extend_loop_and_mask_variants_match(window, one_loop, mask32):
    """one_loop (every tile masked, one loop) and the int64-position mask see exactly what the
    three-loop walk with int32 tile offsets sees."""
    from hwkv_cuda.kernels import ExtendConfig
    c = Case([130, 97, 5], [90, 97, 1], h=8, kvh=2, window=window, seed=33 + (window or 0), page=16)
    sinks = _sinks(8)
    out = c.extend(sinks=sinks, config=ExtendConfig(block_m=16, block_n=16, num_warps=1, num_stages=1,
                                                     one_loop=one_loop, mask32=mask32))
    _close(out, c.ref(sinks=sinks), torch.float32)
    assert torch.allclose(out, c.extend(sinks=sinks), atol=1e-5, rtol=1e-5)


def test_extend_window_edge_hand_computed():
    """W=3, one request, queries at positions 4..6 over keys 0..6 whose values are their positions:
    query p averages keys p-2..p exactly (q = 0 gives equal weights)."""
    n = 7
    k_buf = torch.zeros(n + 1, 1, 16, device=DEV)
    v_buf = torch.zeros(n + 1, 1, 16, device=DEV)
    v_buf[1:, 0, :] = torch.arange(n, dtype=torch.float32, device=DEV)[:, None]
    q = torch.zeros(3, 2, 16, device=DEV)
    out = torch.full((3, 2, 16), float("nan"), device=DEV)
    i32 = dict(dtype=torch.int32, device=DEV)
    i64 = dict(dtype=torch.int64, device=DEV)
    extend_attention(q, k_buf, v_buf, torch.tensor([0, n], **i32), torch.arange(1, n + 1, **i64),
                     torch.tensor([0], **i64), torch.tensor([0, 3], **i32), torch.tensor([4], **i64), out, 3,
                     0.25, 3)
    want = torch.tensor([3.0, 4.0, 5.0], device=DEV)   # mean of (2,3,4), (3,4,5), (4,5,6)
    assert torch.allclose(out[:, :, 0], want[:, None].expand(3, 2), atol=1e-6)


def test_extend_reads_fp8_with_scales():
    if not FP8:
        pytest.skip("this torch has no float8 dtypes")
    c = Case([40, 21], [25, 21], window=13, seed=33)
    kb = (c.k_buf.float() / 0.25).to(FP8[0])
    vb = (c.v_buf.float() / 0.5).to(FP8[0])
    c.keys = [kb.float().cpu()[s] * 0.25 for s in c.slots]
    c.values = [vb.float().cpu()[s] * 0.5 for s in c.slots]
    out = torch.empty(c.q.shape[0], c.h, c.dv, device=DEV)
    extend_attention(c.q, kb, vb, c.kv_indptr, c.kv_indices, c.kv_pos0, c.qo_indptr,
                     torch.tensor(c.q_pos0, dtype=torch.int64, device=DEV), out, 25, c.scaling, c.window,
                     0.0, None, 0.25, 0.5)
    _close(out, c.ref(), torch.float32)


# --------------------------------------------------------------------------- store
FP8 = [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d]


def _ulp_close(out, ref, dtype):
    """Exact on a GPU; the interpreter may round fp32 -> bf16/fp8 by truncation (1 ulp off)."""
    if not INTERPRET or dtype == torch.float32:
        assert torch.equal(out.float(), ref.float())
        return
    rel = torch.finfo(dtype).eps
    assert torch.allclose(out.float(), ref.float(), rtol=2 * rel, atol=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] + FP8)
def test_store_kv_writes_rows_and_leaves_inputs(dtype):
    g = torch.Generator().manual_seed(20)
    size, kvh, d, dv, n = 40, 2, 16, 24, 11
    k_buf = torch.zeros(size, kvh, d, dtype=dtype, device=DEV)
    v_buf = torch.zeros(size, kvh, dv, dtype=dtype, device=DEV)
    loc = (torch.randperm(size - 1, generator=g)[:n] + 1).to(DEV)
    base = torch.randn(n, kvh + 1, d + dv, generator=g).to(DEV) * 50   # strided, non-contiguous views
    k, v = base[:, :kvh, :d], base[:, 1:, d:]
    k_scale, v_scale = (None, None) if dtype in (torch.float32, torch.bfloat16) else (0.5, 2.0)
    k0, v0 = k.clone(), v.clone()
    store_kv(k_buf, v_buf, loc, k, v, k_scale, v_scale)
    assert torch.equal(k, k0) and torch.equal(v, v0), "store_kv modified its inputs"
    if INTERPRET and dtype in FP8:
        pytest.skip("Triton's interpreter rounds fp32 -> fp8 without carrying into the exponent "
                    "(124.3 -> 64 in e4m3); fp8 stores are checked on a GPU")
    fmax = torch.finfo(dtype).max
    kq = (k.float() / (k_scale or 1.0)).clamp(-fmax, fmax).to(dtype)
    vq = (v.float() / (v_scale or 1.0)).clamp(-fmax, fmax).to(dtype)
    _ulp_close(k_buf[loc].cpu(), kq.cpu(), dtype)
    _ulp_close(v_buf[loc].cpu(), vq.cpu(), dtype)
    untouched = torch.ones(size, dtype=torch.bool)
    untouched[loc.cpu()] = False
    assert not k_buf.cpu()[untouched].float().any() and not v_buf.cpu()[untouched].float().any()
    if dtype in FP8:   # round trip: dequantized values within the format's quantization error
        rt = k_buf[loc].float() * k_scale
        rel = 2.0 ** -(3 if dtype == torch.float8_e4m3fn else 2)
        assert torch.allclose(rt.cpu(), k.float().cpu().clamp(-fmax * k_scale, fmax * k_scale),
                              rtol=rel, atol=2.0 ** -6 * k_scale)


def test_store_kv_empty_and_fp8_clamp():
    k_buf = torch.zeros(4, 1, 16, dtype=torch.float32, device=DEV)
    e = torch.empty(0, 1, 16, device=DEV)
    store_kv(k_buf, k_buf.clone(), torch.empty(0, dtype=torch.int64, device=DEV), e, e)
    if not FP8:
        pytest.skip("this torch has no float8 dtypes")
    f8 = FP8[0]
    kb = torch.zeros(4, 1, 16, dtype=f8, device=DEV)
    x = torch.full((1, 1, 16), 1e6, device=DEV)
    store_kv(kb, kb.clone(), torch.tensor([2], device=DEV), x, -x)
    assert torch.equal(kb[2].float().cpu(), torch.full((1, 16), torch.finfo(f8).max))


def test_decode_reads_fp8_with_scales():
    if not FP8:
        pytest.skip("this torch has no float8 dtypes")
    c = Case([13, 21], [1, 1], window=None, seed=21)
    kb = (c.k_buf.float() / 0.25).to(FP8[0])
    vb = (c.v_buf.float() / 0.5).to(FP8[0])
    c.keys = [kb.float().cpu()[s] * 0.25 for s in c.slots]
    c.values = [vb.float().cpu()[s] * 0.5 for s in c.slots]
    out = torch.empty(2, c.h, c.dv, device=DEV)
    q_pos = torch.tensor([12, 20], dtype=torch.int64, device=DEV)
    decode_attention(c.q, kb, vb, c.kv_indptr, c.kv_indices, c.kv_pos0, q_pos, out, c.scaling,
                     None, 0.0, None, 0.25, 0.5)
    _close(out, c.ref(), torch.float32)


# --------------------------------------------------------------------------- index
def test_fill_kv_indices():
    g = torch.Generator().manual_seed(30)
    req_to_token = torch.randint(1, 1000, (5, 50), generator=g).to(DEV)
    rows = torch.tensor([3, 0, 4], device=DEV)
    pos0 = torch.tensor([0, 7, 20], dtype=torch.int64, device=DEV)
    lens = [33, 0, 30]
    indptr = _indptr(lens)
    out = torch.full((70,), -1, dtype=torch.int64, device=DEV)
    fill_kv_indices(req_to_token, rows, pos0, indptr, out)
    want = torch.cat([req_to_token[3, 0:33], req_to_token[4, 20:50]])
    assert torch.equal(out[:63], want)
    assert (out[63:] == -1).all()


def test_extend_config_follows_head_dim_dtype_and_window(monkeypatch):
    """The recorded launch configs: window lists take the small tiles, fp32 halves the tiles, and the
    interpreter always gets its tiny one."""
    from hwkv_cuda.kernels import extend as ext
    monkeypatch.setattr(ext, "interpreting", lambda: False)
    assert ext.default_config(64) == ext.TUNED[(64, False)]
    assert ext.default_config(64, window=128) == ext.WINDOWED[64]
    assert ext.default_config(64, window=4096) == ext.TUNED[(64, False)]      # long windows: causal tiles
    assert ext.default_config(128, window=128) == ext.WINDOWED[128]
    assert ext.default_config(256, window=128).block_m == 64                  # not the causal 128-row tiles
    assert ext.default_config(256) == ext.PORTABLE[256]                       # no Hopper-class device named
    monkeypatch.setattr(ext, "hopper_class", lambda device: True)
    assert ext.default_config(256, device=torch.device("cuda")) == ext.TUNED[(256, False)]
    half = ext.default_config(64, fp32=True)
    assert (half.block_m, half.block_n) == (64, 64) and half.num_stages <= 2
