"""Memory, bytes moved and step time of accelerate_zero stages 0-2 against DDP, ZeroRedundancyOptimizer and DeepSpeed.

Usage:
    .venv/bin/python bench/engine_bench.py                       # 4 processes, 20 timed steps, ~6 minutes
    .venv/bin/python bench/engine_bench.py --world_size 2 --steps 30 --json bench/out/w2.json
    .venv/bin/python bench/engine_bench.py --systems ddp az2     # a subset

Each system runs alone, in its own freshly launched `torchrun --standalone` group (gloo, one thread per rank,
MALLOC_MMAP_THRESHOLD_=131072), on a stack of 16 `nn.Linear(1024, 1024)` (16.8M fp32 parameters) trained with
AdamW on a fixed random 8x1024 batch per rank and an MSE loss. DeepSpeed runs only from its own virtualenv
(`--ds_venv`, default: bench/ds_venv.py), skipped when that does not exist. How each number is measured:
bench_common.py, [Note: how the benchmark measures]. Compare ratios within one run: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import report
from ds_venv import DEFAULT_DS_VENV


BENCH_DIR = Path(__file__).resolve().parent
TORCH_SYSTEMS = ["ddp", "ddp_bucket_view", "ddp_zero_r", "az0", "az1", "az2"]
DS_SYSTEMS = ["ds1", "ds2"]
WORKER_TIMEOUT_SECONDS = 600


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world_size", type=int, default=4, help="processes per system (default 4)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per system, at least 20 (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before measuring (default 3)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the whole list this many times, every other round in reverse order; step times pool all rounds",
    )
    parser.add_argument("--systems", nargs="+", default=TORCH_SYSTEMS + DS_SYSTEMS, choices=TORCH_SYSTEMS + DS_SYSTEMS)
    parser.add_argument(
        "--reduce_bucket_size",
        type=int,
        default=None,
        help="zero_optimization.reduce_bucket_size for accelerate_zero and DeepSpeed (default: theirs, 5e8 elements)",
    )
    parser.add_argument("--ds_venv", type=Path, default=DEFAULT_DS_VENV, help="DeepSpeed's own virtualenv")
    parser.add_argument("--out_dir", type=Path, default=BENCH_DIR / "out", help="worker logs and raw JSON")
    parser.add_argument("--json", type=Path, default=None, help="write every raw and summarized number here")
    parser.add_argument(
        "--from_json", type=Path, default=None, help="print the report of a run saved with --json; run nothing"
    )
    args = parser.parse_args()
    if args.steps < 20:
        parser.error(f"--steps {args.steps}: medians need at least 20 timed steps")
    if args.world_size < 2:
        parser.error(f"--world_size {args.world_size}: ZeRO needs at least 2 processes to shard anything")
    return args


def worker_command(system: str, args: argparse.Namespace, out: Path) -> tuple[list[str], dict[str, str]]:
    """The torchrun command line and environment that run `system` on `args.world_size` fresh processes."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    common = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(out)]
    if args.reduce_bucket_size is not None and (system.startswith(("ds", "az"))):
        common += ["--reduce_bucket_size", str(args.reduce_bucket_size)]
    grad_accum = getattr(args, "grad_accum", 1)  # stage3_bench.py --grad_accums; bench_worker.py systems only
    if grad_accum != 1:
        if system.startswith("ds"):
            raise ValueError(f"{system}: ds_worker.py has no gradient accumulation option (grad_accum={grad_accum})")
        common += ["--grad_accum", str(grad_accum)]
    launch = ["--standalone", "--nproc_per_node", str(args.world_size)]
    if system.startswith("ds"):  # ds1, ds2 here; ds3 from stage3_bench.py
        env.pop("PYTHONPATH", None)
        env.pop("VIRTUAL_ENV", None)
        env["DS_ACCELERATOR"] = "cpu"
        torchrun = [str(args.ds_venv / "bin" / "torchrun")]
        return [*torchrun, *launch, str(BENCH_DIR / "ds_worker.py"), "--stage", system[-1], *common], env
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    extra = getattr(args, "worker_extra", {}).get(system, [])  # stage3_bench.py: the loading systems' folder
    return [*torchrun, *launch, str(BENCH_DIR / "bench_worker.py"), "--system", system, *common, *extra], env


