"""Review 35 (kernels): defects found by a differential driver over the attention kernels of both sets
(`hwkv_cpu.kernels`, and `hwkv_cuda.kernels` under TRITON_INTERPRET=1 on CPU tensors) against `hwkv.reference`.

What held (not tested again here): decode, extend and the reference agree at window edges (W-1, W, W+1 keys,
windows starting mid-page, pages of 1, 2 and 16, contexts shorter than W), GQA groups 1-4 (3 included), sinks,
soft-cap, K/V scales, fp8 and bf16 pools, Dv != D, split-K decode (2-5 splits, the in-place and the kernel merge,
two- and four-head programs, slots ahead), mixed batches with zero-length extends, verify trees through the tree
extend and the decode-like lists (torch and Triton builders), the dense CPU path; nothing written past the batch.

What failed is below: one test per defect, each with what is wrong and what is expected.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402

from hwkv import reference  # noqa: E402
from hwkv.errors import CapacityError, ConfigError, ShapeError  # noqa: E402
from hwkv.window import first_visible  # noqa: E402

import hwkv_cpu.kernels as cpu_kernels  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

I32 = torch.int32
S, KVH, D, H = 16, 2, 8, 4


def _triton():
    from conftest import triton_runs_cpu_tensors
    triton_runs_cpu_tensors()
    import hwkv_cuda.kernels as triton_kernels
    return triton_kernels


def _kernels(name):
    return cpu_kernels if name == "cpu" else _triton()


def _indptr(lens):
    return torch.tensor([0] + list(lens), dtype=torch.int64).cumsum(0).to(I32)


class Batch:
    """Requests with K/V at scattered slots (slot 0 stays padding); request b's list starts at
    first_visible(q_pos0[b], W) (a window list) and holds the rest of its sequence."""

    def __init__(self, seq_lens, extend_lens, h=H, kvh=KVH, d=D, window=None, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.seq_lens, self.extend_lens, self.window, self.h, self.d = list(seq_lens), list(extend_lens), window, h, d
        size = sum(seq_lens) + 8
        self.k_buf = torch.randn(size, kvh, d, generator=g)
        self.v_buf = torch.randn(size, kvh, d, generator=g)
        perm = torch.randperm(size - 1, generator=g)[:sum(seq_lens)] + 1
        self.slots = list(torch.split(perm, self.seq_lens))
        self.q_pos0 = [s - e for s, e in zip(seq_lens, extend_lens)]
        pos0 = [first_visible(p, window) for p in self.q_pos0]
        lists = [s[p:] for s, p in zip(self.slots, pos0)]
        self.kv_indptr = _indptr([len(x) for x in lists])
        self.kv_indices = torch.cat(lists)
        self.kv_pos0 = torch.tensor(pos0, dtype=torch.int64)
        self.qo_indptr = _indptr(extend_lens)
        self.q = torch.randn(sum(extend_lens), h, d, generator=g)
        self.scaling = 1.0 / math.sqrt(d)

    def ref(self, sinks=None):
        return reference.batch_attention(self.q, [self.k_buf[s] for s in self.slots],
                                         [self.v_buf[s] for s in self.slots], self.seq_lens, self.extend_lens,
                                         self.scaling, self.window, 0.0, sinks)

    def extend(self, kern, sinks=None, max_q_len=None, guard=4):
        """out with `guard` rows of 7.0 past it (a view of a larger tensor); returns (big, out)."""
        t = self.q.shape[0]
        big = torch.full((t + guard, self.h, self.d), 7.0)
        kern.extend_attention(self.q, self.k_buf, self.v_buf, self.kv_indptr, self.kv_indices, self.kv_pos0,
                              self.qo_indptr, torch.tensor(self.q_pos0, dtype=torch.int64), big[:t],
                              max(self.extend_lens) if max_q_len is None else max_q_len, self.scaling, self.window,
                              0.0, sinks, None, None)
        return big, big[:t]


# ---------------------------------------------------------------------------------------------------------------
# 1. hwkv_cpu's chunked extend: a sink of -inf gives NaN rows.
# ---------------------------------------------------------------------------------------------------------------

def test_cpu_extend_with_a_minus_inf_sink_gives_no_nan():
    """WRONG: `AttentionLayer` allows a sink of -inf ("no sink", tests/test_review26_numerics.py), but hwkv_cpu's
    chunked extend (`kernels_extend._extend_block` -> `kernels_decode.OnlineSoftmax`) starts the running max at the
    sink (`reset`: m = -inf, l = 1) and, for a query row whose first key chunk lies wholly outside its window, the
    next `step` computes alpha = exp(m - m_new) = exp(-inf - (-inf)) = NaN (kernels_decode.py:264-265), so l and
    the row's output turn NaN. Here: one 512-token prompt chunk after a 10-token prefix, W=4, 4 q heads: the query
    block's 515 keys split into two chunks and every row past the first chunk's end comes out NaN for the heads
    whose sink is -inf (Triton and the reference give the window's attention, the sink adding nothing).
    EXPECTED: the reference's output, no NaN. Fix: in `OnlineSoftmax.reset` keep the running max finite
    (m = sinks.clamp_min(NEG_BIG), l = exp(sinks - m), so a -inf sink contributes 0), or clamp m_new to NEG_BIG in
    `step` as the fresh branch does."""
    sinks = torch.tensor([0.5, float("-inf"), 1.0, float("-inf")])
    b = Batch([522], [512], window=4, seed=3)
    _, out = b.extend(cpu_kernels, sinks)
    nan_rows = torch.isnan(out).any(-1).any(-1).nonzero().flatten().tolist()
    assert not nan_rows, f"{len(nan_rows)} of 512 rows hold NaN (first: {nan_rows[:3]})"
    torch.testing.assert_close(out, b.ref(sinks), atol=3e-5, rtol=3e-5)


# ---------------------------------------------------------------------------------------------------------------
# 2. The public kernels take any logit_cap, window, scaling and sink values.
# ---------------------------------------------------------------------------------------------------------------

BAD_OPTIONS = {
    "logit_cap nan": (dict(logit_cap=float("nan")), r"logit_cap=nan"),
    "logit_cap -1": (dict(logit_cap=-1.0), r"logit_cap=-1\.0"),
    "logit_cap inf": (dict(logit_cap=float("inf")), r"logit_cap=inf"),
    "window -2": (dict(window=-2), r"window=-2"),
    "scaling nan": (dict(scaling=float("nan")), r"scaling=nan"),
    "sinks +inf": (dict(sinks=torch.tensor([0.0, float("inf"), 0.0, 0.0])), r"sinks\[1\] is inf"),
    "sinks nan": (dict(sinks=torch.tensor([0.0, float("nan"), 0.0, 0.0])), r"sinks\[1\] is nan"),
}


def _call(kern, mode, big_rows, **over):
    """A valid decode (one request, keys at slots 1..5, query at 4) or extend (3 rows at positions 2..4) call with
    `over` replacing scaling / window / logit_cap / sinks; out is the first rows of a tensor of 7.0."""
    g = torch.Generator().manual_seed(0)
    k_buf, v_buf = torch.randn(S, KVH, D, generator=g), torch.randn(S, KVH, D, generator=g)
    opts = dict(scaling=D ** -0.5, window=None, logit_cap=0.0, sinks=None)
    opts.update(over)
    rows = 1 if mode == "decode" else 3
    q = torch.randn(rows, H, D, generator=g)
    out = big_rows[:rows]
    ptr, idx = torch.tensor([0, 5], dtype=I32), torch.arange(1, 6)
    if mode == "decode":
        kern.decode_attention(q, k_buf, v_buf, ptr, idx, torch.tensor([0]), torch.tensor([4]), out, opts["scaling"],
                              opts["window"], opts["logit_cap"], opts["sinks"], None, None)
    else:
        kern.extend_attention(q, k_buf, v_buf, ptr, idx, torch.tensor([0]), torch.tensor([0, 3], dtype=I32),
                              torch.tensor([2]), out, 3, opts["scaling"], opts["window"], opts["logit_cap"],
                              opts["sinks"], None, None)


@pytest.mark.parametrize("bad", sorted(BAD_OPTIONS))
@pytest.mark.parametrize("mode", ["decode", "extend"])
@pytest.mark.parametrize("name", ["cpu", "triton"])
def test_public_kernels_refuse_bad_scalar_options_before_writing(name, mode, bad):
    """WRONG: `decode_attention` / `extend_attention` of both kernel sets (and so `torch.ops.hwkv.*`, which engines
    that compile their own layers call without an `AttentionLayer`) check shapes, dtypes, the index lists and
    k_scale/v_scale (ConfigError naming the value), but never logit_cap, window, scaling or the sinks' values
    (hwkv_cpu/kernels.py:36-45 `_scalars`; hwkv_cuda/kernels/decode.py:704-707, extend.py:379-391 cast them as
    they come): a NaN or infinite cap or scale, or a NaN sink, writes NaN outputs; a negative cap or window is read
    as "off" (the reference raises ConfigError for both); a +inf sink gives zeros on Triton and NaN on the CPU (the
    layer refuses exactly these sinks, tests/test_review26_numerics.py, the kernels do not).
    EXPECTED: a ConfigError naming the option and its value (the rule of `hwkv.reference` / `AttentionLayer`:
    `hwkv.checks.logit_cap_ok`, window None or an int >= 0, a finite scaling, finite sinks where values are
    checkable), raised before `out` is written. Fix: one host check of the scalar options (and, where
    `values_checkable`, the sinks) in the public entry points and the plans, shared with the layer's."""
    kern = _kernels(name)
    over, match = BAD_OPTIONS[bad]
    big = torch.full((4, H, D), 7.0)
    with pytest.raises(ConfigError, match=match):
        _call(kern, mode, big, **over)
    assert torch.equal(big, torch.full_like(big, 7.0)), "out was written by a refused call"


# ---------------------------------------------------------------------------------------------------------------
# 3. extend_attention with a max_q_len below a request's new tokens.
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("max_q_len", [1, 0])
@pytest.mark.parametrize("name", ["cpu", "triton"])
def test_extend_refuses_a_max_q_len_below_a_run(name, max_q_len):
    """WRONG: `max_q_len` is "a host upper bound on any request's query count"; the Triton extend sizes its grid by
    it (hwkv_cuda/kernels/extend.py:356-358), so with a bound below a request's run the rows past the grid are
    silently left unwritten (here a request of 20 new tokens with max_q_len 1: rows 8.. keep whatever `out` held;
    max_q_len 0: no row is written), while the CPU kernels ignore it and compute every row: the two backends give
    different results from the same call, and neither says the bound is wrong. The graph refill refuses the same
    bound (CapacityError, tests/test_review34_windows.py), the kernels do not, even where values are checkable.
    EXPECTED: where the lengths are checkable (CPU tensors, HWKV_DEBUG), a typed error naming max_q_len and the
    longest run (CapacityError, as the refill's) before anything is written; at least the same outputs on both.
    Fix: in `_check_extend` / `hwkv_cpu.kernels.extend_attention`, compare max(qo_indptr diffs) with max_q_len where
    `values_checkable(qo_indptr)` (the indptr is already read there by `check_csr_values`)."""
    kern = _kernels(name)
    b = Batch([25], [20], window=None, seed=4)
    big = torch.full((24, H, D), 7.0)
    with pytest.raises((CapacityError, ShapeError, ConfigError), match="max_q_len"):
        kern.extend_attention(b.q, b.k_buf, b.v_buf, b.kv_indptr, b.kv_indices, b.kv_pos0, b.qo_indptr,
                              torch.tensor(b.q_pos0, dtype=torch.int64), big[:20], max_q_len, b.scaling, None, 0.0,
                              None, None, None)
    assert torch.equal(big, torch.full_like(big, 7.0)), "out was written by a refused call"


@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_triton_kernels_read_no_scaling_as_one_over_sqrt_d_as_the_cpu_kernels_do(mode):
    """`scaling=None` was a bare TypeError in the Triton kernels (float(None)) while the CPU kernels and the layer
    read it as 1/sqrt(D); now the same outputs as the CPU kernels' and as an explicit 1/sqrt(D)."""
    tk = _triton()
    outs = []
    for kern, scaling in ((cpu_kernels, None), (tk, None), (tk, D ** -0.5)):
        big = torch.full((4, H, D), 7.0)
        _call(kern, mode, big, scaling=scaling)
        outs.append(big)
    torch.testing.assert_close(outs[1], outs[0], atol=3e-5, rtol=3e-5)
    torch.testing.assert_close(outs[1], outs[2])
