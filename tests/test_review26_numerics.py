"""Review 26: numerical-correctness defects found by differential fuzzing (CPU torch kernels, Triton kernels under
TRITON_INTERPRET=1, eager and graph) against hwkv.reference: a speculative accept over an fp8 pool at page size > 1
(the CPU's index_copy_ has no float8 kernel: the move now copies bytes), and sinks that are no finite logit."""
import pytest
import torch

from hwkv.batch import ForwardMode
from hwkv.errors import ConfigError
from hwkv.layer import AttentionLayer
from hwkv.pool import MHATokenToKVPool
from hwkv.testing.harness import Harness, ModelGeometry
from hwkv.testing.spec_harness import tree_verify
from hwkv_cpu.backend import TorchCPUBackend

FP8 = [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d]


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_move_kv_of_an_fp8_pool(dtype):
    """pool.move_kv (speculative acceptance at page size > 1) on an fp8 pool: `index_copy_` has no CPU kernel for
    float8, so the move raises a bare NotImplementedError instead of copying (every other pool op takes fp8)."""
    pool = MHATokenToKVPool(size=16, page_size=2, dtype=dtype, head_num=1, head_dim=8, layer_num=1, device="cpu")
    pool.k_buffer[0][2] = torch.arange(8, dtype=torch.float32).to(dtype).view(1, 8)
    pool.move_kv(torch.tensor([2]), torch.tensor([5]))
    assert torch.equal(pool.k_buffer[0][5].float(), pool.k_buffer[0][2].float())


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_tree_verify_accept_over_fp8_pool_at_page_size_2(dtype):
    """A tree verify over an fp8 KV cache (page size 2) then accept_draft_tokens keeping the path [0, 2]: the
    verify's outputs match the reference, the accept then dies in pool.move_kv with NotImplementedError
    ("index_copy_cpu" not implemented for 'Float8_...') - speculative decoding cannot run over fp8 KV on the CPU."""
    g = ModelGeometry(num_layers=2, swa_every=2, window=4, num_heads=4, num_kv_heads=2, head_dim=16)
    h = Harness(TorchCPUBackend, "cpu", g, size=256, size_swa=64, page_size=2, dtype=dtype,
                k_scale=0.5, v_scale=0.5)
    rids = [h.add_request()]
    h.forward(rids, [5], ForwardMode.EXTEND)
    h.release()
    tree_verify(h, rids, [[-1, 0, 0]], [[0, 2]])
    h.release()
    h.forward(rids, [1], ForwardMode.DECODE)   # decode after the accept reads the moved K/V
    h.check_integrity()


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_sinks_that_are_not_finite_logits_are_refused(bad):
    """A sink of +inf (all of the softmax's mass) or NaN: the reference and the Triton kernels give zeros for +inf,
    hwkv_cpu's kernels NaN (inf - inf in their max subtraction), and NaN gives NaN or garbage. The layer refuses
    both where values are checkable (CPU sinks; any device in debug mode); -inf (no sink) stays allowed."""
    sinks = torch.tensor([0.5, bad, 0.0, 1.0])
    with pytest.raises(ConfigError, match=r"sinks\[1\] is (inf|nan): every sink must be a finite logit"):
        AttentionLayer(0, 4, 2, 16, sinks=sinks)
    AttentionLayer(0, 4, 2, 16, sinks=torch.tensor([0.5, float("-inf"), 0.0, 1.0]))
