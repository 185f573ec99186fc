"""The contract suite's check that layers read the device no more often with more layers
(`hwkv.testing.contract.test_layers_read_the_device_no_more_with_more_layers`) fails on a backend whose layers read a
device value each, and `HostReads` counts what it says it counts."""
import pytest
import torch

from hwkv.graph import EagerAdapter
from hwkv.testing import ContractTarget
from hwkv.testing import contract
from hwkv.testing.host_reads import HostReads
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
    meta = torch.empty(4, device="meta")
    with HostReads() as r:  # a device (meta here) tensor copied to the host, blocking; and one copied non_blocking
        try:
            meta.to("cpu")
        except NotImplementedError:  # meta holds no data: the op is counted as it dispatches
            pass
        try:
            torch.empty(4).copy_(meta, non_blocking=True)
        except NotImplementedError:
            pass
    assert r.count == 1, r.ops
