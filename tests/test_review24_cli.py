"""Review 24 (newcomer): a chunk larger than any forward can carry.

`hwkv generate --chunk 100000000` was refused with a message about the requests' context (the planner sized an SWA
reserve for a hundred million prompt tokens per forward): the engine's pools now cap the chunk at what one forward
can hold (every row's whole context), and `hwkv plan`, which sizes exactly what it is asked, says when the chunk's
reserve is what does not fit.
"""

from hwkv.engine.pools import plan_pools
from hwkv.engine.presets import PRESETS
from tests.test_cli_errors import _gen, _main, one_line, tiny_model  # noqa: F401  (a fixture)


def test_generate_takes_a_chunk_larger_than_every_forward(capsys, tiny_model):  # noqa: F811
    code, out, err = _gen(capsys, "--model", tiny_model, "--prompt", "1,2,3", "--max-new-tokens", "2",
                          "--chunk", "100000000")
    assert code == 0, err
    assert "[0] '1,2,3' ->" in out


def test_pools_cap_the_chunk_at_every_rows_context():
    shape = PRESETS["gemma-2-27b"]
    plan = plan_pools(shape, context=512, max_running=3, chunk=10**8, page_size=16, memory="8GiB", device="cpu")
    assert plan.chunk == 3 * 512
    assert plan_pools(shape, context=512, max_running=3, chunk=100, page_size=16, memory="8GiB",
                      device="cpu").chunk == 100


def test_plan_names_the_chunk_when_its_reserve_does_not_fit(capsys):
    # (no forward carries more than the running requests' whole contexts: 8 x 4096 of the 10M, as the engine caps it)
    code, out, err = _main(capsys, "plan", "--model", "gemma-2-27b", "--memory", "8GiB", "--context", "4096",
                           "--chunk", "10000000", "--max-running", "8")
    assert code == 2 and out == ""
    line = one_line(err, "hwkv plan: error: gemma-2-27b: 8 request(s) of context 4096 need")
    assert "the chunk of 10000000 tokens, at most 8 x 4096 a forward, alone holds" in line
    assert "a smaller chunk, below 32768, frees it" in line
    code, out, err = _main(capsys, "plan", "--model", "gemma-2-27b", "--memory", "1GiB", "--context", "4096",
                           "--max-running", "40")
    assert code == 2 and "chunk" not in err
