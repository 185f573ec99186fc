"""The oracle on hand-computed cases: the window edge, sinks, soft-cap, GQA."""
import math

import torch

from hwkv import reference
from hwkv.window import first_visible, window_left


def one_hot_values(n, dv=None):
    """V row j is the one-hot e_j: the output row is the attention distribution itself."""
    return torch.eye(n).view(n, 1, n)


def test_window_edge_query_sees_exactly_w_keys():
    n, w = 8, 3
    q = torch.zeros(n, 1, 4)
    k = torch.zeros(n, 1, 4)  # equal logits: uniform over the visible keys
    out = reference.attention(q, k, one_hot_values(n), torch.arange(n), torch.arange(n), window=w)
    assert torch.allclose(out[5, 0], torch.tensor([0, 0, 0, 1 / 3, 1 / 3, 1 / 3, 0, 0]))
    assert torch.allclose(out[1, 0], torch.tensor([0.5, 0.5, 0, 0, 0, 0, 0, 0]))
    assert [first_visible(5, 3), window_left(3), first_visible(1, 3), first_visible(5, None)] == [3, 2, 0, 0]
    assert torch.allclose(out[7, 0, 5:], torch.full((3,), 1 / 3))


def test_window_of_one_sees_itself_and_decode_matches_extend():
    q, k = torch.randn(6, 2, 4), torch.randn(6, 2, 4)
    v = torch.randn(6, 2, 4)
    ext = reference.attention(q, k, v, torch.arange(6), torch.arange(6), window=1)
    assert torch.allclose(ext, v, atol=1e-6)
    dec = reference.attention(q[5:], k, v, torch.tensor([5]), torch.arange(6), window=4)
    ext4 = reference.attention(q, k, v, torch.arange(6), torch.arange(6), window=4)
    assert torch.allclose(dec, ext4[5:], atol=1e-6)


def test_sink_adds_one_logit_to_the_denominator():
    q, k = torch.zeros(1, 1, 2), torch.zeros(2, 1, 2)
    v = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])
    out = reference.attention(q, k, v, torch.tensor([1]), torch.arange(2), sinks=torch.tensor([math.log(2.0)]))
    # weights e^0 / (e^0 + e^0 + 2) = 1/4 each
    assert torch.allclose(out[0, 0], torch.tensor([0.25, 0.25]))


def test_soft_cap_bounds_the_logits():
    q = torch.tensor([[[10.0]]])
    k = torch.tensor([[[10.0]], [[0.0]]])
    v = torch.tensor([[[1.0]], [[0.0]]])
    out = reference.attention(q, k, v, torch.tensor([1]), torch.arange(2), scaling=1.0, logit_cap=2.0)
    p = math.exp(2 * math.tanh(50)) / (math.exp(2 * math.tanh(50)) + 1)
    assert abs(out.item() - p) < 1e-5


def test_gqa_shares_kv_heads():
    q = torch.randn(3, 4, 8)
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    out = reference.attention(q, k, v, torch.arange(2, 5), torch.arange(5))
    for h in range(4):
        single = reference.attention(q[:, h:h + 1], k[:, h // 2:h // 2 + 1], v[:, h // 2:h // 2 + 1],
                                     torch.arange(2, 5), torch.arange(5))
        assert torch.allclose(out[:, h:h + 1], single, atol=1e-6)
