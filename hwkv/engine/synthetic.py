"""A model with a real model's attention shapes and no weights of its size, for the engine (`ModelStep`).

`SyntheticModel`: in every layer the queries, keys and values of a token are a fixed function of (token id,
position, layer): rows of seeded random tables (one per layer geometry, each layer reading them at its own
offset), queries and keys rotated by their position (RoPE). hwkv's backend stores and attends them as it does a
real model's, window, sinks, soft-cap and GQA included. The logits read every layer's output (a small readout
per layer, summed, then an unembedding), so every layer's attention decides the sampled token.

Because K/V depend only on the token sequence, `ReferenceCheck` can recompute a request's attention densely
with `hwkv.reference` from its token ids alone and compare it with what the engine computed: cached prefixes
(K/V written by another request), released windows and reused slots included.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from hwkv import reference
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.engine.presets import ModelShape
from hwkv.errors import ConfigError, ReferenceMismatchError
from hwkv.layer import AttentionLayer

Geometry = Tuple[int, int, int, int]  # (heads, kv heads, head dim, v head dim)
# the token ids a request row holds before the forward being checked (prompt and read outputs); None: a row no request
# holds (a graph's padding), not checked
History = Callable[[int], Optional[Sequence[int]]]


def layer_geometry(shape: ModelShape, layer_id: int) -> Geometry:
    """(heads, kv heads, head dim, v head dim) of one layer of `shape`."""
    if shape.layer_is_swa[layer_id]:
        return shape.swa_num_heads, shape.swa_num_kv_heads, shape.swa_head_dim, shape.swa_v_head_dim
    return shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.v_head_dim


class SyntheticModel:
    """`model(batch, ids, positions, keep) -> logits [K, vocab]` over `backend` (the engine's), see the module.

    `positions`: positions run (the engine's context; RoPE's angles are tabled for them); `tables`: rows of each
    random table (token ids index them modulo this); `readout`: the width of each layer's readout. `check` (a
    `ReferenceCheck`, set after the engine exists) runs on the forwards it picks."""

    def __init__(self, shape: ModelShape, backend: object, *, vocab_size: int, dtype: torch.dtype,
                 device: Union[str, torch.device], positions: int, seed: int = 0, tables: int = 1024,
                 readout: int = 64, rope_base: float = 10000.0) -> None:
        for name, value, low in (("vocab_size", vocab_size, 2), ("positions", positions, 1), ("tables", tables, 1),
                                 ("readout", readout, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"synthetic model: {name} must be an integer >= {low}, got {value!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ConfigError(f"synthetic model: seed must be an integer in [0, 2**63), got {seed!r}")
        if not rope_base > 1:
            raise ConfigError(f"synthetic model: rope_base must be > 1, got {rope_base!r}")
        self.shape, self.backend, self.vocab_size, self.dtype = shape, backend, vocab_size, dtype
        self.device = torch.device(device)
        self.rows, self.positions, self.rope_base = tables, positions, float(rope_base)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        try:   # the device type autocast may run on (None: one torch has no autocast for)
            torch.is_autocast_enabled(self.device.type)
            self._amp: Optional[str] = self.device.type
        except (RuntimeError, ValueError):
            self._amp = None

        def randn(*size: int, scale: float = 1.0) -> torch.Tensor:  # drawn on the host: the same on every device
            return (torch.randn(*size, generator=gen, dtype=torch.float32, device="cpu") * scale).to(self.device)

        self.layers: List[AttentionLayer] = []
        self._tables: Dict[Geometry, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._readout: List[torch.Tensor] = []
        for i, swa in enumerate(shape.layer_is_swa):
            h, kvh, d, dv = g = layer_geometry(shape, i)
            if g not in self._tables:
                self._tables[g] = (randn(tables, h, d), randn(tables, kvh, d), randn(tables, kvh, dv))
            has_sinks = shape.swa_sinks if swa else shape.sinks
            sinks = randn(h) if has_sinks else None
            self.layers.append(AttentionLayer(i, h, kvh, d, scaling=shape.scaling, v_head_dim=dv,
                                              sliding_window=shape.window if swa else None,
                                              logit_cap=shape.logit_cap, sinks=sinks))
            self._readout.append(randn(h * dv, readout, scale=(h * dv) ** -0.5))
        self._unembed = randn(readout, vocab_size, scale=readout ** -0.5)
        self._rope_tables: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self.forwards = 0
        self.check: Optional["ReferenceCheck"] = None

    def _rope(self, x: torch.Tensor, pos: torch.Tensor,
              rot: Optional[Dict[int, Tuple[torch.Tensor, torch.Tensor]]] = None) -> torch.Tensor:
        """x [T, heads, D] rotated by each token's position (pairs (i, i + D/2); an odd last dim stays). `rot`: the
        positions' cos and sin per head dim, gathered once per forward and shared by its layers."""
        d = x.shape[-1]
        half = d // 2
        if half == 0:
            return x
        cs = rot.get(d) if rot is not None else None
        if cs is None:
            cos, sin = self._angles(d)
            cs = (cos[pos][:, None], sin[pos][:, None])
            if rot is not None:
                rot[d] = cs
        c, s = cs
        a, b = x[..., :half], x[..., half:2 * half]
        return torch.cat([a * c - b * s, a * s + b * c, x[..., 2 * half:]], dim=-1)

    def _angles(self, d: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [positions, d // 2] of every position for head dim d, made once."""
        table = self._rope_tables.get(d)
        if table is None:
            half = d // 2
            inv = self.rope_base ** (-torch.arange(half, dtype=torch.float32, device="cpu") / half)
            ang = torch.arange(self.positions, dtype=torch.float32, device="cpu")[:, None] * inv
            table = self._rope_tables[d] = (ang.cos().to(self.device), ang.sin().to(self.device))
        return table

    def qkv(self, layer_id: int, ids: torch.Tensor, pos: torch.Tensor, queries: Optional[int] = None,
            rot: Optional[Dict[int, Tuple[torch.Tensor, torch.Tensor]]] = None
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer `layer_id`'s q [T, H, D], k [T, KVH, D], v [T, KVH, Dv] of tokens `ids` at `pos`, in the model's
        dtype; with `queries`, q of the last that many tokens only. `rot`: a forward's shared rotations (`_rope`)."""
        q_t, k_t, v_t = self._tables[layer_geometry(self.shape, layer_id)]
        rows = (ids + 7919 * layer_id) % self.rows  # each layer reads the tables at its own offset
        qs = slice(None) if queries is None else slice(len(ids) - queries, None)
        q = self._rope(q_t[rows[qs]], pos[qs], rot if queries is None else None)
        k = self._rope(k_t[rows], pos, rot)
        return q.to(self.dtype), k.to(self.dtype), v_t[rows].to(self.dtype)

    def __call__(self, batch: ForwardBatch, ids: torch.Tensor, pos: torch.Tensor,
                 keep: Union[int, torch.Tensor]) -> torch.Tensor:
        """Every layer stores and attends through the backend; logits [K, vocab] fp32 at `keep` (0: every token),
        whatever the caller's autocast (it ran the readouts in bf16: other greedy tokens)."""
        if self._amp is not None and torch.is_autocast_enabled(self._amp):
            with torch.autocast(self._amp, enabled=False):
                return self._forward(batch, ids, pos, keep)
        return self._forward(batch, ids, pos, keep)

    def _forward(self, batch: ForwardBatch, ids: torch.Tensor, pos: torch.Tensor,
                 keep: Union[int, torch.Tensor]) -> torch.Tensor:
        self.forwards += 1
        pick = self.check.pick(batch, ids) if self.check is not None and self.check.due(self.forwards - 1) else None
        outs: List[torch.Tensor] = []  # the checked queries' outputs, per layer
        acc: Optional[torch.Tensor] = None
        rot: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # the positions' rotations, once per forward
        for layer, readout in zip(self.layers, self._readout):
            q, k, v = self.qkv(layer.layer_id, ids, pos, rot=rot)
            out = self.backend.forward(q, k, v, layer, batch)
            if pick is not None:
                outs.append(out.index_select(0, pick.index))
            kept = out if isinstance(keep, int) else out.index_select(0, keep)
            part = kept.reshape(kept.shape[0], readout.shape[0]).to(torch.float32) @ readout
            acc = part if acc is None else acc + part
        if pick is not None:
            self.check.run(pick, outs)
        return acc @ self._unembed


class ReferenceCheck:
    """Every `every`-th forward of `model` (the first included), the last `queries` queries of the first
    `requests` requests of the batch, every layer, recomputed densely by `hwkv.reference` from the requests'
    token ids (`history(row)`: the ids a row holds before the forward; the forward's own come from its inputs)
    and compared with the backend's outputs. A difference beyond the dtype's tolerance raises
    ReferenceMismatchError naming the forward, request row, layer and error."""

    def __init__(self, model: SyntheticModel, history: History, *, every: int, requests: int = 2,
                 queries: int = 4, tolerance: Optional[float] = None) -> None:
        for name, value in (("every", every), ("requests", requests), ("queries", queries)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"reference check: {name} must be an integer >= 1, got {value!r}")
        self.model, self.history = model, history
        self.every, self.requests, self.queries = every, requests, queries
        self.tolerance = tolerance if tolerance is not None else (2e-3 if model.dtype == torch.float32 else 3e-2)
        self.forwards_checked = 0
        self.requests_checked = 0
        self.queries_checked = 0
        self.max_err = 0.0

    def due(self, forward: int) -> bool:
        return forward % self.every == 0

    def pick(self, batch: ForwardBatch, ids: torch.Tensor) -> "Pick":
        """Before the layers: the requests checked, their token ids (history and this forward's inputs) and the
        packed rows of their last queries, which the model keeps from each layer's output."""
        n = min(self.requests, batch.batch_size)
        rows = batch.req_pool_indices[:n].tolist()
        seq = _host_lens(batch.seq_lens_cpu, batch.seq_lens, n)
        ext = [1] * n if batch.forward_mode == ForwardMode.DECODE else \
            _host_lens(batch.extend_seq_lens_cpu, batch.extend_seq_lens, n)
        forward = self.model.forwards - 1
        keep: List[int] = []
        requests: List[Tuple[int, List[int], int, int]] = []
        end = 0
        for row, length, new in zip(rows, seq, ext):
            end += new
            prefix = length - new
            held = self.history(row)
            if held is None:  # a row no request holds: a graph's padding of its batch to the bucket
                continue
            known = list(held)
            if len(known) < prefix:
                raise ReferenceMismatchError(f"reference check, forward {forward}: request row {row} holds {prefix} "
                                             f"tokens but its history has {len(known)}")
            nq = min(self.queries, new)
            keep += range(end - nq, end)
            requests.append((row, known[:prefix] + ids[end - new:end].tolist(), length, nq))
        index = torch.tensor(keep, dtype=torch.int64, device="cpu").to(self.model.device)
        return Pick(forward, batch.forward_mode, index, requests)

    def run(self, pick: "Pick", outs: Sequence[torch.Tensor]) -> None:
        """Compare the picked queries' outputs (one tensor per layer, [len(pick.index), H, Dv]) with the reference."""
        m, dev = self.model, self.model.device
        start = 0
        for row, ids, length, nq in pick.requests:
            tokens = torch.tensor(ids, dtype=torch.int64, device="cpu").to(dev)
            positions = torch.arange(length, dtype=torch.int64, device=dev)
            q_pos = torch.arange(length - nq, length, dtype=torch.int64, device="cpu")
            for layer, out in zip(m.layers, outs):
                q, k, v = m.qkv(layer.layer_id, tokens, positions, queries=nq)
                ref = reference.attention(q, k, v, q_pos, positions.cpu(), layer.scaling, layer.window,
                                          layer.logit_cap, layer.sinks)
                err = (out[start:start + nq].float().cpu() - ref).abs().max().item()
                if not math.isfinite(err) or err > self.tolerance:
                    kind = f"SWA W={layer.window}" if layer.window else "full"
                    raise ReferenceMismatchError(
                        f"forward {pick.forward} ({pick.mode.name}), request row {row} at length {length}, layer "
                        f"{layer.layer_id} ({kind}): max |out - reference| = {err:.3g} > tolerance {self.tolerance}")
                self.max_err = max(self.max_err, err)
            start += nq
            self.requests_checked += 1
            self.queries_checked += nq
        self.forwards_checked += 1


@dataclass(frozen=True)
class Pick:
    """What one checked forward compares: its number and mode, the packed rows kept from each layer's output, and
    per request (row, token ids up to the forward's end, length, queries checked)."""

    forward: int
    mode: ForwardMode
    index: torch.Tensor
    requests: List[Tuple[int, List[int], int, int]]


def _host_lens(host: Optional[torch.Tensor], dev: Optional[torch.Tensor], n: int) -> List[int]:
    """A batch's lengths as host ints: its host copy when the engine gave one, else read from the device."""
    src = host if host is not None else dev
    if src is None:
        raise ConfigError("reference check: the batch carries no lengths")
    return [int(x) for x in src[:n].tolist()]


def engine_history(engine: object) -> History:
    """`history` for a ReferenceCheck over an `hwkv.engine.engine.Engine`: its `tokens_of` (the running request in
    that row, its prompt and the outputs the host has read, at least every token before the forward); None for the
    engine's padding row, which a whole-step graph's padded requests name (nothing to check there)."""
    pad, tokens_of = engine.pad_row, engine.tokens_of  # type: ignore[attr-defined]
    return lambda row: None if row == pad else tokens_of(row)
