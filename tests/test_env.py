"""The environment variables are declared once and the README documents exactly that table."""
import pathlib

from hwkv.env import ALL, HWKV_DEBUG, HWKV_HOPPER_EXTEND, markdown_table


def test_readme_holds_the_generated_table():
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert markdown_table() in readme


def test_flags_parse(monkeypatch):
    monkeypatch.setenv("HWKV_DEBUG", "0")
    assert HWKV_DEBUG.get() is False
    monkeypatch.setenv("HWKV_DEBUG", "1")
    assert HWKV_DEBUG.get() is True
    monkeypatch.delenv("HWKV_DEBUG")
    assert HWKV_DEBUG.get() is False
    assert {v.name for v in ALL} == {"HWKV_DEVICE", "HWKV_DEBUG", "HWKV_HOPPER_EXTEND"}


def test_a_flag_on_by_default_turns_off(monkeypatch):
    monkeypatch.delenv("HWKV_HOPPER_EXTEND", raising=False)
    assert HWKV_HOPPER_EXTEND.get() is True
    monkeypatch.setenv("HWKV_HOPPER_EXTEND", "0")
    assert HWKV_HOPPER_EXTEND.get() is False


def test_flag_values_any_case_and_blanks(monkeypatch):
    for raw, want in (("TRUE", True), (" on ", True), ("Yes", True), ("off", False), ("", False), ("No", False)):
        monkeypatch.setenv("HWKV_DEBUG", raw)
        assert HWKV_DEBUG.get() is want, raw


def test_unknown_flag_value_is_a_config_error_naming_the_variable_and_the_allowed_values(monkeypatch):
    import pytest

    from hwkv.errors import ConfigError

    monkeypatch.setenv("HWKV_DEBUG", "maybe")
    with pytest.raises(ConfigError, match=r"HWKV_DEBUG='maybe' is not a valid value; allowed: 1/true/yes/on \(on\), "
                                          r"0/false/no/off or empty \(off\)"):
        HWKV_DEBUG.get()
