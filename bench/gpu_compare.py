"""Offload side by side on one GPU: ours, DeepSpeed and FSDP2 on the same model, batch, precision, clipping and
accumulation, one process each; tokens/s, TFLOPS, device peak per phase against the estimate, host peak, a timeline
of one step (bench/README.md, "Offload side by side on one GPU"; bench/gpu_compare.sh is the prepared session).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import gpu_compare_worker
from harness import launch, models


SYSTEMS = ("ours", "deepspeed", "fsdp2")
MODES = ("none", "cpu", "cpu+param")
ONE_THREAD = "cpu/omp1"  # ours in mode cpu with OMP_NUM_THREADS=1, as torchrun and accelerate launch set it
SYNCHRONOUS = "cpu/sync"  # ours in mode cpu with the host step inside engine.step() (ACCELERATE_ZERO_OVERLAP_STEP=0)
ONE_HOST_THREAD = "cpu/host1"  # ours in mode cpu with ACCELERATE_ZERO_HOST_THREADS=1 ([Note: threads for host work])
VARIANTS = (ONE_THREAD, SYNCHRONOUS, ONE_HOST_THREAD)
DRY_RUN = {
    "hidden": 256,
    "layers": 2,
    "batch": 2,
    "seq": 32,
    "accumulation": 2,
    "steps": 2,
    "vocab": 1024,
    "threads": 1,
}
"""A dry run's tiny model; one thread per run, as it runs two at a time (`main`)."""


def skip_reason(system: str, mode: str) -> str | None:
    """Why `system` does not run `mode` here, or None when it does."""
    if system == "fsdp2" and mode not in ("none", "cpu+param"):
        return "FSDP2 offloads parameters, gradients and the optimizer together (CPUOffloadPolicy = cpu+param) only"
    if system == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed in this Python (bench/gpu_compare.sh installs the wheel)"
    return None


def tag(system: str, run_mode: str) -> str:
    """`system` and `run_mode` as a file name part: ours_cpu_param, ours_cpu_omp1."""
    return f"{system}_{run_mode.replace('+', '_').replace('/', '_')}"


def run_one(args: argparse.Namespace, system: str, run_mode: str) -> dict[str, Any]:
    """One process running `gpu_compare_worker.run`; its result, or a row naming the error or the skip."""
    mode, _, variant = run_mode.partition("/")
    row: dict[str, Any] = {"system": system, "mode": run_mode}
    reason = skip_reason(system, mode)
    if reason is not None:
        return {**row, "skipped": reason}
    timeout = min(args.timeout, int(args.deadline - time.monotonic()))
    if timeout < 20:
        return {**row, "skipped": f"out of time: --budget {args.budget} s spent before this run"}
    threads = 1 if variant == "omp1" else args.threads
    env = {"OMP_NUM_THREADS": str(threads), "ACCELERATE_ZERO_OVERLAP_STEP": "0" if variant == "sync" else "1"}
    env.update({"ACCELERATE_ZERO_HOST_THREADS": "1"} if variant == "host1" else {})
    timeline = str(args.out / f"timeline_{tag(system, run_mode)}") if system in args.timeline_systems else None
    worker = {
        key: getattr(args, key)
        for key in ("hidden", "layers", "batch", "seq", "accumulation", "steps", "nvme_dir", "vocab")
    }
    worker.update(system=system, mode=mode, timeline=timeline, cpu=args.dry_run)
    begin = time.perf_counter()
    try:
        options = dict(name=tag(system, run_mode), out_dir=args.out, env=env, timeout=timeout, threads=threads)
        ranks = launch.on_ranks(1, gpu_compare_worker.run, {"args": worker}, backend="none", **options)
    except launch.LaunchFailed as failed:
        return {**row, "error": str(failed)[-2000:]}
    found = {**ranks.results[0], **row, "wall_seconds": round(time.perf_counter() - begin, 1)}
    if system == "ours":
        predicted = estimate(args, mode)
        found["estimate_gib"] = round((predicted["memory"].device["total"] + predicted["activations"]) / 2**30, 3)
    return found


