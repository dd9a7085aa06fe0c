"""The rank pool of tests/helpers/dist.py: bodies share ranks without sharing state, a failing or hanging body
reports what every rank was doing, and the next body gets working ranks."""

from __future__ import annotations

import gc
import os
import sys
import time
import types
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist import run_distributed, spawned_rank_count


def _dirty(rank: int, world_size: int) -> dict[str, Any]:
    from accelerate_zero.engine.groups import init_data_parallel_group

    init_data_parallel_group(torch.device("cpu"))
    os.environ["ACCELERATE_ZERO_TEST_LEAK"] = "1"
    torch.manual_seed(1234)
    torch.set_default_dtype(torch.float64)
    from accelerate import PartialState

    PartialState()
    return {"pid": os.getpid(), "accelerate_set": _accelerate_initialized(), "draw": torch.rand(1)}


def _look(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "group_left": dist.is_initialized(),
        "env_left": "ACCELERATE_ZERO_TEST_LEAK" in os.environ,
        "from_parent": os.environ.get("ACCELERATE_ZERO_TEST_FROM_PARENT"),
        "cwd": os.getcwd(),
        "dtype": str(torch.get_default_dtype()),
        "draw": torch.rand(1),
        "accelerate_left": _accelerate_initialized(),
    }


def _accelerate_initialized() -> bool:
    from accelerate.state import PartialState

    return PartialState._shared_state != {}


_CYCLES: list[weakref.ref] = []


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _import_and_leave_a_cycle(rank: int, world_size: int) -> None:
    # A module the rank has not seen (so the pool freezes after this body) and garbage only a collection frees.
    name = f"_heap_probe_{len(sys.modules)}"
    sys.modules[name] = types.ModuleType(name)
    _CYCLES.append(weakref.ref(_Cycle()))


def _cycles_left(rank: int, world_size: int) -> dict[str, int]:
    return {"alive": sum(ref() is not None for ref in _CYCLES), "seen": len(_CYCLES), "frozen": gc.get_freeze_count()}


def _what_the_rank_had(rank: int, world_size: int) -> dict[str, Any]:
    needed = ("transformers.trainer", "trl", "peft", "accelerate_zero.integrations.transformers")
    return {"parent": os.getppid(), "imported": [name for name in needed if name in sys.modules]}


def _fail_on_rank_1(rank: int, world_size: int) -> None:
    from accelerate_zero.engine.groups import init_data_parallel_group

    init_data_parallel_group(torch.device("cpu"))
    if rank == 1:
        raise ValueError("rank 1 gives up")
    dist.barrier()  # rank 0 waits here for a rank that will never come


def _sleep_forever(rank: int, world_size: int) -> None:
    time.sleep(3600)


def test_bodies_share_ranks_but_not_state() -> None:
    first = run_distributed(_dirty, 2)
    started = spawned_rank_count()
    second = run_distributed(_look, 2)
    assert spawned_rank_count() == started  # no new processes for the second body
    for a, b in zip(first, second, strict=True):
        assert a["pid"] == b["pid"]
        assert not (b["group_left"] or b["env_left"] or b["accelerate_left"]), b
        assert b["dtype"] == "torch.float32"
    assert all(r["accelerate_set"] for r in first)  # so there was a singleton to clear
    run_distributed(_dirty, 2)  # seeds 1234 again
    for b, again in zip(second, run_distributed(_look, 2), strict=True):
        assert torch.equal(b["draw"], again["draw"])  # every body starts from the rank's initial seed
    fresh = run_distributed(_look, 2, fresh=True)
    assert spawned_rank_count() == started + 2
    assert {r["pid"] for r in fresh}.isdisjoint(r["pid"] for r in second)


def test_imports_are_frozen_out_of_collections_but_a_body_garbage_is_freed() -> None:
    # tests/helpers/heap.py: after a body that imported modules the rank collects, then freezes what is alive.
    run_distributed(_import_and_leave_a_cycle, 2)
    for r in run_distributed(_cycles_left, 2):
        assert r["seen"] >= 1 and r["alive"] == 0, r  # frozen garbage would live for the rank's whole life
        assert r["frozen"] > 100_000, r  # torch's objects, at least, are out of the collector's view


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA devices ranks are spawned (tests/helpers/dist.py)")
def test_ranks_fork_from_a_template_that_imported_the_libraries() -> None:
    # tests/helpers/rank_template.py: the forkserver ignores an ImportError in it, which would leave every rank
    # importing on its own again (seconds of CPU each), silently
    for r in run_distributed(_what_the_rank_had, 2, fresh=True):
        assert r["parent"] != os.getpid(), r  # the forkserver's child
        assert r["imported"] == ["transformers.trainer", "trl", "peft", "accelerate_zero.integrations.transformers"], r


def test_bodies_see_pytest_environment_at_the_call(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    run_distributed(_look, 2)  # the ranks exist before the variable is set
    monkeypatch.setenv("ACCELERATE_ZERO_TEST_FROM_PARENT", "7")
    monkeypatch.chdir(tmp_path)
    for r in run_distributed(_look, 2):
        assert r["from_parent"] == "7" and r["cwd"] == str(tmp_path)


def test_a_failure_reports_every_rank_and_the_next_body_runs() -> None:
    with pytest.raises(AssertionError) as info:
        run_distributed(_fail_on_rank_1, 2, timeout=120.0)
    message = str(info.value)
    assert "rank 1 raised" in message and "rank 1 gives up" in message
    # rank 0 either still waits in the barrier (its stack) or failed there when rank 1 left (its traceback)
    assert "rank 0" in message and "barrier" in message and "_fail_on_rank_1" in message
    assert all(not r["group_left"] for r in run_distributed(_look, 2))


def test_a_hang_reports_where_each_rank_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELERATE_ZERO_TEST_TIMEOUT_SCALE", "1")
    with pytest.raises(AssertionError) as info:
        run_distributed(_sleep_forever, 2, timeout=3.0)
    message = str(info.value)
    assert "deadline of 3 s passed" in message
    assert message.count("_sleep_forever") >= 2  # both ranks' stacks
    assert len(run_distributed(_look, 2)) == 2
