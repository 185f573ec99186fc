"""Bad input to the pools, KVWriteLoc and AttentionLayer (found by review): a typed error naming the value and
the limit, raised before anything is written, so every K/V buffer, the full->SWA table and the allocator are
unchanged (snapshots before and after). CPU: values are checked here (see hwkv.checks.values_checkable)."""
import math
import re

import pytest
import torch
from torch.overrides import TorchFunctionMode

from hwkv.allocator import SWATokenToKVPoolAllocator, same_snapshot
from hwkv.checks import scale_value
from hwkv.errors import ConfigError, LocError, ShapeError
from hwkv.layer import AttentionLayer
from hwkv.loc import KVWriteLoc
from hwkv.pool import MHATokenToKVPool, SWAKVPool

I64 = torch.int64
SIZE, SIZE_SWA, H, D = 64, 32, 2, 8
SWA_LAYER, FULL_LAYER = AttentionLayer(0, 4, H, D, sliding_window=4), AttentionLayer(1, 4, H, D)


class Hybrid:
    """A hybrid pool (SWA layer 0, full layer 1) with its allocator and 6 tokens allocated."""

    def __init__(self, allocator=True):
        self.pool = SWAKVPool(SIZE, SIZE_SWA, 1, torch.float32, H, D, [0], [1], "cpu")
        self.alloc = SWATokenToKVPoolAllocator(SIZE, SIZE_SWA, 1, "cpu", self.pool) if allocator else None
        self.loc = self.alloc.alloc(6) if allocator else torch.arange(1, 7)
        self.swa_loc = self.pool.translate_loc_from_full_to_swa(self.loc) if allocator else torch.arange(1, 7)
        for g in (self.pool.full_kv_pool, self.pool.swa_kv_pool):  # distinct contents, so a move or write shows
            for b in (*g.k_buffer, *g.v_buffer):
                b.copy_(torch.randn(b.shape))

    def snapshot(self):
        p = self.pool
        snap = {"buffers": [b.clone() for g in (p.full_kv_pool, p.swa_kv_pool) for b in (*g.k_buffer, *g.v_buffer)]}
        if p.full_to_swa_index_mapping is not None:
            snap["mapping"] = p.full_to_swa_index_mapping.clone()
        if self.alloc is not None:
            snap["allocator"] = self.alloc.integrity_snapshot()
        return snap

    def same(self, a, b):
        return (all(torch.equal(x, y) for x, y in zip(a["buffers"], b["buffers"]))
                and torch.equal(a.get("mapping", torch.zeros(0)), b.get("mapping", torch.zeros(0)))
                and ("allocator" not in a or same_snapshot(a["allocator"], b["allocator"])))

    def refused(self, call, exc, match):
        """call() raises exc (message matching) and leaves every buffer, the table and the allocator as they were."""
        before = self.snapshot()
        with pytest.raises(exc, match=match):
            call()
        assert self.same(before, self.snapshot()), "a refused call changed the pool"
        self.pool.check_integrity()
        if self.alloc is not None:
            self.alloc.check_integrity()

    def kv(self, n=6):
        return torch.randn(n, H, D), torch.randn(n, H, D)


def write(h, layer, **kw):
    """set_kv_buffer of `layer` with h's locs (and its swa_loc for the SWA layer) and fresh K/V; kw overrides."""
    k, v = h.kv()
    args = dict(loc=h.loc, cache_k=k, cache_v=v, swa_loc=h.swa_loc if layer is SWA_LAYER else None)
    args.update(kw)
    loc, k, v = args.pop("loc"), args.pop("cache_k"), args.pop("cache_v")
    return lambda: h.pool.set_kv_buffer(layer, loc, k, v, **args)


LAYERS = pytest.mark.parametrize("layer", [SWA_LAYER, FULL_LAYER], ids=["swa", "full"])


# ---- D1: K or V on another device is refused before either is written ------------------------------------
@LAYERS
@pytest.mark.parametrize("which", ["cache_k", "cache_v"])
def test_kv_on_another_device_is_refused_before_k_is_written(layer, which):
    h = Hybrid()
    k, v = h.kv()
    kw = {which: (k if which == "cache_k" else v).to("meta")}
    h.refused(write(h, layer, **kw), ShapeError, rf"{which} is on meta, the pool's buffers are on cpu")


