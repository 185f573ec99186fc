"""Review 35 (newcomer pass over the README, docs/, the `hwkv` command line and the pool planner).

Every test here fails on the code as reviewed; each docstring says what is wrong, what was expected and where the
cause is. CPU only, no model weights (the generate tests stop before a model would load), each well under a second.
"""
from __future__ import annotations

import contextlib
import io
import json

import pytest

from hwkv import cli


def _run_cli(*argv: str):
    """`hwkv ARGV` in-process: (exit code, stdout, stderr). An exception escaping cli.main is what a user sees as a
    traceback: it comes back as the exit code 'traceback', its type and message in stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(argv))
        except SystemExit as e:
            code = e.code
        except Exception as e:  # noqa: BLE001 - the traceback a user would see
            code = "traceback"
            err.write(f"Traceback: {type(e).__name__}: {e}")
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def no_model_load(monkeypatch):
    """A command that gets as far as loading a transformers model (or drawing a serve trace) fails the test: the
    refusals below must come first."""
    pytest.importorskip("transformers")
    import hwkv.bench.serve as serve
    import hwkv.integrations.transformers as hf

    monkeypatch.setattr(hf, "load_model", lambda *a, **k: pytest.fail("the model loaded before the flag check"))
    monkeypatch.setattr(serve, "random_gpt_oss", lambda *a, **k: pytest.fail("the model loaded before the check"))
    monkeypatch.setattr(serve, "make_trace", lambda *a, **k: pytest.fail("the trace was drawn before the check"))


@pytest.fixture
def plenty_of_memory(monkeypatch):
    """The engine's planner asks the device how much is free; answer 1 TiB so that only the plan decides."""
    import hwkv.engine.pools as pools

    monkeypatch.setattr(pools, "free_device_bytes", lambda device: 1 << 40)


# ---- 1. `hwkv plan` reserves a chunk the engine never reserves ------------------------------------------------------

def test_hwkv_plan_caps_the_chunk_reserve_as_the_engine_does(plenty_of_memory):
    """Defect: README says `hwkv plan` "sizes the full and SWA pools for a KV memory budget the way an engine would"
    and that HybridRunner / `hwkv generate` size their pools "with `hwkv plan`'s planner". They do not agree: the
    engine (hwkv/engine/pools.py:116, `plan_pools`) caps the chunk reserve at `max_running * context` ("no forward
    carries more new tokens than every row's whole context"), while `hwkv plan` (hwkv/bench/plan_cli.py:53 ->
    hwkv/engine/plan.py:176, `chunk_reserve = round_up(chunk, P)`) always reserves the whole --chunk (default 8192)
    in the SWA pool. So `hwkv plan --model gpt-oss-20b --memory 300MiB --context 1024 --max-running 4` exits 2 with
    "at most 3 fit (the chunk of 8192 tokens alone holds 192.00 MiB of SWA slots ...)", while the engine, given the
    very same model, budget, context, running count and chunk, sizes pools for all 4 requests in those 300 MiB.
    Expected: the same pools as `plan_pools` (cap the chunk at max_running * context, as the engine does)."""
    from hwkv.engine.pools import plan_pools
    from hwkv.engine.presets import get_preset

    engine = plan_pools(get_preset("gpt-oss-20b"), context=1024, max_running=4, chunk=8192, page_size=16,
                        memory="300MiB", device="cpu", prefix_cache=True)
    assert engine.max_running == 4  # the engine runs four such requests in 300 MiB
    code, out, err = _run_cli("plan", "--model", "gpt-oss-20b", "--memory", "300MiB", "--context", "1024",
                              "--max-running", "4", "--chunk", "8192", "--json")
    assert code == 0, (code, err)
    data = json.loads(out)
    assert (data["max_running"], data["full_pool_tokens"], data["swa_pool_tokens"]) == \
        (engine.max_running, engine.size, engine.size_swa)


def test_hwkv_plan_refuses_a_budget_that_hwkv_generate_runs_in(plenty_of_memory):
    """The same defect as a newcomer meets it: the tiny model of the README (scripts/make_tiny_model.py: 4 layers
    alternating W=8 sliding and full, 2 KV heads of 16, fp32) generates a 3-token prompt + 2 new tokens with
    `hwkv generate --memory 48KiB` (chunk 512, pools of 48.00 KiB, exit 0), yet `hwkv plan` with the same shape,
    budget, context, chunk and one running request says "at most 0 fit (the chunk of 512 tokens alone holds
    256.00 KiB of SWA slots ...)". Expected: the plan the engine makes (exit 0, 1 request, 16 full / 48 SWA slots)."""
    from hwkv.engine.pools import plan_pools
    from hwkv.engine.presets import custom_shape

    shape = custom_shape(layers=4, pattern="sf", window=8, heads=4, kv_heads=2, head_dim=16, dtype_bytes=4)
    engine = plan_pools(shape, context=4, max_running=1, chunk=512, page_size=16, memory="48KiB", device="cpu",
                        prefix_cache=True)
    assert (engine.size, engine.size_swa, engine.max_running) == (16, 48, 1)
    code, out, err = _run_cli("plan", "--layers", "4", "--pattern", "sf", "--window", "8", "--heads", "4",
                              "--kv-heads", "2", "--head-dim", "16", "--kv-dtype", "fp32", "--memory", "48KiB",
                              "--context", "4", "--chunk", "512", "--max-running", "1", "--json")
    assert code == 0, (code, err)
    data = json.loads(out)
    assert (data["full_pool_tokens"], data["swa_pool_tokens"], data["max_running"]) == (16, 48, 1)


