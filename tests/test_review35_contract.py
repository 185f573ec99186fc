"""Review 35 (the contract suite itself): broken backends the contract suite passes.

Method: one realistic bug per backend (a subclass of the reference backend or of the CPU backend), the contract suite
(`hwkv.testing.contract`, `from hwkv.testing.contract import *` with a `hwkv_target` fixture) run against each.
Caught, no test here: window W+1 and W-1 keys, SWA layers reading full locs from the SWA buffer, sinks ignored,
soft-cap ignored, decode over seq_len - 1 keys, extend ignoring the prefix, GQA heads mapped h % kvh, fp8 scales
ignored and K's scale used for V, a verify tree read causally, write locs translated again per layer (through the loc
cache or the pool), an SWA layer storing K but not V, a graph refill reusing the first refill's metadata or window
lists, eager metadata built in the refill (the capture check), one `.item()` per eager layer.

Each test below builds one broken backend that survived, shows that the bug is there (outside the contract), then
runs the contract test that catches it now (the table-read checks in `test_layers_never_translate` and
`test_one_translation_per_forward_with_many_swa_layers[eager]`, and the new
`test_graph_steps_read_the_device_no_more_than_the_template`); before those checks each failed with "GAP: ...".
CPU tensors, tiny shapes.
"""
from __future__ import annotations

import pytest

from hwkv.batch import ForwardMode
from hwkv.errors import HwkvError
from hwkv.graph import EagerAdapter
from hwkv.metadata import KVIndexList
from hwkv.testing import ContractTarget
from hwkv.testing import contract
from hwkv.testing.host_reads import HostReads, StorageReads
from hwkv.testing.reference_backend import ReferenceBackend
from hwkv_cpu.backend import TorchCPUBackend

pytestmark = pytest.mark.usefixtures("one_thread")


def _contract_catches(test, *args, **kwargs):
    """Run one contract test function against a broken target; fail with GAP where it passes."""
    try:
        test(*args, **kwargs)
    except (AssertionError, HwkvError) as e:   # (ReferenceMismatchError, StaleCaptureError, ...)
        return e
    pytest.fail(f"GAP: hwkv.testing.contract.{test.__name__} passed a broken backend")


def _layers_table_reads(target) -> int:
    """Ops of one eager forward's layers (6 SWA of 7, MANY_SWA) that read the pool's full->SWA table."""
    h = contract.make(target, contract.MANY_SWA)
    rid = h.add_request()
    batch = h.make_batch([rid], [4], ForwardMode.EXTEND)
    h.backend.init_forward_metadata(batch)
    with StorageReads(h.pool.full_to_swa_index_mapping) as reads:
        h.model_step(batch, h.random_inputs(4))
    return reads.count


# ---- 1. every SWA layer translates its window itself, reading full_to_swa_index_mapping -------------------------
class _TranslatesWindowPerLayer(ReferenceBackend):
    """SWA layers ignore the window list's SWA slots and translate the full list through the pool's
    full->SWA table in the layer (every layer, every forward); the kernels' window mask trims it. Outputs are
    right; the translation is once per SWA layer, not once per forward."""

    def _attend(self, q, layer, kv, md, out):
        if kv.is_swa_slots:
            mapping = self.pool.full_to_swa_index_mapping
            kv = KVIndexList(md.full.indptr, mapping[md.full.indices], md.full.pos0, kv.window, md.full.max_len, True)
        super()._attend(q, layer, kv, md, out)

    forward_decode = _attend
    forward_extend = _attend


def test_layers_translating_their_window_through_the_table_fail_the_contract():
    """Bug: SWA layers translate full locs to SWA slots themselves (a kernel that reads `full_to_swa_index_mapping`
    per layer, as an "in-kernel translation" port would), so a forward makes one translation per SWA layer.
    docs/architecture.md: "the metadata step does that once per forward (the write slots and each window list), the
    layers never do"; README: "exactly once".

    Should have caught it: `test_layers_never_translate` (and `test_one_translation_per_forward_with_many_swa_layers`).
    Why not: both count calls of `pool.translate_loc_from_full_to_swa` (`CountingTranslate`) and the backend's own
    counters (`loc_cache.translations`, `window_translations`); a layer that indexes the pool's table directly calls
    neither. Outputs equal the reference, so no other test sees it. Suggested check (hwkv/testing/contract.py:122,
    `test_layers_never_translate`): also assert that no op during `h.model_step` reads the storage of
    `h.pool.full_to_swa_index_mapping` (a TorchDispatchMode like `StorageReads`, or swap the table for a
    poisoned one while the layers run)."""
    target = ContractTarget("translates-per-layer", _TranslatesWindowPerLayer, "cpu", EagerAdapter)
    assert _layers_table_reads(target) == 6, "the bug: each of the 6 SWA layers reads the full->SWA table"
    _contract_catches(contract.test_layers_never_translate, target)


class _RetranslatesWriteLocsPerLayer(TorchCPUBackend):
    """Every SWA layer translates the write locs again through the full->SWA table, into the forward's own swa_loc
    tensor (a fused store kernel's way): the same values and the same object, one translation per layer."""

    def forward(self, q, k, v, layer, batch, save_kv_cache=True):
        md = self.forward_metadata
        if layer.window and md.write_loc.swa_loc is not None:
            md.write_loc.swa_loc.copy_(self.pool.full_to_swa_index_mapping[md.write_loc.loc])
        return super().forward(q, k, v, layer, batch, save_kv_cache)


