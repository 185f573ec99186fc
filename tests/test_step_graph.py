"""DecodeStepGraph (the whole decode step in one graph) against the same steps run eagerly: outputs token for
token, the allocator's state, req_to_token and the frontiers after every step, on the same random inputs;
buckets with padding, batches larger than every bucket, page sizes 1 and 4, a small SWA pool whose slots are
released and reused; a step that might not fit is refused before anything changes.

CPU: the step 'replays' as the host running it (EagerAdapter), and through an adapter that records device
work, so the allocation reads its ring heads from the device buffer (the Triton page ops under the
interpreter when TRITON_INTERPRET=1). HWKV_TEST_DEVICE=cuda runs it under CUDA graphs."""
import os

import pytest
import torch

import hwkv
from hwkv.allocator import SWATokenToKVPoolAllocator, same_snapshot
from hwkv.release import release_out_of_window_batch
from hwkv.batch import ForwardBatch, ForwardMode
from hwkv.errors import OutOfSlotsError, ShapeError
from hwkv.graph import EagerAdapter
from hwkv.pool import SWAKVPool
from hwkv.spec import MultiStepDraft
from hwkv.testing.capture_check import CaptureCheckingAdapter
from hwkv.step_graph import DecodeStepGraph, DraftStepGraph, VerifyStepGraph

DEVICE = os.environ.get("HWKV_TEST_DEVICE", "cpu")
COMPARE = os.environ.get("HWKV_TEST_COMPARE", DEVICE)  # "cuda" on CPU checks the GPU's comparison itself
H, KVH, D, W = 4, 2, 16, 8


class RecordingEager(EagerAdapter):
    """A host 'graph' that takes the device-side path: heads read from the device buffer."""

    records_device_work = True


class CheckedRecording(CaptureCheckingAdapter):
    """RecordingEager that also fails a replay whose launches differ from its capture's in what a device graph
    freezes (buffers, grids, scalar arguments): the step's per-step values must reach its kernels through memory."""

    records_device_work = True


def adapter():
    if DEVICE == "cuda":
        from hwkv_cuda.graph import CUDAGraphAdapter
        return CUDAGraphAdapter()
    return None


