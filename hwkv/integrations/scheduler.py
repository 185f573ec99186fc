"""The runner"s scheduler moved to `hwkv.engine.scheduler` (the engine room); re-exported here."""
from hwkv.engine.scheduler import Request, Row, Scheduler, split_rows

__all__ = ["Request", "Row", "Scheduler", "split_rows"]
