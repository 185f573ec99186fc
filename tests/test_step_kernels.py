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
