"""Re-review of review 27's input checks: legitimate flows the new checks refuse.

CPU only, fast, deterministic."""
from pathlib import Path

import pytest
import torch

import hwkv
from hwkv import devices
from hwkv.allocator import SWATokenToKVPoolAllocator, release_out_of_window
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.errors import LocError
from hwkv.graph import EagerAdapter
from hwkv.pool import SWAKVPool
from hwkv.release import release_out_of_window_batch
from hwkv.step_graph import DecodeStepGraph

H, KVH, D, W = 2, 1, 8, 8
I64 = dict(dtype=torch.int64)


def test_a_step_graph_whose_own_padding_row_last_held_a_request_still_replays_a_padded_bucket():
    """DecodeStepGraph(pad_row=None) takes its padding row from the ReqToTokenPool. Where a finished request's row is
    what it gets, that row's entry of the caller's per-row frontier table still holds the request's last frontier
    (nothing resets the frontier of a row that only pads: the engine resets a row's frontier where a request starts
    in it). Padded requests release at length 1, so before review 27 their release moved nothing (frontier >=
    every new frontier: nothing freed, on the CPU as on CUDA's kernels). Review 27's `frontier past its length`
    check in `_check_release` (CPU, and any device in debug mode) now refuses every padded replay, and the graph's
    capture itself: `LocError: request row 0: frontier 32 must be in [0, seq_len 1]`. The padding row holds no pages,
    so its frontier is meaningless; the check (or the graph, zeroing its padding row's frontier) should let it be."""
    pool = SWAKVPool(512, 256, 1, torch.float32, KVH, D, [0], [1], "cpu")
    alloc = SWATokenToKVPoolAllocator(512, 256, 1, "cpu", pool)
    rtt = hwkv.ReqToTokenPool(2, 64, "cpu")
    backend = hwkv.make_backend(pool, rtt, device="cpu", sliding_window=W)
    layers = [hwkv.AttentionLayer(0, H, KVH, D, sliding_window=W), hwkv.AttentionLayer(1, H, KVH, D)]
    frontiers = torch.zeros(2, **I64)   # one per req_to_token row, as DecodeStepGraph takes them
    gen = torch.Generator().manual_seed(0)

    def prefill(row, n):
        loc = alloc.alloc_extend([0], [n], [0], n)
        rtt.write(row, 0, loc)
        batch = ForwardBatch(ForwardMode.EXTEND, 1, torch.tensor([row]), torch.tensor([n]), loc,
                             extend_prefix_lens=torch.tensor([0]), extend_seq_lens=torch.tensor([n]))
        backend.init_forward_metadata(batch)
        for layer in layers:
            k = torch.randn(n, KVH, D, generator=gen)
            backend.forward(torch.randn(n, H, D, generator=gen), k, k.clone(), layer, batch)
        release_out_of_window_batch(alloc, rtt.req_to_token, torch.tensor([row]), torch.tensor([n]), frontiers, W,
                                    by_row=True)
        return loc

    done, live = rtt.alloc(2)
    loc = prefill(done, 40)
    prefill(live, 12)
    f = int(frontiers[done])
    assert f > 0   # the finished request's frontier moved
    # it ends: its pages go back (full below its frontier, full + SWA from it on) and so does its row
    alloc.free(loc[:f], with_swa=False)
    alloc.free(loc[f:], with_swa=True)
    rtt.free([done])

    def layers_fn(batch, inputs):
        return torch.cat([backend.forward(inputs["q"], inputs["k"], inputs["v"], layer, batch)
                          .reshape(batch.num_tokens, -1) for layer in layers], dim=1)

    shapes = {"q": ((H, D), torch.float32), "k": ((KVH, D), torch.float32), "v": ((KVH, D), torch.float32)}
    graph = DecodeStepGraph(backend, alloc, layers_fn, [2], shapes, EagerAdapter(), frontiers=frontiers, window=W,
                            pad_row=None)
    assert graph.pad_row == done   # the only free row
    graph.capture()
    inputs = {"q": torch.randn(1, H, D, generator=gen), "k": torch.randn(1, KVH, D, generator=gen),
              "v": torch.randn(1, KVH, D, generator=gen)}
    seq = torch.tensor([13])
    out = graph.step(torch.tensor([live]), seq, seq.clone(), inputs)   # one live request in bucket 2: one padded
    assert out.shape[0] == 1
    alloc.check_integrity()


# ------------------------------------------------------------------------------------------ device by name


@pytest.mark.parametrize("how", ["HybridRunner(device=None) under HWKV_DEVICE=cpu", "--device cpu"])
def test_a_named_or_forced_cpu_is_reachable_beside_a_broken_plugin_through_the_integration_too(tmp_path, monkeypatch,
                                                                                                how):
    """Review 27 (bad-inputs row 212): 'a named or forced device loads only its own plugin (a broken third-party
    plugin had made even HWKV_DEVICE=cpu unreachable)'. `make_backend(device='cpu')` and `current_device` got
    `discover(only=...)`, but the integration's device choice (`hwkv.integrations.device_choice`: HybridRunner's
    `resolve_spec`, and `available_spec`, which `hwkv generate/bench/verify --device` use) still calls the full
    `discover()` first, so under HWKV_DEVICE=cpu (or with --device cpu) they still raise `device plugin entry point
    'broken27r' ... failed to load`."""
    from hwkv.integrations.device_choice import available_spec, resolve_spec
    from test_review27_contract import cpu_forced_beside_a_broken_plugin
    with cpu_forced_beside_a_broken_plugin(tmp_path, monkeypatch, "broken27r"):
        assert devices.current_device().name == "cpu"   # fixed by review 27
        if how.startswith("HybridRunner"):
            assert resolve_spec(None, "cpu").name == "cpu"     # HybridRunner(model) on a CPU model
        else:
            assert available_spec("cpu").name == "cpu"        # hwkv generate / bench / verify --device cpu


# ------------------------------------------------------------------------------------------ docs


def test_bad_inputs_row_213_names_the_error_type_release_out_of_window_raises_for_a_length_past_int64():
    """docs/bad-inputs.md row 213 lists `seq_len ... must fit int64` among the `ConfigError`s; release_out_of_window
    raises it as a LocError (`seq_len 1180591620717411303424 must fit int64 (below 2**63)`)."""
    pool = SWAKVPool(64, 32, 4, torch.float32, KVH, D, [0], [1], "cpu")
    alloc = SWATokenToKVPoolAllocator(64, 32, 4, "cpu", pool)
    rtt = hwkv.ReqToTokenPool(2, 32, "cpu")
    with pytest.raises(LocError, match="must fit int64"):
        release_out_of_window(alloc, rtt.req_to_token[0], 2 ** 70, 0, W)
    doc = (Path(__file__).resolve().parents[1] / "docs" / "bad-inputs.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| 213 |"))
    outcome = row.split(" | ")[-1]
    quoted = outcome.index("must fit int64")
    assert outcome.rfind("`LocError`", 0, quoted) > outcome.rfind("`ConfigError`", 0, quoted), \
        f"row 213 quotes the int64 refusal under ConfigError: {outcome}"
