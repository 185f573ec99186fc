"""Review 26 (plan caching), a side finding: `hwkv_cpu`'s `parallel_map` held torch's thread count at 1 for its call and
restored what it had read; two calls from two threads could each read and restore, and the process stayed at one
thread for good. Now the first call in flight saves the setting and the last one out restores it."""
import threading

import pytest
import torch

from hwkv_cpu import kernels_decode as kd


def test_two_threads_in_parallel_map_leave_the_thread_count_as_it_was(monkeypatch):
    """B reads the thread count (4) before A sets it to 1 and enters after; A returns first, B last: the process must
    end at 4 threads (each call restoring what it had read left it at 1)."""
    count = [4]
    a_entered, b_entered, a_done = threading.Event(), threading.Event(), threading.Event()
    calls = {"B": 0}

    def get_num_threads():
        name = threading.current_thread().name
        if name == "B":
            calls["B"] += 1
            if calls["B"] == 1:
                value = count[0]                  # B sizes its call at 4 threads ...
                assert a_entered.wait(5)          # ... then A enters and sets 1
                return value
        return count[0]

    def set_num_threads(n):
        count[0] = n

    monkeypatch.setattr(torch, "get_num_threads", get_num_threads)
    monkeypatch.setattr(torch, "set_num_threads", set_num_threads)

    def fn_a(x):
        a_entered.set()
        assert b_entered.wait(5)                  # A returns once B is inside
        return x

    def fn_b(x):
        b_entered.set()
        assert a_done.wait(5)                     # B returns after A
        return x

    errors = []

    def run(name, fn):
        try:
            assert kd.parallel_map(fn, [1, 2]) == [1, 2]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        if name == "A":
            a_done.set()

    threads = [threading.Thread(target=run, args=("A", fn_a), name="A"),
               threading.Thread(target=run, args=("B", fn_b), name="B")]
    threads[1].start()
    threads[0].start()
    for t in threads:
        t.join(10)
    assert not errors, errors
    assert count[0] == 4, f"the process was left at {count[0]} thread(s)"


def test_parallel_map_restores_the_thread_count_after_an_error():
    before = torch.get_num_threads()
    if before < 2:
        torch.set_num_threads(2)

    def boom(x):
        raise ValueError(x)

    try:
        with pytest.raises(ValueError):
            kd.parallel_map(boom, [1, 2, 3])
        assert torch.get_num_threads() == max(before, 2)
    finally:
        torch.set_num_threads(before)
