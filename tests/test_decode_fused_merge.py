"""The decode kernel's in-place merge (the last split of a request's kv-head program merges every split) against
the previous two-launch path (split kernel, then the merge kernel) and hwkv.reference, on the same random inputs:
sinks, soft-cap, windows, GQA, several kv heads per program, fp8 K/V with scales, Dv != D, empty lists. Small
sizes under TRITON_INTERPRET=1 (compiled on a GPU)."""
import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from hwkv_cuda.kernels import decode as dec  # noqa: E402
from hwkv_cuda.kernels import make_decode_workspace  # noqa: E402
from hwkv.errors import ShapeError  # noqa: E402

from test_triton_kernels import DEV, TOL, Case, _close, _sinks  # noqa: E402

pytestmark = pytest.mark.interpret

BASE = dec.INTERPRET_CONFIG if dec.interpreting() else dec.GPU_CONFIG
FUSED = dataclasses.replace(BASE, fused_merge_bytes=1 << 40)
SEPARATE = dataclasses.replace(BASE, fused_merge_bytes=0)
FP8 = [d for d in (getattr(torch, "float8_e4m3fn", None),) if d]


def run(c, cfg, splits, logit_cap=0.0, sinks=None, k_buf=None, v_buf=None, k_scale=None, v_scale=None, ws=None):
    """(out, plan) of one planned decode of case c's last queries; the workspace is fresh unless given."""
    bs = len(c.seq_lens)
    k_buf = c.k_buf if k_buf is None else k_buf
    v_buf = c.v_buf if v_buf is None else v_buf
    out = torch.full((bs, c.h, c.dv), float("nan"), dtype=c.dtype, device=DEV)
    ws = make_decode_workspace(bs, c.h, c.dv, splits, DEV) if ws is None else ws
    q_pos = torch.tensor([s - 1 for s in c.seq_lens], dtype=torch.int64, device=DEV)
    args = (c.q, k_buf, v_buf, c.kv_indptr, c.kv_indices, c.kv_pos0, q_pos, out)
    plan = dec.plan_decode(*args, sinks, max(c.seq_lens), workspace=ws, config=cfg)
    dec.decode_attention_planned(plan, *args, c.scaling, c.window, logit_cap, sinks, k_scale, v_scale)
    return out, plan


def both(c, splits, cfg_fused=FUSED, cfg_separate=SEPARATE, **kw):
    """The in-place merge and the merge kernel on the same inputs: they agree to rounding, and the plans are
    what they say (one fused, one not); the counters are back at zero."""
    fused, pf = run(c, cfg_fused, splits, **kw)
    separate, ps = run(c, cfg_separate, splits, **kw)
    assert pf.fused and not ps.fused and pf.splits == ps.splits == splits
    assert not pf.workspace.counts.any(), "the merging programs put their counters back to zero"
    assert not torch.isnan(fused).any() and not torch.isnan(separate).any()
    tol = 1e-5 if c.dtype == torch.float32 else 1e-2
    assert torch.allclose(fused.float(), separate.float(), atol=tol, rtol=tol)
    return fused


