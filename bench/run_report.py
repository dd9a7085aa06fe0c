"""The benchmark report: runs the engine, stage 3 and offload benchmarks at a size that fits this machine and writes
bench/RESULTS.md with its plots in bench/results/. `bench/report` runs this file.

Usage:
    bench/report                                            # everything, about 10 minutes on 2 shared cores
    bench/report --skip_offload_run                         # offload: read bench/out/offload.json, do not run it
    bench/report --offload_args "--steps 3"                 # arguments for bench/offload_bench.py
    bench/report --from_json bench/out/report/report.json   # re-render RESULTS.md and the plots; run nothing
    bench/report --results /tmp/RESULTS.md --plots_dir /tmp/plots --sweep_world_sizes 1 2   # a quick try

Phases, each system in its own fresh `torchrun --standalone` group (gloo, one thread per rank, as engine_bench.py):
1. memory against world size: sweep_worker.py at W = 1, 2, 3, 4 reads `memory_breakdown()`, live tensors and RSS of
   stages 0-3; `accelerate_zero.debug.estimate` computes the same rank's bytes for the same model and config;
2. the systems compared at W = 4 (harness/steps.py `launch_train`, as engine_bench.py): DDP, DDP +
   ZeroRedundancyOptimizer, our stages 0-3, FSDP2, and DeepSpeed stages 1-3 from --ds_venv when it exists; DDP runs
   first and again last, so its two medians show how much the machine's load moved during the run;
3. offload: bench/offload_bench.py when it exists (its printed markdown tables are copied);
4. the transformers Trainer under DDP, our stages 2/3 and DeepSpeed's: bench/trainer_bench.py, one round (its
   printed table is copied; `--skip_trainer` leaves it out).
Every raw reading goes to --out_dir/report.json, from which --from_json renders the same report again.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness import report, steps
from harness.launch import DEFAULT_DS_VENV
from harness.models import SIZE_ENV


BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
SYSTEMS = ["ddp", "ddp_zero_r", "az0", "az1", "az2", "az3", "fsdp2", "ds1", "ds2", "ds3"]
DS_SYSTEMS = ("ds1", "ds2", "ds3")
OFFLOAD_SCRIPT, OFFLOAD_JSON = BENCH_DIR / "offload_bench.py", BENCH_DIR / "out" / "offload.json"
TRAINER_SCRIPT = BENCH_DIR / "trainer_bench.py"
SWEEP_TIMEOUT_SECONDS = 600
BUDGET_MINUTES = 15


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024, help="Linear width of the benchmark model (1024)")
    parser.add_argument("--layers", type=int, default=8, help="Linear layers (8: Ψ = 8.4M, half the engine bench)")
    parser.add_argument("--world_size", type=int, default=4, help="processes for the systems compared (4)")
    parser.add_argument("--sweep_world_sizes", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument(
        "--llama_world_size", type=int, default=2, help="the sweep run that also measures the Llama (2; 0: none)"
    )
    parser.add_argument("--steps", type=int, default=12, help="timed steps per system, at least 10 (12)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    parser.add_argument("--ds_venv", type=Path, default=DEFAULT_DS_VENV, help="DeepSpeed's own virtualenv")
    parser.add_argument("--skip_offload_run", action="store_true", help=f"read {OFFLOAD_JSON} instead of running")
    parser.add_argument(
        "--offload_args",
        default=None,
        help="arguments for bench/offload_bench.py, one string (default: its step-time part at this run's model "
        "size, 10 steps, stages 3 and 2, JSON into --out_dir)",
    )
    parser.add_argument("--offload_timeout", type=int, default=300, help="seconds before the offload run is cut")
    parser.add_argument("--skip_trainer", action="store_true", help="leave out the Trainer comparison")
    parser.add_argument(
        "--trainer_args",
        default="--rounds 1 --steps 4 --warmup 2",
        help="arguments for bench/trainer_bench.py, one string (default: one round of 4 timed steps)",
    )
    parser.add_argument("--trainer_timeout", type=int, default=1200, help="seconds before the Trainer run is cut")
    parser.add_argument("--out_dir", type=Path, default=BENCH_DIR / "out" / "report", help="logs and raw JSON")
    parser.add_argument("--results", type=Path, default=BENCH_DIR / "RESULTS.md")
    parser.add_argument("--plots_dir", type=Path, default=BENCH_DIR / "results")
    parser.add_argument("--from_json", type=Path, default=None, help="render a saved run again; run nothing")
    args = parser.parse_args()
    if args.steps < 10:
        parser.error(f"--steps {args.steps}: medians need at least 10 timed steps")
    return args


def load_average() -> dict[str, Any]:
    """The 1, 5 and 15-minute load averages (other users' jobs show here)."""
    return {"loadavg": list(os.getloadavg())}


# -------------------------------------------------------------------------------------------------- runs
def run_sweep(world_size: int, args: argparse.Namespace) -> list[dict[str, Any]] | None:
    out, log = args.out_dir / f"sweep_w{world_size}.json", args.out_dir / f"sweep_w{world_size}.log"
    out.unlink(missing_ok=True)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(world_size),
        str(BENCH_DIR / "sweep_worker.py"),
        "--out",
        str(out),
        *(["--llama"] if world_size == args.llama_world_size else []),
    ]
    start = time.perf_counter()
    with open(log, "w") as log_file:
        try:
            code = subprocess.run(
                command, env=env, stdout=log_file, stderr=subprocess.STDOUT, timeout=SWEEP_TIMEOUT_SECONDS
            ).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    if code != 0 or not out.exists():
        print(f"  sweep W={world_size}: FAILED ({code}); see {log}")
        return None
    print(f"  sweep W={world_size}: done in {time.perf_counter() - start:.0f}s", flush=True)
    return json.loads(out.read_text())


