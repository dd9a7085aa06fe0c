"""The transformers Trainer under plain DDP, accelerate_zero stages 2/3 and DeepSpeed stages 2/3: CPU time per
optimizer step against DDP's, per phase and per thread (issue 18; bench/README.md, "trainer_bench.py", says what
runs and how each number is read).

Usage:
    .venv/bin/python bench/trainer_bench.py                # 5 systems x 2 rounds x 10 steps, ~8 minutes
    .venv/bin/python bench/trainer_bench.py --code head --json bench/out/trainer.json     # the committed code
    .venv/bin/python bench/trainer_bench.py --systems ddp az2 az3 --rounds 3 --steps 4 --layers 2
    .venv/bin/python bench/trainer_bench.py --offload none                     # the same configs, offload removed
    .venv/bin/python bench/trainer_bench.py --baseline HEAD~3 --systems ddp az2  # each az system with that code too
    .venv/bin/python bench/trainer_bench.py --from_json bench/out/trainer.json  # print a saved run again

Systems, each on `--world_size` fresh ranks per round (harness/launch.py; rounds interleaved): `ddp` (transformers'
Trainer, no ZeRO), `az2` / `az3` (`accelerate_zero.Trainer` with `TrainingArguments(zero_config=...)`), `ds2` / `ds3`
(transformers' Trainer with `TrainingArguments(deepspeed=...)`, DeepSpeed from its own virtualenv), all with
transformers' own ds_config_zero2/3.json (tests/fixtures/). A TrainerCallback reads CPU and wall time from
`on_step_begin` to `on_step_end` on every rank; `PhaseClock` splits the CPU time into the step's phases.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import code, launch, report


BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
SYSTEMS = ["ddp", "az2", "az3", "ds2", "ds3"]
GOALS = {"az2": 1.05, "az3": 1.15}
"""Issue 18's goals: accelerate_zero's CPU time per optimizer step at most this many times DDP's."""
CONFIG_DIRS = [REPO / "tests" / "fixtures"]

HIDDEN, LAYERS, INTERMEDIATE, VOCAB, HEADS, SEQ = 512, 4, 1376, 20000, 8, 128
# TrainingArguments that agree with the values ds_config_zero3.json writes out (the rest of both files is "auto").
OPTIMIZER_ARGS = {
    "optim": "adamw_torch", "learning_rate": 3e-5, "adam_beta1": 0.8, "adam_beta2": 0.999, "adam_epsilon": 1e-8,
    "weight_decay": 3e-7, "warmup_steps": 500, "max_grad_norm": 1.0,
}  # fmt: skip
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping")
RUN_KEYS = ("steps", "warmup", "layers", "micro", "accumulation", "world_size", "offload", "prefetch", "profile",
            "torch_profile")  # fmt: skip
"""The options a rank reads (`train`'s keyword arguments besides the system and its output prefix)."""


# ------------------------------------------------------------------------------------------------------ configs
def config_path(stage: int) -> Path:
    for folder in CONFIG_DIRS:
        path = folder / f"ds_config_zero{stage}.json"
        if path.exists():
            return path
    raise FileNotFoundError(f"ds_config_zero{stage}.json is in none of {[str(d) for d in CONFIG_DIRS]}")


