"""What a checkpoint save costs training, synchronous against `save_checkpoint(..., async_save=True)` ([Note:
asynchronous saves] in accelerate_zero/checkpoint/async_save.py), and the host memory during the write (issue 43).

Usage:
    .venv/bin/python bench/checkpoint_async.py                       # 1 process, stage 1, ~1 min
    .venv/bin/python bench/checkpoint_async.py --width 4096 --layers 4 --batch 1024 --dir /path/on/the/disk

One process (gloo, world size 1) trains an MLP of `--layers` square Linear layers of `--width` with AdamW at stage 1
on `--batch` rows per step (a step: forward, backward, step). In each of `--rounds` rounds it times a step without a
save, the step that starts a synchronous save (the save call plus that step), and the step that starts an
asynchronous one (and the steps while its writer runs), and samples every 5 ms the resident host memory
(/proc/self/status VmRSS) above its level before the save while the save runs; it prints the medians. A synchronous save blocks for all of it; the
asynchronous one for its snapshot (host copies of the masters and Adam's two moments: 12 bytes per parameter).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn

import accelerate_zero
from accelerate_zero.checkpoint import async_save


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class _PeakRss:
    """The highest VmRSS sampled every 5 ms while the block runs (and until `stop`)."""

    def __init__(self) -> None:
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(0.005)

    def start(self) -> _PeakRss:
        self.peak = _rss_bytes()
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


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
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29533"))
    if args.threads:
        torch.set_num_threads(args.threads)
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
    peaks: dict[str, int] = {"sync": 0, "async": 0}
    during: list[float] = []
    for round_ in range(args.rounds):  # interleaved, so that a busy neighbour slows every kind alike
        times["none"].append(_step(engine, x, y))
        for mode in ("sync", "async"):
            base, rss = _rss_bytes(), _PeakRss().start()
            start = time.perf_counter()
            engine.save_checkpoint(folder, tag=f"{mode}{round_}", async_save=mode == "async")
            calls[mode].append(time.perf_counter() - start)
            times[mode].append(calls[mode][-1] + _step(engine, x, y))
            while async_save.in_flight(engine) and not (Path(folder) / f"{mode}{round_}").is_dir():
                during.append(_step(engine, x, y))
            async_save.finish(engine.layout.world)
            peaks[mode] = max(peaks[mode], rss.stop() - base)
            times["none"].append(_step(engine, x, y))
    plain = statistics.median(times["none"])
    print(
        f"model {numel / 1e6:.1f} M parameters, checkpoint {numel * 12 / 2**20:.0f} MiB; batch {args.batch}; ", end=""
    )
    print(f"{torch.get_num_threads()} torch threads on {os.cpu_count()} cores")
    print(
        f"median of {args.rounds} rounds; a step without a save: {plain * 1e3:.0f} ms (median of {len(times['none'])})"
    )
    print(
        "| save | save call | step that starts a save (call + step) | vs a step | host memory above the start, peak |"
    )
    print("|---|---|---|---|---|")
    for mode in ("sync", "async"):
        first = statistics.median(times[mode])
        print(
            f"| {mode} | {statistics.median(calls[mode]) * 1e3:.0f} ms | {first * 1e3:.0f} ms "
            f"| {(first / plain - 1) * 100:+.1f}% | {peaks[mode] / 2**20:.0f} MiB |"
        )
    if during:
        print(
            f"steps while an asynchronous writer ran: {len(during)}, median {statistics.median(during) * 1e3:.0f} ms"
        )
    engine.destroy()


if __name__ == "__main__":
    main()
