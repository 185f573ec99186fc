"""Re-review 3 of review 35's contract change (6ae3a4b: `StorageReads`, the table-read checks, the graph-step reads
test).

Each test below fails on the change as it stands: one false pass (a layer reading the full->SWA table that the new
check does not see) and two false failures (correct backends the new checks fail). CPU tensors, tiny shapes.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_flatten
from torch.utils._python_dispatch import TorchDispatchMode

from hwkv.batch import ForwardMode
from hwkv.errors import HwkvError
from hwkv.graph import EagerAdapter
from hwkv.metadata import KVIndexList
from hwkv.testing import ContractTarget
from hwkv.testing import contract
from hwkv.testing.reference_backend import ReferenceBackend
from hwkv_cpu.backend import TorchCPUBackend

pytestmark = pytest.mark.usefixtures("one_thread")


class _AnyTableRead(TorchDispatchMode):
    """Counts the ops whose arguments hold a tensor on `t`'s storage anywhere (nested lists included)."""

    def __init__(self, t: torch.Tensor) -> None:
        super().__init__()
        self.ptr, self.ops = t.untyped_storage().data_ptr(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        leaves, _ = tree_flatten((args, kwargs or {}))
        if any(isinstance(a, torch.Tensor) and a.layout == torch.strided and not a.is_nested
               and a.untyped_storage().data_ptr() == self.ptr for a in leaves):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


# ---- 1. false pass: the table read as an index list ----------------------------------------------------------------
class _GathersTheSwaBufferThroughTheTable(ReferenceBackend):
    """SWA layers gather their K/V buffer into full-slot order through the table (`k_buf[mapping]`, every layer,
    every forward) and attend over the full list: a per-layer translation. Outputs are right."""

    def _attend(self, q, layer, kv, md, out):  # noqa: ANN001
        self._full_order = None
        if kv.is_swa_slots:
            m = self.pool.full_to_swa_index_mapping
            k_buf, v_buf = super().kv_buffers(layer)
            self._full_order = (k_buf[m], v_buf[m])   # aten.index.Tensor(k_buf, [m]): the table is in a list argument
            kv = KVIndexList(md.full.indptr, md.full.indices, md.full.pos0, kv.window, md.full.max_len, False)
        super()._attend(q, layer, kv, md, out)

    def kv_buffers(self, layer):  # noqa: ANN001
        return self._full_order if getattr(self, "_full_order", None) is not None else super().kv_buffers(layer)

    forward_decode = _attend
    forward_extend = _attend


def test_layers_reading_the_table_as_an_index_list_fail_test_layers_never_translate():
    """hwkv/testing/host_reads.py:62 (`StorageReads.__torch_dispatch__`) scans `(*args, *kwargs.values())` only one
    level deep, so a tensor inside a list argument is never seen: `aten.index.Tensor(self, indices: Tensor?[])`,
    `index_put_`, `cat`, `stack`. Here every SWA layer indexes its buffer with the whole table (`k_buf[mapping]`),
    i.e. translates per layer, and `test_layers_never_translate` passes it.
    Expected: the contract test fails. Fix: flatten the arguments (`torch.utils._pytree.tree_flatten((args, kwargs))`)
    before comparing storages."""
    target = ContractTarget("gathers-through-table", _GathersTheSwaBufferThroughTheTable, "cpu", EagerAdapter)
    h = contract.make(target, contract.MANY_SWA)
    rid = h.add_request()
    h.forward([rid], [6], ForwardMode.EXTEND)   # outputs match the reference
    batch = h.make_batch([rid], [4], ForwardMode.EXTEND)
    h.backend.init_forward_metadata(batch)
    with _AnyTableRead(h.pool.full_to_swa_index_mapping) as reads:
        h.model_step(batch, h.random_inputs(4))
    assert len(reads.ops) == 12, f"the bug: 6 SWA layers x (K, V) read the table: {reads.ops}"
    try:
        contract.test_layers_never_translate(target)
    except (AssertionError, HwkvError):
        return
    pytest.fail("GAP: test_layers_never_translate passed layers that index their buffer with the full->SWA table")


# ---- 2. false failure: a layer op on a tensor without plain storage ---------------------------------------------
class _PacksOutputsJagged(ReferenceBackend):
    """Correct outputs; each layer also views its per-request output rows as a jagged nested tensor (the varlen
    form torch's SDPA and vendor varlen ops take) and reduces it."""

    def _attend(self, q, layer, kv, md, out):  # noqa: ANN001
        super()._attend(q, layer, kv, md, out)
        rows = torch.nested.nested_tensor_from_jagged(out.flatten(1), md.qo_indptr[:md.batch_size + 1].long())
        self.last_row_sums = rows.sum(dim=-1)   # an op on the NJT

    forward_decode = _attend
    forward_extend = _attend


def test_a_layer_op_on_a_jagged_nested_tensor_does_not_crash_the_table_read_check():
    """hwkv/testing/host_reads.py:62 calls `a.untyped_storage().data_ptr()` on every tensor argument; a jagged nested
    tensor (a wrapper subclass, which a mode sees before it unwraps) has no such storage: "Attempted to access the
    data pointer on an invalid python storage" (RuntimeError; a sparse tensor gives NotImplementedError "Cannot access
    storage of SparseTensorImpl"). A correct backend whose layers use an NJT fails `test_layers_never_translate` (and
    the [eager] translation test) with an error out of the checker.
    Expected: passes. Fix: skip tensors whose storage cannot be read (try/except around `untyped_storage()`, or
    compare only `layout == torch.strided and not is_nested` tensors, unwrapping subclasses via
    `__tensor_flatten__`)."""
    target = ContractTarget("jagged-layers", _PacksOutputsJagged, "cpu", EagerAdapter)
    h = contract.make(target, contract.MANY_SWA)
    rid = h.add_request()
    h.forward([rid], [6], ForwardMode.EXTEND)   # correct outside the checker
    contract.test_layers_never_translate(target)


# ---- 3. false failure: a graph refill reading the runner's host copies --------------------------------------
class _HostMaxLenInRefill(TorchCPUBackend):
    """The graph refill reads the longest length from the runner's host copy (`batch.host_lens()`: "the runner's host
    copies when the engine gave them: no sync", as NPUBackend's graph plan reads them), e.g. for a vendor op that takes
    a host bound updated before each replay. No device tensor is read."""

    def init_kernel_metadata(self, md, batch, graph):  # noqa: ANN001
        if graph:
            assert batch.seq_lens_cpu is not None and batch.seq_lens_cpu.device.type == "cpu"
            md.extra["host_max_len"] = int(batch.host_lens()[0].max())   # a host tensor: no sync on any device
        super().init_kernel_metadata(md, batch, graph)


def test_a_graph_refill_reading_only_host_copies_passes_the_graph_reads_test():
    """`test_graph_steps_read_the_device_no_more_than_the_template` (hwkv/testing/contract.py:199-214) counts with
    `HostReads`, which counts every `_local_scalar_dense` / `is_nonzero` / `nonzero`, of host tensors too
    (host_reads.py:15, 41). The template reads its host copies through numpy so that nothing is counted; a backend
    reading the same host copy with a torch op (`int(seq_lens_cpu.max())`) is failed as "the refill syncs with the
    host", on CPU (2 > the template's 1) and on a device alike (1 > 0: a CPU tensor's item is no device read).
    Expected: passes. Fix: on a non-CPU device count only reads of device tensors (`args[0].device.type != "cpu"`);
    on the CPU, mark the runner's host copies (`runner.seq_lens_cpu`, `runner.extend_seq_lens_cpu`) and what ops
    whose tensor inputs are all marked produce (keep them alive, or storages get reused), and skip reads of marked
    tensors (checked: this passes, and review 35's refill-sync and graph-only-layer-read backends still fail). A
    storage match at the read alone is not enough: `int(seq.max())` reads the fresh `max()` result."""
    contract.test_graph_steps_read_the_device_no_more_than_the_template(
        ContractTarget("host-max-len", _HostMaxLenInRefill, "cpu", EagerAdapter))
