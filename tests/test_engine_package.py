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


@pytest.mark.parametrize("name", ["plan", "presets"])
def test_old_import_paths_give_the_same_objects(name):
    old, new = importlib.import_module(f"hwkv.bench.{name}"), importlib.import_module(f"hwkv.engine.{name}")
    assert set(old.__all__) == _public(new), "hwkv.bench re-exports every public name of hwkv.engine, no more"
    for attr in old.__all__:
        assert getattr(old, attr) is getattr(new, attr), attr


def test_the_engine_package_imports_nothing_beyond_hwkv():
    code = ("import sys, hwkv; before = set(sys.modules); import hwkv.engine; "
            "print(sorted(set(sys.modules) - before))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['hwkv.engine']"
