"""What `hwkv bench` and its library refuse: a flag of another workload (given, 0 included, never silently
ignored), workload and planner values of the wrong type or range (a typed ConfigError naming the value and the
limit, not a bare TypeError or ZeroDivisionError), and the percentile every table reports."""
from __future__ import annotations

import argparse
import statistics
from typing import Dict, List, Tuple

import pytest

from hwkv import cli
from hwkv.errors import ConfigError

DECODE, CHAT, SERVE = "decode", "chat", "serve"
WORKLOADS = {DECODE: ["--quick", "--no-graph", "--device", "cpu"], CHAT: ["--workload", "chat", "--device", "cpu"],
             SERVE: ["--workload", "serve", "--no-baseline", "--device", "cpu"]}
_MODEL = (DECODE, CHAT)  # the model shape, its dtype, the layers run and the reference check: the synthetic workloads'
# every flag only some workloads read: (its arguments, numbers given as 0 where argparse takes them, the workloads
# reading it)
FLAGS: Dict[str, Tuple[List[str], Tuple[str, ...]]] = {
    "--batch-sizes": (["--batch-sizes", "1"], (DECODE,)),
    "--prompt-len": (["--prompt-len", "0"], (DECODE,)),
    "--steps": (["--steps", "0"], (DECODE,)),
    "--warmup": (["--warmup", "0"], (DECODE,)),
    "--repeats": (["--repeats", "0"], (DECODE,)),
    "--quick": (["--quick"], (DECODE,)),
    "--configs": (["--configs", "once/eager"], (DECODE,)),
    "--no-graph": (["--no-graph"], (DECODE,)),
    "--plot": (["--plot", "never-written.png"], (DECODE,)),
    "--check-every": (["--check-every", "0"], _MODEL),
    "--check-requests": (["--check-requests", "0"], _MODEL),
    "--check-queries": (["--check-queries", "0"], _MODEL),
    "--dtype": (["--dtype", "fp32"], _MODEL),
    "--run-layers": (["--run-layers", "0"], _MODEL),
    "--model": (["--model", "gemma-2-27b"], _MODEL),
    "--layers": (["--layers", "0"], _MODEL),
    "--pattern": (["--pattern", "sf"], _MODEL),
    "--full-every": (["--full-every", "0"], _MODEL),
    "--window": (["--window", "0"], _MODEL),
    "--heads": (["--heads", "0"], _MODEL),
    "--kv-heads": (["--kv-heads", "0"], _MODEL),
    "--head-dim": (["--head-dim", "0"], _MODEL),
    "--v-head-dim": (["--v-head-dim", "0"], _MODEL),
    "--swa-heads": (["--swa-heads", "0"], _MODEL),
    "--swa-kv-heads": (["--swa-kv-heads", "0"], _MODEL),
    "--swa-head-dim": (["--swa-head-dim", "0"], _MODEL),
    "--swa-v-head-dim": (["--swa-v-head-dim", "0"], _MODEL),
    "--logit-cap": (["--logit-cap", "0"], _MODEL),
    "--sinks": (["--sinks", "none"], _MODEL),
    "--kv-dtype": (["--kv-dtype", "bf16"], _MODEL),
    "--conversations": (["--conversations", "0"], (CHAT,)),
    "--turns": (["--turns", "0"], (CHAT,)),
    "--system-len": (["--system-len", "0"], (CHAT,)),
    "--user-len": (["--user-len", "0"], (CHAT,)),
    "--reply-len": (["--reply-len", "0"], (CHAT,)),
    "--concurrency": (["--concurrency", "0"], (CHAT,)),
    "--memory": (["--memory", "1KiB"], (CHAT,)),
    "--serve-model": (["--serve-model", "/nonexistent"], (SERVE,)),
    "--serve-requests": (["--serve-requests", "0"], (SERVE,)),
    "--serve-rate": (["--serve-rate", "0"], (SERVE,)),
    "--serve-prompt-len": (["--serve-prompt-len", "0"], (SERVE,)),
    "--serve-new": (["--serve-new", "0"], (SERVE,)),
    "--serve-shared": (["--serve-shared", "0"], (SERVE,)),
    "--serve-system-len": (["--serve-system-len", "0"], (SERVE,)),
    "--serve-running": (["--serve-running", "0"], (SERVE,)),
    "--no-baseline": (["--no-baseline"], (SERVE,)),
}
# read by every workload
EVERY = {"--device", "--threads", "--seed", "--page-size", "--chunk", "--json", "--workload"}


@pytest.fixture
def nothing_runs(monkeypatch: pytest.MonkeyPatch):
    """A workload that gets past its checks fails the test (none of them is to run here)."""
    import hwkv.bench.chat as chat
    import hwkv.bench.run as run

    def ran(*a, **k):
        pytest.fail("the workload ran with a flag it does not read")

    monkeypatch.setattr(run, "run_benchmark", ran)
    monkeypatch.setattr(chat, "run_chat", ran)
    try:
        import hwkv.bench.serve as serve
    except ImportError:
        return
    monkeypatch.setattr(serve, "run_serve", ran)
    monkeypatch.setattr(serve, "random_gpt_oss", ran)


