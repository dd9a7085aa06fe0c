"""UnitScheduler on a one-rank group: which units the module hooks gather before a forward runs and release after it,
what prefetching issues ahead within `prefetch_numel` and `max_live_numel`, what backward gathers again, and what
`blocked_seconds` counts. Every check reads the units' states and the values the modules compute with, not how the
scheduler keeps its books.

The model is a chain of three `Linear(4, 4)` units (24 elements each once padded) under a root unit without
parameters; the execution-order trace is [root, 0, 1, 2], so prefetching starts at the second forward."""

from __future__ import annotations

import copy
import logging
import time

import pytest
import torch
from torch import nn

from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.engine.host_copies import CopyDone, HostCopies
from accelerate_zero.engine.stage3.flat_unit import build_flat
from accelerate_zero.engine.stage3.hooks import register_unit_hooks
from accelerate_zero.engine.stage3.param_unit import ParamUnit, UnitState
from accelerate_zero.engine.stage3.schedule import UnitScheduler


DP = DataParallelGroup(group=None, rank=0, world_size=1)
CPU = torch.device("cpu")
N = 24
"""Elements of one unit: Linear(4, 4) holds 20, padded to a multiple of the shard alignment."""
S, G = UnitState.SHARDED, UnitState.GATHERED


class Probe(nn.Linear):
    """A Linear that appends its index to `seen` when its forward runs (the order in which units ran)."""

    def __init__(self, index: int, seen: list) -> None:
        super().__init__(4, 4)
        self.index, self.seen = index, seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.index)
        return super().forward(x)


class Chain(nn.Module):
    def __init__(self, seen: list) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Probe(i, seen) for i in range(3))
        self.skip: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i != self.skip:
                x = torch.tanh(layer(x))
        return x.sum()


class Scheduled:
    """The chain with its units, hooks and scheduler; `snapshots[i]` holds the layers' states during each run of
    layer i, `live` the elements gathered (or gathering) then."""

    def __init__(self, copies: HostCopies | None = None, **limits: int) -> None:
        torch.manual_seed(0)
        self.seen: list[int] = []
        self.reference = Chain([])
        self.model = copy.deepcopy(self.reference)
        for layer in self.model.layers:
            layer.seen = self.seen
        self.layers = [
            ParamUnit(
                i, f"layers.{i}", layer, build_flat(list(layer.parameters()), 0, 1, torch.float32, CPU), None, None
            )
            for i, layer in enumerate(self.model.layers)
        ]
        assert all(unit.numel == N for unit in self.layers)
        self.root = ParamUnit(3, "", self.model, None, None, None)
        kwargs = {"prefetch_numel": 0, "max_live_numel": 10**9, "max_reuse_distance": 0} | limits
        self.scheduler = UnitScheduler([*self.layers, self.root], self.root, DP, CommStats(), copies=copies, **kwargs)
        self.handles = register_unit_hooks([*self.layers, self.root], self.scheduler)
        self.snapshots: dict[int, list[list[UnitState]]] = {0: [], 1: [], 2: []}
        self.live: list[int] = []
        self.weights_ok: list[bool] = []
        for layer in self.model.layers:
            layer.register_forward_pre_hook(self._snapshot)  # appended: runs after the scheduler's pre-hook

    def states(self) -> list[UnitState]:
        return [unit.state for unit in self.layers]

    def _snapshot(self, module: Probe, args: tuple) -> None:
        self.snapshots[module.index].append(self.states())
        self.live.append(sum(u.numel for u in self.layers if u.state is not S))
        ref = self.reference.layers[module.index]
        self.weights_ok.append(torch.equal(module.weight, ref.weight) and torch.equal(module.bias, ref.bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.model(x)
        self.reference.skip = self.model.skip
        assert torch.equal(out, self.reference(x)), "the gathered weights computed another output"
        return out


X = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))


def test_each_unit_is_gathered_for_its_own_forward_and_released_after_it() -> None:
    run = Scheduled()
    assert run.states() == [S, S, S]
    run.forward(X)
    assert run.seen == [0, 1, 2] and all(run.weights_ok)
    assert run.snapshots == {0: [[G, S, S]], 1: [[S, G, S]], 2: [[S, S, G]]}
    assert run.states() == [S, S, S] and run.root.state is S
    assert all(layer.weight.numel() == 0 for layer in run.model.layers), "released units hold no parameters"


@pytest.mark.parametrize(("max_live", "last_kept"), [(10**9, True), (10, False)])
def test_a_unit_used_again_within_the_reuse_distance_stays_gathered(max_live: int, last_kept: bool) -> None:
    # With backward to follow, layer 2's next use is its own backward (nothing in between: distance 0) and layer
    # 1's comes after layer 2's forward and backward (2 * 24 elements): a distance of 30 keeps only layer 2, and only
    # while max_live_numel allows it. The first forward has no trace yet, so it releases everything.
    run = Scheduled(max_reuse_distance=30, max_live_numel=max_live)
    run.forward(X)
    assert run.states() == [S, S, S]
    run.forward(X)
    assert run.states() == [S, S, G if last_kept else S]
    run.scheduler.end_backward()
    assert run.states() == [S, S, S]


def test_the_first_forward_prefetches_nothing() -> None:
    run = Scheduled(prefetch_numel=10**9)
    run.forward(X)
    assert run.snapshots == {0: [[G, S, S]], 1: [[S, G, S]], 2: [[S, S, G]]}


