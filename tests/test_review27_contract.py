"""Review 27 (public contract): DESIGN.md's public names used as an outside engine uses them, with bad input.

The error contract (DESIGN.md, docs/bad-inputs.md): bad input gets a typed error from `hwkv.errors` naming the value
and the limit, and every pool, table, allocator and cache is left unchanged. Each test below is one reproduction
that fails on the reviewed commit (f8e3983): a bare Python or torch exception, a bad value taken silently, or a
forced device that cannot be reached.
"""
from __future__ import annotations

import contextlib
import importlib
import sys
from pathlib import Path
from typing import List

import numpy as np
import pytest
import torch

import hwkv
from hwkv import devices
from hwkv.allocator import SWATokenToKVPoolAllocator, release_out_of_window, release_out_of_window_batch
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.errors import ConfigError, HwkvError, LocError
from hwkv.layer import AttentionLayer
from hwkv.pool import SWAKVPool

W, P = 8, 4
I64 = torch.int64


def _pool() -> SWAKVPool:
    return SWAKVPool(64, 32, P, torch.float32, 2, 8, [0], [1], "cpu")


class State:
    """A hybrid pool, its allocator, a request table and the CPU backend, with request row 0 holding 10 tokens."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.pool = _pool()
        self.alloc = SWATokenToKVPoolAllocator(64, 32, P, "cpu", self.pool)
        self.rtt = hwkv.ReqToTokenPool(4, 32, "cpu")
        self.row = self.rtt.alloc(1)[0]
        self.loc = self.alloc.alloc_extend([0], [10], [-1], 10)
        self.rtt.write(self.row, 0, self.loc)
        self.backend = hwkv.make_backend(self.pool, self.rtt, sliding_window=W)

    def snapshot(self) -> List[object]:
        p = self.pool
        out: List[object] = [t.clone() for t in (*p.full_kv_pool.k_buffer, *p.full_kv_pool.v_buffer,
                                                 *p.swa_kv_pool.k_buffer, *p.swa_kv_pool.v_buffer)]
        out += [self.alloc.full_to_swa_index_mapping.clone(), self.rtt.req_to_token.clone(), list(self.rtt._free),
                self.alloc.full_available_size(), self.alloc.swa_available_size()]
        for ring in self.alloc._rings():
            out += [v.clone() if isinstance(v, torch.Tensor) else v.copy()
                    for v in vars(ring).values() if isinstance(v, (torch.Tensor, np.ndarray))]
        return out

    def assert_unchanged(self, before: List[object]) -> None:
        after = self.snapshot()
        assert len(before) == len(after)
        for i, (a, b) in enumerate(zip(before, after)):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), f"state entry {i} changed"
            elif isinstance(a, np.ndarray):
                assert np.array_equal(a, b), f"state entry {i} changed"
            else:
                assert a == b, f"state entry {i} changed"

    def extend_batch(self) -> ForwardBatch:
        return ForwardBatch(ForwardMode.EXTEND, 1, torch.tensor([self.row]), torch.tensor([10]), self.loc,
                            torch.tensor([0]), torch.tensor([10]))


def _refused(state: State, fn, error: type = HwkvError) -> HwkvError:
    """fn() raises `error` (a typed hwkv error) and changes nothing."""
    before = state.snapshot()
    with pytest.raises(error) as e:
        fn()
    state.assert_unchanged(before)
    return e.value


def _meta(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, dtype=I64, device="meta")


# ------------------------------------------------------------------------------------------ constructors


@pytest.mark.parametrize("kvcache", ["pool", 0, object()], ids=["str", "int", "object"])
def test_swa_allocator_refuses_a_kvcache_that_is_not_a_pool(kvcache):
    """SWATokenToKVPoolAllocator(size, size_swa, page_size, device, kvcache) with anything but a pool (or None)
    raises a bare AttributeError ('str' object has no attribute 'register_mapping'), after building its rings."""
    with pytest.raises(ConfigError, match="kvcache"):
        SWATokenToKVPoolAllocator(64, 32, P, "cpu", kvcache)


def test_swa_allocator_larger_than_its_pool_is_refused_before_allocating():
    """bad-inputs row 47: an allocator larger than its pool is a ConfigError naming both sizes. A size far past the
    pool's reaches torch's allocation of the page ring first (_check_fits_pool runs after super().__init__): a bare
    RuntimeError 'Storage size calculation overflowed' (or the host's memory) instead."""
    pool = _pool()
    with pytest.raises(ConfigError, match="size"):
        SWATokenToKVPoolAllocator(2 ** 62, 32, P, "cpu", pool)


def test_req_to_token_pool_too_large_is_a_config_error():
    """ReqToTokenPool(size, max_context_len, device) checks only >= 1, then allocates: a table no machine holds is a
    bare RuntimeError from torch.zeros (SWAKVPool sizes its buffers first: bad-inputs row 46)."""
    with pytest.raises(ConfigError):
        hwkv.ReqToTokenPool(2, 2 ** 62, "cpu")


def test_init_graph_state_too_large_is_a_config_error():
    """backend.init_graph_state(max_bs, max_num_tokens, max_context_len) allocates its static buffers unchecked: a
    bare RuntimeError / TypeError from torch for sizes no device holds."""
    s = State()
    with pytest.raises(HwkvError):
        s.backend.init_graph_state(2 ** 62, 2 ** 62)
    with pytest.raises(HwkvError):
        s.backend.init_graph_state(2, 2, max_context_len=2 ** 62)


# ------------------------------------------------------------------------------------------ allocator


@pytest.mark.parametrize("call", ["free", "free_swa", "alloc_extend", "alloc_decode", "rtt_write"])
def test_allocator_and_table_refuse_meta_tensors(call):
    """A loc or length tensor on another device (meta here) is a typed error, as the pool's set_kv_buffer and
    translate refuse one (`loc is on meta, the pool is on cpu`); the allocator and ReqToTokenPool.write raise a bare
    NotImplementedError ('Cannot copy out of meta tensor')."""
    s = State()
    fns = {
        "free": lambda: s.alloc.free(_meta(4)),
        "free_swa": lambda: s.alloc.free_swa(_meta(4)),
        "alloc_extend": lambda: s.alloc.alloc_extend(_meta(1), _meta(1), _meta(1), 4),
        "alloc_decode": lambda: s.alloc.alloc_decode(_meta(1), _meta(1)),
        "rtt_write": lambda: s.rtt.write(s.row, 10, _meta(2)),
    }
    _refused(s, fns[call])


def test_alloc_of_a_count_past_int64_is_typed():
    """alloc(2**62) is an OutOfSlotsError naming the count; alloc(2**70) a bare OverflowError."""
    s = State()
    _refused(s, lambda: s.alloc.alloc(2 ** 70))


def test_alloc_decode_host_copy_that_is_not_a_tensor_is_typed():
    """alloc_decode(..., seq_lens_cpu=[11]) (a list, where README's example passes a tensor): a bare AttributeError
    ('list' object has no attribute 'numel')."""
    s = State()
    _refused(s, lambda: s.alloc.alloc_decode(torch.tensor([11]), s.loc[-1:], seq_lens_cpu=[11]))


# ------------------------------------------------------------------------------------------ out-of-window release


def test_release_out_of_window_refuses_a_2d_token_row():
    """release_out_of_window(allocator, token_row, seq_len, frontier, window) reshapes token_row to one row: passing
    the whole req_to_token table (2-D) silently releases row 0's SWA slots, whichever request was meant."""
    s = State()
    other = s.rtt.alloc(1)[0]
    loc = s.alloc.alloc_extend([0], [16], [-1], 16)
    s.rtt.write(other, 0, loc)
    before = s.alloc.full_to_swa_index_mapping[s.loc].clone()
    with pytest.raises(LocError):
        release_out_of_window(s.alloc, s.rtt.req_to_token, 16, 0, 4)
    assert torch.equal(s.alloc.full_to_swa_index_mapping[s.loc], before), "row 0's SWA slots were released"


@pytest.mark.parametrize("case", ["token_row_list", "allocator_none", "seq_len_2**70", "window_2**63"])
def test_release_out_of_window_bad_arguments_are_typed(case):
    """release_out_of_window: a list row (AttributeError 'reshape'), no allocator (AttributeError 'page_size'), a
    length past int64 (torch's ValueError 'Overflow when unpacking long long'), a window of 2**63 or more (numpy's
    OverflowError; make_backend refuses such a window: bad-inputs row 166)."""
    s = State()
    row = s.rtt.req_to_token[s.row]
    fns = {
        "token_row_list": lambda: release_out_of_window(s.alloc, row.tolist(), 10, 0, W),
        "allocator_none": lambda: release_out_of_window(None, row, 10, 0, W),
        "seq_len_2**70": lambda: release_out_of_window(s.alloc, row, 2 ** 70, 0, W),
        "window_2**63": lambda: release_out_of_window(s.alloc, row, 10, 0, 2 ** 63),
    }
    _refused(s, fns[case])


def test_release_out_of_window_batch_window_past_int64_is_typed():
    s = State()
    f = torch.zeros(1, dtype=I64)
    _refused(s, lambda: release_out_of_window_batch(s.alloc, s.rtt.req_to_token, torch.tensor([s.row]),
                                                    torch.tensor([10]), f, 2 ** 63), ConfigError)


@pytest.mark.parametrize("seq_len, frontier", [(10, 16), (-5, 0)], ids=["frontier_past_seq_len", "negative_seq_len"])
def test_release_out_of_window_batch_refuses_frontier_past_length(seq_len, frontier):
    """A frontier past seq_len (or a negative seq_len) is taken silently: nothing is released and the frontier is
    kept, so the pages between the request's real frontier and it are never released. cache_running and
    release_request refuse the same frontier: `frontier 12 must be ... in [0, seq_len 8]` (bad-inputs rows 99, 191)."""
    s = State()
    f = torch.tensor([frontier], dtype=I64)
    _refused(s, lambda: release_out_of_window_batch(s.alloc, s.rtt.req_to_token, torch.tensor([s.row]),
                                                    torch.tensor([seq_len]), f, 1), LocError)


# ------------------------------------------------------------------------------------------ pool


@pytest.mark.parametrize("layer", [1, None], ids=["layer_id_int", "none"])
def test_set_kv_buffer_refuses_a_layer_without_layer_id(layer):
    """SWAKVPool.set_kv_buffer(layer, ...) with a layer id instead of a layer (or None): a bare AttributeError
    ('int' object has no attribute 'layer_id')."""
    s = State()
    k = torch.randn(10, 2, 8)
    _refused(s, lambda: s.pool.set_kv_buffer(layer, s.loc, k, k))
    _refused(s, lambda: s.pool.full_kv_pool.set_kv_buffer(layer, s.loc, k, k))


def test_translate_into_its_own_loc_is_typed():
    """translate_loc_from_full_to_swa(loc, out=loc) (translating in place): a bare RuntimeError from torch
    ('some elements of the input tensor and the written-to tensor refer to a single memory location')."""
    s = State()
    loc = s.loc.clone()
    _refused(s, lambda: s.pool.translate_loc_from_full_to_swa(loc, out=loc))


# ------------------------------------------------------------------------------------------ backend


@pytest.mark.parametrize("batch", [None, "batch"], ids=["none", "str"])
def test_init_forward_metadata_refuses_what_is_not_a_batch(batch):
    """init_forward_metadata(None): a bare AttributeError ('NoneType' object has no attribute 'forward_mode')."""
    s = State()
    _refused(s, lambda: s.backend.init_forward_metadata(batch))


@pytest.mark.parametrize("field", ["seq_lens", "extend_seq_lens", "req_pool_indices"])
def test_init_forward_metadata_refuses_batch_tensors_on_another_device(field):
    """A ForwardBatch whose lengths are on meta: a bare NotImplementedError ('Cannot copy out of meta tensor'); its
    request rows on meta: a LocError naming values nobody gave ('loc holds values in [94489280618, ...]', read from
    uninitialised memory) instead of the device. out_cache_loc on meta is refused as `loc is on meta, the pool is
    on cpu`."""
    s = State()
    args = dict(req_pool_indices=torch.tensor([s.row]), seq_lens=torch.tensor([10]), extend_seq_lens=torch.tensor([10]))
    args[field] = _meta(1)
    b = ForwardBatch(ForwardMode.EXTEND, 1, args["req_pool_indices"], args["seq_lens"], s.loc, torch.tensor([0]),
                     args["extend_seq_lens"])
    e = _refused(s, lambda: s.backend.init_forward_metadata(b))
    assert "meta" in str(e), str(e)


def test_eager_metadata_refuses_extend_prefix_lens_of_another_batch_size():
    """A ForwardBatch checks every length tensor's entries against batch_size but extend_prefix_lens; a GraphRunner
    refuses it (`extend_prefix_lens has 3 entries, batch_size is 2`, bad-inputs row 98), the eager step takes it."""
    s = State()
    with pytest.raises(HwkvError, match="extend_prefix_lens"):
        b = ForwardBatch(ForwardMode.EXTEND, 1, torch.tensor([s.row]), torch.tensor([10]), s.loc,
                         torch.tensor([0, 0, 0]), torch.tensor([10]))
        s.backend.init_forward_metadata(b)


@pytest.mark.parametrize("what", ["q_list", "k_list", "layer_none", "layer_int"])
def test_forward_refuses_what_is_not_a_tensor_or_a_layer(what):
    """backend.forward(q, k, v, layer, batch) with a list for q or k, or a layer id / None for the layer: a bare
    AttributeError ('list' object has no attribute 'dim', 'NoneType' object has no attribute 'num_heads')."""
    s = State()
    b = s.extend_batch()
    s.backend.init_forward_metadata(b)
    q, k = torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    layer = AttentionLayer(0, 2, 2, 8, sliding_window=W)
    args = {"q_list": ([0.0], k, k, layer), "k_list": (q, [0.0], k, layer), "layer_none": (q, k, k, None),
            "layer_int": (q, k, k, 0)}[what]
    _refused(s, lambda: s.backend.forward(*args, b))


def test_forward_save_kv_cache_takes_a_bool_only():
    """forward(..., save_kv_cache='no') writes K/V (a truthy string), where make_backend refuses debug='no' for this
    reason (bad-inputs row 166)."""
    s = State()
    b = s.extend_batch()
    s.backend.init_forward_metadata(b)
    q = torch.randn(10, 2, 8)
    _refused(s, lambda: s.backend.forward(q, q, q, AttentionLayer(1, 2, 2, 8), b, save_kv_cache="no"), ConfigError)


@pytest.mark.parametrize("case", ["complex_size", "0d_tensor_layer_ids"])
def test_swa_pool_odd_sizes_and_layer_ids_are_config_errors(case):
    """SWAKVPool(size=1j) (a TypeError comparing the complex byte count with the free memory) and
    swa_attention_layer_ids=torch.tensor(0) (a 0-d tensor: 'iteration over a 0-d tensor'): ConfigErrors naming them."""
    with pytest.raises(ConfigError, match="size" if case == "complex_size" else "swa_attention_layer_ids"):
        if case == "complex_size":
            SWAKVPool(1j, 32, P, torch.float32, 2, 8, [0], [1], "cpu")
        else:
            SWAKVPool(64, 32, P, torch.float32, 2, 8, torch.tensor(0), [1], "cpu")


# ------------------------------------------------------------------------------------------ device detection


@contextlib.contextmanager
def cpu_forced_beside_a_broken_plugin(tmp_path: Path, monkeypatch, name: str = "broken27"):
    """A third-party `hwkv.devices` plugin `name` whose module raises on import, installed on sys.path, with
    HWKV_DEVICE=cpu and the device cache cleared around the block."""
    info = tmp_path / f"hwkv_{name}_plugin-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: hwkv_{name}_plugin\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(f"[{devices.ENTRY_POINT_GROUP}]\n{name} = hwkv_{name}:DEVICE\n")
    (tmp_path / f"hwkv_{name}.py").write_text("raise RuntimeError('vendor SDK missing')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    monkeypatch.setenv("HWKV_DEVICE", "cpu")
    devices.current_device.cache_clear()
    try:
        yield
    finally:
        devices.current_device.cache_clear()
        sys.modules.pop(f"hwkv_{name}", None)


def test_forcing_cpu_works_beside_a_third_party_plugin_that_fails_to_import(tmp_path, monkeypatch):
    """DESIGN.md: `HWKV_DEVICE=<name>` forces the device. A probe that raises is skipped when another device is
    forced (its message says so: 'set HWKV_DEVICE to another device (only the forced device is probed then)'), but
    a plugin whose module raises on import makes every device unreachable: HWKV_DEVICE=cpu, and
    make_backend(..., device='cpu'), raise `device plugin entry point 'broken27' ... failed to load` (discover()
    loads every entry point). Forcing a device needs only that device's entry point."""
    with cpu_forced_beside_a_broken_plugin(tmp_path, monkeypatch):
        assert devices.current_device().name == "cpu"
        s_pool, rtt = _pool(), hwkv.ReqToTokenPool(2, 16, "cpu")
        assert hwkv.make_backend(s_pool, rtt, device="cpu", sliding_window=W) is not None


@pytest.mark.parametrize("field, value", [("name", 5), ("backend", None), ("graph_adapter", None)])
def test_device_spec_refuses_non_string_fields_typed(field, value):
    """DeviceSpec validates its fields with ConfigError (tests/test_devices.py::test_spec_validation), but a
    non-string name or import string is a bare AttributeError ('int' object has no attribute 'replace')."""
    args = dict(name="x", priority=1, probe=lambda: None, backend="m:B", graph_adapter="", torch_device="cpu",
                description="x")
    args[field] = value
    with pytest.raises(ConfigError, match=field):
        devices.DeviceSpec(**args)
