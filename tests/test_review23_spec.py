"""Review 23 (left open by review 22): a DraftGraphRunner given a MultiStepDraft batch of another mode than DECODE
is refused as the eager draft step refuses it (a ConfigError), before any static buffer changes; it had copied the
batch and replayed its tokens as decodes."""
import pytest
import torch

from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.errors import ConfigError
from hwkv.graph import EagerAdapter
from hwkv.spec import MultiStepDraft
from hwkv.testing.spec_harness import draft_batch, draft_graphs
from test_spec_refusals import assert_unchanged, harness, snapshot

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY], ids=lambda m: m.name)
def test_a_draft_runner_refuses_a_draft_batch_of_another_mode_before_any_static_buffer_is_written(mode):
    h, rids = harness()
    runner = draft_graphs(h, [2], EagerAdapter(), 3)
    good = draft_batch(h, rids, 3)
    runner.run(good, h.random_inputs(6))  # one good replay first
    batch = ForwardBatch(mode, good.batch_size, good.req_pool_indices, good.seq_lens, good.out_cache_loc,
                         extend_seq_lens=torch.tensor([3, 3]), spec_info=MultiStepDraft(3),
                         seq_lens_cpu=good.seq_lens_cpu, extend_seq_lens_cpu=torch.tensor([3, 3]))
    with pytest.raises(ConfigError, match=r"draft metadata takes a DECODE batch"):  # the eager draft step's refusal
        h.backend.init_draft_metadata(batch)
    before = snapshot(h, runner)
    with pytest.raises(ConfigError, match=r"draft metadata takes a DECODE batch with spec_info=MultiStepDraft"):
        runner.prepare(batch, h.random_inputs(6))
    assert_unchanged(h, before, runner)
