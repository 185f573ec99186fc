"""Review 31: the Hugging Face transformers integration (`hwkv.integrations`: runner, hf_model, generate_cli) as an
inference-engine engineer drives it: greedy tokens equal to transformers' own `generate()`, typed refusals that
change nothing, and a `hwkv generate` command line that never ends in a traceback.

The tests marked "defect" fail on the code this review read; each docstring names the defect, what was expected
and what happened. The last tests pin behaviour that held under a wide sweep (archs x windows x page sizes x
chunks x prefix cache x repeated generate, staggered adds, aborts, stop tokens, small budgets), so it keeps holding.
"""
from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import List

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is in hwkv's test extra")

from hwkv import cli  # noqa: E402
from hwkv.errors import ConfigError, OutOfSlotsError  # noqa: E402
from hwkv.integrations.generate_cli import parse_token_ids  # noqa: E402
from hwkv.integrations.transformers import HybridRunner, SamplingParams  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.3,
            tie_word_embeddings=False, eos_token_id=None, pad_token_id=None, bos_token_id=None)


def _hf_greedy(model, prompt: List[int], new: int) -> List[int]:
    """transformers' own generate(), greedy, one prompt (an explicit all-ones mask: no padding)."""
    gen = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                         max_new_tokens=new, do_sample=False, pad_token_id=0)
    return gen[0, len(prompt):].tolist()


def _cli(*argv: str):
    """`hwkv generate ARGV` in-process: (exit code, stdout, stderr). An exception escaping cli.main (what a user sees
    as a traceback) propagates to the test."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["generate", "--no-progress", *argv])
    return code, out.getvalue(), err.getvalue()


def _tiny_gemma4(global_head_dim: int, **extra):
    """A tiny Gemma 4 text model: sliding and full layers, the full ones with their own head_dim (as every released
    Gemma 4 has: head_dim 256 sliding, global_head_dim 512 full), which transformers keeps as a per-layer config."""
    cfg = transformers.Gemma4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=global_head_dim, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], vocab_size_per_layer_input=128,
        hidden_size_per_layer_input=8, max_position_embeddings=256, initializer_range=0.3,
        eos_token_id=None, pad_token_id=None, bos_token_id=None, **extra)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32,
                                                         attn_implementation="eager").eval()


needs_gemma4 = pytest.mark.skipif(not hasattr(transformers, "Gemma4TextConfig"),
                                  reason="this transformers has no Gemma 4 model")


# ---- defects --------------------------------------------------------------------------------------------------------

@needs_gemma4
@pytest.mark.parametrize("k_eq_v", [False, True], ids=["kv", "k_eq_v"])
def test_a_gemma4_model_is_served(k_eq_v):
    """Defect (fixed): `HybridRunner(gemma4_model)` raised transformers' AmbiguousGlobalPerLayerAttributeError (a
    RuntimeError), not an hwkv error. Gemma 4 keeps head_dim (and with attention_k_eq_v the KV heads) per layer;
    `hf_model._positive` read `getattr(cfg, "head_dim", None)` from the global config, whose attribute access raises
    for a per-layer field, and getattr only swallows AttributeError. Now the full layers' geometry is ModelShape's
    head_dim / num_kv_heads and the sliding ones' swa_head_dim / swa_num_kv_heads: transformers' greedy tokens, and the
    model keeps its own attention afterwards."""
    kv = dict(attention_k_eq_v=True, num_global_key_value_heads=1) if k_eq_v else {}
    model = _tiny_gemma4(global_head_dim=32, **kv)
    prompts = [[5, 9, 17, 33, 2, 71, 40, 11, 3, 90, 64], [7, 8, 9], list(range(20, 40))]
    want = [_hf_greedy(model, p, 4) for p in prompts]
    with HybridRunner(model, max_running=3, chunk=8, page_size=4, context=32) as runner:
        shape = runner.shape
        assert (shape.head_dim, shape.swa_head_dim) == (32, 16)
        assert (shape.num_kv_heads, shape.swa_num_kv_heads) == ((1, 2) if k_eq_v else (2, 2))
        got = [r.tokens for r in runner.generate(prompts, SamplingParams(max_new_tokens=4))]
    assert got == want
    assert model.config._attn_implementation == "eager"


@needs_gemma4
def test_hwkv_generate_on_a_gemma4_folder_ends_without_a_traceback(tmp_path):
    """Defect: `hwkv generate --model <a Gemma 4 folder>` ends in a traceback (AmbiguousGlobalPerLayerAttributeError
    out of HybridRunner.__init__ -> model_shape -> hf_model._positive, hf_model.py:58), exit code 1. cli.main catches
    only HwkvError and OSError. Expected: tokens (exit 0) or one 'hwkv generate: error: ...' line (exit 2)."""
    folder = tmp_path / "tiny-gemma4"
    _tiny_gemma4(global_head_dim=32).save_pretrained(folder)
    code, _, err = _cli("--model", str(folder), "--prompt", "1,2,3", "--max-new-tokens", "2")
    assert code in (0, 2)
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory) -> Path:
    """A tiny GPT-2: learned absolute positions, n_positions = 16."""
    folder = tmp_path_factory.mktemp("tiny-gpt2")
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2, n_positions=16,
                                  bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    return folder


def test_hwkv_generate_past_the_models_positions_is_refused_not_a_traceback(tiny_gpt2):
    """Defect: `hwkv generate` on a model with learned positions (GPT-2, n_positions 16) with a 12-token prompt and
    --max-new-tokens 8 ends in an IndexError traceback from the position embedding (exit code 1). The CLI sizes the
    context as the longest prompt + max_new_tokens - 1 (generate_cli.py:218-219) with no cap at the model's
    max_position_embeddings, and HybridRunner accepts an explicit context past it (runner.py:71-72 caps only its own
    default), so position 16 reaches the model. A runner built with the default context refuses the same request with
    OutOfSlotsError (context 16). Expected: exit 2 with that prompt's typed error, no traceback."""
    prompt = ",".join(str(i) for i in range(1, 13))
    code, _, err = _cli("--model", str(tiny_gpt2), "--prompt", prompt, "--max-new-tokens", "8")
    assert code == 2
    assert "Traceback" not in err and "error" in err


