"""The README's engine example runs as written."""
import pathlib
import re

import torch


def test_readme_engine_example_runs():
    text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"## Use from an engine.*?```python\n(.*?)```", text, re.S).group(1)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    assert scope["out"].shape == (300, 64, 64) and torch.isfinite(scope["out"].float()).all()
    assert scope["frontier"] == 144  # dead below 301 - 128 + 1 = 174 -> page floor 160, one page of margin -> 144
    assert scope["match"].length == 256 and scope["frontier_b"] == 128  # b needs the SWA of [128, 256)
    assert scope["out_b"].shape == (50, 64, 64) and torch.isfinite(scope["out_b"].float()).all()


# ---- the Hugging Face section: the tiny model the examples use, the HybridRunner block, the generate output ------
def _tiny_model(folder: pathlib.Path, *args: str) -> None:
    import importlib.util

    root = pathlib.Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("make_tiny_model", root / "scripts" / "make_tiny_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([str(folder), *args]) == 0


def _hf_section() -> str:
    text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    return re.search(r"## Hugging Face models\n(.*?)\n## ", text, re.S).group(1)


def test_readme_hybrid_runner_example_runs(tmp_path, monkeypatch):
    import pytest

    pytest.importorskip("transformers")
    block = re.search(r"```python\n(.*?)```", _hf_section(), re.S).group(1)
    assert "memory=" not in block  # the pools are sized from the requests and the free memory
    _tiny_model(tmp_path / "tiny-gpt-oss")
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        scope: dict = {}
        exec(compile(block, "README.md", "exec"), scope)
    finally:
        torch.set_num_threads(threads)
    results, runner = scope["results"], scope["runner"]
    assert [r.seed for r in results] == [1, 2] and results[0].tokens != results[1].tokens  # same prompt, own seeds
    assert all(len(r.tokens) == 64 for r in results)
    assert runner.cache.plan.pool_bytes < 100 * 2**20  # "65 MiB for the tiny model"


def test_readme_generate_output_is_what_the_command_prints(tmp_path, monkeypatch, capsys):
    """The `$ hwkv generate ...` block: the same prompts, lengths and KV memory line (the tokens themselves depend
    on float rounding of the CPU and library versions, so only their count is compared)."""
    import shlex

    import pytest

    pytest.importorskip("transformers")
    from hwkv import cli

    block = re.search(r"```\n\$ (hwkv generate .*?)```", _hf_section(), re.S).group(1)
    command, *printed = block.replace("\\\n", " ").strip().splitlines()
    argv = shlex.split(command)[1:]
    model = argv[argv.index("--model") + 1]
    _tiny_model(tmp_path / model)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert cli.main([*argv, "--no-progress", "--device", "cpu"]) == 0  # the block is a CPU run (a GPU machine
    # detects its GPU)
    out = capsys.readouterr().out.splitlines()
    prompts = [argv[i + 1] for i, a in enumerate(argv) if a == "--prompt"]
    assert len(out) == len(printed) == len(prompts) + 3
    for i, prompt in enumerate(prompts):
        head = f"[{i}] {prompt!r} -> "
        assert printed[i].startswith(head) and out[i].startswith(head)
        assert printed[i].endswith("[16 tokens, length]") and out[i].endswith("[16 tokens, length]")
    assert out[-1] == printed[-1]  # KV memory held at the peak and allocated
    assert out[-2] == printed[-2]  # prompt tokens reused and computed
    assert out[-3].split(" tokens in ")[0] == printed[-3].split(" tokens in ")[0]
