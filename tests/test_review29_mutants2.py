"""Review 29, second part (test-suite audit by mutation): single-line mutants of hwkv/integrations/hf_model.py,
device_choice.py, transformers.py and generate_cli.py that the rest of the suite let through, each pinned here by a
small deterministic CPU test that passes on the code as it is and fails with the mutant applied (each test's docstring
names its mutant as `module:line  original -> mutant`). Ten of the generate_cli mutants (the conversation,
seeding, budget-flag and exit-code ones) were not run against the rest of the suite before these tests were written:
those tests may overlap tests/test_cli_errors.py and tests/test_review25_cli.py.
"""
from types import SimpleNamespace

import pytest
import torch

from hwkv.errors import ConfigError
from hwkv.integrations.hf_model import layer_kinds, model_shape

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(**over):
    """A config as hf_model reads it (attributes only): 2 layers, 4 heads, 2 KV heads, head_dim 8, no window."""
    base = dict(model_type="toy", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                hidden_size=32, sliding_window=None)
    base.update(over)
    return SimpleNamespace(**base)


# ------------------------------------------------------------------------------------------------- hf_model.py
def test_model_shape_reads_a_multimodal_configs_text_part():
    """hf_model.py:26  `get() if callable(get) else config` -> `config`. A multimodal config (whose decoder is
    `get_text_config()`) was read through its own attributes; every config the suite used was a text one."""
    inner = _cfg(layer_types=["full_attention", "sliding_attention"], sliding_window=16)
    outer = SimpleNamespace(model_type="toy_vl", get_text_config=lambda: inner)
    assert layer_kinds(outer) == (False, True)
    shape = model_shape(outer, torch.float32)
    assert (shape.num_kv_heads, shape.head_dim, shape.window) == (2, 8, 16)


def test_layer_types_shorter_than_the_layers_is_refused():
    """hf_model.py:41  `len(types) != n` -> `len(types) > n`. A `layer_types` with fewer entries than
    num_hidden_layers gave layer kinds for fewer layers than the model runs; only a longer list was tried."""
    with pytest.raises(ConfigError, match="layer_types has 1 entries, num_hidden_layers is 2"):
        layer_kinds(_cfg(layer_types=["full_attention"]))


@pytest.mark.parametrize("window", [None, 0])
def test_sliding_layer_types_without_a_window_are_refused(window):
    """hf_model.py:43  `if SLIDING in types and not window:` -> `... and False`. Sliding layers with no window were
    taken as sliding (their pool sized for a window of 0 or None) instead of refused."""
    with pytest.raises(ConfigError, match="names sliding layers but sliding_window is"):
        layer_kinds(_cfg(layer_types=["full_attention", "sliding_attention"], sliding_window=window))


@pytest.mark.parametrize("name, value", [("num_key_value_heads", 0), ("head_dim", True), ("head_dim", 0)])
def test_model_shape_refuses_a_zero_or_boolean_geometry_field(name, value):
    """hf_model.py:61  `value < 1` -> `value < 0`, and `isinstance(value, bool) or ` dropped. A 0 (or True) read as
    "absent" (`_positive(...) or default`) or as 1, and the pools took the default geometry silently."""
    with pytest.raises(ConfigError, match=f"config {name}={value!r}: expected an integer >= 1"):
        model_shape(_cfg(**{name: value}), torch.float32)


def test_model_shape_defaults_kv_heads_to_the_heads_and_head_dim_to_hidden_over_heads():
    """hf_model.py:75  `or heads` -> `or 1`; hf_model.py:76  `cfg.hidden_size // heads` -> `// kv_heads`. A config
    with no num_key_value_heads (MHA) or no head_dim took the wrong default; every config the suite read named both."""
    shape = model_shape(_cfg(num_key_value_heads=None, head_dim=None), torch.float32)
    assert (shape.num_kv_heads, shape.head_dim) == (4, 8)
    shape = model_shape(_cfg(head_dim=None), torch.float32)
    assert (shape.num_kv_heads, shape.head_dim) == (2, 8)