# ---- 2. `hwkv plan` refuses the all-SWA models the engine plans and runs --------------------------------------------

def test_hwkv_plan_plans_an_all_swa_model_as_the_engine_does(plenty_of_memory):
    """Defect: README ("Hugging Face models") runs Mistral-style all-SWA models (every layer sliding) and says the
    pools are sized "with `hwkv plan`'s planner"; the engine does plan them (hwkv/engine/pools.py:131-132 and
    140ff, `_all_swa_plan`: the full pool holds locs only). `hwkv plan` refuses every such shape: `hwkv plan --layers 4
    --pattern ssss ...` exits 2 with "plan needs at least one full-attention layer (the full pool holds the locs)"
    (hwkv/engine/plan.py:155-156; plan_cli.py:53 calls `plan` directly). Expected: the engine's plan for it (here
    4 requests, 336 SWA slots), or at least the same numbers the runner would use."""
    from hwkv.engine.pools import plan_pools
    from hwkv.engine.presets import custom_shape

    shape = custom_shape(layers=4, pattern="ssss", window=8, heads=4, kv_heads=2, head_dim=16)
    engine = plan_pools(shape, context=64, max_running=4, chunk=16, page_size=16, memory="1MiB", device="cpu",
                        prefix_cache=True)
    assert (engine.max_running, engine.size_swa) == (4, 336)
    code, out, err = _run_cli("plan", "--layers", "4", "--pattern", "ssss", "--window", "8", "--heads", "4",
                              "--kv-heads", "2", "--head-dim", "16", "--memory", "1MiB", "--context", "64",
                              "--chunk", "16", "--max-running", "4", "--json")
    assert code == 0, (code, err)
    data = json.loads(out)
    assert (data["max_running"], data["swa_pool_tokens"]) == (engine.max_running, engine.size_swa)


# ---- 3. `hwkv generate` lets flag values through its up-front check that the run then refuses -----------------------

@pytest.mark.parametrize("flags, named", [
    (["--temperature", "1e39"], "--temperature"),
    (["--draft", "prompt-lookup", "--num-draft", str(2**63)], "--num-draft"),
])
def test_generate_refuses_out_of_range_flags_before_the_model_loads(no_model_load, tmp_path, flags, named):
    """Defect: `hwkv generate`'s `_check_args` (hwkv/integrations/generate_cli.py:94-123) promises to "refuse bad
    flag values before the model loads (seconds), each naming the flag, its value and the limit", but its limits are
    looser than the ones the run applies: --temperature only has to be finite (line 106) while SamplingParams takes
    at most float32's largest (hwkv/engine/sampling.py:41: 1e39 is refused), and --num-draft only >= 1 (line 101)
    while the engine takes < 2**63 (hwkv/engine/inputs.py:105). Both values therefore pass the check, the model
    loads, and only then comes
    "temperature must be a number in [0, 3.4028234663852886e+38] ..." / "speculative verify needs num_draft to be an
    integer >= 1 and < 2**63 ...", naming the library's parameter rather than the flag. Shown here with a model
    folder that does not exist: the user is told about the folder, not the bad flag (the flag check never fired).
    Expected: exit 2 before the model loads, one line naming the flag as typed and the limit (as for
    `--temperature -1`: "--temperature must be a finite number >= 0 ...")."""
    code, out, err = _run_cli("generate", "--no-progress", "--model", str(tmp_path / "missing"), "--prompt", "1,2,3",
                              *flags)
    assert code == 2 and out == "", (code, err)
    assert "cannot load model" not in err, err
    assert named in err, err


# ---- 4. the serve workload's float flags are named by their field, not the flag -------------------------------------

@pytest.mark.parametrize("flags, named", [
    (["--serve-shared", "2"], "--serve-shared"),
    (["--serve-rate", "-1"], "--serve-rate"),
    (["--serve-prompt-len", "64", "--serve-system-len", "100"], "--serve-system-len"),
])
def test_bench_serve_names_the_flag_it_refuses(no_model_load, flags, named):
    """Defect (the class review 31/bad-inputs row 235 fixed for every integer flag's minimum): `hwkv bench --workload
    serve --serve-shared 2` says "serve workload: shared must be in [0.0, 1.0], got 2.0", `--serve-rate -1` "rate must
    be in [0.0, inf]", `--serve-system-len 100 --serve-prompt-len 64` "system_len must be in [0, prompt_len=64)":
    the dataclass fields of hwkv/bench/serve.py:55-65, which no command-line user types (the same workload's
    too-slow rate does say "(--serve-rate)", serve.py:89ff). Expected: the flag as typed, e.g. "--serve-shared must
    be in [0, 1], got 2.0", as `hwkv bench` names every other refused flag."""
    code, out, err = _run_cli("bench", "--workload", "serve", *flags)
    assert code == 2 and out == "", (code, err)
    assert named in err, err
