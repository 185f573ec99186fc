"""Review 22 (rev1) of the CPU backend and how the core calls it.

1. Graph metadata for requests longer than the graph state's max_context_len is a CapacityError naming the length
   and the limit, before any static buffer changes (a draft's k steps too); it reads the host lengths only.
2. TorchCPUBackend holds its layers' dense-call kits weakly: layers made per forward are not kept alive.
3. Backend option flags and windows are checked by the project's rules (`check_flag`, `check_int_option`): a
   truthy "no" is no switch, a bool is no window.
4. The CPU extend kernel gives a request whose queries see none of its keys zeros, as decode and Triton do.
5. `hwkv.ops.store_kv` on CPU takes the int32 loc its check allows; the CPU kernels take K and V buffers of
   different dtypes, as the Triton kernels do.
"""
from __future__ import annotations

import dataclasses
import gc
import weakref
from typing import Any, Dict, List

import pytest
import torch

import hwkv
from hwkv import ops, reference
from hwkv.backend import BackendOptions, make_options
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.errors import CapacityError, ConfigError, ShapeError
from hwkv.pool import MHATokenToKVPool
from hwkv.testing.harness import Harness, ModelGeometry
from hwkv.testing.spec_harness import draft_batch, draft_model
from hwkv_cpu import kernels as cpu_kernels
from hwkv_cpu.backend import CPUOptions, TorchCPUBackend
from conftest import triton_device

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("one_thread")]

GEO = ModelGeometry()  # hybrid: full and SWA layers


def _tensors(x: Any) -> List[torch.Tensor]:
    """Every tensor of a StaticBuffers / DraftStatic (dataclass fields, dicts of tensors, lists of buffers)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if dataclasses.is_dataclass(x):
        return [t for f in dataclasses.fields(x) for t in _tensors(getattr(x, f.name))]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def _graph_state(h: Harness) -> List[torch.Tensor]:
    be = h.backend
    return [t.clone() for t in (*_tensors(be.static), *_tensors(be.draft_static), be.loc_cache.buffer)]


def _counters(h: Harness) -> tuple:
    return h.backend.loc_cache.translations, h.backend.window_translations, h.backend.forward_metadata


def _same(a: List[torch.Tensor], b: List[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ---- 1. graph metadata past the graph state's context ---------------------------------------------------------

def _long_decode(ctx: int = 8, prompt: int = 12):
    """A hybrid harness whose graph state holds `ctx` keys per request (req_to_token: 64) and a decode batch of two
    requests of prompt + 1 tokens."""
    h = Harness(TorchCPUBackend, geometry=GEO, size=256, size_swa=96, max_context_len=64)
    h.backend.init_graph_state(2, 2, max_context_len=ctx)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [prompt, prompt], ForwardMode.EXTEND)
    batch, inputs = h.prepare(rids, [1, 1], ForwardMode.DECODE)
    return h, rids, batch, inputs


@pytest.mark.parametrize("host", [True, False], ids=["host-copy", "cpu-lengths"])
def test_graph_metadata_past_the_graph_context_is_a_capacity_error_changing_nothing(host: bool) -> None:
    h, rids, batch, inputs = _long_decode()
    if not host:
        batch = dataclasses.replace(batch, seq_lens_cpu=None)
    before, counters = _graph_state(h), _counters(h)
    with pytest.raises(CapacityError, match=r"seq_lens\[0\] is 13, past the graph state's max_context_len 8"):
        h.backend.init_forward_metadata_graph(batch)
    assert _same(before, _graph_state(h)) and _counters(h) == counters, "a refused batch changed the graph state"
    flat = h.step(batch, inputs)  # eagerly it runs, equal to the reference
    h.complete(rids, [1, 1], inputs, flat)


def test_graph_metadata_past_req_to_token_too_is_the_eager_steps_shape_error() -> None:
    """Past the table's width as well: the refusal the eager step (and GraphRunner) gives, not "run it eagerly"."""
    h, _, batch, _ = _long_decode()
    past = dataclasses.replace(batch, seq_lens=torch.tensor([13, 65]), seq_lens_cpu=torch.tensor([13, 65]))
    before, counters = _graph_state(h), _counters(h)
    with pytest.raises(ShapeError, match=r"seq_lens\[1\] is 65; allowed range is \[1, 64\] \(the ReqToTokenPool's"):
        h.backend.init_forward_metadata_graph(past)
    with pytest.raises(ShapeError, match=r"seq_lens\[1\] is 65; allowed range is \[1, 64\]"):
        h.backend.init_forward_metadata(past)
    assert _same(before, _graph_state(h)) and _counters(h) == counters


