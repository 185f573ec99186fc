"""Review 28, re-review of 6e00210..HEAD: holes the step lock, `_check_model` and the sinks adoption leave.

Tiny random models as tests/test_review28_between_steps.py builds them (CPU, fp32); each test is one defect.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="hwkv's test extra")

from hwkv.errors import ConfigError, HwkvError  # noqa: E402
from hwkv.integrations.transformers import HybridRunner, SamplingParams  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# the tiny models, prompts and runner sizes of the between-steps review (one definition)
from test_review28_between_steps import KW, PROMPTS, _model  # noqa: E402


# ---- 1. generate() from on_step: not inside a step, so the new lock lets it through, and the outer run loses results
def test_generate_from_on_step_is_refused_or_keeps_the_outer_results():
    """engine.py generate(): the new `_step_lock.locked()` refusal covers a generate() from inside a step (a drafter,
    the model) but `on_step` runs between steps, with the lock free. A nested generate() from on_step runs the outer
    run's requests to completion in its own steps; their Results go to `self.unclaimed` (not in the inner index), the
    outer loop then sees none of its rids in `self.requests` and returns a short list, silently. Expected: refused
    with a ConfigError (as a nested generate inside a step now is), or the outer list complete."""
    m = _model("gemma2")
    p = SamplingParams(max_new_tokens=8)
    with HybridRunner(m, graphs="off", **KW) as r:
        inner = []

        def on_step(n):
            if not inner:
                inner.append(r.generate([[4, 5, 6]], SamplingParams(max_new_tokens=20)))

        try:
            out = r.generate(PROMPTS[:2], p, on_step=on_step)
        except HwkvError:
            return   # refused: fine
        assert len(out) == 2, (f"generate() returned {len(out)} of 2 results; the others went to unclaimed "
                               f"{sorted(r.unclaimed)}")


# ---- 2. _check_model keeps the embedding module of construction: set_input_embeddings is not seen ----------------
def test_input_embeddings_swapped_by_set_input_embeddings_are_checked_too():
    """runner.py `_check_model` reads `self._embed.weight`, the module `get_input_embeddings()` returned at
    construction. A vocabulary change that installs a new module (`model.set_input_embeddings(nn.Embedding(100, H))`,
    what custom resizers and PEFT's trainable-token wrappers do) is not seen: the stale module still reports [128, H],
    add_request takes id 120 and the step raises torch's raw IndexError from the new embedding (the case the change
    turned into a ConfigError for resize_token_embeddings). Expected: a typed HwkvError."""
    m = _model("gemma2")
    with HybridRunner(m, graphs="off", **KW) as r:
        r.add_request(PROMPTS[0], SamplingParams(max_new_tokens=4))
        r.step()
        old = m.get_input_embeddings()
        new = type(old)(100, old.weight.shape[1], padding_idx=None, embed_scale=old.embed_scale) \
            if hasattr(old, "embed_scale") else torch.nn.Embedding(100, old.weight.shape[1])
        m.set_input_embeddings(new)
        with pytest.raises(HwkvError):
            r.add_request([120, 3, 4], SamplingParams(max_new_tokens=4))
            r.step()


# ---- 3. adopted sinks skip the value check in a graph decode: NaN sinks give token 0s instead of a ConfigError ---
def test_replaced_sinks_with_nan_are_refused_under_graphs_eager_too():
    """hf_attention.py LayerTable.get adopts a layer's new sinks (data_ptr/dtype changed) at any layer call, but the
    backend checks the values of sinks it has not seen (`sinks_checked`, backend.py) only `if not md.graph`. Under
    graphs="eager" (CPU) the first forward after `param.data = new` is a graph decode, so NaN sinks are adopted
    unchecked: every later token is 0 ([107, 41, 0, 0, 0, 0]) where graphs="off" refuses with "sinks[0] is nan".
    At 6e00210 the layers kept the old sinks (stale, but finite). Expected: the same ConfigError as graphs="off"."""
    m = _model("gpt_oss")
    with HybridRunner(m, graphs="eager", **KW) as r:
        for q in PROMPTS[:2]:
            r.add_request(q, SamplingParams(max_new_tokens=6))
        r.step()
        r.step()
        for name, prm in m.named_parameters():
            if name.endswith("sinks"):
                d = prm.data.clone()
                d[0] = float("nan")
                prm.data = d
        with pytest.raises(HwkvError, match="nan"):
            while r.has_work():
                r.step()


# ---- 4. sinks adoption under real graphs: a replay runs no Python, so it reads the sinks it captured -------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a decode graph replay needs CUDA")
def test_replaced_sinks_under_graph_replays_are_refused():
    """hf_attention.py LayerTable.get adopts replaced sinks only when Python runs a layer (eager forwards, CPU
    "eager" graphs). A CUDA decode graph replays the address it captured, so a runner holding device graphs refuses a
    replacement at the first forward that runs the model (here the new request's prefill), with what to do instead,
    and gives back what that step allocated; an in-place update (load_state_dict(sd)) runs on. In bf16: the fp32
    tiny GPT-OSS's grouped_mm experts copy through the host, which a CUDA graph cannot capture (its first GPU run)."""
    new = {k: v.clone() for k, v in _model("gpt_oss", seed=5, dtype=torch.bfloat16).state_dict().items()}
    m = _model("gpt_oss", dtype=torch.bfloat16).cuda()
    with HybridRunner(m, graphs="on", **KW) as r:
        assert r.table.frozen
        r.add_request(PROMPTS[0], SamplingParams(max_new_tokens=8))
        r.step()
        r.step()
        m.load_state_dict(new)                    # in place: the captured addresses hold the new values
        r.step()
        m.load_state_dict({k: v.clone().cuda() for k, v in new.items()}, assign=True)
        r.add_request(PROMPTS[2], SamplingParams(max_new_tokens=8))
        with pytest.raises(ConfigError, match="sinks were replaced .* update the weights in place"):
            while r.has_work():
                r.step()
        r.check_integrity()


def test_gpt_oss_compiles_whole_with_the_sinks_check():
    """graphs="on" on the CPU (torch.compile over the static buffers): the sinks-replacement check compared data
    pointers, which dynamo cannot trace: 36 graph breaks and 85 frames for the tiny GPT-OSS. The check stays out of
    compiled code (the eager forwards make it), so the model compiles whole again: one frame per bucket."""
    from torch._dynamo.utils import counters

    from hwkv_cpu.graph import CompileGraphAdapter

    m = _model("gpt_oss")
    counters.clear()
    with HybridRunner(m, graphs="on", **dict(KW, max_running=2), graph_batch_sizes=[1, 2]) as r:
        if not isinstance(r.graph.adapter, CompileGraphAdapter):
            pytest.skip("the device's graphs are not torch.compile's")
        r.generate(PROMPTS[:2], SamplingParams(max_new_tokens=6))
        assert r.stats.graph_replays > 0
    assert dict(counters["frames"]) == {"total": 2, "ok": 2} and not counters["graph_break"]
