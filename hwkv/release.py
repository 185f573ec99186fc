"""The out-of-window release: SWA slots no later query can see go back, a whole batch in one call.

Apart from the allocators (`hwkv.allocator`), which it drives through their rings, table and checks.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch

from hwkv.allocator import SWATokenToKVPoolAllocator, _distinct, _host_view, _push_on_host, _refs_view
from hwkv.checks import as_int, check_int_dtype, check_rows, check_window, values_checkable
from hwkv.errors import ConfigError, DoubleFreeError, LocError
from hwkv.pages import PageRing
from hwkv.sigint import interrupts_held
from hwkv.torch_page_ops import I64, TORCH_OPS


def release_out_of_window_batch(allocator: SWATokenToKVPoolAllocator, req_to_token: torch.Tensor,
                                req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, frontiers: torch.Tensor,
                                window: int, *, by_row: bool = False,
                                op_word: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Free, for a whole batch at once, the SWA slots no later query can see; `frontiers` (int64, one per
    request, on the pool's device) move forward in place and are returned.

    The next query of a request sits at position >= seq_len and sees keys > seq_len - W, so tokens
    below seq_len - W + 1 are dead. A frontier is page-aligned and kept one page behind that, so the
    last page (and `alloc_decode`'s continuation) always stays mapped.
    `by_row`: `frontiers` holds one frontier per req_to_token row and the batch's rows' entries move (a
    captured step keeps them there: no gather or scatter around the release); a row may repeat only where
    it releases nothing (a graph bucket's padding).
    `op_word`: an int64 device word holding the number of the op before this release (a captured step's
    allocation, staged by the host before each replay; `allocator.reserve(pages, ops=2)` numbered both), read
    when the release runs, so that its errors rank as the op after it in every replay; None: numbered here.
    """
    window = check_window(window)
    if not window:
        return frontiers
    if getattr(allocator, "_swa", None) is None:
        raise ConfigError(f"{type(allocator).__name__} has no SWA pool: an out-of-window release needs a "
                          "SWATokenToKVPoolAllocator")
    if not isinstance(frontiers, torch.Tensor) or frontiers.dtype != I64:
        raise LocError(f"frontiers must be an int64 tensor, got {getattr(frontiers, 'dtype', type(frontiers))}")
    _check_tensors(req_to_token, req_pool_indices, seq_lens)
    bs = req_pool_indices.numel() if by_row else frontiers.numel()
    if by_row and frontiers.shape != (req_to_token.shape[0],):
        raise LocError(f"by_row frontiers must hold one per req_to_token row ({req_to_token.shape[0]}), got "
                       f"{list(frontiers.shape)}")
    if not by_row and frontiers.dim() != 1:  # (one per request: the release writes them back in place)
        raise LocError(f"frontiers must be int64 [bs], one per request, got shape {list(frontiers.shape)}")
    for name, t in (("req_pool_indices", req_pool_indices), ("seq_lens", seq_lens)):
        check_int_dtype(name, t)
        if t.dim() != 1:   # (a column [bs, 1] the kernels read flat and the torch ops index by shape: refused alike)
            raise LocError(f"{name} must be 1-D [bs], got shape {list(t.shape)}")
        if t.numel() != bs:
            raise LocError(f"{name} has {t.numel()} entries, {'req_pool_indices' if by_row else 'frontiers'} has {bs}")
    for name, t in (("req_to_token", req_to_token), ("req_pool_indices", req_pool_indices),
                    ("seq_lens", seq_lens), ("frontiers", frontiers)):
        if t.device.type != allocator.device.type:
            raise LocError(f"{name} is on {t.device}, the allocator is on {allocator.device}")
    if bs == 0:
        return frontiers
    ops = allocator._ops or TORCH_OPS
    if op_word is not None and (not getattr(ops, "reads_op_word", False) or not isinstance(op_word, torch.Tensor)
                                or op_word.dtype != I64 or op_word.numel() < 1
                                or op_word.device.type != allocator.device.type):
        got = (f"{op_word.dtype} of {op_word.numel()} on {op_word.device}" if isinstance(op_word, torch.Tensor)
               else type(op_word).__name__)
        raise ConfigError(f"op_word must be an int64 tensor of >= 1 entry on {allocator.device}, read by the device's "
                          f"page-op kernels (the torch ops number the release on the host); got {got} for "
                          f"{type(ops).__name__}")
    # host checks where values are checkable (CPU; debug mode, never while a stream captures: a read there fails it)
    checks = allocator.immediate and values_checkable(frontiers)
    if by_row and (checks or not getattr(ops, "releases_by_row", False)):
        table = frontiers  # the batch's own frontiers, released as usual, then put back in their rows
        check_rows(req_pool_indices, req_to_token.shape[0])   # the gather below reads them (a bare IndexError)
        f = table[req_pool_indices]
        with interrupts_held():  # the pages and the rows' frontiers move together
            release_out_of_window_batch(allocator, req_to_token, req_pool_indices, seq_lens, f, window,
                                        op_word=op_word)
            table[req_pool_indices] = f
        return table
    if checks:
        checked = _check_release(allocator, req_to_token, req_pool_indices, seq_lens, frontiers, window)
        if allocator._on_host():  # checked on the host: applied there too
            with interrupts_held():  # counts, table rows, pushes and frontiers together
                allocator._next_op()
                _release_on_host(allocator._swa, allocator._mapping, *checked)
                frontiers.copy_(torch.from_numpy(checked[0]))
            return frontiers
    more = {} if op_word is None else {"op_word": op_word}  # (op_word: numbered by the caller's reserve)
    if by_row:
        more["by_row"] = True
    with interrupts_held():  # (the torch ops' several steps land together)
        if op_word is None:
            allocator._next_op()
        ops.release_window(allocator.pages, allocator._swa, allocator._mapping, req_to_token, req_pool_indices,
                           seq_lens, frontiers, window, **more)
    return frontiers


