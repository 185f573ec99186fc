"""Review 26 (newcomer): defects a user of the `hwkv` command, the tiny-model script and the public Python API met.

Each test is one reproduction and fails on the reviewed commit (5b99f91); REVIEW.md says expected vs actual.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hwkv
from hwkv import cli
from hwkv.errors import HwkvError
from hwkv.pool import SWAKVPool

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HWKV_DEVICE", "HWKV_DEBUG")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return env


def _main(capsys, *argv: str):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _pool(**kw) -> SWAKVPool:
    args = dict(size=64, size_swa=32, page_size=4, dtype=torch.float32, head_num=2, head_dim=8,
                swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu")
    args.update(kw)
    return SWAKVPool(**args)


def _script(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), *argv], cwd=tmp_path,
                          env=_env(), text=True, capture_output=True, timeout=120)


# ------------------------------------------------------------------------------------------- hwkv bench serve


def test_serve_json_gives_no_prompt_count_for_the_transformers_baseline(capsys):
    """The table prints '-' for the baseline's prompt tokens (not measured); --json says 0 prompt tokens for a run
    that prefilled every prompt. A value with no measurement is null, as TPOT's n/a is (bad-inputs row 110)."""
    pytest.importorskip("transformers")
    code, out, err = _main(capsys, "bench", "--workload", "serve", "--serve-requests", "2", "--serve-new", "2",
                           "--serve-rate", "0", "--serve-prompt-len", "16", "--page-size", "4", "--json")
    assert code == 0, err
    rows = {r["method"].split()[0]: r for r in json.loads(out)["rows"]}
    assert rows["hwkv"]["prompt_tokens"] > 0
    base = rows["transformers"]
    assert base["error"] is None
    assert base["prompt_tokens"] is None and base["reused_tokens"] is None, base


def test_serve_title_says_all_at_once_for_rate_0(capsys):
    """--serve-rate 0 means every request at once; the title says 'at 0.0/s' (a rate of nothing)."""
    pytest.importorskip("transformers")
    code, out, err = _main(capsys, "bench", "--workload", "serve", "--serve-requests", "2", "--serve-new", "2",
                           "--serve-rate", "0", "--serve-prompt-len", "16", "--page-size", "4", "--no-baseline")
    assert code == 0, err
    title = out.splitlines()[0]
    assert "0.0/s" not in title, title


# ----------------------------------------------------------------------------------------------- hwkv generate


@pytest.fixture(scope="module")
def tiny_ids(tmp_path_factory) -> str:
    pytest.importorskip("transformers")
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import make_tiny_model
    finally:
        sys.path.pop(0)
    folder = tmp_path_factory.mktemp("tiny-ids")
    make_tiny_model.make(folder, tokenizer=False)
    return str(folder)


def test_generate_sizes_the_pools_for_the_prompts_not_for_max_running(capsys, tiny_ids):
    """One 3-token prompt with --max-running 1000: the default budget is 'what the batch needs', but the pools
    are sized (and allocated, zero-filled) for 1000 requests. With --max-running 99999999999999999 the run
    allocates the whole 4 GiB CPU cap (RSS 4.7 GB) and reports max_running 174751."""
    argv = ["generate", "--model", tiny_ids, "--prompt", "1,2,3", "--max-new-tokens", "2", "--no-progress", "--json"]
    code, out, err = _main(capsys, *argv)
    assert code == 0, err
    one = json.loads(out)["stats"]["pools"]
    code, out, err = _main(capsys, *argv, "--max-running", "1000")
    assert code == 0, err
    many = json.loads(out)["stats"]["pools"]
    assert many["allocated_bytes"] == one["allocated_bytes"], (one, many)


# ------------------------------------------------------------------------------------ scripts/make_tiny_model.py


def test_tiny_model_script_refuses_a_seed_past_int64_without_a_traceback(tmp_path):
    run = _script(tmp_path, str(tmp_path / "m"), "--seed", "99999999999999999999999")
    assert "Traceback" not in run.stderr, run.stderr[-600:]
    assert run.returncode == 2, run.returncode


def test_tiny_model_script_refuses_a_window_generate_refuses(tmp_path):
    """--window 2**63 is written, then `hwkv generate` on the folder says: sliding_window=... must be integers >= 1
    and below 2**63. The script refuses what generate would (review 25), but not this."""
    run = _script(tmp_path, str(tmp_path / "m"), "--window", str(2**63))
    assert run.returncode == 2, run.stdout
    assert not (tmp_path / "m").exists()


