"""hwkv.engine holds the planner and the presets; their old homes in hwkv.bench re-export the same objects."""
from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import pytest


def _public(module) -> set[str]:
    """Names a module defines itself (not the ones it imports), without a leading underscore."""
    return {n for n, obj in vars(module).items()
            if not n.startswith("_") and not inspect.ismodule(obj)
            and getattr(obj, "__module__", module.__name__) == module.__name__}


@pytest.mark.parametrize("old_name,name", [("hwkv.bench", "plan"), ("hwkv.bench", "presets"),
                                           ("hwkv.integrations", "scheduler"), ("hwkv.integrations", "sampling"),
                                           ("hwkv.integrations", "stats")])
def test_old_import_paths_give_the_same_objects(old_name, name):
    old, new = importlib.import_module(f"{old_name}.{name}"), importlib.import_module(f"hwkv.engine.{name}")
    assert set(old.__all__) == _public(new), "the old module re-exports every public name of hwkv.engine's, no more"
    for attr in old.__all__:
        assert getattr(old, attr) is getattr(new, attr), attr


def test_the_engine_package_imports_nothing_beyond_hwkv():
    code = ("import sys, hwkv; before = set(sys.modules); import hwkv.engine; "
            "print(sorted(set(sys.modules) - before))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['hwkv.engine']"


def test_the_integration_takes_its_pools_and_step_loop_from_the_engine():
    """The pools and the step loop are the engine's; the transformers integration re-exports the pool names it
    always had and its runner is an Engine."""
    from hwkv.engine import engine, pools
    from hwkv.integrations import hf_model, runner
    for attr in ("Cache", "PoolPlan", "build_cache", "plan_pools", "kv_bytes_needed", "default_memory_cap"):
        assert getattr(hf_model, attr) is getattr(pools, attr), attr
    assert issubclass(runner.HybridRunner, engine.Engine) and runner.Result is engine.Result
