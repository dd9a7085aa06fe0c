"""What verifying a checkpoint costs each loading rank, before and after [Note: each rank verifies what it reads]
(accelerate_zero/checkpoint/meta.py), on a 70B-shaped checkpoint, from a scaled measurement (issue 31).

Usage:
    .venv/bin/python bench/checkpoint_verify.py                          # 4 files of 512 MiB, sparse, in /tmp
    .venv/bin/python bench/checkpoint_verify.py --file_mib 2048 --files 2 --dir /path/on/the/checkpoint/disk

Writes `--files` sparse files of `--file_mib` MiB (reading a sparse file costs no disk I/O, so this measures the
hashing alone), hashes them with the engine's `file_digest` one after the other and with `verify_digests` in
threads, best of two each; then, from that rate, a 70B model's checkpoint (bench/README.md, "checkpoint_verify.py").
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from harness import report

from accelerate_zero.checkpoint.meta import file_digest, verify_digests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--file_mib", type=int, default=512)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="verify_", dir=args.dir))
    paths = []
    for rank in range(args.files):
        path = folder / f"rank{rank:05d}.safetensors"
        with open(path, "wb") as file:
            file.truncate(args.file_mib * 2**20)
        paths.append(path)
    size = args.files * args.file_mib * 2**20
    digests = {path.name: file_digest(path) for path in paths}  # warm-up: the page cache gets the files' pages
    serial = threaded = float("inf")
    for _ in range(2):  # best of two, each way
        start = time.perf_counter()
        for path in paths:
            file_digest(path)
        serial = min(serial, time.perf_counter() - start)
        start = time.perf_counter()
        assert not verify_digests(folder, {"files": digests}, paths)
        threaded = min(threaded, time.perf_counter() - start)
    for path in paths:
        path.unlink()
    folder.rmdir()
    rate = size / serial / 1e9  # GB/s on one core
    print(report.header(report.machine_facts(), "checkpoint_verify: hashing a checkpoint on each loading rank"))
    print(f"{args.files} x {args.file_mib} MiB: one thread {serial:.2f} s ({rate:.2f} GB/s), {args.files} threads "
          f"{threaded:.2f} s ({size / threaded / 1e9:.2f} GB/s; {os.cpu_count()} cores)")  # fmt: skip
    total = 70e9 * 12  # bytes: fp32 masters, exp_avg, exp_avg_sq
    print("70B checkpoint (840 GB), seconds of hashing per loading rank at the saved world size W:\n")
    seconds = total / 1e9 / rate
    rows = [(w, f"{seconds:,.0f}", f"{2 * seconds / w:,.1f}", f"{seconds / w:,.1f}") for w in (8, 64, 512)]
    columns = ["W", "before: every file", "after: own file + rank 0's, one thread", "the same, 2 threads"]
    print(report.table(columns, rows, "rrrr"))


if __name__ == "__main__":
    main()