def _check_tensors(req_to_token: object, req_pool_indices: object, seq_lens: object) -> None:
    """The release's index arguments are tensors (LocError naming one that is not), req_to_token a 2-D integer one
    [rows, max_context_len]: host attributes only, before any of them is read."""
    for name, t in (("req_to_token", req_to_token), ("req_pool_indices", req_pool_indices), ("seq_lens", seq_lens)):
        if not isinstance(t, torch.Tensor):
            shown = repr(t) if len(repr(t)) <= 40 else repr(t)[:37] + "..."
            raise LocError(f"{name} must be a torch.Tensor, got {type(t).__name__} {shown}")
    check_int_dtype("req_to_token", req_to_token)
    if req_to_token.dim() != 2:
        raise LocError(f"req_to_token must be 2-D [rows, max_context_len], got shape {list(req_to_token.shape)} (a "
                       "single request's row is release_out_of_window's)")


def _check_release(a: SWATokenToKVPoolAllocator, rtt: torch.Tensor, rows: torch.Tensor, seq: torch.Tensor,
                   frontiers: torch.Tensor, window: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host checks of a batched release (CPU, debug mode); raise before anything changes. Returns what they
    computed: the new frontiers, and per released page entry its full page and SWA page (host arrays)."""
    p = a.page_size
    # int64 views (no copy when they already are): the checks below read them, nothing writes them
    f, s, r = _host_view(frontiers), np.asarray(_host_view(seq), np.int64), np.asarray(_host_view(rows), np.int64)
    if (f % p).any():
        raise LocError(f"frontier {int(f[(f % p) != 0][0])} is not a multiple of page_size {p}")
    if r.min() < 0 or r.max() >= rtt.shape[0]:
        i = int(np.argmax((r < 0) | (r >= rtt.shape[0])))
        raise LocError(f"request {i}: row {int(r[i])} is outside req_to_token's rows [0, {rtt.shape[0]})")
    if s.max() > rtt.shape[1]:
        i = int(np.argmax(s > rtt.shape[1]))
        raise LocError(f"request row {int(r[i])}: length {int(s[i])} is beyond req_to_token's {rtt.shape[1]} "
                       "positions")
    if f.min() < 0:
        i = int(np.argmax(f < 0))
        raise LocError(f"request row {int(r[i])}: frontier {int(f[i])} is negative")
    if s.min() < 0 or (f > s).any():   # a frontier past its length releases nothing, ever: its pages would leak
        i = int(np.argmax((s < 0) | (f > s)))
        raise LocError(f"request row {int(r[i])}: frontier {int(f[i])} must be in [0, seq_len {int(s[i])}] and the "
                       "length >= 0")
    dead = s - window + 1
    # where nothing is dead: 0 (a window near 2**63 would take (dead // p) * p - p past int64)
    new_f = np.maximum(f, np.where(dead > 0, (dead // p) * p - p, 0).clip(min=0))
    cnt = (new_f - f) // p
    total = int(cnt.sum())
    fp = sp = np.zeros(0, dtype=np.int64)
    if total:
        releasing = r[cnt > 0]  # a row may repeat only where it releases nothing (a graph bucket's padding)
        if not _distinct(releasing):
            b = np.sort(releasing)
            row = int(b[1:][b[1:] == b[:-1]][0])
            raise LocError(f"request row {row} is named twice in one release that frees its pages (each entry "
                           "would drop them again); a row may repeat only where it releases nothing")
        rr = np.repeat(np.arange(cnt.size), cnt)
        j = np.arange(total) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        loc = rtt.detach().cpu().numpy()[r[rr], f[rr] + j * p]
        a._check_free(torch.from_numpy(loc), swa_required=True)
        # each entry drops one SWA reference: requests sharing a page may drop it once per holder, no more
        fp = loc // p
        sp = a._mapping_view()[fp * p] // p  # all >= 1: checked above
        holders = _refs_view(a._swa)[sp]
        if _distinct(sp):  # each page dropped once (one page per request, no shared pages): no counting
            drops = np.ones_like(sp)
        else:
            uniq, inverse, counts = np.unique(sp, return_inverse=True, return_counts=True)
            drops = counts[inverse]
        over = drops > holders
        if over.any():
            i = int(over.argmax())
            f_page = int(fp[i])
            raise DoubleFreeError(f"this release drops the SWA slots of full page {f_page} (locs {f_page * p}..) "
                                  f"{int(drops[i])} times; they have {int(holders[i])} holder(s): "
                                  "a request's frontier is behind pages it already released, or two rows "
                                  "name one page that only one of them holds")
    return new_f, fp, sp


def _release_on_host(swa: PageRing, mapping: torch.Tensor, new_f: np.ndarray, fp: np.ndarray,
                     sp: np.ndarray) -> None:
    """A checked release applied to host tensors in place through numpy (CPU): each entry drops one reference
    to SWA page sp[i] (of full page fp[i]); a page left with none is unmapped and pushed once, in the order
    of its last entry, as `TorchPageOps.release_window` does in about thirty torch dispatches."""
    if not sp.size:
        return
    refs = swa.refs_np
    if _distinct(sp):  # each page has one entry, its last: entry order
        refs[sp] -= 1
        gone = np.flatnonzero(refs[sp] == 0)
    else:
        np.subtract.at(refs, sp, 1)
        rev_first = np.unique(sp[::-1], return_index=True)[1]
        last = np.sort(sp.size - 1 - rev_first)  # each page's last entry, in entry order
        gone = last[refs[sp[last]] == 0]
    if not gone.size:
        return
    p = swa.page_size
    mapping.numpy()[(fp[gone, None] * p + np.arange(p)).reshape(-1)] = 0
    _push_on_host(swa, sp[gone])


def release_out_of_window(allocator: SWATokenToKVPoolAllocator, token_row: torch.Tensor, seq_len: int,
                          frontier: int, window: int) -> int:
    """One request's out-of-window release (see `release_out_of_window_batch`); returns the new frontier."""
    if not isinstance(allocator, SWATokenToKVPoolAllocator):
        raise ConfigError(f"allocator must be a SWATokenToKVPoolAllocator, got {type(allocator).__name__}")
    if not isinstance(token_row, torch.Tensor) or token_row.dim() != 1:
        shape = list(token_row.shape) if isinstance(token_row, torch.Tensor) else type(token_row).__name__
        raise LocError(f"token_row must be one request's req_to_token row (a 1-D tensor), got {shape}")
    p = allocator.page_size
    if not check_window(window):
        return frontier
    for name, value in (("frontier", frontier), ("seq_len", seq_len)):
        if as_int(value) is None:
            raise LocError(f"{name} {value!r} must be an integer")
        if not -2 ** 63 <= as_int(value) < 2 ** 63:
            raise LocError(f"{name} {value} must fit int64 (below 2**63)")
    if frontier % p:
        raise LocError(f"frontier {frontier} is not a multiple of page_size {p}")
    dev = allocator.device
    f = torch.tensor([frontier], dtype=I64, device=dev)
    release_out_of_window_batch(allocator, token_row.reshape(1, -1), torch.zeros(1, dtype=I64, device=dev),
                                torch.tensor([seq_len], dtype=I64, device=dev), f, window)
    return int(f[0])