class Engine:
    """Pools, rows, a backend and 2 layers (SWA + full); requests prefilled eagerly and released."""

    def __init__(self, page, size=1024, size_swa=160, lens=(13, 30, 7, 21, 40)):
        self.page = page
        self.pool = SWAKVPool(size, size_swa, page, torch.float32, KVH, D, [0], [1], DEVICE)
        self.alloc = SWATokenToKVPoolAllocator(size, size_swa, page, DEVICE, self.pool)
        self.rtt = hwkv.ReqToTokenPool(8, 128, DEVICE)
        self.backend = hwkv.make_backend(self.pool, self.rtt, device=DEVICE, sliding_window=W)
        self.layers = [hwkv.AttentionLayer(0, H, KVH, D, sliding_window=W), hwkv.AttentionLayer(1, H, KVH, D)]
        self.frontiers = torch.zeros(8, dtype=torch.int64, device=DEVICE)
        self.rows = self.rtt.alloc(len(lens))
        i64 = dict(dtype=torch.int64, device=DEVICE)
        gen = torch.Generator().manual_seed(page)
        for r, n in zip(self.rows, lens):
            loc = self.alloc.alloc_extend([0], [n], [0], n)
            self.rtt.write(r, 0, loc)
            batch = ForwardBatch(ForwardMode.EXTEND, 1, torch.tensor([r], **i64), torch.tensor([n], **i64), loc,
                                 extend_prefix_lens=torch.tensor([0], **i64), extend_seq_lens=torch.tensor([n], **i64))
            self.backend.init_forward_metadata(batch)
            for layer in self.layers:
                k = torch.randn(n, KVH, D, generator=gen).to(DEVICE)
                self.backend.forward(torch.randn(n, H, D, generator=gen).to(DEVICE), k, k.clone(), layer, batch)
            f = self.frontiers[r:r + 1].clone()
            release_out_of_window_batch(self.alloc, self.rtt.req_to_token, torch.tensor([r], **i64),
                                        torch.tensor([n], **i64), f, W)
            self.frontiers[r] = f[0]
        self.seq = torch.tensor(lens, dtype=torch.int64)

    def layers_fn(self, batch, inputs):
        """Every layer's output side by side, [tokens, layers * H * D]: the SWA layer's too, the only one a release
        that frees in-window slots changes (tests/test_review20_graphs.py shows the comparison sees it)."""
        return torch.cat([self.backend.forward(inputs["q"], inputs["k"], inputs["v"], layer, batch)
                          .reshape(batch.num_tokens, -1) for layer in self.layers], dim=1)

    def eager_step(self, pick, inputs):
        """The reference: the eager API, one call each."""
        rows = torch.tensor([self.rows[i] for i in pick], dtype=torch.int64, device=DEVICE)
        seq_cpu = self.seq[pick] + 1
        seq = seq_cpu.to(DEVICE)
        last = self.rtt.req_to_token[rows, seq - 2]
        loc = self.alloc.alloc_decode(seq, last, seq_lens_cpu=seq_cpu)
        self.rtt.req_to_token[rows, seq - 1] = loc
        batch = ForwardBatch(ForwardMode.DECODE, len(pick), rows, seq, loc, seq_lens_cpu=seq_cpu)
        self.backend.init_forward_metadata(batch)
        out = self.layers_fn(batch, inputs).clone()
        f = self.frontiers[rows]
        release_out_of_window_batch(self.alloc, self.rtt.req_to_token, rows, seq, f, W)
        self.frontiers[rows] = f
        self.seq[pick] = seq_cpu
        return out

    def graph_step(self, graph, pick, inputs, on_host=False):
        """One step of the graph; rows and lengths from the host (sent with the control words in one copy) or
        already on the device."""
        rows = torch.tensor([self.rows[i] for i in pick], dtype=torch.int64)
        seq_cpu = self.seq[pick] + 1
        if on_host == "buffers":  # the engine wrote the inputs into the graph's buffers: nothing passed
            for k, v in inputs.items():
                graph.inputs[k][:v.shape[0]].copy_(v)
            out = graph.step(rows, seq_cpu, seq_cpu).clone()
        elif on_host:
            out = graph.step(rows, seq_cpu, seq_cpu, inputs).clone()
        else:
            out = graph.step(rows.to(DEVICE), seq_cpu.to(DEVICE), seq_cpu, inputs).clone()
        self.seq[pick] = seq_cpu
        return out

    def eager_verify(self, pick, inputs, n):
        """The reference verify: each picked request's next `n` positions through the eager API."""
        bs = len(pick)
        rows = torch.tensor([self.rows[i] for i in pick], dtype=torch.int64, device=DEVICE)
        pre_cpu = self.seq[pick].clone()
        seq_cpu, ext_cpu = pre_cpu + n, torch.full((bs,), n, dtype=torch.int64)
        pre, seq = pre_cpu.to(DEVICE), seq_cpu.to(DEVICE)
        last = self.rtt.req_to_token[rows, pre - 1]
        loc = self.alloc.alloc_extend(pre, seq, last, bs * n, prefix_lens_cpu=pre_cpu, seq_lens_cpu=seq_cpu)
        self.rtt.req_to_token[rows.unsqueeze(1), pre.unsqueeze(1) + torch.arange(n, device=DEVICE)] = loc.view(bs, n)
        batch = ForwardBatch(ForwardMode.TARGET_VERIFY, bs, rows, seq, loc, pre, ext_cpu.to(DEVICE),
                             seq_lens_cpu=seq_cpu, extend_seq_lens_cpu=ext_cpu)
        self.backend.init_forward_metadata(batch)
        return self.layers_fn(batch, inputs).clone()

    def graph_verify(self, graph, pick, inputs, n):
        rows = torch.tensor([self.rows[i] for i in pick], dtype=torch.int64)
        seq_cpu = self.seq[pick] + n
        return graph.step(rows, seq_cpu, seq_cpu, inputs).clone()

    def accept(self, pick, accepted, n):
        """After a verify of `n` tokens each: keep `accepted` drafts per request, free the rest, then the release on
        the accepted lengths (as an engine does after reading the verify's output)."""
        from hwkv.spec import accept_draft_tokens
        bs = len(pick)
        rows = torch.tensor([self.rows[i] for i in pick], dtype=torch.int64, device=DEVICE)
        pre_cpu, acc_cpu = self.seq[pick] + 1, torch.tensor(accepted, dtype=torch.int64)
        index = torch.arange(n - 1, dtype=torch.int64, device=DEVICE).expand(bs, n - 1).contiguous()
        seq = accept_draft_tokens(self.alloc, self.pool, self.rtt.req_to_token, rows, pre_cpu.to(DEVICE), index,
                                  acc_cpu.to(DEVICE), prefix_lens_cpu=pre_cpu, accept_lens_cpu=acc_cpu)
        f = self.frontiers[rows]
        release_out_of_window_batch(self.alloc, self.rtt.req_to_token, rows, seq, f, W)
        self.frontiers[rows] = f
        self.seq[pick] = pre_cpu + acc_cpu

    def draft_fn(self, steps, inputs):
        """A draft model over both layers, every step (as DraftGraphRunner's fn): inputs and output step-major."""
        outs = []
        for i in range(len(steps)):
            batch = steps.select(i)
            n = batch.batch_size
            step_in = {k: v[i * n:(i + 1) * n] for k, v in inputs.items()}
            outs.append(torch.cat([self.backend.forward(step_in["q"], step_in["k"], step_in["v"], layer, batch)
                                   .reshape(n, -1) for layer in self.layers], dim=1))
        return torch.cat(outs)

    def eager_draft(self, pick, inputs, k):
        """The reference draft: k slots per picked request at once, then `init_draft_metadata`'s k steps."""
        bs = len(pick)
        rows = torch.tensor([self.rows[i] for i in pick], dtype=torch.int64, device=DEVICE)
        pre_cpu = self.seq[pick].clone()
        pre, seq = pre_cpu.to(DEVICE), (pre_cpu + k).to(DEVICE)
        last = self.rtt.req_to_token[rows, pre - 1]
        loc = self.alloc.alloc_extend(pre, seq, last, bs * k, prefix_lens_cpu=pre_cpu, seq_lens_cpu=pre_cpu + k)
        self.rtt.req_to_token[rows.unsqueeze(1), pre.unsqueeze(1) + torch.arange(k, device=DEVICE)] = loc.view(bs, k)
        batch = ForwardBatch(ForwardMode.DECODE, bs, rows, pre + 1, loc.view(bs, k).t().reshape(-1),
                             spec_info=MultiStepDraft(k), seq_lens_cpu=pre_cpu + 1)
        return self.draft_fn(self.backend.init_draft_metadata(batch), inputs).view(k, bs, -1).clone()

    def advance(self, pick, n):
        """A verdict that keeps every one of the `n` tokens: the lengths move on, then the release on them."""
        rows = torch.tensor([self.rows[i] for i in pick], dtype=torch.int64, device=DEVICE)
        self.seq[pick] += n
        f = self.frontiers[rows]
        release_out_of_window_batch(self.alloc, self.rtt.req_to_token, rows, self.seq[pick].to(DEVICE), f, W)
        self.frontiers[rows] = f

    def state(self):
        return (self.alloc.integrity_snapshot(), self.rtt.req_to_token.cpu().clone(), self.frontiers.cpu().clone())


