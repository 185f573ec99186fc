"""Review 31 (newcomer pass): defects a first-time user of hwkv hits by following README.md and docs/.

Every test here fails on the code as reviewed; each docstring names the defect, what was expected and what happened,
and where. CPU only, tiny models built offline.
"""
from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from test_review35_newcomer import _run_cli  # noqa: E402 (`hwkv ARGV` in-process)
from test_review31_transformers import tiny_gpt2  # noqa: E402,F401 (the fixture: GPT-2, 16 learned positions)
from hwkv.errors import ConfigError  # noqa: E402


def test_hybrid_runner_with_an_explicit_context_past_the_models_positions_raises_a_bare_index_error(tiny_gpt2):
    """Defect: `HybridRunner(model, context=64)` over a model with 16 learned positions (GPT-2) accepts the context,
    admits a 12-token prompt with max_new_tokens 8 and then the model's position table raises a bare
    `IndexError: index out of range in self` from inside `generate` (torch.nn.functional.embedding). Only the
    runner's *default* context is capped at `max_position_embeddings` (hwkv/integrations/runner.py:70-71); an
    explicit `context=` is taken as is and sized into the pools (runner.py:73-74). README ("A runner ... raises
    `OutOfSlotsError` from `add_request` (in `generate` it lands in that request's `Result.error`)", docs/bad-inputs.md
    row 225) promise a typed refusal. Expected: a typed hwkv error, either at construction (a context past the
    model's positions) or as the request's `Result.error`; actual: IndexError escapes `generate`."""
    from hwkv.integrations.transformers import HybridRunner, load_model

    model = load_model(str(tiny_gpt2))
    attention = model.config._attn_implementation
    with pytest.raises(ConfigError, match=r"context=64 is past the model's 16 positions \(max_position_embeddings, a "
                       r"learned position table\)"):
        HybridRunner(model, max_running=2, context=64, graphs="off")
    assert model.config._attn_implementation == attention  # refused before the model was touched
    HybridRunner(model, max_running=2, context=16, graphs="off").close()  # the model's own length is taken


def test_hwkv_generate_with_an_explicit_context_past_the_models_positions_is_a_traceback(tiny_gpt2):
    """Defect: `hwkv generate --model <GPT-2, 16 positions> --prompt 1,...,12 --max-new-tokens 8 --context 64` ends
    in an `IndexError: index out of range in self` traceback (exit code 1). Review 31's fix caps only the *derived*
    context at the model's positions (hwkv/integrations/generate_cli.py:228-229: `args.context if args.context is not
    None else min(longest, positions ...)`); an explicit --context reaches HybridRunner, which does not check it
    against max_position_embeddings either (runner.py:70-74). Expected (docs/bad-inputs.md preamble, row 225): one
    'hwkv generate: error: ...' line per refused prompt and exit 2 (or a usage error naming --context and the
    model's 16 positions); actual: a traceback."""
    code, _, err = _run_cli("generate", "--no-progress", "--model", str(tiny_gpt2), "--prompt",
                            ",".join(str(i) for i in range(1, 13)), "--max-new-tokens", "8", "--context", "64")
    assert code == 2, (code, err[-300:])
    assert "Traceback" not in err and "context=64 is past the model's 16 positions" in err


def test_hwkv_bench_serve_on_a_model_with_few_positions_is_a_traceback(tiny_gpt2):
    """Defect: `hwkv bench --workload serve --serve-model <GPT-2 folder, 16 positions>` (README: "`--serve-model
    PATH`" takes any local model folder) ends in an `IndexError: index out of range in self` traceback: the serve
    workload sizes HybridRunner for `--serve-prompt-len` (64 on CPU) + `--serve-new` tokens
    (hwkv/bench/serve.py:198, and its pre-check `check_pools_fit`, serve.py:108-117, asks only whether the pools fit;
    `context=w.context`) without looking at the model's max_position_embeddings, and HybridRunner takes the context
    unchecked (runner.py:70-74). Expected: exit 2 with one line naming the model's 16 positions (docs/bad-inputs.md:
    "2 for a usage, configuration or capacity error"); actual: a traceback (exit 1)."""
    code, _, err = _run_cli("bench", "--workload", "serve", "--serve-model", str(tiny_gpt2), "--serve-requests", "2",
                            "--serve-rate", "0", "--no-baseline")
    assert code == 2, (code, err[-300:])
    assert "Traceback" not in err and "past the model's 16 positions" in err


@pytest.mark.parametrize("flag, value, lo", [("--max-running", "0", 1), ("--chunk", "0", 1), ("--page-size", "0", 1),
                                             ("--context", "0", 1), ("--eviction-margin-pages", "-1", 0)])
def test_hwkv_plan_names_the_flag_not_the_planners_parameter(flag, value, lo):
    """Defect (reviewer's note): `hwkv plan --max-running 0` said `max_running must be an integer >= 1 or None, got 0`
    (the planner's parameter, and a None no command-line user can give) where `hwkv generate` says `--max-running
    must be >= 1, got 0`; --chunk, --page-size, --context and --eviction-margin-pages likewise. Now one check of
    the flags (`hwkv.engine.plan.check_flag_minimums`) serves both commands."""
    argv = ["plan", "--model", "gpt-oss-20b", "--memory", "8GiB", "--context", "4096", flag, value]
    code, out, err = _run_cli(*argv)
    assert code == 2 and out == ""
    assert err.strip() == f"hwkv plan: error: {flag} must be >= {lo}, got {value}"
