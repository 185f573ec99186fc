"""The Gluon sm_90 extend kernel (hwkv_cuda.kernels.extend_hopper) against hwkv.reference and the portable
Triton kernel on the same random paged inputs (pages of 16 at random places, prefix + new tokens, GQA, windows,
soft-cap, sinks, K/V scales). Needs a Hopper (compute capability 9.x) GPU; the dispatch tests at the end run
everywhere."""
import dataclasses
import math

import pytest
import torch

from hwkv import reference
from hwkv.window import first_visible
from hwkv_cuda.kernels import extend_hopper
from hwkv_cuda.kernels.extend import default_config, extend_attention, plan_extend

pytestmark = pytest.mark.cuda


def _hopper_reason():
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine"
    if torch.version.hip is not None or torch.cuda.get_device_capability()[0] != 9:
        return f"needs an sm_90 GPU, this one is {torch.cuda.get_device_name()}"
    if extend_hopper.GLUON_ERROR is not None:
        return f"Gluon's Hopper API is not importable with this Triton: {extend_hopper.GLUON_ERROR}"
    return None


hopper = pytest.mark.skipif(_hopper_reason() is not None, reason=str(_hopper_reason()))
PAGE = 16


@pytest.fixture(autouse=True)
def _small_calls_take_the_gluon_kernel(monkeypatch):
    """These tests' batches are small: the dispatch's token threshold (a host-cost rule, tested on its own below) is
    lifted so that they exercise the Gluon kernel."""
    monkeypatch.setattr(extend_hopper, "MIN_TOKENS", 0)
    monkeypatch.setattr(extend_hopper, "MIN_WINDOW_TOKENS", 0)


