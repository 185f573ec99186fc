"""Contract tests of the speculative modes (re-exported by hwkv.testing.contract): tree verify with
accept/reject, multi-step drafts, DRAFT_EXTEND, each over an SWA pool much smaller than the full pool
with slots released and reused, graph replay after a larger batch, one translation per forward."""
from __future__ import annotations

import pytest
import torch

from hwkv.allocator import same_snapshot
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.errors import CapacityError, ConfigError, MissingSWALocError, ShapeError
from hwkv.loc import translations_of
from hwkv.spec import DraftTree, MultiStepDraft, accept_draft_tokens
from hwkv.testing import graph_adapter
from hwkv.testing.harness import FP32_TOLERANCE, Harness, ModelGeometry
from hwkv.testing.spec_harness import draft_batch, draft_graphs, draft_steps, tree_verify

GEOM = ModelGeometry(num_layers=4, swa_every=2, window=4, num_heads=4, num_kv_heads=2, head_dim=16)
TREE = [-1, 0, 0, 1, 2]            # top-2 tree of 5 draft tokens: root, two children, a grandchild each
CHAIN = [-1, 0, 1, 2, 3]


def _make(target, page_size=1, size_swa=32, **kw):
    """A harness for `target` over GEOM, with contract.make's fp32 tolerance (`target.fp32_tolerance`)."""
    if kw.get("dtype", torch.float32) == torch.float32:
        kw.setdefault("tolerance", getattr(target, "fp32_tolerance", FP32_TOLERANCE))
    return Harness(target.backend_cls, target.device, GEOM, size=1024, size_swa=size_swa, page_size=page_size, **kw)


class CountingTranslate:
    """Wraps pool.translate_loc_from_full_to_swa and counts the translations its calls make (one a call, or a
    fused refill's write locs and window lists: `hwkv.loc.translations_of`; shared with hwkv.testing.contract)."""

    def __init__(self, pool):
        self.inner, self.calls = pool.translate_loc_from_full_to_swa, 0
        pool.translate_loc_from_full_to_swa = self

    def __call__(self, *a, **k):
        self.calls += translations_of(*a, **k)
        return self.inner(*a, **k)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("verify_kernel", ["extend", "decode"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_tree_verify_accept_and_reuse(hwkv_target, page_size, graph, verify_kernel):
    """Tree verify (top-k > 1) against the reference, accepted paths kept and the rest freed in both
    pools, decode after it; graphs replayed for 2 requests then 1 (the tail padded with chains); through
    the extend kernels (the tree's mask) and decode-like (one decode query per draft token)."""
    h = _make(hwkv_target, page_size=page_size, tree_verify=verify_kernel)
    if graph:
        h.enable_graphs([1, 2], graph_adapter(hwkv_target), mode=ForwardMode.TARGET_VERIFY, tokens_per_req=5,
                        tree=True)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [9, 3], ForwardMode.EXTEND)
    h.release()
    accepts = ([[0, 1, 3], [0, 2]], [[0], [0, 1, 2, 3, 4]], [[0, 2, 4], []])
    for step in range(6):
        par = [TREE, CHAIN] if step % 2 == 0 else [CHAIN, TREE]
        tree_verify(h, rids, par, accepts[step % 3])
        h.release()
        h.forward(rids, [1, 1], ForwardMode.DECODE)
        h.release()
        h.check_integrity()
    tree_verify(h, rids[:1], [TREE], [[0, 2, 4]])
    h.check_integrity()
    if graph:
        assert h.runner.replays == 7 and h.runner.eager_runs == 0
    assert 1024 - h.allocator.full_available_size() > 32, "released SWA slots must have been reused"
    for r in list(rids):
        h.finish(r)
    h.check_integrity()
    assert h.allocator.full_available_size() == 1024


def test_multi_step_draft_translates_once(hwkv_target):
    """k draft steps in one forward: the write locs of every step and each window's list translated
    once, however many steps and layers; every step equals the reference."""
    h = _make(hwkv_target, page_size=2)
    rids = [h.add_request() for _ in range(3)]
    h.forward(rids, [7, 2, 11], ForwardMode.EXTEND)
    h.release()
    count = CountingTranslate(h.pool)
    for _ in range(4):
        before = (count.calls, h.backend.loc_cache.translations, h.backend.window_translations)
        draft_steps(h, rids, 3)
        assert (count.calls - before[0], h.backend.loc_cache.translations - before[1],
                h.backend.window_translations - before[2]) == (2, 1, 1)
        h.release()
        h.check_integrity()
    assert 1024 - h.allocator.full_available_size() > 32


def test_draft_without_swa_layers_writes_nothing_to_the_swa_pool(hwkv_target):
    """A draft model of full layers only over the hybrid pool: no translation, the SWA pool untouched,
    and an SWA layer forwarded in it raises MissingSWALocError."""
    h = _make(hwkv_target)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [6, 9], ForwardMode.EXTEND)
    full_layers = [l for l in h.layers if l.window is None]
    swa_before = [h.pool.get_key_buffer(l.layer_id).clone() for l in h.layers if l.window is not None]
    count = CountingTranslate(h.pool)
    draft_steps(h, rids, 2, writes_swa=False, layers=full_layers)
    assert count.calls == 0
    assert all(torch.equal(a, h.pool.get_key_buffer(l.layer_id))
               for a, l in zip(swa_before, [l for l in h.layers if l.window is not None]))
    swa = next(l for l in h.layers if l.window is not None)
    step = h.backend.forward_metadata
    batch = ForwardBatch(ForwardMode.DECODE, 2, torch.tensor(rids, device=h.device), torch.tensor([8, 11], device=h.device),
                         step.write_loc.loc)
    q = torch.zeros(2, swa.num_heads, swa.head_dim, device=h.device)
    k = torch.zeros(2, swa.num_kv_heads, swa.head_dim, device=h.device)
    with pytest.raises(MissingSWALocError):
        h.backend.forward(q, k, k, swa, batch)


