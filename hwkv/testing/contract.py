"""The contract tests every backend passes (docs/architecture.md, "Contracts"). Needs a `hwkv_target` fixture."""
from __future__ import annotations

import pytest
import torch

from hwkv.batch import ForwardMode
from hwkv.errors import ConfigError, EvictedSlotError, MissingSWALocError, ShapeError
from hwkv.loc import KVWriteLoc
from hwkv.testing import graph_adapter
from hwkv.testing.contract_spec import CountingTranslate
from hwkv.testing.harness import FP32_TOLERANCE, Harness, ModelGeometry, run_scenario
from hwkv.testing.host_reads import HostReads, StorageReads

SMALL = ModelGeometry(num_layers=4, swa_every=2, window=8, num_heads=4, num_kv_heads=2, head_dim=16)
SIZE_SWA_P16 = 80  # 5 pages of 16: the run's SWA pages diverge from its full pages
MANY_SWA = ModelGeometry(num_layers=7, swa_every=7, window=8, num_heads=4, num_kv_heads=2, head_dim=16)


def make(target, geometry=SMALL, graph=False, buckets=(1, 2, 4), **kw):
    """A harness for `target`; an fp32 one accepts `target.fp32_tolerance` (default FP32_TOLERANCE, imported
    from hwkv.testing.harness and importable from here)."""
    kw.setdefault("size", 1024)
    kw.setdefault("size_swa", 128)
    if kw.get("dtype", torch.float32) == torch.float32:
        kw.setdefault("tolerance", getattr(target, "fp32_tolerance", FP32_TOLERANCE))
    h = Harness(target.backend_cls, target.device, geometry, **kw)
    if graph:
        h.enable_graphs(list(buckets), graph_adapter(target))
    return h


# ---- the write contract ------------------------------------------------------------------------
def test_swa_layer_writes_exactly_the_swa_loc_it_was_handed(hwkv_target):
    h = make(hwkv_target)
    seen = []
    inner = h.pool.swa_kv_pool.set_kv_buffer

    def spy(layer, loc, *a, **k):
        seen.append(loc)
        return inner(layer, loc, *a, **k)

    h.pool.swa_kv_pool.set_kv_buffer = spy
    rid = h.add_request()
    h.forward([rid], [5])
    md = h.backend.forward_metadata
    assert seen and all(s is md.write_loc.swa_loc for s in seen), "SWA layers must write the handed swa_loc object"
    assert md.write_loc.swa_loc is md.swa_out_cache_loc
    swa = md.swa_out_cache_loc
    layer = h.layers[0]
    assert torch.equal(h.pool.get_key_buffer(layer.layer_id)[swa].float().cpu(), torch.cat(h.requests[rid].k[0]))


def test_swa_layer_without_swa_loc_raises_and_full_layer_ignores_it(hwkv_target):
    h = make(hwkv_target)
    loc = h.allocator.alloc(2)
    swa_layer, full_layer = h.layers[0], h.layers[1]
    k = torch.ones(2, swa_layer.num_kv_heads, swa_layer.head_dim, device=h.device)
    before = h.pool.get_key_buffer(0).clone()
    with pytest.raises(MissingSWALocError):
        h.pool.set_kv_buffer(swa_layer, loc, k, k)
    assert torch.equal(before, h.pool.get_key_buffer(0))
    h.pool.set_kv_buffer(full_layer, KVWriteLoc(loc, torch.zeros(2, dtype=torch.int64, device=h.device)), k, k)
    assert torch.equal(h.pool.get_key_buffer(1)[loc], k.to(h.pool.dtype))


@pytest.mark.parametrize("dtype, scale", [(torch.float32, None), (torch.float8_e4m3fn, 0.5)], ids=["fp32", "fp8"])
def test_forward_never_mutates_the_callers_tensors(hwkv_target, dtype, scale):
    h = make(hwkv_target, dtype=dtype, kv_scale=scale)
    rid = h.add_request()
    for n, mode in ((6, ForwardMode.EXTEND), (1, ForwardMode.DECODE)):
        batch = h.make_batch([rid], [n], mode)
        inputs = h.random_inputs(n)
        before = {k: v.clone() for k, v in inputs.items()}
        seq_before = (batch.seq_lens.clone(), batch.out_cache_loc.clone(), batch.req_pool_indices.clone())
        h.backend.init_forward_metadata(batch)
        h.model_step(batch, inputs)
        assert all(torch.equal(before[k], inputs[k]) for k in inputs), "a caller's q/k/v was modified"
        assert all(torch.equal(a, b) for a, b in zip(seq_before, (batch.seq_lens, batch.out_cache_loc,
                                                                  batch.req_pool_indices)))


