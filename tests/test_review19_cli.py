"""Review 19 (context parallelism and the command line): the serve workload's transformers baseline collects
results by request id (transformers' `get_result(request_id=X)` answers None while another request's result
is at the head of its queue: not a failure); a hand-built CPShards has its row_index checked against its sizes;
hwkv.distributed names the device of every tensor it makes; `--serve-new 1` shows "n/a" TPOT with the reason;
`hwkv info --device ""` and a bad HWKV_DEVICE end as other subcommands do."""
from __future__ import annotations

import json
import queue
import time
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist

from hwkv import cli
from hwkv.distributed import CPShards
from hwkv.errors import ShardError

# ------------------------------------------------------------------ finding 1: results by request id


class FakeManager:
    """transformers' continuous batching manager as 5.25 behaves: results finish in reverse order of arrival,
    every other get_result finds nothing yet (None after its timeout), and get_result(request_id=X) puts a
    result of another request back and returns None."""

    def __init__(self, error: Optional[Dict[str, str]] = None, fatal: Optional[Exception] = None,
                 never: bool = False) -> None:
        self.out: "queue.Queue[Any]" = queue.Queue()
        self.pending: List[Any] = []
        self.error, self.fatal, self.never = error or {}, fatal, never
        self.background_thread_status = SimpleNamespace(fatal_error=None)
        self.calls = 0
        self.running = False
        self.warm_left_at_first_timed_add: Optional[int] = None
        self.taken: List[str] = []

    def start(self) -> None:
        self.running = True

    def is_running(self) -> bool:
        return self.running and self.background_thread_status.fatal_error is None

    def stop(self, block: bool = True) -> None:
        self.running = False

    def add_request(self, prompt: List[int], request_id: str, max_new_tokens: int, record_timestamps: bool = False
                    ) -> None:
        if not request_id.startswith("warm-up") and self.warm_left_at_first_timed_add is None:
            self.warm_left_at_first_timed_add = sum(1 for r in self.pending + list(self.out.queue)
                                                    if r.request_id.startswith("warm-up"))
        now = time.perf_counter()
        stamps = [now + 0.001 * (i + 1) for i in range(max_new_tokens)]
        self.pending.append(SimpleNamespace(request_id=request_id, error=self.error.get(request_id),
                                            timestamps=stamps, lifespan=(now, stamps[-1]),
                                            generated_tokens=list(range(max_new_tokens))))

    def get_result(self, request_id: Optional[str] = None, timeout: Optional[float] = None) -> Any:
        self.calls += 1
        if self.never:
            return None
        if self.calls % 2:  # nothing finished within the timeout yet
            if self.fatal is not None and self.out.empty():
                self.background_thread_status.fatal_error = self.fatal
            return None
        while self.pending:  # the latest request finishes first
            self.out.put(self.pending.pop())
        if self.out.empty():
            return None
        result = self.out.get()
        if request_id is not None and result.request_id != request_id:
            self.out.put(result)
            return None
        self.taken.append(result.request_id)
        return result


class FakeModel:
    def __init__(self, manager: FakeManager) -> None:
        self.manager = manager

    def init_continuous_batching(self, generation_config: Any, continuous_batching_config: Any) -> FakeManager:
        return self.manager

    def destroy_cached_continuous_batching_manager(self) -> None:
        pass


@pytest.fixture
def serve_mod():
    pytest.importorskip("transformers", reason="serve_transformers builds transformers' configs")
    from hwkv.bench import serve

    return serve


def _trace(serve, requests: int = 6, new: int = 3):
    w = serve.ServeWorkload(requests=requests, rate=0.0, prompt_len=12, new_tokens=new, system_len=4,
                            max_running=4, page_size=4)
    return w, serve.make_trace(w, 50)


def test_transformers_results_out_of_order_and_not_yet_are_collected_by_id(serve_mod):
    w, trace = _trace(serve_mod)
    manager = FakeManager()
    row = serve_mod.serve_transformers(FakeModel(manager), trace, w)
    assert row.error is None and row.requests == 6 and row.output_tokens == 6 * 3
    assert row.tpot_p50_ms is not None and row.ttft_p50_ms is not None
    # every warm-up result was taken before the first timed request went in
    assert manager.warm_left_at_first_timed_add == 0
    assert sorted(manager.taken) == sorted([f"warm-up-{k}" for k in range(6)] + [str(k) for k in range(6)])


