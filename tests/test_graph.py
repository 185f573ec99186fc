"""GraphRunner and graph state: runners of one backend share its static buffers safely."""
import pytest
import torch

from hwkv.batch import ForwardMode
from hwkv.errors import ConfigError, ShapeError
from hwkv.testing.harness import Harness, ModelGeometry
from hwkv.testing.reference_backend import ReferenceBackend


def test_a_second_runner_shares_the_static_buffers_instead_of_reallocating_them():
    h = Harness(ReferenceBackend, geometry=ModelGeometry(), size=512, size_swa=128)
    decode = h.enable_graphs([1, 2, 4])
    buffers = (h.backend.static, h.backend.loc_cache.buffer)
    h.enable_graphs([1, 2], mode=ForwardMode.TARGET_VERIFY, tokens_per_req=2)  # 4 tokens: fits
    assert (h.backend.static, h.backend.loc_cache.buffer) == buffers, "captured graphs would read freed buffers"
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [6, 9], ForwardMode.EXTEND)
    h.runner = decode
    h.forward(rids, [1, 1], ForwardMode.DECODE)  # the decode graphs still read valid buffers
    with pytest.raises(ConfigError, match="call init_graph_state once with the largest sizes"):
        h.backend.init_graph_state(8, 8)


def _decoding_harness(buckets):
    h = Harness(ReferenceBackend, geometry=ModelGeometry(), size=512, size_swa=128)
    h.enable_graphs(list(buckets))
    rids = [h.add_request() for _ in range(3)]
    h.forward(rids, [5, 9, 7], ForwardMode.EXTEND)
    h.release()
    return h, rids


def test_prepare_then_replay_is_run_in_two_halves():
    h, rids = _decoding_harness([1, 4])
    batch, inputs = h.prepare(rids, [1, 1, 1], ForwardMode.DECODE)
    step = h.runner.prepare(batch, inputs)
    assert step.bucket == 4 and step.num_tokens == 3 and h.runner.replays == 0
    assert int(h.runner.req_pool_indices[3]) == 0 and int(h.runner.out_cache_loc[3]) == 0  # padded
    flat = h.runner.replay(step)
    assert flat.shape[0] == 3 and h.runner.replays == 1 and h.runner.eager_runs == 0
    h.complete(rids, [1, 1, 1], inputs, flat)  # checked against the reference


def test_prepare_of_a_batch_larger_than_every_bucket_falls_back_to_eager():
    h, rids = _decoding_harness([1, 2])
    batch, inputs = h.prepare(rids, [1, 1, 1], ForwardMode.DECODE)
    step = h.runner.prepare(batch, inputs)
    assert step.bucket is None and step.batch is batch  # eager metadata already built for it
    assert h.backend.forward_metadata.batch_size == 3
    flat = h.runner.replay(step)
    assert h.runner.eager_runs == 1 and h.runner.replays == 0 and flat.shape[0] == 3
    h.complete(rids, [1, 1, 1], inputs, flat)


def test_refill_captured_with_the_layers_when_backend_and_adapter_allow_it():
    """A device-only refill (Triton backends under CUDA graphs) is recorded in the graph: prepare only
    copies inputs, every replay refills itself, outputs still match the reference after the batch
    shrinks (the write buffer's tail is zeroed by the recorded refill)."""
    from hwkv.graph import EagerAdapter
    from hwkv.testing.harness import run_scenario

    class RecordingAdapter(EagerAdapter):  # replays the captured callable, like a device graph would
        records_device_work = True

    class DeviceOnlyRefill(ReferenceBackend):
        metadata_in_graph = True
        refills = 0

        def init_forward_metadata_graph(self, batch, max_q_len=None):
            DeviceOnlyRefill.refills += 1
            return super().init_forward_metadata_graph(batch, max_q_len)

    h = Harness(DeviceOnlyRefill, geometry=ModelGeometry(), size=512, size_swa=96, page_size=2)
    runner = h.enable_graphs([2, 4], RecordingAdapter())
    assert runner.metadata_in_graph
    before = DeviceOnlyRefill.refills
    run_scenario(h, steps=8)
    assert runner.replays > 0
    assert DeviceOnlyRefill.refills - before == runner.replays  # one refill per replay, inside it, none in prepare


