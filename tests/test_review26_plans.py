"""Review 26 (rev7): plan caching and kept objects reused after something their key does not capture.

1. TorchCPUBackend's dense decode keeps each layer's sinks column with a *view* of the sinks made at the first
   decode (`kept_sink_column`'s `src`), keyed by the sinks' object identity. A sinks tensor whose storage is swapped
   in place (`param.data = ...`, what `nn.Module._apply` / `torch.nn.utils.vector_to_parameters` / many weight
   loaders do; `Tensor.set_`) keeps its identity, so the kept column is refilled from the old storage: every later
   decode attends with the old sinks (extend, which makes its column per call, uses the new ones).
2. The backend's per-forward check of `layer.sinks` ("checked at construction; again here, as a caller may assign
   another tensor since") re-checks the layout only: a tensor assigned after construction holding +inf or NaN, which
   `AttentionLayer` refuses where values are checkable, is run, and the CPU kernels return NaN where the reference
   gives finite values.
3. `ForwardMetadata.list_for` hands a *full-pool* layer with a sliding window the backend's window list when one of
   that window exists; over a hybrid pool that list holds SWA-pool slots (`is_swa_slots`), which the layer then
   reads in the full pool's buffers: wrong attention as soon as the full->SWA mapping is not the identity.
4. TritonBackend's kept `DecodeLayer` (`_decode_layer`, keyed by the sinks' identity) keeps the sinks' launch spec
   (dtype, 16-byte alignment) and layout from its first decode; after an in-place storage swap of the sinks the
   planned launch (`Launch.parts`) compares that stale spec and launches the variant compiled for the old dtype /
   alignment directly, never going through the JIT for the new specialisation.
"""
from __future__ import annotations

import inspect
import os
import types

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from hwkv.batch import ForwardMode  # noqa: E402
from hwkv.errors import ConfigError, ShapeError  # noqa: E402
from hwkv.layer import AttentionLayer  # noqa: E402
from hwkv.testing.harness import Harness, ModelGeometry, run_scenario  # noqa: E402
from hwkv_cpu.backend import TorchCPUBackend  # noqa: E402

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("one_thread")]


def _prefilled(backend=TorchCPUBackend, **geo) -> tuple:
    h = Harness(backend, geometry=ModelGeometry(**geo), size=256, size_swa=96)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [5, 7], ForwardMode.EXTEND)
    return h, rids


# ---- 1. the dense decode's kept sinks column reads the sinks' old storage ---------------------------------------

def test_cpu_dense_decode_follows_a_sinks_storage_swap():
    """Expected: after `sinks.data = new` the decode attends with the new sinks (as extend does, and as the
    reference does). Actual: the kept column was made from a view of the old storage: max error ~1."""
    h, rids = _prefilled(sinks=True)
    h.forward(rids, [1, 1], ForwardMode.DECODE)       # each layer's sinks column is made and kept here
    for layer in h.layers:
        layer.sinks.data = torch.full_like(layer.sinks, 4.0)   # same tensor object, new storage
    h.forward(rids, [1, 1], ForwardMode.DECODE)       # ReferenceMismatchError: the old sinks were used


def test_cpu_dense_decode_follows_sinks_loaded_by_vector_to_parameters():
    """The same through a torch utility that assigns `.data`: a module's sinks parameter reloaded from a flat vector."""
    h, rids = _prefilled(sinks=True, num_layers=2)
    mod = torch.nn.Module()
    mod.sinks = torch.nn.ParameterList([torch.nn.Parameter(layer.sinks.clone()) for layer in h.layers])
    for layer, p in zip(h.layers, mod.sinks):
        layer.sinks = p  # the parameter itself, as a model hands it
    with torch.no_grad():
        h.forward(rids, [1, 1], ForwardMode.DECODE)
        flat = torch.nn.utils.parameters_to_vector(mod.parameters()) - 3.0
        torch.nn.utils.vector_to_parameters(flat, mod.parameters())  # param.data = view of `flat`
        h.forward(rids, [1, 1], ForwardMode.DECODE)


# ---- 2. sinks assigned after construction are not value-checked -------------------------------------------------

@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("dense", [True, False], ids=["dense", "chunked"])
def test_sinks_assigned_after_construction_are_checked_like_at_construction(bad, dense):
    """Expected: the ConfigError (or ShapeError) `AttentionLayer` raises for such sinks, before anything is written.
    Actual: the forward runs and returns NaN (ReferenceMismatchError with error nan)."""
    with pytest.raises(ConfigError):
        AttentionLayer(0, 4, 2, 16, sinks=torch.tensor([bad, 0.0, 0.0, 0.0]))
    h = Harness(TorchCPUBackend, geometry=ModelGeometry(sinks=True), size=256, size_swa=96,
                **({} if dense else {"dense_max_elements": 0}))
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [5, 7], ForwardMode.EXTEND)
    for layer in h.layers:
        s = layer.sinks.clone()
        s[0] = bad
        layer.sinks = s
    with pytest.raises((ConfigError, ShapeError)):
        h.forward(rids, [1, 1], ForwardMode.DECODE, check=False)


