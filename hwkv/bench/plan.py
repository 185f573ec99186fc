"""The pool planner's old home: re-exports `hwkv.engine.plan`, whose public names are a contract."""
from hwkv.engine.plan import (Plan, bytes_needed, cache_lock_tokens, check_flag_minimums, chunk_reserve_tokens,
                              format_bytes, parse_bytes, plan, round_up, swa_tokens_per_request)

__all__ = ["Plan", "bytes_needed", "cache_lock_tokens", "check_flag_minimums", "chunk_reserve_tokens", "format_bytes",
           "parse_bytes", "plan", "round_up", "swa_tokens_per_request"]