# ---- translation exactly once per forward --------------------------------------------------------
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_one_translation_per_forward_with_many_swa_layers(hwkv_target, graph):
    h = make(hwkv_target, MANY_SWA, graph=graph)
    assert len(h.pool.layers_mapping) == 7 and sum(m[1] for m in h.pool.layers_mapping.values()) == 6
    counter = CountingTranslate(h.pool)
    table_reads = _layers_reading_the_table(h) if not graph else None
    rids = [h.add_request() for _ in range(3)]
    h.forward(rids, [6, 9, 3], ForwardMode.EXTEND)
    per_forward = [counter.calls]
    in_graph = graph and getattr(h.runner, "metadata_in_graph", False)
    for _ in range(3):
        before, cache_before = counter.calls, h.backend.loc_cache.translations
        window_before = h.backend.window_translations
        h.forward(rids, [1, 1, 1], ForwardMode.DECODE)
        if in_graph:  # the refill is recorded in the graph: nothing translates on the host, the replay does
            assert counter.calls == before, "a replay whose graph holds the refill translated on the host"
            per_forward.append(h.backend.loc_cache.translations - cache_before
                               + h.backend.window_translations - window_before)
        else:
            per_forward.append(counter.calls - before)
        assert h.backend.loc_cache.translations - cache_before == 1, "write locs translated more than once"
    # one translation of the write locs + one of the window list, whatever the number of SWA layers
    assert per_forward == [2, 2, 2, 2]
    if graph:
        assert h.runner.replays == 3
    else:   # nor through the table itself (a gather of the write locs again, a window translated in the layer)
        assert table_reads == [0, 0, 0, 0], f"layers read the full->SWA table (ops per forward: {table_reads})"


def _layers_reading_the_table(h):
    """Counts, per eager forward of `h`, the ops of its layers (`model_step`) that read the pool's full->SWA table
    (`StorageReads`): the list it returns fills as forwards run."""
    counts, inner, table = [], h.model_step, h.pool.full_to_swa_index_mapping

    def counted(batch, inputs):
        with StorageReads(table) as r:
            out = inner(batch, inputs)
        counts.append(r.count)
        return out

    h.model_step = counted
    return counts


def test_plain_pool_translates_nothing(hwkv_target):
    h = make(hwkv_target, size_swa=None)
    rid = h.add_request()
    h.forward([rid], [7])
    h.forward([rid], [1])
    assert h.backend.loc_cache.translations == 0 and h.backend.window_translations == 0
    assert h.backend.forward_metadata.write_loc.swa_loc is None


def test_layers_never_translate(hwkv_target):
    h = make(hwkv_target, MANY_SWA)
    counter = CountingTranslate(h.pool)
    rid = h.add_request()
    batch = h.make_batch([rid], [4], ForwardMode.EXTEND)
    h.backend.init_forward_metadata(batch)
    after_metadata = counter.calls
    with StorageReads(h.pool.full_to_swa_index_mapping) as table:
        h.model_step(batch, h.random_inputs(4))
    assert counter.calls == after_metadata
    assert table.count == 0, f"the layers read the full->SWA table themselves: {table.ops}"


# ---- host work once per forward, not per layer -----------------------------------------------------
@pytest.mark.parametrize("geometry", [dict(), dict(sinks=True, logit_cap=4.0, num_heads=8, v_head_dim=8)],
                         ids=["plain", "sinks-gqa4-vdim"])
def test_layers_read_the_device_no_more_with_more_layers(hwkv_target, geometry):
    """The layers of a forward read device values back (`.item()`, `.tolist()`, `.cpu()` of device data, `nonzero`:
    `hwkv.testing.host_reads`) no more often with 8 layers than with 2: what needs the host is planned once per
    forward (the metadata step, or the first layer reading a list), never once per layer."""
    counts = []
    for layers in (2, 8):
        h = make(hwkv_target, ModelGeometry(num_layers=layers, swa_every=2, window=8, num_kv_heads=2, head_dim=16,
                                            **{"num_heads": 4, **geometry}), page_size=2, size_swa=256)
        rids = [h.add_request() for _ in range(3)]
        reads = []
        for lens, mode in (([5, 9, 3], ForwardMode.EXTEND), ([1, 1, 1], ForwardMode.DECODE),
                           ([4, 1, 6], ForwardMode.EXTEND)):
            batch = h.make_batch(rids, lens, mode)
            inputs = h.random_inputs(sum(lens))
            h.backend.init_forward_metadata(batch)
            with HostReads() as r:
                h.model_step(batch, inputs)
            reads.append(r.count)
        counts.append(reads)
    assert counts[1] == counts[0], (f"device reads per forward's layers (extend, decode, extend) with 2 layers "
                                    f"{counts[0]}, with 8 {counts[1]}: some layer reads the device")


