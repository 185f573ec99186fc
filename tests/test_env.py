"""The environment variables are declared once and the README documents exactly that table."""
import pathlib

from hwkv.env import ALL, HWKV_DEBUG, markdown_table


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
    assert {v.name for v in ALL} == {"HWKV_DEVICE", "HWKV_DEBUG"}
