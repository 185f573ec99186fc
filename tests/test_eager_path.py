"""The eager per-layer path of TritonBackend (under TRITON_INTERPRET=1 on CPU): checks once per forward.

With the Triton store registered for CPU tensors (as it is for GPUs), a forward's argument checks
(check_loc, check_shape, check_dims, check_store, _check_decode, ...) and its decode workspaces
must not grow with the number of layers; each layer launches its store and its attention only.
"""
import os
import sys
from collections import Counter

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from hwkv import checks, ops  # noqa: E402
from hwkv.batch import ForwardMode  # noqa: E402
from hwkv.errors import LocError, ShapeError  # noqa: E402
from hwkv.graph import EagerAdapter  # noqa: E402
from hwkv.testing.harness import Harness, ModelGeometry  # noqa: E402
from hwkv_cuda import kernels  # noqa: E402
from hwkv_cuda.backend import TritonBackend  # noqa: E402
from hwkv import csr_checks  # noqa: E402
from hwkv_cuda.kernels import decode, extend, store  # noqa: E402

pytestmark = [pytest.mark.interpret,
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="a GPU is present: the CUDA runs cover the same path")]

CHECKS = {"check_loc": checks.check_loc, "check_shape": checks.check_shape, "check_dims": csr_checks.check_dims,
          "check_same_device": csr_checks.check_same_device, "check_store": csr_checks.check_store,
          "_check_decode": decode._check_decode, "_check_extend": extend._check_extend,
          "make_decode_workspace": decode.make_decode_workspace}


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """Register the Triton store and fill kernels for CPU tensors, as hwkv_cuda does for GPUs."""
    monkeypatch.setitem(ops._STORE, "cpu", kernels.store_kv)
    monkeypatch.setitem(ops._STORE_PRECHECKED, "cpu", kernels.store_kv_prechecked)
    monkeypatch.setitem(ops._FILL, "cpu", kernels.fill_kv_indices)


@pytest.fixture
def calls(monkeypatch):
    """Counts calls of the check helpers (wherever a module imported them) and of Triton launches."""
    counts = Counter()

    def wrap(name, fn):
        def counted(*a, **k):
            counts[name] += 1
            return fn(*a, **k)
        return counted

    for name, fn in CHECKS.items():
        counted = wrap(name, fn)
        # (not the oracle's modules: the harness checks every layer's output against hwkv.reference, which checks
        # its own arguments per call; what is counted is the backend's path)
        for mod in [m for n, m in sys.modules.items() if n.startswith("hwkv") and m is not None
                    and not n.startswith(("hwkv.reference", "hwkv.testing"))]:
            for attr, val in list(vars(mod).items()):
                if val is fn:
                    monkeypatch.setattr(mod, attr, counted)
    cls = type(kernels.decode._decode_split_kernel)
    inner = cls.run

    def run(self, *a, **k):
        counts["launch:" + self.fn.__name__] += 1
        return inner(self, *a, **k)

    monkeypatch.setattr(cls, "run", run)
    return counts


def model(layers, **kw):
    g = ModelGeometry(num_layers=layers, swa_every=2, window=8, num_heads=2, num_kv_heads=1, head_dim=16)
    return Harness(TritonBackend, geometry=g, size=512, size_swa=128, **kw)


def counted_forward(h, calls, rids, new, mode):
    decode._PUBLIC_PLANS.clear()  # the plans of each kind (a forward like an earlier one is not checked again)
    calls.clear()
    h.forward(rids, new, mode)   # outputs checked against hwkv.reference inside
    return Counter(calls)


@pytest.mark.parametrize("mode, new", [(ForwardMode.DECODE, [1, 1]), (ForwardMode.EXTEND, [3, 2])])
def test_checks_per_forward_do_not_grow_with_layers(triton_on_cpu, calls, mode, new):
    per_model = {}
    for layers in (4, 36):
        h = model(layers)
        rids = [h.add_request() for _ in range(2)]
        h.forward(rids, [11, 5], ForwardMode.EXTEND)
        per_model[layers] = counted_forward(h, calls, rids, new, mode)
    small, big = per_model[4], per_model[36]
    checks_of = lambda c: {k: v for k, v in c.items() if not k.startswith("launch:")}  # noqa: E731
    assert checks_of(small) == checks_of(big), "argument checks grew with the number of layers"
    # the write locs (loc, swa_loc) and the window list the SWA layers share (its translation checks its locs), each
    # once per forward
    assert big["check_loc"] == 3, "the write locs and the window list are checked once per forward"
    assert big["check_store"] == 0, "the pool stores through the prechecked entry"
    assert big["launch:_store_kv_kernel"] == 36
    if mode == ForwardMode.DECODE:
        assert big["_check_decode"] == 2 and big["launch:_decode_split_kernel"] == 36  # one plan per list
        assert big["make_decode_workspace"] <= 2, "split-K scratch once per forward, not per layer"
        assert big["launch:_decode_merge_kernel"] in (0, 36)
    else:
        assert big["_check_extend"] == 2 and big["launch:_extend_kernel"] == 36
    per_layer = {k: (big[k] - small[k]) / 32 for k in big if k.startswith("launch:")}
    assert sum(per_layer.values()) <= 3, f"per layer: a store and its attention launches only, got {per_layer}"


