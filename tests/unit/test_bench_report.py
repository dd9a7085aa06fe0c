"""bench/'s reporting, on made-up readings (nothing is launched): the command line every question shares
(harness/cli.py), the estimate-honesty verdict (memory_sweep.py), engine_bench.py's formulas and checks, and
RESULTS.md written from the answers the questions saved (run_report.py)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


BENCH = Path(__file__).resolve().parents[2] / "bench"
PARAMS = 1000


@pytest.fixture(scope="module")
def bench() -> dict[str, ModuleType]:
    sys.path.insert(0, str(BENCH))
    try:
        yield {name: importlib.import_module(name) for name in ("engine_bench", "memory_sweep", "run_report")}
    finally:
        sys.path.remove(str(BENCH))


def test_a_question_s_options_come_from_its_signature_and_its_answer_is_saved_and_printed_again(
    bench: dict[str, ModuleType], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from harness import cli

    seen = {}

    def first(sizes: tuple[int, ...] = (1, 2), name: str | None = None, rate: float = 0.5, fast: bool = False) -> Any:
        """The first.

        Args:
            sizes: the sizes, in
                two lines.
            name: a name.
        """
        seen.update(sizes=sizes, name=name, rate=rate, fast=fast)
        return cli.Answer("first question", "| a |\n|---|\n| 1 |", {"x": 1}, ok=not fast)

    def second(count: int = 3) -> Any:
        """The second."""
        seen.update(count=count)
        return cli.Answer("second question", "text")

    saved = tmp_path / "answer.json"
    argv = ["first", "--sizes", "4", "8", "--name", "n", "--rate", "2", "--fast", "--json", str(saved)]
    assert cli.main(first, second, argv=argv) == 1  # not ok: the exit code says so
    assert seen == {"sizes": [4, 8], "name": "n", "rate": 2.0, "fast": True}
    record = json.loads(saved.read_text())
    assert record["question"] == "first" and record["raw"] == {"x": 1} and record["text"].startswith("| a |")
    assert record["header"].startswith("first question\n") and "load average" in record["header"]
    assert cli.main(first, second, argv=["second"]) == 0 and seen["count"] == 3
    capsys.readouterr()
    assert cli.main(first, second, argv=["second", "--from_json", str(saved)]) == 0
    assert capsys.readouterr().out == f"{record['header']}\n\n{record['text']}\n"
    assert cli._arg_help(first.__doc__) == {"sizes": "the sizes, in two lines.", "name": "a name."}
    with pytest.raises(SystemExit):
        cli.main(first, argv=["--sizes", "x"])  # typed by the default


def _ranks(world_size: int, off: tuple[str, int, int] | None = None) -> list[dict[str, Any]]:
    """Readings as memory_sweep.sweep returns them: the estimate equal to what was held, or 12% above on `off`."""
    out = []
    for rank in range(world_size):
        entry: dict[str, Any] = {}
        for model in ("linear", "llama"):
            entry[model] = {}
            for stage in range(4):
                replicated, sharded = {0: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)}[stage]
                held = int(PARAMS * (replicated + sharded / world_size))
                kinds = {
                    "parameters": held // 2,
                    "gradients": 0,
                    "master_weights": 0,
                    "optimizer_states": held - held // 2,
                }
                scale = 1.12 if off == (model, stage, rank) else 1.0
                entry[model][str(stage)] = {"measured": dict(kinds, total=held),
                                            "estimated": {k: int(v * scale) for k, v in
                                                          dict(kinds, total=held).items()},
                                            "live": held + 64, "rss": 2 * held, "params": PARAMS}  # fmt: skip
        out.append(entry)
    return out


def test_the_estimate_is_honest_until_one_rank_is_12_percent_off(bench: dict[str, ModuleType]) -> None:
    sweep = bench["memory_sweep"]
    rows = sweep.rows({1: _ranks(1), 2: _ranks(2)})
    assert len(rows) == 2 * 4 * 2 and rows[0]["formula"] == 16 * PARAMS
    text, honest = sweep.tables(rows)
    assert honest and text.count("PASS") == 16 + 1 and "1.0000 (rank 0)" in text
    assert "| 3 | 2 | 0.0 | 0.0 | 0.0 | 0.0 | 0.0 | 0.0 | 0.0 |" in text  # the stack's table: MB

    text, honest = sweep.tables(sweep.rows({1: _ranks(1), 2: _ranks(2, off=("llama", 2, 1))}))
    assert not honest and "FAIL: not every estimate" in text
    assert "| llama | 2 | 2 | 0.011 | 0.010 | 1.1200 (rank 1) | FAIL |" in text


def _raw_ranks(step_seconds: float, world_size: int = 4) -> list[dict[str, Any]]:
    status = {"VmRSS": 100_000_000, "RssAnon": 80_000_000, "VmHWM": 120_000_000}
    comm = {"all_gather": {"calls": 10, "payload_bytes": 80_000, "bytes_per_rank": 60_000.0}}
    return [
        {"world_size": world_size, "params": PARAMS, "step_seconds": [step_seconds] * 10,
         "step_cpu_seconds": [step_seconds] * 10, "step_minor_faults": [0] * 10, "wire_bytes_per_step": [6000] * 10,
         "losses": [1.0, 0.5], "baseline": {"VmRSS": 0, "RssAnon": 0}, "after": status, "peak_reset": True,
         "live_tensor_bytes": 16_000, "comm": {**comm, "total": comm["all_gather"]}, "extra": {}}
        for _ in range(world_size)
    ]  # fmt: skip


def test_engine_bench_sets_stage_3_against_3_psi_and_its_checks_skip_what_did_not_run(
    bench: dict[str, ModuleType],
) -> None:
    from harness.summary import summarize

    ddp, az3 = summarize("ddp", [_raw_ranks(0.2), _raw_ranks(0.4)]), summarize("az3", [_raw_ranks(0.15)])
    assert az3.comm_formula_mb == pytest.approx(1.5 * ddp.comm_formula_mb)  # 3Ψ(W−1)/W against 2Ψ(W−1)/W
    text = bench["engine_bench"].answer_text([ddp, az3])
    assert "| 3Ψ(W−1)/W·4 = 0.0 |" in text and "| 2Ψ(W−1)/W·4 = 0.0 |" in text
    assert "| 300 | 1.00 | — |" in text and "| 150 | 0.50 | — |" in text  # DDP pools its two rounds: 300 ms
    checks = {c.name: c for c in bench["engine_bench"].checks({"ddp": ddp, "az3": az3})}
    assert checks["stage 3 RSS <= 0.45 x DDP RSS"].passed is False
    assert checks["stage 3 RSS <= FSDP2 RSS"].passed is None and checks["stage 2 RSS <= 0.5 x DDP RSS"].passed is None
    assert checks["stage 3 counted bytes per step within 5% of the formula"].passed is False  # 60 kB against 4.5 kB


def test_results_md_is_the_answers_the_questions_saved(bench: dict[str, ModuleType], tmp_path: Path) -> None:
    for name in ("engine", "sweep"):
        saved = {"header": f"{name}: the header\nthe machine, load average 1.0", "text": f"| {name} |\n|---|"}
        (tmp_path / f"{name}.json").write_text(json.dumps(saved))
    results = tmp_path / "RESULTS.md"
    bench["run_report"].report(skip=("offload", "trainer"), results=results, out_dir=tmp_path, render_only=True)
    text = results.read_text()
    assert text.startswith("# Benchmark results") and "## The systems compared at W = 4" in text
    assert "`python bench/engine_bench.py --world_size 4 --steps 12 --systems ddp" in text
    assert "engine: the header\nthe machine, load average 1.0\n\n| engine |" in text and "| sweep |" in text
    assert "Offload" not in text and "Trainer" not in text
