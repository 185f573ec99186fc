"""scripts/make_tiny_model.py writes the tiny model the README's `hwkv generate` examples use, offline."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is in hwkv's test extra")
pytest.importorskip("tokenizers", reason="tokenizers comes with transformers")

from hwkv import cli  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("make_tiny_model", ROOT / "scripts" / "make_tiny_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _generate(capsys, *argv: str) -> dict:
    code = cli.main(["generate", *argv, "--max-new-tokens", "4", "--page-size", "4", "--no-progress", "--json",
                     "--device", "cpu"])  # (a GPU machine detects its GPU)
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_the_folder_loads_in_hwkv_generate(tmp_path, capsys, one_thread):
    mod = _script()
    assert mod.main([str(tmp_path / "text")]) == 0
    assert "wrote" in capsys.readouterr().out
    files = {p.name for p in (tmp_path / "text").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    data = _generate(capsys, "--model", str(tmp_path / "text"), "--prompt", "Hello there")
    (res,) = data["results"]
    assert res["prompt_ids"] == [mod.CHARS.index(c) for c in "Hello there"] and len(res["tokens"]) == 4
    assert res["text"] == "".join(mod.CHARS[t] for t in res["tokens"])
    assert data["device"] == "cpu" and data["stats"]["kv_memory"]["peak_held_bytes"] > 0

    mod.main([str(tmp_path / "ids"), "--no-tokenizer"])
    capsys.readouterr()
    assert "tokenizer.json" not in {p.name for p in (tmp_path / "ids").iterdir()}
    data = _generate(capsys, "--model", str(tmp_path / "ids"), "--prompt", "1,2,3")
    assert data["results"][0]["text"] is None and len(data["results"][0]["tokens"]) == 4

    # the same seed, the same weights (drawn by the script, not by transformers' initialisers)
    from safetensors.torch import load_file

    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("text", "ids"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_mimo_v2_folder(tmp_path, capsys, one_thread):
    import transformers

    if not hasattr(transformers, "MiMoV2FlashConfig"):
        pytest.skip("this transformers has no MiMo-V2-Flash model")
    _script().make(tmp_path / "mimo", arch="mimo-v2")
    data = _generate(capsys, "--model", str(tmp_path / "mimo"), "--prompt", "Hi MiMo")
    assert len(data["results"][0]["tokens"]) == 4