def system_config(system: str, offload: str, prefetch: str = "as_written") -> tuple[dict[str, Any] | None, list[str]]:
    """The DeepSpeed config a system trains with (None for DDP) and the changes made to the file, in words."""
    if system == "ddp":
        return None, []
    stage = int(system[2])
    path = config_path(stage)
    config = json.loads(path.read_text())
    changes = [f"read from {path}"]
    fp16 = config.get("fp16", {})
    if fp16.get("enabled") not in (False, "auto"):
        fp16["enabled"] = False
        changes.append("fp16.enabled true -> false (fp32 run)")
    zero = config["zero_optimization"]
    if system.startswith("ds") and zero.get("reduce_bucket_size") == 0:
        # DeepSpeed 0.19.8's config model requires reduce_bucket_size > 0 (zero3 writes 0). A bucket of 1 element
        # reduces each parameter on its own, which is what 0 means to accelerate_zero (shard_plan.plan_group).
        zero["reduce_bucket_size"] = 1
        changes.append(
            "zero_optimization.reduce_bucket_size 0 -> 1 (DeepSpeed requires > 0; one parameter per bucket)"
        )
    if system.startswith("ds"):
        # zero3 leaves the batch keys out; accelerate_zero takes them from the TrainingArguments, DeepSpeed asserts
        # that one is given and transformers fills only keys present, so add them as "auto" (filled the same way).
        added = [k for k in BATCH_KEYS if k not in config]
        config.update(dict.fromkeys(added, "auto"))
        if added:
            changes.append(f'added {", ".join(added)}: "auto" (DeepSpeed needs them; accelerate_zero fills them)')
    if prefetch == "auto" and stage == 3 and zero.get("stage3_prefetch_bucket_size") != "auto":
        # zero3 writes 0 (prefetching off); "auto" is what transformers' documented configs write (0.9 x hidden^2).
        written = zero.get("stage3_prefetch_bucket_size")
        changes.append(f'zero_optimization.stage3_prefetch_bucket_size {written} -> "auto" (--prefetch auto)')
        zero["stage3_prefetch_bucket_size"] = "auto"
    if offload == "none":
        for key in ("offload_optimizer", "offload_param"):
            if zero.pop(key, None) is not None:
                changes.append(f"zero_optimization.{key} removed (--offload none)")
    return config, changes


# ------------------------------------------------------------------------------------------------------- ranks
def train(system: str, out: str, **run: Any) -> dict[str, Any]:
    """Rank function: the Trainer trains `system`; every optimizer step's CPU and wall time, per phase and thread.

    `run` holds `RUN_KEYS`; `out` is the run's path prefix (the cProfile and torch.profiler tables go beside it).
    """
    import torch
    from harness import models
    from transformers import TrainerCallback

    rank = int(os.environ["RANK"])  # the Trainer makes the process group
    config = models.llama_config(HIDDEN, run["layers"], vocab=VOCAB, intermediate=INTERMEDIATE, heads=HEADS, seq=SEQ)
    model = models.llama(config)
    params = sum(p.numel() for p in model.parameters())
    rows_needed = run["world_size"] * run["micro"] * run["accumulation"] * (run["warmup"] + run["steps"] + 1)
    train_rows = [{"input_ids": row, "labels": row} for row in models.tokens(rows_needed, SEQ, VOCAB, seed=1)]
    readings: dict[str, list[float]] = {"cpu": [], "wall": [], "gather_wait": [], "minor_faults": []}
    holder: dict[str, Any] = {}
    phases = PhaseClock()
    timed_end = run["warmup"] + run["steps"]

    class StepClock(TrainerCallback):
        """CPU and wall time between on_step_begin and on_step_end: one optimizer step (all its micro-steps)."""

        begin: tuple[float, float] = (0.0, 0.0)
        faults = 0

        def _unit_scheduler(self) -> Any:
            return getattr(getattr(holder.get("trainer"), "zero_engine", None), "scheduler", None)

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            if not phases.installed:
                phases.install(holder["trainer"], system)
            if len(readings["cpu"]) == run["warmup"] and "threads" not in holder:  # the first timed step
                holder["threads"] = _thread_cpu_seconds()
                if run["torch_profile"]:
                    holder["profiler"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                    holder["profiler"].__enter__()
            scheduler = self._unit_scheduler()
            if scheduler is not None and hasattr(scheduler, "blocked_seconds"):
                scheduler.blocked_seconds = 0.0
            phases.start_step()
            self.faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            self.begin = (time.process_time(), time.perf_counter())

        def on_step_end(self, *_: Any, **__: Any) -> None:
            cpu, wall = time.process_time() - self.begin[0], time.perf_counter() - self.begin[1]
            readings["cpu"].append(cpu)
            readings["wall"].append(wall)
            readings["minor_faults"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - self.faults)
            phases.end_step(cpu)
            scheduler = self._unit_scheduler()
            if scheduler is not None and hasattr(scheduler, "blocked_seconds"):
                readings["gather_wait"].append(scheduler.blocked_seconds)
            if len(readings["cpu"]) == timed_end:  # the last timed step
                if "profiler" in holder:
                    profiler = holder.pop("profiler")
                    profiler.__exit__(None, None, None)
                    table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=60)
                    Path(f"{out}.rank{rank}.ops.txt").write_text(table)
                after, before = _thread_cpu_seconds(), holder["threads"]
                holder["thread_cpu"] = {k: v - before.get(k, 0.0) for k, v in after.items() if v > before.get(k, 0.0)}

    arguments: dict[str, Any] = {
        "output_dir": f"{out}.trainer_output", "per_device_train_batch_size": run["micro"],  # nothing is saved there
        "gradient_accumulation_steps": run["accumulation"], "max_steps": timed_end, **OPTIMIZER_ARGS, "use_cpu": True,
        "report_to": [], "save_strategy": "no", "logging_strategy": "no", "disable_tqdm": True,
        "dataloader_num_workers": 0, "seed": 0,
    }  # fmt: skip
    config, _ = system_config(system, run["offload"], run["prefetch"])
    if system.startswith("az"):
        from accelerate_zero import Trainer, TrainingArguments

        arguments["zero_config"] = config
    else:
        from transformers import Trainer, TrainingArguments

        if system.startswith("ds"):
            arguments["deepspeed"] = config
    trainer = Trainer(
        model=model, args=TrainingArguments(**arguments), train_dataset=train_rows, callbacks=[StepClock()]
    )
    holder["trainer"] = trainer
    started = time.perf_counter()
    if run["profile"] and rank == 0:
        import cProfile

        cProfile.runctx("trainer.train()", {}, {"trainer": trainer}, f"{out}.prof")
    else:
        trainer.train()
    skip = run["warmup"]
    timed = {key: values[skip:] for key, values in readings.items()}
    return {
        "system": system, "rank": rank, "params": params, **timed, "warmup_cpu": readings["cpu"][:skip],
        "warmup_wall": readings["wall"][:skip], "train_seconds": time.perf_counter() - started,
        "thread_cpu": holder.get("thread_cpu", {}), "phase_cpu": {k: v[skip:] for k, v in phases.steps.items()},
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
        "torch": torch.__version__, "modules": _versions(),
    }  # fmt: skip


