"""Session 33: what the engine reports when a run ends where it did not expect it to. A stop token inside a verify's
drafts counts every draft kept (accepted_tokens had counted one fewer: the last kept token taken for the model's own);
a request an engine window wider than the model's cannot fit is refused naming the SWA pool and the window, not the
context."""
from __future__ import annotations

import pytest

from hwkv.engine.sampling import SamplingParams
from hwkv.errors import OutOfSlotsError
from test_engine_defects import _run as _run_checked
from test_review31_windows import _engine
from test_review32_spec import _oracle, _tokens

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one thread for this module


@pytest.mark.parametrize("stop_at", [4, 5, 6, 9])
def test_accepted_tokens_count_the_drafts_kept_when_a_stop_ends_the_run_inside_them(stop_at: int):
    """Greedy drafts that are all right (an oracle), 4 a verify, one request stopped by its `stop_at`-th token: every
    verify keeps its drafts and the model's next token, except the last, which keeps drafts up to the stop (at 4 and
    9 the stop is the last draft, at 5 the model's own token, at 6 the first draft). So the accepted drafts are the
    tokens after the prefill's first less one model token for each verify before the last, and one more where the stop
    is the model's own."""
    prompt = _tokens(20, 1)
    want = _run_checked(_engine(prefix_cache=False), None, [prompt], new=12)[0]
    assert want[stop_at] not in want[:stop_at]
    e = _engine(draft=_oracle([prompt], [want]), num_draft=4)
    rid = e.add_request(prompt, SamplingParams(max_new_tokens=40, stop_token_ids=[want[stop_at]]))
    out = {}
    while e.has_work():
        out.update((r.rid, r.tokens) for r in e.step())
    st = e.stats
    assert out[rid] == want[:stop_at + 1] and st.forwards["DECODE"] == 0
    ends_on_the_models_token = stop_at % 5 == 0
    assert st.accepted_tokens == stop_at - (st.verify_rows - 1) - ends_on_the_models_token
    assert st.accepted_tokens <= st.draft_tokens


def test_a_window_wider_than_the_pools_were_planned_for_is_named_in_the_refusal():
    """Pools planned for the model's window 8 (page 4) and an engine keeping 64: a request well inside the context
    needs more SWA pages than the pool leaves it. The refusal names the SWA pages, the window and the pool, and queues
    nothing (it had said "size it for a longer context": the context was not the limit)."""
    wide = _engine(window=8, prefix_cache=False, check=False, engine_window=64)
    with pytest.raises(OutOfSlotsError, match=r"needs 18 SWA pages of 4 slots \(window 64 keeps up to 18\), past the "
                                              r"16 that an SWA pool of 88 slots .*plan the pools for this window"):
        wide.add_request(list(range(60)), SamplingParams(max_new_tokens=30))
    assert not wide.scheduler.waiting and not wide.has_work()
    _engine(window=8, prefix_cache=False, check=False).add_request(list(range(60)), SamplingParams(max_new_tokens=30))