def _refused(capsys, argv: List[str]) -> str:
    code = cli.main(["bench", *argv])
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and out == "" and len(lines) == 1 and "Traceback" not in err, (code, out, err)
    assert lines[0].startswith("hwkv bench: error: ")
    return lines[0]


def _owners(owners: Tuple[str, ...]) -> str:
    return " and ".join(owners)


CASES = [(flag, w) for flag, (_, owners) in FLAGS.items() for w in WORKLOADS if w not in owners]


@pytest.mark.parametrize("flag, workload", CASES, ids=[f"{f}-in-{w}" for f, w in CASES])
def test_a_flag_of_another_workload_is_refused_naming_it_and_its_workload(capsys, nothing_runs, flag, workload):
    argv, owners = FLAGS[flag]
    line = _refused(capsys, WORKLOADS[workload] + argv)
    assert flag in line and f"{_owners(owners)} workload" in line and f"--workload {workload}" in line, line


def test_the_reviewers_decode_run_is_refused(capsys, nothing_runs):
    line = _refused(capsys, ["--quick", "--batch-sizes", "1", "--configs", "once/eager", "--memory", "1KiB",
                             "--conversations", "99", "--serve-new", "5", "--json"])
    assert "--conversations, --memory: the chat workload's" in line and "--serve-new: the serve workload's" in line


def test_the_reviewers_serve_run_is_refused(capsys, nothing_runs):
    line = _refused(capsys, ["--workload", "serve", "--serve-requests", "2", "--serve-new", "2", "--serve-prompt-len",
                             "16", "--serve-rate", "0", "--no-baseline", "--configs", "bogus", "--model",
                             "gemma-2-27b", "--memory", "1KiB", "--run-layers", "99", "--batch-sizes", "7", "--quick",
                             "--dtype", "bf16", "--check-every", "3"])
    for flag in ("--configs", "--model", "--memory", "--run-layers", "--batch-sizes", "--quick", "--dtype",
                 "--check-every"):
        assert flag in line


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--serve-model", "/nonexistent"], ["--serve-rate", "-5"]])
def test_the_reviewers_chat_runs_are_refused(capsys, nothing_runs, argv):
    assert argv[0] in _refused(capsys, WORKLOADS[CHAT] + argv)


def test_every_bench_flag_is_classified_and_given_means_not_its_default():
    """The table the CLI checks covers every flag of the parser but the ones each workload reads, and each flag in
    it defaults to None (False for a switch), so a given 0 counts as given."""
    from hwkv.bench.bench_cli import WORKLOAD_FLAGS, add_bench_arguments

    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    options = {a.option_strings[0]: a for a in p._actions if a.option_strings and a.dest != "help"}
    assert set(options) == set(FLAGS) | EVERY
    table = {f"--{dest.replace('_', '-')}": owners for dest, owners in WORKLOAD_FLAGS.items()}
    assert table == {flag: owners for flag, (_, owners) in FLAGS.items()}
    for flag in FLAGS:
        assert options[flag].default in (None, False), (flag, options[flag].default)


def test_serve_still_takes_its_defaults(monkeypatch):
    """--serve-requests, --serve-rate, --serve-shared and --serve-running default to None on the parser (given is
    not-None); the workload still gets 32, 8/s, 0.5 and 16."""
    pytest.importorskip("transformers")
    import hwkv.bench.serve as serve

    args = cli.build_parser().parse_args(["bench"])
    assert (args.serve_requests, args.serve_rate, args.serve_shared, args.serve_running) == (None,) * 4

    seen = []
    monkeypatch.setattr(serve, "random_gpt_oss", lambda *a, **k: object())

    def run_serve(model, w, *a, **k):
        seen.append(w)
        return serve.ServeResult("m", "cpu", w)

    monkeypatch.setattr(serve, "run_serve", run_serve)
    assert cli.main(["bench", "--workload", "serve", "--device", "cpu", "--json"]) == 0
    (w,) = seen
    assert (w.requests, w.rate, w.shared, w.max_running, w.prompt_len, w.new_tokens) == (32, 8.0, 0.5, 16, 64, 32)


# ------------------------------------------------------------------------ library values, typed refusals


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch_sizes="1,2"), "batch_sizes must be a tuple of integers >= 1, got '1,2'"),
    (dict(batch_sizes=(1.5,)), "batch_sizes must be a tuple of integers >= 1, got (1.5,)"),
    (dict(batch_sizes=(True,)), "batch_sizes must be a tuple of integers >= 1, got (True,)"),
    (dict(batch_sizes=()), "batch_sizes must be a tuple of integers >= 1, got ()"),
    (dict(batch_sizes=(0,)), "batch_sizes must be a tuple of integers >= 1, got (0,)"),
    (dict(steps=True), "steps must be an integer >= 1, got True"),
    (dict(seed=-1), "seed must be an integer in [0, 2**63), got -1"),
])
def test_decode_workload_values(kwargs, message):
    from hwkv.bench.run import Workload

    with pytest.raises(ConfigError) as e:
        Workload(**kwargs)
    assert message in str(e.value)