@pytest.mark.parametrize("dtype, size", [(torch.float32, 4), (torch.bfloat16, 2), (torch.float64, 8)])
def test_model_shape_names_itself_and_sizes_kv_by_the_dtype(dtype, size):
    """hf_model.py:89  `name=name or model_type` -> `name=model_type`; hf_model.py:92  `dtype_bytes=...element_size()`
    -> `dtype_bytes=2`. The name given was dropped, and an fp32 model's KV was planned at bf16's 2 bytes an element
    (half the memory its pools take); the suite read bf16 shapes and the default name only."""
    assert model_shape(_cfg(), dtype, name="mine").name == "mine"
    assert model_shape(_cfg(), dtype).name == "toy"
    assert model_shape(_cfg(), dtype).dtype_bytes == size


# -------------------------------------------------------------------------------------------- device_choice.py
def _spec(name, torch_device="meta", priority=0, reason=None, adapter=""):
    from hwkv.devices import DeviceSpec

    return DeviceSpec(name=name, priority=priority, probe=lambda: reason, backend="hwkv.backend:Nope",
                      graph_adapter=adapter, torch_device=torch_device, description="a stand-in")


def _devices(monkeypatch, current, *others):
    """hwkv.devices as device_choice sees it: `current` detected, `others` beside it."""
    from hwkv.integrations import device_choice

    every = {s.name: s for s in (current, *others)}
    monkeypatch.setattr(device_choice.devices, "current_device", lambda: current)
    monkeypatch.setattr(device_choice.devices, "discover", lambda only=None: dict(every))
    monkeypatch.setattr(device_choice.devices, "by_name", lambda name: every[name])
    return device_choice


def test_available_spec_refuses_a_named_device_that_is_unavailable(monkeypatch):
    """device_choice.py:21  `if reason is not None:` -> `if False:`. `hwkv generate/bench/verify --device X` took a
    device whose probe said it is unavailable, failing later (or never) instead of saying why up front."""
    from hwkv.errors import DeviceError

    dc = _devices(monkeypatch, _spec("here", "cpu"), _spec("gone", reason="no driver"))
    assert dc.available_spec(None).name == "here"
    assert dc.available_spec("here").name == "here"
    with pytest.raises(DeviceError, match="device 'gone' is unavailable: no driver"):
        dc.available_spec("gone")


def test_resolve_spec_picks_the_highest_priority_available_plugin_of_the_models_device(monkeypatch):
    """device_choice.py:34  `s.torch_device == torch_device and s.is_available()` (either term dropped) and
    device_choice.py:37  `max(matching, ...)` -> `min(...)`. With the detected plugin on another device type, the
    fallback among several plugins was never exercised: an unavailable one, one of another device type or the
    lowest-priority one could be chosen."""
    from hwkv.errors import DeviceError

    dc = _devices(monkeypatch, _spec("here", "cpu"), _spec("low", priority=1), _spec("high", priority=5),
                  _spec("best_but_gone", priority=9, reason="no driver"), _spec("other", "xpu", priority=20))
    assert dc.resolve_spec(None, "meta").name == "high"
    assert dc.resolve_spec(None, "cpu").name == "here"
    with pytest.raises(DeviceError, match="no available device plugin runs on 'mps' tensors"):
        dc.resolve_spec(None, "mps")


def test_resolve_spec_refuses_a_named_plugin_of_another_device_type_or_unavailable(monkeypatch):
    """device_choice.py:38  `if spec.torch_device != torch_device:` -> `if False:`; device_choice.py:42  `if reason
    is not None:` -> `if False:`. A model on one device type ran through a plugin named for another, or through an
    unavailable one."""
    from hwkv.errors import DeviceError

    dc = _devices(monkeypatch, _spec("here", "cpu"), _spec("meta_ok"), _spec("meta_gone", reason="no driver"))
    assert dc.resolve_spec("meta_ok", "meta").name == "meta_ok"
    with pytest.raises(DeviceError, match="device 'here' runs on 'cpu' tensors, the model is on 'meta'"):
        dc.resolve_spec("here", "meta")
    with pytest.raises(DeviceError, match="device 'meta_gone' is unavailable: no driver"):
        dc.resolve_spec("meta_gone", "meta")


