"""`hwkv plan` and `hwkv bench`: model presets, pool sizing and benchmarks (no device needed for presets/plan)."""
