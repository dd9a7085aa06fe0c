"""The benchmark report: runs four questions at a size that fits a small machine and writes bench/RESULTS.md from
the answers they print (bench/README.md, "Benchmark report").
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from harness import cli, launch, models


BENCH_DIR = Path(__file__).resolve().parent
SYSTEMS = ["ddp", "ddp_zero_r", "az0", "az1", "az2", "az3", "fsdp2", "ds1", "ds2", "ds3"]
FULL_OFFLOAD_RUN = BENCH_DIR / "out" / "offload.json"
"""`offload_bench.py --json` of its last full run: its largest-model part takes hours, longer than the report."""


def sections(hidden: int, layers: int) -> dict[str, tuple[str, list[str], int]]:
    """Section name -> (heading, the question's command line under bench/, seconds before it is cut)."""
    size = ["--hidden", str(hidden), "--layers", str(layers)]
    return {
        "engine": ("The systems compared at W = 4", ["engine_bench.py", "--world_size", "4", "--steps", "12",
                                                      "--systems", *SYSTEMS], 1800),
        "sweep": ("Memory per rank against world size: measured and estimated", ["memory_sweep.py"], 900),
        "offload": ("Offload", ["offload_bench.py", "--part", "step_time", "--steps", "10", *size], 300),
        "trainer": ("The transformers Trainer: DDP, accelerate_zero and DeepSpeed",
                    ["trainer_bench.py", "--rounds", "1", "--steps", "4", "--warmup", "2"], 1200),
    }  # fmt: skip


def report(
    skip: tuple[str, ...] = (),
    hidden: int = 1024,
    layers: int = 8,
    results: Path = BENCH_DIR / "RESULTS.md",
    out_dir: Path = BENCH_DIR / "out" / "report",
    render_only: bool = False,
) -> cli.Answer:
    """Runs the report's questions (each with `--json` into `out_dir`) and writes RESULTS.md from their answers.

    Args:
        skip: sections left out (engine, sweep, offload, trainer).
        hidden: the Linear stack's width (1024; half of engine_bench.py's 16 layers, to fit the time budget).
        layers: the Linear stack's layers.
        results: the page written.
        out_dir: logs and the saved answers.
        render_only: write the page from the answers saved in `out_dir`; run nothing.
    """
    env = dict(os.environ, **{models.SIZE_ENV["hidden"]: str(hidden), models.SIZE_ENV["layers"]: str(layers)})
    parts, seconds = [], {}
    for name, (heading, argv, timeout) in sections(hidden, layers).items():
        if name in skip:
            continue
        saved, command = out_dir / f"{name}.json", f"python bench/{' '.join(argv)}"
        if not render_only:
            print(f"{name}: {command}", flush=True)
            done = launch.run_command([sys.executable, str(BENCH_DIR / argv[0]), *argv[1:], "--json", str(saved)],
                                      log=out_dir / f"{name}.log", env=env, timeout=timeout)  # fmt: skip
            seconds[name] = done.seconds
            if done.code != 0:
                parts.append(f"## {heading}\n\n`{command}`: {done.code}; its log: {out_dir / name}.log")
                continue
        answer = json.loads(saved.read_text())
        parts.append(f"## {heading}\n\n`{command}`\n\n{answer['header']}\n\n{answer['text']}")
    if "offload" not in skip and FULL_OFFLOAD_RUN.exists():
        answer = json.loads(FULL_OFFLOAD_RUN.read_text())
        parts.append(f"### The last full run of offload_bench.py\n\n{answer['header']}\n\n{answer['text']}")
    took = ", ".join(f"{name} {value / 60:.1f}" for name, value in seconds.items())
    intro = ("# Benchmark results\n\nWritten by `python bench/run_report.py` from the answers its questions printed "
             "(what each measures and how: [README.md](README.md)); MB = 10^6 bytes. Compare times only as ratios "
             "within one table: each header gives the machine's load when it ran.")  # fmt: skip
    results.write_text("\n\n".join([intro, *parts]) + "\n")
    return cli.Answer(f"run_report: wrote {results}", f"minutes per section: {took or 'none run'}", seconds)


if __name__ == "__main__":
    sys.exit(cli.main(report))