@pytest.mark.parametrize("page_size", [1, 2])
def test_multi_step_draft_through_graphs_reuses_slots_and_translates_once(hwkv_target, page_size):
    """k = 3 draft steps captured as one graph per bucket over an SWA pool a 32nd of the full pool, slots
    released and reused between drafts: every step equals the reference; each draft forward translates
    its write locs once and its window's block once, however many steps and layers (device graphs that
    record the refill: the runner's counts); a batch larger than every bucket runs eagerly."""
    h = _make(hwkv_target, page_size=page_size)
    rids = [h.add_request() for _ in range(3)]
    h.forward(rids, [9, 3, 6], ForwardMode.EXTEND)
    h.release()
    # captured after the prefill: the CPU kernels' per-thread scratch, grown by a larger extend, is not a
    # buffer a replay may move to under the capture-checking adapter
    runner = draft_graphs(h, [1, 2], graph_adapter(hwkv_target), 3)
    count = CountingTranslate(h.pool)
    host = 0 if runner.metadata_in_graph else 2  # a recorded refill translates in the replay, not on the host
    for step in range(4):
        before = (count.calls, h.backend.loc_cache.translations, h.backend.window_translations)
        draft_steps(h, rids[:1 + step % 2], 3, runner=runner)   # checked against the reference inside
        assert (count.calls - before[0], h.backend.loc_cache.translations - before[1],
                h.backend.window_translations - before[2]) == (host, 1, 1)
        h.release()
        h.check_integrity()
    before = count.calls
    draft_steps(h, rids, 3, runner=runner)                      # 3 requests: past every bucket
    assert count.calls - before == 2
    h.release()
    h.check_integrity()
    assert runner.replays == 4 and runner.eager_runs == 1
    assert 1024 - h.allocator.full_available_size() > 32, "released SWA slots must have been reused"
    for r in rids:
        h.finish(r)
    h.check_integrity()