def same_state(a, b):
    """Equal allocator state, rows and frontiers. On a GPU the release kernel's programs push freed pages in any
    order, so the two runs' rings (and from then on their slot numbers) may differ: there the free pages and
    reference counts are compared as counts, and the frontiers exactly."""
    if COMPARE == "cpu":
        return same_snapshot(a[0], b[0]) and torch.equal(a[1][:, :100], b[1][:, :100]) and torch.equal(a[2][:5], b[2][:5])
    for pool in (p for p in a[0] if "head" in a[0][p]):  # the rings (not the full->SWA table)
        if a[0][pool]["head"] != b[0][pool]["head"] or a[0][pool]["tail"] != b[0][pool]["tail"]:
            return False
        if not torch.equal(torch.sort(a[0][pool]["refs"]).values, torch.sort(b[0][pool]["refs"]).values):
            return False
    return torch.equal(a[2][:5], b[2][:5])


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


class ThreeLaunchOps:
    """The Triton page ops without `alloc_step`: the graph allocates in three launches (prologue, alloc, write)."""

    def __init__(self):
        from hwkv_cuda.kernels.alloc import TritonPageOps
        self.ops = TritonPageOps()

    alloc_step = None

    def __getattr__(self, name):
        return getattr(self.ops, name)


@pytest.mark.parametrize("recording", [False, "one launch", "three launches"] if DEVICE == "cpu" else
                         ["one launch", "three launches"])
@pytest.mark.parametrize("page", [1, 4])
def test_whole_step_graph_equals_the_eager_step(page, recording):
    if recording and DEVICE == "cpu" and not INTERPRET:
        pytest.skip("the device-side allocation path runs the Triton page ops: TRITON_INTERPRET=1 on CPU")
    ref, got = Engine(page), Engine(page)
    if recording == "three launches":
        got.alloc._ops = ThreeLaunchOps()
        assert not got.alloc.allocates_step_in_one and got.alloc.allocates_in_graph
    if recording and DEVICE == "cpu":  # both sides through the Triton page ops (interpreted), heads from the device
        from hwkv_cuda.kernels.alloc import TritonPageOps
        ref.alloc._ops = TritonPageOps()
        if recording == "one launch":
            got.alloc._ops = TritonPageOps()
            got.alloc.immediate = False  # errors recorded on the device, as accelerators run: the release in the launch
    graph = DecodeStepGraph(got.backend, got.alloc, got.layers_fn, [2, 4],
                            {"q": ((H, D), torch.float32), "k": ((KVH, D), torch.float32),
                             "v": ((KVH, D), torch.float32)},
                            adapter() or (CheckedRecording() if recording else EagerAdapter()),
                            frontiers=got.frontiers, window=W)
    assert graph._releases_first == (recording == "one launch")
    if recording and DEVICE == "cpu":  # the device's bookkeeping kernels too (interpreted)
        from hwkv_cuda.kernels import step as step_kernels
        graph.kernels = step_kernels.KERNELS
    graph.capture()
    gen = torch.Generator().manual_seed(7)
    picks = [[0, 1, 2, 3], [1, 3, 4], [0], [0, 1, 2, 3, 4], [2, 4]] * 6  # full, padded, eager (5 > 4)
    for step, pick in enumerate(picks):
        n = len(pick)
        inputs = {"q": torch.randn(n, H, D, generator=gen).to(DEVICE),
                  "k": torch.randn(n, KVH, D, generator=gen).to(DEVICE),
                  "v": torch.randn(n, KVH, D, generator=gen).to(DEVICE)}
        want = ref.eager_step(pick, inputs)
        have = got.graph_step(graph, pick, inputs, on_host=(False, True, "buffers")[step % 3] if n <= 4 else step % 2)
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
        assert same_state(ref.state(), got.state()), f"step {step}: allocator, rows or frontiers differ"
        got.alloc.check_integrity()
    assert graph.eager_runs == 6 and graph.replays == 24
    assert int(got.frontiers.max()) > 0  # releases ran inside the step