def test_graph_choice_maps_booleans_and_refuses_other_words():
    """device_choice.py:49  `("on" if graphs else "off")` -> `("off" if graphs else "on")`; device_choice.py:50  `if
    choice not in GRAPH_CHOICES:` -> `if False:`. graphs=True/False were read backwards, or a misspelt choice ran
    as eager decode."""
    from hwkv.integrations.device_choice import graph_choice

    assert (graph_choice(True), graph_choice(False), graph_choice("eager")) == ("on", "off", "eager")
    with pytest.raises(ConfigError, match="graphs='yes'; choose one of auto, on, off, eager"):
        graph_choice("yes")


def test_graph_adapter_per_choice_and_device():
    """device_choice.py:64  `(choice == "auto" and spec.torch_device == "cpu")` (either way), :66  `"eager"` -> `"on"`,
    :71  `if cls is None:` -> `if cls is not None:`, :72  `if choice == "auto":` -> `"on"`. Which adapter each
    graphs= choice gets on a device with and without a graph adapter, and on the CPU."""
    from hwkv.graph import EagerAdapter
    from hwkv.integrations.device_choice import graph_adapter

    cpu, bare = _spec("c", "cpu", adapter="hwkv.graph:EagerAdapter"), _spec("bare")
    dev = _spec("dev", adapter="hwkv.graph:EagerAdapter")
    assert graph_adapter(cpu, "auto") is None and graph_adapter(dev, "off") is None
    assert graph_adapter(bare, "auto") is None
    with pytest.raises(ConfigError, match="device 'bare' has no graph adapter"):
        graph_adapter(bare, "on")
    for spec, choice in ((dev, "auto"), (dev, "on"), (cpu, "on"), (bare, "eager"), (cpu, "eager")):
        assert type(graph_adapter(spec, choice)) is EagerAdapter, (spec.name, choice)


