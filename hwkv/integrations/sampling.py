"""Sampling moved to `hwkv.engine.sampling` (the engine room); re-exported here."""
from hwkv.engine.sampling import SamplingParams, params_tensors, sample, uniform_noise

__all__ = ["SamplingParams", "params_tensors", "sample", "uniform_noise"]
