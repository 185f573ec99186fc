"""Every way `hwkv` used to end in a traceback, or to accept a bad value silently, now ends in one typed line.

Exit codes: 2 a bad value or an unusable device (one line on stderr), 130 Ctrl-C, 141 stdout closed early
(`| head`); 1 stays a reference mismatch. In-process through `hwkv.cli.main` where that is enough; the
process-level endings (a closed pipe, /dev/full, SIGINT) in real processes, started together at collection.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest

from hwkv import cli

REPO = Path(__file__).resolve().parents[1]
PLAN = ["plan", "--model", "gemma-3-27b", "--memory", "80GiB", "--context", "512"]


def _env(**extra: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HWKV_DEVICE", "HWKV_DEBUG")}
    env.update(CUDA_VISIBLE_DEVICES="", **extra)
    return env


def _start(argv: List[str], stdout) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hwkv.cli", *argv], cwd=REPO, env=_env(), text=True,
                            stdout=stdout, stderr=subprocess.PIPE)


def _start_runs() -> Dict[str, subprocess.Popen]:
    """Each process imports torch (seconds): started at collection, they run beside each other and the tests."""
    procs = {"pipe": _start(PLAN + ["--json"], subprocess.PIPE)}
    procs["pipe"].stdout.close()  # the reader is gone before the first write: EPIPE, as `| head` gives
    if os.path.exists("/dev/full"):
        with open("/dev/full", "w") as full:
            procs["full"] = _start(PLAN, full)
    return procs


_PROCS = _start_runs()


def _finish(name: str) -> subprocess.CompletedProcess:
    if name not in _PROCS:
        pytest.skip(f"no {name} run on this machine")
    p = _PROCS[name]
    err = p.communicate(timeout=300)[1]
    return subprocess.CompletedProcess(p.args, p.returncode, "", err)


def _main(capsys, *argv: str):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str, prefix: str) -> str:
    """stderr holds exactly one line, starting with `prefix`, and no traceback."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    assert "Traceback" not in err
    return lines[0]


# ------------------------------------------------------------------------------- process endings


def test_stdout_closed_early_ends_quietly_with_141():
    run = _finish("pipe")
    assert run.returncode == cli.EXIT_BROKEN_PIPE == 141, run.stderr
    assert run.stderr == ""  # no traceback, no "Exception ignored" at interpreter exit


def test_a_full_disk_is_one_line_and_exit_2():
    run = _finish("full")
    assert run.returncode == 2
    assert one_line(run.stderr, "hwkv plan: error: cannot write the output: No space left on device")


def test_ctrl_c_is_exit_130_and_one_line(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, "plan", cli.Command("plan", cli.COMMANDS["plan"].add_arguments, interrupted))
    code, out, err = _main(capsys, *PLAN)
    assert code == cli.EXIT_INTERRUPTED == 130 and out == ""
    assert one_line(err, "hwkv plan: interrupted")