def _graph_step_reads(target, layers):
    """Host reads of two graph decode steps of 3 requests over `layers` layers on `target`: [(the refill,
    `runner.prepare`; the replay)] a step."""
    h = make(target, ModelGeometry(num_layers=layers, swa_every=2, window=8, num_heads=4, num_kv_heads=2,
                                   head_dim=16), graph=True, page_size=2, size_swa=256)
    rids = [h.add_request() for _ in range(3)]
    h.forward(rids, [5, 9, 3], ForwardMode.EXTEND)
    reads = []
    for _ in range(2):
        batch, inputs = h.prepare(rids, [1, 1, 1], ForwardMode.DECODE)
        host = (h.runner.seq_lens_cpu, h.runner.extend_seq_lens_cpu, batch.seq_lens_cpu, batch.extend_seq_lens_cpu)
        with HostReads(host) as refill:   # (the lengths' host copies are read without a sync)
            step = h.runner.prepare(batch, inputs)
        with HostReads() as replay:
            flat = h.runner.replay(step)
        h.complete(rids, [1, 1, 1], inputs, flat)
        reads.append((refill.count, replay.count))
    return reads


def test_graph_steps_read_the_device_no_more_than_the_template(hwkv_target):
    """A graph step's refill reads the device no more than the template's (`init_forward_metadata_graph`: no host
    sync; the reference backend on the same device is the floor, its CPU value checks included), and its replay no
    more with 8 layers than with 2 (a layer reading the device only in graph mode is a sync, or a capture error, a
    layer)."""
    from hwkv.graph import EagerAdapter
    from hwkv.testing import ContractTarget
    from hwkv.testing.reference_backend import ReferenceBackend
    mine = {n: _graph_step_reads(hwkv_target, n) for n in (2, 8)}
    floor = _graph_step_reads(ContractTarget("template", ReferenceBackend, hwkv_target.device, EagerAdapter), 2)
    assert [r[1] for r in mine[8]] == [r[1] for r in mine[2]], (
        f"device reads of a replay with 2 layers {[r[1] for r in mine[2]]}, with 8 {[r[1] for r in mine[8]]}: "
        "some layer reads the device in graph mode")
    assert all(r[0] <= f[0] for r, f in zip(mine[2], floor)), (
        f"device reads of a graph refill {[r[0] for r in mine[2]]}, the template's {[f[0] for f in floor]}: the "
        "refill syncs with the host")


# ---- graph refill ------------------------------------------------------------------------------
def test_graph_replay_with_fewer_tokens_zeroes_the_tail_and_keeps_live_slots(hwkv_target):
    h = make(hwkv_target, graph=True, buckets=(1, 4))
    rids = [h.add_request() for _ in range(4)]
    h.forward(rids, [3, 5, 9, 2], ForwardMode.EXTEND)
    h.forward(rids, [1] * 4, ForwardMode.DECODE)          # replays the 4-bucket
    big = h.backend.loc_cache.buffer.clone()
    assert (big[:4] > 0).all()
    snapshot = h.pool.get_key_buffer(0)[big[:4]].clone()
    h.forward(rids[:1], [1], ForwardMode.DECODE)          # replays the 1-bucket
    buf = h.backend.loc_cache.buffer
    assert (buf[1:] == 0).all(), "stale slots left in the static buffer's tail"
    assert torch.equal(h.pool.get_key_buffer(0)[big[1:4]], snapshot[1:]), "a stale slot was overwritten"
    assert h.runner.replays == 2


def test_batch_larger_than_every_bucket_runs_eagerly(hwkv_target):
    h = make(hwkv_target, graph=True, buckets=(1, 2))
    rids = [h.add_request() for _ in range(3)]
    h.forward(rids, [4, 4, 4], ForwardMode.EXTEND)
    outs = h.forward(rids, [1, 1, 1], ForwardMode.DECODE)  # checked against the reference inside
    assert h.runner.eager_runs == 1 and outs[0].shape[0] == 3


