"""Review 35, re-review of the day's fixes (bad inputs 250-260).

Each test fails on the code as re-reviewed; its comment says what is wrong, what is expected and where. CPU only
(a host 'graph'), each well under a second.
"""
from __future__ import annotations

import pytest
import torch

from hwkv.errors import ConfigError
from test_step_graph import Engine, _bucket_of_4

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("one_thread")]


def test_a_whole_step_graph_that_gave_its_padding_row_back_captures_no_more():
    # Wrong: hwkv/step_graph.py `DecodeStepGraph.release_rows` now sets `_pad_freed`, but only `step()` reads it
    # (hwkv/step_graph.py:236). `capture()` (hwkv/step_graph.py:185) still runs its warm-up and capture over every
    # bucket with no live request: all lanes are padded lanes, and they write the padding slot 0 into
    # req_to_token[pad_row, 0] -- a row the pool has handed to a live request since. A recapture after
    # release_rows() silently overwrites that request's first slot (with a frontier past 0 it then raises a
    # LocError, the row already written).
    # Expected: capture() refuses as step() does (ConfigError "gave its padding row back ...") before anything is
    # written; the new owner's row is untouched. Fix: check `self._pad_freed` at the top of `capture()` too (or
    # in a helper both call).
    e = Engine(4)
    graph = _bucket_of_4(e)
    pad = graph.pad_row
    graph.release_rows()
    taken = e.rtt.alloc(1)[0]   # the pool hands the row on to a new request
    assert taken == pad
    e.rtt.req_to_token[taken, :4] = torch.tensor([101, 102, 103, 104])  # that request's slots
    row = e.rtt.req_to_token[taken].clone()
    with pytest.raises(ConfigError, match="padding row back"):
        graph.capture()
    assert torch.equal(row, e.rtt.req_to_token[taken]), "capture() wrote the row the pool handed on"