def test_a_step_that_might_not_fit_is_refused_before_anything_changes():
    """40 full pages of 4: four requests of 32 tokens hold 32; steps to 33 and to 37 take 4 pages each (the
    last 4 free ones), the step to 41 would need 4 more: refused on the host, before the replay."""
    e = Engine(4, size=160, size_swa=160, lens=(32, 32, 32, 32))
    graph = _bucket_of_4(e)
    inputs = {"q": torch.randn(4, H, D, device=DEVICE), "k": torch.randn(4, KVH, D, device=DEVICE),
              "v": torch.randn(4, KVH, D, device=DEVICE)}
    for _ in range(8):
        e.graph_step(graph, [0, 1, 2, 3], inputs)
    assert e.alloc.full_available_size() == 0 and graph.replays == 8
    before, seq = e.state(), e.seq.clone()
    with pytest.raises(OutOfSlotsError, match="need 4 pages"):
        e.graph_step(graph, [0, 1, 2, 3], inputs)
    assert same_state(before, e.state()) and graph.replays == 8
    e.alloc.check_integrity()


def _bucket_of_4(e):
    """A captured whole-step graph of one bucket (4) over `e`'s fp32 inputs."""
    graph = DecodeStepGraph(e.backend, e.alloc, e.layers_fn, [4],
                            {"q": ((H, D), torch.float32), "k": ((KVH, D), torch.float32),
                             "v": ((KVH, D), torch.float32)}, adapter() or EagerAdapter(), e.frontiers, W)
    graph.capture()
    return graph


def test_a_bad_input_is_refused_before_any_page_is_claimed():
    e = Engine(4)
    graph = _bucket_of_4(e)
    before = e.state()
    good = {"q": torch.randn(2, H, D, device=DEVICE), "k": torch.randn(2, KVH, D, device=DEVICE)}
    for bad in (good, {**good, "v": torch.randn(2, KVH, D + 1, device=DEVICE)}):
        with pytest.raises(ShapeError, match="input 'v' must be"):
            e.graph_step(graph, [0, 4], bad)  # request 4 starts a page at 41: a page would be claimed
        assert same_state(before, e.state())
    rows, seq = torch.tensor(e.rows[:5], dtype=torch.int64), e.seq[:5] + 1
    with pytest.raises(ShapeError, match="larger than every bucket"):  # 5 > 4: no buffers to hold its inputs
        graph.step(rows, seq, seq)
    assert same_state(before, e.state())
    e.alloc.check_integrity()


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU's torch page ops are the case refused")
def test_a_device_graph_without_page_op_kernels_is_refused():
    """The torch page ops size themselves from host values: recorded into a device graph they would replay one
    step's sizes forever, so a whole-step graph over them is refused at construction."""
    from hwkv.errors import ConfigError
    e = Engine(4)
    assert e.alloc._ops is None
    rows = e.rtt.available_size()
    with pytest.raises(ConfigError, match="needs the device's page-op kernels"):
        DecodeStepGraph(e.backend, e.alloc, e.layers_fn, [4], {"q": ((H, D), torch.float32)}, RecordingEager(),
                        e.frontiers, W)
    assert e.rtt.available_size() == rows and e.backend.static is None  # nothing made


class StaticOut(EagerAdapter):
    """Runs the step, its output copied into one tensor per bucket, as a device graph returns it."""

    def capture(self, fn):
        out = fn().clone()
        return (fn, out), out

    def replay(self, graph):
        fn, out = graph
        return out.copy_(fn())


