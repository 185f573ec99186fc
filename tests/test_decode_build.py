"""The decode split kernel builds for sm_90 without a GPU, under the configs the dispatch gives a GPT-OSS layer (64 q /
8 kv heads, D=64, bf16, sinks): its key and value loads are asynchronous copies (cp.async, the pipelined gather), and
ptxas takes it without spilling registers. `make test` runs these under TRITON_INTERPRET=0 after the main suite,
beside the Gluon extend kernel's build, so a Triton upgrade that spills or stops pipelining the loads shows in CI."""
import dataclasses

import pytest

pytest.importorskip("triton")

from hwkv_cuda.kernels import decode as dec  # noqa: E402

from test_extend_hopper import _build_reason, _sass  # noqa: E402


# (config, splits, in-place merge, keys): the plans of 64 x 4K (two kv heads a program, one split), 1 x 32K (two
# heads, the merge kernel after 64 splits), 16 x 4K (one head, 5 splits merged in place by the last) and the W=128
# window list at batch 1 (one head, one split)
PLANS = {"wide": (dec.WIDE_CONFIG, 1, False, 4096), "long": (dec.LONG_CONFIG, 64, False, 32768),
         "fused": (dec.GPU_CONFIG, 5, True, 4096), "window": (dec.GPU_CONFIG, 1, False, 128),
         # whole key rows (8 kv heads a program as a batch of per-head dots) at 256 x 4K, 4 heads at 64 x 32K
         "rows": (dec.ROWS_CONFIG, 1, False, 4096), "wide_long": (dec.WIDE_LONG_CONFIG, 1, False, 32768),
         # pools past 2**31 elements: 64-bit gather offsets
         "long_64bit": (dec.LONG_CONFIG, 64, False, 32768, 1 << 31),
         # slots loaded a tile ahead (DecodeConfig.slots_ahead)
         "fused_ahead": (dataclasses.replace(dec.GPU_CONFIG, slots_ahead=True), 5, True, 4096),
         "long_ahead": (dataclasses.replace(dec.LONG_CONFIG, slots_ahead=True, num_stages=3), 64, False, 32768),
         # the middle batches' one even wave (16 x 4K: 2 splits merged in place; 32 x 4K: one) and small batches over
         # long lists with their splits rounded down (16 x 32K: 4 splits)
         "mid": (dec.MID_CONFIG, 2, True, 4096), "mid_direct": (dec.MID_CONFIG, 1, False, 4096),
         "long_few": (dec.LONG_FEW_CONFIG, 4, True, 32768)}


@pytest.mark.skipif(_build_reason() is not None, reason=str(_build_reason()))
@pytest.mark.parametrize("plan", sorted(PLANS))
def test_decode_compiles_for_sm90_without_a_gpu(plan):
    cfg, splits, fused, keys, *pool = PLANS[plan]
    k = dec.compile_split_for_sm90(cfg, splits, fused, keys, **(dict(pool_elements=pool[0]) if pool else {}))
    ptx = k.asm["ptx"]
    assert "cp.async" in ptx, "the K/V gathers are no longer asynchronous copies (not pipelined)"
    assert ".local" not in ptx
    if fused:
        assert "atom" in ptx, "the in-place merge's arrival counter"
    sass = _sass(k.asm["cubin"])
    if sass is not None:   # register spills show only in the machine code: local stores and loads
        assert sass.count("STL") == 0, "the sm_90 build spills registers"


@pytest.mark.skipif(_build_reason() is not None, reason=str(_build_reason()))
def test_decode_slots_ahead_deepens_the_kv_gathers_for_sm90():
    """Triton's pipeliner keeps the K/V gathers behind their iteration's index load, one tile deep at any num_stages;
    slots loaded a tile ahead let num_stages - 1 tiles fly: at 3 stages, twice the K and V buffers in shared memory."""
    plain = dataclasses.replace(dec.GPU_CONFIG, num_stages=3)
    shared = [dec.compile_split_for_sm90(dataclasses.replace(plain, slots_ahead=a), 5, True, 4096).metadata.shared
              for a in (False, True)]
    assert shared[1] >= 1.5 * shared[0], shared


@pytest.mark.skipif(_build_reason() is not None, reason=str(_build_reason()))
@pytest.mark.parametrize("plan", ["fused", "rows"])
def test_decode_evict_first_marks_the_kv_gathers_for_sm90(plan):
    """DecodeConfig.evict_first reaches the K/V gathers as L2's evict-first hint and keeps them asynchronous copies
    (Triton 3.9); Triton 3.6, the GPU machine's, drops the hint on the cp.async gathers: a no-op there, pinned so a
    release that starts emitting it shows."""
    import triton
    cfg, splits, fused, keys = PLANS[plan]
    plain = dec.compile_split_for_sm90(cfg, splits, fused, keys).asm["ptx"]
    hinted = dec.compile_split_for_sm90(dataclasses.replace(cfg, evict_first=True), splits, fused, keys).asm["ptx"]
    assert "evict_first" not in plain and "cp.async" in hinted
    version = tuple(int(x) for x in triton.__version__.split(".")[:2])
    if version >= (3, 9):
        assert "evict_first" in hinted
    elif version == (3, 6):
        assert "evict_first" not in hinted
    else:
        pytest.skip(f"the hint's presence is not recorded for Triton {triton.__version__}")
