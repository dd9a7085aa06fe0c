"""bench/report's pure-Python parts: the RESULTS.md tables, the estimate-honesty verdict and the plot data.

Made-up readings only: nothing is launched and neither torch nor matplotlib is needed by the code under test.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


BENCH = Path(__file__).resolve().parents[2] / "bench"
PARAMS = 1000
KINDS = ("parameters", "gradients", "master_weights", "optimizer_states")


@pytest.fixture(scope="module")
def sections() -> ModuleType:
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("report_sections")
    finally:
        sys.path.remove(str(BENCH))


def _breakdown(stage: int, world_size: int, scale: float = 1.0) -> dict[str, int]:
    replicated, sharded = {0: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)}[stage]
    total = int(scale * PARAMS * (replicated + sharded / world_size))
    out = {"parameters": total // 4, "gradients": total // 4, "master_weights": 0}
    out["optimizer_states"] = total - out["parameters"] - out["gradients"]
    out["total"] = total
    return out


def _sweep(world_sizes: list[int]) -> dict[int, list[dict[str, Any]]]:
    return {
        w: [
            {
                "rank": rank,
                "params": PARAMS,
                "stages": {
                    str(stage): {
                        "memory_breakdown": _breakdown(stage, w),
                        "live_tensor_bytes": _breakdown(stage, w)["total"] + 64,
                        "rss_bytes": 2 * _breakdown(stage, w)["total"],
                    }
                    for stage in range(4)
                },
            }
            for rank in range(w)
        ]
        for w in world_sizes
    }


def _estimates(world_sizes: list[int], off: tuple[int, int, int] | None = None) -> dict:
    return {
        (stage, w, rank): _breakdown(stage, w, 1.12 if (stage, w, rank) == off else 1.0)
        for w in world_sizes
        for stage in range(4)
        for rank in range(w)
    }


def test_honest_estimate_passes_and_one_rank_12_percent_off_fails(sections: ModuleType) -> None:
    rows = sections.sweep_rows(_sweep([1, 2]), _estimates([1, 2]))
    assert len(rows) == 4 * (1 + 2)
    table, honest = sections.honesty_table(rows)
    assert honest and table.count("PASS") == 8 and "1.0000" in table

    rows = sections.sweep_rows(_sweep([1, 2]), _estimates([1, 2], off=(2, 2, 1)))
    table, honest = sections.honesty_table(rows)
    assert not honest
    assert "| 2 | 2 |" in table and "1.1200 (rank 1) | FAIL |" in table


def test_plot_series_per_stage_in_megabytes(sections: ModuleType) -> None:
    series = sections.plot_series(sections.sweep_rows(_sweep([1, 2, 4]), _estimates([1, 2, 4])))
    assert sorted(series) == [0, 1, 2, 3]
    stage3 = series[3]
    assert stage3["world_size"] == [1, 2, 4]
    assert stage3["formula"] == pytest.approx([16 * PARAMS / 1e6, 8 * PARAMS / 1e6, 4 * PARAMS / 1e6])
    assert stage3["estimated"] == pytest.approx(stage3["measured"])
    assert stage3["live_tensors"][0] == pytest.approx((16 * PARAMS + 64) / 1e6)
    assert series[0]["formula"] == pytest.approx([16 * PARAMS / 1e6] * 3)


def test_comm_formula_is_3_psi_for_stage_3_systems(sections: ModuleType) -> None:
    assert sections.comm_formula("az2", PARAMS, 4) == ("2Ψ(W−1)/W·4", pytest.approx(2 * PARAMS * 0.75 * 4))
    for system in ("az3", "fsdp2", "ds3"):
        assert sections.comm_formula(system, PARAMS, 4)[1] == pytest.approx(3 * PARAMS * 0.75 * 4)


def _raw_ranks(step_seconds: float, world_size: int = 4) -> list[dict[str, Any]]:
    status = {"VmRSS": 100_000_000, "RssAnon": 80_000_000, "VmHWM": 120_000_000}
    return [
        {
            "world_size": world_size,
            "params": PARAMS,
            "step_seconds": [step_seconds] * 10,
            "step_cpu_seconds": [step_seconds] * 10,
            "step_minor_faults": [0] * 10,
            "wire_bytes_per_step": [6000] * 10,
            "losses": [1.0, 0.5],
            "baseline": {"VmRSS": 0, "RssAnon": 0},
            "after": status,
            "peak_reset": True,
            "live_tensor_bytes": 16_000,
            "comm": {"total": {"calls": 10, "payload_bytes": 80_000, "bytes_per_rank": 60_000.0}},
            "extra": {},
        }
        for _ in range(world_size)
    ]


def test_tables_show_formulas_and_step_time_ratio_to_ddp(sections: ModuleType) -> None:
    report = sections.summary
    ddp = report.summarize("ddp", [_raw_ranks(0.2), _raw_ranks(0.4)])
    az3 = report.summarize("az3", [_raw_ranks(0.15)])
    memory = sections.memory_table([ddp, az3])
    assert "| torch DDP + AdamW | 16Ψ | 0.0 |" in memory and "accelerate_zero stage 3 | 16Ψ/W |" in memory
    traffic = sections.traffic_time_table([ddp, az3], ddp)
    # DDP pools its two rounds (median 300 ms); stage 3 at 150 ms is half of it.
    assert "| 300 |" in traffic and "200 / 400" in traffic and "**0.50**" in traffic
    assert "3Ψ(W−1)/W·4" in traffic
    assert sections.step_ratio_spread([ddp, az3]) == pytest.approx(2.0)


def test_markdown_tables_are_cut_out_of_printed_output(sections: ModuleType) -> None:
    text = "running...\n| a | b |\n|---|---|\n| 1 | 2 |\nPASS something\n  | c |\n|---|\ndone"
    assert sections.markdown_tables(text) == "| a | b |\n|---|---|\n| 1 | 2 |\n\n| c |\n|---|"


def test_llama_readings_join_the_honesty_table_under_their_own_model(sections: ModuleType) -> None:
    sweep = _sweep([1, 2])
    for rank in sweep[2]:
        rank["llama_params"] = PARAMS
        rank["llama_stages"] = {"3": rank["stages"]["3"]}
    llama = sections.sweep_rows(sweep, _estimates([2], off=(3, 2, 0)), "llama")
    assert [(r.model, r.stage, r.world_size) for r in llama] == [("llama", 3, 2)] * 2
    table, honest = sections.honesty_table(sections.sweep_rows(sweep, _estimates([1, 2])) + llama)
    assert not honest
    assert table.splitlines()[-1] == "| llama | 3 | 2 | 0.009 | 0.008 | 1.1200 (rank 0) | FAIL |"


def test_a_question_section_copies_the_benchmark_table_and_says_when_it_did_not_run(sections: ModuleType) -> None:
    printed = (
        "ddp round 0: done\n\nTrainer, 2 ranks, Llama 512x4 (vocab 20000), fp32\n\n"
        "| system | CPU s/step (rank 0) | vs DDP |\n|---|---|---|\n| ddp | 1.2 | 1.00 |\n| az2 | 1.4 | 1.17 |\n"
    )
    ran = {"status": "ran", "command": ["python", "/x/bench/trainer_bench.py", "--rounds", "1"], "stdout": printed}
    text = sections.question_section(ran, "python bench/trainer_bench.py", "Trainer, ")
    assert text.startswith("`python bench/trainer_bench.py --rounds 1`, run by the report in 0 s: ran.")
    assert "Trainer, 2 ranks" in text and "| az2 | 1.4 | 1.17 |" in text and "ddp round 0" not in text
    assert "Not run" in sections.question_section(None, "x")
    assert "`python bench/trainer_bench.py` runs it" in sections.question_section(
        {"status": "skipped"}, "python bench/trainer_bench.py"
    )