class PhaseClock:
    """Process CPU time (every thread: gloo's included) per phase of each optimizer step: the model's forward, the
    backward with its gradient reduction, the optimizer step (clipping, the step and, at stages 1-2, the parameter
    all-gather) and the rest of the Trainer's step. The bench wraps the bound methods of its own Trainer's objects
    (the engine's `backward` and `step`; under DDP the accelerator's `backward`, the Trainer's `_clip_grad_norm` and
    the optimizer's `step`) and hooks the model's forward; nothing of the library is changed."""

    PHASES = ("forward", "backward", "optimizer", "other")

    def __init__(self) -> None:
        self.installed = False
        self.current: dict[str, float] = dict.fromkeys(self.PHASES, 0.0)
        self.steps: dict[str, list[float]] = {p: [] for p in self.PHASES}
        self._forward_start = 0.0

    def install(self, trainer: Any, system: str) -> None:
        self.installed = True
        trainer.model.register_forward_pre_hook(self._forward_begins)
        trainer.model.register_forward_hook(self._forward_ends)
        engine = getattr(trainer, "zero_engine", None)
        if system.startswith("az") and engine is not None:
            self._time(engine, "backward", "backward")
            self._time(engine, "step", "optimizer")
        else:  # DDP (DeepSpeed: its engine's step runs inside the accelerator's backward, counted there)
            self._time(trainer.accelerator, "backward", "backward")
            self._time(trainer, "_clip_grad_norm", "optimizer")
            self._time(trainer.optimizer, "step", "optimizer")

    def _time(self, owner: Any, name: str, phase: str) -> None:
        method = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.process_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.current[phase] += time.process_time() - start

        setattr(owner, name, timed)

    def _forward_begins(self, *_: Any) -> None:
        self._forward_start = time.process_time()

    def _forward_ends(self, *_: Any) -> None:
        self.current["forward"] += time.process_time() - self._forward_start

    def start_step(self) -> None:
        self.current = dict.fromkeys(self.PHASES, 0.0)

    def end_step(self, total: float) -> None:
        self.current["other"] = total - sum(v for k, v in self.current.items() if k != "other")
        for phase, seconds in self.current.items():
            self.steps[phase].append(seconds)


