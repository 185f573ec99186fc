"""Review 21 (revE) of the dense oracle: `hwkv.reference` checks its arguments (ShapeError / ConfigError naming the
value and the limit, where it had answered silently short or raised bare errors), the harness compares shapes before
values, and the reference backend names the device of every tensor it makes."""
import ast
import pathlib
import types

import numpy as np
import pytest
import torch

from hwkv import reference
from hwkv.errors import ConfigError, ShapeError
from hwkv.layer import AttentionLayer
from hwkv.metadata import KVIndexList
from hwkv.testing.harness import Harness
from hwkv.testing.reference_backend import ReferenceBackend

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _qkv(tq=3, h=4, kvh=2, tk=5, d=8, dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tq, h, d, generator=g), torch.randn(tk, kvh, d, generator=g),
            torch.randn(tk, kvh, dv, generator=g))


# ---- batch_attention ----------------------------------------------------------------------------------------------

def _batch():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(3, 2, 4, generator=g), torch.randn(5, 1, 4, generator=g), torch.randn(5, 1, 6, generator=g))


BATCH_REFUSALS = {
    # name: (arguments from (q, k, v), message)
    "extra q rows": (lambda q, k, v: (q, [k], [v], [5], [2]), r"q has 3 rows, sum\(extend_lens\) = 2"),
    "too few q rows": (lambda q, k, v: (q[:1], [k], [v], [5], [2]), r"q has 1 rows, sum\(extend_lens\) = 2"),
    "a seq_len without keys": (lambda q, k, v: (q, [k], [v], [5, 5], [2, 1]),
                               r"len\(keys\) = 1, len\(values\) = 1, len\(seq_lens\) = 2, len\(extend_lens\) = 2"),
    "a value list too many": (lambda q, k, v: (q, [k], [v, v], [5], [3]), r"len\(values\) = 2"),
    "an extend_len too few": (lambda q, k, v: (q, [k, k], [v, v], [5, 5], [3]), r"len\(extend_lens\) = 1"),
    "extend_len > seq_len": (lambda q, k, v: (q, [k[:2]], [v[:2]], [2], [3]), "extend_len 3, seq_len 2"),
    "negative extend_len": (lambda q, k, v: (q[:0], [k], [v], [5], [-1]), "extend_len -1"),
    "seq_len > key rows": (lambda q, k, v: (q, [k[:4]], [v], [5], [3]), "seq_len 5, keys 4 rows"),
    "seq_len > value rows": (lambda q, k, v: (q, [k], [v[:4]], [5], [3]), "values 4 rows"),
    "a float length": (lambda q, k, v: (q, [k], [v], [5.0], [3]), "must be integers"),
}


@pytest.mark.parametrize("name", list(BATCH_REFUSALS))
def test_batch_attention_refuses_arguments_that_disagree(name):
    make, match = BATCH_REFUSALS[name]
    with pytest.raises(ShapeError, match=match):
        reference.batch_attention(*make(*_batch()))


def test_batch_attention_empty_answers_on_the_cpu_and_takes_dv_from_v():
    e = reference.batch_attention(torch.empty(0, 2, 4, device="meta"), [], [], [], [])
    assert (e.device.type, e.dtype, tuple(e.shape)) == ("cpu", torch.float32, (0, 2, 4))
    q, k, v = _batch()
    z = reference.batch_attention(q[:0], [k], [v], [5], [0])  # one request, no new token: Dv 6 from v
    assert (z.device.type, tuple(z.shape)) == ("cpu", (0, 2, 6))


def test_batch_attention_still_reads_keys_past_seq_len_as_unused():
    q, k, v = _batch()
    got = reference.batch_attention(q[:2], [k, k], [v, v], [3, 5], [1, 1], window=2)  # keys past seq_len 3: unused
    want0 = reference.attention(q[:1], k[:3], v[:3], torch.tensor([2]), torch.arange(3), window=2)
    want1 = reference.attention(q[1:2], k, v, torch.tensor([4]), torch.arange(5), window=2)
    assert torch.equal(got, torch.cat([want0, want1]))
    one = reference.batch_attention(q[1:2], [k], [v], [np.int64(5)], [torch.tensor(1)], window=2)  # numpy, 0-d
    assert torch.equal(one, want1)


