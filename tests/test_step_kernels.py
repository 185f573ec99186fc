"""The whole-step graph's bookkeeping kernels (hwkv_cuda.kernels.step; interpreted on CPU, compiled on a GPU)
against hwkv.ops' torch versions, on the same random batches: live and padded requests, rows and lengths read
from one interleaved staging buffer, with and without release frontiers. They must agree exactly."""
import random

import pytest
import torch

pytest.importorskip("triton")

from hwkv import ops  # noqa: E402
from hwkv_cuda.kernels import step  # noqa: E402

pytestmark = [pytest.mark.interpret, pytest.mark.cuda]
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
I64 = dict(dtype=torch.int64, device=DEV)


def _case(rng, bs, ctx=40):
    """Staged [ctl, (row, length) pairs] for bs requests on distinct rows (a row written twice would race), the
    req_to_token table, and the padding row (the last)."""
    rows_total = bs + 5
    live = rng.randrange(0, bs + 1)
    staged = torch.zeros(3 + 2 * bs, **I64)
    rows = rng.sample(range(rows_total - 1), bs)
    staged[2] = live
    staged[3::2] = torch.tensor(rows, **I64)
    staged[4::2] = torch.tensor([rng.randrange(2, ctx) for _ in range(bs)], **I64)
    rtt = torch.randint(0, 1000, (rows_total, ctx), generator=torch.Generator().manual_seed(rng.randrange(99))).to(DEV)
    return staged, rtt, rows_total - 1


@pytest.mark.parametrize("seed", range(6))
def test_prologue_and_write_match_the_torch_ops(seed):
    rng = random.Random(seed)
    for n in (1, 3, 16, 17, 40):  # one program and several (16 per program interpreted)
        staged, rtt, pad = _case(rng, n)
        outs = []
        for kernels in (ops.TORCH_STEP, step.KERNELS):
            rows, seq, prefix, last, out = (torch.full((n,), -7, **I64) for _ in range(5))
            kernels.prologue(staged[:3], staged[3::2], staged[4::2], pad, rtt, rows, seq, prefix, last, out)
            out_vals = torch.arange(100, 100 + n, **I64) * (torch.arange(n, **I64) < staged[2])
            out.copy_(out_vals)
            r2 = rtt.clone()
            frontiers = torch.arange(rtt.shape[0], **I64) * 16
            f = torch.full((n,), -1, **I64)
            kernels.write(r2, rows, seq, out, frontiers, f)
            r3 = rtt.clone()
            kernels.write(r3, rows, seq, out, None, None)
            outs.append([rows, seq, prefix, last, r2, f, r3])
        for name, a, b in zip(("rows", "seq", "prefix", "last", "req_to_token", "frontiers", "no-f"), *outs):
            assert torch.equal(a, b), f"{name} differs at bs={n}"
        live = int(staged[2])
        assert outs[0][0][live:].eq(pad).all() and outs[0][1][live:].eq(1).all()  # padded requests: the pad row
        assert torch.equal(outs[0][2], outs[0][1] - (torch.arange(n, **I64) < live).long())


@pytest.mark.parametrize("tokens", [2, 4])
@pytest.mark.parametrize("seed", range(3))
def test_prologue_and_write_of_several_tokens_per_request_match_the_torch_ops(seed, tokens):
    """A verify step's bookkeeping (`tokens` = drafts + 1 per request): lengths after the step, each live
    request's prefix `tokens` behind, padded requests at length `tokens` (prefix == length: nothing to take), and
    every request's `tokens` new slots written at its last `tokens` positions."""
    rng = random.Random(100 + seed)
    for n in (1, 5, 17):
        staged, rtt, pad = _case(rng, n)
        staged[4::2] = staged[4::2] % (40 - tokens - 1) + tokens + 1  # a verify continues a request; <= ctx
        outs = []
        for kernels in (ops.TORCH_STEP, step.KERNELS):
            rows, seq, prefix, last = (torch.full((n,), -7, **I64) for _ in range(4))
            out = torch.full((n * tokens,), -7, **I64)
            kernels.prologue(staged[:3], staged[3::2], staged[4::2], pad, rtt, rows, seq, prefix, last, out,
                             tokens=tokens)
            zeroed = out.clone()
            live = int(staged[2])
            out.copy_(torch.arange(100, 100 + n * tokens, **I64) * (torch.arange(n * tokens, **I64) < live * tokens))
            r2 = rtt.clone()
            kernels.write(r2, rows, seq, out, None, None, tokens=tokens)
            outs.append([rows, seq, prefix, last, zeroed, r2])
        for name, a, b in zip(("rows", "seq", "prefix", "last", "out", "req_to_token"), *outs):
            assert torch.equal(a, b), f"{name} differs at bs={n}, tokens={tokens}"
        rows, seq, prefix, last, zeroed, r2 = outs[0]
        assert zeroed.eq(0).all()
        assert seq[live:].eq(tokens).all() and prefix[live:].eq(tokens).all() and rows[live:].eq(pad).all()
        assert torch.equal(prefix[:live], seq[:live] - tokens)
        for b in range(live):  # hand-checked: row b's last `tokens` positions hold its slots, the rest untouched
            row, s = int(rows[b]), int(seq[b])
            assert r2[row, s - tokens:s].tolist() == list(range(100 + b * tokens, 100 + (b + 1) * tokens))
            assert torch.equal(r2[row, :s - tokens], rtt[row, :s - tokens]) and torch.equal(r2[row, s:], rtt[row, s:])
            assert int(last[b]) == int(rtt[row, s - tokens - 1])
