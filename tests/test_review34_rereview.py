"""Re-review of review 34's fixes (a2b7c8a): graph-refill length checks, dense tree masks and bool flags, staging
events. Every test here fails on a2b7c8a and shows one defect the fixes introduced or left open.

What held under re-review (not re-reported): `_check_graph_lens`'s new refusals (extend lengths that miss the write
locs; `max_q_len` below a host-known extend) fire before any static buffer, the write-loc translation buffer, pool or
allocator changes, and can never fire for GraphRunner / DraftGraphRunner / DecodeStepGraph / VerifyStepGraph: their
static batches always carry `tpr` new tokens a request (host copies and device tensors alike), padded rows included,
and `max_q_len` is that same `tpr`. CapacityError matches `check_fits` and `_check_graph_context`. `_first_write_locs`
matches the eager step for zero-token rows first, in the middle, last, all of them (torch and fused Triton refills),
decode batches and GraphRunner padding (slot 0). No caller in the repository passes a numpy bool or 0/1 to
`chain` / `writes_swa`.
"""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from hwkv.batch import ForwardMode  # noqa: E402
from hwkv.errors import ShapeError  # noqa: E402
from hwkv.spec import DraftTree  # noqa: E402
from hwkv.staging import record_on  # noqa: E402
from test_review34_cp_spec import two_requests_with_trees  # noqa: E402
from hwkv.testing.harness import Harness, ModelGeometry  # noqa: E402
from hwkv.testing.reference_backend import ReferenceBackend  # noqa: E402
from hwkv_cpu.backend import TorchCPUBackend  # noqa: E402

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("one_thread")]


def _kv(h):
    return [b.clone() for l in h.layers for b in h.pool.get_kv_buffer(l.layer_id)]


# ---- 1. a DraftTree whose mask is reassigned to a strided view: refused after the K/V store ----------------------

def test_a_draft_tree_mask_reassigned_to_a_strided_view_is_refused_before_any_kv_store():
    """`DraftTree` is a mutable dataclass; the fix checks the stride only in `DraftTree.__post_init__` and in
    `check_tree_mask`, which the extend kernels call after the layer stored its K/V (hwkv/backend.py forward:
    `set_kv_buffer` then `forward_extend`). A tree whose `.mask` is reassigned after construction (an engine reusing
    its DraftTree per step) passes `TreePlanner.check` and the metadata step, and layer 0 then stores its K/V before
    the kernel raises `tree.mask has stride 2`: the pool changed under a refused forward. On the CPU backend this is a
    regression: before a2b7c8a it read the strided mask by its values and ran exactly.
    Expected: the metadata step refuses the strided mask before anything is written (TreePlanner.check, as it checks
    the mask's device and length; or a frozen DraftTree), or the forward runs exactly, as before the fix. (The backend
    re-checks `layer.sinks` per forward for the same reason: "a caller may assign another tensor since".)"""
    h, rids, n, good, strided = two_requests_with_trees(TorchCPUBackend)
    batch = h.make_batch(rids, [n, n], ForwardMode.TARGET_VERIFY)
    tree = DraftTree(good.clone())
    tree.mask = strided          # the same values, stride 2
    batch.spec_info = tree
    kv = _kv(h)
    with pytest.raises(ShapeError, match="DraftTree.mask has stride 2"):   # the metadata step, before any store
        h.backend.init_forward_metadata(batch)
    assert all(torch.equal(a, b) for a, b in zip(kv, _kv(h))), "refused, but the pools changed"


# ---- 2. a verify graph replays ragged extend lengths it can read for free as tpr each ----------------------------

def test_verify_graph_refuses_ragged_extend_lens_on_the_host_without_host_copies():
    """`GraphRunner._check_tokens_per_request` (hwkv/graph.py) reads only `extend_seq_lens_cpu`, or the lengths
    themselves in debug mode; a CPU batch without the host copy whose `extend_seq_lens` are [1, 3] (sum 4 = 2 x tpr)
    is staged and replayed with the static batch's [2, 2]: silently wrong attention (~2 off the reference). The values
    are free to read here: `_check_lens_and_rows` reads `seq_lens` when it is on the host, and the refill's own
    `_check_graph_lens` reads `extend_seq_lens` where `values_checkable` (the CPU), but compares it with the static
    batch's tpr lengths, never the caller's. docs/architecture.md says the runner "cannot see it" without host copies
    or debug mode, which is not so on the CPU. The eager step runs this batch correctly.
    Expected: the ShapeError the runner gives with host copies ("graph mode needs 2 new token(s) per request"), before
    any static buffer changes, wherever the lengths are checkable (values_checkable), or exact outputs."""
    h = Harness(ReferenceBackend, geometry=ModelGeometry(), size=512, size_swa=128)
    runner = h.enable_graphs([2], mode=ForwardMode.TARGET_VERIFY, tokens_per_req=2)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [6, 9], ForwardMode.EXTEND)
    batch, inputs = h.prepare(rids, [1, 3], ForwardMode.TARGET_VERIFY)
    batch = dataclasses.replace(batch, extend_seq_lens_cpu=None)   # the lengths on the host, no separate copy
    assert batch.extend_seq_lens.is_cpu
    before = [t.clone() for t in (runner.req_pool_indices, runner.seq_lens, runner.out_cache_loc)]
    try:
        step = runner.prepare(batch, inputs)
    except ShapeError as e:
        assert "per request" in str(e), e
        assert all(torch.equal(a, b) for a, b in zip(before, (runner.req_pool_indices, runner.seq_lens,
                                                               runner.out_cache_loc)))
        return
    flat = runner.replay(step)
    h.complete(rids, [1, 3], inputs, flat)   # ReferenceMismatchError: replayed as [2, 2]


# ---- 3. record_on needs torch.accelerator (torch >= 2.6); the package declares torch >= 2.4 -----------------------

def test_record_on_works_on_every_torch_the_package_declares(monkeypatch):
    """`hwkv.staging.record_on` (new in a2b7c8a; used by `StagingRing.send`, i.e. every DecodeStepGraph /
    VerifyStepGraph / DraftStepGraph step, and by the engine's `ReadBack._event` after every forward) calls
    `torch.accelerator.current_stream(device)`. `torch.accelerator` first shipped in torch 2.6, while pyproject.toml
    declares `torch>=2.4` and the README says "other versions from 2.4 on are not excluded". On torch 2.4/2.5 with a GPU
    every engine forward and every whole-step graph step now raises AttributeError (before the fix it recorded
    `torch.Event(...).record()`, which those versions have). Simulated here: torch without `torch.accelerator`, and
    torch.cuda.current_stream(device) as 2.4/2.5 have it.
    Expected: the event recorded on cuda:1's current stream through an API every declared torch has (e.g.
    `torch.get_device_module(device).current_stream(device)`), or the declared floor raised to torch>=2.6."""
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    floor = tuple(int(x) for x in re.search(r'"torch>=(\d+)\.(\d+)', text).groups())
    if floor >= (2, 6):
        return   # the floor was raised: torch.accelerator is there on every declared version

    recorded = []

    class Event:
        def record(self, stream=None):
            recorded.append(stream)

    monkeypatch.delattr(torch, "accelerator")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("current stream of", torch.device(device)))
    record_on(Event(), torch.device("cuda", 1))
    assert recorded == [("current stream of", torch.device("cuda", 1))]
