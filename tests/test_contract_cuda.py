"""The contract suite for the CUDA backend on a real GPU, eager and CUDA graphs (skips without one)."""
import pytest
import torch

from hwkv.testing import available_targets
from hwkv.testing.contract import *  # noqa: F401,F403

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")]


@pytest.fixture(params=available_targets(only="cuda") if torch.cuda.is_available() else [], ids=lambda t: t.name)
def hwkv_target(request):
    return request.param