def test_graph_metadata_at_the_graph_context_still_runs_and_matches_the_reference() -> None:
    h, rids, batch, inputs = _long_decode(ctx=8, prompt=7)  # 8 keys each: exactly the graph state's
    h.backend.init_forward_metadata_graph(batch)
    assert h.backend.forward_metadata.graph
    h.complete(rids, [1, 1], inputs, h.model_step(batch, inputs))


def test_graph_context_check_reads_the_host_copy_not_the_device_lengths() -> None:
    """Lengths on a device without a host read (meta: any read of them raises): the host copy decides, so an
    accelerator's refill adds no device read."""
    h, _, batch, _ = _long_decode()
    meta = {f: getattr(batch, f).to("meta") for f in ("req_pool_indices", "seq_lens", "out_cache_loc")}
    on_device = dataclasses.replace(batch, **meta)
    with pytest.raises(CapacityError, match="is 13, past the graph state's max_context_len 8"):
        h.backend.init_forward_metadata_graph(on_device)


def test_draft_graph_metadata_past_the_graph_context_is_a_capacity_error_changing_nothing() -> None:
    h = Harness(TorchCPUBackend, geometry=GEO, size=256, size_swa=96, max_context_len=64)
    h.backend.init_draft_graph_state(2, 2, max_context_len=8)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [6, 6], ForwardMode.EXTEND)
    fits = draft_batch(h, rids, 2)  # lengths 7 and 8 in its two steps: fits
    inputs = h.random_inputs(4)
    graph_out = draft_model(h, h.layers)(h.backend.init_draft_metadata_graph(fits), inputs)
    eager_out = draft_model(h, h.layers)(h.backend.init_draft_metadata(fits), inputs)
    assert torch.allclose(graph_out, eager_out, atol=1e-5)
    h.forward(rids, [1, 1], ForwardMode.EXTEND)  # 7 tokens (the drafts above were not kept)
    past = draft_batch(h, rids, 2)  # lengths 8 and 9: past 8
    before, counters = _graph_state(h), _counters(h)
    with pytest.raises(CapacityError, match=r"seq_lens\[0\] is 8: its 2 draft steps reach length 9, past the "
                                            r"graph state's max_context_len 8"):
        h.backend.init_draft_metadata_graph(past)
    assert _same(before, _graph_state(h)) and _counters(h) == counters
    h.backend.init_draft_metadata(past)  # eagerly it runs


@pytest.mark.parametrize("ctx", [0, -1, True, 2.5, "8"])
def test_init_graph_state_refuses_a_context_that_is_no_integer_at_least_one(ctx: Any) -> None:
    h = Harness(TorchCPUBackend, geometry=GEO, size=256, size_swa=96, max_context_len=64)
    with pytest.raises(ConfigError, match=f"max_context_len={ctx!r}"):
        h.backend.init_graph_state(2, 2, max_context_len=ctx)
    assert h.backend.static is None


# ---- 2. per-layer state of the CPU backend stays bounded -------------------------------------------------------

def test_layers_made_per_forward_are_not_kept_by_the_backend() -> None:
    pool = MHATokenToKVPool(64, 1, torch.float32, 2, 8, 1, "cpu")
    rtt = hwkv.ReqToTokenPool(size=4, max_context_len=32, device="cpu")
    be = TorchCPUBackend(pool, rtt)
    row = rtt.alloc(1)[0]
    rtt.write(row, 0, torch.arange(1, 7))
    seq = torch.tensor([6])
    batch = ForwardBatch(ForwardMode.DECODE, 1, torch.tensor([row]), seq, torch.tensor([6]), seq_lens_cpu=seq.clone())
    refs, outs = [], []
    q = torch.randn(1, 4, 8)
    for i in range(20):
        sinks = torch.full((4,), float(i % 2))  # a layer of the same id, made per forward, its sinks changing
        layer = hwkv.AttentionLayer(0, 4, 2, 8, sinks=sinks)
        be.init_forward_metadata(batch)
        outs.append(be.forward(q, None, None, layer, batch, save_kv_cache=False))
        refs.append(weakref.ref(layer))
        del layer
    gc.collect()
    assert sum(r() is not None for r in refs) == 0 and len(be._kits) <= 1  # (a kit per live layer at most)
    k, v = pool.get_key_buffer(0)[1:7], pool.get_value_buffer(0)[1:7]
    for i, out in enumerate(outs):  # each forward read its own layer's sinks
        ref = reference.batch_attention(q, [k], [v], [6], [1], sinks=torch.full((4,), float(i % 2)))
        assert torch.allclose(out, ref, atol=1e-5)


# ---- 3. option flags and windows --------------------------------------------------------------------------------

