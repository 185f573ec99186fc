"""Sampling moved to `hwkv.engine.sampling` (the engine room); re-exported here."""
from hwkv.engine.sampling import F32_MAX, RowSampling, SamplingParams, params_tensors, sample, uniform_noise

__all__ = ["F32_MAX", "RowSampling", "SamplingParams", "params_tensors", "sample", "uniform_noise"]
