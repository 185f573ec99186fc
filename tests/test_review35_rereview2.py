"""Review 35, second re-review of the kernels fixes (7c2f627: `hwkv.checks.check_attention_options`, the
max_q_len CapacityError, the OnlineSoftmax -inf sink fix) and the plan-less CP save (d9fa6a5).

Each test fails on the code as re-reviewed; its comment says what is wrong, what is expected and where. CPU only
(Triton under TRITON_INTERPRET=1 on CPU tensors), each well under a second.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from hwkv.errors import ConfigError, ShapeError  # noqa: E402

from test_review35_kernels import H, D, _call, _kernels  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

BIG_WINDOW = 2 ** 63   # one past int64: AttentionLayer refuses it ("kernels and torch ops take it as int64")


def _raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    return None


# Triton's extend is left out on purpose: under TRITON_INTERPRET=1 window=2**63 segfaults the interpreter (the
# kernel reads with a wrapped, negative window), which would take the whole test run down.
@pytest.mark.parametrize("name,mode", [("cpu", "decode"), ("cpu", "extend"), ("triton", "decode")])
def test_public_kernels_refuse_a_window_past_int64_as_the_layer_does(name, mode):
    # WRONG: hwkv/checks.py `check_attention_options` (checks.py:353) takes any integer window >= 0, while the layer
    # whose rule it claims to share refuses sliding_window >= 2**63 (hwkv/layer.py:60-61: "kernels and torch ops take
    # it as int64"). So window=2**63 passes the new check and then: the CPU kernels raise a bare RuntimeError from the
    # custom op's schema ("Expected a value of type 'int' for argument 'window' but instead found type 'int'"); the
    # Triton decode wraps it to a negative int64 window and writes a silently wrong answer (max |diff| ~1.6 against
    # window=None here); the Triton extend segfaults the interpreter (on a GPU: out-of-window reads).
    # EXPECTED: ConfigError naming window=9223372036854775808 and the int64 limit, before `out` is written, on every
    # kernel (as AttentionLayer does). Fix: in check_attention_options refuse `as_int(window) > 2**63 - 1` (the
    # layer's bound), e.g. "window=... must be None or an integer in [0, 2**63 - 1]".
    kern = _kernels(name)
    big = torch.full((4, H, D), 7.0)
    err = _raised(lambda: _call(kern, mode, big, window=BIG_WINDOW))
    assert isinstance(err, ConfigError) and "window=9223372036854775808" in str(err), \
        f"{name} {mode}: window=2**63 gave {type(err).__name__ if err else 'no error'}: {err}"
    assert torch.equal(big, torch.full_like(big, 7.0)), "out was written by a refused call"


@pytest.mark.parametrize("sinks", [torch.tensor([[0.0, float("inf"), 0.0, 0.0]]),
                                   torch.tensor([0.0, 0.0, 0.0, 0.0, float("nan")])], ids=["[1,H] inf", "[H+1] nan"])
def test_triton_decode_checks_the_sinks_shape_before_their_values(sinks):
    # WRONG: hwkv_cuda/kernels/decode.py:773 runs `check_attention_options(..., sinks)` first thing in
    # `decode_attention` (so in torch.ops.hwkv.decode_attention too), before `_public_plan` / `_check_decode` check
    # the sinks' shape. A [1, H] sinks holding inf then fails inside `check_sink_values` (checks.py:341,
    # `float(sinks[head])` of a row) with a bare ValueError "only one element tensors can be converted to Python
    # scalars"; a [H + 1] sinks holding NaN past the heads is refused as "sinks[4] is nan", a head the call does
    # not have. hwkv_cpu's kernels and the Triton extend check shapes first: ShapeError "sinks has shape [1, 4],
    # expected [4]" for the same call.
    # EXPECTED: ShapeError naming the sinks' shape, as the other three entry points give. Fix: run
    # check_attention_options after the plan's checks in decode_attention (a cached public plan's key already holds
    # sinks.shape), and let check_sink_values name a flat index (`bad.flatten().nonzero()[0]`).
    tk = _kernels("triton")
    for name, mode in (("cpu", "decode"), ("cpu", "extend"), ("triton", "extend")):   # the others: ShapeError
        with pytest.raises(ShapeError, match="sinks has shape"):
            _call(_kernels(name), mode, torch.full((4, H, D), 7.0), sinks=sinks)
    big = torch.full((4, H, D), 7.0)
    err = _raised(lambda: _call(tk, "decode", big, sinks=sinks))
    assert isinstance(err, ShapeError) and "sinks has shape" in str(err), \
        f"triton decode: {type(err).__name__ if err else 'no error'}: {err}"
    assert torch.equal(big, torch.full_like(big, 7.0))