def test_kv_on_another_device_is_refused_by_a_plain_pool():
    pool = MHATokenToKVPool(16, 1, torch.float32, H, D, 1, "cpu")
    before = [b.clone() for b in (*pool.k_buffer, *pool.v_buffer)]
    with pytest.raises(ShapeError, match="cache_v is on meta"):
        pool.set_kv_buffer(FULL_LAYER, torch.tensor([1, 2]), torch.ones(2, H, D), torch.ones(2, H, D, device="meta"),
                           layer_id_override=0)
    assert all(torch.equal(a, b) for a, b in zip(before, (*pool.k_buffer, *pool.v_buffer)))


@LAYERS
def test_locs_on_another_device_are_refused(layer):
    h = Hybrid()
    name = "swa_loc" if layer is SWA_LAYER else "loc"
    kw = {name: (h.swa_loc if layer is SWA_LAYER else h.loc).to("meta")}
    h.refused(write(h, layer, **kw), LocError, f"^{name} is on meta, the pool is on cpu")


# ---- D2: a K/V scale must be finite and > 0 ---------------------------------------------------------------
BAD_SCALES = [0.0, -1.0, float("nan"), float("inf"), torch.tensor(0.0), torch.tensor(float("nan"))]


def _scale_text(s):
    return re.escape(repr(float(s)))


@LAYERS
@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
@pytest.mark.parametrize("scale", BAD_SCALES, ids=str)
def test_a_zero_negative_or_non_finite_scale_is_refused_by_set_kv_buffer(layer, which, scale):
    h = Hybrid()
    h.refused(write(h, layer, **{which: scale}), ConfigError, rf"{which}={_scale_text(scale)} must be .*> 0")


@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
def test_a_scale_that_is_not_a_number_or_not_a_scalar_is_refused(which):
    h = Hybrid()
    h.refused(write(h, FULL_LAYER, **{which: "0.5"}), ConfigError, rf"{which}='0.5' must be")
    h.refused(write(h, FULL_LAYER, **{which: torch.ones(2)}), ShapeError, rf"{which} must be a scalar, got shape \[2\]")


@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
@pytest.mark.parametrize("scale", BAD_SCALES, ids=str)
def test_a_layer_with_a_zero_negative_or_non_finite_scale_is_refused(which, scale):
    with pytest.raises(ConfigError, match=rf"{which}={_scale_text(scale)} must be .*> 0"):
        AttentionLayer(1, 4, H, D, **{which: scale})
    with pytest.raises(ConfigError, match=rf"{which}={_scale_text(scale)}"):
        scale_value(which, scale)


def test_good_scales_still_store_and_become_host_floats():
    h = Hybrid()
    k, v = h.kv()
    h.pool.set_kv_buffer(FULL_LAYER, h.loc, k, v, k_scale=0.5, v_scale=torch.tensor(2.0))
    assert torch.allclose(h.pool.get_key_buffer(1)[h.loc], k / 0.5)
    assert torch.allclose(h.pool.get_value_buffer(1)[h.loc], v / 2.0)
    layer = AttentionLayer(1, 4, H, D, k_scale=torch.tensor(0.25), v_scale=1)
    assert layer.k_scale == 0.25 and type(layer.k_scale) is float and layer.v_scale == 1.0


# ---- D3: 0-d and non-tensor locs / K/V get a typed error, not a bare IndexError/AttributeError --------------
@pytest.mark.parametrize("kw, exc, match", [
    (dict(swa_loc=torch.tensor(3)), LocError, r"swa_loc must be 1-D, got shape \(\)"),
    (dict(swa_loc=[1, 2, 3, 4, 5, 6]), LocError, "swa_loc must be a torch.Tensor, got list"),
    (dict(loc=[1, 2, 3, 4, 5, 6]), LocError, "loc must be a torch.Tensor, got list"),
    (dict(loc=torch.tensor(3)), LocError, r"loc must be 1-D, got shape \(\)"),
    (dict(swa_loc=torch.ones(1, 6, dtype=I64)), LocError, r"swa_loc must be 1-D, got shape \(1, 6\)"),
], ids=["swa_loc-0d", "swa_loc-list", "loc-list", "loc-0d", "swa_loc-2d"])
def test_swa_layer_locs_that_are_not_1d_tensors_are_refused(kw, exc, match):
    h = Hybrid()
    h.refused(write(h, SWA_LAYER, **kw), exc, match)


