"""Review 34: context parallelism and speculative-decoding planning (hwkv.distributed, hwkv.cp_checks, hwkv.spec,
hwkv.spec_plan, hwkv.draft). Every test here fails on the current code and shows one defect.

What held under review (not re-reported): cp_plan / cp_allgather_and_save_kv over 2 gloo ranks with K/V that require
grad and a plan made under inference_mode (pools equal one process's save, nothing joins autograd); ragged eager tree
verifies (0..5 drafts per request, random forests, W 1/3/5, page sizes 1/4) through the extend and decode-like
paths on the CPU and the Triton (interpreted) backends, and a strided tree
mask on the CPU backend (read by its values) against hwkv.reference; accept_draft_tokens of no request and
of no draft, immediate and deferred.
"""
from __future__ import annotations

import pytest
import torch

from hwkv import reference
from hwkv.batch import ForwardMode
from hwkv.errors import HwkvError, ShapeError
from hwkv.spec import DraftTree, MultiStepDraft, TreeMask, accept_draft_tokens, check_tree_mask, tree_visible
from hwkv.testing.harness import Harness, ModelGeometry
from conftest import triton_runs_cpu_tensors
from test_accept_draft import N, Setup, kv_state

pytestmark = pytest.mark.usefixtures("one_thread")
I64 = torch.int64


# ---- 1. a strided DraftTree.mask is read as if contiguous by the Triton extend kernel ---------------------------
def test_a_strided_draft_tree_mask_is_refused():
    """`DraftTree.__post_init__` (hwkv/spec.py:74-78) accepts any 1-D bool mask, a strided view included, and
    `build_tree_mask` hands it on as `TreeMask.mask` unchanged (hwkv/spec.py:160). The Triton extend kernel reads it
    by offset, `tl.load(tree_mask + tree_row + t)` after `tree.mask.view(torch.uint8)` (hwkv_cuda/kernels/extend.py:126,
    384), i.e. as if its stride were 1, and `check_tree_mask` (hwkv/spec.py:450) checks dtype, shape and device but not
    the stride: a verify whose mask is `big[::2]` (the same values as a contiguous mask) silently attends through the
    interleaved entries instead (errors ~1.4 against hwkv.reference here). The CPU backend reads the same mask by
    its values and is right, and the decode-like builder (hwkv_cuda/kernels/tree.py:137) refuses such a mask with a
    ShapeError only once the metadata step is under way.
    Expected: every backend attends by the mask's values (the tree made contiguous once, where it is built), or a
    strided mask is refused with a typed error when the DraftTree is made / the metadata step starts. The fix
    refuses it (DraftTree and check_tree_mask: a graph replays the address it captured, so no copy is made)."""
    triton_runs_cpu_tensors()   # (a GPU machine compiles the kernels, which then cannot read these CPU tensors)
    from hwkv_cuda.backend import TritonBackend  # on the CPU, its kernels in Triton's interpreter
    h, rids, n, good, strided = two_requests_with_trees(TritonBackend)
    assert torch.equal(strided, good) and not strided.is_contiguous()
    with pytest.raises(ShapeError, match="DraftTree.mask has stride 2; the kernels read a dense 1-D mask"):
        DraftTree(strided)
    tree = TreeMask(strided, torch.tensor([0, n * n, 2 * n * n], dtype=I64), torch.zeros(2 * n, dtype=I64))
    q = torch.zeros(2 * n, 2, 8)
    with pytest.raises(ShapeError, match="tree.mask has stride 2"):   # the kernel-facing form too
        check_tree_mask(tree, q, torch.tensor([0, n, 2 * n]), torch.tensor([6, 9]))
    prefix = [h.requests[r].seq_len for r in rids]
    batch = h.make_batch(rids, [n, n], ForwardMode.TARGET_VERIFY)   # the mask made dense: exact
    batch.spec_info = DraftTree(strided.contiguous())
    inputs = h.random_inputs(batch.num_tokens)
    outs = h.split_outputs(h.step(batch, inputs))
    h._record(rids, [n, n], inputs)
    blocks = good.view(2, n, n)
    for layer, out in zip(h.layers, outs):
        i = layer.layer_id
        for b, rid in enumerate(rids):
            r, p = h.requests[rid], prefix[b]
            see, q_pos = tree_visible(p, blocks[b], layer.window)
            ref = reference.attention(inputs[f"q{i}"][b * n:(b + 1) * n].float(), torch.cat(r.k[i]), torch.cat(r.v[i]),
                                      q_pos, torch.arange(p + n, device="cpu"), layer.scaling, layer.window,
                                      layer.logit_cap, None, mask=see)
            err = (out[b * n:(b + 1) * n] - ref).abs().max().item()
            assert err < 1e-4, f"triton: layer {i} request {b}: |out - reference| = {err}"