def test_write_locs_translated_again_per_layer_through_the_table_fail_the_contract():
    """Bug: every SWA layer re-translates the write locs (`mapping[loc]`) into the handed swa_loc tensor. "Exactly
    once per forward" (README line 7) is broken; the stored K/V land where they should.

    Should have caught it: `test_one_translation_per_forward_with_many_swa_layers` ("write locs translated more than
    once"). Why not: it counts `translate_loc_from_full_to_swa` calls and `loc_cache.translations`; the layer's
    gather through the table is neither, and `test_swa_layer_writes_exactly_the_swa_loc_it_was_handed` checks the
    object's identity, which an in-place copy keeps. Suggested check: the table-read check of the test above
    (hwkv/testing/contract.py:122), or the same inside test_one_translation_per_forward (contract.py:88)."""
    target = ContractTarget("retranslates-write-locs", _RetranslatesWriteLocsPerLayer, "cpu", EagerAdapter)
    assert _layers_table_reads(target) == 6, "the bug: each of the 6 SWA layers reads the full->SWA table"
    _contract_catches(contract.test_one_translation_per_forward_with_many_swa_layers, target, False)


# ---- 2. host reads in graph mode -----------------------------------------------------------------------------
class _SyncsInGraphRefill(TorchCPUBackend):
    """The graph refill reads a device value back every step (the longest request, for a kernel bound)."""

    def init_kernel_metadata(self, md, batch, graph):
        if graph:
            md.extra["longest"] = int(batch.seq_lens.max())   # one host sync per replay
        super().init_kernel_metadata(md, batch, graph)


def _refill_reads(cls) -> int:
    """Host reads of one graph refill (`GraphRunner.prepare` of a 3-request decode) with backend `cls`."""
    h = contract.make(ContractTarget("x", cls, "cpu", EagerAdapter), graph=True, buckets=(1, 2, 4))
    rids = [h.add_request() for _ in range(3)]
    h.forward(rids, [5, 9, 3])
    batch, inputs = h.prepare(rids, [1, 1, 1], ForwardMode.DECODE)
    with HostReads() as r:
        step = h.runner.prepare(batch, inputs)
    h.complete(rids, [1, 1, 1], inputs, h.runner.replay(step))
    return r.count


def test_a_graph_refill_that_syncs_every_step_fails_the_contract():
    """Bug: `init_kernel_metadata(graph=True)` does `int(batch.seq_lens.max())`, a host sync before every replay.
    `init_forward_metadata_graph` (hwkv/backend.py:483): "Refill the static buffers in place ...: no allocation of
    index storage, no host sync"; docs/architecture.md (draft graphs): "refills them in place ..., no host sync".

    Should have caught it: the graph tests (`test_one_translation_per_forward_with_many_swa_layers[graph]`, the
    refill tests). Why not: no contract test counts host reads around a graph refill; the only host-read test
    (`test_layers_read_the_device_no_more_with_more_layers`) runs eagerly and counts the layers only. Outputs are
    right. Suggested check (a graph test near hwkv/testing/contract.py:159): count `HostReads` around
    `h.runner.prepare(...)` and assert it is no more than the reference backend's count for the same batch (the
    template's CPU value check makes 1 on the CPU, 0 on a device)."""
    assert _refill_reads(_SyncsInGraphRefill) > _refill_reads(ReferenceBackend), "the bug: an extra read per refill"
    _contract_catches(contract.test_graph_steps_read_the_device_no_more_than_the_template,
                      ContractTarget("syncs-in-refill", _SyncsInGraphRefill, "cpu", EagerAdapter))


class _SyncsPerLayerInGraph(TorchCPUBackend):
    """Graph mode only: every layer reads its list's length back to the host (eager forwards read nothing)."""

    def forward_decode(self, q, layer, kv, md, out):
        if md.graph:
            int(kv.indptr[md.batch_size])
        super().forward_decode(q, layer, kv, md, out)

    def forward_extend(self, q, layer, kv, md, out):
        if md.graph:
            int(kv.indptr[md.batch_size])
        super().forward_extend(q, layer, kv, md, out)


def test_layers_reading_the_device_only_in_graph_mode_fail_the_contract():
    """Bug: each layer reads a device value in graph mode (a graph break per layer under the CPU's compile adapter; a
    capture error on a device graph), none eagerly. "Host work once per forward, not per layer" (the contract's
    section header, hwkv/testing/contract.py:133).

    Should have caught it: `test_layers_read_the_device_no_more_with_more_layers`. Why not: it runs eager forwards
    only (`init_forward_metadata` + `model_step`); nothing counts the reads of a graph replay, where `md.graph` is
    True. Suggested check (hwkv/testing/contract.py:136): parametrize it over graph=True as well, counting
    `HostReads` around `h.runner.replay(...)` for 2 and 8 layers."""
    target = ContractTarget("syncs-per-layer-in-graph", _SyncsPerLayerInGraph, "cpu", EagerAdapter)
    h = contract.make(target, graph=True, buckets=(1, 2, 4))
    rids = [h.add_request() for _ in range(3)]
    h.forward(rids, [5, 9, 3])
    batch, inputs = h.prepare(rids, [1, 1, 1], ForwardMode.DECODE)
    step = h.runner.prepare(batch, inputs)
    with HostReads() as r:
        flat = h.runner.replay(step)
    h.complete(rids, [1, 1, 1], inputs, flat)
    assert r.count == len(h.layers), "the bug: one device read per layer in a replay"
    _contract_catches(contract.test_graph_steps_read_the_device_no_more_than_the_template, target)
