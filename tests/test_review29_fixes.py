"""Session 29's GPU run: defects its tests found off the CPU suite's paths, each pinned here on the CPU."""
import dataclasses

from hwkv.bench.serve import continuous_batching_config


@dataclasses.dataclass
class _Config517:            # transformers 5.17's ContinuousBatchingConfig names the page `block_size`
    num_blocks: int = 0
    block_size: int = 256
    max_batch_tokens: int = 0


@dataclasses.dataclass
class _ConfigLater:          # later releases name it `page_size`
    num_blocks: int = 0
    page_size: int = 256
    max_batch_tokens: int = 0


def test_both_transformers_baselines_build_the_page_size_either_release_names():
    """benchmarks/bench_transformers.py's hf-cb baseline passed `page_size=` to transformers 5.17's config (the GPU
    machine's release), a TypeError in each of its runs; it now builds the config through the serve baseline's
    helper, which names the page as the installed release does."""
    old = continuous_batching_config(_Config517, 16, num_blocks=8, max_batch_tokens=64)
    new = continuous_batching_config(_ConfigLater, 16, num_blocks=8, max_batch_tokens=64)
    assert (old.block_size, old.num_blocks, old.max_batch_tokens) == (16, 8, 64)
    assert (new.page_size, new.num_blocks, new.max_batch_tokens) == (16, 8, 64)
