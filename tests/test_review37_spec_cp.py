"""Review 37: speculative decoding and context parallelism (hwkv.spec, hwkv.graph's tree verify, hwkv.distributed).
Every test here fails on the current code and shows one defect.

What held under review (not re-reported): accept_draft_tokens over ~300 random batches (page sizes 1/2/4, immediate
and deferred, chain and tree paths, 0..5 drafts) keeps exactly the accepted K/V at their final positions in both
pool groups, clears the rest of the row and leaks nothing; ~300 harness runs (TorchCPUBackend, W 1..8, one or two
windows, page sizes 1/2/4, tree_verify extend/decode/auto, prefixes of 0 included) of random tree verifies with
random accepted paths, then release, multi-step drafts and decodes, eager and through GraphRunner(tree=True) and
DraftGraphRunner, all equal to hwkv.reference with nothing leaked; cp_allgather_and_save_kv over one gloo rank
with non-contiguous, bf16/fp16, empty and grad-requiring K/V.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hwkv.distributed import CPShards
from hwkv.errors import ConfigError, LocError, ShapeError
from hwkv.spec import DraftTree, accept_draft_tokens
from test_accept_draft import Setup, kv_state
from test_review19_cli import world_of_one  # noqa: F401 (a fixture)
from test_spec_refusals import VERIFY, assert_unchanged, harness, snapshot

pytestmark = pytest.mark.usefixtures("one_thread")
I64 = torch.int64


def _accept_args(s: Setup, **change) -> dict:
    """Good arguments of an accept over `Setup`'s two requests (request 0 keeps drafts 0 and 1, request 1 draft 0)."""
    args = dict(prefix_lens=s.prefix, accept_index=torch.tensor([[0, 1, 0, 0], [0, 1, 0, 0]]),
                accept_lens=torch.tensor([2, 1]), prefix_lens_cpu=s.prefix, accept_lens_cpu=torch.tensor([2, 1]))
    args.update(change)
    return args


# ---- 1. host copies that disagree with the tensors they stand for ----------------------------------------------
@pytest.mark.parametrize("page, change, name", [
    (1, dict(accept_lens=torch.tensor([2, 2]), accept_lens_cpu=torch.tensor([1, 1])), "accept_lens"),
    (4, dict(prefix_lens_cpu=torch.tensor([1, 6])), "prefix_lens"),
], ids=["accept_lens", "prefix_lens"])
def test_accept_refuses_host_lengths_that_disagree_with_the_tensors_on_the_cpu(page, change, name):
    """accept_draft_tokens sizes the frees from the host copies and the kept slots from the tensors, never compared."""
    # spec.py:408 reads prefix_lens_cpu / accept_lens_cpu and never compares them with prefix_lens / accept_lens, whose
    # values are free to read on the CPU (the allocator's own host copies are compared: "LocError: prefix_lens[i] is
    # .. but its host copy holds ..", hwkv/allocator.py:63). At page size 1 `rejected` (from accept_lens_cpu) frees a
    # slot the row (from accept_lens) still names; at page size 4 `new_end` (from prefix_lens_cpu) frees the page
    # holding the prefix's last tokens. Nothing is raised: the finish of those requests then raises DoubleFreeError
    # (and the freed slots can be handed to another request first). Expected: a typed error naming the argument,
    # before anything changes.
    s = Setup(page, immediate=True)
    snap, kv = s.snapshot(), kv_state(s)
    with pytest.raises((ShapeError, LocError), match=name):
        accept_draft_tokens(s.a, s.pool, s.rtt.req_to_token, s.rows, **_accept_args(s, **change))
    assert s.unchanged(snap) and all(torch.equal(a, b) for a, b in zip(kv, kv_state(s)))