def test_refill_stays_before_replay_for_other_adapters():
    from hwkv.graph import EagerAdapter

    class DeviceOnlyRefill(ReferenceBackend):
        metadata_in_graph = True

    h = Harness(DeviceOnlyRefill, geometry=ModelGeometry(), size=512, size_swa=96)
    assert not h.enable_graphs([2], EagerAdapter()).metadata_in_graph


def test_verify_graphs_bound_the_extend_grid_by_tokens_per_request():
    """A verify graph's metadata takes the runner's tokens per request as its static query bound (not the
    batch's token count), and the window lists' bound follows; outputs still match the reference."""
    h = Harness(ReferenceBackend, geometry=ModelGeometry(), size=512, size_swa=128)
    h.enable_graphs([2, 4], mode=ForwardMode.TARGET_VERIFY, tokens_per_req=3)
    rids = [h.add_request() for _ in range(3)]
    h.forward(rids, [6, 9, 4], ForwardMode.EXTEND)
    h.forward(rids, [3, 3, 3], ForwardMode.TARGET_VERIFY)   # bucket 4, padded: checked against the reference
    md = h.backend.forward_metadata
    assert md.graph and md.max_q_len == 3
    w = h.backend.windows[0]
    assert md.windows[w].max_len == w + 2


def test_verify_graph_refuses_requests_of_other_lengths_and_changes_nothing():
    """The static batch gives each request tokens_per_req new tokens: a batch with the right total but other
    per-request lengths (host copies given) is a ShapeError before any static buffer is touched."""
    h = Harness(ReferenceBackend, geometry=ModelGeometry(), size=512, size_swa=128)
    runner = h.enable_graphs([2], mode=ForwardMode.TARGET_VERIFY, tokens_per_req=2)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [6, 9], ForwardMode.EXTEND)
    batch, inputs = h.prepare(rids, [1, 3], ForwardMode.TARGET_VERIFY)
    assert batch.extend_seq_lens_cpu is not None
    before = [t.clone() for t in (runner.req_pool_indices, runner.seq_lens, runner.out_cache_loc)]
    with pytest.raises(ShapeError, match=r"2 new token\(s\) per request; extend_seq_lens are \[1, 3\]"):
        runner.prepare(batch, inputs)
    assert all(torch.equal(a, b) for a, b in zip(before, (runner.req_pool_indices, runner.seq_lens,
                                                           runner.out_cache_loc)))


def test_an_override_without_max_q_len_keeps_working_with_the_token_count_bound():
    """A backend that overrides init_forward_metadata_graph(self, batch) (written before max_q_len) still
    captures and replays verify graphs; its static bound is the batch's token count, as before."""

    class OldSignature(ReferenceBackend):
        def init_forward_metadata_graph(self, batch):
            return super().init_forward_metadata_graph(batch)

    h = Harness(OldSignature, geometry=ModelGeometry(), size=512, size_swa=128)
    h.enable_graphs([2], mode=ForwardMode.TARGET_VERIFY, tokens_per_req=3)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [6, 9], ForwardMode.EXTEND)
    h.forward(rids, [3, 3], ForwardMode.TARGET_VERIFY)   # checked against the reference
    assert h.backend.forward_metadata.graph and h.backend.forward_metadata.max_q_len == 6


def test_a_batch_larger_than_every_bucket_runs_eagerly_with_its_own_lengths():
    """Only a batch that goes through the static buffers must have tokens_per_req per request; a larger
    one runs eagerly with whatever lengths it has (same total), checked against the reference."""
    h = Harness(ReferenceBackend, geometry=ModelGeometry(), size=512, size_swa=128)
    runner = h.enable_graphs([1], mode=ForwardMode.TARGET_VERIFY, tokens_per_req=2)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [6, 9], ForwardMode.EXTEND)
    h.forward(rids, [1, 3], ForwardMode.TARGET_VERIFY)
    assert runner.eager_runs == 1 and not h.backend.forward_metadata.graph


