"""Review 20 (B), `hwkv bench` / `hwkv plan`: a serve rate too small to serve, a --plot format that needs LaTeX, an
explicit `--layers 0` beside --model, `--check-requests 0` / `--check-queries 0` with the chat workload, and the
serve table's prompt range. Each refusal is one line and exit 2, before any model loads or run starts."""
from __future__ import annotations

import argparse
import time
from typing import List

import pytest

from hwkv import cli
from hwkv.errors import ConfigError


def _refused(capsys, argv: List[str]) -> str:
    """`hwkv <argv>` exits 2 with one line on stderr, nothing on stdout, no traceback; returns the line."""
    code = cli.main(argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and out == "" and len(lines) == 1 and "Traceback" not in err, (code, out, err)
    return lines[0]


def _never(*a, **k):
    pytest.fail("the run started (a model loaded or the benchmark ran) before the refusal")


# ---- 1. --serve-rate: a trace that would take longer than a day ---------------------------------------------
@pytest.mark.parametrize("rate", ["1e-300", "1e-9", "5e-324", "1e-5"])
def test_a_serve_rate_whose_trace_spans_past_a_day_is_refused_before_the_model_loads(capsys, monkeypatch, rate):
    """1e-300 had ended in OverflowError from time.sleep (a traceback, exit 1) after the model loaded; 1e-9 slept
    for decades. 2 requests at 1e-5/s span about 200,000 s: past the day the workload allows."""
    pytest.importorskip("transformers")
    import hwkv.bench.serve as serve
    monkeypatch.setattr(serve, "random_gpt_oss", _never)
    monkeypatch.setattr(serve, "run_serve", _never)
    line = _refused(capsys, ["bench", "--workload", "serve", "--serve-requests", "2", "--serve-rate", rate,
                             "--no-baseline", "--page-size", "4", "--device", "cpu"])
    assert line.startswith("hwkv bench: error: ") and "--serve-rate" in line and "86,400 s" in line, line
    assert "at least" in line and "0 for all at once" in line, line


def test_the_trace_check_names_the_rate_and_the_limit_and_takes_a_rate_that_fits():
    """check_trace_fits (what the CLI and run_serve call before the model loads and the trace is drawn)."""
    from hwkv.bench.serve import MAX_TRACE_S, ServeWorkload, check_trace_fits
    with pytest.raises(ConfigError, match=r"rate=1e-09 .*32 requests over about 3.2e\+10 s.*86,400 s"):
        check_trace_fits(ServeWorkload(requests=32, rate=1e-9), free=1 << 40)
    for rate in (32 / MAX_TRACE_S, 0.0, float("inf")):  # exactly a day; all at once
        check_trace_fits(ServeWorkload(requests=32, rate=rate), free=1 << 40)
    # a trace too large for the host is refused as such first: fewer requests, not a higher rate, is the remedy
    with pytest.raises(ConfigError, match=r"free; give fewer requests or shorter prompts"):
        check_trace_fits(ServeWorkload(requests=10**14, rate=1e-9), free=1 << 30)


def test_a_wait_for_the_next_arrival_never_raises(monkeypatch):
    """However far the next arrival (a trace drawn elsewhere, inf from a subnormal rate), a sleep is finite and
    short: the serve loops come back to look at the clock instead of raising OverflowError."""
    import hwkv.bench.serve as serve
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    for delay in (float("inf"), 1e300, float("nan"), -5.0, 0.25):
        serve.wait(delay)
    assert slept == [serve.MAX_SLEEP_S, serve.MAX_SLEEP_S, 0.0, 0.0, 0.25]


# ---- 2. --plot: formats matplotlib writes only with an external program ---------------------------------------
def test_plot_pgf_is_refused_before_the_run(capsys, monkeypatch, tmp_path):
    """.pgf needs a LaTeX install (xelatex): the pre-run check had listed it as writable, the run went through, then
    matplotlib raised RuntimeError (a traceback, exit 1)."""
    pytest.importorskip("matplotlib")
    import hwkv.bench.run as run
    monkeypatch.setattr(run, "run_benchmark", _never)
    line = _refused(capsys, ["bench", "--quick", "--configs", "once/eager", "--batch-sizes", "1", "--device", "cpu",
                             "--plot", str(tmp_path / "bench.pgf")])
    assert "--plot" in line and ".pgf" in line and "LaTeX" in line, line
    assert not (tmp_path / "bench.pgf").exists()
    from hwkv.bench.report import plot_formats
    assert "pgf" not in plot_formats() and "png" in plot_formats() and "svg" in plot_formats()


def test_a_plot_that_fails_after_the_run_is_one_typed_line(capsys, monkeypatch, tmp_path):
    """The tables are printed; then writing the plot fails (a disk filled up, a program missing): one line naming
    the path and the cause, exit 2, no traceback."""
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    from hwkv.bench import bench_cli, report

    monkeypatch.setattr(report, "print_rich", lambda res: print("the tables"))
    monkeypatch.setattr(report, "_plot_steps", lambda ax, res: None)
    monkeypatch.setattr(report, "_plot_memory", lambda ax, res: None)
    monkeypatch.setattr(report, "_plot_phases", lambda fig, res: None)

    class Res:
        class model:
            name = "m"
        target = backend = "cpu"

    monkeypatch.setattr(bench_cli, "_run", lambda args: Res())

    def fail(self, *a, **k):
        raise RuntimeError("Failed to process string with tex because xelatex could not be found\nmore detail")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", fail)
    path = str(tmp_path / "bench.png")
    code = cli.main(["bench", "--quick", "--device", "cpu", "--plot", path])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and "the tables" in out and len(lines) == 1 and "Traceback" not in err, (code, out, err)
    assert lines[0].startswith("hwkv bench: error: --plot") and path in lines[0] and "xelatex" in lines[0], lines[0]


# ---- 3. --layers 0 beside --model ------------------------------------------------------------------------
@pytest.mark.parametrize("kinds", [["--pattern", "sf"], ["--full-every", "2"]])
def test_layers_0_with_a_model_is_refused_as_without_one(kinds):
    """`get("layers") or num_layers` had read a given 0 as not given: 24 layers planned, exit 0."""
    from hwkv.engine.presets import add_model_arguments, shape_from_args
    p = argparse.ArgumentParser()
    add_model_arguments(p)
    with pytest.raises(ConfigError, match=r"layers must be >= 1, got 0"):
        shape_from_args(p.parse_args(["--model", "gpt-oss-20b", "--layers", "0", *kinds]))
    assert shape_from_args(p.parse_args(["--model", "gpt-oss-20b", "--layers", "4", *kinds])).num_layers == 4
    assert shape_from_args(p.parse_args(["--model", "gpt-oss-20b", *kinds])).num_layers == 24


def test_plan_with_a_model_and_layers_0_exits_2(capsys):
    line = _refused(capsys, ["plan", "--model", "gpt-oss-20b", "--layers", "0", "--pattern", "sf", "--memory", "80GiB",
                             "--context", "4096"])
    assert "layers must be >= 1, got 0" in line, line


# ---- 6. --check-requests 0 / --check-queries 0: "all", for the chat workload too -------------------------
def _help() -> str:
    p = argparse.ArgumentParser(prog="hwkv bench")
    from hwkv.bench.bench_cli import add_bench_arguments
    add_bench_arguments(p)
    return " ".join(p.format_help().split())


CHAT = ["bench", "--workload", "chat", "--device", "cpu", "--conversations", "2", "--turns", "2", "--system-len", "16",
        "--user-len", "8", "--reply-len", "3", "--concurrency", "2", "--memory", "100MiB", "--check-every", "1",
        "--json"]


def test_chat_takes_check_requests_and_queries_0_as_all(capsys):
    """The help says 0 = all for both flags, which the chat workload reads too: it had refused 0 (exit 2)."""
    import json
    text = _help()
    for flag in ("--check-requests N", "--check-queries N"):
        i = text.rfind(flag)  # its help line (the usage names it first)
        assert i >= 0 and "0 = all (decode and chat)" in text[i:i + 120], text[i:i + 120]
    assert cli.main(CHAT + ["--check-requests", "0", "--check-queries", "0"]) == 0
    every = json.loads(capsys.readouterr().out)
    assert cli.main(CHAT + ["--check-requests", "1", "--check-queries", "1"]) == 0
    one = json.loads(capsys.readouterr().out)
    for a, b in zip(every["rows"], one["rows"]):
        assert a["checked_forwards"] == b["checked_forwards"] > 0
        # both conversations run at once: every checked forward checks two requests, not one
        assert a["checked_requests"] > b["checked_requests"] == b["checked_forwards"]


def test_chat_workload_takes_0_and_still_refuses_negative():
    from hwkv.bench.chat import ChatWorkload
    ChatWorkload(check_requests=0, check_queries=0)
    for name in ("check_requests", "check_queries"):
        with pytest.raises(ConfigError, match=rf"{name} must be an integer >= 0 \(0 = all\), got -1"):
            ChatWorkload(**{name: -1})


def test_chat_table_says_all_queries_for_0(capsys):
    assert cli.main([a for a in CHAT if a != "--json"] + ["--check-queries", "0"]) == 0
    out = capsys.readouterr().out
    assert "request checks of all their queries" in out and "last 0 queries" not in out, out


# ---- 7. the serve title's prompt range is the range drawn -----------------------------------------------
@pytest.mark.parametrize("system, spread, drawn", [(32, 0.5, (33, 64)), (60, 0.5, (61, 64)), (10, 0.5, (32, 64)),
                                                   (0, 1.0, (1, 64))])
def test_the_serve_prompt_range_is_the_range_drawn(system, spread, drawn):
    from hwkv.bench.serve import ServeWorkload, make_trace
    w = ServeWorkload(requests=3000, prompt_len=64, system_len=system, spread=spread)
    lens = [len(r.prompt) for r in make_trace(w, 512)]
    assert w.prompt_range == drawn == (min(lens), max(lens))


def test_the_serve_title_states_the_drawn_range(capsys, monkeypatch):
    """The title had said 32-64 for prompts drawn in 61-64 (`--serve-system-len 60`)."""
    pytest.importorskip("transformers")
    import hwkv.bench.serve as serve
    monkeypatch.setattr(serve, "random_gpt_oss", lambda device, tiny: None)
    monkeypatch.setattr(serve, "run_serve", lambda model, w, device, name, baseline: serve.ServeResult(name, device, w))
    assert cli.main(["bench", "--workload", "serve", "--device", "cpu", "--serve-prompt-len", "64",
                     "--serve-system-len", "60", "--no-baseline"]) == 0
    title = capsys.readouterr().out.splitlines()[0]
    assert "prompts 61-64 tokens" in title, title