@pytest.mark.parametrize("page_size", [1, 2])
def test_multi_step_draft_in_one_graph_allocates_in_its_replay(hwkv_target, page_size):
    """k = 3 draft steps with their slots' allocation and req_to_token write inside the replay
    (`hwkv.step_graph.DraftStepGraph`) over an SWA pool a 32nd of the full pool, slots released and reused
    between drafts: every step equals the reference and the allocator stays whole; a batch larger than every
    bucket runs eagerly. Where the device's page ops cannot run in a recorded graph, the replay is the host
    running its body."""
    h = _make(hwkv_target, page_size=page_size)
    rids = [h.add_request() for _ in range(3)]
    h.forward(rids, [9, 3, 6], ForwardMode.EXTEND)
    h.release()
    runner = draft_graphs(h, [1, 2], graph_adapter(hwkv_target), 3, whole_step=True)
    for step in range(6):
        draft_steps(h, rids[:1 + step % 2], 3, runner=runner)   # checked against the reference inside
        h.release()
        h.check_integrity()
    draft_steps(h, rids, 3, runner=runner)                      # 3 requests: past every bucket
    h.release()
    h.check_integrity()
    assert runner.replays == 6 and runner.eager_runs == 1
    # the scenario's own premise: its requests hold more tokens than the SWA pool has slots, so the drafts ran on
    # released and reused SWA slots (the checks against the reference above are what prove them right)
    assert 1024 - h.allocator.full_available_size() > 32, "the drafts took fewer slots than the SWA pool holds"
    for r in rids:
        h.finish(r)
    h.check_integrity()


def test_draft_graph_replay_with_fewer_requests_zeroes_the_tail_and_keeps_live_slots(hwkv_target):
    """A 2-step draft replayed for 4 requests, then for 1 (padded to 2): the write buffer holds the
    padding slot for the padded request and zeros past the bucket; the others' K/V are untouched."""
    h = _make(hwkv_target)
    rids = [h.add_request() for _ in range(4)]
    h.forward(rids, [3, 5, 9, 2], ForwardMode.EXTEND)
    runner = draft_graphs(h, [2, 4], graph_adapter(hwkv_target), 2)
    draft_steps(h, rids, 2, runner=runner)
    swa_big, loc_big = h.backend.loc_cache.buffer[:8].clone(), runner.out_cache_loc[:8].clone()
    assert (swa_big > 0).all()
    swa_id, full_id = h.layers[0].layer_id, h.layers[1].layer_id
    others = [i for i in range(8) if i % 4 != 0]               # step-major [step, request]: requests 1..3
    keep = (h.pool.get_key_buffer(swa_id)[swa_big[others]].clone(),
            h.pool.get_key_buffer(full_id)[loc_big[others]].clone())
    draft_steps(h, rids[:1], 2, runner=runner)
    buf = h.backend.loc_cache.buffer
    assert (buf[4:] == 0).all(), "stale slots left in the static buffer's tail"
    assert int(buf[1]) == 0 and int(buf[3]) == 0, "the padded request must write the padding slot"
    assert torch.equal(h.pool.get_key_buffer(swa_id)[swa_big[others]], keep[0]), "a live SWA slot was overwritten"
    assert torch.equal(h.pool.get_key_buffer(full_id)[loc_big[others]], keep[1]), "a live slot was overwritten"
    assert runner.replays == 2 and runner.eager_runs == 0


