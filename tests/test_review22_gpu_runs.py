"""What the H100 run of the GPU test list found (2026-12-05) that the CPU suite can hold."""
import pytest


def test_an_uncached_model_name_is_refused_before_transformers_asks_the_hub(monkeypatch, tmp_path):
    """A name that is no folder and not in the local cache never reaches from_pretrained: some transformers
    releases ask the Hub for an adapter config even with local_files_only (on the offline H100 machine: half a minute
    of retries and logged tracebacks before the CLI's one-line error)."""
    pytest.importorskip("transformers")
    import transformers

    from hwkv.errors import ConfigError
    from hwkv.integrations.transformers import _cache_miss, load_model

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))

    def asked(*a, **k):
        raise AssertionError("from_pretrained was called for a name the cache does not hold")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", asked)
    with pytest.raises(ConfigError, match="no model of that name in the local Hugging Face cache") as e:
        load_model("no-such-org/no-such-model")
    assert e.value.__cause__ is not None
    assert _cache_miss("not a repo id!", {}) is not None
    snap = tmp_path / "hub" / "models--org--cached" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--org--cached" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--cached" / "refs" / "main").write_text("abc")
    assert _cache_miss("org/cached", {}) is None
    # a cache the call names, a revision, a subfolder: looked up as from_pretrained would
    other = tmp_path / "other" / "models--org--elsewhere"
    (other / "snapshots" / "def" / "sub").mkdir(parents=True)
    (other / "snapshots" / "def" / "sub" / "config.json").write_text("{}")
    assert _cache_miss("org/elsewhere", {}) is not None
    assert _cache_miss("org/elsewhere", {"cache_dir": str(tmp_path / "other")}) is not None   # no refs/main
    assert _cache_miss("org/elsewhere", {"cache_dir": str(tmp_path / "other"), "revision": "def"}) is not None
    assert _cache_miss("org/elsewhere", {"cache_dir": str(tmp_path / "other"), "revision": "def",
                                         "subfolder": "sub"}) is None
    with pytest.raises(ConfigError) as e:   # a cached name goes on to load
        load_model("org/cached")
    assert isinstance(e.value.__cause__, AssertionError), "from_pretrained was asked for the cached name"