def test_tiny_model_script_refuses_an_empty_folder_name(tmp_path):
    """`make_tiny_model.py ""` (e.g. an unset shell variable) writes config.json, weights and tokenizer into the
    current folder, overwriting what is there."""
    (tmp_path / "config.json").write_text('{"mine": true}')
    run = _script(tmp_path, "")
    assert run.returncode == 2, run.stdout
    assert json.loads((tmp_path / "config.json").read_text()) == {"mine": True}


# ------------------------------------------------------------------------------------------------ Python API


@pytest.mark.parametrize("swa_ids, full_ids", [
    ("0", [1]),            # a string: iterated into '0', a layer id no AttentionLayer can have
    ([-1], [0]),           # AttentionLayer refuses layer_id=-1
    ([0.0], [1]),          # a float id (get_key_buffer(1.0) is refused, row 188)
    ([False], [True]),     # bools (AttentionLayer(layer_id=True) is refused, row 188)
])
def test_swa_pool_refuses_layer_ids_that_are_not_ints(swa_ids, full_ids):
    with pytest.raises(HwkvError, match="layer"):
        _pool(swa_attention_layer_ids=swa_ids, full_attention_layer_ids=full_ids)


def test_swa_pool_built_from_a_string_of_ids_fails_later_untyped():
    """The pool of the case above then fails a lookup with a bare TypeError, far from the cause."""
    try:
        pool = _pool(swa_attention_layer_ids="0")
    except HwkvError:
        return  # refused at construction: fine
    with pytest.raises(HwkvError):
        pool.get_key_buffer(0)


@pytest.mark.parametrize("pool", [None, "pool"])
def test_make_backend_refuses_a_pool_that_is_no_pool_with_a_typed_error(pool):
    rtt = hwkv.ReqToTokenPool(4, 64, "cpu")
    with pytest.raises(HwkvError):  # a bare AttributeError: 'NoneType' object has no attribute 'device'
        hwkv.make_backend(pool, rtt)


def test_make_backend_refuses_a_missing_req_to_token_pool():
    """make_backend(pool, None) builds a backend; its first init_forward_metadata raises a bare AttributeError."""
    from hwkv.allocator import SWATokenToKVPoolAllocator
    from hwkv.batch import ForwardBatch, ForwardMode

    pool = _pool()
    try:
        backend = hwkv.make_backend(pool, None, sliding_window=8)
    except HwkvError:
        return  # refused at construction: fine
    alloc = SWATokenToKVPoolAllocator(64, 32, 4, "cpu", pool)
    loc = alloc.alloc(4)
    batch = ForwardBatch(ForwardMode.EXTEND, 1, torch.tensor([0]), torch.tensor([4]), loc,
                         extend_prefix_lens=torch.tensor([0]), extend_seq_lens=torch.tensor([4]))
    with pytest.raises(HwkvError):
        backend.init_forward_metadata(batch)


def test_nan_sinks_are_refused_not_turned_into_nan_outputs():
    """AttentionLayer refuses a NaN logit_cap, scaling or k_scale, but NaN sinks (CPU tensors, whose values the
    checks read without a device sync) pass, and every output row of the layer is NaN."""
    from hwkv.allocator import SWATokenToKVPoolAllocator
    from hwkv.batch import ForwardBatch, ForwardMode

    pool = _pool()
    alloc = SWATokenToKVPoolAllocator(64, 32, 4, "cpu", pool)
    rtt = hwkv.ReqToTokenPool(4, 64, "cpu")
    backend = hwkv.make_backend(pool, rtt, sliding_window=8)
    row = rtt.alloc(1)[0]
    loc = alloc.alloc_extend([0], [4], [0], 4)
    rtt.write(row, 0, loc)
    batch = ForwardBatch(ForwardMode.EXTEND, 1, torch.tensor([row]), torch.tensor([4]), loc,
                         extend_prefix_lens=torch.tensor([0]), extend_seq_lens=torch.tensor([4]))
    backend.init_forward_metadata(batch)
    with pytest.raises(HwkvError, match="sinks"):
        layer = hwkv.AttentionLayer(0, 4, 2, 8, sliding_window=8, sinks=torch.full((4,), float("nan")))
        out = backend.forward(torch.randn(4, 4, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8), layer, batch)
        assert not out.isnan().any()
