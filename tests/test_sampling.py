"""The batched sampler: Gumbel noise strictly inside (0, 1), the top-p nucleus, and SamplingParams' refusals."""
import math

import pytest
import torch

from hwkv.engine import sampling
from hwkv.engine.sampling import SamplingParams, sample, uniform_noise
from hwkv.errors import ConfigError

V = 128256  # a Llama-3-sized vocabulary
# (seed, token) pairs whose hash at output index 0 is the largest a 24-bit uniform can take (2**24 - 1, once
# rounded to exactly 1.0 in float32): the first ones among seeds 0..999 at V.
EXTREME = [(123, 38336), (134, 89559), (305, 99998), (354, 105023), (399, 5832), (462, 108413), (492, 28063)]


def test_the_extreme_hash_gives_a_uniform_strictly_inside_0_1():
    seeds = torch.tensor([s for s, _ in EXTREME])
    tokens = torch.tensor([[t, 0] for _, t in EXTREME])
    u = uniform_noise(seeds, torch.zeros_like(seeds), tokens)
    assert u.dtype == torch.float32
    assert bool(((u > 0) & (u < 1)).all()), u[:, 0].tolist()
    assert bool(torch.isfinite(-torch.log(-torch.log(u))).all())


def test_a_near_certain_token_is_always_chosen_at_a_large_vocabulary():
    """Rows whose noise hits the extreme value, and others: token 0 (probability 1 - 1e-12) must win every row,
    with and without a nucleus."""
    seeds = torch.tensor([s for s, _ in EXTREME] + list(range(1000, 1025)))
    n = len(seeds)
    logits = torch.full((n, V), -30.0)
    logits[:, 0] = 10.0
    for top_p in (1.0, 0.5):
        tok = sample(logits, torch.ones(n), torch.full((n,), top_p), seeds, torch.zeros(n, dtype=torch.int64), True)
        assert tok.tolist() == [0] * n, f"top_p={top_p}"


def test_noise_depends_only_on_seed_step_and_token():
    seeds, steps = torch.tensor([7, 9, 7]), torch.tensor([3, 3, 4])
    tokens = torch.arange(64).expand(3, 64)
    both = uniform_noise(seeds, steps, tokens)
    assert torch.equal(uniform_noise(seeds[1:2], steps[1:2], tokens[:1]), both[1:2])
    assert torch.equal(uniform_noise(seeds, steps, tokens.flip(-1)), both.flip(-1))  # keyed by id, not position
    assert not torch.equal(both[0], both[2])


def _tail_logits(vocab=32768, head=20):
    """20 likely tokens and a long tail of probabilities 4.5e-8 .. 3.5e-8 (the least likely token is last): a
    float32 cumulative sum over it reaches 1.0 before the end of the tail."""
    tail = torch.linspace(4.5e-8, 3.5e-8, vocab - head, dtype=torch.float64)
    top = torch.full((head,), (1 - float(tail.sum())) / head, dtype=torch.float64)
    return torch.cat([top, tail]).log().float()


def _favour(monkeypatch, winner, runner_up):
    """Make token `winner` of each row draw the largest possible noise, `runner_up` (-1: none) a large one
    (0.99) and every other token the smallest."""
    lo, hi = 2.0**-24, 1 - 2.0**-24

    def noise(seeds, steps, token_ids):
        second = torch.where(token_ids == runner_up[:, None], torch.tensor(0.99), torch.tensor(lo))
        return torch.where(token_ids == winner[:, None], torch.tensor(hi), second)
    monkeypatch.setattr(sampling, "uniform_noise", noise)


