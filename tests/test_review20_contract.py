"""The contract suite's check that layers read the device no more often with more layers
(`hwkv.testing.contract.test_layers_read_the_device_no_more_with_more_layers`) fails on a backend whose layers read a
device value each, and `HostReads` counts what it says it counts."""
import pytest
import torch

from hwkv.graph import EagerAdapter
from hwkv.testing import ContractTarget
from hwkv.testing import contract
from hwkv.testing.host_reads import HostReads, _device_to_host
from hwkv.testing.reference_backend import ReferenceBackend


class _ReadsPerLayer(ReferenceBackend):
    """The reference backend with one `.item()` of its list's length in every layer's decode and extend."""

    def forward_decode(self, q, layer, kv, md, out):
        int(kv.indptr[-1])
        return super().forward_decode(q, layer, kv, md, out)

    def forward_extend(self, q, layer, kv, md, out):
        kv.indptr[-1].item()
        return super().forward_extend(q, layer, kv, md, out)


@pytest.mark.parametrize("geometry", [dict()], ids=["plain"])
def test_a_backend_reading_the_device_in_every_layer_fails_the_contract(geometry):
    target = ContractTarget("reads-per-layer", _ReadsPerLayer, "cpu", EagerAdapter)
    with pytest.raises(AssertionError, match="some layer reads the device"):
        contract.test_layers_read_the_device_no_more_with_more_layers(target, geometry)


def test_host_reads_counts_scalar_reads_and_blocking_device_to_host_copies():
    x = torch.arange(6)
    with HostReads() as r:
        x[0].item()
        bool(x[1] > 0)
        x.nonzero()
        x.sum()  # no read
    assert r.count == 3 and r.ops[0] == "aten._local_scalar_dense.default"
    # device-to-host copies, judged on the op's arguments (a meta tensor stands for a device one: no data to copy)
    meta, host = torch.empty(4, device="meta"), torch.empty(4)
    assert _device_to_host("aten._to_copy.default", (meta,), {"device": torch.device("cpu")})
    assert not _device_to_host("aten._to_copy.default", (meta,), {"device": torch.device("cpu"), "non_blocking": True})
    assert not _device_to_host("aten._to_copy.default", (host,), {"device": torch.device("meta")})
    assert _device_to_host("aten.copy_.default", (host, meta), {})
    assert not _device_to_host("aten.copy_.default", (host, meta, True), {})
    assert not _device_to_host("aten.copy_.default", (meta, host), {})


def test_reference_check_skips_a_whole_step_graphs_padded_rows():
    """ReferenceCheck over an engine whose decode steps replay whole-step graphs padded to their bucket (3 requests
    in bucket 4): the padding row is no request and is not checked (it had stopped the run with `no running request
    holds row 0`); every real request is checked."""
    from hwkv.engine.engine import Engine
    from hwkv.engine.pools import build_cache, plan_pools
    from hwkv.engine.presets import ModelShape, layer_pattern
    from hwkv.engine.sampling import SamplingParams
    from hwkv.engine.stats import RunnerStats
    from hwkv.engine.synthetic import ReferenceCheck, SyntheticModel, engine_history

    cpu = torch.device("cpu")
    shape = ModelShape(name="t", layer_is_swa=layer_pattern(2, "sf"), window=4, num_heads=2, num_kv_heads=1,
                       head_dim=8, dtype_bytes=4)
    plan = plan_pools(shape, context=48, max_running=4, chunk=16, page_size=4, memory=None, device=cpu,
                      prefix_cache=True)
    cache = build_cache(shape, plan, torch.float32, cpu, backend_device="cpu")
    model = SyntheticModel(shape, cache.backend, vocab_size=11, dtype=torch.float32, device=cpu,
                           positions=cache.rtt.max_context_len, seed=0)
    e = Engine(cache, model, stats=RunnerStats(shape, plan), vocab_size=11, window=4, prefix_cache=True,
               graph_adapter=EagerAdapter(), graph_choice="eager", whole_step=True)
    model.check = ReferenceCheck(model, engine_history(e), every=1, requests=4)
    res = e.generate([[1, 2, 3, 4, 5], [2, 3, 4, 5, 6], [3, 4, 5, 6, 7]], SamplingParams(max_new_tokens=4))
    assert [len(r.tokens) for r in res] == [4, 4, 4]
    assert e.stats.graph_replays > 0 and model.check.forwards_checked > 0
    assert model.check.requests_checked >= 3 * model.check.forwards_checked - 3  # prefill forwards may hold fewer