def test_speculative_verify_through_graphs_reads_swa_slots(hwkv_target):
    """TARGET_VERIFY (3 draft tokens per request) replayed from graphs over a small SWA pool (a 32nd
    of the full pool), slots released and reused between steps: window lists hold SWA slots."""
    h = make(hwkv_target, size=1024, size_swa=32)
    h.enable_graphs([1, 2], graph_adapter(hwkv_target), mode=ForwardMode.TARGET_VERIFY, tokens_per_req=3)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [9, 14], ForwardMode.EXTEND)
    h.release()
    for _ in range(6):
        h.forward(rids, [3, 3], ForwardMode.TARGET_VERIFY)  # checked against the reference inside
        h.release()
        h.check_integrity()
    h.forward(rids[:1], [3], ForwardMode.TARGET_VERIFY)
    assert h.runner.replays == 7 and h.runner.eager_runs == 0
    assert 1024 - h.allocator.full_available_size() > 32, "released SWA slots must have been reused"


# ---- outputs against the reference ---------------------------------------------------------------
# SWA pools smaller than the tokens a run writes (about 70): SWA slots diverge from the full locs and released ones
# are reused, so a backend reading a window through full locs (or writing SWA K/V at them) fails
SCENARIOS = {
    "p1-fp32": dict(page_size=1, size_swa=32),
    "p4-bf16": dict(page_size=4, dtype=torch.bfloat16, size_swa=64),
    "p16-fp32": dict(page_size=16, size_swa=SIZE_SWA_P16),
    "sinks-softcap": dict(page_size=1, size_swa=32, geometry=ModelGeometry(sinks=True, logit_cap=4.0)),
    "gqa4-vdim": dict(page_size=2, size_swa=64, geometry=ModelGeometry(num_heads=8, num_kv_heads=2, v_head_dim=8)),
    # a softmax scale other than 1/sqrt(head_dim) (of either layer kind's head_dim)
    "swa-heads": dict(page_size=1, size_swa=32, geometry=ModelGeometry(swa_num_kv_heads=4, swa_head_dim=32,
                                                                      scaling=0.4)),
    "w1": dict(page_size=1, size_swa=32, geometry=ModelGeometry(window=1)),
    # K and V scaled apart: a backend dequantizing K with v_scale (or V with k_scale) fails
    "fp8": dict(page_size=1, size_swa=32, dtype=torch.float8_e4m3fn, k_scale=0.5, v_scale=0.125),
}


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_outputs_match_reference(hwkv_target, name, graph):
    """Chunked prefill (prefixes below / at / above W), decode, release every step in an SWA pool
    smaller than the tokens written (SWA slots diverge from the full locs; released ones are reused), requests
    finishing and a new one's prompt in MIXED forwards beside the decoding rows."""
    kw = dict(SCENARIOS[name])
    h = make(hwkv_target, graph=graph, **kw)
    diverged = _watch_divergence(h)
    err = run_scenario(h, steps=10, prompt_lens=(5, 8, 13), chunk=4 if h.g.window > 1 else 1, mixed=True)
    assert err < 1.0  # the harness raises ReferenceMismatchError past its tolerance; this guards NaN-free runs
    assert h.allocator.full_available_size() == 1024
    assert any(diverged), "the scenario's premise: some token's SWA slot differs from its full loc"


# one request past the small shapes' tile boundaries (> 64 queries in one forward, > 128 keys), head_dim 128 (its own
# kernel configs), sinks and a soft-cap (where page size > 1 takes other paths), an SWA and a full layer
LONG = ModelGeometry(num_layers=2, swa_every=2, window=8, num_heads=2, num_kv_heads=1, head_dim=128, sinks=True,
                     logit_cap=10.0)


def test_long_prefill_matches_reference(hwkv_target):
    """A 150-token prompt in ONE forward beside a 5-token one at page size 16 over LONG (a second query tile and key
    tile, or a split of the keys, for the long request), then decode steps with release: every layer's output
    against the reference (fp32)."""
    h = make(hwkv_target, LONG, page_size=16, size_swa=256)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [150, 5], ForwardMode.EXTEND)
    h.release()
    for _ in range(2):
        h.forward(rids, [1, 1], ForwardMode.DECODE)
        h.release()
        h.check_integrity()
    assert h.requests[rids[0]].seq_len == 152