def test_decode_workload_takes_a_list_of_batch_sizes_as_a_tuple():
    from hwkv.bench.run import Workload

    assert Workload(batch_sizes=[1, 4]).batch_sizes == (1, 4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(requests=True), "requests must be an integer >= 1, got True"),
    (dict(seed=-1), "seed must be an integer in [0, 2**63), got -1"),
    (dict(rate=True), "rate must be in [0.0, inf], got True"),
    (dict(shared=False), "shared must be in [0.0, 1.0], got False"),
    (dict(system_len=True), "system_len must be in [0, prompt_len=64), got True"),
])
def test_serve_workload_values(kwargs, message):
    pytest.importorskip("transformers")
    from hwkv.bench.serve import ServeWorkload

    with pytest.raises(ConfigError) as e:
        ServeWorkload(**kwargs)
    assert message in str(e.value)


def _gpt():
    from hwkv.engine.presets import get_preset

    return get_preset("gpt-oss-20b")


@pytest.mark.parametrize("call, message", [
    (lambda plan: plan(_gpt(), 2**33, 4096, page_size=True), "page_size must be an integer >= 1, got True"),
    (lambda plan: plan(_gpt(), 2**33, 4096, max_running=True), "max_running must be an integer >= 1 or None, got True"),
    (lambda plan: plan(_gpt(), True, 4096), "memory_bytes must be an integer >= 1, got True"),
    (lambda plan: plan(None, 2**33, 4096), "shape must be a ModelShape, got None"),
    (lambda plan: plan(_gpt(), 2**33, 4096, prefix_cache="no"), "prefix_cache must be True or False, got 'no'"),
])
def test_plan_values(call, message):
    from hwkv.engine.plan import plan

    with pytest.raises(ConfigError) as e:
        call(plan)
    assert message in str(e.value)


@pytest.mark.parametrize("name, args, message", [
    ("round_up", (5, 0), "round_up: multiple must be an integer >= 1, got 0"),
    ("round_up", (5.5, 4), "round_up: x must be an integer, got 5.5"),
    ("swa_tokens_per_request", (128, 0), "page_size must be an integer >= 1, got 0"),
    ("swa_tokens_per_request", (-1, 16), "window must be an integer >= 0, got -1"),  # 0: a model without SWA
    ("swa_tokens_per_request", (128, 16, -1), "eviction_margin_pages must be an integer >= 0, got -1"),
    ("swa_tokens_per_request", (128, 16, 1, -3), "context must be an integer >= 0 or None, got -3"),
    ("cache_lock_tokens", (128, 0, 10), "page_size must be an integer >= 1, got 0"),
])
def test_planner_helpers_refuse_what_would_divide_by_zero(name, args, message):
    import hwkv.bench.plan as old_home
    import hwkv.engine.plan as planner

    for mod in (planner, old_home):  # re-exported: the same functions
        with pytest.raises(ConfigError) as e:
            getattr(mod, name)(*args)
        assert message in str(e.value)


# ---------------------------------------------------------------------------------------- percentiles


def test_serve_percentiles_are_the_decode_benchs_linear_interpolation():
    """p50 is the median (an even count: the mean of the middle two; round() used to pick one by banker's rounding)
    and every percentile is the one the decode workload's p10/p50/p90 use."""
    pytest.importorskip("transformers")
    from hwkv.bench.run import Spread
    from hwkv.bench.serve import ServeWorkload, _row

    for firsts in ([0.001, 0.002, 0.003, 0.004], [0.001, 0.002], [0.005, 0.001, 0.003], [0.004]):
        times = [(0.0, f, f + 0.01, 2) for f in firsts]
        row = _row("m", ServeWorkload(), times, 1.0)
        assert row.ttft_p50_ms == round(statistics.median(firsts) * 1e3, 3)
        assert row.ttft_p50_ms == round(Spread.of(firsts).median_ms, 3)
        if len(firsts) > 1:
            assert row.ttft_p99_ms == round(statistics.quantiles(firsts, n=100, method="inclusive")[98] * 1e3, 3)


def test_one_percentile_function_for_every_table():
    from hwkv.bench.spread import percentile

    xs = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    for q in (0.1, 0.5, 0.9, 0.99):
        k = round(q * 100)
        assert percentile(xs, q) == pytest.approx(statistics.quantiles(xs, n=100, method="inclusive")[k - 1])
    assert percentile(xs, 0.5) == statistics.median(xs) and percentile([7.0], 0.99) == 7.0
    assert (percentile(xs, 0.0), percentile(xs, 1.0)) == (1.0, 9.0)
    with pytest.raises(ConfigError, match="no values"):
        percentile([], 0.5)
    with pytest.raises(ConfigError, match=r"q must be in \[0, 1\], got 1.5"):
        percentile(xs, 1.5)