# ---- 2. a 0-d req_pool_indices -------------------------------------------------------------------------------------
def test_accept_refuses_a_0d_request_row_tensor_with_a_shape_error():
    """accept_draft_tokens(req_pool_indices=torch.tensor(row)) raises a bare IndexError, not a typed error."""
    # spec.py:394 `bs = int(req_pool_indices.shape[0])` on a 0-d tensor: IndexError "tuple index out of range".
    # Expected: ShapeError naming req_pool_indices' shape (as the 2-D [bs, 1] form is refused), nothing changed.
    s = Setup(4, immediate=True)
    snap = s.snapshot()
    args = _accept_args(s, prefix_lens=s.prefix[:1], prefix_lens_cpu=s.prefix[:1],
                        accept_index=torch.tensor([[0, 1, 0, 0]]), accept_lens=torch.tensor([2]),
                        accept_lens_cpu=torch.tensor([2]))
    with pytest.raises(ShapeError, match="req_pool_indices"):
        accept_draft_tokens(s.a, s.pool, s.rtt.req_to_token, s.rows[0], **args)
    assert s.unchanged(snap)


# ---- 3. accept arguments on another device ---------------------------------------------------------------------
@pytest.mark.parametrize("field", ["req_pool_indices", "prefix_lens", "accept_index", "accept_lens", "frontiers"])
def test_accept_refuses_an_argument_on_another_device_with_a_typed_error(field):
    """accept_draft_tokens checks no argument's device: bare RuntimeError/NotImplementedError, or a false error."""
    # _check_accept_args (spec.py:379) checks types, dtypes and shapes but not devices (the metadata steps refuse such
    # a batch with a LocError naming the field, hwkv/batch.py:119). A meta tensor (standing for another device here,
    # as in docs/bad-inputs.md #252) fails in torch.where / .cpu() with a bare RuntimeError or NotImplementedError; a
    # meta req_pool_indices is read as rows of no slot and reported as "DoubleFreeError: ... drafts were already
    # accepted (accept_draft_tokens applied twice?)", which is false. On a GPU an accept_index built on the host beside
    # device lengths fails the same way. Expected: a LocError/ShapeError naming the argument, nothing changed.
    s = Setup(4, immediate=True)
    good = dict(req_pool_indices=s.rows, prefix_lens=s.prefix, accept_index=torch.tensor([[0, 1, 0, 0], [0, 0, 0, 0]]),
                accept_lens=torch.tensor([2, 1]), frontiers=torch.zeros(2, dtype=I64))
    good[field] = good[field].to("meta")
    rows = good.pop("req_pool_indices")
    snap, kv = s.snapshot(), kv_state(s)
    with pytest.raises((LocError, ShapeError), match=field):
        accept_draft_tokens(s.a, s.pool, s.rtt.req_to_token, rows, **good, prefix_lens_cpu=s.prefix,
                            accept_lens_cpu=torch.tensor([2, 1]))
    assert s.unchanged(snap) and all(torch.equal(a, b) for a, b in zip(kv, kv_state(s)))


# ---- 4. a graph tree verify takes a DraftTree the eager step refuses -------------------------------------------
def _meta_mask(tree: DraftTree) -> DraftTree:
    return DraftTree(tree.mask.to("meta"))


def _column_mask(tree: DraftTree) -> DraftTree:
    tree.mask = tree.mask.view(-1, 1)   # (a mutable dataclass: set after construction, as check_draft_tree says)
    return tree


@pytest.mark.parametrize("spoil", [_meta_mask, _column_mask], ids=["mask on meta", "2-D mask set later"])
def test_graph_tree_verify_refuses_what_the_eager_step_refuses_before_any_static_buffer_changes(spoil):
    """GraphRunner(tree=True).prepare stages the batch, then fails copying a bad DraftTree.mask with a bare error."""
    # The eager step refuses both trees (TreePlanner.check, hwkv/spec_plan.py:58-61: "DraftTree.mask lives on meta, the
    # pool on cpu" / check_draft_tree's "must be a 1-D bool tensor"). GraphRunner.prepare (hwkv/graph.py:293-330) only
    # compares the mask's length, copies the batch into its static buffers, then `self.tree_mask[...].copy_(tree.mask)`
    # raises NotImplementedError "Cannot copy out of meta tensor" / RuntimeError "output with shape [8] doesn't match
    # the broadcast shape [8, 8]" with the static batch already overwritten. Expected: the eager step's typed error
    # (ShapeError) before any static buffer changes.
    h, rids = harness()
    runner = h.enable_graphs([2], mode=VERIFY, tokens_per_req=2, tree=True)
    batch, inputs = h.prepare(rids, [2, 2], VERIFY)
    batch.spec_info = spoil(DraftTree.from_parents([[-1, 0], [-1, -1]]))
    with pytest.raises(ShapeError):
        h.backend.init_forward_metadata(batch)   # the eager step's refusal
    before = snapshot(h, runner)
    with pytest.raises(ShapeError, match="DraftTree.mask"):
        runner.prepare(batch, inputs)
    assert_unchanged(h, before, runner)


