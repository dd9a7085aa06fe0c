"""What verifying a checkpoint costs each loading rank, before and after [Note: each rank verifies what it reads]
(accelerate_zero/checkpoint/meta.py), on a 70B-shaped checkpoint, from a scaled measurement (issue 31).

Usage:
    .venv/bin/python bench/checkpoint_verify.py                          # 4 files of 512 MiB, sparse, in /tmp
    .venv/bin/python bench/checkpoint_verify.py --file_mib 2048 --files 2 --dir /path/on/the/checkpoint/disk

Writes `--files` sparse files of `--file_mib` MiB (reading a sparse file costs no disk I/O, so this measures the
hashing alone; a real checkpoint adds its disk's read time), reads them once (the page cache), then hashes them with
the engine's own `file_digest` one after the other and with `verify_digests` in parallel threads, best of two each,
and prints the throughput. Then a
70B-parameter model's checkpoint (fp32 masters + Adam's two moments: 12 bytes per parameter, split into one file per
rank of the saving job): the seconds of hashing per loading rank when every rank hashes every file (before) and when
it hashes the files it reads (after: its own, plus rank 0's for the whole tensors), from the measured slope.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

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
    print(f"{args.files} x {args.file_mib} MiB: one thread {serial:.2f} s ({rate:.2f} GB/s), ", end="")
    print(f"{args.files} threads {threaded:.2f} s ({size / threaded / 1e9:.2f} GB/s; {os.cpu_count()} cores)")
    total = 70e9 * 12  # bytes: fp32 masters, exp_avg, exp_avg_sq
    print("70B checkpoint (840 GB), seconds of hashing per loading rank at the saved world size W:")
    print("| W | before: every file | after: own file + rank 0's, one thread | the same, 2 threads |")
    print("| ---: | ---: | ---: | ---: |")
    for world in (8, 64, 512):
        own = total / world / 1e9 / rate
        print(f"| {world} | {total / 1e9 / rate:,.0f} | {2 * own:,.1f} | {own:,.1f} |")


if __name__ == "__main__":
    main()
