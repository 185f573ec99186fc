"""ForwardBatch: shape checks, and host lengths taken from the engine's copies without a device read."""
import pytest
import torch

from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.errors import ShapeError


def meta(*vals):
    """A device tensor that cannot be read back: any host sync on it raises."""
    return torch.tensor(vals).to("meta")


def test_host_lens_use_the_engines_copies_without_a_device_read():
    dec = ForwardBatch(ForwardMode.DECODE, 2, meta(0, 1), meta(5, 9), meta(3, 4), seq_lens_cpu=torch.tensor([5, 9]))
    seq, ext = dec.host_lens()
    assert seq.tolist() == [5, 9] and ext.tolist() == [1, 1]
    ext_b = ForwardBatch(ForwardMode.EXTEND, 2, meta(0, 1), meta(5, 9), meta(1, 2, 3), extend_seq_lens=meta(2, 1),
                         seq_lens_cpu=torch.tensor([5, 9]), extend_seq_lens_cpu=torch.tensor([2, 1]))
    assert [t.tolist() for t in ext_b.host_lens()] == [[5, 9], [2, 1]]
    with pytest.raises(NotImplementedError):  # without the copies it must read the device
        ForwardBatch(ForwardMode.DECODE, 2, meta(0, 1), meta(5, 9), meta(3, 4)).host_lens()


def test_shape_errors_name_the_field():
    with pytest.raises(ShapeError, match="seq_lens has 1 entries, batch_size is 2"):
        ForwardBatch(ForwardMode.DECODE, 2, torch.tensor([0, 1]), torch.tensor([3]), torch.tensor([1, 2]))
    with pytest.raises(ShapeError, match="needs extend_seq_lens"):
        ForwardBatch(ForwardMode.EXTEND, 1, torch.tensor([0]), torch.tensor([3]), torch.tensor([1, 2, 3]))
    with pytest.raises(ShapeError, match="one token per request"):
        ForwardBatch(ForwardMode.DECODE, 1, torch.tensor([0]), torch.tensor([3]), torch.tensor([1, 2]))