# ---- 5. DraftTree.from_parents of one request's list -------------------------------------------------------------
@pytest.mark.parametrize("parents", [[-1, 0], [[-1, 0], None]], ids=["one tree, no outer list", "None tree"])
def test_from_parents_refuses_what_is_no_list_of_parent_lists_with_a_shape_error(parents):
    """DraftTree.from_parents([-1, 0]) (one request's parents, the outer list forgotten) raises a bare TypeError."""
    # spec.py:84 `n = len(par)` on an int (or None): TypeError "object of type 'int' has no len()". Bad parent
    # values are refused with a ShapeError (docs/bad-inputs.md #92). Expected: ShapeError naming what was given.
    with pytest.raises(ShapeError):
        DraftTree.from_parents(parents)


# ---- 6. CPShards' on/off field --------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["no", 1])
def test_cpshards_refuses_a_check_ranks_that_is_no_bool(value):
    """CPShards(check_ranks="no") is accepted and read as on: its layer calls run a collective the peers' do not."""
    # distributed.py:103 __post_init__ checks sizes, rank and row_index, not check_ranks; cp_allgather_and_save_kv
    # (distributed.py:241) reads `shards.check_ranks` by truth, so "no" runs the per-layer agreement (an extra
    # collective the other ranks, built with False, do not issue). Every other on/off option is refused when it is no
    # bool (cp_plan's check_ranks included: docs/bad-inputs.md #145, #240). Expected: ConfigError naming it.
    with pytest.raises(ConfigError, match="check_ranks"):
        CPShards(0, (3,), check_ranks=value)


# ---- 7. CPShards of numpy integers -------------------------------------------------------------------------------
@pytest.mark.parametrize("rank, sizes", [(np.int64(0), (3, 2)), (0, (np.int64(3), np.int64(2)))],
                         ids=["numpy rank", "numpy sizes"])
def test_cpshards_takes_numpy_integers_as_ints(rank, sizes):
    """CPShards refuses numpy integers, claiming "rank np.int64(0) is outside [0, 2)" (false) / "sizes must be ints"."""
    # distributed.py:105-107 test `cpc.is_int` (Python ints only), while the core's integer rule (`as_int`) takes
    # numpy and 0-d tensor integers everywhere else (MultiStepDraft, draft_steps, windows, batch sizes, reserve:
    # docs/bad-inputs.md #141, #160, #166, #174, #180); shard sizes computed with numpy (np.diff of offsets,
    # np.array_split) are refused, and a numpy rank 0 of 2 is reported outside [0, 2). Expected: taken as ints.
    shards = CPShards(rank, sizes)
    assert (shards.rank, shards.sizes, shards.local_size, shards.offsets) == (0, (3, 2), 3, (0, 3, 5))
    assert type(shards.rank) is int and all(type(s) is int for s in shards.sizes)


def test_cp_plan_takes_numpy_integer_counts(world_of_one):
    """cp_plan(np.int64(5)) was refused as "another type", as were numpy local counts; the core takes numpy ints."""
    from hwkv.distributed import cp_plan
    plan = cp_plan(np.int64(5), np.int64(5))
    assert plan.sizes == (5,) and type(plan.sizes[0]) is int
