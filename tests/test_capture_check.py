"""The capture-checking graph adapter: it fails a replay whose metadata moved (what a real device graph
would read stale), and every in-tree backend's graph path passes through it on CPU."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hwkv.batch import ForwardMode  # noqa: E402
from hwkv.testing.capture_check import CaptureCheckingAdapter, StaleCaptureError  # noqa: E402
from hwkv.testing.harness import Harness, ModelGeometry, run_scenario  # noqa: E402
from hwkv.testing.reference_backend import ReferenceBackend  # noqa: E402

GEOM = ModelGeometry(num_layers=2, swa_every=2, window=6, num_heads=4, num_kv_heads=2, head_dim=16)


class MovingMetadata(ReferenceBackend):
    """A backend bug: a fresh tensor for the window list on every refill instead of the static buffer."""

    def init_forward_metadata_graph(self, batch):
        md = super().init_forward_metadata_graph(batch)
        for w, lst in md.windows.items():
            lst.indices = lst.indices.clone()
        return md


def _run(backend_cls, **kw):
    h = Harness(backend_cls, "cpu", GEOM, size=256, size_swa=64, page_size=2, **kw)
    h.enable_graphs([1, 2, 4], CaptureCheckingAdapter())
    run_scenario(h, steps=4, prompt_lens=(5, 9), chunk=8)
    return h


def test_a_replay_reading_moved_metadata_fails():
    with pytest.raises(StaleCaptureError, match="its capture did not"):
        _run(MovingMetadata)


def test_the_reference_and_cpu_backends_pass():
    from hwkv_cpu.backend import TorchCPUBackend

    for cls in (ReferenceBackend, TorchCPUBackend):
        assert _run(cls).runner.replays > 0


@pytest.mark.interpret
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="a GPU is present: real graphs run there")
@pytest.mark.parametrize("which", ["triton", "xpu", "rocm"])
def test_triton_backends_pass(which, monkeypatch):
    pytest.importorskip("triton")
    if which == "triton":
        from hwkv_cuda.backend import TritonBackend as cls
    elif which == "xpu":
        from hwkv_xpu.backend import XPUBackend as cls
    else:
        from hwkv_rocm.backend import ROCmBackend as cls
    assert _run(cls).runner.replays > 0
