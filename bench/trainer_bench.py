"""The transformers Trainer under DDP, accelerate_zero stages 2 and 3, and DeepSpeed stages 2 and 3 (issue 18).

Usage:
    .venv/bin/python bench/trainer_bench.py                       # every system, 2 rounds, ~12 minutes
    .venv/bin/python bench/trainer_bench.py --systems ddp az2 az3 --rounds 3 --json bench/out/trainer.json

What runs: a LlamaForCausalLM of 33.1M parameters (hidden 512, 4 layers, vocabulary 20000, random weights, fp32)
trained by the Trainer on random token rows (sequence 128, micro-batch 2 per rank, gradient accumulation 2, AdamW)
on 2 ranks, each system in its own `torchrun --standalone` group (gloo, one thread per rank). The configs are the
ZeRO configs transformers documents for the Trainer, with every value the Trainer fills left "auto":
- stage 2: `allgather_partitions`, `overlap_comm`, `reduce_scatter`, `contiguous_gradients` true, buckets "auto";
- stage 3: `overlap_comm` true, `reduce_bucket_size` / `stage3_prefetch_bucket_size` /
  `stage3_param_persistence_threshold` "auto" (hidden², 0.9·hidden², 10·hidden), `sub_group_size`,
  `stage3_max_live_parameters`, `stage3_max_reuse_distance` 1e9, 16-bit weights gathered on save;
- `az3_offload` / `ds3_offload`: the stage-3 config with `offload_optimizer` and `offload_param` on the CPU.
DDP is the plain transformers Trainer under torchrun. DeepSpeed runs from its own virtualenv (`--ds_venv`, default
/work/ds-venv, with DS_ACCELERATOR=cpu); without it the DeepSpeed systems are skipped with a note.

Per optimizer step, a TrainerCallback reads the process CPU time and the wall time of every rank between
`on_step_begin` and `on_step_end`; the medians over the timed steps (after `--warmup` steps) and over rounds are
reported with their ratio to DDP's in the same run. Systems run in interleaved rounds (every other round in reverse
order), so the machine's other load falls on all of them alike. CPU time is the issue's measure: on 2 shared cores
it moves less with other users' load than wall time. Also reported: each rank's peak RSS and, at stage 3, the share
of the step forward and backward waited for parameter gathers (`scheduler.blocked_seconds`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
AZ_SYSTEMS = ["ddp", "az2", "az3", "az3_offload"]
DS_SYSTEMS = ["ds2", "ds3", "ds3_offload"]
GOALS = {"az2": 1.05, "az3": 1.15}
"""Issue 18's goals: CPU time per step at most this times DDP's."""

HIDDEN, LAYERS, VOCAB, INTERMEDIATE, SEQ = 512, 4, 20000, 1376, 128


def _zero_config(stage: int, offload: bool) -> dict[str, Any]:
    autos = {k: "auto" for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")}
    if stage == 2:
        zero: dict[str, Any] = {
            "stage": 2,
            "allgather_partitions": True,
            "allgather_bucket_size": 2e8,
            "overlap_comm": True,
            "reduce_scatter": True,
            "reduce_bucket_size": "auto",
            "contiguous_gradients": True,
        }
    else:
        zero = {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "sub_group_size": 1e9,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": True,
        }
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        **autos,
        "gradient_clipping": "auto",
        "fp16": {"enabled": "auto"},
        "bf16": {"enabled": "auto"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "zero_optimization": zero,
    }


# ------------------------------------------------------------------------------------------------------ worker
def _worker(system: str, args: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    rows = torch.randint(0, VOCAB, (4096, SEQ), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in rows]
    steps: list[tuple[float, float]] = []
    blocked: list[float] = []

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.start: tuple[float, float] | None = None
            self.engine: Any = None

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            scheduler = getattr(self.engine, "scheduler", None)
            if scheduler is not None:
                scheduler.blocked_seconds = 0.0
            self.start = (time.process_time(), time.perf_counter())

        def on_step_end(self, *_: Any, **__: Any) -> None:
            assert self.start is not None
            steps.append((time.process_time() - self.start[0], time.perf_counter() - self.start[1]))
            scheduler = getattr(self.engine, "scheduler", None)
            if scheduler is not None:
                blocked.append(scheduler.blocked_seconds)

    clock = Clock()
    common: dict[str, Any] = {
        "output_dir": tempfile.mkdtemp(prefix="trainer_bench_"),
        "per_device_train_batch_size": args.micro,
        "gradient_accumulation_steps": args.accumulation,
        "max_steps": args.warmup + args.steps,
        "learning_rate": 1e-4,
        "max_grad_norm": 1.0,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "logging_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "seed": 0,
    }
    stage, offload = (int(system[2]), system.endswith("_offload")) if system != "ddp" else (0, False)
    if system.startswith("az"):
        from accelerate_zero import Trainer, TrainingArguments

        training_args = TrainingArguments(zero_config=_zero_config(stage, offload), **common)
    elif system.startswith("ds"):
        from transformers import Trainer, TrainingArguments

        training_args = TrainingArguments(deepspeed=_zero_config(stage, offload), **common)
    else:
        from transformers import Trainer, TrainingArguments

        training_args = TrainingArguments(**common)
    trainer = Trainer(model=model, args=training_args, train_dataset=data, callbacks=[clock])
    if system.startswith("az"):

        class FindEngine(TrainerCallback):
            def on_train_begin(self, *_: Any, **__: Any) -> None:
                clock.engine = getattr(trainer, "zero_engine", None) or _find_engine(trainer)

        trainer.add_callback(FindEngine())
    if args.profile and rank == 0:
        import cProfile

        cProfile.runctx("trainer.train()", globals(), {"trainer": trainer}, str(Path(args.out).with_suffix(".prof")))
    else:
        trainer.train()
    timed = steps[args.warmup :]
    result = {
        "system": system,
        "rank": rank,
        "cpu": [c for c, _ in timed],
        "wall": [w for _, w in timed],
        "blocked": blocked[args.warmup :],
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "params": sum(p.numel() for p in model.parameters()) if system in ("ddp", "az2", "ds2") else None,
    }
    Path(args.out).with_suffix(f".rank{rank}.json").write_text(json.dumps(result))


def _find_engine(trainer: Any) -> Any:
    """The accelerate_zero engine behind the Trainer's model (for the stage-3 gather wait), or None."""
    for holder in (trainer, getattr(trainer, "accelerator", None)):
        for name in ("zero_engine", "engine", "_engine"):
            engine = getattr(holder, name, None)
            if engine is not None and hasattr(engine, "reducer"):
                return engine
    from accelerate_zero.engine.gathered import _ENGINE_OF_PARAM

    for param in trainer.model.parameters():
        engine = _ENGINE_OF_PARAM.get(param)
        if engine is not None:
            return engine
    return None