@LAYERS
@pytest.mark.parametrize("which", ["cache_k", "cache_v"])
def test_kv_that_is_not_a_tensor_is_refused(layer, which):
    h = Hybrid()
    k, v = h.kv()
    h.refused(write(h, layer, **{which: (k if which == "cache_k" else v).tolist()}), ShapeError,
              rf"{which} must be a torch.Tensor, got list")


def test_full_layer_loc_that_is_not_a_1d_tensor_is_refused():
    h = Hybrid()
    h.refused(write(h, FULL_LAYER, loc=[1, 2, 3, 4, 5, 6]), LocError, "loc must be a torch.Tensor, got list")
    h.refused(write(h, FULL_LAYER, loc=torch.tensor(3)), LocError, r"loc must be 1-D, got shape \(\)")


@pytest.mark.parametrize("loc, swa_loc, match", [
    (torch.tensor(3), torch.tensor([1]), r"KVWriteLoc.loc must be 1-D, got shape \(\)"),
    (torch.tensor([3]), torch.tensor(1), r"KVWriteLoc.swa_loc must be 1-D, got shape \(\)"),
    (torch.tensor(3), None, r"KVWriteLoc.loc must be 1-D, got shape \(\)"),
    ([3], None, "KVWriteLoc.loc must be a torch.Tensor, got list"),
    (torch.tensor([3]), [1], "KVWriteLoc.swa_loc must be a torch.Tensor, got list"),
    (torch.tensor([3], dtype=torch.int32), None, "KVWriteLoc.loc must be int64, got torch.int32"),
])
def test_kvwriteloc_refuses_locs_that_are_not_1d_int64_tensors(loc, swa_loc, match):
    with pytest.raises(LocError, match=match):
        KVWriteLoc(loc, swa_loc)


# ---- D4: translate_loc_from_full_to_swa checks loc and out= ----------------------------------------------
LIMIT = rf"\[-1, {SIZE + 1}\)"  # size + page_size; -1 is the table's trailing "no loc" entry


@pytest.mark.parametrize("loc, exc, match", [
    (torch.tensor([1000]), LocError, rf"loc holds values in \[1000, 1000\], allowed range is {LIMIT}"),
    (torch.tensor([SIZE + 1]), LocError, rf"\[{SIZE + 1}, {SIZE + 1}\], allowed range is {LIMIT}"),
    (torch.tensor([-5, 2]), LocError, rf"loc holds values in \[-5, 2\], allowed range is {LIMIT}"),
    (torch.tensor([1.0]), LocError, "loc must be int64, got torch.float32"),
    (torch.tensor([1], dtype=torch.int32), LocError, "loc must be int64, got torch.int32"),
    (torch.tensor([[3, 70]]), LocError, rf"loc holds values in \[3, 70\], allowed range is {LIMIT}"),
    ([1, 2], LocError, "loc must be a torch.Tensor, got list"),
    (torch.tensor([1], device="meta"), LocError, "loc is on meta"),
], ids=["1000", "size+page", "-5", "float", "int32", "2d-table", "list", "meta"])
@pytest.mark.parametrize("with_out", [False, True], ids=["eager", "out"])
def test_translate_refuses_bad_loc(loc, exc, match, with_out):
    h = Hybrid()
    out = torch.full((4,), 7, dtype=I64)
    kw = dict(out=out) if with_out else {}
    if with_out and isinstance(loc, torch.Tensor) and loc.dim() == 2:  # into out=, locs are 1-D
        match = r"loc must be 1-D, got shape \(1, 2\)"
    h.refused(lambda: h.pool.translate_loc_from_full_to_swa(loc, **kw), exc, match)
    assert (out == 7).all(), "a refused translation wrote out="