def test_draft_steps_beyond_graph_capacity_are_refused_and_change_nothing(hwkv_target):
    h = _make(hwkv_target)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [6, 4], ForwardMode.EXTEND)
    runner = draft_graphs(h, [1, 2], graph_adapter(hwkv_target), 2)
    draft_steps(h, rids, 2, runner=runner)
    batch = draft_batch(h, rids, 3)                     # the engine allocated 3 steps: the graphs run 2
    inputs = h.random_inputs(6)
    ds = h.backend.draft_static
    state = lambda: [t.clone() for t in (runner.out_cache_loc, runner.seq_lens, h.backend.loc_cache.buffer,
                                         *[st.full_indices for st in ds.steps], *ds.blocks.values(),
                                         *[h.pool.get_key_buffer(l.layer_id) for l in h.layers])]
    before, snap = state(), h.allocator.integrity_snapshot()
    with pytest.raises(CapacityError, match="draft of 3 steps exceeds the 2 steps"):
        runner.run(batch, inputs)
    with pytest.raises(CapacityError, match="draft of 3 steps exceeds the graph state's 2 steps"):
        h.backend.init_draft_metadata_graph(batch)
    two = ForwardBatch(ForwardMode.DECODE, 2, batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc[:4],
                       spec_info=MultiStepDraft(2, writes_swa=False))
    with pytest.raises(ConfigError, match="these graphs run"):
        runner.run(two, inputs)
    three = ForwardBatch(ForwardMode.DECODE, 3, torch.tensor(rids + rids[:1], device=h.device),
                         torch.cat([batch.seq_lens, batch.seq_lens[:1]]),
                         torch.zeros(6, dtype=torch.int64, device=h.device), spec_info=MultiStepDraft(2))
    with pytest.raises(CapacityError, match="batch size needs 3 entries, the graph buffer holds 2"):
        h.backend.init_draft_metadata_graph(three)
    with pytest.raises(ConfigError, match="init_draft_graph_state once"):
        h.backend.init_draft_graph_state(2, 3)
    assert all(torch.equal(a, b) for a, b in zip(before, state())), "a refused draft changed a buffer"
    assert same_snapshot(snap, h.allocator.integrity_snapshot()) and runner.replays == 1
    h.backend.init_draft_metadata(batch)                # eagerly it runs (the engine's fallback)


def test_draft_extend_through_graphs_reads_swa_slots(hwkv_target):
    """DRAFT_EXTEND (accepted tokens re-extended, 2 per request) through graphs over a small SWA pool:
    window buffers built in graph mode, equal to the reference, slots reused."""
    h = _make(hwkv_target)
    h.enable_graphs([1, 2], graph_adapter(hwkv_target), mode=ForwardMode.DRAFT_EXTEND, tokens_per_req=2)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [5, 10], ForwardMode.EXTEND)
    h.release()
    for _ in range(8):
        h.forward(rids, [2, 2], ForwardMode.DRAFT_EXTEND)
        h.release()
        h.check_integrity()
    h.forward(rids[:1], [2], ForwardMode.DRAFT_EXTEND)
    assert h.runner.replays == 9 and h.runner.eager_runs == 0
    assert 1024 - h.allocator.full_available_size() > 32


def test_bad_speculative_input_raises_and_changes_nothing(hwkv_target):
    h = _make(hwkv_target)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [6, 4], ForwardMode.EXTEND)
    snap = h.allocator.integrity_snapshot()
    batch = h.make_batch(rids, [5, 5], ForwardMode.TARGET_VERIFY)
    after_alloc = h.allocator.integrity_snapshot()
    batch.spec_info = DraftTree.from_parents([TREE], device=h.device)      # one request's mask for two
    with pytest.raises(ShapeError, match="sum"):
        h.backend.init_forward_metadata(batch)
    prefix_cpu = torch.tensor([6, 4], device="cpu")
    idx = torch.zeros(2, 5, dtype=torch.int64, device=h.device)
    with pytest.raises(ShapeError, match="drafted 5"):
        accept_draft_tokens(h.allocator, h.pool, h.rtt.req_to_token, batch.req_pool_indices, prefix_cpu.to(h.device),
                            idx, torch.tensor([6, 1], device=h.device), prefix_lens_cpu=prefix_cpu,
                            accept_lens_cpu=torch.tensor([6, 1], device="cpu"))
    rows_before = h.rtt.req_to_token.clone()
    if h.allocator.immediate:  # value checks run where the allocator checks eagerly (CPU, HWKV_DEBUG)
        with pytest.raises(ShapeError, match="twice"):
            accept_draft_tokens(h.allocator, h.pool, h.rtt.req_to_token, batch.req_pool_indices, prefix_cpu.to(h.device),
                                idx, torch.tensor([2, 1], device=h.device), prefix_lens_cpu=prefix_cpu,
                                accept_lens_cpu=torch.tensor([2, 1], device="cpu"))
    assert torch.equal(rows_before, h.rtt.req_to_token)
    assert same_snapshot(h.allocator.integrity_snapshot(), after_alloc) and not same_snapshot(snap, after_alloc)
    with pytest.raises(ShapeError, match="num_steps"):
        MultiStepDraft(0)