def test_a_request_error_fails_the_baseline_naming_the_request(serve_mod):
    w, trace = _trace(serve_mod)
    with pytest.raises(RuntimeError, match=r"request 4: out of pages"):
        serve_mod.serve_transformers(FakeModel(FakeManager(error={"4": "out of pages"})), trace, w)
    with pytest.raises(RuntimeError, match=r"warm-up request warm-up-1: boom"):
        serve_mod.serve_transformers(FakeModel(FakeManager(error={"warm-up-1": "boom"})), trace, w)


def test_the_managers_fatal_error_fails_the_baseline(serve_mod):
    w, trace = _trace(serve_mod)
    with pytest.raises(RuntimeError, match=r"generation loop failed: ValueError\('kaput'\)"):
        serve_mod.serve_transformers(FakeModel(FakeManager(fatal=ValueError("kaput"))), trace, w)


def test_a_generation_loop_that_ended_fails_the_baseline(serve_mod):
    w, trace = _trace(serve_mod)
    manager = FakeManager()
    manager.start = lambda: None  # its loop never runs
    with pytest.raises(RuntimeError, match=r"generation loop stopped: 6 of 6 warm-up requests missing "
                                           r"\(first warm-up-0\)"):
        serve_mod.serve_transformers(FakeModel(manager), trace, w)


def test_no_result_within_the_deadline_fails_the_baseline(serve_mod, monkeypatch):
    w, trace = _trace(serve_mod)
    monkeypatch.setattr(serve_mod, "RESULT_STALL_S", 0.2, raising=False)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"no result for 0.2 s: 6 of 6 warm-up requests missing"):
        serve_mod.serve_transformers(FakeModel(FakeManager(never=True)), trace, w)
    assert time.monotonic() - t0 < 5


# ------------------------------------------------------------------ finding 2: a hand-built row_index


@pytest.mark.parametrize("index, why", [
    (torch.tensor([0, 0, 0]), r"row_index \[0, 0, 0\] is not the gathered row of each token for sizes \[3\] "
                              r"\(expected \[0, 1, 2\]\)"),
    (torch.tensor([0, 1, 2, 3]), r"row_index \[0, 1, 2, 3\] is not .*sizes \[1, 3\] \(expected \[0, 3, 4, 5\]\)"),
    (torch.tensor([0.0, 1.0, 2.0]), r"row_index must be an int64 tensor, got a float32 tensor"),
    (torch.tensor([True, True, True]), r"row_index must be an int64 tensor, got a bool tensor"),
    ([0, 1, 2], r"row_index must be an int64 tensor, got list"),
    (torch.zeros(3, dtype=torch.int64, device="meta"), r"row_index is on the meta device, which holds no values"),
])
def test_a_hand_built_row_index_is_checked_against_the_sizes(index, why):
    sizes = (3,) if len(index) == 3 else (1, 3)
    with pytest.raises(ShardError, match="CPShards: " + why):
        CPShards(0, sizes, row_index=index)


def test_a_right_hand_built_row_index_is_kept():
    index = torch.tensor([0, 3, 4, 5])
    assert CPShards(1, (1, 3), row_index=index).row_index is index
    assert CPShards(0, (2, 2), row_index=torch.arange(4)).row_index.tolist() == [0, 1, 2, 3]
    with pytest.raises(ShardError, match=r"expected \[0, 1, 2, 3\]"):
        CPShards(0, (2, 2), row_index=torch.tensor([1, 0, 2, 3]))


