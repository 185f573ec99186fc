"""Re-review of review 26 (git diff 5b99f91..HEAD): defects the four commits introduced or left.

1. decode (80ee46f): in graph mode the backend sized the split-K scratch with `decode_num_splits` over the list's
   exact `max_len` (`TritonBackend._graph_workspace`) and handed the plan no workspace where that gave one split;
   the plan made without a workspace (`_public_plan`) picks its config from `next_pow2(max_len)`. For a graph
   context in (8192, 16384) and 17-32 requests x 8 kv heads on a 132-SM Hopper the first was MID_CONFIG's one even
   wave (1 split), the second LONG_FEW_CONFIG (2 splits): the captured plan allocated its own scratch inside the
   capture and ran another config than the one the backend sized for (the wide branch had the same mismatch
   before: 33-65 requests, WIDE_CONFIG vs WIDE_LONG_CONFIG). Now one config sizes the scratch and plans the launch.
2. sinks (3fa1c77/8a1c821): `AttentionLayer`'s new value check reads meta sinks in debug mode (values_checkable is
   True for any device but CUDA-while-capturing there): a bare RuntimeError at construction, where the layer had
   been accepted and the backend refuses it with its typed ShapeError (tests/test_backend_refusals.py's
   `test_sinks_on_another_device_or_of_an_integer_dtype_are_refused_before_the_write` fails under HWKV_DEBUG=1).
3. make_tiny_model (3fa1c77): `--seed` is refused from 2**63, but torch's generator takes seeds below 2**64 and the
   script wrote those models before (`--seed 9223372036854775808` wrote one at 5b99f91).
4. ERR_FRONTIER (a5b9cd8): a padded lane of a step bucket (the graph's pad row) whose row frontier is off the page
   grid is recorded by the torch ops and the Triton release (three launches), not by the one-launch `alloc_step`
   (which masks padded lanes): the same step records different errors by path.
"""
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hwkv.errors import HwkvError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
I64 = torch.int64

pytestmark = pytest.mark.usefixtures("one_thread")


def T(xs):
    return torch.tensor(xs, dtype=I64)


# ---- 1. graph workspace vs plan split count --------------------------------------------------------------------
@pytest.mark.parametrize("bs,ctx", [(32, 12000), (17, 9000), (33, 12000), (16, 4096), (256, 4096)],
                         ids=["mid-vs-long-few-32", "mid-vs-long-few-17", "wide-vs-wide-long-33", "mid-2-splits",
                              "rows-1-split"])
def test_graph_workspace_split_count_is_the_captured_plans(monkeypatch, bs, ctx):
    """The backend's graph path for one decode layer (`TritonBackend._plan` with graph metadata): the scratch it sizes
    and the plan it makes come from one config, so the plan's split count is the scratch's (1 where there is none);
    the plan had picked its config from max_len's power of two (2 splits of LONG_FEW_CONFIG beside MID_CONFIG's 1)."""
    pytest.importorskip("triton")
    from hwkv_cuda import backend as cb
    from hwkv_cuda.kernels import decode as dec
    monkeypatch.setattr(dec, "interpreting", lambda: False)      # as on an H100 (132 SMs)
    monkeypatch.setattr(dec, "num_sms", lambda device: 132)
    monkeypatch.setattr(dec, "hopper_class", lambda device: True)
    monkeypatch.setattr(dec, "_PUBLIC_PLANS", {})                 # keep these plans out of other tests
    be = cb.TritonBackend.__new__(cb.TritonBackend)
    be._graph_workspaces, be._outgrown = {}, []
    h, kvh, d = 64, 8, 64
    q, k, v, out = torch.zeros(bs, h, d), torch.zeros(64, kvh, d), torch.zeros(64, kvh, d), torch.zeros(bs, h, d)
    kv = SimpleNamespace(indptr=torch.zeros(bs + 1, dtype=torch.int32), indices=torch.zeros(0, dtype=I64),
                         pos0=torch.zeros(bs, dtype=I64), max_len=ctx, window=None)
    md = SimpleNamespace(graph=True, extra={}, q_pos0=torch.zeros(bs, dtype=I64))
    plan = be._plan(md, True, q, SimpleNamespace(sinks=None), kv, k, v, out)
    want = dec.decode_config(bs, kvh, d, ctx, "cpu")
    sized = [ws.num_splits for ws in be._graph_workspaces.values()]
    assert plan.config == want
    assert plan.splits == (sized[0] if sized else 1) == dec.decode_num_splits(bs, kvh, ctx, "cpu", want, head_dim=d)
    assert len(sized) <= 1 and (plan.splits == 1) == (not sized)


# ---- 2. meta sinks in debug mode ---------------------------------------------------------------------------------
def test_meta_sinks_are_not_read_in_debug_mode(monkeypatch):
    """Expected: as without HWKV_DEBUG (and at 5b99f91 with it), the layer is made (a meta tensor holds no values
    to check). It raised RuntimeError 'Tensor.item() cannot be called on meta tensors'."""
    from hwkv.layer import AttentionLayer
    monkeypatch.setenv("HWKV_DEBUG", "1")
    layer = AttentionLayer(0, 8, 2, 16, sliding_window=4, sinks=torch.zeros(8, device="meta"))
    assert layer.sinks.is_meta   # made: a meta tensor holds no values to check


# ---- 3. make_tiny_model seeds in [2**63, 2**64) ------------------------------------------------------------------
def test_tiny_model_takes_every_seed_torch_takes(monkeypatch, tmp_path):
    """torch.Generator().manual_seed accepts 0 .. 2**64 - 1; the script wrote a model for --seed 2**63 at 5b99f91.
    Expected: `make` called with that seed. Actual: exit 2, '--seed must be below 2**63'."""
    torch.Generator().manual_seed(2 ** 63)          # the generator `fill_weights` seeds takes it
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import make_tiny_model
    finally:
        sys.path.pop(0)
    seen = []
    monkeypatch.setattr(make_tiny_model, "make", lambda out, arch, seed, *a, **k: seen.append(seed))
    try:
        make_tiny_model.main([str(tmp_path / "m"), "--seed", str(2 ** 63)])
    except SystemExit as e:
        pytest.fail(f"--seed 2**63 refused (exit {e.code})")
    assert seen == [2 ** 63]


# ---- 4. ERR_FRONTIER on a padded lane, by path -------------------------------------------------------------------
def _step_with_a_padded_lane(how, pad_frontier):
    """A decode step of bucket 2 (one live request to 11 tokens, one padded lane on row 1) at W=4, page size 4, the
    padding row's frontier `pad_frontier`; (frontiers after, the error check_integrity raises or None)."""
    from test_review26_deferred import step_by_path
    a, _, frontiers, _ = step_by_path(how, {1: pad_frontier}, bucket=2, window=4)
    try:
        a.check_integrity()
        err = None
    except HwkvError as e:
        err = f"{type(e).__name__}: {e}"
    return frontiers.tolist(), err


def test_a_padded_lanes_frontier_is_judged_alike_by_every_step_path():
    """Expected: the three paths of one step record the same thing. Actual: torch and the Triton three launches
    raise "request row 1's release frontier is negative or not a multiple of page_size 4" (the pad row), the
    one-launch alloc_step records nothing."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("Triton kernels on CPU tensors need TRITON_INTERPRET=1")
    got = {how: _step_with_a_padded_lane(how, 2) for how in ("torch", "triton three launches", "triton one launch")}
    assert got["torch"][0] == [4, 2]
    assert len({g[1] for g in got.values()}) == 1, got
