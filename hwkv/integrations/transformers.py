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

import os
from typing import Any, Dict, Optional, Union

import torch

from hwkv.engine.dtypes import DTYPES
from hwkv.engine.pools import PoolPlan, plan_pools
from hwkv.engine.sampling import SamplingParams
from hwkv.engine.stats import RunnerStats
from hwkv.errors import ConfigError, DeviceError, HwkvError
from hwkv.integrations.hf_attention import ATTN_IMPLEMENTATION, hwkv_attention, register
from hwkv.integrations.hf_model import layer_kinds, model_shape
from hwkv.integrations.runner import HybridRunner, Result
from hwkv.pool import check_device

__all__ = ["HybridRunner", "Result", "SamplingParams", "RunnerStats", "PoolPlan", "load_model", "register",
           "hwkv_attention", "ATTN_IMPLEMENTATION", "layer_kinds", "model_shape", "plan_pools"]



def _cache_miss(name: str, kwargs: Dict[str, Any]) -> Optional[Exception]:
    """Why the local Hugging Face cache the call names (`cache_dir`, `revision`, `subfolder` as from_pretrained takes
    them) holds no config.json for the model `name`, or None where it holds one (nothing is fetched)."""
    sub = kwargs.get("subfolder") or ""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, f"{sub}/config.json" if sub else "config.json",
                                       cache_dir=kwargs.get("cache_dir"), revision=kwargs.get("revision"))
    except Exception as e:  # noqa: BLE001 - a name that is no repo id (HFValidationError), or no huggingface_hub
        return e
    return None if isinstance(found, str) else FileNotFoundError(f"no config.json for {name!r} in the cache")


def load_model(path: str, device: Union[str, torch.device] = "cpu", dtype: Union[None, str, torch.dtype] = None,
               **kwargs: Any) -> Any:
    """A causal LM from a local folder (or the local Hugging Face cache; nothing is downloaded), in eval
    mode on `device`; `dtype` "fp32"/"bf16"/"fp16" or a floating torch dtype (default: the config's).

    Typed errors, chained to the cause: DeviceError for a device that is no torch device or is unavailable and
    ConfigError for another dtype (both before anything loads); ConfigError naming the model for whatever stops
    it from loading (no such folder or cached name, a broken config or weights file)."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ConfigError(f"dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    elif dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        what = "is not a floating-point dtype" if isinstance(dtype, torch.dtype) else "is not a dtype"
        raise ConfigError(f"dtype={dtype!r} {what}; choose one of {', '.join(DTYPES)} or a floating torch dtype")
    try:
        torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise DeviceError(f"device={device!r} is not a torch device: {_first_line(e)}") from e
    dev = check_device(device)  # its runtime is present
    from transformers import AutoModelForCausalLM

    name = os.fspath(path) if isinstance(path, (str, os.PathLike)) else path
    miss = None if not isinstance(name, str) or os.path.exists(os.path.expanduser(name)) else _cache_miss(name, kwargs)
    if miss is not None:
        # refused before transformers looks: some releases ask the Hub for an adapter config even with
        # local_files_only, which on a machine without a network retries for half a minute and logs tracebacks
        raise ConfigError(f"cannot load model {name!r}: no such folder, and no model of that name in the local "
                          "Hugging Face cache (nothing is downloaded)") from miss
    try:
        model = AutoModelForCausalLM.from_pretrained(os.path.expanduser(name), local_files_only=True,
                                                     dtype=dtype or "auto", **kwargs)
    except HwkvError:
        raise
    except Exception as e:  # transformers, huggingface_hub, safetensors, json, torch: each raises its own kind
        if isinstance(name, str) and not os.path.exists(os.path.expanduser(name)):
            raise ConfigError(f"cannot load model {name!r}: no such folder, and no model of that name in the local "
                              "Hugging Face cache (nothing is downloaded)") from e
        raise ConfigError(f"cannot load model {name!r}: {_first_line(e)}") from e
    try:
        model = model.to(dev)
    except Exception as e:
        raise DeviceError(f"cannot move model {name!r} to {dev}: {_first_line(e)}") from e
    return model.eval()


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__
