"""Speculative metadata refuses a bad batch with a typed error naming the value and the limit, before anything
changes: a multi-step draft (or an unknown spec_info) handed to the plain metadata step, draft lengths or rows
outside req_to_token (eager and graph), a draft runner's missing or mis-shaped input, a verify tree of the wrong
size in graph mode. Pools, the full-to-SWA mapping, req_to_token, the allocator and every static buffer (the
backend's, the draft graph state's, the runner's batch) are compared before and after."""
import dataclasses

import pytest
import torch

from hwkv.allocator import same_snapshot
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.errors import ConfigError, LocError, ShapeError
from hwkv.graph import EagerAdapter
from hwkv.spec import DraftTree, MultiStepDraft
from hwkv.testing.harness import Harness, ModelGeometry
from hwkv.testing.spec_harness import draft_batch, draft_graphs
from hwkv_cpu.backend import TorchCPUBackend

pytestmark = pytest.mark.usefixtures("one_thread")

GEOM = ModelGeometry(num_layers=2, swa_every=2, window=4, num_heads=2, num_kv_heads=1, head_dim=8)
CTX, ROWS = 16, 16
DEC, VERIFY = ForwardMode.DECODE, ForwardMode.TARGET_VERIFY
t = torch.tensor


def harness():
    """Two requests (rows 0 and 1) of 6 and 9 prefilled tokens over a small SWA pool, rows of CTX = 16."""
    h = Harness(TorchCPUBackend, "cpu", GEOM, size=256, size_swa=64, page_size=1, max_reqs=ROWS, max_context_len=CTX)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [6, 9], ForwardMode.EXTEND)
    return h, rids