def test_a_token_id_of_more_than_4300_digits_is_a_config_error():
    """Defect: `parse_token_ids` (the token-id prompt of `hwkv generate`) passes an item of 5000 digits to int(),
    which raises Python's ValueError "Exceeds the limit (4300 digits) for integer string conversion"
    (generate_cli.py:79): `hwkv generate --prompt 111...1` ends in a traceback after the model loaded. Expected: the
    ConfigError it gives any other id outside the vocabulary (exact type: ConfigError subclasses ValueError)."""
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        parse_token_ids("1" * 5000, 128)


@pytest.fixture(scope="module")
def tiny_gemma2_with_tokenizer(tmp_path_factory) -> Path:
    """A tiny Gemma 2 (W=8) folder with a word-level tokenizer: 'w0' .. 'w59'."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("tiny-gemma2-tok")
    cfg = transformers.Gemma2Config(**TINY, sliding_window=8, query_pre_attn_scalar=32, attn_logit_softcapping=5.0)
    torch.manual_seed(2)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(60)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(folder)
    return folder


def test_a_prompt_that_is_not_utf8_is_refused_not_a_traceback(tiny_gemma2_with_tokenizer):
    """Defect: a text prompt holding bytes that are not UTF-8 (a Latin-1 terminal's 'café': Python hands it over as
    the lone surrogate '\\udce9') makes `tokenizer.encode(p)` raise TypeError ("TextEncodeInput must be ...") at
    generate_cli.py:211, outside any handler: `hwkv generate` ends in a traceback (exit code 1). Expected: exit 2
    with a typed error naming the prompt (as a token-id prompt with the same byte gets: "prompt item '\\udce9' is not
    a token id")."""
    code, _, err = _cli("--model", str(tiny_gemma2_with_tokenizer), "--prompt", "w5 caf\udce9 w9",
                        "--max-new-tokens", "2")
    assert code == 2
    assert "Traceback" not in err


def test_an_empty_text_prompt_with_one_new_token_is_refused_as_an_empty_prompt(tiny_gemma2_with_tokenizer):
    """Defect: with a tokenizer, `hwkv generate --prompt '' --max-new-tokens 1` says "context must be an integer >= 1,
    got 0": the CLI derives the context from the longest prompt + max_new_tokens - 1 = 0 (generate_cli.py:218-219)
    and HybridRunner refuses that, so the user is told about a --context they never gave. With --max-new-tokens 2 the
    same prompt gets "ConfigError: the prompt is empty". Expected: the refusal names the empty prompt."""
    code, out, err = _cli("--model", str(tiny_gemma2_with_tokenizer), "--prompt", "", "--max-new-tokens", "1")
    assert code == 2
    assert "empty" in err + out, err



def test_a_non_ascii_prompt_on_an_ascii_stdout_ends_without_a_traceback(tiny_gemma2_with_tokenizer):
    """Defect: with stdout in an encoding that cannot hold the prompt (PYTHONIOENCODING=ascii, a Latin-1 pipe),
    `hwkv generate --prompt 'w5 \u00e9 w9'` ends in a UnicodeEncodeError traceback (exit code 1): `_print_plain` prints
    the prompt's repr, which keeps the non-ASCII character (generate_cli.py:284),
    and cli.main turns only OSError write failures into its one-line error (UnicodeEncodeError is a ValueError).
    Expected: the line written with the character escaped, or one 'hwkv generate: error: cannot write the output'
    line and exit 2."""
    raw = io.BytesIO()
    stdout = io.TextIOWrapper(raw, encoding="ascii", errors="strict")
    err = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(err):
        code = cli.main(["generate", "--no-progress", "--model", str(tiny_gemma2_with_tokenizer),
                         "--prompt", "w5 \u00e9 w9", "--max-new-tokens", "2"])
    assert code in (0, 2)

# ---- behaviour that held (pinned) -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma2_w8():
    cfg = transformers.Gemma2Config(**TINY, sliding_window=8, query_pre_attn_scalar=32, attn_logit_softcapping=5.0)
    torch.manual_seed(2)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()


def test_greedy_tokens_equal_transformers_at_window_and_page_boundaries_with_shared_prefixes(gemma2_w8):
    """Held: prompts of 1, W-1, W, W+1, 2W, page boundaries and a shared prefix with a divergent tail, in one batch,
    chunked (3 tokens), page sizes 1/4/8, prefix cache on and off, generate() twice on one runner (the second round
    served from the cache), max_new_tokens 1 and 6: transformers' greedy tokens, and the pools hold nothing but the
    cache's afterwards."""
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, 128, (40,), generator=g).tolist()
    prompts = [base[:n] for n in (1, 7, 8, 9, 16, 17)] + [base[:12] + [3, 4, 5]]
    want = {new: [_hf_greedy(gemma2_w8, p, new) for p in prompts] for new in (1, 6)}
    for page_size, prefix_cache in ((1, True), (4, True), (8, False)):
        with HybridRunner(gemma2_w8, max_running=3, chunk=3, page_size=page_size, context=48,
                          prefix_cache=prefix_cache) as runner:
            for new in (6, 1, 6):
                got = [r.tokens for r in runner.generate(prompts, SamplingParams(max_new_tokens=new))]
                assert got == want[new], (page_size, prefix_cache, new)
                runner.check_integrity()
            held = runner.cache.held_slots()
            assert held == ((runner.prefix.full_tokens, runner.prefix.swa_tokens) if runner.prefix else (0, 0))