# ---- Harness.compare ----------------------------------------------------------------------------------------------

def _compare(got, ref):
    fake = types.SimpleNamespace(tolerance=1e-3, max_err=0.0)
    return Harness.compare(fake, AttentionLayer(0, 2, 1, 4), got, ref, "check")


def test_harness_compare_refuses_an_output_against_an_empty_or_broadcast_reference():
    with pytest.raises(ShapeError, match=r"the output has shape \[3, 2, 4\], the reference \[0, 2, 4\]"):
        _compare(torch.ones(3, 2, 4), torch.zeros(0, 2, 4))
    with pytest.raises(ShapeError, match=r"the output has shape \[3, 2, 4\], the reference \[1, 2, 4\]"):
        _compare(torch.ones(3, 2, 4), torch.ones(1, 2, 4))  # had broadcast the one reference row
    assert _compare(torch.zeros(0, 2, 4), torch.zeros(0, 2, 4)) == 0.0
    assert _compare(torch.ones(3, 2, 4), torch.ones(3, 2, 4)) == 0.0


# ---- attention ------------------------------------------------------------------------------------------------------

def _args(**over):
    q, k, v = _qkv()
    a = dict(q=q, k=k, v=v, q_pos=torch.arange(2, 5), k_pos=torch.arange(5))
    a.update(over)
    return a


SHAPE_REFUSALS = {
    "sinks per KV head": (dict(sinks=torch.zeros(2)), r"sinks has shape \[2\], expected \[4\]"),
    "k_pos short": (dict(k_pos=torch.arange(4)), r"k_pos has shape \[4\], expected \[5\]"),
    "q_pos long": (dict(q_pos=torch.arange(1, 5)), r"q_pos has shape \[4\], expected \[3\]"),
    "v short": (dict(v=torch.randn(4, 2, 6)), r"v has shape \[4, 2, 6\], expected \[5, 2, \*\]"),
    "v heads": (dict(v=torch.randn(5, 1, 6)), r"v has shape \[5, 1, 6\]"),
    "k head_dim": (dict(k=torch.randn(5, 2, 7), v=torch.randn(5, 2, 6)),
                   r"k has shape \[5, 2, 7\], expected \[\*, \*, 8\]"),
    "mask columns": (dict(mask=torch.ones(3, 4, dtype=torch.bool)), r"mask has shape \[3, 4\], expected \[3, 5\]"),
    "heads not a multiple": (dict(q=torch.randn(3, 3, 8)), "q has 3 heads, k 2"),
    "q 2-D": (dict(q=torch.randn(3, 32)), r"q has shape \[3, 32\]"),
}


@pytest.mark.parametrize("name", list(SHAPE_REFUSALS))
def test_attention_refuses_shapes_that_disagree(name):
    over, match = SHAPE_REFUSALS[name]
    with pytest.raises(ShapeError, match=match) as e:
        reference.attention(**_args(**over))
    assert isinstance(e.value, ValueError)  # ShapeError is a ValueError: callers catching the old one still do


OPTION_REFUSALS = {
    "logit_cap -1": (dict(logit_cap=-1.0), r"logit_cap=-1\.0 must be a finite number >= 0"),
    "logit_cap nan": (dict(logit_cap=float("nan")), "logit_cap=nan"),
    "logit_cap inf": (dict(logit_cap=float("inf")), "logit_cap=inf"),
    "logit_cap past float32": (dict(logit_cap=1e39), "logit_cap=1e\\+39"),
    "window -3": (dict(window=-3), "window=-3 must be None or an integer >= 0"),
    "window float": (dict(window=2.5), "window=2.5"),
    "window nan": (dict(window=float("nan")), "window=nan"),
    "scaling nan": (dict(scaling=float("nan")), "scaling=nan must be a finite number"),
}