def run_systems(args: argparse.Namespace) -> tuple[dict[str, list[list[dict[str, Any]]]], list[str]]:
    """Every system once at --world_size, then DDP again; returns {system: rounds} and the systems that failed."""
    order = [(system, 0) for system in args.systems] + ([("ddp", 1)] if "ddp" in args.systems else [])
    raw: dict[str, list[list[dict[str, Any]]]] = {system: [] for system in args.systems}
    failed = []
    for system, round_index in order:
        ranks = steps.launch_train(
            system, args.world_size, out_dir=args.out_dir / f"w{args.world_size}", ds_venv=args.ds_venv,
            round_index=round_index, steps=args.steps, warmup=args.warmup,
        )  # fmt: skip
        if ranks is None:
            failed.append(system)
        else:
            raw[system].append(ranks)
    return raw, failed


def run_offload(args: argparse.Namespace) -> dict[str, Any]:
    """bench/offload_bench.py's tables: printed by a run now, or read from its JSON (--skip_offload_run)."""
    if not OFFLOAD_SCRIPT.exists():
        return {"status": "absent"}
    if args.skip_offload_run:
        if not OFFLOAD_JSON.exists():
            return {"status": "no_json"}
        return {"status": "json", "json": json.loads(OFFLOAD_JSON.read_text())}
    json_path = args.out_dir / "offload.json"
    if args.offload_args is None:
        size = ["--hidden", str(args.hidden), "--layers", str(args.layers)]
        offload_args = ["--part", "step_time", "--steps", "10", *size, "--json", str(json_path)]
    else:
        offload_args = shlex.split(args.offload_args)
    json_path.unlink(missing_ok=True)
    command = [sys.executable, str(OFFLOAD_SCRIPT), *offload_args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    # Its own session, so that a timeout ends the torchrun groups it started too (by this group's id).
    with subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=args.offload_timeout)
            status = "ran" if process.returncode == 0 else f"failed (exit code {process.returncode})"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            status = f"cut after {args.offload_timeout} s (--offload_timeout)"
    (args.out_dir / "offload.log").write_text(stdout + stderr)
    return {
        "status": status,
        "command": command,
        "stdout": stdout,
        "stderr_tail": stderr.splitlines()[-10:],
        "seconds": time.perf_counter() - start,
        "json": json.loads(json_path.read_text()) if json_path.exists() else None,
        "tracked": _tracked(OFFLOAD_SCRIPT),
        "saved_full_run": _saved_offload_run(),
    }


