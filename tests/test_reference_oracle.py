"""hwkv.reference checked against torch's own attention, so the oracle cannot drift with the kernels:
torch SDPA with an explicit mask built from the window definition itself (i - W < j <= i), sinks as an
extra zero key whose logit comes from an additive mask, and flex_attention's score_mod for soft-cap
(caps that do not saturate tanh). Prefix offsets (queries of an extend after a prefix), GQA, window
edges (lengths below, at and above W)."""
import math

import pytest
import torch
import torch.nn.functional as F

from hwkv import reference

CASES = [  # (prefix, new tokens, window)
    (0, 9, None), (0, 9, 4), (5, 3, 4), (7, 1, 8), (7, 1, 1), (12, 4, 16), (3, 6, 3), (0, 1, 2)]


def _mask(prefix, new, window):
    """[new, prefix + new] bool from the definition: key j visible to query i iff i - W < j <= i."""
    i = torch.arange(prefix, prefix + new)[:, None]
    j = torch.arange(prefix + new)[None, :]
    vis = j <= i
    if window:
        vis &= j > i - window
    return vis


def _inputs(prefix, new, h=4, kvh=2, d=8, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(new, h, d, generator=g) * scale
    k = torch.randn(prefix + new, kvh, d, generator=g) * scale
    v = torch.randn(prefix + new, kvh, d, generator=g)
    return q, k, v


def _sdpa(q, k, v, vis, sinks=None):
    """SDPA over [1, H, T, D] with GQA expanded; sinks: one extra zero key, its logit in the float mask."""
    h, kvh = q.shape[1], k.shape[1]
    kk = k.repeat_interleave(h // kvh, dim=1).transpose(0, 1)[None]
    vv = v.repeat_interleave(h // kvh, dim=1).transpose(0, 1)[None]
    mask = torch.zeros(h, *vis.shape).masked_fill(~vis, float("-inf"))
    if sinks is not None:
        kk = torch.cat([kk, torch.zeros(1, h, 1, kk.shape[-1])], dim=2)
        vv = torch.cat([vv, torch.zeros(1, h, 1, vv.shape[-1])], dim=2)
        mask = torch.cat([mask, sinks.view(h, 1, 1).expand(h, vis.shape[0], 1)], dim=-1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kk, vv, attn_mask=mask[None])
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("prefix, new, window", CASES)
def test_reference_equals_sdpa_with_an_explicit_mask(prefix, new, window):
    q, k, v = _inputs(prefix, new)
    ref = reference.attention(q, k, v, torch.arange(prefix, prefix + new), torch.arange(prefix + new), window=window)
    assert torch.allclose(ref, _sdpa(q, k, v, _mask(prefix, new, window)), atol=1e-5)


@pytest.mark.parametrize("prefix, new, window", CASES)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_sinks_of_both_signs_equal_an_extra_zero_key(prefix, new, window, sign):
    q, k, v = _inputs(prefix, new, seed=1)
    sinks = sign * torch.tensor([0.5, 2.0, 3.5, 0.1])
    ref = reference.attention(q, k, v, torch.arange(prefix, prefix + new), torch.arange(prefix + new),
                              window=window, sinks=sinks)
    assert torch.allclose(ref, _sdpa(q, k, v, _mask(prefix, new, window), sinks), atol=1e-5)


@pytest.mark.parametrize("prefix, new, window", CASES[:5])
def test_soft_cap_equals_flex_attention_score_mod(prefix, new, window):
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    cap = 5.0
    q, k, v = _inputs(prefix, new, scale=1.5, seed=2)  # logits up to ~2x the cap: tanh bends, not saturated
    scale = 1 / math.sqrt(q.shape[-1])
    logits = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(2, dim=1)) * scale
    assert 0.5 < float(logits.abs().max()) / cap < 4
    ref = reference.attention(q, k, v, torch.arange(prefix, prefix + new), torch.arange(prefix + new),
                              window=window, logit_cap=cap)
    vis = _mask(prefix, new, window)

    def score_mod(score, b, h, qi, kj):
        return torch.where(vis[qi, kj], cap * torch.tanh(score / cap), float("-inf"))

    out = flex.flex_attention(q.transpose(0, 1)[None], k.repeat_interleave(2, dim=1).transpose(0, 1)[None],
                              v.repeat_interleave(2, dim=1).transpose(0, 1)[None], score_mod=score_mod, scale=scale)
    assert torch.allclose(ref, out[0].transpose(0, 1), atol=1e-5)
    # and the cap changes the answer (the test would catch a reference that ignored it)
    plain = reference.attention(q, k, v, torch.arange(prefix, prefix + new), torch.arange(prefix + new), window=window)
    if int(vis.sum(1).max()) > 1:  # with one visible key the softmax is 1 whatever the cap
        assert not torch.allclose(ref, plain, atol=1e-3)