@pytest.fixture
def world_of_one(tmp_path):
    """A one-process gloo group (no other process, no spawn)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_plans_own_row_index_is_not_checked_again(world_of_one, monkeypatch):
    """cp_plan builds the row index from the agreed sizes: no host check per forward."""
    import hwkv.distributed as D

    rows = [D._plan_row(9, n, r, 2, None, "cpu", None, None, False, True)[0] for r, n in enumerate((5, 4))]
    info = {"dtype": None, "device_type": "cpu", "groups": None}
    checked = []
    real = D._checked_row_index
    monkeypatch.setattr(D, "_checked_row_index", lambda *a: checked.append(a) or real(*a))
    shards = D._shards_from(rows, 1, torch.device("cpu"), info)
    assert shards.row_index.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8] and shards.sizes == (5, 4)
    assert checked == []
    CPShards(0, (5, 4), row_index=shards.row_index)
    assert len(checked) == 1


# ------------------------------------------------------------------ finding 3: tensors name their device


@pytest.fixture
def meta_default():
    before = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(before)


def test_plan_and_row_index_under_a_meta_default_device(world_of_one, meta_default):
    from hwkv.distributed import _row_index, cp_plan

    plan = cp_plan(5)
    assert plan.sizes == (5,) and plan.row_index is None
    index = _row_index((2, 1), torch.device("cpu"))
    assert index.device.type == "cpu" and index.tolist() == [0, 1, 2]
    assert CPShards(1, (1, 2)).row_index.tolist() == [0, 2, 3]
    assert CPShards(0, (2, 1), row_index=torch.tensor([0, 1, 2], device="cpu")).row_index.device.type == "cpu"


# ------------------------------------------------------------------ nits


def test_serve_new_1_shows_tpot_as_not_applicable_with_the_reason(capsys):
    pytest.importorskip("transformers", reason="the serve workload runs a transformers model")
    args = ["bench", "--workload", "serve", "--serve-requests", "2", "--serve-rate", "0", "--serve-prompt-len", "12",
            "--serve-new", "1", "--serve-system-len", "4", "--serve-running", "2", "--page-size", "4"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "None" not in out
    row = next(line for line in out.splitlines() if line.startswith("| hwkv |"))
    assert row.split(" | ")[4:6] == ["n/a", "n/a"]
    assert "note: TPOT n/a for hwkv" in out and ": no request generated more than one token" in out
    assert cli.main(args + ["--json", "--no-baseline"]) == 0
    data = json.loads(capsys.readouterr().out)
    (hwkv,) = data["rows"]
    assert hwkv["tpot_p50_ms"] is None and hwkv["tpot_p99_ms"] is None and hwkv["ttft_p50_ms"] > 0
    assert data["notes"] == ["TPOT n/a for hwkv: no request generated more than one token (new tokens per request: "
                             "1), so there is no time between output tokens to measure (null in --json)"]


def test_serve_json_has_notes_when_there_is_nothing_to_note(serve_mod):
    w, _ = _trace(serve_mod)
    assert serve_mod.ServeResult("m", "cpu", w).to_dict()["notes"] == []


def test_info_refuses_an_empty_device_as_bench_and_verify_do(capsys):
    assert cli.main(["info", "--device", ""]) == 2
    out, err = capsys.readouterr()
    assert err.startswith("hwkv info: error: ") and "--device '' names no known device" in err
    assert out == ""


def test_info_with_a_bad_hwkv_device_names_the_subcommand(capsys, monkeypatch):
    monkeypatch.setenv("HWKV_DEVICE", "nonexistent")
    assert cli.main(["info"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hwkv info: error: ") and "HWKV_DEVICE='nonexistent'" in err
    assert "\nhwkv: error" not in err


# ---- hwkv generate: flags its run would not read, and empty prompt items --------------------------------------
def test_generate_refuses_num_draft_without_draft_before_the_model_loads(capsys):
    """`--num-draft 3` without `--draft` had run without a drafter, silently (bench refuses flags its run ignores)."""
    code = cli.main(["generate", "--model", "/nonexistent/model", "--prompt", "1,2", "--num-draft", "3"])
    err = capsys.readouterr().err
    assert code == 2 and "--num-draft 3 needs --draft (no drafter runs without it)" in err and "Traceback" not in err


@pytest.mark.parametrize("text", ["1,,2", "1, ,2", ",1", "1,2,"])
def test_generate_token_id_prompts_refuse_empty_items_as_bench_does(text):
    from hwkv.errors import ConfigError
    from hwkv.integrations.generate_cli import parse_token_ids

    with pytest.raises(ConfigError, match="has an empty item"):
        parse_token_ids(text, 100)


def test_generate_token_id_prompts_take_commas_and_spaces():
    from hwkv.integrations.generate_cli import parse_token_ids

    assert parse_token_ids(" 1, 2 3\t4,5 ", 100) == [1, 2, 3, 4, 5]
