"""The benchmark report: runs the engine, stage 3, offload and Trainer questions at a size that fits this machine and
writes bench/RESULTS.md with its plots in bench/results/ (bench/README.md, "Benchmark report"). `bench/report` runs
this file.

Usage:
    bench/report                                            # everything, about 10 minutes on 2 shared cores
    bench/report --skip_offload_run                         # offload: read bench/out/offload.json, do not run it
    bench/report --offload_args "--steps 3"                 # arguments for bench/offload_bench.py
    bench/report --from_json bench/out/report/report.json   # re-render RESULTS.md and the plots; run nothing
    bench/report --results /tmp/RESULTS.md --plots_dir /tmp/plots --sweep_world_sizes 1 2   # a quick try
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import launch, models, report, steps


BENCH_DIR = Path(__file__).resolve().parent
SYSTEMS = ["ddp", "ddp_zero_r", "az0", "az1", "az2", "az3", "fsdp2", "ds1", "ds2", "ds3"]
OFFLOAD_JSON = BENCH_DIR / "out" / "offload.json"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024, help="Linear width of the benchmark model (1024)")
    parser.add_argument("--layers", type=int, default=8, help="Linear layers (8: Ψ = 8.4M, half the engine bench)")
    parser.add_argument("--world_size", type=int, default=4, help="processes for the systems compared (4)")
    parser.add_argument("--sweep_world_sizes", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument(
        "--llama_world_size", type=int, default=2, help="the sweep that also measures the Llama (0: none)"
    )
    parser.add_argument("--steps", type=int, default=12, help="timed steps per system, at least 10 (12)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    parser.add_argument("--ds_venv", type=Path, default=launch.DEFAULT_DS_VENV, help="DeepSpeed's own virtualenv")
    parser.add_argument("--skip_offload_run", action="store_true", help=f"read {OFFLOAD_JSON} instead of running")
    parser.add_argument(
        "--offload_args",
        default=None,
        help="arguments for bench/offload_bench.py, one string "
        "(default: its step-time part at this run's model size, 10 steps, JSON into --out_dir)",
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
    args = parser.parse_args()  # fmt: skip
    if args.steps < 10:
        parser.error(f"--steps {args.steps}: medians need at least 10 timed steps")
    return args


# ----------------------------------------------------------------------------- the sweep (a rank function)
def _measure_stage(stage: int, optimizer_steps: int, make: Callable[[], tuple[Any, Callable]]) -> dict[str, Any]:
    """What this rank holds at the end of a backward after `optimizer_steps` steps at `stage` (the whole model state:
    gradients live from the first backward to the step), above what it held before the model existed."""
    import torch
    import torch.distributed as dist
    from harness.readings import live_tensor_bytes, proc_status

    import accelerate_zero

    gc.collect()
    dist.barrier()
    live_before, status_before = live_tensor_bytes(), proc_status()
    model, loss_of = make()
    optimizer = torch.optim.AdamW(model.parameters(), lr=models.LR)
    engine = accelerate_zero.initialize(model, optimizer, config=models.engine_config(stage))
    for _ in range(optimizer_steps):
        engine.backward(loss_of(engine))
        engine.step()
    engine.backward(loss_of(engine))  # read before its step: the gradients are freed after it
    gc.collect()
    dist.barrier()
    status = proc_status()
    reading = {
        "memory_breakdown": engine.memory_breakdown(),
        "live_tensor_bytes": live_tensor_bytes() - live_before,
        "rss_bytes": status["VmRSS"] - status_before["VmRSS"],
        "anon_rss_bytes": status["RssAnon"] - status_before["RssAnon"],
    }
    engine.step()
    engine.destroy()
    del engine, optimizer, model, loss_of
    gc.collect()
    reading["live_tensor_bytes_left"] = live_tensor_bytes() - live_before  # a leak would inflate the next stage
    return reading


def sweep(stages: list[int], optimizer_steps: int, llama: bool) -> dict[str, Any]:
    """Rank function: memory per rank of stages 0-3 on the Linear stack (and the ladder's 2-layer Llama), after a
    throwaway run on a tiny stack (the first engine in a process also maps code pages and allocator arenas)."""
    import torch.distributed as dist
    from offload_bench import LADDER_LLAMA, ladder_llama
    from report_sections import SWEEP_LLAMA_LAYERS
    from torch import nn

    rank = dist.get_rank()

    def stack(hidden: int | None = None, layers: int | None = None) -> tuple[Any, Callable]:
        model = models.build_model(*(v for v in (hidden, layers) if v is not None))
        x, y = models.make_batch(rank, model[0].in_features)
        return model, lambda engine: nn.functional.mse_loss(engine(x), y)

    def llama_model() -> tuple[Any, Callable]:
        tokens = models.tokens(2, 64, LADDER_LLAMA["vocab"], seed=rank)
        return models.llama(
            ladder_llama(SWEEP_LLAMA_LAYERS)
        ), lambda engine: engine(input_ids=tokens, labels=tokens).loss

    params = sum(p.numel() for p in models.build_model().parameters())
    _measure_stage(stages[0], 1, lambda: stack(64, 2))
    record = {"rank": rank, "world_size": dist.get_world_size(), "params": params,
              "stages": {str(stage): _measure_stage(stage, optimizer_steps, stack) for stage in stages}}  # fmt: skip
    if llama:
        record["llama_params"] = sum(
            p.numel() for p in models.llama(ladder_llama(SWEEP_LLAMA_LAYERS), device="meta").parameters()
        )
        record["llama_stages"] = {str(stage): _measure_stage(stage, optimizer_steps, llama_model) for stage in stages}
    return record


# -------------------------------------------------------------------------------------------------- runs
def run_sweep(world_size: int, args: argparse.Namespace) -> list[dict[str, Any]] | None:
    kwargs = {"stages": [0, 1, 2, 3], "optimizer_steps": 1, "llama": world_size == args.llama_world_size}
    try:
        return launch.on_ranks(world_size, sweep, kwargs, name=f"sweep_w{world_size}", out_dir=args.out_dir).results
    except launch.LaunchFailed as failed:
        print(f"  FAILED {failed}")
        return None


def run_question(script: str, argv: list[str], timeout: int, out_dir: Path) -> dict[str, Any]:
    """Runs `bench/<script>` with `argv` in its own process tree (cut after `timeout` seconds); what it printed."""
    command = [sys.executable, str(BENCH_DIR / script), *argv]
    log = out_dir / f"{Path(script).stem}.log"
    done = launch.run_command(command, log=log, env=dict(os.environ, PYTHONUNBUFFERED="1"), timeout=timeout)
    status = "ran" if done.code == 0 else (f"failed (exit code {done.code})" if isinstance(done.code, int) else
                                          f"cut: {done.code}")  # fmt: skip
    return {"status": status, "command": command, "stdout": log.read_text(errors="replace"), "seconds": done.seconds}


def run_offload(args: argparse.Namespace) -> dict[str, Any]:
    """bench/offload_bench.py's tables: printed by a run now, or read from its JSON (--skip_offload_run)."""
    if args.skip_offload_run:
        return {"status": "json", "json": json.loads(OFFLOAD_JSON.read_text())} if OFFLOAD_JSON.exists() else {
            "status": "no_json"}  # fmt: skip
    size = ["--hidden", str(args.hidden), "--layers", str(args.layers)]
    default = ["--part", "step_time", "--steps", "10", *size, "--json", str(args.out_dir / "offload.json")]
    argv = default if args.offload_args is None else shlex.split(args.offload_args)
    ran = run_question("offload_bench.py", argv, args.offload_timeout, args.out_dir)
    if OFFLOAD_JSON.exists():  # the last full run, whose largest-model part the report has no time for
        written = datetime.datetime.fromtimestamp(OFFLOAD_JSON.stat().st_mtime, datetime.timezone.utc)
        saved = json.loads(OFFLOAD_JSON.read_text())
        ran["saved_full_run"] = {"written": written.strftime("%Y-%m-%d %H:%M UTC"), "markdown": saved["markdown"]}
    return ran


def run_trainer(args: argparse.Namespace) -> dict[str, Any]:
    """bench/trainer_bench.py's table (the Trainer under DDP, accelerate_zero and DeepSpeed), printed by a run now."""
    if args.skip_trainer:
        return {"status": "skipped"}
    ds_venv = [] if args.ds_venv == launch.DEFAULT_DS_VENV else ["--ds_venv", str(args.ds_venv)]
    argv = [*shlex.split(args.trainer_args), *ds_venv, "--json", str(args.out_dir / "trainer.json")]
    return run_question("trainer_bench.py", argv, args.trainer_timeout, args.out_dir)


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    args.out_dir.mkdir(parents=True, exist_ok=True)
    os.environ[models.SIZE_ENV["hidden"]], os.environ[models.SIZE_ENV["layers"]] = str(args.hidden), str(args.layers)
    payload: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "seconds": {}, "notes": []}
    payload.update(machine=report.machine_facts(), load_start={"loadavg": list(os.getloadavg())})
    start = time.perf_counter()
    print(f"memory against world size: W = {args.sweep_world_sizes}", flush=True)
    payload["sweep"] = {w: run_sweep(w, args) for w in args.sweep_world_sizes}
    payload["seconds"]["sweep"] = time.perf_counter() - start
    runnable = steps.runnable(args.systems, args.ds_venv)
    if runnable != args.systems:
        skipped = sorted(set(args.systems) - set(runnable))
        payload["notes"].append(f"DeepSpeed skipped ({', '.join(skipped)}): no virtualenv at {args.ds_venv}.")
    print(f"systems at W = {args.world_size}: {', '.join(runnable)}, then ddp again", flush=True)
    mark = time.perf_counter()
    payload["main"], payload["failed"] = {system: [] for system in runnable}, []
    for system, round_index in [(s, 0) for s in runnable] + ([("ddp", 1)] if "ddp" in runnable else []):
        ranks = steps.launch_train(system, args.world_size, out_dir=args.out_dir / f"w{args.world_size}",
                                   ds_venv=args.ds_venv, round_index=round_index, steps=args.steps,
                                   warmup=args.warmup)  # fmt: skip
        payload["main"][system] += [ranks] if ranks is not None else []
        payload["failed"] += [system] if ranks is None else []
    payload["seconds"]["systems"] = time.perf_counter() - mark
    for name, run in (("offload", run_offload), ("trainer", run_trainer)):
        print(name, flush=True)
        mark = time.perf_counter()
        payload[name] = run(args)
        payload["seconds"][name] = time.perf_counter() - mark
    payload["seconds"]["total"] = time.perf_counter() - start
    payload["load_end"] = {"loadavg": list(os.getloadavg())}
    (args.out_dir / "report.json").write_text(json.dumps(payload, indent=1, default=str))
    return payload


def main() -> None:
    args = parse_args()
    payload = json.loads(args.from_json.read_text()) if args.from_json else run_all(args)
    import render_report  # after the runs: it imports torch and accelerate_zero for the estimate

    render_report.write(payload, args.results, args.plots_dir)
    minutes = payload["seconds"]["total"] / 60
    print(f"wrote {args.results} and {args.plots_dir}/*.png; the runs took {minutes:.1f} minutes")
    if payload.get("failed"):
        sys.exit(f"these systems failed (logs in {args.out_dir}): {', '.join(payload['failed'])}")


if __name__ == "__main__":
    main()