@pytest.mark.skipif(DEVICE != "cpu", reason="a host adapter")
@pytest.mark.parametrize("page", [3, 4])
def test_steps_of_one_bucket_output_return_its_live_rows(page):
    """Steps read their bucket's one output through their live rows, batch after batch of the same size or not;
    page 3 counts the steps that open a page by remainder, 4 by mask: the eager step's pages either way."""
    ref, got = Engine(page, size=240 * page, size_swa=48 * page), Engine(page, size=240 * page, size_swa=48 * page)
    graph = DecodeStepGraph(got.backend, got.alloc, got.layers_fn, [2, 4],
                            {"q": ((H, D), torch.float32), "k": ((KVH, D), torch.float32),
                             "v": ((KVH, D), torch.float32)}, StaticOut(), got.frontiers, W)
    graph.capture()
    gen = torch.Generator().manual_seed(page)
    for step, pick in enumerate([[0, 1, 2], [0, 1, 2], [0, 1, 2, 3], [1, 3], [1, 3], [4], [4], [0, 1, 2]] * 2):
        n = len(pick)
        inputs = {"q": torch.randn(n, H, D, generator=gen), "k": torch.randn(n, KVH, D, generator=gen),
                  "v": torch.randn(n, KVH, D, generator=gen)}
        want = ref.eager_step(pick, inputs)
        have = got.graph_step(graph, pick, inputs, on_host=True)
        assert have.shape[0] == n
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
        assert same_state(ref.state(), got.state()), f"step {step}: allocator, rows or frontiers differ"
    got.alloc.check_integrity()


def test_lengths_that_do_not_continue_a_request_are_refused_before_any_page_is_claimed():
    from hwkv.errors import LocError
    e = Engine(4)
    graph = _bucket_of_4(e)
    before = e.state()
    rows = torch.tensor(e.rows[:2], dtype=torch.int64)
    for seq, match in ((torch.tensor([41, 1]), "seq_lens must be >= 2, got 1"),
                       (torch.tensor([41]), "must have one entry per request")):
        with pytest.raises(LocError, match=match):
            graph.step(rows, seq, seq)
        assert same_state(before, e.state()) and graph.replays == 0


@pytest.mark.parametrize("page", [1, 4])
def test_steps_of_the_same_rows_copy_nothing_until_a_page_opens(page):
    """The replay moves its staged lengths on by one itself (`alloc_step(advance=True)`): a step of the same rows,
    one token on, that opens no page sends nothing; a page, other rows or another bucket send everything. Token for
    token and state for state the eager step's, either way."""
    if DEVICE == "cpu" and not INTERPRET:
        pytest.skip("the one-launch allocation is a Triton page op: TRITON_INTERPRET=1 on CPU")
    ref, got = Engine(page), Engine(page)
    if DEVICE == "cpu":
        from hwkv_cuda.kernels import step as step_kernels
        from hwkv_cuda.kernels.alloc import TritonPageOps
        ref.alloc._ops, got.alloc._ops = TritonPageOps(), TritonPageOps()
        got.alloc.immediate = False
    graph = DecodeStepGraph(got.backend, got.alloc, got.layers_fn, [2, 4],
                            {"q": ((H, D), torch.float32), "k": ((KVH, D), torch.float32),
                             "v": ((KVH, D), torch.float32)}, adapter() or CheckedRecording(), got.frontiers, W)
    if DEVICE == "cpu":
        graph.kernels = step_kernels.KERNELS
    graph.capture()
    assert graph._advances == {2: True, 4: True}
    sends = []
    real = graph._ring.send
    graph._ring.send = lambda dst: sends.append(1) or real(dst)
    gen = torch.Generator().manual_seed(3)
    picks = [[0, 2]] * 7 + [[0, 1, 2]] * 3 + [[0, 2]] * 3 + [[1, 3]] * 2
    expect = 0
    for step, pick in enumerate(picks):
        opens = any(int(ref.seq[i]) % page == 0 for i in pick)  # length after the step is 1 mod page
        expect += step == 0 or opens or pick != picks[step - 1] or page == 1
        n = len(pick)
        inputs = {"q": torch.randn(n, H, D, generator=gen).to(DEVICE),
                  "k": torch.randn(n, KVH, D, generator=gen).to(DEVICE),
                  "v": torch.randn(n, KVH, D, generator=gen).to(DEVICE)}
        want = ref.eager_step(pick, inputs)
        have = got.graph_step(graph, pick, inputs, on_host=True)
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
        assert same_state(ref.state(), got.state()), f"step {step}: allocator, rows or frontiers differ"
        assert len(sends) == expect, f"step {step}: {len(sends)} copies, expected {expect}"
    assert expect < len(picks) or page == 1
    got.alloc.check_integrity()


@pytest.mark.parametrize("recording,tree_verify", [(False, "extend"), (True, "extend"), (False, "decode")]
                         if DEVICE == "cpu" else [(True, "extend"), (True, "decode")])
