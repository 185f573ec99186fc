"""Graph capture runs with Python's garbage collector paused.

Since torch 2.9 `torch.cuda.graph` no longer collects before a capture, so a graph of an earlier
runner left in a reference cycle can be destroyed by an automatic collection *during* a later
capture: the driver forbids that call while a stream captures, and the capture fails with
"operation failed due to a previous error during capture" (seen intermittently on an H100 when
several CUDA test files ran in one process).
"""
import gc
import types

import pytest
import torch

from hwkv.graph import TorchDeviceGraphAdapter, gc_paused


class _FakeGraph:
    def pool(self):
        return "pool"


class _Module(types.SimpleNamespace):
    """Stands in for `torch.cuda`: records whether the collector ran enabled inside capture."""


def _fake_module(seen):
    class _Capture:
        def __init__(self, g, pool=None, stream=None):
            pass

        def __enter__(self):
            seen.append(("enter", gc.isenabled()))

        def __exit__(self, *exc):
            seen.append(("exit", gc.isenabled()))
            return False

    return _Module(CUDAGraph=_FakeGraph, graph=_Capture, Stream=lambda: "stream")


@pytest.fixture
def fake_adapter(monkeypatch):
    seen = []
    monkeypatch.setattr(torch, "hwkvfakegpu", _fake_module(seen), raising=False)

    class Adapter(TorchDeviceGraphAdapter):
        module = "hwkvfakegpu"

    return Adapter(), seen


@pytest.mark.parametrize("enabled_before", [True, False])
def test_capture_pauses_the_collector_and_restores_it(fake_adapter, enabled_before):
    adapter, seen = fake_adapter
    inside = []
    was = gc.isenabled()
    (gc.enable if enabled_before else gc.disable)()
    try:
        handle, out = adapter.capture(lambda: inside.append(gc.isenabled()) or torch.zeros(1, device="cpu"))
        assert inside == [False]
        assert seen == [("enter", False), ("exit", False)]
        assert gc.isenabled() is enabled_before
    finally:
        (gc.enable if was else gc.disable)()


def test_capture_restores_the_collector_when_the_model_raises(fake_adapter):
    adapter, _ = fake_adapter
    assert gc.isenabled()

    def boom():
        raise RuntimeError("model failed")

    with pytest.raises(RuntimeError, match="model failed"):
        adapter.capture(boom)
    assert gc.isenabled()


def test_gc_paused_nests():
    assert gc.isenabled()
    with gc_paused():
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


class _Cycle:
    def __init__(self, obj):
        self.obj = obj
        self.me = self


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")
def test_a_graph_left_unreachable_during_a_capture_does_not_break_it():
    """An earlier capture's graph becomes unreachable (in a cycle) while a later capture runs, with a collection
    due at every allocation: the capture must succeed (the collector waits until it is over) and replay."""
    from hwkv_cuda.graph import CUDAGraphAdapter

    old = CUDAGraphAdapter()
    holder = [old.capture(lambda: torch.ones(4, device="cuda") * 2)[0]]
    del old
    x = torch.arange(4.0, device="cuda")
    adapter = CUDAGraphAdapter()
    thresholds = gc.get_threshold()

    def fn():
        _Cycle(holder.pop())   # the earlier graph now lives only in a cycle, mid-capture
        junk = [[i] for i in range(5000)]   # container allocations: each one may start a collection
        del junk
        return x * 3

    try:
        gc.set_threshold(1, 1, 1)
        graph, out = adapter.capture(fn)
    finally:
        gc.set_threshold(*thresholds)
    gc.collect()   # the earlier graph goes now, outside any capture
    x.copy_(torch.full((4,), 5.0, device="cuda"))
    adapter.replay(graph)
    torch.cuda.synchronize()
    assert out.tolist() == [15.0] * 4
