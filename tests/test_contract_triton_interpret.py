"""The contract suite for hwkv_cuda's TritonBackend, its kernels run by Triton's CPU interpreter.

The interpreter is ~10x slower than the CPU backend, so the reference scenarios run eagerly
on a subset (the graph path is the same kernels over static buffers, covered on the GPU and
by the CPU backend's graph run); every other contract check runs in full.
"""
import os

import pytest

from hwkv.graph import EagerAdapter
from hwkv.testing import ContractTarget
from hwkv.testing import contract as _contract
from hwkv.testing.contract import *  # noqa: F401,F403

triton = pytest.importorskip("triton", reason="triton is not installed (pip install hwkv[cpu])")
pytestmark = [pytest.mark.interpret,
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="a GPU is present: the cuda contract run covers the kernels")]


@pytest.fixture
def hwkv_target():
    from hwkv_cuda.backend import TritonBackend
    return ContractTarget("cuda-interpret", TritonBackend, "cpu", EagerAdapter)


@pytest.mark.parametrize("name", ["p1-fp32", "p4-bf16", "sinks-softcap", "gqa4-vdim", "swa-heads", "fp8"])
def test_outputs_match_reference(hwkv_target, name):  # noqa: F811 - narrows the imported test
    _contract.test_outputs_match_reference(hwkv_target, name, graph=False)


def test_small_swa_pool_reuses_released_slots(hwkv_target):  # noqa: F811 - shorter run, same property
    h = _contract.make(hwkv_target, size=1024, size_swa=64, page_size=4)
    _contract.run_scenario(h, steps=20, prompt_lens=(9, 11, 6), chunk=5, finish=False)
    assert 1024 - h.allocator.full_available_size() > 64, "the run must hold more tokens than the SWA pool has"


# every pair of (page size, verify kernel, eager or graph) once: four of the eight runs, each ~5-15 s interpreted (the
# CPU backend's contract run and the GPU run take all eight)
@pytest.mark.parametrize("page_size, verify_kernel, graph", [(1, "extend", False), (1, "decode", True),
                                                             (4, "extend", True), (4, "decode", False)],
                         ids=["1-extend-eager", "1-decode-graph", "4-extend-graph", "4-decode-eager"])
def test_tree_verify_accept_and_reuse(hwkv_target, page_size, verify_kernel, graph):  # noqa: F811 - narrows it
    from hwkv.testing import contract_spec
    contract_spec.test_tree_verify_accept_and_reuse(hwkv_target, page_size, graph, verify_kernel)