@pytest.mark.parametrize("window", [None, 5, 19])
@pytest.mark.parametrize("splits", [2, 3, 4])
def test_fused_merge_matches_merge_kernel_and_reference(window, splits):
    c = Case([1, 17, 33, 40], [1, 1, 1, 1], window=window, seed=splits * 7 + (window or 0))
    _close(both(c, splits), c.ref(), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_merge_sinks_softcap_gqa(dtype):
    c = Case([9, 38, 27], [1, 1, 1], h=8, kvh=2, d=32, dtype=dtype, window=8, window_list=False, seed=2)
    sinks = _sinks(8)
    _close(both(c, 3, logit_cap=1.5, sinks=sinks), c.ref(1.5, sinks), dtype)


@pytest.mark.parametrize("hpp", [1, 2])
@pytest.mark.parametrize("h,kvh,d,dv", [(8, 4, 16, 16), (8, 2, 24, 40), (4, 4, 16, 32), (6, 2, 16, 16)])
def test_fused_merge_dv_not_d_and_several_kv_heads_per_program(hpp, h, kvh, d, dv):
    """Rows of several kv heads in one program (block-diagonal tiles), odd head dims, Dv != D, a group of 3."""
    cfgs = [dataclasses.replace(cfg, heads_per_program=hpp) for cfg in (FUSED, SEPARATE)]
    c = Case([9, 40, 23], [1, 1, 1], h=h, kvh=kvh, d=d, dv=dv, window=11, seed=hpp + kvh + d)
    sinks = _sinks(h)
    _close(both(c, 4, *cfgs, logit_cap=2.0, sinks=sinks), c.ref(2.0, sinks), torch.float32)


def test_fused_merge_reads_fp8_with_scales():
    if not FP8:
        pytest.skip("this torch has no float8 dtypes")
    c = Case([40, 21, 7], [1, 1, 1], h=4, kvh=2, window=13, seed=33)
    kb = (c.k_buf.float() / 0.25).to(FP8[0])
    vb = (c.v_buf.float() / 0.5).to(FP8[0])
    c.keys = [kb.float().cpu()[s] * 0.25 for s in c.slots]
    c.values = [vb.float().cpu()[s] * 0.5 for s in c.slots]
    sinks = _sinks(4)
    out = both(c, 3, sinks=sinks, k_buf=kb, v_buf=vb, k_scale=0.25, v_scale=0.5)
    _close(out, c.ref(sinks=sinks), torch.float32)


def test_fused_merge_of_empty_lists_and_empty_splits():
    """A request with no key (every split empty: zeros, or the sink alone: zeros) and one with fewer keys than
    splits (some splits empty) beside a long one."""
    c = Case([4, 2, 30], [1, 1, 1], seed=5)
    c.kv_indptr = torch.tensor([0, 0, 2, 32], dtype=torch.int32, device=DEV)
    c.kv_indices = torch.cat([c.slots[1], c.slots[2], torch.zeros(3, dtype=torch.int64)]).to(DEV)
    for sinks in (None, _sinks(4)):
        out = both(c, 4, sinks=sinks)
        assert torch.equal(out[0].cpu(), torch.zeros_like(out[0].cpu()))
        _close(out[1:], c.ref(sinks=sinks)[1:], torch.float32)


def test_one_workspace_reused_across_calls_and_geometries():
    """The counters reset themselves: one workspace serves many launches (layers, graph replays) and a layer
    with fewer kv heads, each result equal to a fresh workspace's."""
    a = Case([12, 35], [1, 1], h=8, kvh=4, d=16, window=None, seed=8)
    b = Case([12, 35], [1, 1], h=8, kvh=2, d=16, window=6, seed=9)
    ws = make_decode_workspace(4, 8, 16, 3, DEV)
    sinks = _sinks(8)
    want = [run(c, FUSED, 3, sinks=sinks)[0] for c in (a, b)]
    for _ in range(3):
        for c, w in zip((a, b), want):
            got, plan = run(c, FUSED, 3, sinks=sinks, ws=ws)
            assert plan.fused and torch.equal(got, w)
            assert not ws.counts.any()


def test_plan_picks_the_merge_kernel_past_the_byte_bound_or_without_counters():
    c = Case([20, 30], [1, 1], h=4, kvh=2, d=16, seed=11)
    rows_bytes = 3 * 2 * 16 * 4   # splits x q heads per kv-head program x Dv x fp32
    at = dataclasses.replace(BASE, fused_merge_bytes=rows_bytes)
    below = dataclasses.replace(BASE, fused_merge_bytes=rows_bytes - 1)
    out_at, plan_at = run(c, at, 3)
    out_below, plan_below = run(c, below, 3)
    assert plan_at.fused and not plan_below.fused
    ws = make_decode_workspace(2, 4, 16, 3, DEV)
    out_none, plan_none = run(c, FUSED, 3, ws=dec.DecodeWorkspace(ws.acc, ws.lse))
    assert not plan_none.fused and plan_none.workspace.counts is None
    for out in (out_at, out_below, out_none):
        _close(out, c.ref(), torch.float32)
    _, one = run(c, FUSED, 1)
    assert one.splits == 1 and not one.fused and one.workspace is None   # one split: one launch writes out


def test_fused_plan_launches_no_merge_kernel(monkeypatch):
    """Counted at the plans' launch (a planned launch on a GPU goes to the compiled launcher, not through the
    JIT's run, so counting run there sees only first launches)."""
    launched = []
    inner = dec.launch

    def counted(plans, key, kernel, *a, **k):
        launched.append(kernel.fn.__name__)
        return inner(plans, key, kernel, *a, **k)

    monkeypatch.setattr(dec, "launch", counted)
    c = Case([20, 30], [1, 1], h=4, kvh=2, d=16, seed=12)
    run(c, FUSED, 3)
    assert launched == ["_decode_split_kernel"]
    launched.clear()
    run(c, SEPARATE, 3)
    assert launched == ["_decode_split_kernel", "_decode_merge_kernel"]


def test_workspace_counters_are_checked():
    c = Case([20, 30], [1, 1], h=4, kvh=2, d=16, seed=13)
    ws = make_decode_workspace(2, 4, 16, 3, DEV)
    with pytest.raises(ShapeError, match="counts"):
        run(c, FUSED, 3, ws=dec.DecodeWorkspace(ws.acc, ws.lse, ws.counts[:1]))
    with pytest.raises(ShapeError, match="counts"):
        run(c, FUSED, 3, ws=dec.DecodeWorkspace(ws.acc, ws.lse, ws.counts.float()))


def test_in_place_merge_only_on_nvidia_and_the_interpreter(monkeypatch):
    assert dec._merges_in_place(torch.device("cpu"), True)
    assert not dec._merges_in_place(torch.device("xpu"), False)
    assert not dec._merges_in_place(torch.device("cpu"), False)
    monkeypatch.setattr(torch.version, "hip", None)
    assert dec._merges_in_place(torch.device("cuda"), False)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert not dec._merges_in_place(torch.device("cuda"), False)


def test_workspace_made_during_graph_capture_takes_the_merge_kernel(monkeypatch):
    """Counters zeroed inside one graph's capture would be garbage for the other graphs sharing the workspace."""
    monkeypatch.setattr(dec, "_capturing", lambda device: True)
    ws = make_decode_workspace(2, 4, 16, 3, DEV)
    assert ws.counts is None
    c = Case([20, 30], [1, 1], h=4, kvh=2, d=16, seed=14)
    out, plan = run(c, FUSED, 3, ws=ws)
    assert not plan.fused
    _close(out, c.ref(), torch.float32)
    monkeypatch.undo()
    assert not dec._capturing(torch.device("cpu"))
    assert make_decode_workspace(2, 4, 16, 3, DEV).counts is not None


def test_eager_plans_merge_in_place_past_the_graph_bound():
    """A plan without the caller's workspace (eager: the host's launch costs more than the merge's tail) merges in
    place up to eager_fused_merge_bytes; the same call with a workspace (a graph's) keeps the merge kernel."""
    c = Case([20, 30], [1, 1], h=4, kvh=2, d=16, seed=12)
    rows_bytes = 3 * 2 * 16 * 4
    cfg = dataclasses.replace(BASE, fused_merge_bytes=rows_bytes - 1, eager_fused_merge_bytes=rows_bytes, max_splits=3,
                              ctas_per_sm=64, min_keys_per_split=1)
    q_pos = torch.tensor([s - 1 for s in c.seq_lens], dtype=torch.int64, device=DEV)
    outs = []
    for ws in (None, make_decode_workspace(2, 4, 16, 3, DEV)):
        out = torch.full((2, 4, 16), float("nan"), device=DEV)
        args = (c.q, c.k_buf, c.v_buf, c.kv_indptr, c.kv_indices, c.kv_pos0, q_pos, out)
        plan = dec.plan_decode(*args, None, 30, workspace=ws, config=cfg)
        dec.decode_attention_planned(plan, *args, c.scaling)
        assert plan.splits == 3 and plan.fused == (ws is None)
        outs.append(out)
    never = dataclasses.replace(cfg, fused_merge_bytes=0)
    assert not dec.plan_decode(*args, None, 30, config=never).fused, "0 still means never"
    for out in outs:
        _close(out, c.ref(), torch.float32)


def test_merge_kernel_launches_as_a_dependent_only_on_hopper_class_gpus(monkeypatch):
    """PDL (DecodeConfig.pdl) where the merge kernel runs on an sm_90+ NVIDIA GPU; never with one split or the
    in-place merge, nor elsewhere (the interpreter included)."""
    c = Case([20, 30], [1, 1], h=4, kvh=2, d=16, seed=15)
    for hopper in (True, False):
        monkeypatch.setattr(dec, "hopper_class", lambda device, hopper=hopper: hopper)
        for cfg, splits, want in ((SEPARATE, 3, hopper), (FUSED, 3, False), (SEPARATE, 1, False),
                                  (dataclasses.replace(SEPARATE, pdl=False), 3, False)):
            q_pos = torch.tensor([19, 29], dtype=torch.int64, device=DEV)
            out = torch.empty(2, 4, 16, device=DEV)
            args = (c.q, c.k_buf, c.v_buf, c.kv_indptr, c.kv_indices, c.kv_pos0, q_pos, out)
            plan = dec.plan_decode(*args, None, 30, workspace=make_decode_workspace(2, 4, 16, splits, DEV), config=cfg)
            assert plan.split_consts["PDL"] == plan.merge_consts["PDL"] == want, (hopper, cfg, splits)
            assert plan.merge_consts.get("launch_pdl", False) == want


@pytest.mark.skipif(not torch.cuda.is_available() or not dec.hopper_class(torch.device("cuda")),
                    reason="programmatic dependent launch needs an sm_90+ NVIDIA GPU")
@pytest.mark.cuda
@pytest.mark.parametrize("splits", [3, 17])
def test_dependent_merge_matches_the_plain_launch_eager_and_in_a_graph(splits):
    """The merge kernel as the split kernel's programmatic dependent gives the plain launch's bits, eagerly and
    replayed in a CUDA graph (where the dependency becomes a programmatic edge), over repeated runs. Before each run
    the workspace is NaN and the inputs alternate between two sets (q and sinks copied into the buffers the graph
    reads), so a merge that read before the splits finished would show NaN or the other set's answer."""
    c = Case([700, 1500, 64], [1, 1, 1], h=16, kvh=2, d=64, dtype=torch.bfloat16, seed=splits, page=16)
    g = torch.Generator().manual_seed(splits)
    inputs = [(c.q.clone(), _sinks(16)), (torch.randn(c.q.shape, generator=g).to(c.q), _sinks(16) + 1)]
    q, sinks = inputs[0][0].clone(), inputs[0][1].clone()
    q_pos = torch.tensor([s - 1 for s in c.seq_lens], dtype=torch.int64, device=DEV)
    out = torch.empty(3, 16, 64, dtype=c.dtype, device=DEV)
    args = (q, c.k_buf, c.v_buf, c.kv_indptr, c.kv_indices, c.kv_pos0, q_pos, out)
    plans = {pdl: dec.plan_decode(*args, sinks, 1500, workspace=make_decode_workspace(3, 16, 64, splits, DEV),
                                  config=dataclasses.replace(SEPARATE, pdl=pdl)) for pdl in (False, True)}

    def step(plan, k, fn):
        q.copy_(inputs[k % 2][0])
        sinks.copy_(inputs[k % 2][1])
        plan.ws_acc.fill_(float("nan"))
        plan.ws_lse.fill_(float("nan"))
        out.fill_(float("nan"))
        fn()
        return out.clone()

    want = []
    for k in range(2):   # the plain launch, eagerly: one answer per input set
        want.append(step(plans[False], k, lambda: dec.decode_attention_planned(plans[False], *args, c.scaling,
                                                                              c.window, 0.0, sinks)))
    _close(want[0], c.ref(0.0, inputs[0][1]), torch.bfloat16)   # the first set is the case's own q
    assert not torch.equal(want[0], want[1])
    for pdl, plan in plans.items():
        assert plan.merge_consts["PDL"] == pdl and plan.splits == splits and not plan.fused

        def eager(plan=plan):
            dec.decode_attention_planned(plan, *args, c.scaling, c.window, 0.0, sinks)
        for k in range(4):
            assert torch.equal(step(plan, k, eager), want[k % 2]), (pdl, "eager", k)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            eager()
        for k in range(10):
            assert torch.equal(step(plan, k, graph.replay), want[k % 2]), (pdl, "graph", k)


@pytest.mark.parametrize("hpp", [2, 4])
@pytest.mark.parametrize("window", [None, 11])
@pytest.mark.parametrize("h,kvh,d,dv", [(16, 4, 16, 16), (8, 4, 24, 40), (6, 2, 16, 16)])
def test_batched_heads_match_the_reference(hpp, window, h, kvh, d, dv):
    """Several kv heads a program as a batch of per-head dots (no block-diagonal tile): odd head dims, Dv != D, a
    group of 3, sinks and soft-cap, both merges; lists of several key tiles a split."""
    # tiles of at most 32 keys (the interpreter's are 16): 4 heads of 64 columns stay within the tile bound
    cfgs = [dataclasses.replace(cfg, heads_per_program=hpp, batched_heads=True, block_n=min(cfg.block_n, 32),
                                mid_block_n=min(cfg.mid_block_n, 32)) for cfg in (FUSED, SEPARATE)]
    c = Case([9, 140, 23], [1, 1, 1], h=h, kvh=kvh, d=d, dv=dv, window=window, seed=hpp + kvh + d + 1)
    sinks = _sinks(h)
    _close(both(c, 4, *cfgs, logit_cap=2.0, sinks=sinks), c.ref(2.0, sinks), torch.float32)
    one, plan = run(c, cfgs[0], 1, logit_cap=2.0, sinks=sinks)   # one split: finished in place
    assert plan.splits == 1 and plan.split_consts["BATCHED"] and plan.split_consts["HPP"] == min(hpp, kvh)
    _close(one, c.ref(2.0, sinks), torch.float32)


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("window", [None, 11])
def test_rows_past_a_split_end_never_read_unlisted_slots(batched, window):
    """A key tile's rows past its split's end repeat the split's last key (masked after the product), so no
    slot outside the lists reaches an output: NaN in the padding slot 0 and in every unlisted slot changes
    nothing, one split or four, with partial tiles in every list."""
    cfgs = [dataclasses.replace(cfg, heads_per_program=2, batched_heads=batched) for cfg in (FUSED, SEPARATE)]
    c = Case([9, 140, 23], [1, 1, 1], h=16, kvh=4, d=16, window=window, seed=31)
    listed = torch.zeros(c.k_buf.shape[0], dtype=torch.bool, device=DEV)
    listed[c.kv_indices[:int(c.kv_indptr[-1])]] = True    # the lists themselves (a window list starts late)
    assert not listed[0]
    # with a window, the keys before each list's start are NaN too (a read one entry early would show)
    assert (int(listed.sum()) < sum(c.seq_lens)) == (window is not None)
    c.k_buf[~listed] = float("nan")
    c.v_buf[~listed] = float("nan")
    _close(both(c, 4, *cfgs), c.ref(), torch.float32)
    one, plan = run(c, cfgs[0], 1)
    assert plan.split_consts["BATCHED"] == batched and plan.split_consts["HPP"] == 2
    _close(one, c.ref(), torch.float32)


def test_the_plan_takes_64_bit_gathers_for_pools_past_int32_offsets(monkeypatch):
    """The plan asks for int32 K/V element offsets (OFF32) only while every offset of both pools fits, from the pools'
    span (strides included); a span past that plans 64-bit gathers, which give the same results here. (The build
    test compiles the 64-bit variant for sm_90; no test holds a pool of 2**31 elements.)"""
    c = Case([9, 140, 23], [1, 1, 1], h=16, kvh=4, d=16, seed=32)
    assert dec._span(c.k_buf) == c.k_buf.numel()
    assert dec._span(c.k_buf[:, :, :8]) == c.k_buf.numel() - 8   # a strided view: its last row ends 8 early
    want = c.ref()
    out, plan = run(c, FUSED, 4)
    assert plan.split_consts["OFF32"]
    _close(out, want, torch.float32)
    monkeypatch.setattr(dec, "_span", lambda t: 2 ** 31)
    out, plan = run(c, FUSED, 4)
    assert not plan.split_consts["OFF32"]
    _close(out, want, torch.float32)


@pytest.mark.parametrize("name", ["ROWS_CONFIG", "WIDE_LONG_CONFIG"])
@pytest.mark.parametrize("window", [None, 37])
def test_the_whole_row_configs_match_the_reference(name, window):
    """The dispatch's batched-heads configs as recorded (8 heads of 32-key tiles, 4 heads of 64), on a GPT-OSS-shaped
    layer (64 q / 8 kv heads, D=64, sinks): one split, and three merged either way."""
    cfg = getattr(dec, name)
    c = Case([70, 200, 131], [1, 1, 1], h=64, kvh=8, d=64, window=window, seed=41)
    sinks = _sinks(64)
    one, plan = run(c, cfg, 1, sinks=sinks)
    assert plan.split_consts["BATCHED"] and plan.split_consts["HPP"] == cfg.heads_per_program
    _close(one, c.ref(0.0, sinks), torch.float32)
    cfgs = [dataclasses.replace(cfg, fused_merge_bytes=b) for b in (1 << 40, 0)]
    _close(both(c, 3, *cfgs, sinks=sinks), c.ref(0.0, sinks), torch.float32)


@pytest.mark.parametrize("name,window", [("MID_CONFIG", None), ("MID_CONFIG", 37), ("LONG_FEW_CONFIG", 37)])
def test_the_even_wave_configs_match_the_reference(name, window):
    """The middle batches' config (one head, 128-key tiles read a tile ahead) and the small batches' over long lists
    (two heads), each with its splits rounded down, as recorded on a GPT-OSS-shaped layer: one split, and two merged
    either way."""
    cfg = getattr(dec, name)
    assert cfg.fill_down
    c = Case([70, 300, 131], [1, 1, 1], h=64, kvh=8, d=64, window=window, seed=43)
    sinks = _sinks(64)
    one, plan = run(c, cfg, 1, sinks=sinks)
    assert plan.split_consts["AHEAD"] == cfg.slots_ahead
    _close(one, c.ref(0.0, sinks), torch.float32)
    cfgs = [dataclasses.replace(cfg, fused_merge_bytes=b) for b in (1 << 40, 0)]
    _close(both(c, 2, *cfgs, sinks=sinks), c.ref(0.0, sinks), torch.float32)
