"""Memory, bytes moved and step time of accelerate_zero stages 0-2 against DDP, ZeroRedundancyOptimizer and DeepSpeed.

Usage:
    .venv/bin/python bench/engine_bench.py                       # 4 processes, 20 timed steps, ~6 minutes
    .venv/bin/python bench/engine_bench.py --world_size 2 --steps 30 --json bench/out/w2.json
    .venv/bin/python bench/engine_bench.py --systems ddp az2     # a subset

Each system trains the Linear stack in its own fresh group (`steps.train`); DeepSpeed only from its own virtualenv.
bench/README.md, "engine_bench.py", and [Note: how the benchmark measures] (harness/readings.py) say how.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from harness import launch, report, steps
from harness.peers import FORMULA_TEXT, PEERS
from harness.report import Check, fmt, ratio
from harness.summary import Summary, summarize


SYSTEMS = ["ddp", "ddp_bucket_view", "ddp_zero_r", "az0", "az1", "az2", "ds1", "ds2"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world_size", type=int, default=4, help="processes per system (default 4)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per system, at least 20 (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before measuring (default 3)")
    parser.add_argument(
        "--rounds", type=int, default=1, help="run the list this many times, every other round reversed; times pool"
    )
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    parser.add_argument(
        "--reduce_bucket_size", type=int, default=None, help="zero_optimization.reduce_bucket_size (default: theirs)"
    )
    parser.add_argument("--ds_venv", type=Path, default=launch.DEFAULT_DS_VENV, help="DeepSpeed's own virtualenv")
    parser.add_argument("--out_dir", type=Path, default=launch.BENCH_DIR / "out", help="logs and per-rank JSON")
    parser.add_argument("--json", type=Path, default=None, help="write every raw and summarized number here")
    parser.add_argument("--from_json", type=Path, default=None, help="print a run saved with --json; run nothing")
    args = parser.parse_args(argv)
    if args.steps < 20:
        parser.error(f"--steps {args.steps}: medians need at least 20 timed steps")
    if args.world_size < 2:
        parser.error(f"--world_size {args.world_size}: ZeRO needs at least 2 processes to shard anything")
    return args


def main_table(summaries: list[Summary], reference: Summary | None) -> str:
    """The headline table: memory, bytes and time against the ZeRO formulas and against DDP."""
    columns = [
        "system", "RSS per rank (MB, max over ranks)", "anonymous RSS (MB)", "engine-held (MB)", "ZeRO formula (MB)",
        "RSS / formula", "held / formula", "bytes per step per rank (MB)", "formula 2Ψ(W−1)/W·4 (MB)",
        "bytes / formula", "step time (ms, median)", "step time / DDP",
    ]  # fmt: skip
    rows = [
        (PEERS[s.system].label, fmt(s.rss_mb), fmt(s.anon_rss_mb), fmt(s.held_mb),
         f"{FORMULA_TEXT[PEERS[s.system].memory]} = {fmt(s.memory_formula_mb)}", ratio(s.rss_mb, s.memory_formula_mb),
         ratio(s.held_mb, s.memory_formula_mb), f"{fmt(s.comm_mb_per_step)} ({PEERS[s.system].counted_by})",
         fmt(s.comm_formula_mb), ratio(s.comm_mb_per_step, s.comm_formula_mb), fmt(s.step_ms, 0),
         ratio(s.step_ms, reference.step_ms if reference else None))
        for s in summaries
    ]  # fmt: skip
    return report.table(columns, rows)


def crosscheck_table(summaries: list[Summary]) -> str:
    """Independent readings: peak RSS, tensors the GC sees, bytes really written to gloo's sockets, the loss."""
    columns = [
        "system", "peak RSS (MB)", "live tensors (MB)", "anonymous RSS − live tensors (MB)",
        "wire bytes per step per rank (MB)", "wire / formula", "counted / wire", "step ms p25–p75",
        "step ms median by round", "CPU ms per step per rank", "page faults per step", "load avg before → after",
        "final loss (mean over ranks)",
    ]  # fmt: skip
    rows = [
        (PEERS[s.system].label, fmt(s.peak_rss_mb), fmt(s.live_tensor_mb), fmt(s.anon_rss_mb - s.live_tensor_mb),
         fmt(s.wire_mb_per_step), ratio(s.wire_mb_per_step, s.comm_formula_mb),
         ratio(s.comm_mb_per_step, s.wire_mb_per_step), f"{s.step_ms_p25_p75[0]:.0f}–{s.step_ms_p25_p75[1]:.0f}",
         " / ".join(f"{ms:.0f}" for ms in s.step_ms_by_round), f"{s.cpu_ms_per_rank:.0f}",
         fmt(s.minor_faults_per_step, 0),
         " / ".join("—" if pair is None else f"{pair[0]:.1f} → {pair[1]:.1f}" for pair in s.loadavg_1min),
         f"{s.final_loss:.7f}")
        for s in summaries
    ]  # fmt: skip
    return report.table(columns, rows, "l" + "r" * 7 + "l" + "r" * 4)