class Paged:
    """A batch over a pool of pages of 16 placed at random; request b holds seq_lens[b] keys, the last
    extend_lens[b] of them are its queries."""

    def __init__(self, seq_lens, extend_lens, h=16, kvh=2, d=64, window=None, window_list=True,
                 dtype=torch.bfloat16, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.seq_lens, self.extend_lens, self.window, self.h, self.d = list(seq_lens), list(extend_lens), window, h, d
        pages_needed = sum(-(-n // PAGE) for n in seq_lens)
        n_pages = 2 * pages_needed + 3
        pages = torch.randperm(n_pages - 1, generator=g)[:pages_needed] + 1   # page 0 stays padding
        size = n_pages * PAGE
        self.k_buf = torch.randn(size, kvh, d, generator=g).to(dtype).cuda()
        self.v_buf = torch.randn(size, kvh, d, generator=g).to(dtype).cuda()
        slots, at = [], 0
        for n in seq_lens:
            own = pages[at:at + -(-n // PAGE)]
            at += len(own)
            slots.append((own[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)[:n])
        self.keys = [self.k_buf.float().cpu()[s] for s in slots]
        self.values = [self.v_buf.float().cpu()[s] for s in slots]
        q_pos0 = [s - e for s, e in zip(seq_lens, extend_lens)]
        pos0 = [first_visible(p, window) if window_list else 0 for p in q_pos0]
        lists = [s[p:] for s, p in zip(slots, pos0)]
        i32 = dict(dtype=torch.int32, device="cuda")
        self.kv_indptr = torch.tensor([0] + [len(x) for x in lists], **i32).cumsum(0).to(torch.int32)
        self.kv_indices = torch.cat(lists + [torch.zeros(5, dtype=torch.int64)]).cuda()
        self.kv_pos0 = torch.tensor(pos0, dtype=torch.int64, device="cuda")
        self.qo_indptr = torch.tensor([0] + list(extend_lens), **i32).cumsum(0).to(torch.int32)
        self.q_pos0 = torch.tensor(q_pos0, dtype=torch.int64, device="cuda")
        self.q = torch.randn(sum(extend_lens), h, d, generator=g).to(dtype).cuda()
        self.scaling = 1.0 / math.sqrt(d)

    def args(self, out):
        return (self.q, self.k_buf, self.v_buf, self.kv_indptr, self.kv_indices, self.kv_pos0, self.qo_indptr,
                self.q_pos0, out)

    def empty_out(self):
        return torch.full_like(self.q, float("nan"))

    def portable(self, logit_cap=0.0, sinks=None, k_scale=None, v_scale=None):
        out = self.empty_out()
        extend_attention(*self.args(out), max(self.extend_lens), self.scaling, self.window, logit_cap, sinks,
                         k_scale, v_scale, config=default_config(self.d, False, self.window, self.q.device))
        return out

    def gluon(self, monkeypatch, logit_cap=0.0, sinks=None, k_scale=None, v_scale=None):
        """Through the dispatch, as the backend calls it (plan once, run planned); a window through the Gluon kernel's
        own window plan (its window tiles), whether the list is the window's or the full one."""
        monkeypatch.setenv(extend_hopper.ENV_FLAG, "1")
        out = self.empty_out()
        if self.window:
            hop = extend_hopper.plan_hopper_extend(self.q, self.k_buf, self.v_buf, out, max(self.extend_lens),
                                                   window=self.window)
        else:
            hop = plan_extend(*self.args(out), max(self.extend_lens), sinks, window=self.window).hopper
        assert hop is not None, extend_hopper.unsupported(self.q, self.k_buf, self.v_buf, out, max(self.extend_lens))
        launched = extend_hopper.run_hopper_extend(hop, *self.args(out), self.scaling, self.window,
                                                   logit_cap, sinks, k_scale, v_scale)
        assert launched
        return out

    def ref(self, logit_cap=0.0, sinks=None, k_scale=None, v_scale=None):
        keys = [k * (k_scale or 1.0) for k in self.keys]
        values = [v * (v_scale or 1.0) for v in self.values]
        return reference.batch_attention(self.q.float().cpu(), keys, values, self.seq_lens, self.extend_lens,
                                         self.scaling, self.window, logit_cap,
                                         None if sinks is None else sinks.cpu())


def _close(out, want, tol=2e-2):
    assert not torch.isnan(out).any(), "output holds NaN (a row never written, or 0/0)"
    err = (out.float().cpu() - want.float().cpu()).abs().max().item()
    assert err <= tol * max(1.0, want.abs().max().item()), f"max abs error {err}"


CASES = {   # name: (seq_lens, extend_lens)
    "one_causal": ([300], [300]),
    "over_prefix": ([700, 513, 64], [200, 13, 64]),       # prefix + new; one request shorter than a program
    "ragged": ([1000, 17, 160, 33], [1000, 17, 40, 1]),   # a decode row beside prefill
    "long": ([2100], [2100]),
}


@hopper
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", [None, 128, 37])
def test_gluon_matches_reference_and_portable(monkeypatch, d, case, window):
    seq, ext = CASES[case]
    c = Paged(seq, ext, h=16, kvh=2, d=d, window=window)
    got = c.gluon(monkeypatch)
    _close(got, c.ref())
    _close(got, c.portable())


VARIANTS = {   # the sweep's schedule switches, each against the reference
    "persistent": extend_hopper.HopperConfig(128, 4),
    "one_item_per_program": extend_hopper.HopperConfig(128, 4, persistent=False),
    "pingpong": extend_hopper.HopperConfig(128, 4, pingpong=True),
    "q_regs": extend_hopper.HopperConfig(128, 4, q_regs=True),
    "pingpong_q_regs_64_keys": extend_hopper.HopperConfig(64, 3, pingpong=True, q_regs=True),
    # the proxy fence in the producer, a tile and three tiles behind its copies
    "producer_fence_1": extend_hopper._CLEAN[64]._replace(fence_lag=1),
    "producer_fence_3": extend_hopper._CLEAN_WINDOW[64]._replace(fence_lag=3),
    # the turns rotating among three and four consumers
    "pingpong_three_consumers": extend_hopper._CLEAN[64]._replace(pingpong=True),
    "pingpong_four_consumers": extend_hopper._CLEAN_WINDOW[64]._replace(pingpong=True, consumers=4,
                                                                         consumer_regs=104),
    "three_consumers": extend_hopper.HopperConfig(64, 4, 152, consumers=3),
    "window_tiles": extend_hopper._CLEAN_WINDOW[64],   # 32 keys a tile, 8 stages (Triton releases but 3.6)
    "causal_tiles": extend_hopper._CLEAN[64],          # 3 consumers x 64 keys, 6 stages (Triton releases but 3.6)
    "four_consumers_q_regs": extend_hopper._TUNED_WINDOW[64]._replace(sums_mma=False),   # 4 x 64 rows, Q in registers
    # row sums on the tensor cores: the dispatch's causal and window tiles (3.6) take them; an N-major ones tile once
    # gave wrong sums with two consumers of 128-key tiles, so those forms too
    "sums_mma_causal_tiles": extend_hopper._CLEAN[64]._replace(sums_mma=True),
    "sums_mma_window_tiles": extend_hopper._TUNED_WINDOW[64],
    "sums_mma_128_keys": extend_hopper.HopperConfig(128, 4, sums_mma=True),
    "sums_mma_pingpong": extend_hopper.HopperConfig(128, 4, pingpong=True, sums_mma=True),
    # gathers without row masks: rows past a list's end repeat its last slot
    "lean_causal_tiles": extend_hopper._CLEAN[64]._replace(lean_gather=True),
    "lean_window_tiles": extend_hopper._CLEAN_WINDOW[64]._replace(lean_gather=True),
    "lean_sums_mma_window_tiles": extend_hopper._TUNED_WINDOW[64]._replace(lean_gather=True),
    # the soft-cap's tanh: the dispatch's tiles take the hardware's (tanh.approx.f32), these the exact form
    "exact_tanh_causal_tiles": extend_hopper._CLEAN[64]._replace(fast_tanh=False),
    "exact_tanh_window_tiles": extend_hopper._CLEAN_WINDOW[64]._replace(fast_tanh=False),
}


@hopper
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("programs", [1, 11, 13])   # 11 and 13 divide no item count (630, 420, 320): a last round
#                                                     part-full
@pytest.mark.parametrize("window", [None, 37])
def test_gluon_programs_walk_many_items(monkeypatch, variant, programs, window):
    """A few persistent programs each walk many work items (empty ones of short requests among them), carrying the
    ring's stages, the Q tiles' phases and the O tiles' stores from one item to the next."""
    c = Paged([1000, 17, 160, 33, 300], [1000, 17, 40, 1, 300], h=16, kvh=2, d=64, window=window, seed=11)
    out = c.empty_out()
    plan = extend_hopper._plan(8, 2, 64, 1000, VARIANTS[variant], c.q.device)
    if not plan.programs and programs > 1:
        pytest.skip("one item per program: the program count does not apply")
    if plan.programs:
        plan = plan._replace(programs=programs)
    assert plan.kv_heads * plan.blocks * 5 % programs or programs == 1
    sinks = torch.randn(16, generator=torch.Generator().manual_seed(2)).float().cuda()
    assert extend_hopper.run_hopper_extend(plan, *c.args(out), c.scaling, window, 0.0, sinks)
    _close(out, c.ref(sinks=sinks))


@hopper
@pytest.mark.parametrize("window", [None, 37])
def test_gluon_batch_with_a_request_of_no_new_tokens(monkeypatch, window):
    """A request with keys but no new token between two with some: every one of its token blocks is inactive (the
    blocks end at each request's end, so its would start before it), and the others' rows are right."""
    c = Paged([400, 90, 70], [250, 0, 70], window=window, seed=13)
    _close(c.gluon(monkeypatch), c.ref())


@hopper
@pytest.mark.parametrize("h,kvh", [(64, 8), (8, 8), (32, 2), (64, 1)])
def test_gluon_group_sizes(monkeypatch, h, kvh):
    c = Paged([400, 90], [250, 90], h=h, kvh=kvh, d=64, seed=3)
    _close(c.gluon(monkeypatch), c.ref())


@hopper
def test_the_dispatch_gives_window_layers_window_tiles(monkeypatch):
    """D=64: a causal call plans the Gluon kernel's causal tiles (64 keys), a window call its window tiles (32)."""
    monkeypatch.delenv(extend_hopper.ENV_FLAG, raising=False)
    c = Paged([900, 300], [500, 300], window=64, seed=5)
    out = c.empty_out()
    causal = plan_extend(*c.args(out), 500, None, window=None).hopper
    windowed = plan_extend(*c.args(out), 500, None, window=64).hopper
    assert not causal.windows and causal.consts["BLOCK_N"] == extend_hopper.CONFIGS[64].block_n == 64
    assert windowed.windows and windowed.consts["BLOCK_N"] == extend_hopper.WINDOW_CONFIGS[64].block_n == 32


def test_a_window_layer_reading_the_full_list_keeps_the_portable_kernel(monkeypatch):
    """A plan made without the window (a window layer over the full list, as a pool without an SWA group gives it)
    has the causal tiles: a call with a window keeps the portable kernel. Runs anywhere: the Gluon plan and launch
    are stand-ins that record what the dispatch asked for."""
    from hwkv_cuda.kernels import extend as ext
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    calls = []
    from types import SimpleNamespace
    stand_in = SimpleNamespace(windows=False)   # a Gluon plan made without the window, as the dispatch reads it
    monkeypatch.setattr(extend_hopper, "plan_hopper_extend", lambda *a, **k: stand_in)
    monkeypatch.setattr(extend_hopper, "run_hopper_extend", lambda plan, *a: calls.append(a[-6]) or True)
    g = torch.Generator().manual_seed(0)
    n, h, kvh, d = 8, 2, 1, 16
    q = torch.randn(n, h, d, generator=g).to(dev)
    k_buf, v_buf = torch.randn(n + 1, kvh, d, generator=g).to(dev), torch.randn(n + 1, kvh, d, generator=g).to(dev)
    i32, i64 = dict(dtype=torch.int32, device=dev), dict(dtype=torch.int64, device=dev)
    lists = (torch.tensor([0, n], **i32), torch.arange(1, n + 1, **i64), torch.zeros(1, **i64))
    qo, q0 = torch.tensor([0, n], **i32), torch.zeros(1, **i64)
    for window, gluon in ((None, True), (4, False)):
        out = torch.full_like(q, float("nan"))
        plan = ext.plan_extend(q, k_buf, v_buf, *lists, qo, q0, out, n, None, window=None)  # the full list's plan
        assert plan.hopper is stand_in
        before = len(calls)
        ext.extend_attention_planned(plan, q, k_buf, v_buf, *lists, qo, q0, out, n, d ** -0.5, window)
        assert (len(calls) > before) == gluon, f"window={window}"
        if not gluon:  # the portable kernel ran the call, its window applied
            want = reference.batch_attention(q.float().cpu(), [k_buf.float().cpu()[1:]], [v_buf.float().cpu()[1:]],
                                             [n], [n], d ** -0.5, window)
            torch.testing.assert_close(out.float().cpu(), want.float(), rtol=1e-3, atol=1e-3)


@hopper
@pytest.mark.parametrize("window_list", [True, False])
def test_gluon_window_over_a_full_list(monkeypatch, window_list):
    """A window layer reads either its window list (pos0 > 0) or the full list masked by the window."""
    c = Paged([900, 300], [500, 300], window=64, window_list=window_list, seed=5)
    _close(c.gluon(monkeypatch), c.ref())


@hopper
@pytest.mark.parametrize("d", [64, 128])
def test_gluon_sinks_softcap_scales(monkeypatch, d):
    c = Paged([600, 200], [300, 200], h=16, kvh=2, d=d, window=100, seed=7)
    sinks = (torch.randn(16, generator=torch.Generator().manual_seed(1)) * 2).float().cuda()
    kw = dict(logit_cap=20.0, sinks=sinks, k_scale=0.5, v_scale=1.5)
    got = c.gluon(monkeypatch, **kw)
    _close(got, c.ref(**kw))
    _close(got, c.portable(**kw))


@hopper
@pytest.mark.parametrize("tile", ["causal", "window"])
@pytest.mark.parametrize("cap", [20.0, 1.5])
def test_gluon_fast_tanh_softcap(tile, cap):
    """The soft-cap by the hardware's tanh (HopperConfig.fast_tanh) against the reference and the exact tanh's
    kernel: a cap the logits saturate (1.5) and one they mostly do not (20), sinks and K/V scales, window and not."""
    window = 100 if tile == "window" else None
    c = Paged([600, 200, 37], [300, 200, 37], h=16, kvh=2, d=64, window=window, seed=5)
    sinks = (torch.randn(16, generator=torch.Generator().manual_seed(3)) * 2).float().cuda()
    base = (extend_hopper.CONFIGS if tile == "causal" else extend_hopper.WINDOW_CONFIGS)[64]
    outs = []
    for fast in (False, True):
        plan = extend_hopper._plan(8, 2, 64, 300, base._replace(fast_tanh=fast), c.q.device, windows=bool(window))
        out = c.empty_out()
        assert extend_hopper.run_hopper_extend(plan, *c.args(out), c.scaling, window, cap, sinks, 0.5, 1.5)
        outs.append(out)
    want = c.ref(logit_cap=cap, sinks=sinks, k_scale=0.5, v_scale=1.5)
    _close(outs[1], want)
    _close(outs[1], outs[0], tol=1e-2)


def _nvidia_reason():
    if not torch.cuda.is_available() or torch.version.hip is not None:
        return "needs an NVIDIA GPU (the hardware's tanh is PTX)"
    if torch.cuda.get_device_capability() < (7, 5):
        return f"tanh.approx.f32 needs sm_75 or later, this is {torch.cuda.get_device_name()}"
    return None


@pytest.mark.skipif(_nvidia_reason() is not None, reason=str(_nvidia_reason()))
@pytest.mark.parametrize("window", [None, 100], ids=["causal", "window"])
@pytest.mark.parametrize("cap", [20.0, 1.5])
def test_portable_fast_tanh_softcap(window, cap):
    """The portable kernel's soft-cap by the hardware's tanh (ExtendConfig.fast_tanh, for bf16/fp16 on NVIDIA GPUs)
    against the reference and the exact tanh's build: caps the logits saturate (1.5) and mostly do not (20), sinks and
    K/V scales; fp32 queries keep the exact form."""
    from hwkv_cuda.kernels.common import fast_tanh_for
    c = Paged([600, 200, 37], [300, 200, 37], h=16, kvh=2, d=64, window=window, seed=7)
    assert fast_tanh_for(c.q.device, False) and not fast_tanh_for(c.q.device, True)
    sinks = (torch.randn(16, generator=torch.Generator().manual_seed(4)) * 2).float().cuda()
    base = default_config(64, False, window, c.q.device)
    outs = []
    for fast in (False, True):
        out = c.empty_out()
        extend_attention(*c.args(out), 300, c.scaling, window, cap, sinks, 0.5, 1.5,
                         config=dataclasses.replace(base, fast_tanh=fast))
        outs.append(out)
    want = c.ref(logit_cap=cap, sinks=sinks, k_scale=0.5, v_scale=1.5)
    _close(outs[0], want)
    _close(outs[1], want)
    _close(outs[1], outs[0], tol=1e-2)


@hopper
def test_gluon_fp16(monkeypatch):
    c = Paged([500], [320], dtype=torch.float16, seed=9)
    _close(c.gluon(monkeypatch), c.ref(), tol=4e-3)


@hopper
def test_backend_call_takes_the_gluon_kernel_unless_turned_off(monkeypatch):
    c = Paged([300], [300])
    out = c.empty_out()
    monkeypatch.setenv(extend_hopper.ENV_FLAG, "0")
    assert plan_extend(*c.args(out), 300).hopper is None
    monkeypatch.delenv(extend_hopper.ENV_FLAG, raising=False)
    assert plan_extend(*c.args(out), 300).hopper is not None
    extend_attention(*c.args(out), 300, c.scaling)   # through the dispatch
    _close(out, c.ref())


@hopper
def test_a_call_keeps_no_tensor_alive(monkeypatch):
    """The TMA descriptors over q and out are made per call and dropped: a prefill chunk's q (tens of MB) is freed
    when its caller drops it."""
    import gc
    import weakref
    c = Paged([300], [300])
    for _ in range(3):   # the first call goes through the JIT, later ones through the planned direct launcher
        c.q = c.q.clone()
        out = c.gluon(monkeypatch)
    refs = [weakref.ref(c.q), weakref.ref(out)]
    del c, out
    gc.collect()
    assert all(r() is None for r in refs)


@hopper
def test_gluon_launches_go_direct_after_the_first(monkeypatch):
    """The Gluon kernel launches through its compiled launcher from the second call on (hwkv_cuda.kernels.launch),
    with new TMA descriptors each call: another q and out of the same shape, then a longer batch (another grid)."""
    extend_hopper._LAUNCHES.clear()
    c = Paged([700, 513, 64], [200, 13, 64], seed=3)
    for _ in range(3):
        c.q = c.q.clone()
        _close(c.gluon(monkeypatch), c.ref())
    (plan,) = extend_hopper._LAUNCHES.values()
    assert plan.direct and plan.jit_calls == 1
    c = Paged([2100, 300], [2100, 300], seed=4)
    for _ in range(2):
        _close(c.gluon(monkeypatch), c.ref())
    assert all(p.direct and p.jit_calls == 1 for p in extend_hopper._LAUNCHES.values())


@hopper
@pytest.mark.parametrize("window", [None, 37])
def test_a_request_alone_equals_it_in_a_batch(monkeypatch, window):
    """A batch of one request builds its own variant (ONE_REQ: no division by the batch size, fixed addresses for its
    bounds); its output is the batch kernel's, bit for bit, on the same request's rows."""
    monkeypatch.setenv(extend_hopper.ENV_FLAG, "1")
    extend_hopper._LAUNCHES.clear()
    c = Paged([1000, 300, 77], [700, 300, 20], window=window, seed=9)
    out = c.empty_out()
    plan = extend_hopper.plan_hopper_extend(c.q, c.k_buf, c.v_buf, out, 700, window=window)
    assert plan is not None, extend_hopper.unsupported(c.q, c.k_buf, c.v_buf, out, 700)
    assert extend_hopper.run_hopper_extend(plan, *c.args(out), c.scaling, window)
    alone = c.empty_out()
    n = 700
    assert extend_hopper.run_hopper_extend(plan, c.q[:n], c.k_buf, c.v_buf, c.kv_indptr[:2], c.kv_indices,
                                           c.kv_pos0[:1], c.qo_indptr[:2], c.q_pos0[:1], alone[:n], c.scaling, window)
    assert torch.equal(alone[:n], out[:n])
    _close(out, c.ref())
    assert sorted(key[-1] for key in extend_hopper._LAUNCHES) == [False, True]   # one variant each


@hopper
def test_window_layers_take_the_gluon_kernel(monkeypatch):
    """Window layers plan the Gluon kernel with its window tiles at D=128 (1.86x the portable kernel) and D=64 (1.24x)
    and launch it through the dispatch."""
    monkeypatch.delenv(extend_hopper.ENV_FLAG, raising=False)
    launched, run = [], extend_hopper.run_hopper_extend
    monkeypatch.setattr(extend_hopper, "run_hopper_extend",
                        lambda *a, **k: launched.append(run(*a, **k)) or launched[-1])
    for d in (128, 64):
        c = Paged([900, 300], [500, 300], d=d, window=64, seed=5)
        out = c.empty_out()
        assert plan_extend(*c.args(out), 500, None, window=64).hopper.windows, d
        launched.clear()
        extend_attention(*c.args(out), 500, c.scaling, 64)
        assert launched == [True], d
        _close(out, c.ref())


# ------------------------------------------------------------------- dispatch (runs everywhere)
def test_on_unless_turned_off_and_reasons_name_the_feature(monkeypatch):
    monkeypatch.setenv(extend_hopper.ENV_FLAG, "0")
    assert extend_hopper.requested() is False
    q = torch.zeros(32, 8, 64, dtype=torch.bfloat16)
    kv = torch.zeros(64, 1, 64, dtype=torch.bfloat16)
    assert extend_hopper.plan_hopper_extend(q, kv, kv, q, 32) is None
    monkeypatch.delenv(extend_hopper.ENV_FLAG, raising=False)
    assert extend_hopper.requested() is True
    assert extend_hopper.plan_hopper_extend(q, kv, kv, q, 32) is None   # a CPU tensor: never the Gluon kernel
    assert extend_hopper.unsupported(q, kv, kv, q, 32) is not None
    assert extend_hopper.takes_window(128) and extend_hopper.takes_window(64) and not extend_hopper.takes_window(80)


def test_calls_under_the_token_threshold_keep_the_portable_kernel(monkeypatch):
    """A call of fewer than MIN_TOKENS query tokens plans no Gluon launch (its host time would not hide under the
    device's); at the threshold it does; window calls from min_window_tokens(D). Stand-ins for the device checks, so it
    runs anywhere."""
    monkeypatch.setattr(extend_hopper, "MIN_TOKENS", 1024)
    monkeypatch.setattr(extend_hopper, "unsupported", lambda *a, **k: None)
    monkeypatch.setattr(extend_hopper, "_plan", lambda *a, **k: "gluon plan")
    monkeypatch.delenv(extend_hopper.ENV_FLAG, raising=False)
    kv = torch.zeros(64, 1, 64, dtype=torch.bfloat16)
    for t, want in ((1023, None), (1024, "gluon plan")):
        q = torch.zeros(t, 8, 64, dtype=torch.bfloat16)
        assert extend_hopper.plan_hopper_extend(q, kv, kv, q, t) == want, t
    monkeypatch.setattr(extend_hopper, "MIN_WINDOW_TOKENS", 4096)   # window calls: a higher threshold
    for t, want in ((1024, None), (4095, None), (4096, "gluon plan")):
        q = torch.zeros(t, 8, 64, dtype=torch.bfloat16)
        assert extend_hopper.plan_hopper_extend(q, kv, kv, q, t, window=128) == want, t
        assert extend_hopper.plan_hopper_extend(q, kv, kv, q, t) == "gluon plan", t
    # D=128 window calls pay from 2048 tokens (under the ceiling MIN_WINDOW_TOKENS, 4096 as set above)
    kv128 = torch.zeros(64, 1, 128, dtype=torch.bfloat16)
    for t, want in ((2047, None), (2048, "gluon plan")):
        q = torch.zeros(t, 8, 128, dtype=torch.bfloat16)
        assert extend_hopper.plan_hopper_extend(q, kv128, kv128, q, t, window=128) == want, t
    monkeypatch.setattr(extend_hopper, "MIN_WINDOW_TOKENS", 0)      # lowering the constant lowers every head dim's
    assert extend_hopper.min_window_tokens(64) == extend_hopper.min_window_tokens(128) == 0


def test_a_triton_release_is_read_from_its_version():
    """The tiles are chosen by Triton's major.minor: local builds and release candidates read the same; a version
    without one takes the untuned tiles rather than failing the import."""
    assert extend_hopper._release("3.6.0") == extend_hopper._release("3.6+git1a2b") == (3, 6)
    assert extend_hopper._release("3.6rc1") == (3, 6) and extend_hopper._release("3.10.0") == (3, 10)
    assert extend_hopper._release("nightly") is None


def test_a_consumer_count_the_kernel_has_no_partitions_for_is_refused():
    """2, 3 or 4 consumer warpgroups: any other count is a ConfigError naming it, not a kernel whose barriers wait
    for consumers that never run."""
    from hwkv.errors import ConfigError
    for n in (1, 5):
        with pytest.raises(ConfigError, match=f"consumers={n}"):
            extend_hopper._plan(8, 8, 64, 1024, extend_hopper.HopperConfig(32, 4, 104, consumers=n),
                               torch.device("cpu"))
    assert extend_hopper._plan(8, 8, 64, 1024, extend_hopper.HopperConfig(32, 4, 104, consumers=4),
                               torch.device("cpu")).consts["NC"] == 4
    for lag in (-1, 4):   # the producer may hold back stages - 1 tiles at most
        with pytest.raises(ConfigError, match=f"fence_lag={lag}: .* 0 to stages - 1 = 3"):
            extend_hopper._plan(8, 8, 64, 1024, extend_hopper.HopperConfig(32, 4, 104, fence_lag=lag),
                               torch.device("cpu"))


def test_a_scale_that_is_not_positive_keeps_the_portable_kernel():
    """The kernel folds the logit scale into the exponent after the row max, which needs scale > 0: a zero or
    negative scaling launches nothing, and the dispatch runs the portable kernel (a k_scale that is not > 0 is a
    ConfigError, as in every kernel)."""
    q = torch.zeros(32, 8, 64, dtype=torch.bfloat16)
    kv = torch.zeros(64, 1, 64, dtype=torch.bfloat16)
    lists = (torch.tensor([0, 32], dtype=torch.int32), torch.arange(32), torch.zeros(1, dtype=torch.int64),
             torch.tensor([0, 32], dtype=torch.int32), torch.zeros(1, dtype=torch.int64))
    for scaling in (0.0, -0.125):
        assert extend_hopper.run_hopper_extend(None, q, kv, kv, *lists, q, scaling) is False
    from hwkv.errors import ConfigError
    for k_scale in (0.0, -1.0):   # a K scale that is not > 0 is bad input everywhere (K is stored divided by it)
        with pytest.raises(ConfigError, match=f"^k_scale={k_scale} must be a finite number > 0"):
            extend_hopper.run_hopper_extend(None, q, kv, kv, *lists, q, 0.125, k_scale=k_scale)


def _nvidia_tool(name: str) -> str:
    """Where Triton's wheel keeps an NVIDIA tool (ptxas: TRITON_PTXAS_PATH first, as Triton itself reads it)."""
    import os
    import triton
    if name == "ptxas" and os.environ.get("TRITON_PTXAS_PATH"):
        return os.environ["TRITON_PTXAS_PATH"]
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _build_reason():
    """Why a kernel cannot be built for sm_90 here (None: it can): the interpreter is on, or the wheel has no ptxas."""
    import os
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):   # Triton's own jit helpers are interpreted then
        return "TRITON_INTERPRET is on; run with TRITON_INTERPRET=0 to compile for sm_90 on a CPU-only machine"
    ptxas = _nvidia_tool("ptxas")
    if not os.path.exists(ptxas):
        return f"no ptxas at {ptxas}"
    return None


def _compile_reason():
    if extend_hopper.GLUON_ERROR is not None:
        return f"Gluon's Hopper API is not importable: {extend_hopper.GLUON_ERROR}"
    return _build_reason()


@pytest.mark.skipif(_compile_reason() is not None, reason=str(_compile_reason()))
@pytest.mark.parametrize("d,window,cap_sinks,variant", [(64, False, False, None), (128, True, False, None),
                                                        (64, True, True, "three_consumers"),
                                                        (64, True, False, "window_tiles"),
                                                        (64, True, False, "one_request"),
                                                        (64, False, True, "sums_mma_causal_tiles"),
                                                        (64, False, True, "lean_causal_tiles"),
                                                        (64, False, False, "pingpong_three_consumers"),
                                                        (64, False, False, "producer_fence_1"),
                                                        (64, True, False, "producer_fence_3"),
                                                        (64, True, False, "lean_window_tiles"),
                                                        (64, False, True, "exact_tanh_causal_tiles"),
                                                        (64, True, True, "exact_tanh_window_tiles"),
                                                        (64, False, True, "tuned"), (64, True, True, "tuned"),
                                                        (128, True, True, "tuned")])
def test_compiles_for_sm90_without_a_gpu(d, window, cap_sinks, variant):
    """The kernel lowers to sm_90 PTX and ptxas takes it without spills or serialising its warpgroup products:
    warp-specialised (setmaxnreg), async wgmma, cp.async gathers, TMA for Q and O. The tiles tuned on Triton 3.6 are
    checked where that release runs (the dispatch gives them to no other)."""
    config = VARIANTS.get(variant)
    if variant == "tuned":
        if extend_hopper._RELEASE != extend_hopper.TUNED_TRITON:
            pytest.skip(f"tiles tuned for Triton {extend_hopper.TUNED_TRITON}, this is {extend_hopper._RELEASE}")
        config = (extend_hopper._TUNED_WINDOW if window else extend_hopper._TUNED)[d]
    k = extend_hopper.compile_for_sm90(d, 8, window=window, cap=cap_sinks, sinks=cap_sinks, config=config,
                                       one_req=variant == "one_request")
    ptx = k.asm["ptx"]
    # the copies complete a stage on their own (noinc arrives), or with `fence_lag` through the producer's waits
    lag = (config or extend_hopper.CONFIGS[d]).fence_lag
    arrive = "cp.async.wait_group" if lag else "cp.async.mbarrier.arrive.noinc"
    for needle in ("wgmma.mma_async", "cp.async.cg", arrive, "cp.async.bulk.tensor.3d", "setmaxnreg"):
        assert needle in ptx, needle
    assert ".local" not in ptx
    sass = _sass(k.asm["cubin"])
    if sass is not None:   # register spills show only in the machine code: local stores and loads
        # D=64: none; D=128's three consumers leave the producer a few spill stores (17 with Triton 3.9, 44 with 3.6,
        # the H200 machine's, where it measured 1.5x the portable kernel all the same); 3.6's D=128 window tile with
        # Q in registers spills 2 in a consumer (1.86x the portable kernel)
        assert sass.count("STL") <= (0 if d == 64 else 48), "the sm_90 build spills registers"
        # the products stay asynchronous: S_j is waited for with P_{j-1} V_{j-1} still in flight. A build that ptxas
        # serialises (it waits for every product at its issue, warning C7514 or C7517) lacks this wait
        # (and the row sums' product, where the config has it)
        in_flight = 2 if (config or extend_hopper.CONFIGS[d]).sums_mma else 1
        assert f"WARPGROUP.DEPBAR.LE gsb0, 0x{in_flight}" in sass, "ptxas serialised the warpgroup products"
    warnings = _ptxas_serialisation(ptx)
    assert not warnings, f"ptxas serialises warpgroup products: {warnings}"
    if cap_sinks:   # the hardware's tanh where the tile asks for it (the dispatch's do), the exact form elsewhere
        assert ("tanh.approx.f32" in ptx) == (config or extend_hopper.CONFIGS[d]).fast_tanh


@pytest.mark.skipif(_build_reason() is not None, reason=str(_build_reason()))
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("window", [False, True], ids=["causal", "window"])
def test_portable_extend_compiles_for_sm90_without_a_gpu(d, window):
    """The portable extend kernel's soft-cap on an NVIDIA GPU takes the hardware's tanh (HAS_CAP 2, inline PTX the
    interpreter cannot run, so its build is checked here): one MUFU.TANH a score and no exp or division beyond the
    uncapped build's, and about the uncapped build's spill stores (the recorded Hopper tiles spill capped or not:
    Triton 3.6, the GPU machines', 23 / 27 / 113 / 187 uncapped at D=64 causal / window and D=128, the hardware's tanh
    2 / 0 / 5 / 3 more, the exact form 1 / 40 / 4 / -1 more; Triton 3.9 0 / -3 / -3 / -8 against 26 / 37 / 3 / -8);
    the exact form (HAS_CAP 1) has no tanh.approx."""
    from hwkv_cuda.kernels import extend
    builds = {cap: extend.compile_extend_for_sm90(extend.TUNED[(d, False)], d=d, cap=cap, window=window, sinks=True)
              for cap in (0, 1, 2)}
    assert "tanh.approx.f32" in builds[2].asm["ptx"] and "tanh.approx.f32" not in builds[1].asm["ptx"]
    sass = {cap: _sass(k.asm["cubin"]) for cap, k in builds.items()}
    if sass[0] is not None:
        assert sass[2].count("MUFU.TANH") > 0 and sass[1].count("MUFU.TANH") == 0
        assert sass[2].count("MUFU.EX2") == sass[0].count("MUFU.EX2") < sass[1].count("MUFU.EX2")
        assert sass[2].count("MUFU.RCP") <= sass[0].count("MUFU.RCP") + 1 < sass[1].count("MUFU.RCP")
        assert sass[2].count("STL") <= sass[0].count("STL") + 8, "the hardware's tanh adds spills"


def _ptxas_serialisation(ptx: str):
    """ptxas's warnings that it serialised or waited for warpgroup products (C7514, C7517) on this PTX."""
    import os
    import subprocess
    import tempfile
    ptxas = _nvidia_tool("ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        run = subprocess.run([ptxas, "-arch=sm_90a", "-O3", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    return [ln.strip() for ln in run.stderr.splitlines() if "C7514" in ln or "C7517" in ln]


def _sass(cubin: bytes):
    """The machine code of a cubin (cuobjdump from Triton's wheel), or None where the wheel has none."""
    import os
    import subprocess
    import tempfile
    tool = _nvidia_tool("cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(extend_hopper.GLUON_ERROR is not None, reason=str(extend_hopper.GLUON_ERROR))
def test_a_call_descriptor_is_gluons_descriptor_with_the_same_fields():
    """The per-call descriptor skips Gluon's validation (run_hopper_extend checks the same first) but is a Gluon
    TensorDescriptor with the fields a validated one would have, so Triton specialises and encodes it the same."""
    import dataclasses
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    x = torch.zeros(40, 8, 64, dtype=torch.bfloat16)[3:]
    got = extend_hopper._descriptor(x, (8, 8, 64))
    want = TensorDescriptor(x, list(x.shape), list(x.stride()), [8, 8, 64], extend_hopper._box_layout(True, (8, 8, 64)))
    assert isinstance(got, TensorDescriptor) and type(got) is not TensorDescriptor, "the unchecked form (3.6 and 3.9)"
    for f in dataclasses.fields(TensorDescriptor):
        assert getattr(got, f.name) is want.base if f.name == "base" else getattr(got, f.name) == getattr(want, f.name)


def test_the_module_imports_without_gluon():
    """A Triton without Gluon's Hopper API (ROCm builds, older releases) still imports the module: the dispatch then
    says why it keeps the portable kernel. Run in a child process whose imports of triton.experimental fail."""
    import subprocess
    import sys
    code = ("import builtins\n"
            "real = builtins.__import__\n"
            "def fake(name, *a, **k):\n"
            "    if name.startswith('triton.experimental'):\n"
            "        raise ImportError('no gluon here')\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = fake\n"
            "import torch\n"
            "from hwkv_cuda.kernels import extend_hopper as e\n"
            "q = torch.zeros(32, 8, 64, dtype=torch.bfloat16)\n"
            "assert 'no gluon here' in e.GLUON_ERROR\n"
            "assert 'not importable' in e.unsupported(q, q[:, :1], q[:, :1], q, 32)\n"
            "assert e.plan_hopper_extend(q, q[:, :1], q[:, :1], q, 32) is None\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