def run_trainer(args: argparse.Namespace) -> dict[str, Any]:
    """bench/trainer_bench.py's table (the Trainer under DDP, accelerate_zero and DeepSpeed), printed by a run now."""
    if args.skip_trainer:
        return {"status": "skipped"}
    json_path = args.out_dir / "trainer.json"
    command = [
        sys.executable,
        str(TRAINER_SCRIPT),
        *shlex.split(args.trainer_args),
        # The default is the trainer bench's too (bench/ds_venv.py): only another folder is passed on.
        *([] if args.ds_venv == DEFAULT_DS_VENV else ["--ds_venv", str(args.ds_venv)]),
        "--json",
        str(json_path),
    ]
    start = time.perf_counter()
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    ) as process:
        try:
            output, _ = process.communicate(timeout=args.trainer_timeout)
            status = "ran" if process.returncode == 0 else f"failed (exit code {process.returncode})"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            status = f"cut after {args.trainer_timeout} s (--trainer_timeout)"
    (args.out_dir / "trainer.log").write_text(output)
    return {"status": status, "command": command, "stdout": output, "seconds": time.perf_counter() - start}


def _tracked(path: Path) -> bool:
    """Whether git knows `path` (another engineer's benchmark may still be uncommitted)."""
    done = subprocess.run(["git", "-C", str(REPO), "ls-files", "--error-unmatch", str(path)], capture_output=True)
    return done.returncode == 0


def _saved_offload_run() -> dict[str, Any] | None:
    """The last full offload_bench.py run (its default JSON), whose largest-model part the report has no time for."""
    if not OFFLOAD_JSON.exists():
        return None
    written = datetime.datetime.fromtimestamp(OFFLOAD_JSON.stat().st_mtime, datetime.timezone.utc)
    return {"written": written.strftime("%Y-%m-%d %H:%M UTC"), "json": json.loads(OFFLOAD_JSON.read_text())}


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    args.out_dir.mkdir(parents=True, exist_ok=True)
    os.environ[SIZE_ENV["hidden"]], os.environ[SIZE_ENV["layers"]] = str(args.hidden), str(args.layers)
    payload: dict[str, Any] = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "machine": report.machine_facts(),
        "load_start": load_average(),
        "seconds": {},
        "notes": [],
    }
    start = time.perf_counter()
    print(f"memory against world size: W = {args.sweep_world_sizes}", flush=True)
    # The comparison's own stage runs give the sweep's point at its world size (report_sections.sweep_from_systems).
    in_comparison = args.world_size if all(f"az{stage}" in args.systems for stage in range(4)) else None
    payload["sweep"] = {w: run_sweep(w, args) for w in args.sweep_world_sizes if w != in_comparison}
    payload["seconds"]["sweep"] = time.perf_counter() - start
    if not (args.ds_venv / "bin" / "torchrun").exists():
        skipped = [s for s in args.systems if s in DS_SYSTEMS]
        args.systems = [s for s in args.systems if s not in DS_SYSTEMS]
        payload["notes"].append(f"DeepSpeed skipped ({', '.join(skipped)}): no virtualenv at {args.ds_venv}.")
    print(f"systems at W = {args.world_size}: {', '.join(args.systems)}, then ddp again", flush=True)
    mark = time.perf_counter()
    payload["main"], payload["failed"] = run_systems(args)
    payload["seconds"]["systems"] = time.perf_counter() - mark
    print("offload", flush=True)
    mark = time.perf_counter()
    payload["offload"] = run_offload(args)
    payload["seconds"]["offload"] = time.perf_counter() - mark
    print("the Trainer", flush=True)
    mark = time.perf_counter()
    payload["trainer"] = run_trainer(args)
    payload["seconds"]["trainer"] = time.perf_counter() - mark
    payload["seconds"]["total"] = time.perf_counter() - start
    payload["load_end"] = load_average()
    (args.out_dir / "report.json").write_text(json.dumps(payload, indent=1, default=str))
    return payload


def main() -> None:
    args = parse_args()
    payload = json.loads(args.from_json.read_text()) if args.from_json else run_all(args)
    import render_report  # after the runs: it imports torch and accelerate_zero for the estimate

    render_report.write(payload, args.results, args.plots_dir)
    total = payload["seconds"]["total"]
    print(f"wrote {args.results} and {args.plots_dir}/*.png; the runs took {total / 60:.1f} minutes")
    if payload.get("failed"):
        sys.exit(f"these systems failed (logs in {args.out_dir}): {', '.join(payload['failed'])}")


if __name__ == "__main__":
    main()