@pytest.mark.parametrize("out, match", [
    (torch.zeros(4, dtype=torch.int32), "out must be int64, got torch.int32"),
    (torch.zeros(4), "out must be int64, got torch.float32"),
    (torch.zeros(2, 2, dtype=I64), r"out must be 1-D, got shape \(2, 2\)"),
    (torch.zeros(4, dtype=I64, device="meta"), "out is on meta"),
    ([0, 0, 0, 0], "out must be a torch.Tensor, got list"),
])
def test_translate_refuses_bad_out(out, match):
    h = Hybrid()
    h.refused(lambda: h.pool.translate_loc_from_full_to_swa(h.loc[:1], out=out), LocError, match)


def test_translate_refuses_a_0d_loc_into_out():
    h = Hybrid()
    out = torch.full((4,), 7, dtype=I64)
    h.refused(lambda: h.pool.translate_loc_from_full_to_swa(torch.tensor(3), out=out), LocError,
              r"loc must be 1-D, got shape \(\)")
    assert (out == 7).all()


def test_translate_still_maps_minus_one_tables_and_fills_out():
    h = Hybrid()
    assert h.pool.translate_loc_from_full_to_swa(torch.tensor([-1])).tolist() == [-1]
    table = h.loc.view(2, 3)  # a backend's [bs, L] table of a window: one gather, any shape
    assert torch.equal(h.pool.translate_loc_from_full_to_swa(table), h.swa_loc.view(2, 3))
    out = torch.full((8,), 7, dtype=I64)
    got = h.pool.translate_loc_from_full_to_swa(h.loc, out=out)
    assert torch.equal(got, h.swa_loc) and (out[6:] == 0).all()


# ---- D5: AttentionLayer geometry, window, logit cap ---------------------------------------------------------
@pytest.mark.parametrize("kw, match", [
    (dict(sliding_window=0), "sliding_window=0 must be an int >= 1"),
    (dict(sliding_window=-1), "sliding_window=-1 must be an int >= 1"),
    (dict(sliding_window=True), "sliding_window=True must be an int >= 1"),
    (dict(sliding_window=4.0), r"sliding_window=4\.0 must be an int >= 1"),
    (dict(head_dim=0), "head_dim=0 must be an int >= 1"),
    (dict(head_dim=-4), "head_dim=-4 must be an int >= 1"),
    (dict(head_dim=8.0), r"head_dim=8\.0 must be an int >= 1"),
    (dict(num_heads=0), "num_heads=0 must be an int >= 1"),
    (dict(num_kv_heads=0), "num_kv_heads=0 must be an int >= 1"),
    (dict(v_head_dim=0), "v_head_dim=0 must be an int >= 1"),
    (dict(v_head_dim=-2), "v_head_dim=-2 must be an int >= 1"),
    (dict(logit_cap=-1.0), r"logit_cap=-1\.0 must be"),
    (dict(logit_cap=float("nan")), "logit_cap=nan must be"),
    (dict(logit_cap=float("inf")), "logit_cap=inf must be"),
], ids=lambda v: str(v) if not isinstance(v, dict) else "-".join(f"{k}={x}" for k, x in v.items()))
def test_layer_with_bad_geometry_window_or_cap_is_refused(kw, match):
    args = dict(layer_id=0, num_heads=4, num_kv_heads=H, head_dim=D)
    args.update(kw)
    with pytest.raises(ConfigError, match=match):
        AttentionLayer(**args)


def test_layer_good_values_still_work():
    assert AttentionLayer(0, 4, 2, 8, sliding_window=1).window == 1
    assert AttentionLayer(0, 4, 2, 8, sliding_window=None).window is None
    layer = AttentionLayer(0, 4, 2, 16, v_head_dim=8, logit_cap=30.0)
    assert layer.scaling == pytest.approx(1 / math.sqrt(16)) and layer.v_head_dim == 8