# -------------------------------------------------------------------------------------------------------- main
def _launch(system: str, args: argparse.Namespace, out: Path) -> list[dict[str, Any]] | str:
    if system.startswith("ds"):
        python = args.ds_venv / "bin" / "python"
        if not python.exists():
            return f"skipped: no DeepSpeed virtualenv at {args.ds_venv}"
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": ""}
    else:
        python = Path(sys.executable)
        env = {**os.environ, "PYTHONPATH": str(REPO)}
    env["OMP_NUM_THREADS"] = "1"
    command = [
        str(python),
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.world_size}",
        __file__,
        "--worker",
        system,
        f"--out={out}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--layers={args.layers}",
        f"--micro={args.micro}",
        f"--accumulation={args.accumulation}",
        *(["--profile"] if args.profile else []),
    ]
    log = out.with_suffix(".log")
    with open(log, "w") as handle:
        done = subprocess.run(command, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=1800, check=False)
    if done.returncode != 0:
        return f"failed (exit {done.returncode}): see {log}"
    return [json.loads(out.with_suffix(f".rank{r}.json").read_text()) for r in range(args.world_size)]


def _summary(runs: dict[str, list[list[dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    out = {}
    for system, rounds in runs.items():
        ranks = [r for round_ in rounds for r in round_]
        rank0 = [r for r in ranks if r["rank"] == 0]
        cpu = statistics.median(v for r in rank0 for v in r["cpu"])
        wall = statistics.median(v for r in rank0 for v in r["wall"])
        blocked = [b / w for r in rank0 for b, w in zip(r["blocked"], r["wall"], strict=False)]
        out[system] = {
            "cpu_per_step": cpu,
            "wall_per_step": wall,
            "blocked_share": statistics.median(blocked) if blocked else None,
            "max_rss_mb": max(r["max_rss_mb"] for r in ranks),
            "steps": sum(len(r["cpu"]) for r in rank0),
        }
    if "ddp" in out:
        for system in out:
            out[system]["cpu_vs_ddp"] = out[system]["cpu_per_step"] / out["ddp"]["cpu_per_step"]
            out[system]["wall_vs_ddp"] = out[system]["wall_per_step"] / out["ddp"]["wall_per_step"]
    return out


def _table(summary: dict[str, dict[str, Any]], notes: dict[str, str]) -> str:
    lines = [
        "| system | CPU s/step (rank 0) | vs DDP | goal | wall s/step | vs DDP | waiting for gathers | peak RSS/rank MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for system, s in summary.items():
        goal = GOALS.get(system)
        goal_text = f"<= {goal:.2f}: {'PASS' if s.get('cpu_vs_ddp', 9) <= goal else 'FAIL'}" if goal else ""
        blocked = f"{100 * s['blocked_share']:.1f}%" if s["blocked_share"] is not None else ""
        lines.append(
            f"| {system} | {s['cpu_per_step']:.3f} | {s.get('cpu_vs_ddp', float('nan')):.2f} | {goal_text} | "
            f"{s['wall_per_step']:.3f} | {s.get('wall_vs_ddp', float('nan')):.2f} | {blocked} | {s['max_rss_mb']:.0f} |"
        )
    for system, note in notes.items():
        lines.append(f"| {system} | {note} | | | | | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--systems", nargs="+", default=AZ_SYSTEMS + DS_SYSTEMS, choices=AZ_SYSTEMS + DS_SYSTEMS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps per system and round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--world_size", type=int, default=2)
    parser.add_argument("--ds_venv", type=Path, default=Path("/work/ds-venv"))
    parser.add_argument("--json", type=Path, default=None, help="write the raw and summarized numbers here")
    parser.add_argument("--profile", action="store_true", help="cProfile rank 0 (<out>.prof in the run folder)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args)
        return
    folder = Path(tempfile.mkdtemp(prefix="trainer_bench_"))
    runs: dict[str, list[list[dict[str, Any]]]] = {s: [] for s in args.systems}
    notes: dict[str, str] = {}
    loads = [os.getloadavg()[0]]
    for round_index in range(args.rounds):
        order = args.systems if round_index % 2 == 0 else args.systems[::-1]
        for system in order:
            if system in notes:
                continue
            result = _launch(system, args, folder / f"{system}_{round_index}")
            if isinstance(result, str):
                notes[system] = result
                runs.pop(system, None)
                print(f"{system}: {result}", flush=True)
                continue
            runs[system].append(result)
            print(f"{system} round {round_index}: done", flush=True)
            loads.append(os.getloadavg()[0])
    summary = _summary(runs)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    print(
        f"\nTrainer, {args.world_size} ranks, Llama {HIDDEN}x{args.layers} (vocab {VOCAB}), fp32, micro-batch "
        f"{args.micro}, accumulation {args.accumulation}, {args.rounds} rounds x {args.steps} steps; commit "
        f"{commit.stdout.strip()}, load average {min(loads):.1f}-{max(loads):.1f}\n"
    )
    print(_table(summary, notes))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"runs": runs, "summary": summary, "notes": notes}, indent=1))


if __name__ == "__main__":
    main()