# ------------------------------------------------------------------------------------------------ transformers.py
def _hf_cache(root, repo="org/tiny", commit="c0ffee", files=("config.json",), no_exist=()):
    """A local Hugging Face cache under `root` holding `files` (and `.no_exist` markers) of `repo` at `commit`, the
    ref main pointing at it."""
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    for f in files:
        (repo_dir / "snapshots" / commit / f).parent.mkdir(parents=True, exist_ok=True)
        (repo_dir / "snapshots" / commit / f).write_text("{}")
    for f in no_exist:
        (repo_dir / ".no_exist" / commit / f).parent.mkdir(parents=True, exist_ok=True)
        (repo_dir / ".no_exist" / commit / f).write_text("")
    (repo_dir / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
    return str(root)


def test_cache_miss_reads_the_cache_the_call_names(tmp_path):
    """transformers.py:46  `isinstance(found, str)` -> `found is not None`. The cache's "no such file" marker
    (huggingface_hub's _CACHED_NO_EXIST, left where a file was looked for and absent) was taken for a cached
    config.json, so the look into the cache let an unloadable name through to transformers. (The call's cache_dir,
    revision and subfolder, tried here beside it, are pinned by test_review22_gpu_runs too.)"""
    pytest.importorskip("huggingface_hub")
    from hwkv.integrations.transformers import _cache_miss

    cache = _hf_cache(tmp_path / "a")
    assert _cache_miss("org/tiny", {"cache_dir": cache}) is None
    assert _cache_miss("org/tiny", {"cache_dir": cache, "revision": "main"}) is None
    assert isinstance(_cache_miss("org/tiny", {"cache_dir": cache, "revision": "other"}), FileNotFoundError)
    sub = _hf_cache(tmp_path / "b", files=("llm/config.json",))
    assert _cache_miss("org/tiny", {"cache_dir": sub, "subfolder": "llm"}) is None
    assert isinstance(_cache_miss("org/tiny", {"cache_dir": sub}), FileNotFoundError)
    marked = _hf_cache(tmp_path / "c", files=(), no_exist=("config.json",))
    assert isinstance(_cache_miss("org/tiny", {"cache_dir": marked}), FileNotFoundError)


def test_load_model_refuses_a_dtype_that_is_not_floating_or_no_torch_device():
    """transformers.py:58  `if dtype not in DTYPES:` -> `if False:` (an unknown dtype name escaped as a bare
    KeyError); :61  ` and dtype.is_floating_point` dropped (an integer dtype went to from_pretrained);
    :62  the message said "is not a dtype" of a torch dtype; :66  `(RuntimeError, TypeError, ValueError)` ->
    `(RuntimeError, ValueError)` (a device of the wrong type escaped as a bare TypeError)."""
    pytest.importorskip("transformers")
    from hwkv.errors import DeviceError
    from hwkv.integrations.transformers import load_model

    with pytest.raises(ConfigError, match="dtype 'fp8'; choose one of fp32, bf16, fp16"):
        load_model("/nonexistent/hwkv-model", dtype="fp8")
    with pytest.raises(ConfigError, match=r"dtype=torch.int32 is not a floating-point dtype"):
        load_model("/nonexistent/hwkv-model", dtype=torch.int32)
    with pytest.raises(ConfigError, match=r"dtype=3 is not a dtype"):
        load_model("/nonexistent/hwkv-model", dtype=3)
    with pytest.raises(DeviceError, match="is not a torch device"):
        load_model("/nonexistent/hwkv-model", device=1.5)


def test_load_model_passes_hwkv_errors_through_and_names_the_first_line_of_others(tmp_path, monkeypatch):
    """transformers.py:81  `except HwkvError:` -> `except ZeroDivisionError:` (an hwkv error raised while loading
    was rewrapped as a ConfigError), :97  `lines[0]` -> `lines[-1]` (the error named its last line, not its first)."""
    transformers = pytest.importorskip("transformers")
    from hwkv.errors import DeviceError
    from hwkv.integrations.transformers import load_model

    def refuse(*a, **k):
        raise error

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    error = DeviceError("from hwkv")
    with pytest.raises(DeviceError, match="from hwkv"):
        load_model(str(tmp_path))
    error = ValueError("\n  first line\nsecond line\n")
    with pytest.raises(ConfigError, match=r"cannot load model '.*': first line$"):
        load_model(str(tmp_path))


def test_load_model_expands_the_home_folder_and_takes_the_configs_dtype(tmp_path, monkeypatch):
    """transformers.py:72  `os.path.exists(os.path.expanduser(name))` -> `os.path.exists(name)` (a '~/model' folder was
    looked up in the Hugging Face cache and refused). The folder's bf16 model loads as bf16 (the config's dtype)."""
    from test_review29_mutants import _tiny_gpt_oss

    from hwkv.integrations.transformers import load_model

    _tiny_gpt_oss(positions=64).to(torch.bfloat16).save_pretrained(tmp_path / "m")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_model("~/m").dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------------ generate_cli.py
def _args(*argv):
    import argparse

    from hwkv.integrations.generate_cli import add_generate_arguments

    p = argparse.ArgumentParser()
    add_generate_arguments(p)
    return p.parse_args(["--model", "/nonexistent/m", "--no-progress", *argv])


class _FakeRunner:
    """HybridRunner as `hwkv generate` drives it: records its options and each generate call; every prompt gets the
    tokens [7, 8] unless its first token is 63 (refused, as the engine refuses before queueing: rid -1)."""

    def __init__(self, model, **kw):
        self.kw, self.calls, self.graph, self.prefix = kw, [], None, None
        self.cache = SimpleNamespace(backend=object())
        self.stats = SimpleNamespace(as_dict=lambda: {}, memory_line=lambda: "", prefix_line=lambda: "",
                                     draft_line=lambda: "")
        _FakeRunner.last = self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def generate(self, prompts, params, on_step=None):
        from hwkv.engine.engine import Result

        params = params if isinstance(params, list) else [params] * len(prompts)
        self.calls.append(([list(p) for p in prompts], [p.seed for p in params]))
        return [Result(-1, p, error=ConfigError("request -1: refused")) if p[0] == 63 else
                Result(i, p, [7, 8], "length", seed=q.seed) for i, (p, q) in enumerate(zip(prompts, params))]


def _generate(monkeypatch, *argv, tokenizer=None):
    """`hwkv generate`'s _generate over the fake runner and a stand-in model of 64 tokens (eos ids 5 and 6)."""
    from hwkv.integrations import generate_cli, transformers as hwkv_transformers

    model = SimpleNamespace(get_output_embeddings=lambda: SimpleNamespace(weight=torch.empty(64, 1)),
                            generation_config=SimpleNamespace(eos_token_id=[5, 6]), dtype=torch.float32,
                            config=SimpleNamespace())  # (no max_position_embeddings: the context is not capped)
    monkeypatch.setattr(generate_cli, "_load", lambda args: (SimpleNamespace(name="cpu", torch_device="cpu"), model,
                                                             tokenizer))
    monkeypatch.setattr(hwkv_transformers, "HybridRunner", _FakeRunner)
    data, code = generate_cli._generate(_args(*argv))
    return data, code, _FakeRunner.last


def test_parse_token_ids_refuses_an_empty_prompt_a_sign_and_the_vocab_size():
    """generate_cli.py:68  `if not text.strip():` -> `if False:` (a blank prompt was called "an empty item");
    :76  `r"\\d+"` -> `r"-?\\d+"` (a negative id passed); :79  `>= vocab_size` -> `> vocab_size` (the id equal to the
    vocabulary size passed)."""
    from hwkv.integrations.generate_cli import parse_token_ids

    with pytest.raises(ConfigError, match="the prompt is empty"):
        parse_token_ids("  ", 10)
    with pytest.raises(ConfigError, match="prompt item '-1' is not a token id"):
        parse_token_ids("1,-1", 10)
    with pytest.raises(ConfigError, match=r"token id 10 is outside the vocabulary \[0, 10\)"):
        parse_token_ids("9,10", 10)
    assert parse_token_ids("0 9", 10) == [0, 9]


def test_stop_tokens_error_text_and_paths():
    """generate_cli.py:89  `tuple(eos)` -> `tuple(eos[:1])` (a list of eos ids stopped at the first only); :121
    `name.count("/") > 1` -> `> 2` ('a/b/c' taken for a Hub repo id, not a missing folder); :186  `res.rid < 0` -> `<= 0` (request 0's own "request 0: " prefix dropped)."""
    from hwkv.engine.engine import Result
    from hwkv.integrations import generate_cli as g

    assert g._stop_tokens(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[5, 6]))) == (5, 6)
    assert g._stop_tokens(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=5))) == (5,)
    g._check_args(_args("--prompt", "1", "--max-new-tokens", "1", "--max-running", "1", "--context", "1", "--chunk",
                        "1", "--page-size", "1", "--seed", "0"))
    assert g._looks_like_path("a/b/c") and not g._looks_like_path("org/name")
    assert g._error_text(Result(0, [1], error=ConfigError("request 0: too long"))) == \
        "ConfigError: request 0: too long"
    assert g._error_text(Result(-1, [1], error=ConfigError("request -1: too long"))) == "ConfigError: too long"


