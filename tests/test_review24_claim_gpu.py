"""Review 24, on a GPU: the programs of one allocation launch run together, so the one that gives unopened claimed
pages back to the ring's tail (`hwkv_cuda.kernels.alloc._give_back`) must wait for every other's ring reads: the
interpreter runs programs one after another and cannot show it (tests/test_review24_claim.py covers the rest)."""
import pytest
import torch

from hwkv.allocator import PagedTokenToKVPoolAllocator

I64 = torch.int64
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (programs running concurrently)")]


@pytest.mark.parametrize("one_launch", [False, True], ids=["alloc_reserved", "alloc_step"])
def test_the_give_back_never_overwrites_a_page_another_program_reads(one_launch):
    """A ring all free, a claim twice the need over many programs: the tail's new entries lie exactly where the
    first programs read their pages. Every page handed out is distinct and the pool whole, launch after launch."""
    from hwkv_cuda.kernels.alloc import TritonPageOps
    dev = torch.device("cuda")
    for trial in range(3):
        p, n = (16, 8192) if not one_launch else (1, 8192)
        a = PagedTokenToKVPoolAllocator(p * n, p, dev)
        a._ops, a.immediate = TritonPageOps(), False
        if one_launch:  # 4096 decode rows at length 1: one page each, several programs
            bs = n // 2
            heads = a.reserve(2 * bs)
            staged = torch.zeros(5 + 2 * bs, dtype=I64, device=dev)
            staged[:5] = torch.tensor([heads[0], 0, bs, a.op_number, 2 * bs])
            staged[5::2] = torch.arange(bs)
            staged[6::2] = 1
            rtt = torch.zeros(bs + 1, 4, dtype=I64, device=dev)
            rows, seq, out = (torch.zeros(bs, dtype=I64, device=dev) for _ in range(3))
            a.alloc_step(staged[:5], staged[5::2], staged[6::2], bs, rtt, rows, seq, out)
        else:  # 64 requests of 64 pages each
            req = 64
            need = n // 2
            heads = a.reserve(2 * need)
            per = need // req * p
            out = torch.zeros(need * p, dtype=I64, device=dev)
            z = torch.zeros(req, dtype=I64, device=dev)
            a.alloc_reserved(z, torch.full((req,), per, dtype=I64, device=dev), z.clone(), out, heads, 2 * need)
        pages = torch.div(out, p, rounding_mode="floor")
        assert int(pages.min()) >= 1
        assert torch.unique(pages).numel() == out.numel() // p, f"trial {trial}: a page handed out twice"
        a.check_integrity()
        assert a.available_size() == p * n - out.numel() // p * p