@pytest.mark.parametrize("name", list(OPTION_REFUSALS))
def test_attention_refuses_options_out_of_range(name):
    over, match = OPTION_REFUSALS[name]
    with pytest.raises(ConfigError, match=match):
        reference.attention(**_args(**over))


def test_attention_accepts_every_spelling_of_off():
    base = reference.attention(**_args())
    for over in (dict(window=0), dict(window=None), dict(logit_cap=None), dict(logit_cap=0), dict(window=np.int64(0))):
        assert torch.equal(reference.attention(**_args(**over)), base), over
    w = reference.attention(**_args(window=2))
    assert torch.equal(reference.attention(**_args(window=np.int64(2))), w)
    sinks = torch.arange(4.0)
    assert torch.equal(reference.attention(**_args(sinks=sinks.view(1, 4))), reference.attention(**_args(sinks=sinks)))


# ---- ReferenceBackend and the contract spec name their devices -------------------------------------------------------

def _decode_once(tree=None):
    layer = AttentionLayer(0, 2, 1, 4, sliding_window=2)
    g = torch.Generator().manual_seed(3)
    k_buf, v_buf = torch.randn(8, 1, 4, generator=g, device="cpu"), torch.randn(8, 1, 4, generator=g, device="cpu")
    fake = types.SimpleNamespace(kv_buffers=lambda layer: (k_buf, v_buf),
                                 request_attention=lambda *a: ReferenceBackend.request_attention(None, *a))
    i64 = dict(dtype=torch.int64, device="cpu")
    kv = KVIndexList(indptr=torch.tensor([0, 3], dtype=torch.int32, device="cpu"),
                     indices=torch.tensor([3, 4, 5], **i64), pos0=torch.tensor([4], **i64), window=None, max_len=3)
    nq = 1 if tree is None else 2
    md = types.SimpleNamespace(batch_size=1, qo_indptr=torch.tensor([0, nq], **i64),
                               q_pos0=torch.tensor([7 - nq], **i64), tree=tree)
    q = torch.randn(nq, 2, 4, generator=g, device="cpu")
    out = torch.zeros(nq, 2, 4, device="cpu")
    ReferenceBackend._attend(fake, q, layer, kv, md, out)
    return out


@pytest.mark.parametrize("tree", [False, True])
def test_reference_backend_runs_under_another_default_device(tree):
    # a chain of two drafts at positions 5, 6 over keys at positions 4..6: every tensor the backend makes is on the CPU
    t = types.SimpleNamespace(mask=torch.tensor([True, False, True, True], device="cpu"),
                              mask_indptr=torch.tensor([0, 4], device="cpu"),
                              q_positions=torch.tensor([5, 6], device="cpu")) if tree else None
    want = _decode_once(t)
    torch.set_default_device("meta")
    try:
        got = _decode_once(t)
    finally:
        torch.set_default_device(None)
    assert got.device.type == "cpu" and torch.equal(got, want)


FACTORIES = {"tensor", "arange", "zeros", "ones", "empty", "full", "randn", "rand", "randint", "zeros_like"}


@pytest.mark.parametrize("path", ["hwkv/testing/reference_backend.py", "hwkv/testing/contract_spec.py"])
def test_test_helpers_name_the_device_of_every_tensor_they_make(path):
    tree = ast.parse((ROOT / path).read_text())
    bare = [f"{path}:{n.lineno} torch.{n.func.attr}" for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in FACTORIES
            and isinstance(n.func.value, ast.Name) and n.func.value.id == "torch"
            and not any(kw.arg in ("device", None) for kw in n.keywords)]  # None: a **kwargs that may carry it
    assert not bare, "tensors made on the default device: " + ", ".join(bare)