def test_load_takes_fp32_on_the_cpu(monkeypatch):
    """generate_cli.py:165  `("fp32" if spec.torch_device == "cpu" else None)` -> `None`: on the CPU the model loaded
    in its config's dtype (bf16, slow there) instead of fp32 as --dtype's help says."""
    from hwkv.integrations import device_choice, generate_cli

    seen = []
    monkeypatch.setattr(device_choice, "available_spec", lambda name: SimpleNamespace(name="cpu", torch_device="cpu"))
    monkeypatch.setattr(generate_cli, "check_model_path", lambda name: None)
    monkeypatch.setattr(generate_cli, "load_local_model", lambda name, dev, dtype, tokenizer: (seen.append(dtype), None))
    generate_cli._load(_args("--prompt", "1"))
    generate_cli._load(_args("--prompt", "1", "--dtype", "bf16"))
    assert seen == ["fp32", "bf16"]


def test_generate_seeds_sizes_and_caps_the_runner(monkeypatch):
    """generate_cli.py:214  `seed=args.seed + i` -> `seed=args.seed` (every prompt sampled the same stream); :218  `+
    args.max_new_tokens - 1` -> `+ args.max_new_tokens` (a context one token larger than any request needs); :222
    `min(args.max_running, most)` -> `args.max_running` (pools sized for more requests than there are prompts); :227
    `args.num_draft or NUM_DRAFT` -> `NUM_DRAFT` (--num-draft ignored)."""
    data, code, runner = _generate(monkeypatch, "--prompt", "1,2,3", "--prompt", "4", "--seed", "7",
                                   "--max-new-tokens", "5", "--max-running", "6", "--draft", "prompt-lookup",
                                   "--num-draft", "2")
    assert code == 0 and runner.calls[0][1] == [7, 8]
    assert (runner.kw["context"], runner.kw["max_running"], runner.kw["num_draft"]) == (3 + 5 - 1, 2, 2)