@pytest.mark.parametrize("page", [1, 4])
def test_verify_step_graph_equals_the_eager_verify(page, recording, tree_verify):
    """VerifyStepGraph (2 drafts: 3 tokens per request) against the eager verify (extend kernels, causal) on the
    same random inputs: outputs token for token and the allocator, rows and frontiers after each verify and after
    each acceptance of a random number of drafts (which frees the rest and releases out of window); padded
    buckets and a batch larger than every bucket (run eagerly). tree_verify="decode": the graph's chain runs as
    one decode query per token over its own list."""
    if recording and DEVICE == "cpu" and not INTERPRET:
        pytest.skip("the device-side allocation path runs the Triton page ops: TRITON_INTERPRET=1 on CPU")
    ref, got = Engine(page), Engine(page)
    got.backend = hwkv.make_backend(got.pool, got.rtt, device=DEVICE, sliding_window=W, tree_verify=tree_verify)
    if recording and DEVICE == "cpu":  # the allocation reads its ring heads from the device buffer (interpreted)
        from hwkv_cuda.kernels import step as step_kernels
        from hwkv_cuda.kernels.alloc import TritonPageOps
        ref.alloc._ops, got.alloc._ops = TritonPageOps(), TritonPageOps()
    n = 3
    graph = VerifyStepGraph(got.backend, got.alloc, got.layers_fn, [2, 4],
                            {"q": ((H, D), torch.float32), "k": ((KVH, D), torch.float32),
                             "v": ((KVH, D), torch.float32)}, 2,
                            adapter() or (CheckedRecording() if recording else EagerAdapter()))
    if recording and DEVICE == "cpu":
        graph.kernels = step_kernels.KERNELS
    graph.capture()
    gen = torch.Generator().manual_seed(11 + page)
    picks = [[0, 1, 2, 3], [1, 3, 4], [0], [0, 1, 2, 3, 4], [2, 4]] * 3
    for step, pick in enumerate(picks):
        t = len(pick) * n
        inputs = {"q": torch.randn(t, H, D, generator=gen).to(DEVICE),
                  "k": torch.randn(t, KVH, D, generator=gen).to(DEVICE),
                  "v": torch.randn(t, KVH, D, generator=gen).to(DEVICE)}
        want = ref.eager_verify(pick, inputs, n)
        have = got.graph_verify(graph, pick, inputs, n)
        assert have.shape[0] == t
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
        assert same_state(ref.state(), got.state()), f"verify {step}: allocator, rows or frontiers differ"
        accepted = torch.randint(0, n, (len(pick),), generator=gen).tolist()
        ref.accept(pick, accepted, n)
        got.accept(pick, accepted, n)
        assert same_state(ref.state(), got.state()), f"accept {step}: allocator, rows or frontiers differ"
        got.alloc.check_integrity()
    assert graph.eager_runs == 3 and graph.replays == 12
    assert (graph.tree_mask is not None) == (tree_verify != "extend") == graph.decode_like(4)
    assert int(got.frontiers.max()) > 0  # the acceptances' releases ran


def test_a_verify_that_might_not_fit_or_passes_the_context_is_refused_before_anything_changes():
    """A verify of 3 tokens each needs a page per page start among its positions: refused on the host's bound of
    free pages (OutOfSlotsError) or at a length past the rows' context (LocError), before the replay."""
    from hwkv.errors import ConfigError, LocError
    e = Engine(4, size=160, size_swa=160, lens=(32, 32, 32, 32))
    with pytest.raises(ConfigError, match="drafts >= 1"):
        VerifyStepGraph(e.backend, e.alloc, e.layers_fn, [4], {"q": ((H, D), torch.float32)}, 0, adapter())
    graph = VerifyStepGraph(e.backend, e.alloc, e.layers_fn, [4],
                            {"q": ((H, D), torch.float32), "k": ((KVH, D), torch.float32),
                             "v": ((KVH, D), torch.float32)}, 2, adapter() or EagerAdapter())
    graph.capture()
    inputs = {"q": torch.randn(12, H, D, device=DEVICE), "k": torch.randn(12, KVH, D, device=DEVICE),
              "v": torch.randn(12, KVH, D, device=DEVICE)}
    e.graph_verify(graph, [0, 1, 2, 3], inputs, 3)  # 32 -> 35: one page each, the last 4 free ones...
    e.seq[:4] += 3
    assert e.alloc.full_available_size() == 4 * 4
    e.graph_verify(graph, [0, 1, 2, 3], inputs, 3)  # ...35 -> 38: none; 38 -> 41 would take 4 more than remain
    e.seq[:4] += 3
    assert graph.replays == 2
    before, seq = e.state(), e.seq.clone()
    with pytest.raises(OutOfSlotsError, match="need 4 pages"):
        e.graph_verify(graph, [0, 1, 2, 3], inputs, 3)
    rows = torch.tensor(e.rows[:2], dtype=torch.int64)
    for lens, err, match in ((torch.tensor([126, 129]), LocError, "exceed max_context_len 128"),
                             (torch.tensor([41, 3]), LocError, "verify step continues a request: seq_lens must be >= 4")):
        with pytest.raises(err, match=match):
            graph.step(rows, lens, lens, {k: v[:6] for k, v in inputs.items()})
    assert same_state(before, e.state()) and graph.replays == 2 and torch.equal(e.seq, seq)
    e.alloc.check_integrity()