def _kv_rows(h):
    """Every layer's K and V buffers, cloned (a snapshot of both pools)."""
    return {l.layer_id: tuple(b.clone() for b in h.pool.get_kv_buffer(l.layer_id)) for l in h.layers}


def test_padding_a_partial_bucket_writes_only_the_padding_slot():
    """A full bucket leaves every static write slot pointing at a live token; the next, smaller batch in the
    same bucket pads the rest. Padded requests must write the padding slot 0 only: every other slot of both
    pools keeps the previous step's K/V byte for byte, except the new tokens' own slots, which hold their K/V."""
    h = Harness(ReferenceBackend, geometry=ModelGeometry(), size=512, size_swa=128)
    runner = h.enable_graphs([4])
    rids = [h.add_request() for _ in range(4)]
    h.forward(rids, [5, 9, 7, 6], ForwardMode.EXTEND)
    h.release()
    h.forward(rids, [1, 1, 1, 1], ForwardMode.DECODE)  # bucket 4, nothing padded
    h.release()
    before = _kv_rows(h)
    live = rids[:3]
    batch, inputs = h.prepare(live, [1, 1, 1], ForwardMode.DECODE)
    step = runner.prepare(batch, inputs)
    assert step.bucket == 4 and step.num_tokens == 3 and runner.replays == 1  # one request padded
    h.complete(live, [1, 1, 1], inputs, runner.replay(step))  # outputs checked against the reference
    after = _kv_rows(h)
    new_full = batch.out_cache_loc.cpu()
    new_swa = h.allocator.translate_loc_from_full_to_swa(batch.out_cache_loc).cpu()
    for l in h.layers:
        new = new_swa if l.sliding_window else new_full
        keep = torch.ones(before[l.layer_id][0].shape[0], dtype=torch.bool)
        keep[new] = False
        keep[0] = False  # the padding slot
        for kind, old, now, x in zip("kv", before[l.layer_id], after[l.layer_id],
                                     (inputs[f"k{l.layer_id}"], inputs[f"v{l.layer_id}"])):
            changed = (old[keep] != now[keep]).flatten(1).any(1).nonzero().flatten()
            assert changed.numel() == 0, \
                f"layer {l.layer_id} {kind}: slots {keep.nonzero().flatten()[changed].tolist()} were overwritten"
            assert torch.equal(now[new], x.to(now.dtype)), f"layer {l.layer_id} {kind}: a new token's slot"


def test_cpu_compiled_buckets_each_compile_once_past_dynamo_recompile_limit():
    """The CPU adapter (torch.compile) gives each bucket its own compiled function: ten buckets (dynamo recompiles
    one code object at most 8 times, then runs it uncompiled) compile ten graphs, and replays compile nothing."""
    from torch._dynamo.utils import counters

    from hwkv_cpu.backend import TorchCPUBackend
    from hwkv_cpu.graph import CompileGraphAdapter

    h = Harness(TorchCPUBackend, geometry=ModelGeometry(num_layers=2), size=512, size_swa=256)
    buckets = list(range(1, 11))
    counters.clear()
    h.enable_graphs(buckets, CompileGraphAdapter())
    assert counters["stats"]["unique_graphs"] == len(buckets)
    rids = [h.add_request() for _ in buckets]
    h.forward(rids, [3] * len(rids), ForwardMode.EXTEND)
    h.release()
    for n in buckets + buckets[::-1]:  # every bucket, each replay checked against the reference
        h.forward(rids[:n], [1] * n, ForwardMode.DECODE)
        h.release()
    assert h.runner.replays == 2 * len(buckets) and h.runner.eager_runs == 0
    assert dict(counters["frames"]) == {"total": len(buckets), "ok": len(buckets)}