# ---- D6: pool constructors -----------------------------------------------------------------------------
@pytest.mark.parametrize("kw, match", [
    (dict(swa_head_num=0), "swa_head_num=0 must be an int >= 1"),
    (dict(swa_head_dim=0), "swa_head_dim=0 must be an int >= 1"),
    (dict(swa_v_head_dim=0), "swa_v_head_dim=0 must be an int >= 1"),
    (dict(v_head_dim=-1), "v_head_dim=-1 must be an int >= 1"),
    (dict(v_head_dim=0), "v_head_dim=0 must be an int >= 1"),
    (dict(v_head_dim=8.0), r"v_head_dim=8\.0 must be an int >= 1"),
])
def test_swa_pool_with_bad_head_geometry_is_refused(kw, match):
    with pytest.raises(ConfigError, match=match):
        SWAKVPool(16, 8, 1, torch.float32, 2, 8, [0], [1], "cpu", **kw)


@pytest.mark.parametrize("v_head_dim", [-1, 0, 8.0])
def test_plain_pool_with_bad_v_head_dim_is_refused(v_head_dim):
    with pytest.raises(ConfigError, match=rf"v_head_dim={re.escape(repr(v_head_dim))} must be an int >= 1"):
        MHATokenToKVPool(16, 1, torch.float32, 2, 8, 2, "cpu", v_head_dim=v_head_dim)


def test_swa_head_num_none_means_the_full_groups():
    assert SWAKVPool(16, 8, 1, torch.float32, 2, 8, [0], [1], "cpu").swa_kv_pool.head_num == 2
    assert SWAKVPool(16, 8, 1, torch.float32, 2, 8, [0], [1], "cpu", swa_head_num=4).swa_kv_pool.head_num == 4


class FactoriesWithoutDevice(TorchFunctionMode):
    """Records tensor factories called without device= (they would land on the user's default device)."""

    FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.arange, torch.tensor, torch.empty_like}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FACTORIES and func is not torch.empty_like and "device" not in kwargs:
            self.calls.append(func.__name__)
        return func(*args, **kwargs)


def test_pool_construction_and_sizes_never_use_the_default_device():
    with FactoriesWithoutDevice() as mode:
        pool = SWAKVPool(16, 8, 1, torch.bfloat16, 2, 8, [0], [1], "cpu")
        plain = MHATokenToKVPool(16, 1, torch.float16, 2, 8, 2, "cpu")
        sizes = pool.bytes_per_token(), plain.bytes_per_token()
    assert mode.calls == []
    assert sizes == ((1 * 2 * 16 * 2, 1 * 2 * 16 * 2), 2 * 2 * 16 * 2)


# ---- D11: SWAKVPool.move_kv checks and translates everything before it moves anything ----------------------
def test_move_kv_without_a_mapping_moves_nothing():
    h = Hybrid(allocator=False)
    h.refused(lambda: h.pool.move_kv(torch.tensor([3]), torch.tensor([5])), ConfigError,
              "no full_to_swa_index_mapping")


@pytest.mark.parametrize("src, dst, match", [
    (torch.tensor([3]), torch.tensor([SIZE + 5]), rf"dst_loc holds values in \[{SIZE + 5}, {SIZE + 5}\]"),
    (torch.tensor([3, 4]), torch.tensor([5]), "src_loc has"),
    (torch.tensor([3.0]), torch.tensor([5]), "src_loc must be int64"),
])
def test_move_kv_with_bad_locs_moves_nothing(src, dst, match):
    h = Hybrid()
    h.refused(lambda: h.pool.move_kv(src, dst), LocError, match)


def test_move_kv_moves_both_groups():
    h = Hybrid()
    src, dst = h.loc[:2], h.loc[4:6]
    full_k = h.pool.get_key_buffer(1)[src].clone()
    swa_v = h.pool.get_value_buffer(0)[h.swa_loc[:2]].clone()
    h.pool.move_kv(src, dst)
    assert torch.equal(h.pool.get_key_buffer(1)[dst], full_k)
    assert torch.equal(h.pool.get_value_buffer(0)[h.swa_loc[4:6]], swa_v)
