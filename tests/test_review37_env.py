"""Review 37: hwkv reads TRITON_INTERPRET as Triton does (the kernels' configs follow the mode Triton runs in)."""
import pytest

triton = pytest.importorskip("triton")
knobs = pytest.importorskip("triton.knobs")

from hwkv_cuda.kernels.common import interpreting  # noqa: E402


@pytest.mark.parametrize("value", ["0", "1", "false", "False", "off", "no", "true", "TRUE", "on", "yes", "y", "2",
                                   "x", ""])
def test_interpreting_reads_triton_interpret_as_triton_does(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    """TRITON_INTERPRET=false ran Triton compiled but hwkv took the interpreter's configs (and its in-place merge)."""
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreting() == bool(knobs.runtime.interpret), value