def _watch_divergence(h):
    """A list that records, after every forward, whether some allocated full loc's SWA slot differs from it (read
    from the allocator's mapping, so translations inside a graph's own kernels count as the pool's do)."""
    seen = []
    forward = h.forward

    def spy(*a, **k):
        out = forward(*a, **k)
        mapping = h.pool.full_to_swa_index_mapping[:-1]
        locs = torch.arange(mapping.shape[0], device=mapping.device)
        seen.append(bool(((mapping != 0) & (mapping != locs)).any()))
        return out

    h.forward = spy
    return seen


# ---- windows: several per model, and a window layer over the full list ------------------------
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_two_windows_each_layer_reads_its_own(hwkv_target, graph):
    """Two SWA layers with W=4 and W=8 (one list per distinct W); the release keeps the largest W."""
    g = ModelGeometry(num_layers=4, swa_every=2, window=8, swa_windows=(4, 8))
    h = make(hwkv_target, g, graph=graph, page_size=1, size_swa=64)
    assert [l.window for l in h.layers] == [4, None, 8, None]
    run_scenario(h, steps=6, prompt_lens=(5, 8, 13), chunk=4)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_window_layers_over_a_plain_pool_mask_the_full_list(hwkv_target, graph):
    """A plain pool and a backend built without the window: window layers read the full list and the kernels'
    window mask trims it (decode and extend), lists longer than W."""
    h = make(hwkv_target, graph=graph, page_size=1, size_swa=None, sliding_window=())
    assert not h.hybrid and h.layers[0].window == 8
    run_scenario(h, steps=6, prompt_lens=(5, 8, 13), chunk=4)


def test_small_swa_pool_reuses_released_slots(hwkv_target):
    h = make(hwkv_target, size=1024, size_swa=128, page_size=4)
    run_scenario(h, steps=60, prompt_lens=(9, 11, 6, 14), chunk=5, finish=False)
    used_full = 1024 - h.allocator.full_available_size()
    assert used_full > 128, "the run must hold more tokens than the SWA pool has slots"


# ---- bad input ---------------------------------------------------------------------------------
def test_bad_input_raises_typed_error_and_changes_nothing(hwkv_target):
    h = make(hwkv_target)
    rid = h.add_request()
    h.forward([rid], [6])
    batch = h.make_batch([rid], [1], ForwardMode.DECODE)
    h.backend.init_forward_metadata(batch)
    layer = h.layers[0]
    k_before = [h.pool.get_key_buffer(i).clone() for i in range(len(h.layers))]
    free_before = (h.allocator.full_available_size(), h.allocator.swa_available_size())
    q = torch.zeros(1, layer.num_heads + 1, layer.head_dim, device=h.device)
    k = torch.zeros(1, layer.num_kv_heads, layer.head_dim, device=h.device)
    with pytest.raises(ShapeError, match="q has shape"):
        h.backend.forward(q, k, k, layer, batch)
    with pytest.raises(ShapeError, match="cache_k"):
        h.backend.forward(torch.zeros(1, layer.num_heads, layer.head_dim, device=h.device),
                          torch.zeros(1, layer.num_kv_heads + 1, layer.head_dim, device=h.device), k, layer, batch)
    assert all(torch.equal(a, h.pool.get_key_buffer(i)) for i, a in enumerate(k_before))
    assert free_before == (h.allocator.full_available_size(), h.allocator.swa_available_size())


def test_unknown_option_and_missing_window_are_refused(hwkv_target):
    h = make(hwkv_target)
    with pytest.raises(ConfigError, match="unknown backend option"):
        hwkv_target.backend_cls(h.pool, h.rtt, sliding_window=8, no_such_option=1)
    with pytest.raises(ConfigError, match="sliding_window"):
        hwkv_target.backend_cls(h.pool, h.rtt)


def test_debug_mode_refuses_an_evicted_in_window_token(hwkv_target):
    h = make(hwkv_target, debug=True)
    rid = h.add_request()
    h.forward([rid], [6])
    h.allocator.free_swa(h.rtt.req_to_token[rid, 4:5].clone())  # wrongly release an in-window token
    batch = h.make_batch([rid], [1], ForwardMode.DECODE)
    with pytest.raises(EvictedSlotError, match="W=8"):
        h.backend.init_forward_metadata(batch)


from hwkv.testing.contract_spec import *  # noqa: E402,F401,F403  (the speculative modes' contract)