def run_system(system: str, args: argparse.Namespace, round_index: int) -> list[dict[str, Any]] | None:
    """Runs one system to completion; returns every rank's raw measurement, or None (the log says why)."""
    stem = system if round_index == 0 else f"{system}.round{round_index + 1}"
    out, log = args.out_dir / f"{stem}.json", args.out_dir / f"{stem}.log"
    out.unlink(missing_ok=True)
    command, env = worker_command(system, args, out)
    load_before, start = os.getloadavg()[0], time.perf_counter()
    with open(log, "w") as log_file:
        try:
            code = subprocess.run(
                command, env=env, stdout=log_file, stderr=subprocess.STDOUT, timeout=WORKER_TIMEOUT_SECONDS
            ).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    seconds = time.perf_counter() - start
    if code != 0 or not out.exists():
        tail = log.read_text().splitlines()[-15:]
        print(f"  {stem}: FAILED ({code}) after {seconds:.0f}s; end of {log}:\n    " + "\n    ".join(tail))
        return None
    load_after = os.getloadavg()[0]
    print(f"  {stem}: done in {seconds:.0f}s (1-min load average {load_before:.1f} -> {load_after:.1f})", flush=True)
    ranks = json.loads(out.read_text())
    for rank in ranks:
        rank["extra"]["loadavg_1min"] = [load_before, load_after]
    return ranks


def main() -> None:
    args = parse_args()
    if args.from_json is not None:
        raw = json.loads(args.from_json.read_text())["raw"]
        # A run saved before --rounds existed holds one list of ranks per system.
        raw = {k: [v] if v and isinstance(v[0], dict) else v for k, v in raw.items()}
        report_and_save(raw, args)
        return
    args.out_dir.mkdir(parents=True, exist_ok=True)
    systems = list(args.systems)
    if not (args.ds_venv / "bin" / "torchrun").exists():
        skipped = [s for s in systems if s in DS_SYSTEMS]
        systems = [s for s in systems if s not in DS_SYSTEMS]
        if skipped:
            print(f"no DeepSpeed virtualenv at {args.ds_venv}: skipping {', '.join(skipped)}")
    print(
        f"running {len(systems)} systems on {args.world_size} processes, {args.steps} timed steps each, "
        f"{args.rounds} round(s)"
    )
    raw: dict[str, list[list[dict[str, Any]]]] = {system: [] for system in systems}
    failed = set()
    for round_index in range(args.rounds):
        for system in systems if round_index % 2 == 0 else systems[::-1]:
            ranks = run_system(system, args, round_index)
            if ranks is None:
                failed.add(system)
            else:
                raw[system].append(ranks)
    report_and_save(raw, args)
    if failed:
        sys.exit(f"these systems failed (see their logs in {args.out_dir}): {', '.join(sorted(failed))}")


def report_and_save(raw: dict[str, list[list[dict[str, Any]]]], args: argparse.Namespace) -> None:
    """Prints the tables and the target lines; writes everything to `args.json` when given.

    `raw` maps each system to its rounds, each round a list of every rank's raw measurement.
    """
    summaries = [report.summarize(system, rounds) for system, rounds in raw.items() if rounds]
    by_name = {s.system: s for s in summaries}
    check_list = report.checks(by_name)
    info_list = report.wire_checks(by_name)
    print_report(summaries, by_name, check_list + info_list)
    if args.json is not None:
        payload = {"args": {k: str(v) for k, v in vars(args).items()}, "raw": raw}
        payload.update(report.as_json(summaries, check_list + info_list))
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=1))
        print(f"\nraw numbers: {args.json}")


def print_report(
    summaries: list[report.Summary], by_name: dict[str, report.Summary], lines: list[report.Check]
) -> None:
    if not summaries:
        print("no system finished")
        return
    first = summaries[0]
    print(
        f"\nΨ = {first.params:,} parameters, W = {first.world_size}, {first.steps} timed steps x {first.rounds} "
        "round(s); MB = 10^6 bytes\n"
    )
    print(report.main_table(summaries, by_name.get("ddp")))
    print("\nCross-checks\n")
    print(report.crosscheck_table(summaries))
    print("\nCollectives as each system counted them\n")
    print(report.comm_kind_table(summaries))
    print()
    for check in lines:
        print(check.line())


if __name__ == "__main__":
    main()