@pytest.mark.parametrize("opts, match", [
    (dict(debug="no"), "debug must be True, False or None, got 'no'"),
    (dict(debug=1), "debug must be True, False or None, got 1"),
    (dict(ipex="off"), "ipex must be True or False, got 'off'"),
    (dict(ipex=None), "ipex must be True or False, got None"),
    (dict(ipex_extend="no"), "ipex_extend must be True or False, got 'no'"),
    (dict(ipex_extend=0), "ipex_extend must be True or False, got 0"),
    (dict(sliding_window=True), r"sliding_window=True must be integers >= 1"),
    (dict(sliding_window=(4, True)), r"sliding_window=\(4, True\) must be integers >= 1"),
    (dict(sliding_window=4.0), r"sliding_window=4.0 must be integers >= 1"),
    (dict(sliding_window="4"), r"sliding_window='4' must be integers >= 1"),
    (dict(sliding_window=2 ** 63), r"sliding_window=9223372036854775808 must be integers >= 1 and below 2\*\*63"),
    (dict(dense_max_elements=True), "dense_max_elements must be an integer >= 0, got True"),
    (dict(dense_max_elements=-1), "dense_max_elements must be an integer >= 0, got -1"),
], ids=lambda v: str(v) if not isinstance(v, dict) else "-".join(f"{k}={x!r}" for k, x in v.items()))
def test_backend_options_refuse_what_is_no_switch_and_no_window(opts: Dict[str, Any], match: str) -> None:
    pool = MHATokenToKVPool(64, 1, torch.float32, 2, 8, 2, "cpu")
    rtt = hwkv.ReqToTokenPool(size=4, max_context_len=32, device="cpu")
    with pytest.raises(ConfigError, match=match):
        hwkv.make_backend(pool, rtt, device="cpu", **opts)


def test_backend_options_still_take_switches_windows_and_integer_types() -> None:
    import numpy as np

    pool = MHATokenToKVPool(64, 1, torch.float32, 2, 8, 2, "cpu")
    rtt = hwkv.ReqToTokenPool(size=4, max_context_len=32, device="cpu")
    be = hwkv.make_backend(pool, rtt, device="cpu", debug=True, ipex=False, ipex_extend=True,
                           sliding_window=[np.int64(8), torch.tensor(4), 8], dense_max_elements=0)
    assert be.debug is True and be.windows == (4, 8) and type(be.windows[0]) is int
    assert hwkv.make_backend(pool, rtt, device="cpu", debug=None, sliding_window=None).windows == ()


@pytest.mark.parametrize("module, cls, flag", [("hwkv_npu.backend", "NPUOptions", "fused"),
                                               ("hwkv_rocm.backend", "ROCmOptions", "aiter"),
                                               ("hwkv_xpu.backend", "XPUOptions", "ipex")])
def test_every_devices_switches_are_checked_by_the_shared_options(module: str, cls: str, flag: str) -> None:
    """The switches of the other devices' options are checked by BackendOptions from their declared types."""
    options = getattr(pytest.importorskip(module), cls)
    with pytest.raises(ConfigError, match=f"{flag} must be True or False, got 'no'"):
        make_options(options, {flag: "no"})
    assert getattr(make_options(options, {flag: False}), flag) is False


def test_base_options_check_debug() -> None:
    with pytest.raises(ConfigError, match="debug must be True, False or None, got 'yes'"):
        BackendOptions(debug="yes")
    assert CPUOptions(debug=False).debug is False


# ---- 4. extend with a request that sees none of its keys ------------------------------------------------------

S, KVH, D, H = 16, 2, 8, 4


def _kv(dtype_k=torch.float32, dtype_v=torch.float32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(S, KVH, D, generator=g).to(dtype_k), torch.randn(S, KVH, D, generator=g).to(dtype_v)


def _extend_unseen(kernels: Any, sinks: Any, dev: torch.device = torch.device("cpu")) -> torch.Tensor:
    """Request 0: keys at 0..2, queries at 10 and 11 with W=2 (none visible); request 1: keys at 3..5 after its
    query at 2 (none visible); request 2: an empty list; request 3: a query seeing its keys. On `dev`; returned on the
    CPU."""
    k_buf, v_buf = _kv()
    q = torch.randn(5, H, D, generator=torch.Generator().manual_seed(1))
    kv_indptr = torch.tensor([0, 3, 6, 6, 9], dtype=torch.int32)
    kv_indices = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9])
    kv_pos0 = torch.tensor([0, 3, 0, 0])
    qo_indptr = torch.tensor([0, 2, 3, 4, 5], dtype=torch.int32)
    q_pos0 = torch.tensor([10, 2, 0, 2])
    out = torch.full((5, H, D), 7.0)
    args = [t.to(dev) for t in (q, k_buf, v_buf, kv_indptr, kv_indices, kv_pos0, qo_indptr, q_pos0, out)]
    kernels.extend_attention(*args, 2, D ** -0.5, 2, 0.0, None if sinks is None else sinks.to(dev), None, None)
    return args[-1].cpu()


