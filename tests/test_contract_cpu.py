"""The contract suite for the CPU backend, eager and graph (torch.compile over static buffers)."""
import pytest

from hwkv.testing import available_targets
from hwkv.testing.contract import *  # noqa: F401,F403

pytestmark = pytest.mark.cpu


@pytest.fixture(params=available_targets(only="cpu"), ids=lambda t: t.name)
def hwkv_target(request):
    return request.param
