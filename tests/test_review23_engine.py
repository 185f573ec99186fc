"""Review 23 (left open by review 22): the verify and whole-step paths check the model's logits shape as the plain
step does (`Engine._check_logits`): a model whose logits are wider than the vocabulary is refused with a ShapeError
inside the step's undo, every pool, row and frontier as before; then the run gives a clean run's tokens. A wider
verify row had been argmaxed to a token id past the vocabulary and accepted as the model's next token."""
import pytest
import torch

from hwkv.errors import ShapeError
from hwkv.graph import EagerAdapter
from hwkv.engine.drafters import prompt_lookup
from test_engine_defects import Flaky, _engine, _prompts, _run

pytestmark = pytest.mark.usefixtures("one_thread")


class Wider(Flaky):
    """The model, once armed, returning its logits with one more column than the vocabulary (after its layers)."""

    def __call__(self, batch, ids, pos, keep):
        out = self.model(batch, ids, pos, keep)
        armed, self.exc = self.exc, None
        return out if armed is None else torch.cat([out, out[:, :1] + 100.0], dim=1)


CASES = {
    "whole-step": dict(graphs=EagerAdapter(), whole_step=True, overlap=True),
    "verify": dict(draft=prompt_lookup()),
    "verify-graph": dict(draft=prompt_lookup(), graphs=EagerAdapter(), whole_step=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_wider_than_the_vocabulary_are_refused_on_every_path_and_the_step_runs_again(case):
    kw = CASES[case]
    prompts = [p + p[:9] for p in _prompts()] if "draft" in kw else _prompts()
    want = _run(*_engine(**kw), prompts)
    e, model = _engine(**kw)
    wider = Wider(model.model)
    e.model_step = wider
    assert _run(e, wider, prompts, exc=ShapeError("model_step returned logits of shape")) == want