@pytest.mark.parametrize("sinks", [None, torch.zeros(H)], ids=["no-sinks", "sinks"])
def test_cpu_extend_gives_zeros_to_queries_without_a_visible_key(sinks: Any) -> None:
    out = _extend_unseen(cpu_kernels, sinks)
    assert out[:4].abs().max().item() == 0.0 and out[4].abs().max().item() > 0
    dev = triton_device()
    from hwkv_cuda import kernels as triton_kernels
    assert torch.allclose(out, _extend_unseen(triton_kernels, sinks, dev), atol=1e-5)


# ---- 5a. store_kv with an int32 loc ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_on_cpu_takes_an_int32_loc(dtype: torch.dtype) -> None:
    k, v = torch.randn(3, 2, 4).to(dtype), torch.randn(3, 2, 4).to(dtype)
    bufs = {}
    for idx in (torch.int32, torch.int64):
        k_buf, v_buf = torch.zeros(8, 2, 4, dtype=dtype), torch.zeros(8, 2, 4, dtype=dtype)
        loc = torch.tensor([5, 1, 3], dtype=idx)
        ops.store_kv(k_buf, v_buf, loc, k, v)
        bufs[idx] = (k_buf, v_buf)
        assert loc.dtype == idx  # the caller's loc untouched
    assert all(torch.equal(a, b) for a, b in zip(bufs[torch.int32], bufs[torch.int64]))
    assert torch.equal(bufs[torch.int32][0][torch.tensor([5, 1, 3])], k)


# ---- 5b. K and V buffers of different dtypes --------------------------------------------------------------------

@pytest.mark.parametrize("dk, dv", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                    (torch.float16, torch.bfloat16)])
@pytest.mark.parametrize("op", ["decode", "extend"])
def test_cpu_kernels_take_k_and_v_of_different_dtypes_as_triton_does(dk: torch.dtype, dv: torch.dtype,
                                                                      op: str) -> None:
    k_buf, v_buf = _kv(dk, dv)
    indptr, indices = torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])
    pos0 = torch.zeros(2, dtype=torch.int64)
    keys = [k_buf[1:4].float(), k_buf[4:9].float()]
    vals = [v_buf[1:4].float(), v_buf[4:9].float()]

    def run(kernels: Any, dev: torch.device = torch.device("cpu")) -> torch.Tensor:
        """(q, out) on the CPU; the kernel ran on `dev`."""
        n = 2 if op == "decode" else 4
        q, out = torch.randn(n, H, D, generator=torch.Generator().manual_seed(3)), torch.zeros(n, H, D)
        common, o = [t.to(dev) for t in (q, k_buf, v_buf, indptr, indices, pos0)], out.to(dev)
        if op == "decode":
            kernels.decode_attention(*common, torch.tensor([2, 4], device=dev), o, D ** -0.5, 3, 0.0, None, None, None)
        else:
            kernels.extend_attention(*common, torch.tensor([0, 1, 4], dtype=torch.int32, device=dev),
                                     torch.tensor([2, 2], device=dev), o, 3, D ** -0.5, 3, 0.0, None, None, None)
        return q, o.cpu()

    q, out = run(cpu_kernels)
    ext = [1, 1] if op == "decode" else [1, 3]
    ref = reference.batch_attention(q, keys, vals, [3, 5], ext, window=3)
    assert torch.allclose(out, ref, atol=2e-2), (out - ref).abs().max()
    dev = triton_device()
    from hwkv_cuda import kernels as triton_kernels
    _, t_out = run(triton_kernels, dev)
    assert torch.allclose(out, t_out, atol=2e-2), (out - t_out).abs().max()


def test_a_graph_state_wider_than_the_table_still_refuses_lengths_past_the_table():
    """init_graph_state(max_context_len=100) over a 64-wide req_to_token: a 65-token request is the table's
    ShapeError, not a 65-key list read into the next row (the final review of session 22)."""
    from hwkv.batch import ForwardBatch, ForwardMode
    from hwkv.errors import ShapeError
    from hwkv.testing.harness import Harness, ModelGeometry
    from hwkv_cpu.backend import TorchCPUBackend

    h = Harness(TorchCPUBackend, geometry=ModelGeometry(), size=256, size_swa=96, max_context_len=64)
    h.backend.init_graph_state(2, 2, max_context_len=100)
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [12, 12], ForwardMode.EXTEND)
    batch, _ = h.prepare(rids, [1, 1], ForwardMode.DECODE)
    seq = torch.tensor([13, 65])
    bad = ForwardBatch(ForwardMode.DECODE, 2, batch.req_pool_indices, seq, batch.out_cache_loc, seq_lens_cpu=seq)
    with pytest.raises(ShapeError, match=r"seq_lens\[1\] is 65; allowed range is \[1, 64\]"):
        h.backend.init_forward_metadata_graph(bad)