def two_requests_with_trees(factory) -> tuple:
    """Two requests (6 and 9 tokens) prefilled on `factory`'s backend (2 layers, one of them SWA with W=4), and a
    4-draft tree a request: (harness, rids, drafts a request, the trees' dense mask, the same values at stride 2)."""
    geom = ModelGeometry(num_layers=2, swa_every=2, window=4, num_heads=2, num_kv_heads=1, head_dim=8)
    h = Harness(factory, "cpu", geom, size=256, size_swa=128, page_size=1, max_reqs=4, max_context_len=32)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [6, 9], ForwardMode.EXTEND)
    good = DraftTree.from_parents([[-1, 0, 0, 1], [-1, -1, 1, 2]]).mask
    big = torch.ones(2 * good.numel(), dtype=torch.bool, device="cpu")
    big[::2] = good
    return h, rids, 4, good, big[::2]


# ---- 2. the speculative API's on/off options take any truthy value ------------------------------------------------
def test_accept_chain_that_is_no_bool_is_refused_not_read_as_on():
    """`accept_draft_tokens(..., chain=)` (hwkv/spec.py:279, read at 323 and 367) reads `chain` by truthiness: a
    caller's chain="no" (or 1, or a tensor) is read as on. In deferred mode (the device's; `allocator.immediate =
    False`) nothing checks the word, so an accept of the tree path [0, 2] with page size 4 moves no K/V: position
    prefix + 1 keeps draft 1's K/V, while its row says the request's token there is draft 2. The project's rule for
    on/off options (`hwkv.checks.check_flag`: "a truthy 'no' or 1 would read as on"; check_ranks, prefix_cache,
    overlap, save_kv_cache, with_swa follow it) is a ConfigError naming the option before anything changes.
    Expected: a typed refusal with the pools, rows and allocator unchanged (or, at the least, the accepted drafts'
    K/V at their final positions)."""
    s = Setup(4, immediate=False)
    drafts = s.rtt.req_to_token[s.rows[0], 5:5 + N].clone()
    for b in (*s.pool.full_kv_pool.k_buffer, *s.pool.swa_kv_pool.k_buffer):  # distinct K per slot
        b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(0)))
    want_k = [b[drafts[2]].clone() for b in s.pool.full_kv_pool.k_buffer]  # draft 2's K, bound for position 6
    snap, kv = s.snapshot(), kv_state(s)
    idx = torch.tensor([[0, 2, 0, 0], [1, 0, 0, 0]], dtype=I64)
    lens = torch.tensor([2, 1], dtype=I64)
    try:
        accept_draft_tokens(s.a, s.pool, s.rtt.req_to_token, s.rows, s.prefix, idx, lens, prefix_lens_cpu=s.prefix,
                            accept_lens_cpu=lens, chain="no")
    except HwkvError as e:
        assert "chain" in str(e), e
        assert s.unchanged(snap) and all(torch.equal(a, b) for a, b in zip(kv, kv_state(s)))
        return
    pos6 = int(s.rtt.req_to_token[s.rows[0], 6])
    got = [b[pos6] for b in s.pool.full_kv_pool.k_buffer]
    assert all(torch.equal(g, w) for g, w in zip(got, want_k)), \
        "chain='no' was read as chain=True: position 6 holds draft 1's K, not the accepted draft 2's"


@pytest.mark.parametrize("make", [
    pytest.param(lambda: MultiStepDraft(3, writes_swa="no"), id="MultiStepDraft.writes_swa"),
    pytest.param(lambda: DraftTree(torch.ones(1, dtype=torch.bool, device="cpu"), chain="no"), id="DraftTree.chain"),
])
def test_speculative_on_off_options_that_are_no_bool_are_refused(make):
    """`MultiStepDraft.writes_swa` (hwkv/spec.py:43-47, read by truthiness in hwkv/draft.py:101, 184, 250) and
    `DraftTree.chain` (hwkv/spec.py:72-78, read in hwkv/spec_plan.py:106) take any value: writes_swa="no" is read
    as on (the draft translates its write locs and builds every window list, and `DraftGraphRunner(...,
    writes_swa="no")` captures it so), chain="no" as a chain. Their `__post_init__`s check num_steps and the mask but
    not the flags. Expected (hwkv.checks.check_flag's rule for on/off options): a typed error naming the option."""
    with pytest.raises(HwkvError, match=r"writes_swa|chain"):
        make()
