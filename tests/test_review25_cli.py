"""Review 25 (newcomer): what a user of the `hwkv` command met that the rules forbid.

Every command needed pytest (the test extra) to start; a huge --layers filled the host's memory; the tiny-model
script ended in tracebacks or wrote models `hwkv generate` refuses; --help into a full disk exited 0 with nothing
written; --configs dropped empty items silently; `--graphs eager` reported "graphs on"; a drafter beside sampling
ran with no draft token, unsaid; and the memory refusals did not name the flags that sized them.
"""
from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hwkv import cli
from tests.test_cli_errors import _env, _gen, _main, one_line, tiny_model  # noqa: F401  (a fixture)

REPO = Path(__file__).resolve().parents[1]

# a process where importing pytest fails, as after `pip install hwkv[cpu]`: --version, then verify, as JSON
_NO_PYTEST = r"""
import json, sys
class NoPytest:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pytest", "_pytest"):
            raise ImportError(f"No module named {name!r}")
sys.meta_path.insert(0, NoPytest())
from hwkv import cli
out = {}
try:
    cli.main(["--version"])
except SystemExit as e:
    out["version"] = e.code
out["verify"] = cli.main(["verify", "--device", "cpu"])
out["plan"] = cli.main(["plan", "--model", "gpt-oss-20b", "--memory", "1GiB", "--context", "512", "--json"])
print(json.dumps(out))
"""
_PROC = subprocess.Popen([sys.executable, "-c", _NO_PYTEST], cwd=REPO, env=_env(), text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # (started at collection: torch imports)


def test_every_command_but_verify_runs_without_pytest():
    out, err = _PROC.communicate(timeout=300)
    assert _PROC.returncode == 0, err
    res = json.loads(out.strip().splitlines()[-1])
    assert res == {"version": 0, "verify": 2, "plan": 0}, res
    assert "Traceback" not in err
    assert "hwkv verify: error: verify runs the contract suite under pytest, which is not installed here: pip " \
           "install pytest (or 'hwkv[test]')" in err


class _Full:
    """A stdout on a full disk: every write fails as /dev/full's does."""

    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["plan", "--help"]])
def test_help_into_a_full_disk_is_one_line_and_exit_2(monkeypatch, capsys, argv):
    monkeypatch.setattr(sys, "stdout", _Full())
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2
    one_line(err, "hwkv: error: cannot write the output: No space left")  # (before a command is parsed)


def test_a_huge_layer_count_is_refused_before_any_layer_is_built(capsys):
    code, out, err = _main(capsys, "plan", "--model", "gpt-oss-20b", "--layers", "99999999999", "--pattern", "sf",
                           "--memory", "80GiB", "--context", "4096")
    assert code == 2 and out == ""
    one_line(err, "hwkv plan: error: layers must be <= 4096, got 99999999999")


@pytest.mark.parametrize("configs, message", [
    ("", "--configs '' has an empty item"),
    ("once/eager,,", "--configs 'once/eager,,' has an empty item"),
    (",", "--configs ',' has an empty item"),
])
def test_bench_refuses_an_empty_configuration(capsys, configs, message):
    code, out, err = _main(capsys, "bench", "--quick", "--configs", configs)
    assert code == 2 and out == ""
    one_line(err, f"hwkv bench: error: {message}")


def test_bench_names_every_flag_behind_a_request_that_fits_nowhere(capsys):
    code, out, err = _main(capsys, "bench", "--quick", "--warmup", "99999999999999")
    assert code == 2
    line = one_line(err, "hwkv bench: error: --batch-sizes: batch size 1 needs at least")
    assert "--warmup 99999999999999" in line and "--page-size 16" in line and "--prompt-len" in line


def test_generate_names_the_flags_behind_a_refused_budget(capsys, tiny_model):  # noqa: F811
    code, out, err = _gen(capsys, "--model", tiny_model, "--prompt", "1,2", "--context", "99999999999999")
    assert code == 2 and out == ""
    line = one_line(err, "hwkv generate: error:")
    assert "--context 99999999999999" in line
    assert "the default budget; --memory sets it" in line and "--page-size 16" in line
    code, out, err = _gen(capsys, "--model", tiny_model, "--prompt", "1,2", "--max-new-tokens", "64",
                          "--memory", "1KiB")
    assert code == 2 and out == ""
    line = one_line(err, "hwkv generate: error:")
    assert "the longest prompt + --max-new-tokens 64 - 1;" in line
    assert "--memory 1KiB" in line and "--page-size 16" in line


def test_generate_refuses_a_drafter_beside_sampling(capsys, tiny_model):  # noqa: F811
    code, out, err = _gen(capsys, "--model", tiny_model, "--prompt", "1,2", "--draft", "prompt-lookup",
                          "--temperature", "0.5")
    assert code == 2 and out == ""
    one_line(err, "hwkv generate: error: --draft prompt-lookup verifies greedy decoding only: --temperature 0.5")


@pytest.mark.parametrize("graphs, said", [("eager", "graphs eager"), ("off", "graphs off")])
def test_generate_says_which_graphs_ran(capsys, tiny_model, graphs, said):  # noqa: F811
    code, out, err = _gen(capsys, "--model", tiny_model, "--prompt", "1,2,3", "--max-new-tokens", "2",
                          "--graphs", graphs)
    assert code == 0, err
    assert any(line.endswith(f"{said})") for line in out.splitlines()), out
    code, out, err = _gen(capsys, "--model", tiny_model, "--prompt", "1,2,3", "--max-new-tokens", "2",
                          "--graphs", graphs, "--json")
    data = json.loads(out)
    assert data["graphs"] is (graphs == "eager") and data["graph_mode"] == (None if graphs == "off" else "eager")


@pytest.mark.parametrize("argv, message", [
    (["--layers", "0"], "--layers must be >= 1, got 0"),
    (["--layers=-1"], "--layers must be >= 1, got -1"),
    (["--window", "0"], "--window must be >= 1, got 0"),
    (["--layers", "65"], "--layers must be <= 64 for a tiny model, got 65"),
])
def test_tiny_model_script_refuses_what_generate_would(tmp_path, argv, message):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import make_tiny_model
    finally:
        sys.path.pop(0)
    with pytest.raises(SystemExit) as e:
        make_tiny_model.main([str(tmp_path / "m"), *argv])
    assert e.value.code == 2
    assert not (tmp_path / "m").exists()


def test_tiny_model_script_refuses_a_file_for_its_folder(tmp_path, capsys):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import make_tiny_model
    finally:
        sys.path.pop(0)
    f = tmp_path / "a-file"
    f.write_text("x")
    with pytest.raises(SystemExit) as e:
        make_tiny_model.main([str(f)])
    assert e.value.code == 2
    assert f"{f} exists and is not a folder" in capsys.readouterr().err
