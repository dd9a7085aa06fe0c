"""engine/step_in_flight.py's state machine on its own: which slices the worker takes, what a read waits for, the
asserted transitions, a worker's error raised where the step is waited for, and the switch's values."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from accelerate_zero.engine.shard_slice import ShardSlice
from accelerate_zero.engine.step_in_flight import OVERLAP_ENV, SliceState, StepInFlight, overlap_enabled


class _Runner:
    """Steps slices on the worker thread when `release` is set (so a test sees the step in flight), on the caller's
    thread at once (`step_direct`); `fail` raises instead."""

    on_host = True

    def __init__(self, slices: list[ShardSlice], fail: bool = False) -> None:
        self.slices, self.fail = slices, fail
        self.release = threading.Event()

    def step(self, sharded: Any, coefficient: float) -> None:
        self.step_where(sharded, coefficient, None)

    def step_where(self, sharded: Any, coefficient: float, keep: Any) -> None:
        for s in self.slices:
            if keep is None or keep(s):
                if threading.current_thread() is not threading.main_thread():
                    assert self.release.wait(10), "the test never released the worker"
                if self.fail:
                    raise OSError("disk full")
                sharded.step_slices([s], coefficient)


class _Sharded:
    def __init__(self) -> None:
        self.optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
        self.stepped: list[tuple[int, float, Any]] = []

    def step_slices(self, slices: list[ShardSlice], coefficient: float, grads: Any = None, **worker: Any) -> None:
        for s in slices:
            s.params.add_(coefficient)
            self.stepped.append((s.start, coefficient, worker.get("optimizer")))


def _slices(shard: torch.Tensor, persistent: torch.Tensor) -> list[ShardSlice]:
    cut = [(shard, 0, 4), (shard, 4, 10), (persistent, 0, 3)]
    return [ShardSlice(None, lo, hi, t[lo:hi], t[lo:hi]) for t, lo, hi in cut]  # type: ignore[arg-type]


def test_the_worker_steps_the_gated_slices_and_a_read_waits_for_its_own() -> None:
    shard, persistent = torch.zeros(10), torch.zeros(3)
    slices = _slices(shard, persistent)
    runner, sharded, then = _Runner(slices), _Sharded(), []
    flight = StepInFlight(runner, slices, torch.device("cpu"), None, "test::step")  # type: ignore[arg-type]
    flight.wait_for(shard)  # nothing in flight: returns at once
    assert flight.plan([shard])
    flight.step_direct(sharded, 2.0)  # the persistent slice, on this thread
    assert torch.equal(persistent, torch.full((3,), 2.0)) and not shard.any()
    flight.launch(sharded, 2.0, [lambda: then.append("zero_grad")])
    assert flight.running and flight.states[id(slices[0])] in (SliceState.PENDING, SliceState.STEPPING)
    with pytest.raises(AssertionError, match="settle"):
        flight.launch(sharded, 2.0, [])
    threading.Timer(0.2, runner.release.set).start()
    flight.wait_for(shard[:4])  # the first slice only, still pending when asked for
    assert flight.states[id(slices[0])] is SliceState.UPLOADED and torch.equal(shard[:4], torch.full((4,), 2.0))
    assert flight.waits == 1 and then == []
    flight.settle()
    assert then == ["zero_grad"] and torch.equal(shard, torch.full((10,), 2.0))
    assert all(state is SliceState.SETTLED for state in flight.states.values())
    # the worker stepped a private view: the user's param groups are not the ones it narrowed
    worker_optimizers = {id(o) for start, _, o in sharded.stepped if o is not None}
    assert worker_optimizers and id(sharded.optimizer) not in worker_optimizers
    assert flight.launches == 1


def test_nothing_to_overlap_and_a_runner_that_cannot_split_step_synchronously() -> None:
    shard, persistent = torch.zeros(10), torch.zeros(3)
    slices = _slices(shard, persistent)
    flight = StepInFlight(_Runner(slices), slices, torch.device("cpu"), None, "test::step")  # type: ignore[arg-type]
    assert not flight.plan([])  # no unit shard: every slice is read directly

    class Whole:  # a runner without step_where
        on_host = True

    whole = StepInFlight(Whole(), slices, torch.device("cpu"), None, "test::step")  # type: ignore[arg-type]
    assert not whole.plan([shard]) and whole.plan([shard, persistent])


def test_a_worker_error_is_raised_where_the_step_is_waited_for() -> None:
    shard = torch.zeros(10)
    slices = _slices(shard, torch.zeros(3))[:2]
    runner = _Runner(slices, fail=True)
    flight = StepInFlight(runner, slices, torch.device("cpu"), None, "test::step")  # type: ignore[arg-type]
    assert flight.plan([shard])
    flight.launch(_Sharded(), 1.0, [])
    runner.release.set()
    with pytest.raises(RuntimeError, match=f"worker thread .*{OVERLAP_ENV}=0") as raised:
        flight.wait_for(shard)
    assert isinstance(raised.value.__cause__, OSError)
    assert not flight.running
    flight.settle()  # nothing left in flight


def test_a_transition_from_the_wrong_state_is_refused() -> None:
    shard = torch.zeros(10)
    slices = _slices(shard, torch.zeros(3))
    flight = StepInFlight(_Runner(slices), slices, torch.device("cpu"), None, "test::step")  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match=r"slice \[0, 4\): cannot go pending -> stepping, it is settled"):
        flight._move(slices[:1], SliceState.PENDING, SliceState.STEPPING)


def test_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OVERLAP_ENV, raising=False)
    assert overlap_enabled(torch.device("cuda", 0)) and not overlap_enabled(torch.device("cpu"))
    monkeypatch.setenv(OVERLAP_ENV, "1")
    assert overlap_enabled(torch.device("cpu"))
    monkeypatch.setenv(OVERLAP_ENV, "0")
    assert not overlap_enabled(torch.device("cuda", 0))
    monkeypatch.setenv(OVERLAP_ENV, "yes")
    with pytest.raises(ValueError, match=f"{OVERLAP_ENV}='yes': set it to 1"):
        overlap_enabled(torch.device("cpu"))


def test_chunks_follow_the_buckets_across_param_groups() -> None:
    """A unit's weights (group 0) and its bias (group 1) are stepped together, units in order: the first unit of the
    next forward does not wait for every other unit's weights."""
    from accelerate_zero.offload.pipelined_step import cut_chunks

    first, second = object(), object()
    values = torch.zeros(40)

    def piece(bucket: object, lo: int, hi: int) -> ShardSlice:
        return ShardSlice(bucket, lo, hi, values[lo:hi], values[lo:hi])  # type: ignore[arg-type]

    weights = [piece(first, 0, 10), piece(second, 10, 20)]
    biases = [piece(first, 20, 22), piece(second, 22, 24)]
    chunks = cut_chunks([weights, biases], chunk_numel=12)
    assert [[(g, s.start) for g, s in chunk] for chunk in chunks] == [[(0, 0), (1, 20)], [(0, 10), (1, 22)]]