def test_bad_input_still_raises_typed_errors(triton_on_cpu, calls):
    h = model(4)
    rid = h.add_request()
    h.forward([rid], [6])
    batch = h.make_batch([rid], [1], ForwardMode.DECODE)
    h.backend.init_forward_metadata(batch)
    layer = h.layers[0]
    q = torch.zeros(1, layer.num_heads, layer.head_dim)
    k = torch.zeros(1, layer.num_kv_heads, layer.head_dim)
    before = [h.pool.get_key_buffer(i).clone() for i in range(4)]
    with pytest.raises(ShapeError, match="q has shape"):
        h.backend.forward(torch.zeros(1, layer.num_heads + 1, layer.head_dim), k, k, layer, batch)
    with pytest.raises(ShapeError, match="cache_k"):
        h.backend.forward(q, torch.zeros(1, 2, layer.head_dim), k, layer, batch)
    strided = torch.zeros(1, layer.num_heads, 2 * layer.head_dim)[:, :, ::2]  # last dim not contiguous
    with pytest.raises(ShapeError, match="contiguous last dimension"):
        h.backend.forward(strided, k, k, layer, batch, save_kv_cache=False)
    assert all(torch.equal(a, h.pool.get_key_buffer(i)) for i, a in enumerate(before))
    # a loc that is not this forward's checked write loc is checked at the write
    with pytest.raises(LocError, match="allowed range"):
        h.pool.set_kv_buffer(h.layers[1], torch.tensor([10 ** 6]), k, k)
    calls.clear()
    h.pool.set_kv_buffer(h.layers[1], h.backend.forward_metadata.write_loc.loc.clone(), k, k)
    assert calls["check_loc"] == 1, "a copy of the checked locs is checked again"
    # out-of-range write locs are refused by the metadata step, before any layer writes
    bad = h.make_batch([rid], [1], ForwardMode.DECODE)
    bad.out_cache_loc = torch.tensor([10 ** 6])
    with pytest.raises(LocError, match="allowed range"):
        h.backend.init_forward_metadata(bad)


def test_strided_kv_still_stored_through_the_checked_path(triton_on_cpu):
    """k/v with a strided last dim are not what the prechecked store launches with: it takes the checked
    store_kv, which refuses them with a typed error (as before); pool and inputs stay untouched."""
    h = model(4)
    rid = h.add_request()
    h.forward([rid], [3])
    batch = h.make_batch([rid], [1], ForwardMode.DECODE)
    h.backend.init_forward_metadata(batch)
    layer = h.layers[1]
    q = torch.zeros(1, layer.num_heads, layer.head_dim)
    kv = torch.ones(1, layer.num_kv_heads, 2 * layer.head_dim)[:, :, ::2]
    before = h.pool.get_key_buffer(1).clone()
    with pytest.raises(ShapeError, match="contiguous last dimension"):
        h.backend.forward(q, kv, kv, layer, batch)
    assert torch.equal(before, h.pool.get_key_buffer(1))


def test_graph_decode_workspace_outlives_the_forward(triton_on_cpu, calls):
    """Graph metadata: the split-K scratch is the backend's (captured graphs keep writing it), allocated
    at capture and reused by every later replay."""
    h = model(4)
    h.enable_graphs([1, 2], EagerAdapter())
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [9, 30], ForwardMode.EXTEND)
    workspaces = dict(h.backend._graph_workspaces)
    assert workspaces, "the interpreter's two SMs make decode split"
    calls.clear()
    for _ in range(2):
        h.forward(rids, [1, 1], ForwardMode.DECODE)
        h.forward(rids[:1], [1], ForwardMode.DECODE)
    assert h.runner.replays == 4 and calls["make_decode_workspace"] == 0
    assert all(h.backend._graph_workspaces[k] is ws for k, ws in workspaces.items())


def test_a_layer_changed_between_forwards_launches_with_its_new_values(triton_on_cpu):
    """The backend keeps each layer's part of its decode launch across forwards; a layer whose sinks or soft-cap
    changed gets a new one (the outputs are compared with hwkv.reference, which reads the layer as it is now)."""
    h = model(4)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [11, 5], ForwardMode.EXTEND)
    h.forward(rids, [1, 1], ForwardMode.DECODE)
    kept = {i: entry[5] for i, entry in h.backend._decode_layers.items()}
    assert sorted(kept) == [0, 1, 2, 3]
    h.forward(rids, [1, 1], ForwardMode.DECODE)
    assert all(h.backend._decode_layers[i][5] is part for i, part in kept.items()), "unchanged layers keep theirs"
    for layer in h.layers:
        layer.logit_cap = 2.0
        layer.sinks = torch.randn(layer.num_heads)
    h.forward(rids, [1, 1], ForwardMode.DECODE)
    assert all(h.backend._decode_layers[i][5] is not part for i, part in kept.items())


def test_the_store_keeps_no_freed_pool_alive(triton_on_cpu):
    """A pool layer's part of the store launch is kept by weak reference: deleting the harness frees its pool."""
    import gc
    import weakref
    h = model(2)
    rid = h.add_request()
    h.forward([rid], [5])
    buf = weakref.ref(h.pool.get_key_buffer(1))
    assert any(entry[0]() is buf() for entry in store._BUFFERS.values())
    del h
    gc.collect()
    assert buf() is None


def test_a_decode_forward_like_an_earlier_one_neither_checks_nor_allocates_its_plan(triton_on_cpu, calls):
    """The plan of each kind (shapes, strides, devices, the list bound's power of two, stream, thread) is checked and
    its split-K scratch allocated once; later forwards of that kind attach their lists to it (outputs compared with
    hwkv.reference inside)."""
    h = model(4)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [11, 5], ForwardMode.EXTEND)
    first = counted_forward(h, calls, rids, [1, 1], ForwardMode.DECODE)
    assert first["_check_decode"] == 2
    calls.clear()
    h.forward(rids, [1, 1], ForwardMode.DECODE)
    assert calls["_check_decode"] == 0 and calls["make_decode_workspace"] == 0
    assert calls["launch:_decode_split_kernel"] == 4
