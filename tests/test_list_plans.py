"""hwkv.list_plans.ListPlans, the one rule by which the vendor backends (CPU and XPU IPEX tables, ROCm's AITER int32
lists) plan per list: eager, once per forward by the list's first reader; graph mode, into static tables at capture,
the lists read there recorded and refilled by every later graph forward, per mode where asked."""
import torch

from hwkv.list_plans import ListPlans
from hwkv.metadata import ForwardMetadata, KVIndexList

W = 4


def _list(window=None):
    return KVIndexList(torch.tensor([0, 2], dtype=torch.int32), torch.tensor([5, 6]), torch.zeros(1, dtype=torch.int64),
                       window, 2)


def _md(graph=False, decode=True):
    """A one-request forward over a full list and one window's (the fields ListPlans reads are real)."""
    i32 = torch.tensor([0, 1], dtype=torch.int32)
    return ForwardMetadata(None, None, i32, torch.zeros(1, dtype=torch.int64), _list(), {W: _list(W)}, 1, 1, decode,
                           graph=graph)


class Calls:
    """Stand-in make / fill / refill: each records (what, window) and answers a fresh plan (fill: None for the
    windows in `foreign`, lists no static table holds)."""

    def __init__(self, foreign=()):
        self.log, self.foreign, self.filled = [], set(foreign), []

    def make(self, md, kv):
        self.log.append(("make", kv.window))
        return object()

    def fill(self, md, kv):
        self.log.append(("fill", kv.window))
        self.filled.append(kv)
        return None if kv.window in self.foreign else object()

    def refill(self, md, batch, w):
        self.log.append(("refill", w, batch))
        return object()


def test_eager_plans_once_per_forward_and_list_read():
    c = Calls()
    plans = ListPlans("k", c.make, c.fill)
    for _ in range(2):  # two forwards: each plans again, once per list its layers read
        md = _md()
        plans.open(md, "batch", graph=False)
        assert md.extra["k"] == {} and plans.opened(md)
        first = plans.get(md, md.full)
        assert all(plans.get(md, md.full) is first for _ in range(3))  # the forward's other layers reuse it
        assert set(md.extra["k"]) == {None}
    assert c.log == [("make", None)] * 2
    assert not plans.recorded  # eager forwards record nothing for graph refills


def test_a_forward_not_opened_plans_nothing():
    c = Calls()
    plans = ListPlans("k", c.make, c.fill)
    off, never = _md(), _md(graph=True)  # the op off for the forward; metadata built without kernel metadata
    plans.open(off, "batch", graph=False, enabled=False)
    assert "k" not in off.extra and not plans.opened(off) and not plans.opened(never)
    assert plans.get(off, off.full) is None and plans.get(never, never.windows[W]) is None
    assert c.log == [] and not plans.recorded


def test_graph_capture_records_the_lists_read_and_every_refill_fills_them():
    c = Calls()
    plans = ListPlans("k", c.make, c.fill)
    warm = _md(graph=True)
    plans.open(warm, "batch", graph=True)  # before any capture: nothing recorded, nothing refilled
    assert warm.extra["k"] == {} and c.log == []
    plan = plans.get(warm, warm.windows[W])  # the capture warm-up's first layer reading the window list
    assert plans.get(warm, warm.windows[W]) is plan and c.log == [("fill", W)]
    assert list(plans.recorded) == [(None, W)]
    for decode, lists in ((True, [W]), (False, [W, None])):  # without per_mode, a refill of either mode fills them
        md = _md(graph=True, decode=decode)
        c.log.clear()
        plans.open(md, "batch", graph=True)
        assert set(md.extra["k"]) == set(lists) and c.log == [("fill", w) for w in lists]  # the default refill:
        own = [md.full if w is None else md.windows[w] for w in lists]
        assert all(a is b for a, b in zip(c.filled[-len(lists):], own, strict=True))  # over md's own lists
        assert plans.get(md, md.windows[W]) is md.extra["k"][W] and len(c.log) == len(lists)  # layers only read it
        plans.get(md, md.full)  # a list first read by a later graph forward: filled then, refilled from then on
    assert list(plans.recorded) == [(None, W), (None, None)]


def test_per_mode_refills_only_what_the_forwards_mode_read_and_foreign_lists_stay_off():
    c = Calls(foreign={W})
    plans = ListPlans("k", c.make, c.fill, c.refill, per_mode=True)
    warm = _md(graph=True, decode=True)
    plans.open(warm, "b0", graph=True)
    plans.get(warm, warm.full)
    assert plans.get(warm, warm.windows[W]) is None  # not a static list: the portable kernels, nothing recorded ...
    assert plans.get(warm, warm.windows[W]) is None and "k" in warm.extra and W not in warm.extra["k"]
    assert c.log == [("fill", None), ("fill", W), ("fill", W)]  # ... and asked again by the next layer
    assert list(plans.recorded) == [(True, None)]
    c.log.clear()
    dec, ext = _md(graph=True, decode=True), _md(graph=True, decode=False)
    plans.open(dec, "b1", graph=True)
    plans.open(ext, "b2", graph=True)
    assert c.log == [("refill", None, "b1")]  # the refill callable, handed the batch; the extend forward fills none
    assert set(dec.extra["k"]) == {None} and ext.extra["k"] == {}
    plans.open(_md(), "b3", graph=False)  # eager forwards never refill
    assert c.log == [("refill", None, "b1")]
