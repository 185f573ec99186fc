"""GraphRunner and graph state: runners of one backend share its static buffers safely."""
import pytest

from hwkv.batch import ForwardMode
from hwkv.errors import ConfigError
from hwkv.testing.harness import Harness, ModelGeometry
from hwkv.testing.reference_backend import ReferenceBackend


def test_a_second_runner_shares_the_static_buffers_instead_of_reallocating_them():
    h = Harness(ReferenceBackend, geometry=ModelGeometry(), size=512, size_swa=128)
    decode = h.enable_graphs([1, 2, 4])
    buffers = (h.backend.static, h.backend.loc_cache.buffer)
    h.enable_graphs([1, 2], mode=ForwardMode.TARGET_VERIFY, tokens_per_req=2)  # 4 tokens: fits
    assert (h.backend.static, h.backend.loc_cache.buffer) == buffers, "captured graphs would read freed buffers"
    rids = [h.add_request() for _ in range(2)]
    h.forward(rids, [6, 9], ForwardMode.EXTEND)
    h.runner = decode
    h.forward(rids, [1, 1], ForwardMode.DECODE)  # the decode graphs still read valid buffers
    with pytest.raises(ConfigError, match="call init_graph_state once with the largest sizes"):
        h.backend.init_graph_state(8, 8)
