"""Stage 3 against FSDP2 under gradient accumulation: the peak of every phase of every micro-step (issue 51, item 5).

Usage:
    PYTHONPATH=$PWD .venv/bin/python bench/accum_peaks.py                  # W = 4, fsdp2 and az3, accumulation 1 and 4
    PYTHONPATH=$PWD .venv/bin/python bench/accum_peaks.py --accumulations 4 --systems az3 --json out.json

The workload of stage3_bench.py's accumulation table (harness/models.py): 16 x Linear(1024, 1024), 8 rows
per rank, fp32 AdamW, gloo, one thread per rank, `MALLOC_MMAP_THRESHOLD_=131072`; FSDP2 is `fully_shard` on each
Linear then the root (reshard after forward), accumulating on its default path (a reduce-scatter every micro-step);
az3 is `accelerate_zero.initialize` with models.STAGE3_KEYS (each Linear a unit, released after its forward).
Each (system, accumulation) runs in its own torchrun group. Every phase (the forward and the backward of each
micro-step, the optimizer step) starts by resetting the process's peak RSS (`/proc/self/clear_refs`) and ends by
reading it (`VmHWM`): the exact peak of that phase, not a sampled one. Reported: per phase, the peak minus the
baseline (after imports and the process group, before the model), max over ranks and over the timed steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


BENCH_DIR = Path(__file__).resolve().parent
MB = 1e6


def _peak_since_reset() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


class PhasePeaks:
    """The exact peak RSS of each named phase (the kernel's high-water mark, reset when a phase starts)."""

    def __init__(self, baseline: int) -> None:
        self.baseline, self.peaks, self._name = baseline, {}, None

    def start(self, name: str) -> None:
        self.stop()
        _reset_peak()
        self._name = name

    def stop(self) -> None:
        if self._name is not None:
            peak = _peak_since_reset() - self.baseline
            self.peaks[self._name] = max(self.peaks.get(self._name, peak), peak)
            self._name = None


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from harness.models import LR, build_model, engine_config, make_batch
    from torch import nn

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, accumulation = dist.get_rank(), args.accumulation
    import accelerate_zero  # noqa: F401  (imported before the baseline, as every library)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _reset_peak()
    baseline = _peak_since_reset()
    phases = PhasePeaks(baseline)
    model = build_model()
    x, y = make_batch(rank)
    micro_step: Callable[[int], None]
    if args.system == "fsdp2":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for module in model.modules():
            if isinstance(module, nn.Linear):
                fully_shard(module, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

        def micro_step(micro: int) -> None:
            phases.start(f"forward {micro + 1}")
            loss = nn.functional.mse_loss(model(x), y) / accumulation
            phases.start(f"backward {micro + 1}")
            loss.backward()
            if micro == accumulation - 1:
                phases.start("optimizer")
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        config = engine_config(3, None, accumulation)
        config["zero_optimization"].update(json.loads(args.zero))
        engine = accelerate_zero.initialize(model, optimizer, config=config)

        def micro_step(micro: int) -> None:
            phases.start(f"forward {micro + 1}")
            loss = nn.functional.mse_loss(engine(x), y)
            phases.start(f"backward {micro + 1}")
            engine.backward(loss)
            if micro == accumulation - 1:
                phases.start("optimizer")
            engine.step()

    phases.stop()
    init = _peak_since_reset() - baseline
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            phases.peaks.clear()  # the timed steps only (the first step allocates the optimizer state)
        for micro in range(accumulation):
            micro_step(micro)
        phases.stop()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"rank": rank, "init": init, "peaks": phases.peaks})
    if rank == 0:
        Path(args.out).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


def launch(system: str, accumulation: int, args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCH_DIR), env.get("PYTHONPATH", "")) if p)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.world_size}"]
    command += [__file__, f"--worker={system}", f"--accumulation={accumulation}", f"--out={out}"]
    command += [f"--steps={args.steps}", f"--warmup={args.warmup}", f"--zero={args.zero}"]
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def table(results: dict[tuple[str, int], list[dict[str, Any]]]) -> str:
    columns = sorted({name for ranks in results.values() for r in ranks for name in r["peaks"]}, key=_phase_order)
    lines = [
        "| system | accumulation | " + " | ".join(columns) + " | step peak | / FSDP2 at the same accumulation |",
        "|---|--:|" + "--:|" * (len(columns) + 2),
    ]
    step_peaks = {key: max(max(r["peaks"].values()) for r in ranks) for key, ranks in results.items()}
    for (system, accumulation), ranks in results.items():
        cells = [max((r["peaks"].get(c, 0) for r in ranks), default=0) for c in columns]
        fsdp2 = step_peaks.get(("fsdp2", accumulation))
        ratio = "" if fsdp2 is None else f"{step_peaks[(system, accumulation)] / fsdp2:.3f}"
        text = " | ".join(f"{c / MB:.1f}" if c else "" for c in cells)
        lines.append(f"| {system} | {accumulation} | {text} | {step_peaks[(system, accumulation)] / MB:.1f} | {ratio} |")
    return "\n".join(lines)


def _phase_order(name: str) -> tuple[int, int]:
    kind, _, micro = name.partition(" ")
    return (int(micro) if micro else 99, ["forward", "backward", "optimizer"].index(kind))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--systems", nargs="+", default=["fsdp2", "az3"], choices=["fsdp2", "az3"])
    parser.add_argument("--accumulations", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--world_size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--zero", default="{}", help="az3: zero_optimization keys over models.STAGE3_KEYS (JSON)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--accumulation", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.system = args.worker
        worker(args)
        return
    folder = Path(os.environ.get("TMPDIR", "/tmp")) / f"accum_peaks_{os.getpid()}"
    folder.mkdir(exist_ok=True)
    results = {}
    for accumulation in args.accumulations:
        for system in args.systems:
            results[(system, accumulation)] = launch(system, accumulation, args, folder / f"{system}_{accumulation}.json")
            print(f"{system} accumulation {accumulation}: done (load {os.getloadavg()[0]:.1f})", flush=True)
    print(f"W = {args.world_size}, peak RSS above the baseline per phase (MB, max over ranks and timed steps)\n")
    print(table(results))
    if args.json is not None:
        args.json.write_text(json.dumps({f"{s}@{a}": r for (s, a), r in results.items()}, indent=1))


if __name__ == "__main__":
    main()
