"""What a checkpoint save costs training, synchronous against `save_checkpoint(..., async_save=True)` ([Note:
asynchronous saves] in accelerate_zero/checkpoint/async_save.py), and the host memory during the write (issue 43;
bench/README.md, "checkpoint_async.py").

Usage:
    .venv/bin/python bench/checkpoint_async.py                       # 1 process, stage 1, ~1 min
    .venv/bin/python bench/checkpoint_async.py --width 4096 --layers 4 --batch 1024 --dir /path/on/the/disk

In each round, interleaved: a step without a save, the step that starts a synchronous save (the call plus that
step), the one that starts an asynchronous save (and the steps while its writer runs), the resident memory above
its level before the save sampled while the save runs; medians printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from harness import launch, report
from harness.readings import PeakSampler
from torch import nn


def _step(engine: object, x: torch.Tensor, y: torch.Tensor) -> float:
    start = time.perf_counter()
    engine.backward(nn.functional.mse_loss(engine(x), y))
    engine.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    import accelerate_zero
    from accelerate_zero.checkpoint import async_save

    launch.single_process_env()
    if args.threads:
        torch.set_num_threads(args.threads)
    facts = report.machine_facts()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine = accelerate_zero.initialize(model, optimizer, config={"zero_optimization": {"stage": 1}})
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    numel = sum(p.numel() for p in model.parameters())
    for _ in range(2):
        _step(engine, x, y)  # warm-up: optimizer state allocated
    folder = tempfile.mkdtemp(prefix="ckpt_async_", dir=args.dir)
    times: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
    calls: dict[str, list[float]] = {"sync": [], "async": []}
    peaks, during = {"sync": 0, "async": 0}, []
    for round_ in range(args.rounds):  # interleaved, so that a busy neighbour slows every kind alike
        times["none"].append(_step(engine, x, y))
        for mode in ("sync", "async"):
            with PeakSampler(("VmRSS",), interval=0.005) as rss:
                base, start = rss.read()["VmRSS"], time.perf_counter()
                engine.save_checkpoint(folder, tag=f"{mode}{round_}", async_save=mode == "async")
                calls[mode].append(time.perf_counter() - start)
                times[mode].append(calls[mode][-1] + _step(engine, x, y))
                while async_save.in_flight(engine) and not (Path(folder) / f"{mode}{round_}").is_dir():
                    during.append(_step(engine, x, y))
                async_save.finish(engine.layout.world)
            peaks[mode] = max(peaks[mode], rss.peak["VmRSS"] - base)
            times["none"].append(_step(engine, x, y))
    plain = statistics.median(times["none"])
    title = (f"checkpoint_async: {numel / 1e6:.1f} M parameters, checkpoint {numel * 12 / 2**20:.0f} MiB; batch "
             f"{args.batch}; {torch.get_num_threads()} torch threads on {os.cpu_count()} cores")  # fmt: skip
    print(report.header(facts, title))
    print(
        f"median of {args.rounds} rounds; a step without a save: {plain * 1e3:.0f} ms (median of {len(times['none'])})"
    )
    rows = [(mode, f"{statistics.median(calls[mode]) * 1e3:.0f} ms", f"{statistics.median(times[mode]) * 1e3:.0f} ms",
             f"{(statistics.median(times[mode]) / plain - 1) * 100:+.1f}%", f"{peaks[mode] / 2**20:.0f} MiB")
            for mode in ("sync", "async")]  # fmt: skip
    columns = [
        "save",
        "save call",
        "step that starts a save (call + step)",
        "vs a step",
        "host memory above the start, peak",
    ]
    print(report.table(columns, rows, "lllll"))
    if during:
        print(
            f"steps while an asynchronous writer ran: {len(during)}, median {statistics.median(during) * 1e3:.0f} ms"
        )
    engine.destroy()


if __name__ == "__main__":
    main()