def _tensors(obj):
    """Every tensor inside a (dataclass / dict / list) state object, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for k in sorted(obj, key=repr):
            yield from _tensors(obj[k])
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name))


def snapshot(h, runner=None):
    """Pools, mapping, req_to_token, allocator, the backend's graph and draft-graph buffers, the runner's batch."""
    be = h.backend
    state = [h.pool.get_key_buffer(l.layer_id) for l in h.layers] + [h.pool.get_value_buffer(l.layer_id)
                                                                     for l in h.layers]
    state += [h.pool.full_to_swa_index_mapping, h.rtt.req_to_token, be.loc_cache.buffer]
    state += list(_tensors(be.static)) + list(_tensors(be.draft_static))
    if be.tree_planner._tree_static is not None:
        state += list(be.tree_planner._tree_static)
    if runner is not None:
        state += [runner.req_pool_indices, runner.seq_lens, runner.seq_lens_cpu, runner.out_cache_loc,
                  *runner.inputs.values()]
    return [x.clone() for x in state if x is not None], h.allocator.integrity_snapshot()


def assert_unchanged(h, before, runner=None):
    tensors, alloc = snapshot(h, runner)
    changed = [i for i, (a, b) in enumerate(zip(before[0], tensors)) if not torch.equal(a, b)]
    assert len(tensors) == len(before[0]) and not changed, f"state tensors {changed} changed"
    assert same_snapshot(before[1], alloc), "the allocator changed"
    h.allocator.check_integrity()


def draft(rows, seq, steps=3, loc=None):
    """A MultiStepDraft DECODE batch with host lengths; write locs 1.. unless given."""
    bs = len(seq)
    loc = torch.arange(1, bs * steps + 1) if loc is None else loc
    return ForwardBatch(DEC, bs, t(rows), t(seq), loc, spec_info=MultiStepDraft(steps), seq_lens_cpu=t(seq))


# ---- D2: the plain metadata step takes no multi-step draft and no unknown spec_info ----------------------------
@pytest.mark.parametrize("graph", [False, True])
def test_a_multi_step_draft_is_refused_by_the_plain_metadata_step(graph):
    h, rids = harness()
    be = h.backend
    if graph:
        be.init_graph_state(2, 6)
    batch = draft_batch(h, rids, 3)                       # 2 requests x 3 steps = 6 write locs
    before = snapshot(h)
    with pytest.raises(ConfigError, match="MultiStepDraft batch runs through init_draft_metadata"):
        be.init_forward_metadata_graph(batch) if graph else be.init_forward_metadata(batch)
    assert_unchanged(h, before)
    be.init_draft_metadata(batch)                         # where it belongs


@pytest.mark.parametrize("graph", [False, True])
def test_an_unknown_spec_info_is_refused(graph):
    h, rids = harness()
    be = h.backend
    if graph:
        be.init_graph_state(2, 6)
    batch = dataclasses.replace(h.make_batch(rids, [1, 1], DEC), spec_info={"tree": None})
    before = snapshot(h)
    with pytest.raises(ConfigError, match=r"spec_info is a dict.*DraftTree"):
        be.init_forward_metadata_graph(batch) if graph else be.init_forward_metadata(batch)
    assert_unchanged(h, before)


def test_a_tree_outside_a_verify_is_refused_in_graph_mode_too():
    h, rids = harness()
    be = h.backend
    be.init_graph_state(2, 6)
    batch = dataclasses.replace(h.make_batch(rids, [1, 1], DEC), spec_info=DraftTree.from_parents([[-1], [-1]]))
    before = snapshot(h)
    with pytest.raises(ConfigError, match="DraftTree belongs to a TARGET_VERIFY forward, not DECODE"):
        be.init_forward_metadata_graph(batch)
    assert_unchanged(h, before)


# ---- D5: a verify tree of the wrong size is refused before the graph buffers are refilled ------------------------
def test_a_graph_verify_tree_of_the_wrong_size_changes_no_static_buffer():
    h, rids = harness()
    be = h.backend
    be.init_graph_state(2, 10)
    good = h.make_batch(rids, [3, 3], VERIFY)
    good.spec_info = DraftTree.from_parents([[-1, 0, 0], [-1, 0, 1]])
    be.init_forward_metadata_graph(good, max_q_len=3)
    bad = ForwardBatch(VERIFY, 2, good.req_pool_indices, good.seq_lens + 3, good.out_cache_loc + 100,
                       good.extend_prefix_lens, good.extend_seq_lens,
                       spec_info=DraftTree.from_parents([[-1, 0, 0]]))   # one request's tree for two
    before = snapshot(h)
    with pytest.raises(ShapeError, match="DraftTree.mask has 9 entries; 2 requests of 3 draft tokens need 18"):
        be.init_forward_metadata_graph(bad, max_q_len=3)
    assert_unchanged(h, before)


@pytest.mark.parametrize("host_copy", [True, False], ids=["host lengths", "device lengths"])
def test_a_graph_verify_tree_over_ragged_draft_counts_is_refused_before_the_refill(host_copy):
    """Extend lengths [2, 3] with a mask of 8 entries: bs * per^2 = 2 * 2^2 passes the static size check, but the
    draft counts need sum(n^2) = 13 (as the eager step says). With the host copy the exact check runs; without it
    the lengths are read where values are checkable (CPU) and must all equal tokens // batch."""
    h, rids = harness()
    be = h.backend
    be.init_graph_state(2, 8)
    good = h.make_batch(rids, [3, 3], VERIFY)
    good.spec_info = DraftTree.from_parents([[-1, 0, 0], [-1, 0, 1]])
    be.init_forward_metadata_graph(good, max_q_len=3)     # what a captured graph's buffers hold
    bad = h.make_batch(rids, [2, 3], VERIFY)
    bad.spec_info = DraftTree.from_parents([[-1, 0], [-1, 0]])
    if not host_copy:
        bad = dataclasses.replace(bad, extend_seq_lens_cpu=None, seq_lens_cpu=None)
    match = (r"DraftTree.mask has 8 entries; the draft tokens per request \[2, 3\] need sum\(n\^2\) = 13" if host_copy
             else r"a graph verify takes equal draft counts per request: extend_seq_lens are \[2, 3\], 5 tokens "
                  r"over 2 requests")
    before = snapshot(h)
    with pytest.raises(ShapeError, match=match):
        be.init_forward_metadata_graph(bad)
    assert_unchanged(h, before)


