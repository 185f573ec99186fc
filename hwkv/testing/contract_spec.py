"""Contract tests of the speculative modes (re-exported by hwkv.testing.contract): tree verify with
accept/reject, multi-step drafts, DRAFT_EXTEND, each over an SWA pool much smaller than the full pool
with slots released and reused, graph replay after a larger batch, one translation per forward."""
from __future__ import annotations

import pytest
import torch

from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.errors import MissingSWALocError, ShapeError
from hwkv.spec import DraftTree, MultiStepDraft, accept_draft_tokens
from hwkv.testing.harness import Harness, ModelGeometry
from hwkv.testing.spec_harness import draft_steps, tree_verify

GEOM = ModelGeometry(num_layers=4, swa_every=2, window=4, num_heads=4, num_kv_heads=2, head_dim=16)
TREE = [-1, 0, 0, 1, 2]            # top-2 tree of 5 draft tokens: root, two children, a grandchild each
CHAIN = [-1, 0, 1, 2, 3]


def _make(target, page_size=1, size_swa=32, **kw):
    return Harness(target.backend_cls, target.device, GEOM, size=1024, size_swa=size_swa, page_size=page_size, **kw)


class _Count:
    def __init__(self, pool):
        self.inner, self.calls = pool.translate_loc_from_full_to_swa, 0
        pool.translate_loc_from_full_to_swa = self

    def __call__(self, *a, **k):
        self.calls += 1
        return self.inner(*a, **k)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_tree_verify_accept_and_reuse(hwkv_target, page_size, graph):
    """Tree verify (top-k > 1) against the reference, accepted paths kept and the rest freed in both
    pools, decode after it; graphs replayed for 2 requests then 1 (the tail padded with chains)."""
    h = _make(hwkv_target, page_size=page_size)
    if graph:
        h.enable_graphs([1, 2], hwkv_target.adapter_factory(), mode=ForwardMode.TARGET_VERIFY, tokens_per_req=5,
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
    count = _Count(h.pool)
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
    count = _Count(h.pool)
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


def test_draft_extend_through_graphs_reads_swa_slots(hwkv_target):
    """DRAFT_EXTEND (accepted tokens re-extended, 2 per request) through graphs over a small SWA pool:
    window buffers built in graph mode, equal to the reference, slots reused."""
    h = _make(hwkv_target)
    h.enable_graphs([1, 2], hwkv_target.adapter_factory(), mode=ForwardMode.DRAFT_EXTEND, tokens_per_req=2)
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
    prefix_cpu = torch.tensor([6, 4])
    idx = torch.zeros(2, 5, dtype=torch.int64, device=h.device)
    with pytest.raises(ShapeError, match="drafted 5"):
        accept_draft_tokens(h.allocator, h.pool, h.rtt.req_to_token, batch.req_pool_indices, prefix_cpu.to(h.device),
                            idx, torch.tensor([6, 1], device=h.device), prefix_lens_cpu=prefix_cpu,
                            accept_lens_cpu=torch.tensor([6, 1]))
    rows_before = h.rtt.req_to_token.clone()
    if h.allocator.immediate:  # value checks run where the allocator checks eagerly (CPU, HWKV_DEBUG)
        with pytest.raises(ShapeError, match="twice"):
            accept_draft_tokens(h.allocator, h.pool, h.rtt.req_to_token, batch.req_pool_indices, prefix_cpu.to(h.device),
                                idx, torch.tensor([2, 1], device=h.device), prefix_lens_cpu=prefix_cpu,
                                accept_lens_cpu=torch.tensor([2, 1]))
    assert torch.equal(rows_before, h.rtt.req_to_token)
    assert _same(h.allocator.integrity_snapshot(), after_alloc) and not _same(snap, after_alloc)
    with pytest.raises(ShapeError, match="num_steps"):
        MultiStepDraft(0)


def _same(a, b) -> bool:
    """Two allocator snapshots ({pool: {field: array or int}}) hold the same state."""
    if a.keys() != b.keys():
        return False
    return all(a[p].keys() == b[p].keys() and all(torch.equal(torch.as_tensor(a[p][f]), torch.as_tensor(b[p][f]))
                                                  for f in a[p]) for p in a)
