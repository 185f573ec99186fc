"""The runner"s counters moved to `hwkv.engine.stats` (the engine room); re-exported here."""
from hwkv.engine.stats import RunnerStats

__all__ = ["RunnerStats"]
