"""Multi-step draft decode: one metadata step for k draft steps (the write locs of all steps translated
once, each window list cut from one translated list that covers every step), then k decode steps."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterator, List

import torch

from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.errors import ConfigError
from hwkv.loc import KVWriteLoc
from hwkv.metadata import ForwardMetadata, KVIndexList, cumsum_into, fill_list, window_pos0
from hwkv.spec import MultiStepDraft


@dataclass
class DraftSteps:
    """The k steps of a draft forward: iterate to run them; each step makes its metadata current on
    the backend and yields that step's DECODE batch (the one its layers' forward calls take)."""

    backend: Any
    batches: List[ForwardBatch]
    metadata: List[ForwardMetadata]

    def __len__(self) -> int:
        return len(self.batches)

    def select(self, i: int) -> ForwardBatch:
        """Make step i current (its metadata on the backend) and return its batch."""
        self.backend.forward_metadata = self.metadata[i]
        return self.batches[i]

    def __iter__(self) -> Iterator[ForwardBatch]:
        for i in range(len(self.batches)):
            yield self.select(i)


def _cut(combined: KVIndexList, comb_pos0: torch.Tensor, pos0: torch.Tensor, seq: torch.Tensor, total: int,
         window: int, max_len: int) -> KVIndexList:
    """Step list [pos0, seq) of each request, gathered (not translated) from the combined list."""
    bs = seq.shape[0]
    lens = seq - pos0
    indptr = cumsum_into(lens, torch.empty(bs + 1, dtype=torch.int32, device=seq.device))
    req = torch.repeat_interleave(torch.arange(bs, device=seq.device), lens, output_size=total)
    j = torch.arange(total, device=seq.device) - indptr[:-1].to(torch.int64)[req]
    src = combined.indptr[:-1].to(torch.int64)[req] + (pos0 - comb_pos0)[req] + j
    return KVIndexList(indptr, combined.indices[src], pos0, window, max_len, combined.is_swa_slots)


class DraftMetadataMixin:
    """`init_draft_metadata` for AttentionBackend (kept apart: it is a mode, not the template)."""

    def init_draft_metadata(self, batch: ForwardBatch) -> DraftSteps:
        """All k steps' metadata at once: one write-loc translation, one translated window list per
        window covering every step; each step's full and window lists (no further translation)."""
        info = batch.spec_info
        if not isinstance(info, MultiStepDraft) or batch.forward_mode != ForwardMode.DECODE:
            raise ConfigError("init_draft_metadata takes a DECODE batch with spec_info=MultiStepDraft(num_steps)")
        k, bs = info.num_steps, batch.batch_size
        loc = batch.out_cache_loc
        if info.writes_swa:
            write_all = self._write_loc(loc, graph=False)
        else:  # the draft has no SWA layer: nothing to translate (an SWA layer would raise MissingSWALocError)
            if getattr(self.pool, "check_write_loc", None) is not None:
                self.pool.check_write_loc(loc)
            write_all = KVWriteLoc(loc)
        seq = batch.seq_lens.to(torch.int64)
        seq_cpu, _ = batch.host_lens()
        combined: Dict[int, tuple] = {}
        if info.writes_swa:
            last = seq + (k - 1)          # lengths after the last step
            for w in self.windows:
                pos0 = window_pos0(seq - 1, w)
                lens_cpu = seq_cpu + (k - 1) - window_pos0(seq_cpu - 1, w)
                lst = self._eager_list(_Rows(batch), last, pos0, int(lens_cpu.sum()), w, int(lens_cpu.max()) if bs else 0)
                combined[w] = (lst, pos0)
        ones = torch.ones(bs, dtype=torch.int64, device="cpu")
        qo_indptr = torch.arange(bs + 1, dtype=torch.int32, device=self.device)
        batches, mds = [], []
        for i in range(k):
            seq_i, seq_i_cpu = seq + i, seq_cpu + i
            loc_i = loc[i * bs:(i + 1) * bs]
            swa_i = None if write_all.swa_loc is None else write_all.swa_loc[i * bs:(i + 1) * bs]
            step = ForwardBatch(ForwardMode.DECODE, bs, batch.req_pool_indices, seq_i, loc_i, seq_lens_cpu=seq_i_cpu)
            full = self._eager_list(step, seq_i, torch.zeros_like(seq_i), int(seq_i_cpu.sum()), None,
                                    int(seq_i_cpu.max()) if bs else 0)
            windows = {}
            for w, (lst, comb_pos0) in combined.items():
                pos0 = window_pos0(seq_i - 1, w)
                lens_cpu = seq_i_cpu - window_pos0(seq_i_cpu - 1, w)
                windows[w] = _cut(lst, comb_pos0, pos0, seq_i, int(lens_cpu.sum()), w, int(lens_cpu.max()) if bs else 0)
            md = ForwardMetadata(KVWriteLoc(loc_i, swa_i), swa_i, qo_indptr, seq_i - 1, full, windows, 1, bs, True,
                                 seq_lens_cpu=seq_i_cpu, extend_lens_cpu=ones)
            self.init_kernel_metadata(md, step, graph=False)
            batches.append(step)
            mds.append(md)
        steps = DraftSteps(self, batches, mds)
        steps.select(0)
        return steps


class _Rows:
    """The two fields `_eager_list` reads of a batch (rows and their count)."""

    def __init__(self, batch: ForwardBatch) -> None:
        self.batch_size = batch.batch_size
        self.req_pool_indices = batch.req_pool_indices