def estimate(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """The estimator's memory (device, host, disk) and activation bytes of ours in `mode` on this model."""
    from accelerate_zero.config import ZeroConfig
    from accelerate_zero.debug import estimate as est

    config = gpu_compare_worker.llama_config(args.hidden, args.layers, args.seq, args.vocab)
    ds = gpu_compare_worker.deepspeed_config(mode, args.batch, args.accumulation, args.nvme_dir or "/tmp", False)
    zero = ZeroConfig.from_any(ds).zero_optimization
    architecture = est.Architecture(hidden_size=config.hidden_size, num_layers=config.num_hidden_layers,
                                    num_heads=config.num_attention_heads, vocab_size=config.vocab_size)  # fmt: skip
    shapes = est.shapes_from_module(models.llama(config, device="meta"), zero, architecture=architecture)
    memory = est.estimate_stage(shapes, est.TrainingSetup(world_size=1, mixed_precision="bf16", zero=zero), 3, mode)
    activations = est.activation_bytes(architecture, micro_batch=args.batch, seq_len=args.seq, compute_bytes=2)
    return {"memory": memory, "activations": activations, "numel": shapes.numel}


def largest(args: argparse.Namespace) -> None:
    """Prints, per mode, the most layers (at `--hidden`) the estimator says fit 90% of the GPU, 95% of the RAM and
    `--disk_gb` of disk, and what each place would hold."""
    from accelerate_zero.debug import estimate as est

    gib = 2**30
    budget = est.Budget(int(args.gpu_gib * gib * 0.9), int(args.cpu_gib * gib * 0.95), int(args.disk_gb * 1e9))
    for mode in (*MODES, "nvme"):

        def fitting_at(layers: int) -> dict[str, Any] | None:
            args.layers = layers
            predicted = estimate(args, mode)  # noqa: B023 (called at once)
            return predicted if est.fits(predicted["memory"], predicted["activations"], budget) else None

        fitting, low, high = None, 0, 1  # double while it fits, then halve the gap: a few estimates of small models
        while high <= 4096 and (found := fitting_at(high)) is not None:
            fitting, low, high = (high, found), high, 2 * high
        while high - low > 1:
            middle = (low + high) // 2
            found = fitting_at(middle)
            fitting, low, high = ((middle, found), middle, high) if found else (fitting, low, middle)
        if fitting is None:
            print(f"{mode}: no layer count fits")
            continue
        (layers, predicted), memory = fitting, fitting[1]["memory"]
        device = (memory.device["total"] + predicted["activations"]) / gib
        print(f"{mode}: {layers} layers, {predicted['numel'] / 1e9:.2f}B parameters; device {device:.1f} GiB, host "
              f"{memory.host['total'] / gib:.1f} GiB, disk {memory.nvme['total'] / 1e9:.1f} GB")  # fmt: skip


def add_predictions(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """Ours in modes cpu and cpu+param: `accelerate-zero estimate`'s predicted step time from our no-offload step and
    the copy bandwidth and host step rate the same run measured ([Note: the offload step time model] in
    accelerate_zero/debug/step_time.py)."""
    from accelerate_zero.debug.step_time import Measured, offload_step_seconds

    base = next((r for r in rows if r["system"] == "ours" and r["mode"] == "none" and "step_seconds" in r), None)
    for row in rows:
        if base is None or row["system"] != "ours" or row["mode"] not in ("cpu", "cpu+param", SYNCHRONOUS):
            continue
        if "measured" not in row:
            continue
        figures = Measured(base["step_seconds"], row["measured"]["copy_gbps"], row["measured"]["host_rate"])
        mode, _, variant = row["mode"].partition("/")
        row["predicted"] = offload_step_seconds(
            row["numel"], 3, mode, args.accumulation, figures, overlapped=variant != "sync"
        )


def table(args: argparse.Namespace, rows: list[dict[str, Any]]) -> str:
    """The markdown table: one row per (system, mode), with ours against DeepSpeed's tokens/s in the same mode."""
    numel = next((r["numel"] for r in rows if "numel" in r), 0)
    device = next((r["device"] for r in rows if "device" in r), "?")
    head = (
        f"{args.label}: Llama hidden {args.hidden} x {args.layers} layers ({numel / 1e9:.2f}B parameters), bf16, "
        f"clipping 1.0, {args.accumulation} x {args.batch} x {args.seq} tokens per step, 1 process, {device}\n\n"
        "| system | mode | s/step | tokens/s | TFLOPS | x no offload | ours / DeepSpeed | predicted s/step "
        "(pred. / meas.) | device peak GiB (phase) | estimate GiB (est. / meas.) | host peak GiB | step timeline "
        "(busy share) | losses |\n| --- | --- |" + " ---: |" * 9 + " --- | --- |"
    )
    lines = [head]
    by_key = {(r["system"], r["mode"]): r for r in rows}
    for r in rows:
        if "skipped" in r or "error" in r:
            text = r.get("skipped") or r["error"][-300:].replace("\n", " ").replace("|", "/")
            lines.append(f"| {r['system']} | {r['mode']} | {'skipped' if 'skipped' in r else 'error'}: {text} |")
            continue
        base = by_key.get((r["system"], "none"), {})
        slower = f"{r['step_seconds'] / base['step_seconds']:.2f}" if "step_seconds" in base else "-"
        theirs = by_key.get(("deepspeed", r["mode"]), {})
        versus = "-"
        if r["system"] == "ours" and "tokens_per_second" in theirs:
            versus = f"{r['tokens_per_second'] / theirs['tokens_per_second']:.2f}"
        predicted = "-"
        if r.get("predicted") is not None:
            predicted = f"{r['predicted']['total']:.3f} ({r['predicted']['total'] / r['step_seconds']:.2f})"
        phases = r.get("phase_peak_gib") or {"-": r["device_peak_gib"]}
        phase = max(phases, key=lambda name: phases[name] or 0)
        measured, est = phases[phase], r.get("estimate_gib")
        peak = "-" if measured is None else f"{measured} ({phase})"
        versus_estimate = "-" if est is None else f"{est} ({est / measured:.2f})" if measured else f"{est}"
        busy = r.get("timeline", {}).get("busy", {})
        lanes = ", ".join(f"{lane} {share:.0%}" for lane, share in busy.items() if share) or "-"
        lines.append(
            f"| {r['system']} | {r['mode']} | {r['step_seconds']} | {r['tokens_per_second']:.0f} | {r['tflops']} | "
            f"{slower} | {versus} | {predicted} | {peak} | {versus_estimate} | {r['host_peak_gib']} | {lanes} | "
            f"{', '.join(str(v) for v in r['losses'])} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--modes", nargs="+", default=[*MODES, *VARIANTS])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000, help="the Llama's vocabulary (the dry run: 1024)")
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--timeout", type=int, default=150, help="seconds per (system, mode) process")
    parser.add_argument("--budget", type=int, default=3600, help="seconds for all runs; later runs are skipped")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="OMP_NUM_THREADS of the runs")
    parser.add_argument("--timeline_systems", nargs="*", default=["ours"], choices=SYSTEMS)
    parser.add_argument("--nvme_dir", default=None, help="a folder on a local disk for mode nvme")
    parser.add_argument("--label", default="side by side")
    parser.add_argument("--out", type=Path, default=Path("bench/out/gpu_compare"))
    parser.add_argument("--dry_run", action="store_true", help="a tiny model on the CPU (checks the script)")
    parser.add_argument("--largest", action="store_true", help="print the estimator's largest model per mode")
    parser.add_argument("--gpu_gib", type=float, default=139.0, help="for --largest: GPU memory")
    parser.add_argument("--cpu_gib", type=float, default=125.0, help="for --largest: RAM")
    parser.add_argument("--disk_gb", type=float, default=64.0, help="for --largest: free disk for NVMe offload")
    args = parser.parse_args(argv)
    for mode in args.modes:
        if mode not in (*MODES, "nvme", *VARIANTS):
            parser.error(f"--modes {mode!r}: choose from {', '.join((*MODES, 'nvme', *VARIANTS))}")
    if args.dry_run:
        for key, value in DRY_RUN.items():
            setattr(args, key, value)
        args.label = f"dry run ({args.label})"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.largest:
        largest(args)
        return 0
    args.deadline = time.monotonic() + args.budget
    args.out.mkdir(parents=True, exist_ok=True)
    runs = [(system, mode) for mode in args.modes for system in (["ours"] if mode in VARIANTS else args.systems)]
    rows = []
    # On the GPU every run has the machine to itself (its speed is the result); a dry run checks the script and
    # runs two at a time, as its processes each use one core.
    with ThreadPoolExecutor(max_workers=2 if args.dry_run else 1) as pool:
        for row in pool.map(lambda run: run_one(args, *run), runs):
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "timeline"})[:2000], flush=True)
    add_predictions(args, rows)
    settings = {k: str(v) for k, v in vars(args).items()}
    (args.out / "results.json").write_text(json.dumps({"args": settings, "results": rows}, indent=1))
    text = table(args, rows)
    (args.out / "table.md").write_text(text)
    print(text, end="")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