def test_auto_tree_verify_runs_the_chain_decode_like_only_in_the_buckets_where_the_backend_says_it_pays():
    """tree_verify="auto": a bucket whose verify the backend would run decode-like carries the chain as a DraftTree;
    the others run the causal extend verify (no tree: the masked extend kernel is slower than the causal one)."""
    from hwkv.spec import DraftTree
    e = Engine(4)
    e.backend = hwkv.make_backend(e.pool, e.rtt, device=DEVICE, sliding_window=W, tree_verify="auto")
    e.backend.decode_like_chain_pays = lambda requests, tokens: requests <= 2
    graph = VerifyStepGraph(e.backend, e.alloc, e.layers_fn, [2, 4], {"q": ((H, D), torch.float32)}, 2, adapter())
    assert graph.decode_like(2) and not graph.decode_like(4)
    assert isinstance(graph._static_batch(2).spec_info, DraftTree) and graph._static_batch(4).spec_info is None
    assert graph._static_batch(4).forward_mode == ForwardMode.TARGET_VERIFY


@pytest.mark.parametrize("recording,k", [(False, 3), (True, 3), (False, 1), (True, 1)] if DEVICE == "cpu" else
                         [(True, 3), (True, 1)])
@pytest.mark.parametrize("page", [1, 4])
def test_draft_step_graph_equals_the_eager_draft(page, recording, k):
    """DraftStepGraph (3 draft steps of both layers) against the eager multi-step draft on the same random inputs:
    every step's outputs token for token, and the allocator, rows and frontiers after each draft and after each
    verify's verdict (the first draft and a random number of the others kept, the rest freed, then the release
    on the kept lengths); padded buckets, inputs passed or written into the graph's buffers, and a batch larger
    than every bucket (run eagerly). k = 1 takes the one-launch allocation (`alloc_step`) where the page ops have
    it, k = 3 the three launches."""
    if recording and DEVICE == "cpu" and not INTERPRET:
        pytest.skip("the device-side allocation path runs the Triton page ops: TRITON_INTERPRET=1 on CPU")
    ref, got = Engine(page), Engine(page)
    if recording and DEVICE == "cpu":
        from hwkv_cuda.kernels import step as step_kernels
        from hwkv_cuda.kernels.alloc import TritonPageOps
        ref.alloc._ops, got.alloc._ops = TritonPageOps(), TritonPageOps()
    graph = DraftStepGraph(got.backend, got.alloc, got.draft_fn, [2, 4],
                           {"q": ((H, D), torch.float32), "k": ((KVH, D), torch.float32),
                            "v": ((KVH, D), torch.float32)}, k,
                           adapter() or (CheckedRecording() if recording else EagerAdapter()))
    if recording and DEVICE == "cpu":
        graph.kernels = step_kernels.KERNELS
    graph.capture()
    gen = torch.Generator().manual_seed(23 + page)
    picks = [[0, 1, 2], [1, 3, 4], [0], [0, 1, 2, 3, 4], [2, 4]] * 2
    for step, pick in enumerate(picks):
        bs = len(pick)
        inputs = {"q": torch.randn(bs * k, H, D, generator=gen).to(DEVICE),
                  "k": torch.randn(bs * k, KVH, D, generator=gen).to(DEVICE),
                  "v": torch.randn(bs * k, KVH, D, generator=gen).to(DEVICE)}
        want = ref.eager_draft(pick, inputs, k)
        rows = torch.tensor([got.rows[i] for i in pick], dtype=torch.int64)
        seq_cpu = got.seq[pick] + k
        if step % 5 == 2:  # written step-major at the bucket's width: nothing passed
            bucket = min(b for b in graph.buckets if b >= bs)
            for name, v in inputs.items():
                graph.inputs[name][:k * bucket].view(k, bucket, *v.shape[1:])[:, :bs].copy_(v.view(k, bs, *v.shape[1:]))
            have = graph.step(rows, seq_cpu, seq_cpu).clone()
        else:
            have = graph.step(rows, seq_cpu, seq_cpu, inputs).clone()
        assert have.shape == (k, bs, 2 * H * D)
        torch.testing.assert_close(have.reshape(k, bs, -1), want, rtol=1e-5, atol=1e-5)
        assert same_state(ref.state(), got.state()), f"draft {step}: allocator, rows or frontiers differ"
        if k == 1:  # nothing to choose: the one draft stays
            ref.advance(pick, 1)
            got.advance(pick, 1)
        else:
            accepted = torch.randint(0, k, (bs,), generator=gen).tolist()
            ref.accept(pick, accepted, k)
            got.accept(pick, accepted, k)
        assert same_state(ref.state(), got.state()), f"verdict {step}: allocator, rows or frontiers differ"
        got.alloc.check_integrity()
    assert graph.eager_runs == 2 and graph.replays == 8
    assert graph._one_launch == (k == 1 and got.alloc.allocates_step_in_one)
    assert int(got.frontiers.max()) > 0


