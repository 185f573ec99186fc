"""Test-wide settings: Triton runs in its interpreter when no GPU is present (CPU CI)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import importlib.util  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="session")
def load_benchmark():
    """A loader of benchmarks/NAME.py as a module (the folder on sys.path while it imports its neighbours), for the
    tests that check a benchmark script off a GPU."""
    def load(name: str) -> types.ModuleType:
        sys.path.insert(0, str(BENCHMARKS))
        try:
            spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
        finally:
            sys.path.remove(str(BENCHMARKS))
        return mod
    return load


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors gain nothing from threads and lose a lot on a shared 2-core machine: one thread for the
    module (modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def npu_standin(monkeypatch):
    """torch_npu and torch.npu replaced by hwkv.testing.vendor_schemas.npu's stand-ins, NPU pools faked by CPU
    tensors. `.graphs()` makes a graph adapter that captures task groups in the stand-in runtime and
    replays by re-running the step under the capture-checking adapter (fused calls take their task
    groups' updated arguments, as a device graph would); `.use(v2_sinks=...)` reinstalls another release."""
    from hwkv.testing.capture_check import CaptureCheckingAdapter
    from hwkv.testing.vendor_schemas.npu import make_torch_npu
    from hwkv_npu import backend as npu_backend
    from hwkv_npu.graph import NPUTaskUpdates

    state = types.SimpleNamespace()

    def use(v2_sinks=True):
        state.mod = make_torch_npu(v2_sinks=v2_sinks)
        state.runtime = state.mod.npu
        monkeypatch.setitem(sys.modules, "torch_npu", state.mod)
        monkeypatch.setattr(torch, "npu", state.runtime, raising=False)
        return state

    class StandInNPUGraphs(NPUTaskUpdates, CaptureCheckingAdapter):
        def capture(self, fn):
            g = state.runtime.NPUGraph()
            with state.runtime.graph(g):
                handle, out = super().capture(fn)
            return (g, handle), out

        def pre_replay(self, graph):
            super().pre_replay(graph[1])

        def replay(self, graph):
            g, handle = graph
            with g.replaying():
                return super().replay(handle)

    monkeypatch.setattr(npu_backend, "device_reason", lambda device: None)
    state.use, state.graphs = use, StandInNPUGraphs
    return use()


@pytest.fixture(scope="session")
def tiny_gemma2_config():
    """Makes a 2-layer Gemma-2 config (one SWA, one full layer, W = 8, vocabulary 64), a new one each call (models
    built from it may set fields on it): the CLI's and the runner's tests build their tiny model from it."""
    transformers = pytest.importorskip("transformers")
    return lambda: transformers.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                     max_position_embeddings=128, sliding_window=8, query_pre_attn_scalar=16,
                                     eos_token_id=None, pad_token_id=None, bos_token_id=None)


@pytest.fixture
def python_sigint():
    """SIGINT handled as in a terminal (Python's handler: KeyboardInterrupt) for one test, for tests that send a real
    Ctrl-C: a run started in the background by a non-interactive shell (CI) inherits SIGINT ignored."""
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, outer)


def triton_runs_cpu_tensors():
    """Skips the test unless Triton runs kernels over CPU tensors: only its interpreter does (TRITON_INTERPRET=1, set
    above without a GPU); a GPU machine compiles them, and its device runs cover the kernels there."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels over CPU tensors run in Triton's interpreter only (TRITON_INTERPRET=1)")


def triton_device() -> torch.device:
    """Where Triton runs the kernels a CPU-versus-Triton differential test compares: the CPU under its interpreter
    (TRITON_INTERPRET=1, CI), else the GPU (a device run); the test skips where it has neither."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.skip("Triton runs kernels in its interpreter (TRITON_INTERPRET=1) or on a GPU: neither here")
    return torch.device("cuda")


def triton_page_ops_on_cpu():
    """The Triton page-op kernels for an allocator over CPU tensors (the test skips where Triton compiles them)."""
    triton_runs_cpu_tensors()
    from hwkv_cuda.kernels.alloc import TritonPageOps
    return TritonPageOps()
