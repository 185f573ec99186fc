"""NPU fused attention for extend-like forwards whose longest request has one new token (a one-token prompt, a
prefix-cache hit recomputing only the last token, a chunked prefill with one token left, one-token verify /
draft-extend graphs). With a query length of 1 torch_npu's fused infer attention runs its incremental
branch: sparse_mode / pre_tokens / next_tokens are ignored and the mask must be [B, (1, 1,) KV_S]. hwkv_npu
runs such a forward in the decode call form (window lists trimmed, head mask on the first page), checked
against hwkv.reference through the torch_npu stand-in (the `npu_standin` fixture of conftest.py)."""
import pytest
import torch

from hwkv.batch import ForwardMode
from hwkv.testing.harness import Harness, ModelGeometry

from hwkv_npu.backend import NPUBackend

W = 20
GEO = ModelGeometry(num_layers=2, swa_every=2, window=W, num_heads=4, num_kv_heads=2, head_dim=16)
# prefixes below, at and above W; 59 and 149 start the window mid-page (the head mask matters), 299 on page 2
PREFIXES = (9, 19, 59, 149, 299)


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _harness(page_size):
    h = Harness(NPUBackend, "cpu", GEO, size=4096, size_swa=2048, page_size=page_size, dtype=torch.float16)
    assert h.backend.fused_reason is None
    return h


def _one_row_calls(mod):
    return [c for c in mod.npu_fused_infer_attention_score.calls + mod.npu_fused_infer_attention_score.out.calls
            if c["query"].shape[1] == 1]


def _assert_decode_form(calls):
    assert calls
    for c in calls:
        m = c["atten_mask"]
        assert m is None or (m.shape[0] == c["query"].shape[0] and m.dim() == 4 and m.shape[1:3] == (1, 1))


@pytest.mark.parametrize("page_size", [128, 16])
def test_one_token_extend_runs_the_decode_form_eagerly(npu_standin, page_size):
    """Eager EXTEND / MIXED forwards of one token per request (after prefixes below / at / above W, and one-token
    prompts), every layer checked against the reference inside `h.forward`, all through the fused op."""
    mod = npu_standin.mod
    h = _harness(page_size)
    rids = [h.add_request() for _ in PREFIXES]
    h.forward(rids, list(PREFIXES), ForwardMode.EXTEND)
    h.release()
    for mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
        before = len(_one_row_calls(mod))
        h.forward(rids, [1] * len(rids), mode)  # recompute / last chunk: the query sits at seq_len - 1
        h.release()
        calls = _one_row_calls(mod)[before:]
        assert len(calls) == 2, "both layers (full and SWA) through the fused op"
        _assert_decode_form(calls)
        assert any(c["atten_mask"] is not None for c in calls), "the SWA layer masks its first page's head"
    fresh = [h.add_request() for _ in range(2)]
    before = len(_one_row_calls(mod))
    h.forward(fresh, [1, 1], ForwardMode.EXTEND)  # one-token prompts
    h.forward(fresh[:1], [1], ForwardMode.EXTEND)
    _assert_decode_form(_one_row_calls(mod)[before:])


@pytest.mark.parametrize("mode,tree", [(ForwardMode.TARGET_VERIFY, False), (ForwardMode.TARGET_VERIFY, True),
                                       (ForwardMode.DRAFT_EXTEND, False)],
                         ids=["verify", "verify-tree", "draft-extend"])
def test_one_token_graphs_run_the_decode_form(npu_standin, mode, tree):
    """Graphs of one token per request: the captured task groups take the decode form and are updated per
    replay with each forward's lengths and head masks (checked against the reference inside `h.forward`)."""
    h = _harness(128)
    h.enable_graphs([1, 2, 4], npu_standin.graphs(), mode=mode, tokens_per_req=1, tree=tree)
    rids = [h.add_request() for _ in range(4)]
    h.forward(rids, [9, 19, 59, 149], ForwardMode.EXTEND)
    h.release()
    for step in range(4):
        n = 2 + step % 3
        h.forward(rids[:n], [1] * n, mode)
        h.release()
    assert h.runner.replays == 4
    _assert_decode_form(npu_standin.mod.npu_fused_infer_attention_score.out.calls)