def test_a_draft_that_might_not_fit_or_is_malformed_is_refused_before_anything_changes():
    """A draft of 3 steps needs a page per page start among its positions: refused on the host's bound of free pages
    (OutOfSlotsError), at a length past the context or one that continues no request (LocError), or with inputs of
    the wrong size (ShapeError), before the replay and with the allocator, rows and frontiers unchanged."""
    from hwkv.errors import ConfigError, LocError
    e = Engine(4, size=160, size_swa=160, lens=(32, 32, 32, 32))
    shapes = {"q": ((H, D), torch.float32), "k": ((KVH, D), torch.float32), "v": ((KVH, D), torch.float32)}
    with pytest.raises(ConfigError, match="draft_steps >= 1"):
        DraftStepGraph(e.backend, e.alloc, e.draft_fn, [4], shapes, 0, adapter())
    graph = DraftStepGraph(e.backend, e.alloc, e.draft_fn, [4], shapes, 3, adapter() or EagerAdapter())
    graph.capture()
    inputs = {"q": torch.randn(12, H, D, device=DEVICE), "k": torch.randn(12, KVH, D, device=DEVICE),
              "v": torch.randn(12, KVH, D, device=DEVICE)}
    rows = torch.tensor(e.rows[:4], dtype=torch.int64)
    for _ in range(2):  # 32 -> 35 and 35 -> 38 open a page each (pages 8 and 9), the last 8 free ones...
        e.seq[:4] += 3
        graph.step(rows, e.seq[:4].clone(), e.seq[:4].clone(), inputs)
    assert e.alloc.full_available_size() == 0 and graph.replays == 2  # ...so 38 -> 41 (page 10) cannot fit
    before, seq = e.state(), e.seq.clone()
    with pytest.raises(OutOfSlotsError, match="need 4 pages"):
        graph.step(rows, seq[:4] + 3, seq[:4] + 3, inputs)
    two = torch.tensor(e.rows[:2], dtype=torch.int64)
    for lens, ins, err, match in (
            (torch.tensor([126, 129]), inputs, LocError, "exceed max_context_len 128"),
            (torch.tensor([41, 3]), inputs, LocError, "draft step continues a request: seq_lens must be >= 4"),
            (torch.tensor([41, 41]), {k_: v[:5] for k_, v in inputs.items()}, ShapeError, r"must be \[6, 4, 16\]"),
            (torch.tensor([41, 41]), {k_: v[:6] for k_, v in graph.inputs.items()}, ShapeError, "own buffer")):
        with pytest.raises(err, match=match):
            graph.step(two, lens, lens, ins)
    assert same_state(before, e.state()) and graph.replays == 2 and torch.equal(e.seq, seq)
    e.alloc.check_integrity()


@pytest.mark.parametrize("kind", ["decode", "draft"])
def test_a_batch_past_every_bucket_with_bad_inputs_is_refused_before_any_slot_is_taken(kind):
    """The eager fallback checks the inputs before it allocates: a ShapeError leaves the allocator, rows and
    frontiers as they were."""
    e = Engine(4)
    shapes = {"q": ((H, D), torch.float32), "k": ((KVH, D), torch.float32), "v": ((KVH, D), torch.float32)}
    if kind == "decode":
        graph, n = DecodeStepGraph(e.backend, e.alloc, e.layers_fn, [2], shapes, adapter(), e.frontiers, W), 1
    else:
        graph, n = DraftStepGraph(e.backend, e.alloc, e.draft_fn, [2], shapes, 3, adapter()), 3
    graph.capture()
    rows = torch.tensor(e.rows[:3], dtype=torch.int64)
    seq = e.seq[:3] + n
    short = {"q": torch.randn(3 * n - 1, H, D, device=DEVICE), "k": torch.randn(3 * n, KVH, D, device=DEVICE),
             "v": torch.randn(3 * n, KVH, D, device=DEVICE)}
    before = e.state()
    with pytest.raises(ShapeError, match="input 'q' must be"):
        graph.step(rows, seq, seq, short)
    assert same_state(before, e.state()) and graph.eager_runs == 0


@pytest.mark.skipif(DEVICE != "cpu", reason="reads the host lengths an eager 'replay' hands the metadata step")
def test_padded_requests_get_the_padding_length_on_the_host_too():
    """A step of 2 requests, then of 1 in the same bucket: the padded request's host length is the padding's
    (what the prologue gives it on the device), not the length its slot held in the step before."""
    e = Engine(4)
    shapes = {"q": ((H, D), torch.float32), "k": ((KVH, D), torch.float32), "v": ((KVH, D), torch.float32)}
    graph = DecodeStepGraph(e.backend, e.alloc, e.layers_fn, [2], shapes, EagerAdapter(), e.frontiers, W)
    graph.capture()
    gen = torch.Generator().manual_seed(3)
    for pick in ([0, 1], [2]):
        inputs = {"q": torch.randn(len(pick), H, D, generator=gen), "k": torch.randn(len(pick), KVH, D, generator=gen),
                  "v": torch.randn(len(pick), KVH, D, generator=gen)}
        e.graph_step(graph, pick, inputs, on_host=True)
    assert graph.seq_lens_cpu[:2].tolist() == [int(e.seq[2]), 1]
    assert graph.seq_lens[:2].tolist() == [int(e.seq[2]), 1]