def test_generate_conversation_context_history_and_not_run_turns(monkeypatch):
    """generate_cli.py:216  `len(prompts) * args.max_new_tokens` -> `args.max_new_tokens` (the context of a
    conversation held one reply, not one per turn); :245  `history = prompts[i] + res.tokens` -> `prompts[i]` (a turn
    sent without the replies before it); :255  `[len(results):]` -> `[len(results) + 1:]` (the first turn not run was
    left out of the output)."""
    data, code, runner = _generate(monkeypatch, "--prompt", "1,2", "--prompt", "3", "--max-new-tokens", "2",
                                   "--conversation")
    assert code == 0 and runner.kw["context"] == 3 + 2 * 2
    assert [c[0] for c in runner.calls] == [[[1, 2]], [[1, 2, 7, 8, 3]]]
    data, code, runner = _generate(monkeypatch, "--prompt", "63", "--prompt", "3", "--prompt", "4", "--conversation")
    assert code == 2 and len(runner.calls) == 1
    assert [r["error"] is not None for r in data["results"]] == [True, True, True]
    assert data["results"][1]["error"].startswith("not run: turn [0] was refused (ConfigError)")


def test_generate_one_refused_prompt_fails_the_run_and_has_no_text(monkeypatch):
    """generate_cli.py:265  `any(r["error"] ...)` -> `all(...)` (a batch with one refused prompt exited 0); :253
    ` and res.error is None` dropped (a refused prompt's text was its decoded empty output, not null)."""
    tok = SimpleNamespace(encode=lambda text: [int(t) for t in text.split(",")], decode=lambda ids: "<text>")
    data, code, runner = _generate(monkeypatch, "--prompt", "63", "--prompt", "3", tokenizer=tok)
    assert code == 2
    assert [r["text"] for r in data["results"]] == [None, "<text>"]
    assert data["results"][0]["error"] == "ConfigError: refused"


def test_budget_flags_of_a_conversation():
    """generate_cli.py:272  `elif args.conversation:` -> `elif False:`: a refused conversation's budget error said its
    context was "the longest prompt + --max-new-tokens - 1", which a conversation's is not."""
    from hwkv.integrations.generate_cli import _budget_flags

    assert _budget_flags(_args("--prompt", "1", "--conversation", "--max-new-tokens", "4"), 9).startswith(
        "context 9: every turn and --max-new-tokens 4 per reply; --page-size 16; the default budget")


def test_load_model_refuses_an_uncached_name_before_transformers_looks(tmp_path, monkeypatch):
    """transformers.py:72  `miss = None if ...` -> `None if True or ...` (the look into the local cache skipped): a name
    in no cache went to from_pretrained, which some releases answer by asking the Hub (half a minute of retries off
    the network); the error afterwards was the same ConfigError, so the suite did not see the call."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("huggingface_hub")
    from hwkv.integrations.transformers import load_model

    calls = []

    def record(*a, **k):
        calls.append(a)
        raise OSError("asked the Hub")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", record)
    with pytest.raises(ConfigError, match="no such folder, and no model of that name in the local Hugging Face cache"):
        load_model("hwkv-test-org/not-cached", cache_dir=str(tmp_path))
    assert calls == []
