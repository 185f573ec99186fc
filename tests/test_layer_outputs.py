"""An eager decode forward's attention outputs are one allocation (hwkv.metadata.LayerOutputs): each layer's first
call takes its own view of it; nothing a caller holds is ever handed out again."""
import torch

from hwkv.batch import ForwardMode
from hwkv.metadata import LayerOutputs
from hwkv.testing.harness import Harness, ModelGeometry
from hwkv_cpu.backend import TorchCPUBackend


def _decode_forward(layers=4):
    g = ModelGeometry(num_layers=layers, swa_every=2, window=8, num_heads=2, num_kv_heads=1, head_dim=16)
    h = Harness(TorchCPUBackend, geometry=g, size=256, size_swa=64)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [9, 4], ForwardMode.EXTEND)
    batch = h.make_batch(rids, [1, 1], ForwardMode.DECODE)
    h.backend.init_forward_metadata(batch)
    return h, batch


def _call(h, batch, layer):
    q = torch.randn(2, layer.num_heads, layer.head_dim)
    k = torch.randn(2, layer.num_kv_heads, layer.head_dim)
    return h.backend.forward(q, k, k.clone(), layer, batch)


def test_the_layers_of_a_decode_forward_share_one_allocation_and_never_an_output():
    h, batch = _decode_forward()
    outs = [_call(h, batch, layer) for layer in h.layers]
    base = {o.untyped_storage().data_ptr() for o in outs}
    assert len(base) == 1, "one allocation for the forward's layers"
    assert len({o.data_ptr() for o in outs}) == len(outs), "each layer its own rows"
    kept = outs[0].clone()
    again = _call(h, batch, h.layers[0])  # a layer called twice in one forward gets a tensor of its own
    assert again.untyped_storage().data_ptr() not in base and torch.equal(outs[0], kept)
    h.backend.init_forward_metadata(batch)  # the next forward: a new allocation, the old outputs untouched
    nxt = _call(h, batch, h.layers[0])
    assert nxt.untyped_storage().data_ptr() not in base and torch.equal(outs[0], kept)


def test_outputs_of_another_shape_or_past_the_bound_are_allocated_alone():
    outs = LayerOutputs(3)
    q = torch.zeros(2, 4, 8)
    a = outs.take(0, q, 2, 4, 8)
    assert outs.take(1, q.half(), 2, 4, 8).untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    assert outs.take(2, q, 2, 4, 16).shape == (2, 4, 16)
    big = LayerOutputs(36)
    q = torch.zeros(1, 1, 1)
    t = LayerOutputs.MAX_BYTES // 36 // 4 + 1  # 36 fp32 outputs of this many rows pass the bound
    first, second = big.take(0, q, t, 1, 1), big.take(1, q, t, 1, 1)
    assert big.key is None and first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