@pytest.mark.parametrize(
    ("budget_in_units", "ahead_of_layer_0"),
    [
        (0.0, 0),  # a budget of 0 turns prefetching off
        (0.25, 1),  # [Note: a prefetch budget smaller than a unit]: the next unit is still issued
        (1.0, 1),
        (2.0, 2),
    ],
)
def test_prefetch_issues_the_next_units_within_the_budget(budget_in_units: float, ahead_of_layer_0: int) -> None:
    run = Scheduled(prefetch_numel=int(budget_in_units * N))
    run.forward(X)  # records the trace
    run.forward(X)
    during_layer_0 = run.snapshots[0][1]
    assert during_layer_0[0] is G
    issued = [state is not S for state in during_layer_0[1:]]
    assert issued == [i < ahead_of_layer_0 for i in range(2)], during_layer_0
    during_layer_1 = run.snapshots[1][1]
    assert during_layer_1[:2] == [S, G] and (during_layer_1[2] is not S) == (ahead_of_layer_0 > 0)
    assert all(run.weights_ok)


def test_max_live_parameters_bounds_what_prefetching_gathers() -> None:
    unbounded = Scheduled(prefetch_numel=10**9)
    bounded = Scheduled(prefetch_numel=10**9, max_live_numel=2 * N + N // 2)
    for run in (unbounded, bounded):
        run.forward(X)
        run.forward(X)
        assert all(run.weights_ok)
    assert max(unbounded.live) == 3 * N, "without the bound the root's prefetch issues every layer"
    assert max(bounded.live) == 2 * N
    assert bounded.snapshots[0][1] == [G, UnitState.GATHERING, S]


def test_backward_gathers_released_units_again_and_end_backward_releases_all() -> None:
    run = Scheduled()
    out = run.forward(X)
    assert run.states() == [S, S, S]
    out.backward()
    grads = [(layer.weight.grad.clone(), layer.bias.grad.clone()) for layer in run.model.layers]
    run.reference.zero_grad()
    run.reference(X).backward()
    for (weight, bias), ref in zip(grads, run.reference.layers, strict=True):
        assert torch.equal(weight, ref.weight.grad) and torch.equal(bias, ref.bias.grad)
    assert any(state is not S for state in run.states()), "backward gathered the units (no bucket releases them here)"
    run.scheduler.end_backward()
    assert run.states() == [S, S, S] and run.scheduler.live_numel() == 0


def test_release_all_releases_gathered_and_gathering_units() -> None:
    run = Scheduled(max_reuse_distance=30)
    run.forward(X)
    run.forward(X)  # layer 2 stays gathered
    run.layers[0].unshard(DP, CommStats())  # a gather in flight
    assert run.states() == [UnitState.GATHERING, S, G]
    run.scheduler.release_all()
    assert run.states() == [S, S, S] and run.scheduler.live_numel() == 0


class SlowCopies(HostCopies):
    """Host copies that take `delay` seconds each: a shard brought in for a gather costs measurable time."""

    def __init__(self, delay: float) -> None:
        super().__init__(CPU)
        self.delay = delay

    def to_device(self, source: torch.Tensor) -> tuple[torch.Tensor, CopyDone]:
        time.sleep(self.delay)
        return super().to_device(source)


def test_blocked_seconds_counts_gathers_waited_for_not_prefetched_ones() -> None:
    delay = 0.1
    run = Scheduled(copies=SlowCopies(delay), prefetch_numel=10**9)
    assert run.scheduler.blocked_seconds == 0.0
    run.forward(X)  # no trace yet: each layer is gathered when its forward needs it
    first = run.scheduler.blocked_seconds
    assert first >= 3 * delay
    start = time.perf_counter()
    run.forward(X)  # the root's pre-hook issues every layer ahead; no forward waits for their copies
    assert time.perf_counter() - start >= 3 * delay, "the copies did run (in the prefetch)"
    second = run.scheduler.blocked_seconds - first
    assert second < delay, f"{second=}: a prefetched gather was counted as blocking"


def test_a_forward_in_another_order_becomes_the_trace(caplog: pytest.LogCaptureFixture) -> None:
    run = Scheduled(prefetch_numel=N)
    run.forward(X)
    run.model.skip = 1
    with caplog.at_level(logging.WARNING, logger="accelerate_zero.engine.stage3.schedule"):
        run.forward(X)  # follows the trace at layer 0 (prefetches layer 1), then leaves it
    assert "order in which modules ran changed" in caplog.text
    run.scheduler.end_backward()  # layer 1 was prefetched but not run
    run.forward(X)
    assert run.seen[-2:] == [0, 2] and all(run.weights_ok)
    assert run.snapshots[0][-1][1:] == [S, UnitState.GATHERING], "the new trace prefetches layer 2 after layer 0"


def test_sub_module_calls_that_do_not_nest_raise() -> None:
    run = Scheduled()
    scheduler, (a, b, _) = run.scheduler, run.layers
    entered_a, began = scheduler.enter(1, [a])
    entered_b, _ = scheduler.enter(2, [b])
    assert began and run.states() == [G, G, S]
    with pytest.raises(AssertionError, match="forwards must nest"):
        scheduler.leave(entered_a, began)
    scheduler.leave(entered_b, False)
    scheduler.leave(entered_a, began)
    assert run.states() == [S, S, S]
