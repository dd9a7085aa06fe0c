"""Offload: step time of each mode against no offload, and the largest model each system trains in a RAM budget.

Usage:
    .venv/bin/python bench/offload_bench.py                         # both parts; budget 24 GiB (this machine)
    .venv/bin/python bench/offload_bench.py --ram_budget_gb 4       # the largest-model search within 4 GiB
    .venv/bin/python bench/offload_bench.py --part step_time --steps 12
    .venv/bin/python bench/offload_bench.py --part largest --ram_budget_gb 4 --systems ddp az3_nvme
    .venv/bin/python bench/offload_bench.py --from_json bench/out/offload.json   # print a saved run again

Part 1, step time: at 2 processes (gloo, one thread per rank, fp32 AdamW), a stack of `--layers` x
Linear(--hidden, --hidden) with ReLU, 8 samples per rank. One torchrun group per stage trains every mode in turn
(no offload first and again last; the ratio is against the mean of the two medians, which absorbs drift from
other load on the machine): the median over `--steps` (>= 10) timed steps after 2 warm-up steps, each step timed
on rank 0 between barriers. Modes: none, optimizer cpu, optimizer+param cpu (stage 3), optimizer nvme,
optimizer+param nvme (stage 3, `max_in_cpu: 0` so every shard is on disk); stage 2 runs the modes that exist there.

Part 2, largest model: a LlamaForCausalLM (hidden 1024, intermediate 2816, 8 heads, vocab 1024; 12.85M
parameters per decoder layer) with a ladder of layer counts trains 3 steps (batch 2 x 64 tokens per rank, fp32
AdamW) at 2 processes, each point in its own torchrun group: `ddp` (DistributedDataParallel with its defaults, the
model built on every rank), `az3` (stage 3), `az3_cpu` (stage 3, optimizer and parameters offloaded to CPU) and
`az3_nvme` (stage 3, optimizer and parameters in files under --nvme_dir, `max_in_cpu: 0`); the stage-3 systems
gather one layer ahead with at most two live and release each after use (LEAN_STAGE3). The ZeRO systems load the model
partitioned with `accelerate_zero.from_pretrained` from a safetensors checkpoint written layer by layer (so no
process ever builds the whole model); DDP cannot and builds it. The reading is each rank's peak RSS (VmHWM of the
whole process, libraries included); a point fits when the sum over the ranks is within `--ram_budget_gb`. A
watchdog kills a point as soon as the ranks' RSS sum exceeds the budget (the point does not fit), so no run ever
takes more than the budget. For each system the ladder is climbed until the first point that does not fit.
The checkpoint and the swap files live under --nvme_dir (a local disk folder), deleted at the end.

Output: markdown tables on stdout and everything as JSON in --json (default bench/out/offload.json; its
"markdown" entry holds the tables).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


BENCH_DIR = Path(__file__).resolve().parent
GIB = 1024**3
LLAMA = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_attention_heads=8,
    num_key_value_heads=8,
    vocab_size=1024,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
LADDER = [1, 2, 4, 6, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96]
# Largest-model part, ZeRO systems: gather one decoder layer ahead, at most two live, release each after use (the
# settings a user picks to fit the largest model; DeepSpeed's defaults keep up to 1e9 parameters gathered).
LEAN_STAGE3 = {
    "stage3_prefetch_bucket_size": 13_000_000,
    "stage3_max_live_parameters": 26_000_000,
    "stage3_max_reuse_distance": 0,
}
LARGEST_SYSTEMS = ["ddp", "az3", "az3_cpu", "az3_nvme"]
STEP_MODES = {
    2: ["none", "opt_cpu", "opt_nvme"],
    3: ["none", "opt_cpu", "opt_param_cpu", "opt_nvme", "opt_param_nvme"],
}
MODE_LABEL = {
    "none": "no offload",
    "opt_cpu": "optimizer cpu",
    "opt_param_cpu": "optimizer + param cpu",
    "opt_nvme": "optimizer nvme",
    "opt_param_nvme": "optimizer + param nvme",
}


def zero_config(stage: int, mode: str, nvme_dir: str) -> dict[str, Any]:
    """The DeepSpeed-format config of one offload mode."""
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    if mode.startswith("opt_"):
        device = "nvme" if mode.endswith("nvme") else "cpu"
        zero["offload_optimizer"] = (
            {"device": device, "nvme_path": nvme_dir} if device == "nvme" else {"device": device}
        )
        zero["sub_group_size"] = 4_000_000
    if mode == "opt_param_cpu":
        zero["offload_param"] = {"device": "cpu"}
    if mode == "opt_param_nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir, "max_in_cpu": 0}
    return {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.0, "zero_optimization": zero}


# ------------------------------------------------------------------------------------------------ rank side
def _rss() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def worker_step_time(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import accelerate_zero

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    x, y = torch.randn(8, args.hidden), torch.randn(8, args.hidden)
    modes = STEP_MODES[args.stage]
    results: dict[str, list[float]] = {}
    for mode in [*modes, "none"]:
        torch.manual_seed(0)
        layers = [m for _ in range(args.layers) for m in (nn.Linear(args.hidden, args.hidden), nn.ReLU())]
        model = nn.Sequential(*layers)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine = accelerate_zero.initialize(model, optimizer, config=zero_config(args.stage, mode, args.nvme_dir))
        times = []
        for step in range(2 + args.steps):
            dist.barrier()
            start = time.perf_counter()
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
            dist.barrier()
            if step >= 2:
                times.append(time.perf_counter() - start)
        key = mode if mode not in results else "none_again"
        results[key] = times
        engine.destroy()
        del engine, model, optimizer
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))
    dist.destroy_process_group()


def worker_largest(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import accelerate_zero

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    baseline = _rss()["VmRSS"]
    if args.system == "ddp":
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**LLAMA, num_hidden_layers=args.layers))
        model = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def train_step(ids: torch.Tensor) -> None:
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    else:
        mode = {"az3": "none", "az3_cpu": "opt_param_cpu", "az3_nvme": "opt_param_nvme"}[args.system]
        config = zero_config(3, mode, args.nvme_dir)
        config["train_micro_batch_size_per_gpu"] = 2
        config["zero_optimization"].update(LEAN_STAGE3)
        model = accelerate_zero.from_pretrained(LlamaForCausalLM, args.checkpoint, config=config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine = accelerate_zero.initialize(model, optimizer, config=config)

        def train_step(ids: torch.Tensor) -> None:
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()

    generator = torch.Generator().manual_seed(rank)
    start = time.perf_counter()
    for _ in range(3):
        train_step(torch.randint(0, LLAMA["vocab_size"], (2, 64), generator=generator))
    seconds = time.perf_counter() - start
    reading = {"rank": rank, "baseline_rss": baseline, "peak_rss": _rss()["VmHWM"], "seconds_3_steps": seconds}
    readings: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(readings, reading)
    if rank == 0:
        Path(args.out).write_text(json.dumps(readings))
    dist.barrier()
    # Tearing down a gloo group that DDP still references can hang once the other rank has exited: leave at once.
    os._exit(0)


# ---------------------------------------------------------------------------------------------- launcher side
def _torchrun(worker_args: list[str], world_size: int) -> list[str]:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}"]
    return [*launch, str(Path(__file__).resolve()), "--worker", *worker_args]


def _env() -> dict[str, str]:
    # Freed buffers go back to the OS at once, so RSS follows what is live (as in engine_bench.py).
    return dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _tree_pids(root: int) -> list[int]:
    """`root` and all its descendants (torchrun's ranks need not share its process group)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    pids, stack = [], [root]
    while stack:
        pid = stack.pop()
        pids.append(pid)
        stack += children.get(pid, [])
    return pids


def _rss_of(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as statm:
                total += int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            pass
    return total


def run_watched(command: list[str], limit_bytes: float, timeout: float) -> tuple[str, int]:
    """Runs `command` in its own process group; kills it when its RSS sum exceeds `limit_bytes`.

    Returns:
        ("ok" | "over budget" | "failed (rc)" | "timeout", the largest RSS sum seen).
    """
    process = subprocess.Popen(command, env=_env(), start_new_session=True, stdout=subprocess.DEVNULL)
    seen, start = 0, time.monotonic()
    while process.poll() is None:
        pids = _tree_pids(process.pid)
        seen = max(seen, _rss_of(pids))
        over, late = seen > limit_bytes, time.monotonic() - start > timeout
        if over or late:
            for pid in reversed(pids):  # the ranks first, then torchrun: none keeps running
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            process.wait()
            return ("over budget" if over else "timeout"), seen
        time.sleep(0.1)
    return ("ok" if process.returncode == 0 else f"failed ({process.returncode})"), seen


def step_time_part(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    rows = []
    for stage in args.stages:
        out = work / f"step_time_stage{stage}.json"
        worker = ["--part", "step_time", "--stage", str(stage), "--steps", str(args.steps), "--out", str(out)]
        worker += ["--layers", str(args.layers), "--hidden", str(args.hidden), "--nvme_dir", str(args.nvme_dir)]
        print(f"step time, stage {stage}", file=sys.stderr, flush=True)
        done = subprocess.run(_torchrun(worker, 2), env=_env(), stdout=subprocess.DEVNULL)
        if done.returncode != 0:
            rows.append({"stage": stage, "mode": "all", "status": f"failed ({done.returncode})"})
            continue
        times = json.loads(out.read_text())
        reference = (statistics.median(times["none"]) + statistics.median(times["none_again"])) / 2
        for mode in STEP_MODES[stage]:
            median = statistics.median(times[mode])
            rows.append(
                {
                    "stage": stage,
                    "mode": mode,
                    "median_step_s": median,
                    "ratio_to_none": median / reference,
                    "steps": len(times[mode]),
                    "none_medians_s": [statistics.median(times["none"]), statistics.median(times["none_again"])],
                }
            )
    return rows


def write_checkpoint(folder: Path, ladder: list[int]) -> tuple[int, int]:
    """Writes a LlamaForCausalLM checkpoint one tensor at a time (one safetensors file per layer), then per
    ladder point a folder `L<n>` whose index names only the files of its first n layers.

    Returns:
        (parameters outside the decoder layers, parameters per decoder layer).
    """
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    max_layers = max(ladder)
    shards = folder / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    with torch.device("meta"):
        meta = LlamaForCausalLM(LlamaConfig(**LLAMA, num_hidden_layers=max_layers))
    generator = torch.Generator().manual_seed(0)
    by_file: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in meta.named_parameters():
        parts = name.split(".")
        file = f"layer{int(parts[2]):05d}.safetensors" if parts[1] == "layers" else "outer.safetensors"
        by_file.setdefault(file, {})[name] = param.shape
    for file, shapes in by_file.items():
        if (shards / file).exists():
            continue
        tensors = {}
        for name, shape in shapes.items():
            ones = name.endswith("norm.weight")
            tensors[name] = torch.ones(shape) if ones else torch.randn(shape, generator=generator) * 0.02
        save_file(tensors, str(shards / file), metadata={"format": "pt"})
    for layers in sorted(set(ladder)):
        point = folder / f"L{layers}"
        point.mkdir(exist_ok=True)
        LlamaConfig(**LLAMA, num_hidden_layers=layers).save_pretrained(point)
        weight_map = {}
        for file, shapes in by_file.items():
            if file == "outer.safetensors" or int(file[5:10]) < layers:
                weight_map.update({name: file for name in shapes})
                if not (point / file).exists():
                    (point / file).symlink_to(shards / file)
        index = {"metadata": {}, "weight_map": weight_map}
        (point / "model.safetensors.index.json").write_text(json.dumps(index))
    per_layer = sum(p.numel() for p in meta.model.layers[0].parameters())
    return sum(p.numel() for p in meta.parameters()) - max_layers * per_layer, per_layer


def largest_part(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    budget = args.ram_budget_gb * GIB
    ladder = [n for n in (args.ladder or LADDER) if n <= args.max_layers]
    outer, per_layer = write_checkpoint(args.nvme_dir / "checkpoint", ladder)
    out: dict[str, Any] = {"ram_budget_gb": args.ram_budget_gb, "points": [], "largest": {}}
    for system in args.systems:
        largest = None
        for layers in ladder:
            params = outer + layers * per_layer
            reading = work / f"largest_{system}_{layers}.json"
            swap = args.nvme_dir / f"swap_{system}_{layers}"
            worker = ["--part", "largest", "--system", system, "--layers", str(layers), "--out", str(reading)]
            worker += ["--nvme_dir", str(swap), "--checkpoint", str(args.nvme_dir / "checkpoint" / f"L{layers}")]
            print(f"largest: {system} with {layers} layers ({params / 1e6:.0f}M parameters)", file=sys.stderr)
            status, seen = run_watched(_torchrun(worker, 2), budget, args.point_timeout)
            shutil.rmtree(swap, ignore_errors=True)
            point: dict[str, Any] = {"system": system, "layers": layers, "params": params, "status": status}
            point["watchdog_max_rss_sum"] = seen
            if status == "ok":
                ranks = json.loads(reading.read_text())
                point["peak_rss_per_rank"] = [r["peak_rss"] for r in ranks]
                point["peak_rss_sum"] = sum(point["peak_rss_per_rank"])
                point["seconds_3_steps"] = max(r["seconds_3_steps"] for r in ranks)
                point["fits"] = point["peak_rss_sum"] <= budget
            else:
                point["fits"] = False
            out["points"].append(point)
            print(f"  {status}, peak RSS sum {point.get('peak_rss_sum', seen) / GIB:.2f} GiB", file=sys.stderr)
            if not point["fits"]:
                break
            largest = point
        out["largest"][system] = largest
    return out


def markdown(payload: dict[str, Any]) -> str:
    lines = []
    if payload.get("step_time"):
        lines += [
            f"Step time at 2 processes, fp32 AdamW, {payload['args']['layers']} x Linear({payload['args']['hidden']})"
            f" (median of {payload['args']['steps']} steps; ratio to no offload in the same group)",
            "",
            "| stage | mode | median step (ms) | ratio to no offload |",
            "| --- | --- | ---: | ---: |",
        ]
        for row in payload["step_time"]:
            if "median_step_s" not in row:
                lines.append(f"| {row['stage']} | {row['mode']} | {row['status']} | |")
                continue
            label = MODE_LABEL[row["mode"]]
            lines.append(
                f"| {row['stage']} | {label} | {1000 * row['median_step_s']:.1f} | {row['ratio_to_none']:.2f} |"
            )
        lines.append("")
    largest = payload.get("largest")
    if largest:
        budget = largest["ram_budget_gb"]
        ddp = largest["largest"].get("ddp")
        lines += [
            f"Largest LlamaForCausalLM that trains 3 steps at 2 processes within a RAM budget of {budget:g} GiB "
            "(sum over ranks of each rank's peak RSS, measured)",
            "",
            "| system | largest fitting (parameters) | layers | peak RSS per rank (GiB) | vs DDP | first size that "
            "does not fit |",
            "| --- | ---: | ---: | --- | ---: | --- |",
        ]
        for system, point in largest["largest"].items():
            failed = next(
                (p for p in largest["points"] if p["system"] == system and not p["fits"]),
                None,
            )
            over = f"{failed['params'] / 1e6:.0f}M ({failed['status']})" if failed else "none up to the ladder's top"
            if point is None:
                lines.append(f"| {system} | none | | | | {over} |")
                continue
            ratio = f"{point['params'] / ddp['params']:.1f}x" if ddp else "n/a"
            per_rank = ", ".join(f"{b / GIB:.2f}" for b in point["peak_rss_per_rank"])
            lines.append(
                f"| {system} | {point['params'] / 1e6:.0f}M | {point['layers']} | {per_rank} | {ratio} | {over} |"
            )
        nvme = largest["largest"].get("az3_nvme")
        if ddp and nvme:
            factor = nvme["params"] / ddp["params"]
            verdict = "MET" if factor >= 8 else "NOT MET"
            lines += ["", f"Target (stage 3 + NVMe >= 8x DDP): {verdict} ({factor:.1f}x at {budget:g} GiB)"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["both", "step_time", "largest"], default="both")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per mode (>= 10)")
    parser.add_argument("--stages", type=int, nargs="+", default=[3, 2])
    parser.add_argument("--layers", type=int, default=8, help="step time: Linear layers")
    parser.add_argument("--hidden", type=int, default=1024, help="step time: Linear width")
    parser.add_argument("--ram_budget_gb", type=float, default=24.0, help="largest model: RAM of the machine")
    parser.add_argument("--systems", nargs="+", default=LARGEST_SYSTEMS, choices=LARGEST_SYSTEMS)
    parser.add_argument("--max_layers", type=int, default=max(LADDER), help="largest model: top of the ladder")
    parser.add_argument(
        "--ladder",
        type=int,
        nargs="+",
        help=f"largest model: decoder layer counts to try, ascending (default {LADDER})",
    )
    parser.add_argument("--point_timeout", type=float, default=900, help="seconds before a ladder point is cut")
    parser.add_argument(
        "--nvme_dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "accelerate_zero_nvme_bench",
        help="a folder on the local disk to measure (default: in the system's temporary folder)",
    )
    parser.add_argument("--json", type=Path, default=BENCH_DIR / "out" / "offload.json")
    parser.add_argument("--from_json", type=Path, help="print the tables of a saved run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.worker:
        (worker_step_time if args.part == "step_time" else worker_largest)(args)
        return
    if args.from_json:
        print(markdown(json.loads(args.from_json.read_text())))
        return
    if args.steps < 10:
        raise SystemExit(f"--steps={args.steps}: the step time is a median of at least 10 steps")
    payload: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "command": sys.argv}
    root = args.nvme_dir
    root.mkdir(parents=True, exist_ok=True)
    args.nvme_dir = Path(tempfile.mkdtemp(prefix="offload_bench_", dir=root))  # concurrent runs do not collide
    try:
        with tempfile.TemporaryDirectory() as work:
            if args.part in ("both", "step_time"):
                payload["step_time"] = step_time_part(args, Path(work))
            if args.part in ("both", "largest"):
                payload["largest"] = largest_part(args, Path(work))
    finally:
        shutil.rmtree(args.nvme_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            root.rmdir()  # only when no other run uses it
    payload["markdown"] = markdown(payload)
    print(payload["markdown"])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