def checks(by_name: dict[str, Summary]) -> list[Check]:
    """The engine's targets (issue 2), each PASS/FAIL (SKIP when a system it needs did not run)."""
    az1, zero_r, az2, ddp = (by_name.get(k) for k in ("az1", "ddp_zero_r", "az2", "ddp"))
    out = [
        _memory_check("stage 1 RSS <= ZeroRedundancyOptimizer RSS", az1, zero_r, 1.0),
        _memory_check("stage 2 RSS <= 0.5 x DDP RSS", az2, ddp, 0.5),
    ]
    for stage in range(3):
        s = by_name.get(f"az{stage}")
        name = f"stage {stage} bytes per step within 5% of 2Ψ(W−1)/W·4"
        if s is None:
            out.append(Check(name, None, f"az{stage} missing"))
            continue
        value = s.comm_mb_per_step / s.comm_formula_mb
        detail = f"comm_stats {s.comm_mb_per_step:.2f} MB vs {s.comm_formula_mb:.2f} MB (ratio {value:.3f})"
        out.append(Check(name, abs(value - 1) <= 0.05, detail))
    step = [s.step_ms if s else None for s in (az2, ddp)]
    out.append(report.at_most("stage 2 step time <= 1.15 x DDP", *step, 1.15, " ms"))
    return out


def wire_checks(by_name: dict[str, Summary]) -> list[Check]:
    """Not a target: the same 5% test on the bytes really written to the sockets (gloo's own algorithms)."""
    out = []
    for s in (by_name[system] for system in ("az0", "az1", "az2") if system in by_name):
        value = s.wire_mb_per_step / s.comm_formula_mb
        detail = f"wire {s.wire_mb_per_step:.2f} MB vs {s.comm_formula_mb:.2f} MB (ratio {value:.3f})"
        out.append(
            Check(f"(info) stage {s.system[-1]} wire bytes within 5% of formula", abs(value - 1) <= 0.05, detail)
        )
    return out


def _memory_check(name: str, s: Summary | None, ref: Summary | None, limit: float) -> Check:
    """Passes only when both the process RSS and its anonymous part are within `limit` x the reference's.

    File-backed pages (shared libraries) count in RSS but the kernel may drop them under memory pressure from
    other processes; the anonymous part cannot be dropped without swap, so it is the steadier reading.
    """
    if s is None or ref is None:
        return Check(name, None, "a system it compares did not run")
    rss, anon = s.rss_mb / ref.rss_mb, s.anon_rss_mb / ref.anon_rss_mb
    detail = (
        f"RSS {s.rss_mb:.1f} MB vs {ref.rss_mb:.1f} MB (ratio {rss:.2f}); anonymous {s.anon_rss_mb:.1f} MB vs "
        f"{ref.anon_rss_mb:.1f} MB (ratio {anon:.2f}); limit {limit}"
    )
    return Check(name, rss <= limit and anon <= limit, detail)


def print_report(raw: dict[str, list[list[dict[str, Any]]]], facts: dict[str, Any]) -> list[Summary]:
    """Prints the tables and the target lines of `raw` ({system: rounds, each a list of rank records})."""
    summaries = [summarize(system, rounds) for system, rounds in raw.items() if rounds]
    if not summaries:
        print("no system finished")
        return summaries
    by_name, first = {s.system: s for s in summaries}, summaries[0]
    print("\n" + report.header(facts, "engine_bench: accelerate_zero stages 0-2 against DDP, ZeRO-R and DeepSpeed"))
    print(
        f"\nΨ = {first.params:,} parameters, W = {first.world_size}, {first.steps} timed steps x {first.rounds} "
        "round(s); MB = 10^6 bytes\n"
    )
    print(main_table(summaries, by_name.get("ddp")))
    print("\nCross-checks\n\n" + crosscheck_table(summaries))
    print("\nCollectives as each system counted them\n\n" + report.comm_kind_table(summaries) + "\n")
    for check in checks(by_name) + wire_checks(by_name):
        print(check.line())
    return summaries


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        print_report(saved["raw"], saved["machine"])
        return
    facts = report.machine_facts()
    args.systems = steps.runnable(args.systems, args.ds_venv)
    print(f"running {len(args.systems)} systems on {args.world_size} processes, {args.steps} timed steps each")
    raw: dict[str, list[list[dict[str, Any]]]] = {system: [] for system in args.systems}
    for round_index, system in launch.interleaved(args.systems, args.rounds):
        ranks = steps.launch_train(
            system, args.world_size, out_dir=args.out_dir, ds_venv=args.ds_venv, round_index=round_index,
            steps=args.steps, warmup=args.warmup, reduce_bucket_size=args.reduce_bucket_size,
        )  # fmt: skip
        if ranks is not None:
            raw[system].append(ranks)
    summaries = print_report(raw, facts)
    if args.json is not None:
        by_name = {s.system: s for s in summaries}
        found = [vars(c) for c in checks(by_name) + wire_checks(by_name)]
        payload = {"args": vars(args), "raw": raw, "summaries": [vars(s) for s in summaries], "checks": found}
        report.save_json(args.json, payload, facts)
    failed = [system for system, rounds in raw.items() if len(rounds) < args.rounds]
    if failed:
        sys.exit(f"these systems failed (see their logs in {args.out_dir}): {', '.join(failed)}")


if __name__ == "__main__":
    main()