# ---- 3. a windowed full-pool layer reads the SWA window list in the full pool ------------------------------------

def test_windowed_layer_of_the_full_pool_reads_full_pool_slots():
    """Layer 1 sits in the full group of a hybrid pool and has W=8, one of the backend's windows. Expected: its
    outputs match the reference (the full list trimmed by the kernel's mask, as for a window the backend lacks).
    Actual: it is handed the W=8 list of SWA-pool slots and reads them in the full pool's buffers."""
    h = Harness(TorchCPUBackend, geometry=ModelGeometry(), size=256, size_swa=64)
    assert h.pool.layers_mapping[1] == (0, False)
    l1 = h.layers[1]
    h.layers[1] = AttentionLayer(1, l1.num_heads, l1.num_kv_heads, l1.head_dim, sliding_window=8)
    run_scenario(h, steps=30, prompt_lens=(9, 20, 6), chunk=5)


# ---- 4. TritonBackend's kept DecodeLayer keeps a stale launch spec ----------------------------------------------

class _Param:
    def __init__(self, p: inspect.Parameter, free: bool) -> None:
        self.name = p.name
        self.is_constexpr = "constexpr" in str(p.annotation)
        self.has_default = p.default is not inspect.Parameter.empty
        self.default = p.default if self.has_default else None
        self.do_not_specialize = free


class _FakeSplitKernel:
    """Stands in for the compiled split kernel: records JIT launches and direct (planned) launches."""

    def __init__(self, fn) -> None:
        self.params = [_Param(p, p.name in ("window", "num_splits")) for p in inspect.signature(fn).parameters.values()]
        self.jit, self.direct = [], []

    def __getitem__(self, grid):
        def run(*args, **consts):
            self.jit.append(args)
            return types.SimpleNamespace(run=lambda *a: self.direct.append(a), function="fn", packed_metadata="m")
        return run


def test_kept_decode_layer_spec_follows_a_sinks_storage_swap(monkeypatch):
    """Expected: after the sinks' storage is swapped for one at another 16-byte alignment, the next planned launch
    goes through the JIT (another specialisation: Triton compiles a pointer per dtype and divisibility by 16).
    Actual: the backend's kept part is reused with its first spec, `Launch.parts` finds it equal and launches the
    variant compiled for an aligned sinks pointer directly (on a GPU: vector loads assuming an alignment the pointer
    lacks). The public plan's key (sinks shape, stride, dtype) does not see it either. A dtype swap shows the same
    whenever the plan of the forward was made by another layer (whose sinks kept their dtype)."""
    from hwkv_cuda.backend import TritonBackend
    from hwkv_cuda.kernels import decode as D
    from hwkv_cuda.kernels import launch as L
    fake = _FakeSplitKernel(getattr(D._decode_split_kernel, "fn", None) or D._decode_split_kernel)
    monkeypatch.setattr(L, "JITFunction", _FakeSplitKernel)
    monkeypatch.setattr(L, "_CONVENTION", "all")
    monkeypatch.setattr(L, "driver", types.SimpleNamespace(active=types.SimpleNamespace(
        get_current_device=lambda: 0, get_current_stream=lambda dev: 0)))
    monkeypatch.setattr(D, "_decode_split_kernel", fake)
    monkeypatch.setattr(D, "_LAUNCHES", {})
    monkeypatch.setattr(D, "_PUBLIC_PLANS", {})

    layer = AttentionLayer(0, 4, 2, 16, sinks=torch.randn(4))
    k_buf, v_buf = torch.randn(32, 2, 16), torch.randn(32, 2, 16)
    q, out = torch.randn(1, 4, 16), torch.zeros(1, 4, 16)
    indptr = torch.tensor([0, 5], dtype=torch.int32)
    indices = torch.arange(1, 6, dtype=torch.int64)
    pos0, q_pos = torch.zeros(1, dtype=torch.int64), torch.full((1,), 4, dtype=torch.int64)
    owner = types.SimpleNamespace(_decode_layers={})   # the backend's state _decode_layer reads

    def forward() -> None:
        plan = D.plan_decode(q, k_buf, v_buf, indptr, indices, pos0, q_pos, out, layer.sinks, 5)
        assert plan.splits == 1
        part = TritonBackend._decode_layer(owner, layer, k_buf, v_buf)
        D.decode_attention_planned(plan, q, k_buf, v_buf, indptr, indices, pos0, q_pos, out, layer.scaling,
                                   None, 0.0, layer.sinks, None, None, part)

    forward()
    forward()
    assert (len(fake.jit), len(fake.direct)) == (1, 1), "the second forward launches directly"
    moved = torch.empty(5)[1:]                     # fp32, 4 bytes past a 16-byte boundary
    moved.copy_(layer.sinks.detach())
    layer.sinks.data = moved                      # same object, same dtype and shape, storage at another alignment
    forward()
    assert len(fake.jit) == 2, ("a sinks pointer off its 16-byte boundary was launched directly through the plan "
                                f"compiled for an aligned one ({len(fake.direct)} direct launches)")
