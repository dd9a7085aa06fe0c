"""bench/expert_parallel.py tells the experts' bytes from the rest's as [Note: what the experts moved] says, and
checks the issue's goal (at most 1/ep of flat stage 3's expert bytes): on made-up collectives, W = 4."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest


BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("expert_parallel")
    finally:
        sys.path.remove(str(BENCH))


def test_flat_stage_3_counts_each_unit_in_proportion_of_its_experts(bench: ModuleType) -> None:
    layer, root = 1000, 400  # elements: a layer unit 60% experts, the root unit none
    calls = [("all_gather", layer * 4, 0.75), ("reduce_scatter", layer * 4, 0.75), ("all_gather", root * 4, 0.75)]
    calls.append(("all_reduce", 8, 1.5))
    got = bench._split_bytes(calls, 1, {layer: 0.6, root: 0.0})
    assert got["expert_gathers"] == got["expert_reduce_scatters"] == pytest.approx(0.6 * layer * 4 * 0.75)
    assert got["rest"] == pytest.approx(0.4 * layer * 4 * 0.75 * 2 + root * 4 * 0.75 + 12)
    assert got["expert_all_to_all"] == 0 and got["expert_total"] == pytest.approx(2 * 0.6 * layer * 3)


def test_expert_parallel_counts_the_peers_collectives_and_every_all_to_all(bench: ModuleType) -> None:
    calls = [
        ("all_gather", 100, 0.5),  # over the 2 peers (ep 2): the experts' after-step all-gather
        ("reduce_scatter", 60, 0.5),  # the experts' gradients over the peers
        ("all_gather", 200, 0.75),  # a unit of the rest, over all 4 ranks
        ("reduce_scatter", 80, 0.75),
        ("all_to_all_experts", 40, 1.0),
        ("all_to_all_expert_routes", 8, 1.0),
        ("all_to_all", 16, 1.0),  # the counts
    ]
    got = bench._split_bytes(calls, 2, {})
    assert (got["expert_gathers"], got["expert_reduce_scatters"], got["expert_all_to_all"]) == (50, 30, 64)
    assert got["rest"] == 210 and got["expert_total"] == 144


def test_the_goal_check_passes_at_one_ep_th_and_fails_above(bench: ModuleType) -> None:
    def run(total: float) -> dict:
        return {"experts": {"expert_total": total, "expert_gathers": 0.0}}

    results = {"flat3 accum 1": run(100.0), "ep2_s3 accum 1": run(50.0), "ep4_s3 accum 1": run(25.1)}
    lines = bench.checks(results, [1])
    assert lines[0].startswith("PASS: ep2_s3") and lines[1].startswith("FAIL: ep4_s3"), lines


def test_the_held_state_row_compares_each_expert_parallel_run_with_flat_stage_3(bench: ModuleType) -> None:
    def run(parameters: int) -> dict:
        return {
            "breakdown": {"parameters": parameters, "gradients": 4e6, "master_weights": 0, "optimizer_states": 8e6}
        }

    results = {"flat3 accum 1": run(4e6), "ep2_s3 accum 1": run(4e6), "ep4_s3 accum 2": run(5e6)}
    rows = bench.held_rows(results, [1, 2])
    assert rows == [
        "held state: ep2_s3 accum 1 16.00 MB vs flat3's 16.00 MB (ratio 1.0000; parameters 4.00 vs 4.00 MB)"
    ]  # no flat3 run at accumulation 2: nothing to compare ep4_s3 with
