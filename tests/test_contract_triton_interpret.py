"""The contract suite for hwkv_cuda's TritonBackend, its kernels run by Triton's CPU interpreter."""
import os

import pytest

from hwkv.graph import EagerAdapter
from hwkv.testing import ContractTarget
from hwkv.testing.contract import *  # noqa: F401,F403

triton = pytest.importorskip("triton", reason="triton is not installed (pip install hwkv[cpu])")
pytestmark = [pytest.mark.interpret,
              pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="a GPU is present: the cuda contract run covers the kernels")]


@pytest.fixture
def hwkv_target():
    from hwkv_cuda.backend import TritonBackend
    return ContractTarget("cuda-interpret", TritonBackend, "cpu", EagerAdapter)