# ---- D3: draft lengths and rows, eager and graph ----------------------------------------------------------------
BAD_DRAFTS = [
    ("last step past the row", dict(seq=[7, 15]), ShapeError, r"seq_lens\[1\] is 15.*3 draft steps.*17.*16"),
    ("length past the row", dict(seq=[7, 17]), ShapeError, r"seq_lens\[1\] is 17.*\[1, 16\]"),
    ("length 0", dict(seq=[0, 10]), ShapeError, r"seq_lens\[0\] is 0.*\[1, 16\]"),
    ("row past the table", dict(rows=[0, 99]), LocError, r"req_pool_indices.*\[0, 99\].*\[0, 16\)"),
    ("negative row", dict(rows=[0, -1]), LocError, r"req_pool_indices.*\[-1, 0\].*\[0, 16\)"),
]


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("what, change, error, match", BAD_DRAFTS, ids=[c[0] for c in BAD_DRAFTS])
def test_draft_lengths_and_rows_are_checked_before_anything_is_built(graph, what, change, error, match):
    h, rids = harness()
    be = h.backend
    if graph:
        be.init_draft_graph_state(2, 3)
    args = dict(rows=rids, seq=[7, 10])
    args.update(change)
    batch = draft(**args)
    before = snapshot(h)
    with pytest.raises(error, match=match):
        be.init_draft_metadata_graph(batch) if graph else be.init_draft_metadata(batch)
    assert_unchanged(h, before)
    edge = draft(rids, [7, CTX - 2])   # the bound is inclusive: a last step of length max_context_len runs
    assert len(be.init_draft_metadata_graph(edge) if graph else be.init_draft_metadata(edge)) == 3


def test_graph_draft_lengths_are_checked_on_the_device_values_where_no_host_copy_is_given():
    """Without seq_lens_cpu the graph step reads the lengths where values are checkable (CPU): no new sync."""
    h, rids = harness()
    be = h.backend
    be.init_draft_graph_state(2, 3)
    batch = dataclasses.replace(draft(rids, [7, 15]), seq_lens_cpu=None)
    before = snapshot(h)
    with pytest.raises(ShapeError, match=r"seq_lens\[1\] is 15"):
        be.init_draft_metadata_graph(batch)
    assert_unchanged(h, before)


# ---- D4: a draft runner checks its inputs before its first copy --------------------------------------------------
@pytest.mark.parametrize("what", ["missing", "short", "wrong shape"])
def test_a_draft_runner_refuses_a_bad_input_before_touching_its_static_batch(what):
    h, rids = harness()
    runner = draft_graphs(h, [2], EagerAdapter(), 2)
    runner.run(draft_batch(h, rids, 2), h.random_inputs(4))   # one good replay
    h.release()
    batch = draft_batch(h, rids[::-1], 2)
    inputs = h.random_inputs(4)
    if what == "missing":
        del inputs["q0"]
    elif what == "short":
        inputs["q0"] = inputs["q0"][:3]
    else:
        inputs["q0"] = torch.zeros(4, 2, 7)
    before = snapshot(h, runner)
    with pytest.raises(ShapeError, match=r"input 'q0' must be \[4, 2, 8\] \(step-major\)"):
        runner.run(batch, inputs)
    assert_unchanged(h, before, runner)


def test_a_bad_max_q_len_is_refused_before_the_graph_refill():
    h, rids = harness()
    be = h.backend
    be.init_graph_state(2, 10)
    good = h.make_batch(rids, [3, 3], VERIFY)
    be.init_forward_metadata_graph(good, max_q_len=3)
    bad = ForwardBatch(VERIFY, 2, good.req_pool_indices, good.seq_lens + 3, good.out_cache_loc + 100,
                       good.extend_prefix_lens, good.extend_seq_lens)
    before = snapshot(h)
    with pytest.raises(ConfigError, match="max_q_len=0 must be an int >= 1"):
        be.init_forward_metadata_graph(bad, max_q_len=0)
    assert_unchanged(h, before)


# ---- DraftTree.from_parents: a parent is -1 or an earlier token's index ---------------------------------------
@pytest.mark.parametrize("parents", [[-1, -2], [-1, 0, 3], [-1, 1], [-1, 0.0], [-1, True], [-1, None]])
def test_from_parents_refuses_what_is_no_parent(parents):
    """Any negative parent other than -1 had made a silent forest (an engine's off-by-one); a float or bool parent
    is no index either."""
    with pytest.raises(ShapeError, match=r"draft token 1|draft token 2"):
        DraftTree.from_parents([parents])


def test_from_parents_takes_numpy_and_tensor_integers():
    import numpy as np

    want = DraftTree.from_parents([[-1, 0, 0, 1]]).mask
    tensor = torch.tensor([-1, 0, 0, 1])
    for par in ([-1, np.int64(0), np.int32(0), 1], tensor.tolist(), list(tensor)):  # list(): 0-d tensors
        assert torch.equal(DraftTree.from_parents([par]).mask, want)
