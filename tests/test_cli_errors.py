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
from typing import Any, Dict, List

import pytest

from hwkv import cli
from hwkv.engine.sampling import F32_MAX

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
def tiny_model(tmp_path_factory, tiny_gemma2_config) -> str:
    """A 2-layer Gemma-2 (one SWA, one full layer, W = 8), saved."""
    transformers = pytest.importorskip("transformers")
    import torch

    cfg = tiny_gemma2_config()
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
    ("--temperature", "-1", f"--temperature must be a number in [0, {F32_MAX!r}] (0 = greedy; the sampler reads it "
                            "as float32), got -1.0"),
    ("--temperature", "inf", f"--temperature must be a number in [0, {F32_MAX!r}] (0 = greedy; the sampler reads "
                             "it as float32), got inf"),
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


def test_generate_conversation_lists_the_turns_after_a_refused_one_as_not_run(capsys, tiny_model):
    """Turn 1 (the conversation so far plus its prompt) outgrows --context: turn 2 cannot run without it, and is
    still listed, marked as not run with the reason, in the plain output, the JSON and on stderr (exit 2)."""
    import json

    argv = ["--model", tiny_model, "--prompt", "1,2,3", "--prompt", "4,5", "--prompt", "6", "--conversation",
            "--max-new-tokens", "4", "--context", "10"]
    code, out, err = _gen(capsys, *argv, "--json")
    assert code == 2 and "Traceback" not in err
    rows = json.loads(out)["results"]
    assert [r["prompt"] for r in rows] == ["1,2,3", "4,5", "6"]
    assert len(rows[0]["tokens"]) == 4 and rows[0]["error"] is None
    assert rows[1]["error"].startswith("OutOfSlotsError: prompt 9 + max_new_tokens 4 needs 12 KV slots")
    assert rows[2]["error"] == "not run: turn [1] was refused (OutOfSlotsError), and this turn continues it"
    assert rows[2]["tokens"] == [] and rows[2]["finish_reason"] is None and rows[2]["prompt_ids"] == [6]
    lines = [line for line in err.splitlines() if line.startswith("hwkv generate: error:")]
    assert len(lines) == 2 and lines[1] == ("hwkv generate: error: prompt [2] '6': not run: turn [1] was refused "
                                            "(OutOfSlotsError), and this turn continues it")
    code, out, err = _gen(capsys, *argv)
    assert code == 2
    assert "[2] '6' -> not run: turn [1] was refused (OutOfSlotsError), and this turn continues it" in out


def test_generate_memory_beyond_the_device_says_what_it_has(capsys, tiny_model):
    code, out, err = _gen(capsys, "--model", tiny_model, "--prompt", "1,2,3", "--memory", "100TiB")
    assert code == 2 and out == ""
    line = one_line(err, "hwkv generate: error: ")
    assert "free" in line and "TiB" in line


# ---------------------------------------------------------------- found by review (2026-12-04)


def _interrupt_while_importing(module: str) -> str:
    """A child that runs the console script's entry and sends itself SIGINT when `module` starts importing."""
    return ("import os, signal, sys\n"
            "import hwkv_entry\n"
            "class Interrupt:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            f"        if name == {module!r}:\n"
            "            os.kill(os.getpid(), signal.SIGINT)\n"
            "        return None\n"
            "sys.meta_path.insert(0, Interrupt())\n"
            "sys.argv = ['hwkv', 'bench', '--quick']\n"
            "sys.exit(hwkv_entry.main())\n")


