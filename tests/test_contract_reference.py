"""The contract suite run against the reference backend: checks the template itself, kernel-free."""
import pytest

from hwkv.graph import EagerAdapter
from hwkv.testing import ContractTarget
from hwkv.testing.contract import *  # noqa: F401,F403
from hwkv.testing.reference_backend import ReferenceBackend


@pytest.fixture
def hwkv_target():
    return ContractTarget("reference", ReferenceBackend, "cpu", EagerAdapter)