def test_sigint_during_verify_is_exit_130_without_a_traceback():
    """A real Ctrl-C: sent once the first check's progress line shows; pytest's own handling is bypassed."""
    # SIGINT at its default in the child, as in a terminal: a test run started in the background by a
    # non-interactive shell inherits it ignored, and the child would never see the Ctrl-C
    p = subprocess.Popen([sys.executable, "-m", "hwkv.cli", "verify", "--device", "cpu", "-k", "graphs_reuses_slots"],
                         cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = b""
    deadline = time.monotonic() + 240
    while b"[1/" not in seen and time.monotonic() < deadline:
        chunk = os.read(p.stderr.fileno(), 1)
        if not chunk:
            break
        seen += chunk
    assert b"[1/" in seen, seen.decode()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    err = (seen + err).decode()
    assert p.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.rstrip().splitlines()[-1] == "hwkv verify: interrupted"
    assert b"contract checks passed" not in out


def test_a_bad_environment_variable_fails_every_command_up_front(capsys, monkeypatch):
    monkeypatch.setenv("HWKV_DEBUG", "maybe")
    code, out, err = _main(capsys, *PLAN)
    assert code == 2 and out == ""
    assert one_line(err, "hwkv plan: error: HWKV_DEBUG='maybe' is not a valid value; allowed: 1/true/yes/on (on)")


def test_multi_line_messages_become_one_line():
    assert cli.one_line("first\n  second\n\nthird ") == "first second third"


# ------------------------------------------------------------------------------------- info


def test_info_keeps_bracketed_text_such_as_the_ipex_extra(capsys, monkeypatch):
    pytest.importorskip("rich")
    monkeypatch.setenv("COLUMNS", "400")
    data = cli.info_data()
    hint = "intel_extension_for_pytorch is not installed (pip install 'hwkv[ipex]')"
    data["devices"][0]["reason"], data["devices"][0]["available"] = hint, False
    data["cpu"]["attention_path_reason"] = f"IPEX: {hint}"
    cli.print_info_rich(data)
    out = capsys.readouterr().out
    assert out.count("pip install 'hwkv[ipex]'") == 2 and "pip install 'hwkv')" not in out


# ------------------------------------------------------------------------------------- bench


@pytest.fixture
def no_bench_run(monkeypatch: pytest.MonkeyPatch):
    """A bench that gets as far as running the workload fails the test: the checks must come first."""
    import hwkv.bench.run as run

    monkeypatch.setattr(run, "run_benchmark", lambda *a, **k: pytest.fail("the benchmark ran before its checks"))


@pytest.mark.parametrize("layers", ["0", "-1", "25"])
def test_bench_run_layers_out_of_range(capsys, no_bench_run, layers):
    code, out, err = _main(capsys, "bench", "--quick", "--no-graph", "--device", "cpu", "--run-layers", layers)
    assert code == 2 and out == ""
    assert one_line(err, f"hwkv bench: error: run_layers must be in [1, 24] for gpt-oss-20b, got {layers}")


@pytest.mark.parametrize("name, ext", [("x.txt", "txt"), ("plot.docx", "docx")])
def test_bench_plot_format_is_refused_before_the_run(tmp_path, capsys, no_bench_run, name, ext):
    pytest.importorskip("matplotlib")
    path = str(tmp_path / name)
    code, out, err = _main(capsys, "bench", "--quick", "--no-graph", "--plot", path)
    assert code == 2 and out == ""
    line = one_line(err, f"hwkv bench: error: --plot {path!r}: cannot write a .{ext} file; use one of ")
    assert ".png" in line and ".pdf" in line and not os.path.exists(path)


def test_bench_plot_without_an_extension_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from hwkv.bench.report import plot_format

    assert plot_format(str(tmp_path / "out")) == "png" and plot_format("a/b.PDF") == "pdf"


def test_bench_batch_size_beyond_memory_says_how_many_fit(capsys, no_bench_run, monkeypatch):
    import hwkv.pool
    from hwkv.bench import bench_cli
    from hwkv.engine.presets import PRESETS
    from hwkv.bench.run import Workload

    monkeypatch.setattr(hwkv.pool, "device_free_bytes", lambda device: 2**30)
    code, out, err = _main(capsys, "bench", "--quick", "--no-graph", "--device", "cpu", "--batch-sizes", "1,100000")
    assert code == 2 and out == ""
    line = one_line(err, "hwkv bench: error: --batch-sizes: batch size 100000 needs at least ")
    assert "and cpu has 1.00 GiB free; at most batch size " in line
    fits = int(line.rsplit("at most batch size ", 1)[1].split()[0])
    w = Workload(batch_sizes=(1,), prompt_len=160, chunk=256, steps=4, warmup=1, check_every=2)
    need = [bench_cli.memory_needed(PRESETS["gpt-oss-20b"], 4, w, bs, 2) for bs in (fits, fits + 1)]
    assert need[0] <= 2**30 < need[1]


def test_bench_memory_estimate_counts_the_pools_the_harness_allocates():
    """memory_needed mirrors hwkv.bench.run._harness: with checks off it is exactly the pools' buffers."""
    from dataclasses import replace

    from hwkv.bench import bench_cli, run
    from hwkv.engine.presets import PRESETS
    from hwkv_cpu.backend import TorchCPUBackend

    shape = PRESETS["gpt-oss-20b"]
    w = run.Workload(batch_sizes=(3,), prompt_len=40, chunk=32, steps=2, warmup=1, check_every=0, dtype="fp32")
    target = run.Target("cpu", TorchCPUBackend, "cpu", None)
    h = run._harness(target, run.geometry(replace(shape, dtype_bytes=4), 4), w, 3, 2)
    pools = [h.pool.full_kv_pool, h.pool.swa_kv_pool]
    allocated = sum(b.numel() * b.element_size() for g in pools for b in (*g.k_buffer, *g.v_buffer))
    assert bench_cli.memory_needed(shape, 4, w, 3, 2) == allocated
    checked = replace(w, check_every=1)
    assert bench_cli.memory_needed(shape, 4, checked, 3, 2) > allocated


# ------------------------------------------------------------------------------------ verify


@pytest.mark.parametrize("expr, why", [("and or (", "at column 1: expected not OR left parenthesis OR identifier"),
                                       ("(write", "expected right parenthesis")])
def test_verify_names_an_invalid_k_expression(capsys, expr, why):
    code, out, err = _main(capsys, "verify", "-k", expr)
    assert code == 2 and out == ""
    line = one_line(err, f"hwkv verify: error: -k {expr!r} is not a valid pytest -k expression")
    assert why in line


def test_verify_shows_each_check_as_it_runs(capsys):
    code, out, err = _main(capsys, "verify", "--device", "cpu", "-k",
                           "writes_exactly_the_swa_loc or plain_pool_translates")
    assert code == 0
    progress = [line for line in err.splitlines() if line.startswith("hwkv verify: [")]
    assert len(progress) == 2 and progress[0].startswith("hwkv verify: [1/2] test_")
    assert all(" ... PASS (" in line and line.endswith(" s)") for line in progress)
    assert "2/2 contract checks passed on cpu" in out and "hwkv verify: [" not in out


def test_verify_quiet_shows_no_progress(capsys):
    code, out, err = _main(capsys, "verify", "--device", "cpu", "-q", "-k", "writes_exactly_the_swa_loc")
    assert code == 0 and "hwkv verify: [" not in err and "contract checks passed" in out


def test_verify_unavailable_device_reuses_the_shared_device_check(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    code, out, err = _main(capsys, "verify", "--device", "cuda")
    assert code == 2
    assert one_line(err, "hwkv verify: error: device 'cuda' is unavailable: ")


# ---------------------------------------------------------------------------------- generate


def _gen(capsys, *argv: str):
    return _main(capsys, "generate", *argv, "--no-progress")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A 2-layer Gemma-2 (one SWA, one full layer, W = 8), saved."""
    transformers = pytest.importorskip("transformers")
    import torch

    cfg = transformers.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                    max_position_embeddings=128, sliding_window=8, query_pre_attn_scalar=16,
                                    eos_token_id=None, pad_token_id=None, bos_token_id=None)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-gemma2")
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    return str(folder)


@pytest.fixture
def needs_transformers():
    pytest.importorskip("transformers")


@pytest.mark.parametrize("flag, value, message", [
    ("--max-running", "0", "--max-running must be >= 1, got 0"),
    ("--context", "0", "--context must be >= 1, got 0"),
    ("--max-new-tokens", "-3", "--max-new-tokens must be >= 1, got -3"),
    ("--chunk", "0", "--chunk must be >= 1, got 0"),
    ("--page-size", "0", "--page-size must be >= 1, got 0"),
    ("--seed", "-1", "--seed must be >= 0, got -1"),
    ("--temperature", "-1", "--temperature must be >= 0 (0 = greedy), got -1.0"),
    ("--top-p", "0", "--top-p must be in (0, 1], got 0.0"),
    ("--memory", "lots", "cannot read memory size 'lots'"),
])
def test_generate_refuses_bad_flags_before_loading_the_model(capsys, needs_transformers, tmp_path, flag, value,
                                                            message):
    code, out, err = _gen(capsys, "--model", str(tmp_path / "not-loaded"), "--prompt", "1", flag, value)
    assert code == 2 and out == ""
    assert one_line(err, f"hwkv generate: error: {message}")


def test_generate_on_a_device_without_its_runtime(capsys, needs_transformers, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    code, out, err = _gen(capsys, "--model", str(tmp_path), "--prompt", "1", "--device", "cuda")
    assert code == 2
    assert one_line(err, "hwkv generate: error: device 'cuda' is unavailable: torch is not built with CUDA")


def test_generate_unknown_device(capsys, needs_transformers, tmp_path):
    code, out, err = _gen(capsys, "--model", str(tmp_path), "--prompt", "1", "--device", "tpu")
    assert code == 2
    assert one_line(err, "hwkv generate: error: unknown device 'tpu'; known devices: ")


def test_generate_model_paths_say_what_is_wrong(capsys, needs_transformers, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"")
    deep = tmp_path / "a" / "b"
    for model, message in (("./missing", "cannot load model './missing': no such folder"),
                           (str(deep), f"cannot load model {str(deep)!r}: no such folder"),
                           ("empty", "cannot load model 'empty': the folder has no config.json"),
                           ("weights.bin", "cannot load model 'weights.bin': it is a file"),
                           ("no-such-name", "cannot load model 'no-such-name': no such folder, and no model of that "
                                            "name in the local Hugging Face cache")):
        code, out, err = _gen(capsys, "--model", model, "--prompt", "1")
        assert code == 2, err
        line = one_line(err, f"hwkv generate: error: {message}")
        assert "Repo id" not in line


def test_generate_names_refused_prompts_by_their_own_index(capsys, tiny_model):
    code, out, err = _gen(capsys, "--model", tiny_model, "--prompt", "1,2,3", "--prompt", "5,6", "--context", "4",
                          "--max-new-tokens", "4")
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("hwkv generate: error:")]
    assert len(lines) == 2 and "Traceback" not in err
    assert lines[0].startswith("hwkv generate: error: prompt [0] '1,2,3': OutOfSlotsError: prompt 3 + ")
    assert lines[1].startswith("hwkv generate: error: prompt [1] '5,6': OutOfSlotsError: prompt 2 + ")
    assert "request 0" not in err


def test_generate_memory_beyond_the_device_says_what_it_has(capsys, tiny_model):
    code, out, err = _gen(capsys, "--model", tiny_model, "--prompt", "1,2,3", "--memory", "100TiB")
    assert code == 2 and out == ""
    line = one_line(err, "hwkv generate: error: ")
    assert "free" in line and "TiB" in line
