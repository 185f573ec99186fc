"""Hugging Face transformers models generating through hwkv's hybrid cache.

    from hwkv.integrations.transformers import HybridRunner, SamplingParams, load_model
    model = load_model("path/to/model", device="cpu")
    with HybridRunner(model, max_running=8) as runner:
        results = runner.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=32))

The pieces: `hf_model` (config -> layer kinds and geometry), `hf_attention` (the attention function registered
as "hwkv"), `runner` (the engine over a transformers model). The step loop, its scheduler, sampling, counters
and pools are the engine's (`hwkv.engine`). transformers itself is imported only by `load_model` and when the
runner registers the attention function.
"""
from __future__ import annotations

from typing import Any, Union

import torch

from hwkv.engine.pools import PoolPlan, plan_pools
from hwkv.engine.sampling import SamplingParams
from hwkv.engine.stats import RunnerStats
from hwkv.errors import ConfigError
from hwkv.integrations.hf_attention import ATTN_IMPLEMENTATION, hwkv_attention, register
from hwkv.integrations.hf_model import layer_kinds, model_shape
from hwkv.integrations.runner import HybridRunner, Result

__all__ = ["HybridRunner", "Result", "SamplingParams", "RunnerStats", "PoolPlan", "load_model", "register",
           "hwkv_attention", "ATTN_IMPLEMENTATION", "layer_kinds", "model_shape", "plan_pools"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_model(path: str, device: Union[str, torch.device] = "cpu", dtype: Union[None, str, torch.dtype] = None,
               **kwargs: Any) -> Any:
    """A causal LM from a local folder (or the local Hugging Face cache; nothing is downloaded), in eval
    mode on `device`; `dtype` "fp32"/"bf16"/"fp16" or a torch dtype (default: the config's)."""
    from transformers import AutoModelForCausalLM

    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ConfigError(f"dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype or "auto", **kwargs)
    return model.to(device).eval()
