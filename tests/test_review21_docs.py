"""Review 21 (what a newcomer reads): the CPU store refuses what the kernels' store refuses (bad-inputs row 70), and
`hwkv generate --help` states the CPU's default memory cap as the code applies it."""
import pytest
import torch

import hwkv.ops as ops
from hwkv import cli
from hwkv.errors import LocError, ShapeError
from hwkv.engine.pools import CPU_MEMORY_CAP, CPU_MEMORY_FRACTION

S, KVH, D = 16, 1, 4


@pytest.mark.parametrize("loc, scales", [([99], None), ([-1], 2.0), ([-1], None), ([3, 16], None)])
def test_the_cpu_store_refuses_a_loc_outside_the_pool_before_writing(loc, scales):
    """A loc past the pool had been a bare IndexError, and -1 with a scale (or any cast) a silent write into the
    pool's last slot, another token's K/V."""
    kb, vb = torch.zeros(S, KVH, D), torch.zeros(S, KVH, D)
    with pytest.raises(LocError, match=r"lies outside the pool's slots \[0, 16\)"):
        ops.store_kv(kb, vb, torch.tensor(loc), torch.ones(len(loc), KVH, D), torch.ones(len(loc), KVH, D),
                     scales, scales)
    assert not kb.any() and not vb.any()


def test_the_cpu_store_refuses_shapes_and_keeps_storing_good_rows():
    kb, vb = torch.zeros(S, KVH, D), torch.zeros(S, KVH, D)
    with pytest.raises(ShapeError, match=r"k has shape \[2, 1, 4\], expected \[1, 1, 4\]"):
        ops.store_kv(kb, vb, torch.tensor([3]), torch.ones(2, KVH, D), torch.ones(1, KVH, D))
    with pytest.raises(LocError, match="1-D int64"):
        ops.store_kv(kb, vb, torch.tensor([3.0]), torch.ones(1, KVH, D), torch.ones(1, KVH, D))
    assert not kb.any()
    ops.store_kv(kb, vb, torch.tensor([3, 5]), torch.ones(2, KVH, D), 2 * torch.ones(2, KVH, D), 2.0, None)
    assert kb[3].eq(0.5).all() and vb[5].eq(2).all() and kb.count_nonzero() == 2 * D


def test_generate_help_states_the_cpus_default_memory_cap(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert CPU_MEMORY_FRACTION == 0.25 and CPU_MEMORY_CAP == 4 << 30
    assert "on the CPU a quarter of the available RAM and at most 4 GiB" in text, text


def test_the_npu_store_is_registered_behind_the_cores_checks(monkeypatch):
    """Ascend's reshape-and-cache store checks nothing itself: registered as the checked store it had taken any
    loc; the pool's per-layer calls keep the unchecked one (`prechecked`)."""
    pytest.importorskip("hwkv_npu.backend")
    from hwkv_npu import ops as npu_ops
    calls = []
    monkeypatch.setattr(npu_ops, "store_kv", lambda *a: calls.append(a))
    checked = ops.checked_store(npu_ops.store_kv)
    kb, vb = torch.zeros(S, KVH, D), torch.zeros(S, KVH, D)
    with pytest.raises(LocError, match=r"loc\[0\] = 16 lies outside the pool's slots \[0, 16\)"):
        checked(kb, vb, torch.tensor([16]), torch.ones(1, KVH, D), torch.ones(1, KVH, D))
    assert not calls
    checked(kb, vb, torch.tensor([15]), torch.ones(1, KVH, D), torch.ones(1, KVH, D))
    assert len(calls) == 1
    assert ops._STORE_PRECHECKED["npu"] is not ops._STORE["npu"]
    assert ops._STORE["npu"].__qualname__.startswith("checked_store")