def _thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) of each thread of this process, keyed "<name>/<tid>" (the main thread is the
    one whose id is the process's; gloo's and the host step's threads show apart from it)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        main = "main" if task.name == str(os.getpid()) else name
        out[f"{main}/{task.name}"] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def _versions() -> dict[str, str]:
    out = {}
    for name in ("transformers", "accelerate", "deepspeed", "accelerate_zero"):
        module = sys.modules.get(name)
        if module is not None:
            out[name] = (
                f"{getattr(module, '__version__', '?')} ({Path(getattr(module, '__file__', '') or '?').parent})"
            )
    return out


# --------------------------------------------------------------------------------------------------- launching
def base_system(system: str) -> str:
    """ "az2" for "az2@<commit>" (accelerate_zero from `--baseline`), the name itself otherwise."""
    return system.split("@")[0]


def run_system(system: str, args: argparse.Namespace, folder: Path, name: str, tree: Path) -> list[Any] | str:
    """One system on `--world_size` fresh ranks; its per-rank readings, or why it did not run."""
    system = base_system(system)
    python = launch.deepspeed_python(args.ds_venv) if system.startswith("ds") else None
    if system.startswith("ds") and python is None:
        return f"skipped: no DeepSpeed virtualenv at {args.ds_venv}"
    kwargs = {"system": system, "out": str(folder / name), **{key: getattr(args, key) for key in RUN_KEYS}}
    env = None if python is not None else {"PYTHONPATH": str(tree)}  # DeepSpeed's ranks: never the project's code
    try:
        return launch.on_ranks(args.world_size, train, kwargs, name=name, out_dir=folder, python=python, env=env,
                               timeout=args.timeout, backend="none").results  # fmt: skip
    except launch.LaunchFailed as failed:
        return f"failed ({failed.code}), see {folder / name}.log"


# ----------------------------------------------------------------------------------------------------- summary
def summarize(runs: dict[str, list[list[dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    """Per system: medians over every timed step of every round, per-round medians, peak RSS per rank."""
    summary: dict[str, dict[str, Any]] = {}
    for system, rounds in runs.items():
        if not rounds:
            continue
        by_rank: dict[int, list[dict[str, Any]]] = {}
        for round_ in rounds:
            for reading in round_:
                by_rank.setdefault(reading["rank"], []).append(reading)
        row: dict[str, Any] = {"rounds": len(rounds), "steps": sum(len(r["cpu"]) for r in by_rank[0])}
        for rank, readings in sorted(by_rank.items()):
            row[f"cpu_rank{rank}"] = statistics.median(v for r in readings for v in r["cpu"])
            row[f"wall_rank{rank}"] = statistics.median(v for r in readings for v in r["wall"])
            row[f"peak_rss_mib_rank{rank}"] = max(r["peak_rss_mib"] for r in readings)
        row["cpu_rank0_by_round"] = [statistics.median(r["cpu"]) for r in by_rank[0]]
        waits = [w / t for r in by_rank[0] for w, t in zip(r["gather_wait"], r["wall"], strict=False) if t > 0]
        row["gather_wait_share"] = statistics.median(waits) if waits else None
        row["params"] = by_rank[0][0]["params"]
        faults = [v for r in by_rank[0] for v in r.get("minor_faults", [])]
        row["minor_faults_rank0"] = statistics.median(faults) if faults else None
        row["phase_cpu_rank0"] = {
            phase: statistics.median(v for r in by_rank[0] for v in r.get("phase_cpu", {}).get(phase, []))
            for phase in PhaseClock.PHASES
            if any(r.get("phase_cpu", {}).get(phase) for r in by_rank[0])
        }
        summary[system] = row
    base = summary.get("ddp")
    for row in summary.values():
        for key in [k for k in row if k.startswith(("cpu_rank", "wall_rank")) and not k.endswith("by_round")]:
            row[f"{key}_vs_ddp"] = row[key] / base[key] if base is not None and key in base else None
    return summary


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def table(summary: dict[str, dict[str, Any]], notes: dict[str, str]) -> str:
    rows = []
    for system, row in summary.items():
        goal, ratio = GOALS.get(base_system(system)), row.get("cpu_rank0_vs_ddp")
        verdict = "no DDP run" if ratio is None or goal is None else ("PASS" if ratio <= goal else "FAIL")
        wait = row["gather_wait_share"]
        rows.append((
            system, f"{row['cpu_rank0']:.3f}", _ratio(ratio), "" if goal is None else f"<= {goal:.2f}: {verdict}",
            f"{row.get('cpu_rank1', 0):.3f}", _ratio(row.get("cpu_rank1_vs_ddp")), f"{row['wall_rank0']:.3f}",
            _ratio(row.get("wall_rank0_vs_ddp")), " / ".join(f"{v:.3f}" for v in row["cpu_rank0_by_round"]),
            "" if wait is None else f"{100 * wait:.1f}%",
            " / ".join(f"{row[k]:.0f}" for k in sorted(row) if k.startswith("peak_rss_mib_rank")),
        ))  # fmt: skip
    rows += [(system, note, *[""] * 9) for system, note in notes.items()]
    columns = ["system", "CPU s/step rank 0", "vs DDP", "goal", "CPU s/step rank 1", "vs DDP", "wall s/step rank 0",
               "vs DDP", "rank-0 CPU by round", "waiting for gathers", "peak RSS MiB rank 0 / 1"]  # fmt: skip
    return report.table(columns, rows, "lrrlrrrrlrl")


def phase_table(summary: dict[str, dict[str, Any]]) -> str:
    """Rank 0's median CPU seconds per phase of a step (PhaseClock), and the difference from DDP's; the page faults
    per step (first touches of fresh memory: the kernel zeroes every page)."""
    base = summary.get("ddp", {}).get("phase_cpu_rank0", {})
    rows = []
    for system, row in summary.items():
        phases = row.get("phase_cpu_rank0", {})
        if not phases:
            continue
        cells = []
        for phase in PhaseClock.PHASES:
            value = phases.get(phase)
            delta = "" if value is None or phase not in base or system == "ddp" else f" ({value - base[phase]:+.3f})"
            cells.append("" if value is None else f"{value:.3f}{delta}")
        faults = row.get("minor_faults_rank0")
        rows.append((system, *cells, "" if faults is None else f"{faults:.0f}"))
    columns = ["system", *(f"{p} CPU s (vs DDP)" for p in PhaseClock.PHASES), "minor page faults"]
    return report.table(columns, rows)


def header(meta: dict[str, Any]) -> str:
    a, loads = meta["args"], meta["load_averages"]
    return (
        f"Trainer, {a['world_size']} ranks, LlamaForCausalLM {meta['params'] / 1e6:.1f}M params (hidden {HIDDEN}, "
        f"{a['layers']} layers, vocab {VOCAB}), fp32, micro-batch {a['micro']}, accumulation {a['accumulation']}, "
        f"seq {SEQ}; {a['rounds']} rounds x {a['steps']} timed steps after {a['warmup']} warm-up; offload "
        f"{a['offload']}; prefetch {a.get('prefetch', 'as_written')}; {meta['start_utc']} to {meta['end_utc']} UTC "
        f"({meta['seconds'] / 60:.1f} min); load average (1 min) {min(loads):.2f}-{max(loads):.2f}; code: "
        f"{meta['code']}"
    )


def report_text(payload: dict[str, Any]) -> str:
    meta = payload["meta"]
    lines = [header(meta), "", *(f"- {system}: " + "; ".join(changes) for system, changes in meta["configs"].items())]
    lines += ["", table(payload["summary"], payload["notes"]), "", phase_table(payload["summary"]), ""]
    for system, row in payload["summary"].items():
        goal, ratio = GOALS.get(base_system(system)), row.get("cpu_rank0_vs_ddp")
        if goal is not None and ratio is not None:
            verdict = "PASS" if ratio <= goal else "FAIL"
            lines.append(
                f"goal {system}: CPU time per step {ratio:.2f}x DDP's (rank 0), at most {goal:.2f}: {verdict}"
            )
    ddp = payload["summary"].get("ddp")
    if ddp is not None and len(ddp["cpu_rank0_by_round"]) > 1:
        spread = max(ddp["cpu_rank0_by_round"]) / min(ddp["cpu_rank0_by_round"])
        lines.append(f"noise: DDP's per-round medians of rank-0 CPU time are {spread:.2f}x apart")
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per system and round")
    parser.add_argument("--warmup", type=int, default=2, help="optimizer steps before the timed ones")
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--micro", type=int, default=2, help="per-device train batch size")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument("--offload", choices=["as_written", "none"], default="as_written")
    parser.add_argument(
        "--prefetch",
        choices=["as_written", "auto"],
        default="as_written",
        help="stage 3: zero3's stage3_prefetch_bucket_size (0: off) or \"auto\" (0.9 x hidden^2, transformers' docs)",
    )
    parser.add_argument(
        "--code",
        default="tree",
        help="accelerate_zero from the working tree (tree), or from a `git archive` of HEAD (head: for a tree others "
        "are editing) or of any other commit (a before/after comparison with the same benchmark code)",
    )
    parser.add_argument(
        "--baseline",
        default=None,
        help="also run every accelerate_zero system with the code of this revision (a `git archive`), interleaved "
        "with the others: rows <system>@<commit>",
    )
    parser.add_argument("--ds_venv", type=Path, default=launch.DEFAULT_DS_VENV)
    parser.add_argument("--timeout", type=int, default=900, help="seconds before one system's run is cut")
    parser.add_argument("--json", type=Path, default=None, help="write the raw readings and the summary here")
    parser.add_argument("--from_json", type=Path, default=None, help="print a saved run's report, run nothing")
    parser.add_argument("--profile", action="store_true", help="cProfile rank 0 (a .prof beside each run's log)")
    parser.add_argument(
        "--torch_profile",
        action="store_true",
        help="torch.profiler over the timed steps: each rank's ops by self CPU time in <run>.rank<R>.ops.txt",
    )
    args = parser.parse_args()
    if args.from_json:
        print(report_text(json.loads(args.from_json.read_text())))
        return

    start_utc = datetime.datetime.now(datetime.timezone.utc)
    started = time.perf_counter()
    folder = Path(tempfile.mkdtemp(prefix="trainer_bench_"))
    tree, code_text = code.code_tree(args.code, folder)
    codes = dict.fromkeys(args.systems, tree)
    if args.baseline:
        # Each accelerate_zero system runs twice per round, next to itself with the baseline's code: an A/B in one
        # interleaved run, under the same load.
        baseline, baseline_text = code.code_tree(args.baseline, folder)
        code_text += f"; systems named <system>@{baseline.name[5:]}: {baseline_text}"
        systems = []
        for system in args.systems:
            systems.append(system)
            if system.startswith("az"):
                systems.append(f"{system}@{baseline.name[5:]}")
                codes[systems[-1]] = baseline
        args.systems = systems
    configs = {s: system_config(base_system(s), args.offload, args.prefetch)[1] for s in args.systems if s != "ddp"}
    runs: dict[str, list[list[dict[str, Any]]]] = {s: [] for s in args.systems}
    notes: dict[str, str] = {}
    loads = [os.getloadavg()[0]]
    print(f"logs in {folder}; code: {code_text}", flush=True)
    for round_index in range(args.rounds):
        order = args.systems if round_index % 2 == 0 else args.systems[::-1]
        for system in order:
            if system in notes:
                continue
            mark = time.perf_counter()
            result = run_system(system, args, folder, f"{system}_round{round_index + 1}", codes[system])
            loads.append(os.getloadavg()[0])
            if isinstance(result, str):
                notes[system] = result
                runs.pop(system)
                print(f"{system}: {result}", flush=True)
                continue
            runs[system].append(result)
            print(
                f"{system} round {round_index + 1}: rank-0 CPU s/step median {statistics.median(result[0]['cpu']):.3f}"
                f" ({time.perf_counter() - mark:.0f} s, load {loads[-1]:.2f})",
                flush=True,
            )
    summary = summarize(runs)
    params = next((row["params"] for row in summary.values()), 0)
    for snapshot in set(codes.values()) - {REPO}:
        shutil.rmtree(snapshot, ignore_errors=True)
    meta = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "start_utc": start_utc.strftime("%Y-%m-%d %H:%M"),
        "end_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "seconds": time.perf_counter() - started,
        "load_averages": loads,
        "load_average_1_5_15_at_end": list(os.getloadavg()),
        "code": code_text,
        "commit": code.git("rev-parse", "--short", "HEAD"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "params": params,
        "configs": configs,
        "config_used": {
            s: system_config(base_system(s), args.offload, args.prefetch)[0] for s in args.systems if s != "ddp"
        },
        "versions": {s: copy.deepcopy(r[0][0].get("modules", {})) for s, r in runs.items() if r},
    }
    payload = {"meta": meta, "runs": runs, "summary": summary, "notes": notes}
    print(f"\n{report_text(payload)}")
    if args.json is not None:
        report.save_json(args.json, payload, report.machine_facts())


if __name__ == "__main__":
    main()