def test_bad_requests_are_typed_name_the_value_and_limit_and_change_nothing(gemma2_w8):
    """Held: an empty prompt, a token id past the vocabulary, max_new_tokens 0 / -1 and a request past the context are
    typed hwkv errors naming the value and the limit; add_request refuses them before queueing, generate() reports
    them in their own Result while the good prompt runs; the allocator, request rows and prefix cache are as before."""
    with pytest.raises(ConfigError, match="max_new_tokens must be an integer >= 1, got 0"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ConfigError, match="got -1"):
        SamplingParams(max_new_tokens=-1)
    want = _hf_greedy(gemma2_w8, [4, 5, 6], 7)
    with HybridRunner(gemma2_w8, max_running=2, chunk=8, page_size=4, context=16) as runner:
        runner.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))  # something in the prefix cache
        before = (runner.cache.held_slots(), runner.cache.rtt.available_size(), runner._next_rid)
        with pytest.raises(ConfigError, match="empty"):
            runner.add_request([])
        with pytest.raises(ConfigError, match=r"token id 128 is outside the vocabulary \[0, 128\)"):
            runner.add_request([1, 128])
        with pytest.raises(OutOfSlotsError, match="prompt 10 \\+ max_new_tokens 8 needs 17 KV slots.*at most 16"):
            runner.add_request(list(range(10)), SamplingParams(max_new_tokens=8))
        assert (runner.cache.held_slots(), runner.cache.rtt.available_size(), runner._next_rid) == before
        assert not runner.has_work()
        runner.check_integrity()
        res = runner.generate([[], [1, 200], list(range(12)), [4, 5, 6]], SamplingParams(max_new_tokens=7))
        assert [type(r.error) for r in res[:3]] == [ConfigError, ConfigError, OutOfSlotsError]
        assert res[3].error is None and res[3].tokens == want
        runner.check_integrity()

