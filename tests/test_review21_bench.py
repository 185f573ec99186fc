"""Review 21 (C): soft-caps that a float32 tanh lost to cancellation (large caps) or to overflow (caps past float32's
largest), `--memory` numbers past a float and memory given as a float, the chat workload over a model without
full-attention layers, and repeated `--configs` names. Each refusal is a ConfigError naming the value; on the
command line one line and exit 2."""
from __future__ import annotations

import argparse
import os
import re

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_review20_bench import _refused  # noqa: E402  (one line on stderr, exit 2)
from hwkv.errors import ConfigError  # noqa: E402

F32_MAX = float(torch.finfo(torch.float32).max)   # 3.4028234663852886e+38
CAPS = (50.0, 1e6, 1e8, F32_MAX)
_tanh = None   # the kernels' tanh, set by _tanh_kernel


def _never(*a, **k):
    pytest.fail("the run started before the refusal")


# ---- 1. soft-cap: cap * tanh(s / cap) in float32 ------------------------------------------------------------------
def _tanh_kernel():
    """A kernel storing the Triton kernels' tanh of each input; the helper becomes this module's global `_tanh`,
    where a jit function looks its names up."""
    import triton
    import triton.language as tl

    from hwkv_cuda.kernels.common import tanh_fp32

    global _tanh
    _tanh = tanh_fp32

    @triton.jit
    def kernel(x_ptr, out_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(out_ptr + i, _tanh(tl.load(x_ptr + i)))
    return kernel


@pytest.mark.interpret
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")   # exp(2x) = inf past x = 44: tanh is 1 there
def test_the_kernels_tanh_is_within_a_few_ulp_of_float64_tanh_near_zero_and_beyond():
    """1 - 2 / (exp(2x) + 1) had an absolute error of ~1e-7 whatever x: for x = 1e-6 the result was off by 10%, and
    a cap of 1e8 turned every logit into ~0 (uniform attention)."""
    pytest.importorskip("triton")
    kernel = _tanh_kernel()
    mags = np.concatenate([np.geomspace(1e-30, 1e-3, 60), np.linspace(1e-3, 1.0, 120), np.geomspace(1.0, 100.0, 76)])
    x = torch.tensor(np.concatenate([mags, -mags]), dtype=torch.float32)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.empty_like(x, device=dev)
    kernel[(1,)](x.to(dev), out, N=x.numel())
    exact = torch.tanh(x.double())
    ulp = torch.tensor(np.spacing(exact.float().abs().numpy()), dtype=torch.float64)
    err = ((out.cpu().double() - exact).abs() / ulp)
    assert err.max().item() <= 6, (x[err.argmax()].item(), err.max().item())


@pytest.mark.interpret
def test_decode_with_large_soft_caps_matches_the_reference():
    """Caps 1e6 and 1e8 had been off by ~0.08 and ~1.6 (the reviewer's harness); float32's largest cap is taken too."""
    pytest.importorskip("triton")
    from test_triton_kernels import Case, _close

    c = Case([7, 19, 33], [1, 1, 1], h=4, kvh=2, d=16, window=None, seed=3)
    for cap in CAPS:
        _close(c.decode(logit_cap=cap), c.ref(cap), torch.float32)
        _close(c.decode(logit_cap=cap, splits=2), c.ref(cap), torch.float32)


@pytest.mark.interpret
def test_extend_with_large_soft_caps_matches_the_reference():
    pytest.importorskip("triton")
    from test_triton_kernels import Case, _close

    c = Case([9, 20], [4, 20], h=4, kvh=2, d=16, window=5, seed=4)
    for cap in CAPS:
        _close(c.extend(logit_cap=cap), c.ref(cap), torch.float32)


@pytest.mark.parametrize("cap", [1e39, 3.4028235e38, np.float64(1e300), float("inf"), float("nan"), -1.0])
def test_attention_layer_refuses_a_cap_past_float32s_largest_naming_the_value_and_the_limit(cap):
    """A cap past float32's largest is inf in every float32 kernel (CPU, NPU torch path, Triton): tanh(s / inf) * inf
    made every output NaN (`hwkv bench --logit-cap 1e39`: FAILED, output differs from the reference)."""
    from hwkv.layer import AttentionLayer
    with pytest.raises(ConfigError) as e:
        AttentionLayer(0, 2, 1, 16, logit_cap=cap)
    assert f"logit_cap={cap!r} must be" in str(e.value) and "3.4028234663852886e+38" in str(e.value), str(e.value)
    assert AttentionLayer(0, 2, 1, 16, logit_cap=F32_MAX).logit_cap == F32_MAX


def test_bench_logit_cap_past_float32_is_one_line_exit_2(capsys):
    line = _refused(capsys, ["bench", "--quick", "--configs", "once/eager", "--batch-sizes", "1", "--device", "cpu",
                             "--logit-cap", "1e39"])
    assert line.startswith("hwkv bench: error: gpt-oss-20b: logit_cap must be") and "3.4028234663852886e+38" in line \
        and "got 1e+39" in line, line  # (the model's shape refuses it, before a layer is built)


# ---- 2. --memory: numbers past a float, memory given as a float ---------------------------------------------------
BIG = "9" * 400 + ".5GiB"


@pytest.mark.parametrize("argv", [
    ["plan", "--model", "gpt-oss-20b", "--context", "4096"],
    ["bench", "--workload", "chat", "--conversations", "2", "--turns", "1", "--device", "cpu"],
    ["generate", "--model", "/nonexistent/model", "--prompt", "hi"],
], ids=["plan", "bench-chat", "generate"])
def test_memory_past_a_float_is_one_line_exit_2(capsys, monkeypatch, argv):
    """float('9' * 400 + '.5') is inf: int(inf * unit) had ended each command in an OverflowError traceback."""
    import hwkv.bench.chat as chat
    monkeypatch.setattr(chat, "run_chat", _never)
    line = _refused(capsys, argv + ["--memory", BIG])
    assert line.startswith(f"hwkv {argv[0]}: error: memory size {BIG!r} is too large: at most 2**63 - 1 bytes"), line


def test_parse_bytes_reads_decimals_exactly_and_refuses_floats_bools_and_sizes_past_2_63():
    from hwkv.engine.plan import parse_bytes
    # float() rounding had read these one byte short
    assert parse_bytes("8.2GB") == 8_200_000_000 and parse_bytes("2.01KB") == 2010
    assert parse_bytes("1.5TiB") == 3 * 2**39 and parse_bytes("0.0009765625KiB") == 1
    assert parse_bytes(np.int64(4096)) == 4096 and parse_bytes(2**63 - 1) == 2**63 - 1
    assert parse_bytes("0" * 5000 + "1.5KiB") == 1536   # past int()'s 4,300 digits, all leading zeros
    for big in (2**63, "8388608TiB", "9" * 5000 + "GiB", BIG):
        with pytest.raises(ConfigError, match=r"is too large: at most 2\*\*63 - 1 bytes"):
            parse_bytes(big)
    # a memory given as a number must be an integer: 1.5 had been read as 1 byte, np.True_ as 'True' refused only by
    # luck of its text
    for bad in (1.5, 2.0, np.float32(3.0), np.True_, True):
        with pytest.raises(ConfigError, match=re.escape("memory size must be an integer number of bytes or a string "
                                                        f"like '80GiB' or '1.5GiB', got {bad!r} (")):
            parse_bytes(bad)


def test_plan_pools_refuses_memory_given_as_a_float():
    """HybridRunner(memory=1.5) and Engine's memory= go through plan_pools: 1.5 was read as 1 byte."""
    from hwkv.engine.pools import plan_pools
    from hwkv.engine.presets import custom_shape
    shape = custom_shape(layers=2, pattern="sf", window=8, heads=2, kv_heads=1, head_dim=16, sinks="none",
                         dtype_bytes=2)
    with pytest.raises(ConfigError, match=r"integer number of bytes .*got 1\.5 \(float\)"):
        plan_pools(shape, context=64, max_running=2, chunk=16, page_size=4, memory=1.5, device="cpu")


# ---- 3. the chat workload over a model with no full-attention layer --------------------------------------------
def test_chat_workload_refuses_a_model_without_full_attention_layers(capsys, monkeypatch):
    """chat_sizes divided by the full group's bytes per token, 0 for an all-SWA model: ZeroDivisionError."""
    import hwkv.bench.chat as chat
    from hwkv.engine.presets import custom_shape
    shape = custom_shape(layers=2, pattern="s", window=8, heads=2, kv_heads=1, head_dim=16, sinks="none",
                         dtype_bytes=2)
    w = chat.ChatWorkload(memory=300 << 20, conversations=2, turns=1, system=20, user=8, reply=4, concurrency=2,
                          chunk=64, dtype="fp32", run_layers=2)
    for call in (chat.chat_sizes, chat.run_chat):
        with pytest.raises(ConfigError, match="has no full-attention layers: the chat workload compares hybrid"):
            call(shape, w)
    monkeypatch.setattr(chat, "run_variant", _never)
    line = _refused(capsys, ["bench", "--workload", "chat", "--conversations", "2", "--turns", "1", "--layers", "2",
                             "--pattern", "s", "--window", "8", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
                             "--device", "cpu"])
    assert line.startswith("hwkv bench: error: ") and "has no full-attention layers" in line, line


# ---- 4. repeated --configs names -----------------------------------------------------------------------------------
def test_a_repeated_config_runs_once_in_first_order(capsys, monkeypatch):
    """`--configs once/eager,once/eager` had run two arms: two rows under one (config, bs) key in the table and JSON.
    Repeats are dropped as --batch-sizes drops its own."""
    from hwkv.bench import bench_cli
    import hwkv.bench.run as run
    args = argparse.Namespace(configs=" once/eager, per-layer/eager,once/eager ,per-layer/eager", no_graph=False)
    assert bench_cli._configs(args, False, "cpu") == ["once/eager", "per-layer/eager"]
    seen = []

    def record(target, shape, configs, *a, **k):
        seen.append(list(configs))
        raise ConfigError("stop here")

    monkeypatch.setattr(run, "run_benchmark", record)
    _refused(capsys, ["bench", "--quick", "--batch-sizes", "1", "--device", "cpu", "--configs",
                      "once/eager,once/eager"])
    assert seen == [["once/eager"]]


@pytest.mark.parametrize("cap", [1e39, 1e-39, 1e-45])
def test_a_cap_the_kernels_cannot_apply_is_refused_by_the_model_shape_and_the_layer_alike(capsys, cap):
    """`hwkv plan` checks the shape before any layer is built: it refuses what the layers refuse (a cap past
    float32's largest is inf in the kernels; a positive cap below its smallest normal overflows the scale over it)."""
    from hwkv.checks import FLOAT32_TINY
    from hwkv.layer import AttentionLayer
    with pytest.raises(ConfigError, match="smallest normal"):
        AttentionLayer(0, 2, 1, 16, logit_cap=cap)
    line = _refused(capsys, ["plan", "--layers", "2", "--pattern", "fs", "--window", "8", "--heads", "2",
                             "--kv-heads", "1", "--head-dim", "16", "--memory", "1GiB", "--context", "64",
                             f"--logit-cap={cap!r}"])
    assert "logit_cap must be a finite number >= 0" in line and "smallest normal" in line, line
    assert AttentionLayer(0, 2, 1, 16, logit_cap=FLOAT32_TINY).logit_cap == FLOAT32_TINY
