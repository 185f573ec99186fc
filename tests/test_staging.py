"""StagingRing: per-step host values reach the device in one copy, and a pinned block is never rewritten before
the device read it (HWKV_TEST_DEVICE=cuda runs the second test on the GPU)."""
import os

import pytest
import torch

from hwkv.staging import StagingRing

DEVICE = os.environ.get("HWKV_TEST_DEVICE", "cpu")


def test_the_values_of_each_step_arrive():
    ring = StagingRing(8, torch.device(DEVICE), slots=2)
    dst = torch.full((8,), -1, dtype=torch.int64, device=DEVICE)
    for step in range(5):
        block = ring.next()
        block[:3] = step, step + 1, step + 2
        ring.send(dst[:3])
        assert dst.tolist()[:3] == [step, step + 1, step + 2]
        assert dst.tolist()[3:] == [-1] * 5  # only the first k values are copied


def test_each_send_copies_as_many_values_as_its_destination_holds():
    """Widths change from step to step over the same blocks: each copy takes the block's first len(dst) values."""
    ring = StagingRing(8, torch.device(DEVICE), slots=2)
    dst = torch.full((8,), -1, dtype=torch.int64, device=DEVICE)
    for step, k in enumerate([3, 8, 8, 3, 5, 3, 8]):
        ring.next()[:] = torch.arange(8).numpy() + 10 * step
        dst.fill_(-1)
        ring.send(dst[:k])
        assert dst.tolist() == [10 * step + v for v in range(k)] + [-1] * (8 - k)


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE != "cuda" or not torch.cuda.is_available(), reason="needs HWKV_TEST_DEVICE=cuda and a GPU")
def test_a_block_is_not_rewritten_before_the_device_read_it():
    """The host issues 64 steps while the device is still busy with a long kernel: with 4 blocks, each block is
    reused 16 times, and every step's copy must still deliver that step's values."""
    ring = StagingRing(2, torch.device("cuda"), slots=4)
    outs = torch.zeros(64, 2, dtype=torch.int64, device="cuda")
    torch.cuda._sleep(200_000_000)  # keep the stream busy while the host races ahead
    for step in range(64):
        block = ring.next()
        block[0], block[1] = step, -step
        ring.send(outs[step])
    torch.cuda.synchronize()
    assert outs[:, 0].tolist() == list(range(64)) and outs[:, 1].tolist() == [-s for s in range(64)]


@pytest.mark.cuda
@pytest.mark.skipif(DEVICE != "cuda" or not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs HWKV_TEST_DEVICE=cuda and two GPUs")
def test_a_ring_for_another_gpu_waits_on_that_gpus_copies():
    """A ring bound to cuda:1 while cuda:0 is current (review 34): each block's event is recorded on cuda:1's stream,
    where its copy runs (recorded on the current device's stream, it would complete before the copy, and the block
    could be rewritten under it), and 64 steps behind a busy cuda:1 still deliver each step's values."""
    with torch.cuda.device(0):
        ring = StagingRing(2, torch.device("cuda:1"), slots=4)
        outs = torch.zeros(64, 2, dtype=torch.int64, device="cuda:1")
        with torch.cuda.device(1):
            torch.cuda._sleep(200_000_000)
        for step in range(64):
            block = ring.next()
            block[0], block[1] = step, -step
            ring.send(outs[step])
            assert ring._events[ring._i].device == torch.device("cuda:1")
        torch.cuda.synchronize(1)
    assert outs[:, 0].tolist() == list(range(64)) and outs[:, 1].tolist() == [-s for s in range(64)]


def test_host_blocks_stay_on_the_host_under_a_default_device():
    """Users call torch.set_default_device: the staging blocks and the sampling parameters' host copies are
    host tensors whatever it is."""
    from hwkv.engine.sampling import SamplingParams, params_tensors
    torch.set_default_device("meta")
    try:
        ring = StagingRing(4, torch.device("cpu"), slots=2)
        assert all(b.device.type == "cpu" for b in ring._blocks)
        temp, top_p, seeds, steps = params_tensors([SamplingParams(seed=3)], [5], torch.device("cpu"))
        assert temp.device.type == seeds.device.type == "cpu" and int(steps[0]) == 5
    finally:
        torch.set_default_device(None)
