"""Allocators on a real accelerator (no host sync on the hot path) and everywhere without relying
on torch's default device (`torch.set_default_device`)."""
import pytest
import torch

from hwkv.allocator import SWATokenToKVPoolAllocator, same_snapshot
from hwkv.release import release_out_of_window_batch
from hwkv.req_to_token import ReqToTokenPool
from hwkv.errors import DoubleFreeError
from hwkv.pool import SWAKVPool

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")


def _engine_steps(dev, page, bs=8, prompt=40, steps=24, window=16, sync_check=None):
    """Prefill bs requests, decode `steps` steps with batched release; returns the allocator."""
    size, size_swa = 4096, 1024
    pool = SWAKVPool(size, size_swa, page, torch.float32, 1, 4, [0], [1], dev)
    a = SWATokenToKVPoolAllocator(size, size_swa, page, dev, pool)
    rtt = ReqToTokenPool(bs, 256, dev)
    rows = torch.arange(bs, device=dev)
    frontiers = torch.zeros(bs, dtype=torch.int64, device=dev)
    seq_cpu = torch.full((bs,), prompt, dtype=torch.int64, device="cpu")
    zeros = torch.zeros(bs, dtype=torch.int64, device=dev)
    loc = a.alloc_extend(zeros, seq_cpu.to(dev), zeros, bs * prompt, prefix_lens_cpu=torch.zeros(bs, dtype=torch.int64, device="cpu"),
                         seq_lens_cpu=seq_cpu)
    rtt.req_to_token[:, :prompt] = loc.view(bs, prompt)
    seq = seq_cpu.to(dev)
    for step in range(steps):
        ctx = sync_check() if sync_check and step >= 2 else None
        seq_cpu, seq = seq_cpu + 1, seq + 1
        last = rtt.req_to_token[rows, seq - 2]
        new = a.alloc_decode(seq, last, seq_lens_cpu=seq_cpu)
        rtt.req_to_token[rows, seq - 1] = new
        release_out_of_window_batch(a, rtt.req_to_token, rows, seq, frontiers, window)
        if ctx:
            ctx.__exit__(None, None, None)
    a.check_integrity()
    m = a.full_to_swa_index_mapping
    for r in range(bs):
        s, f = int(seq_cpu[r]), int(frontiers[r])
        assert f <= s - window + 1 and bool((m[rtt.req_to_token[r, f:s]] > 0).all())
    return a, rtt, seq_cpu


class _NoSync:
    """torch.cuda sync debug mode 'error': any synchronizing call inside raises."""

    def __init__(self):
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(0)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("page", [1, 16])
def test_decode_step_allocates_and_releases_without_host_sync(page):
    a, rtt, seq_cpu = _engine_steps("cuda", page, sync_check=_NoSync)
    with_free = _NoSync()
    try:
        a.free(rtt.req_to_token[0, :int(seq_cpu[0])].clone())  # a request finishes: no sync either
    finally:
        with_free.__exit__()
    a.check_integrity()


@cuda
@pytest.mark.cuda
def test_device_double_free_is_reported_at_the_next_sync_and_changes_nothing():
    a, rtt, seq_cpu = _engine_steps("cuda", 4)
    loc = rtt.req_to_token[0, :int(seq_cpu[0])].clone()
    a.free(loc)
    before = a.integrity_snapshot()
    a.free(loc)  # deferred: recorded on the device
    with pytest.raises(DoubleFreeError, match="already free"):
        a.available_size()
    after = a.integrity_snapshot()
    assert same_snapshot(before, after)  # rings, reference counts and the full->SWA table
    a.check_integrity()


def test_host_bookkeeping_names_its_device(monkeypatch):
    """Everything keeps working when the user made another device the default (meta: any tensor
    created without naming its device lands there and fails loudly)."""
    from hwkv.graph import EagerAdapter
    from hwkv.testing.harness import Harness, ModelGeometry, run_scenario
    from hwkv_cpu.backend import TorchCPUBackend

    torch.set_default_device("meta")
    try:
        _engine_steps("cpu", 4, steps=6)
        h = Harness(TorchCPUBackend, "cpu", ModelGeometry(), size=512, size_swa=96, page_size=4)
        h.enable_graphs([1, 4], EagerAdapter())
        run_scenario(h, steps=6)
        # the chunked kernels (the dense path off: what graphs and large batches run) plan on the host too
        h = Harness(TorchCPUBackend, "cpu", ModelGeometry(), size=512, size_swa=96, page_size=4,
                    dense_max_elements=0)
        run_scenario(h, steps=6)
    finally:
        torch.set_default_device(None)


def test_allocator_and_an_eager_decode_forward_without_host_lengths_under_a_meta_default_device():
    """A DECODE batch without host copies of its lengths (ForwardBatch.host_lens makes the extend lengths
    itself) through the CPU backend while torch's default device is meta: every tensor hwkv makes names
    its device, so nothing lands on meta."""
    import hwkv
    from hwkv.batch import ForwardBatch, ForwardMode
    from hwkv.layer import AttentionLayer

    torch.set_default_device("meta")
    try:
        cpu, page, bs = torch.device("cpu"), 4, 2
        pool = SWAKVPool(64, 32, page, torch.float32, 2, 8, [0], [1], cpu)
        a = SWATokenToKVPoolAllocator(64, 32, page, cpu, pool)
        rtt = ReqToTokenPool(bs, 32, cpu)
        backend = hwkv.make_backend(pool, rtt, device="cpu", sliding_window=4)
        layers = [AttentionLayer(0, 2, 2, 8, sliding_window=4), AttentionLayer(1, 2, 2, 8)]
        prompt = a.alloc_extend([0, 0], [5, 3], [0, 0], 8)
        rtt.write(0, 0, prompt[:5])
        rtt.write(1, 0, prompt[5:])
        rows = torch.tensor([0, 1], device=cpu)
        seq = torch.tensor([6, 4], device=cpu)
        loc = a.alloc_decode(seq, rtt.req_to_token[rows, seq - 2])
        rtt.req_to_token[rows, seq - 1] = loc
        batch = ForwardBatch(ForwardMode.DECODE, bs, rows, seq, loc)  # no seq_lens_cpu
        backend.init_forward_metadata(batch)
        for layer in layers:
            q, k, v = (torch.randn(bs, 2, 8, device=cpu) for _ in range(3))
            out = backend.forward(q, k, v, layer, batch)
            assert out.device == cpu and out.shape == (bs, 2, 8) and bool(torch.isfinite(out).all())
        a.check_integrity()
        assert same_snapshot(a.integrity_snapshot(), a.integrity_snapshot())
    finally:
        torch.set_default_device(None)
