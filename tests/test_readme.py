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
