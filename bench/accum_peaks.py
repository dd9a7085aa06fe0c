"""Stage 3 against FSDP2 under gradient accumulation: the peak of every phase of every micro-step (issue 51, item 5).

Usage:
    PYTHONPATH=$PWD .venv/bin/python bench/accum_peaks.py                  # W = 4, fsdp2 and az3, accumulation 1 and 4
    PYTHONPATH=$PWD .venv/bin/python bench/accum_peaks.py --accumulations 4 --systems az3 --json out.json

The workload of stage3_bench.py's accumulation table (harness/models.py): 16 x Linear(1024, 1024), 8 rows per rank,
fp32 AdamW, gloo, one thread per rank, `MALLOC_MMAP_THRESHOLD_=131072`; FSDP2 is `fully_shard` on each Linear then
the root (reshard after forward), accumulating on its default path (a reduce-scatter every micro-step); az3 is
`accelerate_zero.initialize` with `models.STAGE3_KEYS` (each Linear a unit, released after its forward). Each
(system, accumulation) runs on its own fresh ranks (harness/launch.py). Every phase (the forward and the backward of
each micro-step, the optimizer step) starts by resetting the process's peak RSS (`/proc/self/clear_refs`) and ends by
reading it (`VmHWM`): the exact peak of that phase, not a sampled one. Reported: per phase, the peak minus the
baseline (after imports and the process group, before the model), max over ranks and over the timed steps.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import launch, report


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


def train(system: str, accumulation: int, steps: int, warmup: int, zero: str) -> dict[str, Any]:
    """Rank function: `system` trains the stack; the peak of every phase of the timed steps, above the baseline."""
    import torch
    import torch.distributed as dist
    from harness.models import LR, build_model, engine_config, make_batch
    from torch import nn

    rank = dist.get_rank()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import accelerate_zero  # noqa: F401  (imported before the baseline, as every library)

    _reset_peak()
    baseline = _peak_since_reset()
    phases = PhasePeaks(baseline)
    model = build_model()
    x, y = make_batch(rank)
    micro_step: Callable[[int], None]
    if system == "fsdp2":
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
        config["zero_optimization"].update(json.loads(zero))
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
    for step in range(warmup + steps):
        if step == warmup:
            phases.peaks.clear()  # the timed steps only (the first step allocates the optimizer state)
        for micro in range(accumulation):
            micro_step(micro)
        phases.stop()
    return {"rank": rank, "init": init, "peaks": phases.peaks}


def table(results: dict[tuple[str, int], list[dict[str, Any]]]) -> str:
    columns = sorted({name for ranks in results.values() for r in ranks for name in r["peaks"]}, key=_phase_order)
    step_peaks = {key: max(max(r["peaks"].values()) for r in ranks) for key, ranks in results.items()}
    rows = []
    for (system, accumulation), ranks in results.items():
        cells = [max((r["peaks"].get(c, 0) for r in ranks), default=0) for c in columns]
        fsdp2 = step_peaks.get(("fsdp2", accumulation))
        ratio = "" if fsdp2 is None else f"{step_peaks[(system, accumulation)] / fsdp2:.3f}"
        peak = f"{step_peaks[(system, accumulation)] / MB:.1f}"
        rows.append((system, accumulation, *(f"{c / MB:.1f}" if c else "" for c in cells), peak, ratio))
    return report.table(["system", "accumulation", *columns, "step peak", "/ FSDP2 at the same accumulation"], rows)


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
    args = parser.parse_args()
    facts, results = report.machine_facts(), {}
    for accumulation in args.accumulations:
        for system in args.systems:
            kwargs = dict(
                system=system, accumulation=accumulation, steps=args.steps, warmup=args.warmup, zero=args.zero
            )
            ranks = launch.on_ranks(args.world_size, train, kwargs, name=f"{system}_{accumulation}")
            results[(system, accumulation)] = ranks.results
    title = (
        f"accum_peaks: W = {args.world_size}, peak RSS above the baseline per phase (MB, max over ranks, timed steps)"
    )
    print(report.header(facts, title) + "\n\n" + table(results))
    if args.json is not None:
        report.save_json(args.json, {f"{s}@{a}": r for (s, a), r in results.items()}, facts)


if __name__ == "__main__":
    main()
