"""The per-layer-translation baseline (benchmark only): what hwkv's once-per-forward translation beats.

`per_layer_backend(cls)` subclasses any device backend so that its metadata step translates
nothing, and every SWA layer's forward translates the write locs itself and rebuilds and
translates its window list, as engines did before the translation moved into the metadata
step. Kernel-specific metadata derived from the lists is rebuilt with them, so outputs stay
correct on every backend (the bench checks them against the reference like any other).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Type

import torch

from hwkv.backend import AttentionBackend
from hwkv.batch import ForwardBatch
from hwkv.layer import AttentionLayer
from hwkv.loc import KVWriteLoc, SWALocCache
from hwkv.metadata import ForwardMetadata, KVIndexList, fill_list


class _NoTranslation(SWALocCache):
    """A loc cache that leaves the write locs untranslated (the layers do it)."""

    def translate(self, loc: torch.Tensor) -> Optional[torch.Tensor]:
        self.current = None
        return None

    def refill(self, loc: torch.Tensor) -> Optional[torch.Tensor]:
        self.current = None
        return None


class PerLayerTranslation:
    """Mixin over an AttentionBackend: translation per SWA layer instead of once per forward."""

    def __init__(self, pool: Any, req_to_token_pool: Any, **options: Any) -> None:
        super().__init__(pool, req_to_token_pool, **options)  # type: ignore[call-arg]
        self.loc_cache = _NoTranslation(pool)
        self._graph_metadata = False

    def _translate_window(self, locs: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Metadata step: keep the window lists in full-pool locs (the layers translate them)."""
        return locs if out is None else out.copy_(locs)

    def init_forward_metadata(self, batch: ForwardBatch) -> ForwardMetadata:
        self._graph_metadata = False
        return super().init_forward_metadata(batch)  # type: ignore[misc]

    def init_forward_metadata_graph(self, batch: ForwardBatch, max_q_len: Optional[int] = None) -> ForwardMetadata:
        self._graph_metadata = True
        return super().init_forward_metadata_graph(batch, max_q_len)  # type: ignore[misc]

    def _layer_list(self, kv: KVIndexList, batch: ForwardBatch) -> KVIndexList:
        """Rebuild one window list from req_to_token and translate it to SWA slots."""
        indptr = torch.empty_like(kv.indptr)
        locs = torch.zeros_like(kv.indices)  # graph buffers are longer than the live list: zeros map to 0
        fill_list(self.req_to_token_pool.req_to_token, batch.req_pool_indices, batch.seq_lens.to(torch.int64),
                  kv.pos0, indptr, locs)
        swa = self.pool.translate_loc_from_full_to_swa(locs)
        # table: a backend's per-forward gather of the list (CPU) holds full-pool locs; this list is rebuilt
        return dataclasses.replace(kv, indptr=indptr, indices=swa, is_swa_slots=True, table=None)

    def _layer_metadata(self, md: ForwardMetadata, layer: AttentionLayer, batch: ForwardBatch) -> ForwardMetadata:
        swa_loc = self.pool.translate_loc_from_full_to_swa(md.write_loc.loc)
        kv = md.list_for(layer, True)
        windows: Dict[int, KVIndexList] = dict(md.windows)
        windows[layer.window] = self._layer_list(kv, batch)
        layer_md = dataclasses.replace(md, write_loc=KVWriteLoc(md.write_loc.loc, swa_loc),
                                       swa_out_cache_loc=swa_loc, windows=windows, extra=dict(md.extra))
        self.init_kernel_metadata(layer_md, batch, graph=self._graph_metadata)
        return layer_md

    def forward(self, q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                layer: AttentionLayer, batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        """SWA layers: translate write locs and window list here, then run the backend's forward."""
        md = self.forward_metadata
        if md is None or not self.is_swa_group(layer):
            return super().forward(q, k, v, layer, batch, save_kv_cache)  # type: ignore[misc]
        self.forward_metadata = self._layer_metadata(md, layer, batch)
        try:
            return super().forward(q, k, v, layer, batch, save_kv_cache)  # type: ignore[misc]
        finally:
            self.forward_metadata = md


def per_layer_backend(backend_cls: Type[AttentionBackend]) -> Type[AttentionBackend]:
    """`backend_cls` with translation per SWA layer (the benchmark's baseline; never for serving)."""
    if not (isinstance(backend_cls, type) and issubclass(backend_cls, AttentionBackend)):
        raise TypeError(f"per_layer_backend needs an AttentionBackend subclass, got {backend_cls!r}")
    return type(f"PerLayer{backend_cls.__name__}", (PerLayerTranslation, backend_cls),
                {"name": f"{backend_cls.name}+per-layer", "__doc__": PerLayerTranslation.__doc__})