def test_top_p_1_keeps_every_token_and_mixed_rows_keep_their_own_nucleus(monkeypatch):
    """Row 0 (top_p 1) must reach its least likely token; row 1 (top_p 0.5) has the same logits and must not;
    row 2 (top_p 1, probabilities .5 .3 .2) picks its favoured token 2 and row 3 (top_p 0.6, the same) its
    runner-up, token 1: the one whose mass crosses 0.6 is kept, token 2 is not."""
    v = 32768
    big = _tail_logits(v)
    small = torch.full((v,), -1e4)
    small[:3] = torch.tensor([0.5, 0.3, 0.2]).log()
    logits = torch.stack([big, big, small, small])
    _favour(monkeypatch, torch.tensor([v - 1, v - 1, 2, 2]), torch.tensor([-1, -1, 1, 1]))
    tok = sample(logits, torch.ones(4), torch.tensor([1.0, 0.5, 1.0, 0.6]), torch.zeros(4, dtype=torch.int64),
                 torch.zeros(4, dtype=torch.int64), True)
    assert tok[0] == v - 1, "top_p=1 left the least likely token out"
    assert tok[1] < 20
    assert tok[2:].tolist() == [2, 1]


@pytest.mark.parametrize("top_p, kept", [(0.45, 1), (0.5 + 1e-6, 2), (0.6, 2), (0.8 + 1e-6, 3), (0.85, 3),
                                         (0.999, 4), (1.0, 5)])
def test_top_p_keeps_the_smallest_prefix_whose_mass_reaches_it(top_p, kept):
    probs = torch.tensor([[0.0, 0.05, 0.15, 0.3, 0.5]])  # ascending, as the sampler sorts them
    outside = sampling._outside_nucleus(probs, torch.tensor([top_p]))
    assert outside.tolist() == [[i < 5 - kept for i in range(5)]]


def test_outside_nucleus_rows_mix_top_p():
    probs = torch.log_softmax(_tail_logits(), -1).sort().values.exp().expand(4, -1)
    top_p = torch.tensor([1.0, 0.5, 0.9999, 1e-9])
    kept = (~sampling._outside_nucleus(probs, top_p)).sum(-1).tolist()
    p64 = probs.double().flip(-1)  # descending, normalised (the float32 ones sum to 1 +- 1e-5)
    p64 = p64 / p64.sum(-1, keepdim=True)
    before = torch.cat([torch.zeros(4, 1, dtype=torch.float64), p64.cumsum(-1)[:, :-1]], -1)
    assert kept == (before < top_p.double()[:, None]).sum(-1).tolist()  # the float64 answer
    assert kept[0] == probs.shape[1] and kept[3] == 1


# ---- SamplingParams: each refusal is a ConfigError naming the field, the value and the range ----------------------
@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature="0.7"), "temperature"), (dict(temperature=None), "temperature"),
    (dict(temperature=-0.1), "temperature"), (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"), (dict(temperature=True), "temperature"),
    (dict(top_p=None), "top_p"), (dict(top_p="0.9"), "top_p"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_p=math.nan), "top_p"), (dict(top_p=True), "top_p"),
    (dict(max_new_tokens=True), "max_new_tokens"), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=2.0), "max_new_tokens"), (dict(max_new_tokens="4"), "max_new_tokens"),
    (dict(seed=-1), "seed"), (dict(seed=2**32), "seed"), (dict(seed=True), "seed"), (dict(seed=1.0), "seed"),
    (dict(stop_token_ids=2), "stop_token_ids"), (dict(stop_token_ids=["eos"]), "stop_token_ids"),
    (dict(stop_token_ids="2"), "stop_token_ids"), (dict(stop_token_ids=[2.5]), "stop_token_ids"),
    (dict(stop_token_ids=[True]), "stop_token_ids"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=None), "stop_token_ids"),
])
def test_sampling_params_refusals_are_typed_and_explain_themselves(kwargs, field):
    with pytest.raises(ConfigError) as err:
        SamplingParams(**kwargs)
    msg = str(err.value)
    assert msg.startswith(field) and repr(next(iter(kwargs.values()))) in msg, msg


def test_sampling_params_valid_inputs_stay_valid():
    p = SamplingParams(max_new_tokens=3, temperature=1, top_p=1, seed=2**32 - 1, stop_token_ids=[2, 5])
    assert (p.temperature, p.top_p, p.stop_token_ids) == (1.0, 1.0, (2, 5))
    assert SamplingParams(stop_token_ids=torch.tensor([7, 8])).stop_token_ids == (7, 8)
    assert SamplingParams(temperature=0.7, top_p=0.9, seed=None, stop_token_ids=(0,)).greedy is False
    assert SamplingParams().greedy