# torch: while hwkv imports it; datetime: inside numpy's C extension, which turns the KeyboardInterrupt into an
# ImportError (a real Ctrl-C 0.1 s after start did that)
@pytest.mark.parametrize("module", ["torch", "datetime"])
def test_ctrl_c_while_hwkv_imports_is_exit_130_and_one_line(module):
    run = subprocess.run([sys.executable, "-c", _interrupt_while_importing(module)], cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=300,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert run.returncode == 130, run.stderr
    assert run.stderr == "hwkv: interrupted\n" and run.stdout == ""


def test_the_console_script_and_python_m_hwkv_enter_through_the_guard():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["hwkv"] == "hwkv_entry:main"
    assert "hwkv_entry" in project["tool"]["setuptools"]["py-modules"]  # installed beside the packages
    run = subprocess.run([sys.executable, "-m", "hwkv", "--version"], cwd=REPO, env=_env(), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.startswith("hwkv "), run.stderr


def test_cli_imports_no_subcommand_module_before_main():
    """The subcommands' modules load inside main's handlers (verify's pulls in pytest)."""
    code = ("import sys, hwkv.cli\n"
            "print(sorted(m for m in ('hwkv.bench.bench_cli', 'hwkv.bench.plan_cli', 'hwkv.testing.verify',\n"
            "                         'hwkv.integrations.generate_cli') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stderr


@pytest.fixture
def no_model_load(monkeypatch: pytest.MonkeyPatch):
    """A command that gets as far as loading a transformers model (or drawing a serve trace) fails the test."""
    pytest.importorskip("transformers")
    import hwkv.bench.serve as serve
    import hwkv.integrations.transformers as hf

    monkeypatch.setattr(hf, "load_model", lambda *a, **k: pytest.fail("the model loaded before the checks"))
    monkeypatch.setattr(serve, "random_gpt_oss", lambda *a, **k: pytest.fail("the model loaded before the checks"))
    monkeypatch.setattr(serve, "make_trace", lambda *a, **k: pytest.fail("the trace was drawn before the checks"))


def test_bench_serve_model_paths_say_what_is_wrong_as_generate_does(capsys, no_model_load, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"")
    for model, message in ((str(tmp_path / "missing"), "no such folder"),
                           (str(tmp_path / "empty"), "the folder has no config.json"),
                           (str(tmp_path / "weights.bin"), "it is a file; give the model's folder")):
        code, out, err = _main(capsys, "bench", "--workload", "serve", "--serve-model", model, "--no-baseline")
        assert code == 2 and out == ""
        assert one_line(err, f"hwkv bench: error: cannot load model {model!r}: {message}")


@pytest.fixture(scope="module")
def broken_models(tiny_model, tmp_path_factory) -> Dict[str, str]:
    """The tiny model with its weights cut short, and with a tokenizer.json that is not JSON."""
    import shutil

    folders = {}
    for kind in ("weights", "tokenizer"):
        folder = tmp_path_factory.mktemp(f"broken-{kind}")
        shutil.copytree(tiny_model, folder, dirs_exist_ok=True)
        if kind == "weights":
            weights = folder / "model.safetensors"
            weights.write_bytes(weights.read_bytes()[:1000])
        else:
            (folder / "tokenizer.json").write_text("{not json")
        folders[kind] = str(folder)
    return folders


@pytest.mark.parametrize("kind, message", [("weights", "Error while deserializing header"),
                                           ("tokenizer", "its tokenizer: ")])
def test_generate_a_broken_model_folder_is_one_line(capsys, broken_models, kind, message):
    model = broken_models[kind]
    code, out, err = _gen(capsys, "--model", model, "--prompt", "1,2", "--max-new-tokens", "2")
    assert code == 2 and out == ""
    assert message in one_line(err, f"hwkv generate: error: cannot load model {model!r}: ")


def test_bench_serve_a_broken_model_folder_is_one_line(capsys, broken_models):
    model = broken_models["weights"]
    code, out, err = _main(capsys, "bench", "--workload", "serve", "--serve-model", model, "--no-baseline")
    assert code == 2 and out == ""
    assert "Error while deserializing header" in one_line(err, f"hwkv bench: error: cannot load model {model!r}: ")


WORKLOADS = {"decode": ["--quick", "--no-graph"], "chat": ["--workload", "chat"], "serve": ["--workload", "serve"]}


@pytest.mark.parametrize("workload", list(WORKLOADS))
@pytest.mark.parametrize("threads", ["0", "-1", "99999999999"])
def test_bench_threads_out_of_range_in_every_workload(capsys, no_bench_run, no_model_load, workload, threads):
    from hwkv.bench.bench_cli import max_threads

    code, out, err = _main(capsys, "bench", *WORKLOADS[workload], "--threads", threads)
    assert code == 2 and out == ""
    assert one_line(err, f"hwkv bench: error: --threads must be in [1, {max_threads()}] (4 per CPU core, at "
                         f"least 1024), got {threads}")


@pytest.mark.parametrize("workload", list(WORKLOADS))
@pytest.mark.parametrize("seed", ["99999999999999999999999", str(2**63), "-1"])
def test_bench_seed_out_of_range_in_every_workload(capsys, no_bench_run, no_model_load, workload, seed):
    code, out, err = _main(capsys, "bench", *WORKLOADS[workload], "--seed", seed)
    assert code == 2 and out == ""
    assert one_line(err, f"hwkv bench: error: --seed must be in [0, 2**63 - 1 = {2**63 - 1}], got {seed}")


def test_the_largest_seed_runs_everywhere_it_seeds():
    """2**63 - 1 seeds the harness, the synthetic model and each chat turn's tokens (a product of the seed
    overflowed torch's 64 bits); the library refuses what the CLI refuses, as a ConfigError."""
    import torch

    from hwkv.bench import chat
    from hwkv.engine.synthetic import SyntheticModel
    from hwkv.errors import ConfigError
    from hwkv.testing.harness import Harness
    from hwkv_cpu.backend import TorchCPUBackend

    top = 2**63 - 1
    w = chat.ChatWorkload(seed=top, user=4)
    assert len(chat._user_tokens(w, 3, 2)) == 4
    Harness(TorchCPUBackend, size=64, size_swa=64, seed=top)
    for bad in (2**63, -1):
        with pytest.raises(ConfigError, match="seed must be an integer in"):
            chat.ChatWorkload(seed=bad)
        with pytest.raises(ConfigError, match="harness: seed must be an integer in"):
            Harness(TorchCPUBackend, size=64, size_swa=64, seed=bad)
        with pytest.raises(ConfigError, match="synthetic model: seed must be an integer in"):
            SyntheticModel(_tiny_shape(), None, vocab_size=8, dtype=torch.float32, device="cpu", positions=8,
                           seed=bad)


def _tiny_shape(**fields: Any):
    from hwkv.engine.presets import ModelShape, layer_pattern

    return ModelShape(name="tiny", layer_is_swa=layer_pattern(2, "sf"), window=4, num_heads=2, num_kv_heads=1,
                      head_dim=8, **fields)


def test_generate_seed_beyond_its_prompts_range_is_refused_before_the_model_loads(capsys, needs_transformers,
                                                                                 tmp_path):
    code, out, err = _gen(capsys, "--model", str(tmp_path / "not-loaded"), "--prompt", "1", "--prompt", "2",
                          "--seed", "4294967295")
    assert code == 2 and out == ""
    assert one_line(err, "hwkv generate: error: --seed must be in [0, 4294967294] with 2 prompt(s) (prompt i "
                         "samples with seed + i, below 2**32), got 4294967295")


def test_chat_reference_mismatch_exits_1_as_decode_does(capsys, monkeypatch):
    import hwkv.bench.chat as chat
    import hwkv.bench.run as run
    from hwkv.errors import ReferenceMismatchError

    def mismatch(*a, **k):
        raise ReferenceMismatchError("forward 3 (DECODE): max |out - reference| = 0.5 > tolerance 0.002")

    monkeypatch.setattr(chat, "run_chat", mismatch)
    monkeypatch.setattr(run, "run_benchmark", mismatch)
    for argv in (WORKLOADS["chat"], WORKLOADS["decode"]):
        code, out, err = _main(capsys, "bench", "--device", "cpu", *argv)
        assert code == 1 and out == ""
        assert one_line(err, "hwkv bench: FAILED: output differs from hwkv.reference: forward 3 (DECODE): ")


@pytest.mark.parametrize("cap", ["nan", "inf", "-inf", "-1"])
def test_logit_cap_must_be_finite_and_not_negative(capsys, no_bench_run, cap):
    from hwkv.errors import ConfigError

    message = f"logit_cap must be a finite number >= 0 (0 = off), got {float(cap)!r}"
    for argv in (["bench", "--quick", "--no-graph", "--device", "cpu"], PLAN):
        code, out, err = _main(capsys, *argv, f"--logit-cap={cap}")
        assert code == 2 and out == ""
        assert message in one_line(err, "hwkv ")
    with pytest.raises(ConfigError, match="logit_cap must be a finite number"):
        _tiny_shape(logit_cap=float(cap))


@pytest.mark.parametrize("flag", ["--serve-new", "--serve-prompt-len", "--chunk", "--serve-requests",
                                  "--serve-running", "--page-size"])
def test_bench_serve_zero_values_are_refused_not_replaced_by_defaults(capsys, no_model_load, flag):
    code, out, err = _main(capsys, "bench", "--workload", "serve", "--no-baseline", flag, "0")
    assert code == 2 and out == ""
    assert one_line(err, f"hwkv bench: error: {flag} must be >= 1, got 0")


@pytest.mark.parametrize("workload, flag, value, least", [
    ("decode", "--check-requests", "-1", 0), ("decode", "--warmup", "-1", 0), ("decode", "--steps", "0", 1),
    ("decode", "--prompt-len", "0", 1), ("chat", "--system-len", "0", 1), ("chat", "--check-every", "-1", 0),
    ("chat", "--concurrency", "0", 1), ("serve", "--serve-system-len", "-1", 0)])
def test_bench_names_the_flag_below_its_minimum(capsys, no_bench_run, no_model_load, monkeypatch, workload, flag,
                                               value, least):
    """A value below a flag's least is refused naming the flag as typed, for every workload (the workloads' own
    checks name their fields: `check_requests must be an integer >= 0`)."""
    import hwkv.bench.chat as chat

    monkeypatch.setattr(chat, "run_chat", lambda *a, **k: pytest.fail("the chat workload ran before its checks"))
    extra = ["--no-baseline"] if workload == "serve" else ["--no-graph"] if workload == "decode" else []
    code, out, err = _main(capsys, "bench", "--workload", workload, "--device", "cpu", *extra, flag, value)
    assert code == 2 and out == ""
    assert one_line(err, f"hwkv bench: error: {flag} must be >= {least}, got {value}")


def test_bench_absurd_batch_size_is_refused_without_listing_its_prompts(capsys, no_bench_run, monkeypatch):
    """The memory check asks its exact estimate (a list of every request's prompt length) only about batch sizes
    that could fit: 10**14 is refused at once, with the same answer for how many fit."""
    import hwkv.pool
    from hwkv.bench.run import Workload

    original = Workload.prompt_lens

    def prompt_lens(self, bs):  # 1 GiB holds a few hundred of these requests: no list beyond that
        if bs > 10**4:
            pytest.fail(f"the memory check listed the prompt lengths of a batch of {bs}")
        return original(self, bs)

    monkeypatch.setattr(Workload, "prompt_lens", prompt_lens)
    monkeypatch.setattr(hwkv.pool, "device_free_bytes", lambda device: 2**30)
    answers = []
    for bs in ("100000", str(10**14)):
        code, out, err = _main(capsys, "bench", "--quick", "--no-graph", "--device", "cpu", "--batch-sizes", bs)
        assert code == 2 and out == ""
        line = one_line(err, f"hwkv bench: error: --batch-sizes: batch size {bs} needs at least ")
        answers.append(line.rsplit("; ", 1)[1])
    assert answers[0] == answers[1] and answers[0].startswith("at most batch size ")


@pytest.mark.parametrize("flags", [["--serve-requests", str(10**14)], ["--serve-prompt-len", str(10**14)]])
def test_bench_serve_absurd_trace_is_refused_before_the_model_loads(capsys, no_model_load, flags):
    code, out, err = _main(capsys, "bench", "--workload", "serve", "--no-baseline", *flags)
    assert code == 2 and out == ""
    line = one_line(err, "hwkv bench: error: serve workload: ")
    assert "prompt tokens, at least " in line and "free; give fewer requests or shorter prompts" in line


def test_bench_serve_context_beyond_the_pools_is_refused_before_the_trace(capsys, monkeypatch):
    pytest.importorskip("transformers")
    import hwkv.bench.serve as serve

    monkeypatch.setattr(serve, "make_trace", lambda *a, **k: pytest.fail("the trace was drawn before the checks"))
    code, out, err = _main(capsys, "bench", "--workload", "serve", "--no-baseline", "--serve-requests", "2",
                           "--serve-prompt-len", str(10**8))
    assert code == 2 and out == ""
    assert "at most 0 fit" in one_line(err, "hwkv bench: error: ")
