"""The backend's metadata step refuses a forward mode that is not a ForwardMode (typed, naming the value and
the members), before it translates or builds anything."""
import pytest
import torch

import hwkv
from hwkv.allocator import SWATokenToKVPoolAllocator
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.errors import ConfigError
from hwkv.pool import SWAKVPool


def one_decode():
    """A hybrid pool, its allocator and rows, the CPU backend and a one-token DECODE batch."""
    pool = SWAKVPool(64, 64, 16, torch.float32, 2, 8, [0], [1], "cpu")
    alloc = SWATokenToKVPoolAllocator(64, 64, 16, "cpu", pool)
    rtt = hwkv.ReqToTokenPool(size=2, max_context_len=64, device="cpu")
    backend = hwkv.make_backend(pool, rtt, sliding_window=8)
    row = rtt.alloc(1)[0]
    loc = alloc.alloc_extend(prefix_lens=[0], seq_lens=[1], last_loc=[0], extend_num_tokens=1)
    rtt.write(row, 0, loc)
    batch = ForwardBatch(ForwardMode.DECODE, 1, torch.tensor([row]), torch.tensor([1]), loc)
    return alloc, rtt, backend, batch


@pytest.mark.parametrize("mode", ["decode", "DECODE", 2, None])
def test_a_forward_mode_that_is_not_a_forward_mode_is_a_config_error(mode):
    alloc, rtt, backend, batch = one_decode()
    batch.forward_mode = mode  # e.g. an engine handing its own enum's name
    before = (alloc.full_available_size(), alloc.swa_available_size(), rtt.req_to_token.clone())
    with pytest.raises(ConfigError, match=rf"batch.forward_mode is {mode!r} \({type(mode).__name__}\), not a "
                                          r"ForwardMode; use one of ForwardMode.EXTEND, ForwardMode.DECODE, .*IDLE"):
        backend.init_forward_metadata(batch)
    after = (alloc.full_available_size(), alloc.swa_available_size(), rtt.req_to_token)
    assert before[:2] == after[:2] and torch.equal(before[2], after[2])
    batch.forward_mode = ForwardMode.DECODE
    assert backend.init_forward_metadata(batch).full.window is None  # the same batch runs once it is fixed


@pytest.mark.parametrize("mode", ["decode", 2, None])
def test_a_batch_built_with_a_mode_that_is_not_a_forward_mode_is_a_config_error(mode):
    with pytest.raises(ConfigError, match=rf"forward_mode is {mode!r} .*not a ForwardMode; use one of"):
        ForwardBatch(mode, 1, torch.tensor([0]), torch.tensor([1]), torch.tensor([16]))


def test_a_layer_the_pool_lacks_is_a_config_error_naming_its_ids():
    alloc, rtt, backend, batch = one_decode()
    backend.init_forward_metadata(batch)
    q, kv = torch.randn(1, 4, 8), torch.randn(1, 2, 8)
    with pytest.raises(ConfigError, match=r"layer_id 5 is in neither group|layer 5 is in neither group"):
        backend.forward(q, kv, kv, hwkv.AttentionLayer(5, 4, 2, 8), batch)
    with pytest.raises(ConfigError, match=r"layer 5 is in neither group of the pool; its layer ids are \[0, 1\]"):
        backend.forward(q, None, None, hwkv.AttentionLayer(5, 4, 2, 8), batch, save_kv_cache=False)
